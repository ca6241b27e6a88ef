"""A tokenizer for the tiny random models whose vocabulary holds step delimiters, and engine builders."""
from __future__ import annotations

from tests.conftest import TINY_VOCAB

STEP, NEWLINE = 5, 6  # token 5 is "\n\n" (closes a step alone); 6 is "\n" (two in a row close one)


class TinyTokenizer:
    """Just what the lossy modes read from a tokenizer: the text of every token id."""

    eos_token_id = 2

    def __len__(self) -> int:
        return TINY_VOCAB

    def text(self, i: int) -> str:
        return {STEP: "\n\n", NEWLINE: "\n"}.get(i, chr(ord("a") + i % 26))

    def batch_decode(self, ids: list[list[int]]) -> list[str]:
        return ["".join(self.text(i) for i in row) for row in ids]

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(TINY_VOCAB)}


def lossy_engine(hf, drafter, k: int = 4, **spec_fields):
    """An engine over `hf` whose every step drafts with `drafter` (a forced chain arm of depth k)."""
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.model import loader
    from rlspec.rollout.speculation.selectors.base import Arm
    from rlspec.rollout.types import SpecConfig

    spec = SpecConfig(drafter="ngram", num_draft_tokens=k, **spec_fields)
    eng = RolloutEngine(loader.from_hf_model(hf), TinyTokenizer(), spec=spec, eos_token_ids=[2], drafter=drafter)
    eng.speculation.force(Arm(drafter.name, k, 1))
    return eng
