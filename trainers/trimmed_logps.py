"""TRL's per-token log-probabilities without the completions' padding (SpecGRPOTrainer's passes over a batch).

TRL pads every completion of a batch to the batch's longest and runs the policy over all of it, twice a step (the
old-logprob pass and the loss's forward and backward). In a long-tail GRPO batch, where one sample runs to the cap
and the rest stop at a third of it, most of that work is padding. A causal model's outputs at a position do not
depend on later positions, so cutting padding off the right changes nothing for the real tokens: rows are sorted by
completion length and split into chunks, each run by TRL's own method only up to its longest completion, and the
results are laid back at full width, zeros past each row's end (what TRL's masked labels give there).
"""
from __future__ import annotations

import torch

CHUNK_OVERHEAD_TOKENS = 256  # one more forward call's fixed cost, in tokens of work: split only when it saves more
PASS_FLAGS = ("compute_entropy", "compute_aux_loss")  # TRL's pass options that are not the model's inputs


def text_only(kwargs: dict, ignore: tuple = PASS_FLAGS) -> bool:
    """Whether a call of TRL's pass carries only text: every keyword argument not in `ignore` None (no pixel values,
    image grids, token types...), and no MoE auxiliary loss asked for."""
    return not kwargs.get("compute_aux_loss") and all(v is None for k, v in kwargs.items() if k not in ignore)


def plan_chunks(lengths: list[int], prompt_len: int, max_rows: int | None = None) -> list[list[int]]:
    """Rows (indices into lengths) in chunks of similar completion length: the split of the rows sorted longest
    first into runs that minimises the tokens computed (rows x (prompt_len + the run's longest)) plus
    CHUNK_OVERHEAD_TOKENS a run; no run longer than max_rows."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n, cap = len(order), max_rows or len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j rows of `order`
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(max(0, j - cap), j):  # the last run is order[i:j]; its longest is order[i]
            cost = best[i] + (j - i) * (prompt_len + lengths[order[i]]) + CHUNK_OVERHEAD_TOKENS
            if cost < best[j]:
                best[j], cut[j] = cost, i
    runs, j = [], n
    while j:
        runs.append(order[cut[j]:j])
        j = cut[j]
    return runs[::-1]


def trimmed(per_token_logps, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
            **kwargs):
    """per_token_logps (TRL's method, bound) over chunks of plan_chunks, each cut to its longest completion;
    -> (logps [B, logits_to_keep], entropies or None, None), and the share of the padded tokens computed."""
    completion = attention_mask[:, -logits_to_keep:]
    positions = torch.arange(1, logits_to_keep + 1, device=completion.device)
    lengths = (completion * positions).amax(dim=1).clamp(min=1).tolist()  # one past each row's last real token
    prompt_len = input_ids.size(1) - logits_to_keep
    logps = torch.zeros(input_ids.size(0), logits_to_keep, device=input_ids.device)
    entropies = torch.zeros_like(logps) if compute_entropy else None
    computed = 0
    for rows in plan_chunks(lengths, prompt_len, batch_size):
        keep = max(lengths[i] for i in rows)
        idx = torch.tensor(rows, device=input_ids.device)
        lp, ent, _ = per_token_logps(input_ids[idx, :prompt_len + keep], attention_mask[idx, :prompt_len + keep],
                                     keep, batch_size=None, compute_entropy=compute_entropy, **kwargs)
        at = (idx[:, None], torch.arange(keep, device=idx.device)[None])  # the chunk's rows, its first keep columns
        logps = logps.to(lp.dtype).index_put(at, lp)
        if compute_entropy:
            entropies = entropies.to(ent.dtype).index_put(at, ent)
        computed += len(rows) * (prompt_len + keep)
    return (logps, entropies, None), computed / (input_ids.size(0) * input_ids.size(1))
