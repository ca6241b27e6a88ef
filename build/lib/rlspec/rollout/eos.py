"""The one EOS rule: which token ids end a completion. The engine, the Ray workers, the vLLM backend and
PPO all ask `resolve_eos`, so a completion ends at the same token whichever backend wrote it.

The ids are the model's generation_config.eos_token_id (what `model.generate` stops on; chat models often
list several, such as an end-of-turn and an end-of-text token), then the tokenizer's eos_token (what TRL
masks completions after), then any extra ids the caller names (PPO's stop_token_id), in that order and
without repeats. For the usual chat checkpoints the tokenizer's EOS is already among the generation
config's, so the union only matters for a checkpoint whose two files disagree, where stopping at either
is what both readers of the completion expect.
"""
from __future__ import annotations

from collections.abc import Iterable


def resolve_eos(source=None, tokenizer=None, extra: Iterable[int | None] = ()) -> list[int]:
    """EOS ids. source: a model (its generation_config), a model directory (its generation_config.json, if any)
    or None; tokenizer: anything with eos_token_id, or None; extra: more stop ids (None entries ignored)."""
    ids = list(_generation_eos(source))
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    ids += [i for i in extra if i is not None]
    return list(dict.fromkeys(int(i) for i in ids))


def _generation_eos(source) -> list[int]:
    if source is None:
        return []
    if isinstance(source, str):
        from transformers import GenerationConfig

        try:
            eos = GenerationConfig.from_pretrained(source).eos_token_id
        except OSError:  # no generation_config.json: the tokenizer's EOS decides
            eos = None
    else:
        eos = getattr(getattr(source, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
