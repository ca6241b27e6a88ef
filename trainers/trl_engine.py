"""The seam between a TRL online trainer and the rollout engine, written once for SpecGRPOTrainer and SpecRLOOTrainer.

`trl.GRPOTrainer` and `trl.RLOOTrainer` share their generation structure: a RepeatSampler lays each prompt out
num_generations times in a row, `_generate_and_score_completions` tokenizes the prompts, calls
`_generate_single_turn` (the narrowest method that owns "token ids in -> completions out"), scores the completions
and runs the policy's no-grad pass over them; `_step` and `_buffered_inputs` carry a generation batch over the
micro-steps that consume it. `TrlEngineMixin` (before the TRL class in the MRO) holds everything around the engine
that does not depend on the algorithm:

- construction: use_vllm refused, a vision-language policy refused (GRPO) or left to TRL's generation (RLOO), the
  engine built from the policy (or TRL's own
  generation after one warning when the engine cannot reproduce what TRL would sample: trainers/trl_compat.py),
  TRL's sampling options as the engine's (trainers/sampling_args.py), the sampling dtype (trainers/sampling_dtype.py)
  and the prompt preflight (trainers/preflight.py);
- `_engine_completions`: one generation batch through the engine, each prompt's prefill shared, each sample drawn
  from its own key (trainers/sample_keys.py), the engine's metrics in TRL's metric store;
- the passes over the rollouts without the completions' padding (trainers/trimmed_logps.py), the learned drafter fed
  from the first one (trainers/drafter_feed.py), or that first one run as the loss's forward
  (trainers/loss_forward.py);
- checkpoints: TRL's micro-step counter and buffered generation batch (trainers/run/checkpoint.py), the on_nonfinite policy.

What each algorithm adds lives in its class: GRPO's importance-sampling correction, tool loops, rollout_func and
partial rollouts (trainers/grpo.py); RLOO's own signature of `_generate_single_turn` (trainers/rloo.py).
"""
from __future__ import annotations

import torch

from rlspec.rollout.limits import fits
from rlspec.rollout.runtime.model.loader import body_tensor
from rlspec.trainers import loss_forward, rollout_source, trl_compat
from rlspec.trainers.callbacks import attach_summary_callback
from rlspec.trainers.run.checkpoint import CheckpointMixin
from rlspec.trainers.sample_keys import sample_keys
from rlspec.trainers.sampling_args import trl_sampling
from rlspec.trainers.trimmed_logps import text_only, trimmed
from rlspec.trainers.weight_sync import unwrap_model


