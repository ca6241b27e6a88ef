"""What the device check needs that a GPU machine lacks, prepared here for its run to carry (`make gpu-carry`).

The GPU machine has a CUDA torch, transformers and pytest but no registry and no hub, so the `e2e` section (TRL's
GRPOTrainer against ours) needs, under `.cache/gpu_carry/` (an ignored path: name it in the run's carried paths):

- `tokenizer/`: the embedded model's tokenizer files, from the rlspec cache (`make model`);
- `site/`: TRL, datasets, dill and multiprocess, the versions installed here, unpacked from wheels built for the
  GPU machine's Python (3.12 on the H100 and H200 images so far). They are pure Python, so unpacking a wheel is its
  installation (no scripts or compiled parts to place), and the machine's own pip is not needed. The image has the
  rest of their dependencies (pyarrow, xxhash, fsspec, huggingface-hub, accelerate; report.json's `packages`).

    python -m rlspec.bench.gpucheck.carry                      # .cache/gpu_carry/ for a Python 3.12 machine
    python -m rlspec.bench.gpucheck.carry --python-version 3.11 --wheels ~/wheels   # wheels already downloaded
"""
from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

CARRY = Path(".cache") / "gpu_carry"
PACKAGES = ("trl", "datasets", "dill", "multiprocess")  # what the e2e section imports that the image lacks
TOKENIZER_FILES = ("tokenizer*", "chat_template.jinja", "special_tokens_map.json")


def pins(packages=PACKAGES) -> list[str]:
    """`name==version` of each package as installed here: the machine runs the versions the suite tested."""
    out = []
    for name in packages:
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is not installed here, so its version is unknown: "
                             "run `make venv` first") from None
    return out


def download(requirements: list[str], dest: Path, python_version: str) -> list[Path]:
    """The wheels of `requirements` for a manylinux x86-64 machine running `python_version`, without dependencies."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--dest", str(dest), "--python-version", python_version,
                    "--platform", "manylinux2014_x86_64", "--only-binary=:all:", "--no-deps", *requirements],
                   check=True)
    return wheels_for(requirements, dest)


def wheels_for(requirements: list[str], folder: Path) -> list[Path]:
    """One wheel in `folder` per requirement (`name==version`), or an error naming the ones missing."""
    found, missing = [], []
    for req in requirements:
        name, version = req.split("==")
        hits = sorted(folder.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        if hits:
            found.append(hits[-1])
        else:
            missing.append(req)
    if missing:
        raise SystemExit(f"no wheel in {folder} for {', '.join(missing)}: download them (without --wheels) or "
                         "put them there")
    return found


def check_pure(wheels: list[Path]) -> None:
    """Only pure-Python wheels are unpacked: one with compiled code needs the GPU machine's own pip."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            if any(n.endswith((".so", ".pyd")) for n in zf.namelist()):
                raise SystemExit(f"{wheel.name} holds compiled code: it must be installed for the GPU machine's "
                                 "platform by its own pip, not unpacked")


def unpack(wheels: list[Path], site: Path) -> None:
    """Install pure-Python wheels into `site` by unpacking them (what pip does for a purelib wheel)."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)


def tokenizer_files(model_dir: Path) -> list[Path]:
    files = [f for pattern in TOKENIZER_FILES for f in model_dir.glob(pattern) if f.is_file()]
    if not any(f.name == "tokenizer_config.json" for f in files):
        raise SystemExit(f"no tokenizer in {model_dir}: run `make model` first")
    return files


def prepare(carry: Path, model_dir: Path, python_version: str, wheels: Path | None = None) -> dict:
    """Make `carry` anew (tokenizer/ and site/), in a folder beside it that replaces it once whole: a failure
    leaves the carry made before. Returns what went in."""
    requirements = pins()
    tokenizer = tokenizer_files(model_dir)
    found = wheels_for(requirements, wheels) if wheels else download(requirements, carry.parent / "gpu_wheels",
                                                                     python_version)
    check_pure(found)  # before anything is written: a refusal leaves nothing half made
    new = carry.with_name(carry.name + ".new")
    shutil.rmtree(new, ignore_errors=True)
    (new / "tokenizer").mkdir(parents=True)
    for f in tokenizer:
        shutil.copy2(f, new / "tokenizer" / f.name)
    unpack(found, new / "site")
    shutil.rmtree(carry, ignore_errors=True)
    new.rename(carry)
    size = sum(f.stat().st_size for f in carry.rglob("*") if f.is_file())
    return {"packages": requirements, "wheels": [w.name for w in found], "bytes": size}


def main(argv=None) -> None:
    from rlspec.rollout.runtime.model.fetch import fetch_embedded

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=CARRY, help=f"the carried folder (default {CARRY})")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python (its wheels' tags)")
    p.add_argument("--wheels", type=Path, default=None, help="a folder holding the wheels already (no download)")
    args = p.parse_args(argv)
    done = prepare(args.out, fetch_embedded(), args.python_version, args.wheels)
    print(f"{args.out}: tokenizer/ and site/ ({', '.join(done['packages'])}), {done['bytes'] / 2**20:.1f} MiB; "
          f"carry it with the run (docs/gpu.md)")


if __name__ == "__main__":
    main()
