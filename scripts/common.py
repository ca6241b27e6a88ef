"""Shared bits of the benchmark scripts: the command line, the embedded math task, JSON, tables and PNGs,
and the `rlspec.train` runs the end-to-end benchmarks compare.

Importing it puts the repository on sys.path (every script imports it first, so it runs from anywhere).
Imports nothing heavy at module level (matplotlib, transformers and the repo's packages only inside the
helpers), so the GPU check can use it on a machine without TRL or W&B. Building engines and timing them:
bench_engine.py."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere


def parser(doc: str) -> argparse.ArgumentParser:
    """The script's argument parser, described by the first paragraph of its module docstring `doc`."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0])


def math_task(tokenizer, n: int, seed: int = 0, max_operand: int = 9,
              ops=("+",)) -> tuple[list[list[int]], list[str]]:
    """(chat-templated prompt token ids, answers) of `n` embedded arithmetic problems (the default run's data)."""
    from trainers.data import make_math_dataset, prompt_token_ids

    data = make_math_dataset(num_examples=n, seed=seed, max_operand=max_operand, ops=ops)
    return prompt_token_ids(tokenizer, data["prompt"]), list(data["answer"])


def math_prompts(tokenizer, n: int, seed: int = 0, max_operand: int = 9, ops=("+",)) -> list[list[int]]:
    """Chat-templated token ids of the embedded arithmetic problems (the default run's data)."""
    return math_task(tokenizer, n, seed, max_operand, ops)[0]


def write_json(path: str, payload: dict) -> None:
    """Write `payload` as indented JSON (creating the folder) and say so."""
    text = json.dumps(payload, indent=2)  # first: a payload that fails to encode must not truncate the file
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}", flush=True)


def table(rows: list[dict], cols: list[str]) -> str:
    """`rows` as aligned text columns `cols` (floats to 3 decimals, missing cells blank)."""
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(fmt(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)


@contextmanager
def png(path: str, *grid: int, dpi: int = 120, **subplots_kw):
    """`(fig, axes)` of matplotlib's subplots(*grid, **subplots_kw) on the file-only Agg backend; when the
    block ends the figure is laid out, saved as a PNG at `path` and announced."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*grid, **subplots_kw)
    yield fig, axes
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
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


def summary_of(out: Path) -> dict | None:
    """The summary.json `rlspec.train` wrote in the run directory `out`, or None where there is none (yet)."""
    path = Path(out) / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def train_run(tag: str, out: Path, config: str, steps: int, overrides: list[str]) -> dict:
    """`python -m rlspec.train config=<config> grpo.max_steps=<steps> output_dir=<out> <overrides>` from the
    repo root, in a process of its own (W&B and threads start clean), the command echoed after `[tag]`;
    returns the run's summary.json."""
    cmd = [sys.executable, "-m", "rlspec.train", f"config={config}", f"grpo.max_steps={steps}", f"output_dir={out}",
           *overrides]
    print(f"[{tag}]", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return json.loads((Path(out) / "summary.json").read_text())


def rollout_seconds(summary: dict) -> float:
    """Seconds a finished run spent in its rollout phases (the per-step rows of its summary.json)."""
    return sum(r.get("rollout_s") or 0 for r in summary["rows"])
