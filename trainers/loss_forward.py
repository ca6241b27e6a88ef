"""One policy forward where TRL runs two: the first no-grad pass over a generation batch doubles as the loss's.

With one generation batch per micro-step (steps_per_generation == 1 and num_iterations == 1), TRL runs the policy
twice over the same rows at the same weights within one training_step: the no-grad pass of
`_generate_and_score_completions` (RLOO: the old logprobs of its ratio and its KL penalty; GRPO with the engine: the
logprobs its importance-sampling correction sets against the sampler's) and the forward of the loss. Both compute the
same numbers. So the first pass runs as the loss's forward would (with grad, the loss's arguments, under the loss's
autocast) and keeps its graph; the loss takes it instead of running the model again, and TRL's first pass gets the
same logprobs, detached. TRL shuffles the batch's rows in between: the loss's rows are matched back by their tokens.
The ratio of the loss is then exactly 1 at its value, as TRL intends on-policy, where two passes could differ in the
last bits.

Only where nothing tells the two passes apart (`reusable`): training, one process without DeepSpeed or FSDP (their
wrappers run the loss's forward), no dropout (the passes would draw different masks), a text policy without a MoE
auxiliary loss, no Liger loss. Gradient checkpointing (TRL's default) is on for the pass, as for the loss (TRL turns
it off around its no-grad pass): the graph then holds each layer's input only, and the backward recomputes the
layers as it would after the loss's own forward. The loss's activations are held from the first pass through the
reference pass and the reward functions, rather than from the loss's forward.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from rlspec.trainers import checkpointing
from rlspec.trainers.trimmed_logps import text_only

PASS_ARGS = ("batch_size", "num_images", "num_tiles")  # what TRL's first pass passes besides the model's inputs


def reusable(trainer, pass_kwargs: dict) -> bool:
    """Whether `trainer`'s first no-grad pass (called with `pass_kwargs`) may run as its loss's forward."""
    args = trainer.args
    return (trainer.model.training and args.steps_per_generation == 1 and trainer.num_iterations == 1
            and trainer.accelerator.num_processes == 1
            and not trainer.is_deepspeed_enabled and not trainer.is_fsdp_enabled
            and not getattr(trainer, "aux_loss_enabled", False) and not getattr(args, "use_liger_kernel", False)
            and text_only(pass_kwargs, PASS_ARGS) and not has_dropout(trainer.model))


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether a forward in training mode draws dropout masks: a dropout module or a config attention dropout > 0."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    return any(float(getattr(config, key, 0) or 0) > 0 for key in ("attention_dropout", "attn_pdrop", "dropout"))


def row_keys(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[tuple]:
    """Each row's identity: its tokens and mask (a few hundred integers a row, read once a step)."""
    return [tuple(r) for r in torch.cat([input_ids, attention_mask.to(input_ids.dtype)], 1).tolist()]


def match_rows(kept: list[tuple], wanted: list[tuple]) -> list[int] | None:
    """For each wanted row the index of an equal kept row, each used once (equal rows have equal outputs), or None
    when the rows are not the same multiset."""
    where = defaultdict(list)
    for i, key in enumerate(kept):
        where[key].append(i)
    order = []
    for key in wanted:
        if not where[key]:
            return None
        order.append(where[key].pop())
    return order


@dataclass
class LossForward:
    """The first pass's outputs with their graph, kept for the loss of the same training_step."""

    model: torch.nn.Module
    keys: list[tuple]
    logits_to_keep: int
    logps: torch.Tensor
    entropies: torch.Tensor | None

    def outputs_for(self, model, input_ids, attention_mask, logits_to_keep, kwargs: dict):
        """(logps, entropies, None) for the loss's call, rows in its order, or None when the call is another one."""
        if model is not self.model or logits_to_keep != self.logits_to_keep or not text_only(kwargs):
            return None
        order = match_rows(self.keys, row_keys(input_ids, attention_mask))
        if order is None:
            return None
        idx = torch.tensor(order, device=self.logps.device)
        entropies = self.entropies[idx] if kwargs.get("compute_entropy") else None
        return self.logps[idx], entropies, None


def first_pass(trainer, run, model, input_ids, attention_mask, logits_to_keep) -> tuple:
    """Run `run()` (the loss's forward: entropy on, whole batch) with grad under the loss's autocast, keep it on
    `trainer._loss_forward` and give TRL's first pass its logprobs, detached."""
    with torch.enable_grad(), trainer.compute_loss_context_manager(), loss_checkpointing(trainer, model):
        logps, entropies, _ = run()
    trainer._loss_forward = LossForward(model, row_keys(input_ids, attention_mask), logits_to_keep, logps, entropies)
    return logps.detach(), None, None


@contextmanager
def loss_checkpointing(trainer, model):
    """Gradient checkpointing on, as the loss's forward runs, when the user asked for it (TRL turns it off around
    its no-grad pass, which keeps no graph); back off afterwards, for TRL to restore."""
    asked, kwargs = checkpointing.asked(trainer.args)
    off = asked and not checkpointing.is_on(model)
    if off:
        checkpointing.enable(model, kwargs)
    try:
        yield
    finally:
        if off:
            checkpointing.disable(model)
