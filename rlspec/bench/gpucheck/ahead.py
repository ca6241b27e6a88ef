"""Compile ahead: the kernels the measuring sections will launch, compiled while the CUDA tests run.

The first launch of each variant of our Triton kernels compiles it (~1 s of the host's each: compiles.py), and
the sections meet dozens: `plain` alone ~30 (five products at two pipeline depths, attention, rotation and the
activation, per model shape). On the GPU the core's tests take two minutes of captures, small steps and checks
that leave most of the host's cores idle. So the check starts, beside them, one child that runs the measuring
sections after them in their light form (presets.AHEAD: one repetition, no transformers baseline), with the same
code path, shapes and batches: its launches compile what the sections' own children will meet, into Triton's and
Inductor's caches on disk, which every process on the machine reads. It is stopped when the tests end, wherever
it got to; what it built stays built. Its figures are thrown away (they ran beside the tests); the report keeps
what it did (`ahead`: its sections, how it ended, the compiles its log lists), and each section's
`triton_compiles` says how many it still built itself (`built`)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from rlspec.bench.gpucheck import compiles

SECTIONS = ("plain", "spec_costs", "contexts", "oracle")  # what compiles: profile and e2e meet plain's kernels


class Ahead:
    """The compile-ahead child, running until `stop`."""

    def __init__(self, proc: subprocess.Popen, log, names: list[str]):
        self.proc, self.log, self.names, self.t0 = proc, log, names, time.perf_counter()

    def stop(self) -> dict:
        """Stop the child (if it still runs) and say what it did: its sections, how it ended, its seconds and the
        compiles its log lists (how many, how many built rather than loaded from disk, their seconds)."""
        running = self.proc.poll() is None
        if running:
            os.killpg(self.proc.pid, 9)
        self.proc.wait()
        self.log.close()
        status = "stopped" if running else \
            "finished" if self.proc.returncode == 0 else f"failed (exit {self.proc.returncode})"
        log = Path(self.log.name)
        return dict(sections=self.names, status=status, seconds=round(time.perf_counter() - self.t0, 2),
                    triton_compiles=compiles.logged(log.read_text(errors="replace")), log=log.name)


def start(args, folder: Path, child) -> Ahead | None:
    """Start the compile-ahead child over the asked sections that compile (None: none asked); child: gpu.child,
    which starts a section's child. Its results go to folder/ahead/, its log to folder/ahead.log."""
    names = [n for n in args.sections if n in SECTIONS]
    if not names:
        return None
    out = folder / "ahead"
    out.mkdir(parents=True, exist_ok=True)
    log = open(folder / "ahead.log", "w")
    return Ahead(child(names, args, out, log, [], ahead=True), log, names)
