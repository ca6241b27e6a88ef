"""A built wheel works outside the checkout: the recipes resolve by name and the CPU kernels build.

A wheel that shipped the kernels' .cpp files without the headers they include, and no configs/, installed
fine and then quietly ran every fused CPU path off and could not find grpo_math.yaml. Here the package is
built into a wheel (`pip wheel --no-deps --no-build-isolation`, from a copy of the sources, so the checkout
gets no build/ folder), installed with `pip install --no-deps --target` into a temporary folder, and used from
another directory by this venv's Python, whose dependencies it shares."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rlspec.config import load_config, resolve_config_path
from rlspec.rollout.runtime.model import kernels

REPO = Path(__file__).resolve().parents[1]
KERNELS = "rollout/runtime/model/kernels"
SHIPPED = ("pyproject.toml", "README.md", "configs", "rlspec", "trainers", "rollout")

# Run from the installed copy: where each package came from, the default recipe, and the kernels' state.
PROBE = """
import json, sys
import rlspec, rlspec.rollout as rollout
from rlspec.config import load_config, resolve_config_path
from rlspec.rollout.runtime.model import kernels
cfg = load_config("grpo_math.yaml", ["grpo.max_steps=1"])
print(json.dumps(dict(rlspec=rlspec.__file__, rollout=rollout.__file__, recipe=str(resolve_config_path("grpo_math")),
                      model=cfg.model, max_steps=cfg.grpo.max_steps,
                      cpu=kernels.cpu_has_avx512_bf16(), kernels=kernels.available(),
                      top_levels=sorted(p.name for p in __import__("pathlib").Path(rlspec.__file__).parents[1].iterdir()
                                        if (p / "__init__.py").exists()))))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel built from this checkout, installed into a folder of its own; returns that folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SHIPPED:
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy2
        kwargs = dict(symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")) \
            if copy is shutil.copytree else {}
        copy(REPO / name, src / name, **kwargs)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                   check=True, cwd=tmp, timeout=300)
    (wheel,) = (tmp / "dist").glob("rlspec-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", str(tmp / "site"), str(wheel)],
                   check=True, cwd=tmp, timeout=300)
    (tmp / "elsewhere").mkdir()
    return tmp


def test_the_wheel_ships_the_kernel_headers_and_the_recipes(installed):
    (wheel,) = (installed / "dist").glob("rlspec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for p in kernels.SOURCES + kernels.HEADERS:
        assert f"rlspec/{KERNELS}/{p.name}" in names
    assert {n.split("/")[0] for n in names if n.endswith(".py")} == {"rlspec"}  # one top-level package
    for recipe in (REPO / "configs").rglob("*.yaml"):
        assert f"rlspec/configs/{recipe.relative_to(REPO / 'configs').as_posix()}" in names


def test_installed_outside_the_checkout_it_loads_the_default_recipe_and_builds_the_kernels(installed):
    env = dict(os.environ, PYTHONPATH=str(installed / "site"))  # ahead of the venv's editable checkout
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=installed / "elsewhere", env=env, capture_output=True,
                          text=True, timeout=900)  # 900: the first kernel build on a loaded machine
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    site = installed / "site"
    for key in ("rlspec", "rollout", "recipe"):
        assert Path(got[key]).is_relative_to(site), (key, got[key])  # the installed copy, not the checkout's
    assert (got["model"], got["max_steps"]) == (load_config("grpo_math.yaml").model, 1)
    assert got["top_levels"] == ["rlspec"], got["top_levels"]  # installs exactly one package
    built_from, there = installed / "src" / KERNELS, site / "rlspec" / KERNELS
    for p in kernels.SOURCES + kernels.HEADERS:  # every source and header there, byte for byte
        assert (there / p.name).read_bytes() == (built_from / p.name).read_bytes(), p.name
    assert got["kernels"] == got["cpu"], proc.stderr[-3000:]  # built (or found built) wherever the CPU can


def test_a_recipe_resolves_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here: the package's own copy answers
    assert resolve_config_path("grpo_math.yaml").read_bytes() == (REPO / "configs" / "grpo_math.yaml").read_bytes()