class TrlEngineMixin(CheckpointMixin):
    """A TRL trainer whose rollouts go through `rlspec.rollout.engine.RolloutEngine` (see the module docstring).

    Subclasses name themselves and the TRL class they replace (for messages) and may override the hooks
    `_check_arguments` (before TRL's __init__), `_before_engine`, `_engine_rows` (the engine's batch) and
    `_after_engine` (after it is built, or not).
    """

    spec_class_name = "SpecGRPOTrainer"
    trl_class_name = "GRPOTrainer"
    # a vision-language policy: refused at construction (True), or sampled by TRL's generation after the one warning
    refuse_vlms = True

    def __init__(self, model, reward_funcs=None, args=None, *trainer_args, spec_config=None, engine=None,
                 engine_kwargs: dict | None = None, on_nonfinite: str = "stop", drop_long_prompts: bool = False,
                 **trainer_kwargs):
        name = self.spec_class_name
        if args is not None and getattr(args, "use_vllm", False):  # fail before TRL's __init__ starts anything
            raise ValueError(f"{name} generates with its own engine: set use_vllm=False (the default)")
        self._check_arguments(args, spec_config)
        # a processor passed in is refused before TRL loads anything; one TRL loads itself (AutoProcessor) after
        positional = trainer_args[2] if len(trainer_args) > 2 else None  # after train_dataset, eval_dataset
        if self.refuse_vlms:
            trl_compat.refuse_vlm(trainer_kwargs.get("processing_class", positional), name, self.trl_class_name)
        self.init_resilience(on_nonfinite)
        super().__init__(model, reward_funcs, args, *trainer_args, **trainer_kwargs)
        if self.refuse_vlms:
            trl_compat.refuse_vlm(self.processing_class, name, self.trl_class_name)
        policy = unwrap_model(self.model, self.accelerator)
        self._before_engine()
        why_not = trl_compat.why_not_the_engine(policy, self.args.generation_kwargs)
        if getattr(self, "_is_vlm", False):  # TRL's own test (a ProcessorMixin processing class), when not refused
            why_not = "a vision-language model: the engine generates text only"
        # None when the engine cannot run the policy: TRL's own generation then samples (trl_compat.py)
        self.rollouts = trl_compat.engine_or_trl_generation(lambda: rollout_source.for_trainer(
            self, policy, self._tokenizer, spec_config, engine, engine_kwargs or {}, max_num_seqs=self._engine_rows(),
            max_model_len=self.args.vllm_max_model_length), engine_given=engine is not None, fsdp=self.is_fsdp_enabled,
            why_not=why_not, trainer=name)
        self.engine = self.rollouts.engine if self.rollouts is not None else None
        self.weight_syncer = self.rollouts.weight_syncer if self.rollouts is not None else None
        self.dropped_long_prompts = 0
        if self.rollouts is not None:  # on TRL's generation, its sampling settings stay as plain TRL has them
            # TRL's sampling options as the engine's, what every rollout asks for (why_not_the_engine has sent
            # generation_kwargs the engine cannot honour to TRL's generation)
            self.engine_sampling = trl_sampling(self)
            self.dropped_long_prompts = rollout_source.preflight(self, drop_long_prompts)
            self.rlspec_sampling_dtypes = (self.rollouts.sampling_dtype, body_tensor(policy.named_parameters()).dtype)
        self._after_engine()
        self.summary_callback = attach_summary_callback(self)

    # ---- hooks ------------------------------------------------------------------------------------------------
    def _check_arguments(self, args, spec_config) -> None:
        """Refuse, before TRL's __init__, what this algorithm cannot train."""

    def _before_engine(self) -> None:
        """After TRL's __init__, before the engine is built."""

    def _engine_rows(self) -> int:
        """The engine's batch: one generation batch of the process."""
        return self.args.per_device_train_batch_size * self.args.steps_per_generation

    def _after_engine(self) -> None:
        """After the engine is built (self.rollouts is None on TRL's generation)."""

    # ---- steps and checkpoints --------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's step, under the on_nonfinite policy (CheckpointMixin.guarded_step). A first pass's graph kept for
        the loss (trainers/loss_forward.py) never outlives its step."""
        try:
            return self.guarded_step(super().training_step, model, inputs, num_items_in_batch)
        finally:
            self._loss_forward = None

    def rlspec_trainer_state(self) -> dict:
        """TRL's micro-step counter and, when a checkpoint falls inside a generation batch that later
        steps still consume (steps_per_generation or num_iterations > 1), that buffered batch."""
        mid_buffer = self._step % (self.args.steps_per_generation * self.num_iterations) != 0
        return {"trl_step": self._step, "buffered_inputs": self._buffered_inputs if mid_buffer else None}

    def load_rlspec_trainer_state(self, state: dict) -> None:
        self._step = int(state["trl_step"])
        self._buffered_inputs = state["buffered_inputs"]

    # ---- generation -------------------------------------------------------------------------------------------
    def _engine_completions(self, prompt_ids: list[list[int]], num_generations: int,
                            metrics) -> tuple[list[list[int]], list[list[float]]]:
        """One completion per entry of `prompt_ids` (each prompt repeated `num_generations` times, consecutively, as
        TRL's sampler lays them out) from the engine: (completion ids, the sampling logprobs), same order.

        The logprobs are the behaviour policy's: the target's, except on tokens a lossy mode kept (rollout/types.py,
        docs/lossy.md). A prompt `_prompts_that_fit` leaves out gets an empty completion."""
        completions: list[list[int]] = [[] for _ in prompt_ids]
        logprobs: list[list[float]] = [[] for _ in prompt_ids]
        todo = self._prompts_that_fit(prompt_ids)
        if todo:
            unique_ids, n = dedupe_repeated_prompts([prompt_ids[i] for i in todo], num_generations)
            results = self.rollouts.generate(
                self.model, self.state.global_step, unique_ids, n, **self.engine_sampling,
                max_new_tokens=self.max_completion_length, stop_token_ids=list(self.eos_token_ids),
                sample_keys=self._sample_keys(todo, num_generations, len(prompt_ids)))
            self.rollouts.log_metrics(metrics)
            for i, r in zip(todo, results, strict=True):
                completions[i], logprobs[i] = list(r.completion_ids), list(r.sampling_logprobs())
        metrics[trl_compat.ENGINE_METRIC].append(1.0)
        return completions, logprobs

    def _sample_keys(self, rows: list[int], num_generations: int, batch_rows: int) -> list[int] | None:
        """The keys of a training generation batch's rows `rows` (TRL lays group g's samples at rows g*n..g*n+n-1):
        group ordinal = generation round x groups per batch + g, as partial rollouts number TRL's groups, so a
        sample is drawn alike with partial rollouts on or off (trainers/sample_keys.py). None in evaluation and for
        tool turns (TRL calls those with num_generations=1: keyed again, a sample's turns would share draws)."""
        if not self.model.training or num_generations != self.num_generations:
            return None
        generation = self._step // (self.args.steps_per_generation * self.num_iterations)
        base = generation * (batch_rows // num_generations)
        return sample_keys(self.args.seed, self.accelerator.process_index,
                           [(base + i // num_generations, i % num_generations) for i in rows])

    def _prompts_that_fit(self, prompt_ids: list[list[int]]) -> list[int]:
        """Indices of the prompts to generate for. A tool turn whose prompt (prompt + completion + tool output)
        fills the engine's context gets no tokens, as generating in a full context would give: TRL's tool loop
        drops a tool result only past the model's max_position_embeddings, which may exceed the engine's
        max_model_len. First-turn prompts were checked at construction (preflight) and all go to the engine,
        which names any that do not fit."""
        context = self.rollouts.max_model_len
        if not getattr(self, "_in_tool_loop", False) or context is None:
            return list(range(len(prompt_ids)))
        return [i for i, ids in enumerate(prompt_ids) if fits(len(ids), context)]

    def _generate_and_score_completions(self, inputs):
        """TRL's; its first no-grad pass of the policy over the rollouts (the old logprobs) also feeds the
        learned drafter (trainers/drafter_feed.py) or runs as the loss's forward (trainers/loss_forward.py)."""
        self._first_pass = getattr(self, "rollouts", None) is not None
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._first_pass = False

    # ---- the passes over the rollouts ---------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """TRL's, without the completions' padding (_trimmed_logps). The first no-grad pass of the policy in
        _generate_and_score_completions (only that one: TRL's reference pass comes after it, and for a PEFT policy
        it runs through the very same layers with the adapter off) feeds a learned drafter, at TRL's shapes, or else
        runs as the loss's forward, which then takes its graph (trainers/loss_forward.py)."""
        if getattr(self, "_first_pass", False) and model is self.model and not torch.is_grad_enabled():
            self._first_pass = False
            if self.rollouts.feeds_drafter:  # the drafter's hooks read TRL's padded shapes
                with self.rollouts.drafter_pass(input_ids, attention_mask, logits_to_keep):
                    return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask,
                                                                       logits_to_keep, *args, **kwargs)
            if len(args) <= 1 and loss_forward.reusable(self, kwargs):  # args: RLOO passes batch_size by position
                return loss_forward.first_pass(self, lambda: self._trimmed_logps(
                    model, input_ids, attention_mask, logits_to_keep, compute_entropy=True), model, input_ids,
                    attention_mask, logits_to_keep)
        kept = getattr(self, "_loss_forward", None)
        if kept is not None and torch.is_grad_enabled() and not args:  # the loss's forward: taken once
            self._loss_forward = None
            outputs = kept.outputs_for(model, input_ids, attention_mask, logits_to_keep, kwargs)
            if outputs is not None:
                return outputs
        return self._trimmed_logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    def _trimmed_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, **kwargs):
        """TRL's pass without the completions' padding (trainers/trimmed_logps.py), for text models; the share of
        the padded tokens it computed is logged as train/logps_token_frac. Multimodal inputs and MoE aux losses
        take TRL's padded pass."""
        parent = super()._get_per_token_logps_and_entropies
        if not text_only(kwargs):
            return parent(model, input_ids, attention_mask, logits_to_keep, batch_size, **kwargs)
        out, frac = trimmed(lambda *a, **kw: parent(model, *a, **kw), input_ids, attention_mask, logits_to_keep,
                            batch_size, **kwargs)
        getattr(self, "_metrics", {}).get("train" if model.training else "eval", {}).setdefault(
            "train/logps_token_frac", []).append(frac)
        return out


def dedupe_repeated_prompts(prompt_ids: list[list[int]], n: int) -> tuple[list[list[int]], int]:
    """(unique prompts, samples per prompt) for the engine, so each prompt's prefill is shared.

    TRL's RepeatSampler lays each prompt out `n` times in a row, and the engine returns prompt 0's n
    samples, then prompt 1's...: the same order. When the list is not made of whole blocks of n equal
    prompts (a process holding part of a group in multi-GPU runs), fall back to one sample per entry.
    """
    if n > 1 and len(prompt_ids) % n == 0:
        blocks = [prompt_ids[i:i + n] for i in range(0, len(prompt_ids), n)]
        if all(all(p == block[0] for p in block) for block in blocks):
            return [block[0] for block in blocks], n
    return [list(p) for p in prompt_ids], 1
