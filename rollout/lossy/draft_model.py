"""A smaller model with the target's tokenizer as a step source (step_source=draft_model=<dir>).

It drafts whole steps for Arbitrage routing: per sequence, the model's own KV cache (transformers'
DynamicCache) holds the context it has read; a proposal feeds the new context tokens, then writes
up to `cap` tokens one at a time, each the argmax of the draft model's distribution processed like
the target's (temperature, top-k, top-p). A step is thus a point mass given the context, which is
what keeps the recorded law of a routed step exact (docs/lossy.md#the-exact-behaviour-law): the
router keeps or rejects a step by its content, and the law of a sampled step under that choice
would need a sum over every step the model could write. Afterwards the cache is cropped back to the context, since
the engine may reject the draft. One sequence at a time: simple, and the draft
model is meant to be several times cheaper than the target.
"""
from __future__ import annotations

import torch

from rlspec.rollout.runtime.model.loader import hf_cache_arg
from rlspec.rollout.speculation.drafters.base import Draft


class DraftModelSource:
    name = "draft_model"

    def __init__(self, path: str, target_tokenizer, target_vocab: int, device, dtype):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        check_same_tokenizer(path, tok, target_tokenizer, target_vocab)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        self._cache_arg = hf_cache_arg(self.model)
        self.vocab = target_vocab
        self._caches: dict[int, tuple[object, int]] = {}  # id(seq) -> (DynamicCache, tokens it holds)

    def start(self, params, generator) -> None:
        """A new call: forget the last call's sequences (steps are argmax chains: no sampling state)."""
        self._caches.clear()

    @torch.inference_mode()
    def propose(self, seqs, caps: list[int], boundary) -> list[Draft]:
        return [self._one(s, cap, boundary) if cap > 0 else Draft() for s, cap in zip(seqs, caps)]

    def _one(self, seq, cap: int, boundary) -> Draft:
        from transformers import DynamicCache

        ctx = seq.all_ids()
        cache, held = self._caches.get(id(seq), (DynamicCache(), 0))
        dev = next(self.model.parameters()).device
        feed = torch.tensor([ctx[held:]], device=dev)
        tokens = []
        for _ in range(cap):
            logits = self.model(input_ids=feed, **{self._cache_arg: cache}, use_cache=True).logits[0, -1].float()
            logits = _to_vocab(logits, self.vocab)
            # the processed law's argmax: top-k/top-p keep the most likely token, so this is logits' argmax
            x = int(logits.argmax())
            tokens.append(x)
            feed = torch.tensor([[x]], device=dev)
            if boundary.closes(tokens[-2] if len(tokens) > 1 else ctx[-1], x):
                break
        extra = cache.get_seq_length() - len(ctx)  # drafted tokens fed back: they may be rejected
        if extra > 0:
            cache.crop(-extra)  # transformers' crop: a negative count removes that many from the end
        self._caches[id(seq)] = (cache, len(ctx))
        return Draft.chain(tokens)

    def finish(self, seq) -> None:
        self._caches.pop(id(seq), None)


def _to_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The draft model's logits over the target's vocabulary: padding rows cut, missing ids at -inf."""
    if logits.shape[-1] >= vocab:
        return logits[:vocab]
    return torch.cat([logits, logits.new_full((vocab - logits.shape[-1],), float("-inf"))])


def check_same_tokenizer(path: str, tok, target_tokenizer, target_vocab: int) -> None:
    """A draft token id must mean the same text to the target: the vocabularies must be identical."""
    if target_tokenizer is not None:
        same = tok.get_vocab() == target_tokenizer.get_vocab()
    else:
        same = len(tok) <= target_vocab
    if not same:
        raise ValueError(f"step_source=draft_model={path}: its tokenizer differs from the target's (different "
                         "vocabulary), so its token ids would mean other text to the target; pick a draft model "
                         "of the same family (e.g. Qwen2.5-0.5B for Qwen2.5-7B, SmolLM2-135M for SmolLM2-1.7B)")
