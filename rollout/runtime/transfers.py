"""Transfers: the one funnel every host <-> device copy of the decode loop goes through.

Host to device (`to_device`): a step's small index tensors (pending tokens and cache lengths, drafts, block-table
updates) are written into a staging buffer on the host and copied without blocking. On CUDA the staging buffers are
pinned (a copy from pageable memory blocks the host until it is done) and come from a small ring, each slot reused
only once the copy that read it has finished; elsewhere the host tensor is the device tensor and nothing is copied.
The code path is the same on every device.

Device to host (`to_host`): a step's one transfer, its columns packed side by side as float64 (which holds token ids
and float32 logprobs exactly) and copied without blocking into a pinned buffer; `Pending.rows()` waits for that copy
only when the host reads it, so whatever the host does in between overlaps the device's work.

`counts` tells how many copies of each kind went through (tests/rollout/test_transfer_funnel.py).
"""
from __future__ import annotations

import itertools
from array import array
from collections import Counter

import torch

RING = 4  # staging slots per shape: a slot is written again only after its copy completed (an event per slot)
_CODES = {torch.long: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d"}  # array typecodes


def host_tensor(values, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list of numbers, or a list of equally long lists, as a host tensor. Packed through array's buffer, which
    is 3-4x as fast as torch.tensor reading the lists element by element (a tree step's layout at batch 64: 1,700
    integers). Anything else (deeper, ragged, empty, a non-integer for an integer type) goes to torch.tensor, which
    converts it or says what is wrong."""
    code = _CODES.get(dtype)
    if code is not None and values:
        first = values[0]
        try:
            if not isinstance(first, (list, tuple)):
                return torch.frombuffer(array(code, values), dtype=dtype)
            n = len(first)
            if n and all(map(n.__eq__, map(len, values))):  # (C loops: no call a row)
                flat = array(code, itertools.chain.from_iterable(values))
                return torch.frombuffer(flat, dtype=dtype).view(len(values), n)
        except TypeError:  # a list inside a row, or a float for an integer type
            pass
    return torch.tensor(values, dtype=dtype)


class Pending:
    """A device-to-host copy in flight; rows() waits for it and returns the host rows (a list per row)."""

    __slots__ = ("buf", "event")

    def __init__(self, buf: torch.Tensor, event=None):
        self.buf, self.event = buf, event

    def rows(self) -> list[list[float]]:
        if self.event is not None:
            self.event.synchronize()
        return self.buf.tolist()


class Transfers:
    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.counts: Counter = Counter()  # "h2d", "h2d_blocking", "d2h"
        self._slots: dict[tuple, list] = {}  # (direction, shape, dtype) -> ring of [pinned buffer, event or None]
        self._turn: Counter = Counter()

    def to_device(self, values, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """A host list (nested for 2-D) or tensor as a tensor on the device, copied without blocking."""
        host = values if isinstance(values, torch.Tensor) else host_tensor(values, dtype)
        self.counts["h2d"] += 1
        if not self.cuda:
            return host
        slot = self._slot("h2d", tuple(host.shape), host.dtype)
        slot[0].copy_(host)
        out = slot[0].to(self.device, non_blocking=True)
        slot[1] = torch.cuda.Event()
        slot[1].record()
        return out

    def to_host(self, *columns: torch.Tensor) -> Pending:
        """The step's one device-to-host transfer: [B, *] columns side by side as float64 [B, C], in flight."""
        cols = list(columns)
        if torch.float64 not in [c.dtype for c in cols]:  # cat and stack promote to the widest input: make it float64
            cols[0] = cols[0].to(torch.float64)
        if len(cols) > 1 and all(c.dim() == 1 for c in cols):  # a plain step's [B] columns: one op
            packed = torch.stack(cols, 1)
        else:
            cols = [c if c.dim() == 2 else c.reshape(c.shape[0], -1) for c in cols]
            packed = torch.cat(cols, 1) if len(cols) > 1 else cols[0]
        self.counts["d2h"] += 1
        if packed.device.type != "cuda":
            return Pending(packed)
        slot = self._slot("d2h", tuple(packed.shape), packed.dtype)  # read (rows()) long before the ring comes round
        slot[0].copy_(packed, non_blocking=True)
        slot[1] = torch.cuda.Event()
        slot[1].record()
        return Pending(slot[0], slot[1])

    def _slot(self, way: str, shape: tuple, dtype: torch.dtype) -> list:
        """The next pinned staging slot of this direction and shape, waiting for the copy that last used it (rarely
        still pending: RING copies ago)."""
        key = (way, shape, dtype)
        ring = self._slots.setdefault(key, [])
        if len(ring) < RING:
            ring.append([torch.empty(shape, dtype=dtype, pin_memory=True), None])
            return ring[-1]
        k = self._turn[key] = (self._turn[key] + 1) % RING
        slot = ring[k]
        if slot[1] is not None:
            slot[1].synchronize()
        return slot


def host_rows(*columns: torch.Tensor) -> list[list[float]]:
    """Columns packed and read at once, outside a decode loop's funnel (tests, tools): the same packing."""
    return Transfers(columns[0].device).to_host(*columns).rows()
