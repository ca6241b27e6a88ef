"""Imports point one way: rlspec -> rlspec.trainers -> rlspec.rollout. Parsed with ast, so nothing is imported.

rollout/ and trainers/ sit at the repository's top level and are installed as rlspec.rollout and rlspec.trainers
(rlspec/rollout and rlspec/trainers are links to them): the walks below read the real folders, never the links."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINKED = ("rollout", "trainers")  # folder -> package rlspec.<folder>
# folder -> the rlspec sub-packages it may import (everything else under rlspec is above it)
ALLOWED = {"rollout": ("rlspec.rollout",), "trainers": ("rlspec.rollout", "rlspec.trainers")}


def sources(folder: str) -> list[Path]:
    """The .py files of a top-level folder; for rlspec/, without the linked sub-packages."""
    return [p for p in sorted((ROOT / folder).rglob("*.py"))
            if folder != "rlspec" or not any(p.is_relative_to(ROOT / "rlspec" / sub) for sub in LINKED)]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(("rlspec",) * (parts[0] in LINKED) + parts)
    return name.removesuffix(".__init__")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every absolute import in a file, including ones inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _under(mod: str, prefixes) -> bool:
    return any(mod == f or mod.startswith(f + ".") for f in prefixes)


def violations(folder: str) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line} imports {mod}" for path in sources(folder)
            for line, mod in imported_modules(path)
            if mod.split(".")[0] in ("rlspec", *LINKED) and not _under(mod, ALLOWED[folder])]


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_point_one_way(folder):
    bad = violations(folder)
    assert not bad, f"{folder}/ may import only {ALLOWED[folder]} of rlspec:\n" + "\n".join(bad)


def test_checker_sees_imports_inside_functions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from rlspec.trainers.grpo import X\n    import rlspec.config\n")
    assert [mod for _, mod in imported_modules(src)] == ["rlspec.trainers.grpo", "rlspec.config"]


def test_the_linked_folders_refuse_their_bare_names():
    """`import rollout` from the checkout's root would load a second copy of every module beside rlspec.rollout."""
    import subprocess
    import sys
    for folder in LINKED:
        proc = subprocess.run([sys.executable, "-c", f"import {folder}"], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode != 0 and f"import this package as rlspec.{folder}" in proc.stderr, proc.stderr


# inside rollout/, bottom to top: the plain types and rules -> runtime/ -> speculation/ -> lossy/ -> engine.py ->
# the backends (backend.py, workers/, vllm_backend/). A layer imports only layers below it.
BOTTOM = ("types", "errors", "limits", "eos", "registry", "config_checks", "metrics")
ABOVE_RUNTIME = tuple(f"rlspec.rollout.{m}" for m in ("speculation", "lossy", "engine", "backend", "workers",
                                                      "vllm_backend", "nonfinite"))
FORBIDDEN_INSIDE = {
    **{f"rollout/{mod}.py": ("rlspec.rollout.runtime",) + ABOVE_RUNTIME for mod in BOTTOM},
    "rollout/runtime": ABOVE_RUNTIME,
    "rollout/speculation": ABOVE_RUNTIME[1:],
    "rollout/lossy": ABOVE_RUNTIME[2:],
    "rollout/engine.py": ABOVE_RUNTIME[3:6],
}


def _files(where: str) -> list[Path]:
    target = ROOT / where
    return [target] if target.suffix == ".py" else sorted(target.rglob("*.py"))


@pytest.mark.parametrize("where", sorted(FORBIDDEN_INSIDE))
def test_rollout_layers_point_down(where):
    bad = [f"{path.relative_to(ROOT)}:{line} imports {mod}"
           for path in _files(where)
           for line, mod in imported_modules(path)
           if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN_INSIDE[where])]
    assert not bad, f"{where} must not import {FORBIDDEN_INSIDE[where]}:\n" + "\n".join(bad)


# rlspec/bench/ (the benchmarks) is the top layer: it may import everything below, nothing imports it
# (rlspec.bench -> rlspec -> rlspec.trainers -> rlspec.rollout), so a benchmark can never become a dependency of training.
def bench_importers(paths: list[Path]) -> list[str]:
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line} imports {mod}"
            for path in paths for line, mod in imported_modules(path)
            if mod == "rlspec.bench" or mod.startswith("rlspec.bench.")]


def test_benchmarks_sit_above_the_trainers():
    below = [p for folder in ("rollout", "trainers", "rlspec") for p in sources(folder)
             if not p.is_relative_to(ROOT / "rlspec" / "bench")]
    bad = bench_importers(below)
    assert not bad, "nothing outside rlspec/bench may import it:\n" + "\n".join(bad)
    assert any(mod.startswith(("rlspec.trainers", "rlspec.train")) for p in (ROOT / "rlspec" / "bench").rglob("*.py")
               for _, mod in imported_modules(p)), "rlspec/bench drives the trainers (it sits above them)"


def test_bench_checker_sees_a_lazy_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from rlspec.bench.harness import table\n    import rlspec.benchmarks\n")
    assert bench_importers([src]) == [f"{src}:2 imports rlspec.bench.harness"]


def module_graph() -> dict[str, set[str]]:
    """module -> the repo modules it imports (at the top or inside functions), over rollout, trainers, rlspec.
    `from a.b import c` counts as importing a.b.c when that is a module, else a.b."""
    paths = {module_name(p): p for folder in ("rollout", "trainers", "rlspec") for p in sources(folder)}
    graph = {}
    for mod, path in paths.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in paths}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in paths:
                subs = {f"{node.module}.{a.name}" for a in node.names} & paths.keys()
                deps |= subs or {node.module}
        graph[mod] = deps - {mod}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    """No two modules import each other, directly or around a loop, even through an import inside a function
    (a lazy import hides a circle from Python, not from a reader)."""
    cycles = import_cycles(module_graph())
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_sees_a_lazy_circle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
