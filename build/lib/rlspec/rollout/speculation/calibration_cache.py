"""Calibrated forward costs, measured once per machine, model and runner mode and cached on disk.

`CostModel.calibrate` times dummy forwards: seconds per engine, in every process that builds one. What
they measure depends on the machine (CPU model, cores and torch threads, or the CUDA device), the
model's shape and dtype, how the runner executes a step (eager, compiled, fused with its kernels' build,
CUDA graphs), torch's version and the sizes timed, not on the weights' values or on the run asking.
`Speculation.calibrate` therefore keys the table by all of those (`calibration_key`) and keeps it as JSON in

    $RLSPEC_CACHE (default ~/.cache/rlspec) / calibration / <sha256 of the key>.json

A later engine with the same key loads it instead of timing (buckets the file lacks, e.g. a larger
max_num_seqs, are timed and added). Only calibration is cached: real steps refine each engine's own
copy (EMA), and one run's load should not steer the next run's start.

RLSPEC_CALIBRATION_CACHE: `off` times every engine afresh (the test suite sets it, so that each test
sees what its own engine measured); a directory puts the files there instead. A file that cannot be
read or does not hold this key's table is ignored with a warning and rewritten.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from dataclasses import fields
from pathlib import Path

import torch

from rlspec.rollout.runtime.model.fetch import cache_root

log = logging.getLogger(__name__)


def cache_file(key: dict) -> Path | None:
    """Where the table of `key` lives; None when the cache is off."""
    where = os.environ.get("RLSPEC_CALIBRATION_CACHE", "")
    if where.lower() == "off":
        return None
    folder = Path(where).expanduser() if where else cache_root() / "calibration"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return folder / f"{digest}.json"


def calibration_key(runner, sizes: list[int], context: int) -> dict:
    """Everything a calibrated table depends on (see the module docstring), as plain values."""
    cfg = runner.model.cfg
    model = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name != "hf_config"}
    return {"machine": machine_fingerprint(runner.device), "torch": torch.__version__,
            "model": hashlib.sha256(json.dumps(model, sort_keys=True, default=str).encode()).hexdigest(),
            "dtype": str(runner.dtype), "steps": type(runner.steps).__name__, "graph_mode": runner.graph_mode,
            "compiled": bool(runner.compiled), "compiled_rows": getattr(runner.steps, "max_rows", None),
            "fused": fused_steps(runner),
            "sizes": sorted(set(sizes)), "context": int(context)}


def fused_steps(runner) -> str | None:
    """The fused CPU step's kernel build when the runner's steps run fused (model/fused.py), else None."""
    from rlspec.rollout.runtime.model import fused, kernels

    return kernels.source_digest() if getattr(runner.steps, "fused", None) is not None and fused.enabled else None


def machine_fingerprint(device) -> dict:
    """The CUDA device's name and capability, or the CPU's model, core count and torch's thread count."""
    device = torch.device(device)
    if device.type == "cuda":
        return {"cuda": torch.cuda.get_device_name(device), "capability": list(torch.cuda.get_device_capability(device)),
                "cuda_version": torch.version.cuda}
    return {"cpu": _cpu_model(), "arch": platform.machine(), "cores": os.cpu_count(),
            "threads": torch.get_num_threads()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_table(key: dict) -> dict[tuple[int, int], float]:
    """The cached table of `key` ({} when there is none, the cache is off or the file is unusable)."""
    path = cache_file(key)
    if path is None or not path.is_file():
        return {}
    try:
        saved = json.loads(path.read_text())
        if saved["key"] != key:
            raise ValueError("it holds another key's table")
        return {(int(b), int(t)): float(s) for b, t, s in saved["table"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the calibration cache file %s (%s); calibrating again", path, exc)
        return {}


def save_table(key: dict, table: dict[tuple[int, int], float]) -> None:
    """Write the table for later engines (atomically: a concurrent reader never sees half a file)."""
    path = cache_file(key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "table": [[b, t, s] for (b, t), s in sorted(table.items())]}))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home must not stop a rollout
        log.warning("could not write the calibration cache file %s (%s)", path, exc)
