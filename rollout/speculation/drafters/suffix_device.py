"""Suffix drafts where suffix has evidence, the device n-gram lookup's for every other row (`drafter: suffix_device`).

A verify pads every row to the step's longest draft (draft_batch.py), so in a step where any row drafts, a row the
suffix drafter leaves empty runs the verify's nodes anyway. This drafter fills such rows with the device lookup's
chain (ngram_device.py: the row's own and its siblings' texts), which costs the host one lookup for the whole batch
and the verify nothing more. A row suffix drafts for keeps suffix's draft, cut as suffix cuts it. Over two epochs
of GRPO-shaped rollouts (`python -m rlspec.bench drafter --part replay`, bench_out/drafter_replay.json) a draft at
every position would be accepted for 0.289 / 0.247 tokens a position against suffix's 0.226 / 0.211.

Chains only (the device lookup's). Both drafters' histories are this drafter's checkpoint state.
"""
from __future__ import annotations

from rlspec.rollout.runtime.sequence import Sequence
from rlspec.rollout.speculation.drafters.base import DRAFTERS, Draft, DraftTensors
from rlspec.rollout.speculation.drafters.ngram_device import DeviceNgramDrafter
from rlspec.rollout.speculation.drafters.suffix import SuffixDrafter


class SuffixDeviceDrafter:
    name = "suffix_device"

    def __init__(self, suffix: SuffixDrafter | None = None, device: DeviceNgramDrafter | None = None):
        self.suffix = suffix or SuffixDrafter()
        self.device = device or DeviceNgramDrafter()

    @property
    def graph_mode(self) -> str:
        """The device lookup's graph mode (ngram_device.py)."""
        return self.device.graph_mode

    @graph_mode.setter
    def graph_mode(self, mode: str) -> None:
        self.device.graph_mode = mode

    def graph_set(self):
        return self.device.graph_set()

    # ---- the engine's hooks: both drafters hear of every sample ----------------------------------
    def start(self, seqs, cache, params=None, generator=None, history=None) -> None:
        self.device.start(seqs, cache, params, generator, history)

    def begin(self, groups: list[list[Sequence]]) -> None:
        self.suffix.begin(groups)
        self.device.begin(groups)

    def finish(self, seq: Sequence) -> None:
        self.suffix.finish(seq)
        self.device.finish(seq)

    def abandon(self, seq: Sequence) -> None:
        self.suffix.abandon(seq)
        self.device.abandon(seq)

    def settle(self) -> None:
        self.suffix.settle()

    def state_dict(self) -> dict:
        return {"suffix": self.suffix.state_dict(), "device": self.device.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.suffix.load_state_dict(state["suffix"])
        self.device.load_state_dict(state["device"])

    def propose(self, seqs: list[Sequence], max_tokens: list[int], width: int) -> list[Draft]:
        return self.propose_tensors(seqs, max_tokens, width).to_drafts()

    def propose_tensors(self, seqs: list[Sequence], max_tokens: list[int], width: int) -> DraftTensors:
        """Suffix's chain for each row it drafts for, the device lookup's (max_tokens[i] tokens) for the others."""
        looked = self.device.propose_tensors(seqs, max_tokens, 1)
        drafts = self.suffix.propose(seqs, max_tokens, 1)
        mine = [i for i, d in enumerate(drafts) if len(d)]
        if not mine:
            return looked
        D = looked.ids.shape[2]  # >= every suffix draft: both are at most max(max_tokens)
        rows = self.device.cache.ints([[i, *drafts[i].tokens, *[0] * (D - len(drafts[i]))] for i in mine])
        ids = looked.ids.clone()
        ids[rows[:, 0], 0] = rows[:, 1:]
        caps = list(max_tokens)
        for i in mine:
            caps[i] = len(drafts[i])
        return DraftTensors(ids, None, caps)


@DRAFTERS.register("suffix_device", learned=False, auto=False, chains_only=True)
def _build(target=None, spec=None, **overrides) -> SuffixDeviceDrafter:
    """Model-free; chains only (SpecConfig.tree_width 1, `make_drafter` checks). overrides: `suffix` and `device`,
    the SuffixDrafter's and DeviceNgramDrafter's keyword arguments."""
    return SuffixDeviceDrafter(SuffixDrafter(**overrides.get("suffix", {})),
                               DeviceNgramDrafter(**overrides.get("device", {})))
