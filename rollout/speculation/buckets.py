"""Live-batch buckets: a decode step's costs are kept per power of two of its live batch (1, 2, 4, ...).

A step's cost grows slowly with the rows within one power of two, so one figure per bucket serves every batch in
it. Every table keyed by batch (the ledger's costs, drafting, plain-step times; calibration) uses `bucket`.
"""
from __future__ import annotations


def bucket(rows: int) -> int:
    """The power of two at or above `rows` (1 for 0 or 1 rows)."""
    return 1 << max(rows - 1, 0).bit_length()


def reachable_buckets(rows: int) -> list[int]:
    """The buckets live batches of 1..rows fall in: 1, 2, 4, ... bucket(rows) (60 rows reach bucket 64)."""
    return [1 << i for i in range(bucket(rows).bit_length())]


def nearest_bucket(known, b: int) -> int:
    """The bucket of `known` closest to b in powers of two, the smaller on a tie: an unmeasured bucket borrows
    its figures."""
    return min(known, key=lambda k: (abs(k.bit_length() - b.bit_length()), k))
