"""StepLayout: the columns of a decode step's one host transfer, written and read in this one place.

A tree step (N nodes per row, padded) sends, per row,

    [accepted, path (N), emitted (N + 1), logprobs (N + 1), finite, verifier columns]

a chain step the same without the path (it is 1..accepted), and a plain step (N = 0: no row drafted) only
[emitted, logprob, finite, verifier columns]: its accepted count is 0 and its path empty. Columns past a row's
accepted count carry nothing the host reads. `emitted` are the accepted drafts and the token after them, `logprobs` their target logprobs,
`finite` a number that is finite exactly when every logit the row used is (their float64 sum: any NaN or inf makes
it NaN or inf; it also makes cat pack every column as float64), and the verifier columns what a lossy verifier wants
back (its token sources and behaviour logprobs, rollout/speculation/strategies.py). A chain step launched ahead
(rollout/chains_ahead.py) sends its rows' draft counts after them, which the device worked out (`drafted`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from rlspec.rollout.runtime.transfers import Pending, Transfers
from rlspec.rollout.speculation.strategies import Provenance


@dataclass
class HostStep:
    """A decode step's result on the host, per row: accepted drafts, their node path (-1 after; None for a chain or
    a plain step, whose accepted node j is draft j), the emitted tokens (accepted drafts + the one after) and their
    target logprobs; provenance from a lossy verifier."""

    accepted: list[int]
    path: list[list[int]] | None
    tokens: list[list[int]]
    lps: list[list[float]]
    provenance: Provenance | None = None

    @property
    def kept(self) -> list[bool]:
        """Rows whose whole drafted step a router kept."""
        return self.provenance.kept if self.provenance is not None else [False] * len(self.accepted)


class StepLayout:
    """The transfer layout of a step of N draft nodes per row (module docstring); `of(N, tree)` gives the one
    instance per shape."""

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def of(N: int, tree: bool = False) -> "StepLayout":
        return StepLayout(N, tree)

    def __init__(self, N: int, tree: bool = False):
        self.N, self.P = N, N if tree else 0  # P: path columns sent (a tree's only)
        self.flag = 2 if N == 0 else 2 * N + 3 + self.P  # the finite flag's column
        self.extra = self.flag + 1  # where the verifier's columns start

    def send(self, funnel: Transfers, accepted: torch.Tensor | None, path: torch.Tensor | None,
             emitted: torch.Tensor, lps: torch.Tensor, flags: torch.Tensor, columns=()) -> Pending:
        """Pack the step's device columns into the funnel's one device-to-host transfer."""
        if self.N == 0:
            return funnel.to_host(emitted, lps, flags, *columns)
        if self.P == 0:
            return funnel.to_host(accepted[:, None], emitted, lps, flags, *columns)
        return funnel.to_host(accepted[:, None], path, emitted, lps, flags, *columns)

    @staticmethod
    def finite(logits: torch.Tensor) -> torch.Tensor:
        """The finite column from the logits [B, n, V] the rows used: [B] float64."""
        return logits.sum((1, 2), dtype=torch.float64)

    @staticmethod
    def chain_finite(logits: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
        """The finite column of a chain step from its logits [B, N+1, V]: nodes 0..accepted, the ones it used."""
        return logits.sum(-1, dtype=torch.float64).cumsum(-1).gather(1, accepted[:, None])

    def bad_rows(self, rows: list[list[float]]) -> list[int]:
        """Rows whose finite column says a logit was NaN or inf."""
        col, isfinite = self.flag, math.isfinite
        return [i for i, r in enumerate(rows) if not isfinite(r[col])]

    def columns(self, rows: list[list[float]]) -> list[list[float]]:
        """The verifier's columns of each row."""
        return [r[self.extra:] for r in rows]

    def drafted(self, rows: list[list[float]]) -> list[int]:
        """A looked-ahead chain step's draft counts per row (its one column after the flag: a lean call's verifier
        sends none)."""
        col = self.extra
        return [int(r[col]) for r in rows]

    def read(self, rows: list[list[float]]) -> HostStep:
        """Host rows -> accepted, path, emitted tokens and logprobs per row (the tokens and logprobs up to the accepted
        count's: the columns past it carry nothing)."""
        N, P = self.N, self.P
        if N == 0:
            B = len(rows)
            return HostStep([0] * B, None, [[int(r[0])] for r in rows], [[r[1]] for r in rows])
        accepted = [int(r[0]) for r in rows]
        path = [list(map(int, r[1:1 + P])) for r in rows] if P else None
        t, lp = 1 + P, 2 + N + P  # where the emitted tokens and their logprobs start
        return HostStep(accepted, path, [list(map(int, r[t:t + a + 1])) for r, a in zip(rows, accepted)],
                        [r[lp:lp + a + 1] for r, a in zip(rows, accepted)])
