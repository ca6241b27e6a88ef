"""Whether a checkpoint without rlspec's completion marker is whole enough to resume from.

A checkpoint written by an older rlspec or by plain HF/TRL has no rlspec_complete.json, so nothing says it
was finished. resume=auto skips such directories (it cannot tell them from a save cut short); named
explicitly (`resume=<dir>`, `train(resume_from_checkpoint=<dir>)`) one is resumed when its files verify:

- trainer_state.json parses and names a global_step (the data position);
- the weights are there (model.safetensors, the shards an index names, pytorch_model.bin, or a PEFT
  adapter), and every *.safetensors file is as long as its header says (a copy cut short is not);
- the optimizer and scheduler states are there (or DeepSpeed's global_step*/ folder), so the resume
  continues the optimizer rather than restarting it; every torch file (*.pt, *.pth, *.bin) is a whole zip
  archive (torch.save's format ends with the archive's directory: a truncated file has none).

Plain files, no torch: the CLI checks before any heavy import.
"""
from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

WEIGHTS = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")
INDEX = "model.safetensors.index.json"


def checkpoint_problems(path: str | Path) -> list[str]:
    """What keeps the checkpoint directory from being resumed (empty: its files verify)."""
    path = Path(path)
    if not path.is_dir():
        return [f"{path} is not a directory"]
    problems = _trainer_state_problems(path) + _weights_problems(path) + _optimizer_problems(path)
    for f in sorted(path.iterdir()):
        if f.suffix == ".safetensors":
            problems += _safetensors_problems(f)
        elif f.suffix in (".pt", ".pth", ".bin") and f.is_file() and not zipfile.is_zipfile(f):
            problems.append(f"{f.name} is not a whole torch file (cut short?)")
    return problems


def _trainer_state_problems(path: Path) -> list[str]:
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except OSError:
        return ["no trainer_state.json (the step and data position)"]
    except ValueError:
        return ["trainer_state.json is not valid JSON (cut short?)"]
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        return ["trainer_state.json names no global_step"]
    return []


def _weights_problems(path: Path) -> list[str]:
    if any((path / name).is_file() for name in WEIGHTS):
        return []
    if (path / INDEX).is_file():
        try:
            shards = set(json.loads((path / INDEX).read_text())["weight_map"].values())
        except (ValueError, KeyError, AttributeError):
            return [f"{INDEX} is not a valid index"]
        return [f"the weight shard {s} that {INDEX} names is missing" for s in sorted(shards)
                if not (path / s).is_file()]
    return [f"no model weights ({', '.join(WEIGHTS)} or {INDEX})"]


def _optimizer_problems(path: Path) -> list[str]:
    if any(p.is_dir() for p in path.glob("global_step*")):  # DeepSpeed keeps optimizer and scheduler there
        return []
    missing = [n for n in ("optimizer.pt", "scheduler.pt") if not (path / n).is_file()]
    if "optimizer.pt" in missing and (path / "optimizer.bin").is_file():
        missing.remove("optimizer.pt")
    return [f"no {n} (a resume would restart the optimizer and learning-rate schedule)" for n in missing]


def _safetensors_problems(f: Path) -> list[str]:
    """A safetensors file is an 8-byte header length, a JSON header with each tensor's byte range, the data."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size:
                return [f"{f.name} is cut short (its header is longer than the file)"]
            header = json.loads(fh.read(n))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return [f"{f.name} has no readable safetensors header (cut short?)"]
    if size < 8 + n + max(ends, default=0):
        return [f"{f.name} is cut short ({size} bytes, its header needs {8 + n + max(ends)})"]
    return []
