"""Imports point one way: rlspec -> trainers -> rollout. Parsed with ast, so nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> top-level packages it must never import
FORBIDDEN = {"rollout": {"trainers", "rlspec"}, "trainers": {"rlspec"}}


def imported_top_levels(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) for every absolute import in a file, including ones inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def violations(package: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, top in imported_top_levels(path):
            if top in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {top}")
    return bad


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package):
    bad = violations(package)
    assert not bad, f"{package} must not import {sorted(FORBIDDEN[package])}:\n" + "\n".join(bad)


def test_checker_sees_imports_inside_functions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from trainers.grpo import X\n    import rlspec.config\n")
    assert [top for _, top in imported_top_levels(src)] == ["trainers", "rlspec"]


# inside rollout/: engine -> spec -> runtime (the runtime never knows speculation exists)
FORBIDDEN_INSIDE = {"rollout/runtime": ("rollout.spec", "rollout.engine"), "rollout/spec": ("rollout.engine",)}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("folder", sorted(FORBIDDEN_INSIDE))
def test_rollout_subpackages_point_one_way(folder):
    bad = [f"{path.relative_to(ROOT)}:{line} imports {mod}"
           for path in sorted((ROOT / folder).rglob("*.py"))
           for line, mod in imported_modules(path)
           if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN_INSIDE[folder])]
    assert not bad, f"{folder} must not import {FORBIDDEN_INSIDE[folder]}:\n" + "\n".join(bad)
