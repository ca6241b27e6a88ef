"""The one table of dtype names a user may write (configs, CLI flags, the export format), and their torch dtypes.

Plain Python at import (torch is imported when a name is turned into a dtype), so config parsing and
`rlspec.export`'s argument parser stay light.
"""
from __future__ import annotations

NAMES = ("bfloat16", "float16", "float32")  # the canonical names, as torch spells them
ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def dtype_name(dtype) -> str:
    """The canonical name of a torch dtype or a name ("bf16", "torch.float16", "float32", ...)."""
    key = str(dtype).removeprefix("torch.").lower()
    key = ALIASES.get(key, key)
    if key not in NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(NAMES)} "
                         f"(or {', '.join(sorted(ALIASES))})")
    return key


def as_dtype(dtype):
    """torch dtype from a torch dtype or a name (dtype_name)."""
    import torch

    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype_name(dtype))
