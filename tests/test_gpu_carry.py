"""`make gpu-carry` (rlspec/bench/gpucheck/carry.py): the device check's carried folder, built from wheels of the
versions installed here and the embedded model's tokenizer; what it cannot build is an error that says why."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import zipfile

import pytest

from rlspec.bench.gpucheck import carry


def _wheel(folder, name: str, version: str, tag: str = "py3-none-any", extra: str | None = None):
    """A pure-Python wheel of `name` whose module says where it came from (extra: one more file, e.g. a .so)."""
    path = folder / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}/__init__.py", f"ORIGIN = 'carried {version}'\n")
        zf.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {name}\nVersion: {version}\n")
        if extra:
            zf.writestr(extra, b"\0")
    return path


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json", "model.safetensors"):
        (d / f).write_text("{}")
    return d


def test_the_carry_holds_the_installed_versions_unpacked_and_the_tokenizer(tmp_path, model_dir):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    versions = {name: importlib.metadata.version(name) for name in carry.PACKAGES}
    for name, version in versions.items():
        _wheel(wheels, name, "0.0.1")  # another version beside it: not the one taken
        _wheel(wheels, name, version, tag="py312-none-any" if name == "multiprocess" else "py3-none-any")
    out = tmp_path / "gpu_carry"
    (out / "site" / "stale").mkdir(parents=True)  # a carry made before is replaced, not added to
    done = carry.prepare(out, model_dir, "3.12", wheels)
    assert done["packages"] == [f"{n}=={v}" for n, v in versions.items()]
    assert sorted(p.name for p in (out / "tokenizer").iterdir()) == ["chat_template.jinja", "tokenizer.json",
                                                                     "tokenizer_config.json"]
    assert not (out / "site" / "stale").exists()
    # the carried packages import from site/ alone, at the installed versions
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import trl, multiprocess; "
             "print(trl.ORIGIN, multiprocess.ORIGIN)")
    got = subprocess.run([sys.executable, "-c", probe, str(out / "site")], capture_output=True, text=True, check=True)
    assert got.stdout.split() == ["carried", versions["trl"], "carried", versions["multiprocess"]]


def test_what_cannot_be_carried_is_an_error_that_says_why(tmp_path, model_dir):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    versions = {name: importlib.metadata.version(name) for name in carry.PACKAGES}
    for name in ("trl", "datasets", "dill"):
        _wheel(wheels, name, versions[name])
    with pytest.raises(SystemExit, match=f"no wheel in .* for multiprocess=={versions['multiprocess']}"):
        carry.prepare(tmp_path / "c1", model_dir, "3.12", wheels)
    _wheel(wheels, "multiprocess", versions["multiprocess"], extra="multiprocess/_speedups.so")
    (tmp_path / "c2" / "site").mkdir(parents=True)  # a carry made before stays as it was
    with pytest.raises(SystemExit, match="holds compiled code"):
        carry.prepare(tmp_path / "c2", model_dir, "3.12", wheels)
    assert [p.name for p in (tmp_path / "c2").iterdir()] == ["site"] and not (tmp_path / "c2.new").exists()
    (model_dir / "tokenizer_config.json").unlink()
    with pytest.raises(SystemExit, match="no tokenizer in .*make model"):
        carry.prepare(tmp_path / "c3", model_dir, "3.12", wheels)
    with pytest.raises(SystemExit, match="not installed here"):
        carry.pins(("no-such-package-rlspec",))
