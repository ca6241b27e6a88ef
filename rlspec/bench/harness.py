"""The shared harness of `python -m rlspec.bench <name>`: common flags, alternated arms, medians and one-run
ratios, runs in child processes, the JSON report (stamped with the day, the source's commit where it is a git
checkout, and the machine), the PNG and the printed table.

Benchmarks run from a checkout or from an installed wheel alike: reports go under the working directory's
bench_out/, children import rlspec from where this process did, and git is optional (a wheel's commit is
"unknown").

Stdlib only at import (matplotlib inside `png`), so `--help` stays fast and a benchmark may set process limits
(RLIMIT_AS) before torch loads.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the folder rlspec is imported from: a checkout, or site-packages
UNKNOWN = "unknown"
COMMON_FLAGS = ("--smoke", "--out", "--reps", "--seed")


def add_common_flags(parser: argparse.ArgumentParser, name: str) -> None:
    """--smoke, --out, --reps, --seed, each unless the benchmark defined its own."""
    have = parser._option_string_actions  # the flags add_arguments already declared
    if "--smoke" not in have:
        parser.add_argument("--smoke", action="store_true",
                            help="tiny shapes, a few seconds: checks the benchmark runs end to end (no figure)")
    if "--out" not in have:
        parser.add_argument("--out", default=None,
                            help=f"JSON report path (default bench_out/{name}.json; with --smoke "
                                 f"outputs/bench_smoke/{name}.json, so a smoke run never replaces a figure)")
    if "--reps" not in have:
        parser.add_argument("--reps", type=int, default=3, help="repetitions of each arm (alternated; medians)")
    if "--seed" not in have:
        parser.add_argument("--seed", type=int, default=0, help="sampling / data seed")


def default_out(args: argparse.Namespace, name: str) -> str:
    """The report path: --out, else bench_out/<name>.json under the working directory (outputs/bench_smoke/ for
    a smoke run)."""
    if getattr(args, "out", None):
        return str(args.out)
    folder = "outputs/bench_smoke" if getattr(args, "smoke", False) else "bench_out"
    return str(Path.cwd() / folder / f"{name.replace('-', '_')}.json")


def child_env(extra: dict | None = None, path: list[str] | None = None) -> dict:
    """This process's environment for a child that imports rlspec from where this one did (ROOT first on its
    PYTHONPATH, after `path`), plus `extra`."""
    parts = [*(path or []), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, **(extra or {}), "PYTHONPATH": os.pathsep.join(p for p in parts if p)}


def source_state() -> dict:
    """{"commit", "dirty"} of the tree rlspec is imported from, where that is a git checkout's root and git is
    installed; {"commit": "unknown", "dirty": None} otherwise (an installed wheel, a copied tree). Changed figures
    under bench_out/ (what benchmarks write) do not make the tree dirty: the code is what a figure is dated by."""
    def git(*cmd: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", str(ROOT), *cmd], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if not top or Path(top).resolve() != ROOT:  # site-packages inside some repository is not its source
        return {"commit": UNKNOWN, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench_out")
    return {"commit": git("rev-parse", "--short", "HEAD") or UNKNOWN, "dirty": None if status is None else bool(status)}


def rotation(items: list, k: int) -> list:
    """`items` starting at position k (mod their count): repetition k measures them in this order, so a machine
    that drifts during a repetition does not always favour the same arm."""
    k %= max(len(items), 1)
    return items[k:] + items[:k]


def alternate(arms: dict, reps: int, say=None) -> dict[str, list]:
    """Call every arm (name -> fn(rep) -> value) once per repetition, in rotating order; {name: [values]}.
    `say(name, rep, value)` after each call reports progress."""
    runs: dict[str, list] = {name: [] for name in arms}
    for rep in range(reps):
        for name in rotation(list(arms), rep):
            runs[name].append(arms[name](rep))
            if say is not None:
                say(name, rep, runs[name][-1])
    return runs


def medians(runs: dict[str, list[float]]) -> dict[str, float]:
    """The median of each arm's repetitions."""
    return {name: statistics.median(values) for name, values in runs.items() if values}


