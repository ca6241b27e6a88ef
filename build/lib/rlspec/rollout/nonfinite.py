"""Non-finite logits stop the rollout where they appear, naming the step, the rows and the culprit.

Sampling from NaN/inf logits does not fail: it returns arbitrary tokens with NaN logprobs, which a
trainer turns into a NaN loss steps later, far from the cause. The decode loop therefore carries one
flag per row, "every logit this row used is finite", inside the one host transfer it already makes
per step (`finite_flags`, computed on the device); the host checks it and raises
`NonFiniteLogitsError`. Only then, on the error path where time no longer matters, `first_nonfinite`
looks for the cause: the first runtime parameter holding a NaN/inf (a bad weight sync or update), else
the first layer whose output is non-finite in a fresh eager forward of the failing sequence (an
overflow in the activations).
"""
from __future__ import annotations

import torch

from rlspec.rollout.errors import NonFiniteLogitsError
from rlspec.rollout.runtime.model.attention import causal_mask
from rlspec.rollout.runtime.model.llama import ForwardBatch, LlamaForCausalLM


def finite_flags(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, ..., V] -> [B] bool on the device: True where every logit of the row is finite.

    One sum per row instead of an elementwise isfinite: a sum over finite float32 logits stays finite
    (|logit| is far below 3e38 / V), while any NaN or inf makes it NaN or inf."""
    return torch.isfinite(logits.float().sum(-1).reshape(logits.shape[0], -1)).all(-1)


def bad_rows(flags: list[float]) -> list[int]:
    """Host side: the rows whose flag (1.0 finite, 0.0 not) says non-finite."""
    return [i for i, f in enumerate(flags) if f != 1.0]


def first_nonfinite(model: LlamaForCausalLM, token_ids: list[int] | None = None) -> str | None:
    """The first parameter (runtime name, with the Hugging Face name of a fused slice) holding NaN/inf;
    else, given the failing sequence's tokens, the first layer whose output is non-finite in an eager
    forward of them; None when neither shows one (the cause then lies outside the weights, e.g. the KV)."""
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all():
            return _describe_param(model, name, param)
    if token_ids:
        return _first_bad_layer(model, token_ids)
    return None


def nonfinite_error(model: LlamaForCausalLM, rows: list[int], step: int, where: str, seqs: list) -> NonFiniteLogitsError:
    """The error for non-finite logits in `rows` (batch rows) of decode `step`; seqs: the batch's Sequences,
    whose first failing one is re-run to find the bad layer when no parameter is bad."""
    first = seqs[rows[0]]
    culprit = first_nonfinite(model, first.all_ids())
    prompts = sorted({seqs[r].prompt_index for r in rows})
    found = f"first non-finite: {culprit}" if culprit else "no parameter or layer reproduced it"
    return NonFiniteLogitsError(
        f"non-finite logits (NaN/inf) at {where} (decode step {step}) in batch rows {rows[:10]} "
        f"(prompts {prompts[:10]}); {found}. The rollout was stopped before sampling from them: check the "
        "weights the trainer last pushed (a NaN update or a failed sync) or run in float32/bfloat16 "
        "instead of float16 if activations overflow", step=step, rows=rows, first_bad=culprit)


def _describe_param(model: LlamaForCausalLM, name: str, param: torch.Tensor) -> str:
    """`name`, plus the Hugging Face parameter of the first bad row when `name` is a fused q|k|v or gate|up."""
    from rlspec.rollout.runtime.model.loader import fused_parts

    bad_row = int((~torch.isfinite(param.reshape(param.shape[0], -1))).any(-1).nonzero()[0, 0])
    for hf, start, stop in fused_parts(model.cfg, name):
        if start <= bad_row < stop:
            return f"parameter {name} (rows of {hf})"
    return f"parameter {name}"


@torch.inference_mode()
def _first_bad_layer(model: LlamaForCausalLM, token_ids: list[int]) -> str | None:
    """Re-run `token_ids` as one causal prefill with a throwaway one-slot KV pool (a prefill attends to its
    own keys only, so nothing is read back from it) and name the first module whose output is non-finite."""
    cfg, device = model.cfg, model.lm_head.weight.device
    T, L = len(token_ids), cfg.num_layers
    model.init_rope(T)
    pool = torch.zeros(L, 1, 1, cfg.num_kv_heads, cfg.head_dim, dtype=model.lm_head.weight.dtype, device=device)
    pos = torch.arange(T, device=device)[None]
    fb = ForwardBatch(input_ids=torch.tensor([token_ids], device=device), positions=pos, write_index=pos,
                      attn=causal_mask(), slots=torch.zeros_like(pos))
    logits, hiddens = model(fb, pool, pool.clone(), hidden_layers=tuple(range(L + 1)))
    # hiddens[0] is the embedding output; hiddens[i] (i >= 1) the output of layer i - 1
    for i in range(L + 1):
        if not torch.isfinite(hiddens[i]).all():
            return "model.embed_tokens" if i == 0 else f"layer model.layers.{i - 1}"
    if not torch.isfinite(model.model.norm(hiddens[L])).all():
        return "model.norm"
    return "lm_head" if not torch.isfinite(logits).all() else None
