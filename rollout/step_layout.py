"""StepLayout: the columns of a decode step's one host transfer, written and read in this one place.

A step with drafts (N nodes per row, padded) sends, per row,

    [accepted, path (N), emitted (N + 1), logprobs (N + 1), finite, verifier columns]

and a plain step (N = 0: no row drafted) only [emitted, logprob, finite, verifier columns]: its accepted count is 0
and its path empty. `emitted` are the accepted drafts and the token after them, `logprobs` their target logprobs,
`finite` the row's "every logit the step used is finite" flag (rollout/nonfinite.py), and the verifier columns what
a lossy verifier wants back (its token sources and behaviour logprobs, rollout/speculation/strategies.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlspec.rollout.runtime.transfers import Pending, Transfers
from rlspec.rollout.speculation.strategies import Provenance


@dataclass
class HostStep:
    """A decode step's result on the host, per row: accepted drafts, their node path (-1 after), the emitted tokens
    (accepted drafts + the one after) and their target logprobs; provenance from a lossy verifier."""

    accepted: list[int]
    path: list[list[int]]
    tokens: list[list[int]]
    lps: list[list[float]]
    provenance: Provenance | None = None

    @property
    def kept(self) -> list[bool]:
        """Rows whose whole drafted step a router kept."""
        return self.provenance.kept if self.provenance is not None else [False] * len(self.accepted)


class StepLayout:
    """The transfer layout of a step of N draft nodes per row (module docstring)."""

    def __init__(self, N: int):
        self.N = N
        self.flag = 2 if N == 0 else 3 * N + 3  # the finite flag's column
        self.extra = self.flag + 1  # where the verifier's columns start

    def send(self, funnel: Transfers, accepted: torch.Tensor | None, path: torch.Tensor | None,
             emitted: torch.Tensor, lps: torch.Tensor, flags: torch.Tensor, columns=()) -> Pending:
        """Pack the step's device columns into the funnel's one device-to-host transfer."""
        if self.N == 0:
            return funnel.to_host(emitted, lps, flags, *columns)
        return funnel.to_host(accepted[:, None], path, emitted, lps, flags, *columns)

    def flags(self, rows: list[list[float]]) -> list[float]:
        return [r[self.flag] for r in rows]

    def columns(self, rows: list[list[float]]) -> list[list[float]]:
        """The verifier's columns of each row."""
        return [r[self.extra:] for r in rows]

    def read(self, rows: list[list[float]]) -> HostStep:
        """Host rows -> accepted, path, emitted tokens and logprobs per row."""
        N = self.N
        if N == 0:
            return HostStep([0] * len(rows), [[] for _ in rows], [[int(r[0])] for r in rows], [[r[1]] for r in rows])
        return HostStep([int(r[0]) for r in rows], [[int(x) for x in r[1:1 + N]] for r in rows],
                        [[int(x) for x in r[1 + N:2 + 2 * N]] for r in rows], [r[2 + 2 * N:3 + 3 * N] for r in rows])