def ratios(runs: dict[str, list[float]], base: str) -> dict[str, list[float]]:
    """Per repetition, each arm over `base` measured in the same repetition (a one-run ratio: the two halves are
    seconds apart, so machine drift between repetitions cancels); the median of these is the figure to quote."""
    return {name: [v / b for v, b in zip(values, runs[base])] for name, values in runs.items() if name != base}


class ChildRuns:
    """Runs of one benchmark, each in a fresh process (imports, threads and allocator start clean for every arm):
    the parent `spawn`s `python -m rlspec.bench <name> --child <spec as JSON>`; the child, seeing --child,
    `serve`s it: runs fn(spec) and prints the result after the benchmark's mark, which the parent reads."""

    def __init__(self, name: str):
        self.name, self.mark = name, f"{name.upper().replace('-', '_')}_RESULT "

    @staticmethod
    def add_flag(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one run's settings (JSON)

    def serve(self, args: argparse.Namespace, fn) -> dict | None:
        """In a child (--child given): fn(spec) printed for the parent, returned as a report with no plot; None
        in the parent."""
        if not getattr(args, "child", None):
            return None
        result = fn(json.loads(args.child))
        print(self.mark + json.dumps(result), flush=True)
        return {**result, "no_plot": True}

    def spawn(self, spec: dict, what: str) -> dict:
        """One run in a fresh process: the result its child printed; `what` names the run in the error."""
        cmd = [sys.executable, "-m", "rlspec.bench", self.name, "--child", json.dumps(spec), "--out", os.devnull]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(self.mark)), None)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(line[len(self.mark):])


def timed(fn) -> tuple[object, float]:
    """(fn(), wall seconds)."""
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


def table(rows: list[dict], cols: list[str] | None = None) -> str:
    """`rows` as aligned text columns (floats to 3 decimals, missing cells blank); cols default to the first
    row's keys whose values are scalars."""
    if not rows:
        return "(no rows)"
    cols = cols or [k for k, v in rows[0].items() if not isinstance(v, (dict, list, tuple))]

    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))

    widths = [max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in cols]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)


def provenance(name: str, argv: list[str]) -> dict:
    """What dates a figure: the day (UTC), the commit the code was at (+dirty; "unknown" outside a checkout), the
    command and the machine."""
    return {"benchmark": name, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            **source_state(),
            "command": "python -m rlspec.bench " + " ".join([name, *argv]),
            "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                        # other processes on a shared machine skew timings: record how busy it was
                        "loadavg_1m": round(os.getloadavg()[0], 2)}}


def write_json(path: str, payload: dict) -> None:
    """Write `payload` as indented JSON (creating the folder) and say so."""
    text = json.dumps(payload, indent=2, default=str)  # first: a payload that fails to encode must not truncate
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}", flush=True)


def png_path(json_path: str) -> str:
    return str(Path(json_path).with_suffix(".png"))


@contextmanager
def png(path: str, *grid: int, dpi: int = 120, **subplots_kw):
    """`(fig, axes)` of matplotlib's subplots(*grid, **subplots_kw) on the file-only Agg backend; when the block
    ends the figure is laid out, saved at `path` and announced."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*grid, **subplots_kw)
    yield fig, axes
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    print(f"wrote {path}")


def line_plot(series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str, title: str, path: str) -> None:
    """One line per named series of (x, y) points, saved as a PNG."""
    with png(path, figsize=(6, 3.5)) as (fig, ax):
        for name, pts in series.items():
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if len(series) > 1:
            ax.legend()
        ax.grid(alpha=0.3)


def finish(module, args: argparse.Namespace, report: dict, argv: list[str]) -> dict:
    """Stamp the report, print its table (report["rows"], columns report["columns"]), write the JSON and, where
    the benchmark draws one (module.plot(report, path)), the PNG beside it."""
    report = {**provenance(module.NAME, argv), "args": _jsonable(vars(args)), **report}
    if report.get("rows"):
        print(table(report["rows"], report.get("columns")))
    write_json(args.out, report)
    plot = getattr(module, "plot", None)
    if plot is not None and not report.get("no_plot"):
        plot(report, png_path(args.out))
    return report


def _jsonable(d: dict) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items() if not callable(v)}
