"""Small helpers for speculation state in checkpoints (Speculation.state_dict and what it calls).

A state is plain Python values and CPU tensors, so that torch.save writes it and
torch.load(weights_only=True) reads it back. Token histories are many short int arrays: they are
packed into one int32 tensor plus a list of lengths (one tensor per document made checkpoints of a
long run's suffix history slow to write and read).
"""
from __future__ import annotations

from array import array

import torch


def pack_arrays(arrays: list) -> dict:
    """Int token arrays (array("i") or lists) -> {"flat": int32 tensor, "lengths": [int]}."""
    lengths = [len(a) for a in arrays]
    flat = array("i")
    for a in arrays:
        flat.extend(a)
    return {"flat": torch.tensor(flat, dtype=torch.int32) if flat else torch.zeros(0, dtype=torch.int32),
            "lengths": lengths}


def unpack_arrays(packed: dict) -> list[array]:
    """pack_arrays(...) -> the arrays, as array("i")."""
    flat = array("i", packed["flat"].tolist())
    out, at = [], 0
    for n in packed["lengths"]:
        out.append(flat[at:at + n])
        at += n
    return out


def cpu_clone(obj):
    """obj with every tensor replaced by a detached CPU copy (lists, tuples and dicts walked)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_clone(x) for x in obj)
    if isinstance(obj, dict):
        return {k: cpu_clone(v) for k, v in obj.items()}
    return obj


def mismatch(what: str, saved, here, fix: str) -> str:
    """One line of a 'does not fit' error: what differs, both values, and how to fix it."""
    return f"{what}: {saved!r} in the checkpoint, {here!r} in this engine ({fix})"
