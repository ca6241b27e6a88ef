"""Shared bits of the benchmark scripts: the embedded math prompts, JSON output, a plain table, step timing.

Imports nothing heavy at module level (torch only inside the timing helpers), so the GPU check can
use it on a machine without TRL or W&B."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere


def math_prompts(tokenizer, n: int, seed: int = 0, max_operand: int = 9, ops=("+",)) -> list[list[int]]:
    """Chat-templated token ids of the embedded arithmetic problems (the default run's data)."""
    from trainers.data import make_math_dataset, prompt_token_ids

    return prompt_token_ids(tokenizer, make_math_dataset(num_examples=n, seed=seed, max_operand=max_operand,
                                                         ops=ops)["prompt"])


def write_json(path: str, payload: dict) -> None:
    text = json.dumps(payload, indent=2)  # first: a payload that fails to encode must not truncate the file
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}")


def table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(fmt(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)


def line_plot(series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str, title: str, path: str) -> None:
    """One line per named series of (x, y) points, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, pts in series.items():
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def sync(device) -> None:
    """Wait for queued GPU work, so wall-clock time covers it (a no-op on CPU)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def time_steps(run, tokens, start, iters: int, device, warmup: int = 2) -> float:
    """Seconds per `run(tokens, start)` after `warmup` untimed calls (they capture, for a graph pool)."""
    import time

    for _ in range(warmup):
        run(tokens, start)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        run(tokens, start)
    sync(device)
    return (time.perf_counter() - t0) / iters
