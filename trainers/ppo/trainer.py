"""PPOTrainer: actor-critic PPO for language models, rollouts through the speculative engine.

A `transformers.Trainer` subclass in TRL's conventions (config in trainers/ppo/config.py, the maths
in trainers/ppo/maths.py and docs/ppo.md). One training step = one rollout and its PPO epochs:

1. rollout: the batch's prompts, each sampled num_generations times through the shared
   `RolloutSource` (the same engine, speculation, weight sync and rollout metrics as SpecGRPOTrainer);
2. score: reward functions with GRPO's signature, summed; missing_eos_penalty for cut-off samples;
3. experience (no grad): the policy's own logprobs of the samples (old logprobs), values, reference
   logprobs (a frozen copy of the initial policy, only when kl_coef > 0), truncated importance
   weights pi_old / pi_engine, per-token rewards, GAE, whitening;
4. update: num_ppo_epochs passes over shuffled minibatches, one optimizer update each, on the clipped
   policy loss (times the importance weights) + vf_coef * clipped value loss (+ kl_coef * KL when
   kl_in_reward is False).

The optimizer updates happen inside `training_step` (PPO needs several per rollout); the Trainer's own
optimizer.step() that follows finds every gradient None and changes nothing, while its scheduler,
logging, callbacks and checkpointing run once per rollout as for any HF trainer.
"""
from __future__ import annotations

import copy
import os
import time
from collections import defaultdict

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer
from trl.models import prepare_deepspeed, prepare_fsdp

from rlspec.rollout.eos import resolve_eos
from rlspec.rollout.types import SpecConfig
from rlspec.trainers.ppo import maths as ppo_math
from rlspec.trainers import rollout_source
from rlspec.trainers.callbacks import attach_summary_callback
from rlspec.trainers.run.checkpoint import CheckpointMixin
from rlspec.trainers.data import prompt_token_ids
from rlspec.trainers.ppo.batch import Experience, RolloutBatch, pad_results, token_logprobs
from rlspec.trainers.ppo.config import PPOConfig
from rlspec.trainers.ppo.model import VALUE_FILE, PolicyAndValue, completion_logits
from rlspec.trainers.ppo.update import PPOUpdateMixin
from rlspec.trainers.rewards import score_completions
from rlspec.trainers.weight_sync import unwrap_model


def _keep_rows(rows: list) -> list:
    """Collator: a batch is the list of dataset rows (prompts are tokenized at rollout time)."""
    return rows


class PPOTrainer(CheckpointMixin, PPOUpdateMixin, Trainer):
    """PPO with a value head or a separate critic (PPOConfig.value_model), rollouts through the engine.

    model: an HF causal LM or its name/path (loaded with args.model_init_kwargs).
    reward_funcs: a function or a list, GRPO's signature: f(prompts, completions, **columns) -> list[float].
    spec_config / engine / engine_kwargs: as SpecGRPOTrainer (how the engine speculates, an existing
        engine, or RolloutEngine.from_hf_model overrides: max_model_len, max_num_seqs, dtype, graph_mode).
    on_nonfinite: as SpecGRPOTrainer ("stop" or "skip_batch"); checkpoints and resume: trainers/run/checkpoint.py.
    drop_long_prompts: as SpecGRPOTrainer (prompts too long for the rollout context: refused, or dropped).
    """

    def __init__(self, model, reward_funcs, args: PPOConfig | None = None, train_dataset=None, processing_class=None,
                 callbacks=None, optimizers=(None, None), *, spec_config: SpecConfig | None = None, engine=None,
                 engine_kwargs: dict | None = None, on_nonfinite: str = "stop", drop_long_prompts: bool = False):
        self.init_resilience(on_nonfinite)
        args = args or PPOConfig(output_dir="ppo_output")
        if not isinstance(args, PPOConfig):
            raise TypeError(f"PPOTrainer needs a PPOConfig, got {type(args).__name__}")
        if isinstance(model, str):
            model = AutoModelForCausalLM.from_pretrained(model, **(args.model_init_kwargs or {}))
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path)
        self.reward_funcs = _check_reward_funcs(reward_funcs)
        # The reference policy is the initial policy, frozen; copied before training can touch it.
        ref = copy.deepcopy(model).eval().requires_grad_(False) if args.kl_coef > 0 else None
        super().__init__(model=PolicyAndValue(model, args.value_model), args=args, data_collator=_keep_rows,
                         train_dataset=train_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers)
        self.ref_policy = self._prepare_reference(ref) if ref is not None else None
        self.stop_token_ids = _stop_token_ids(model, processing_class, args.stop_token_id)
        self.rollouts = rollout_source.for_trainer(
            self, self.policy, self.processing_class, spec_config, engine, engine_kwargs or {},
            max_num_seqs=args.per_device_train_batch_size * args.num_mini_batches, max_model_len=args.max_model_len)
        self.engine, self.weight_syncer = self.rollouts.engine, self.rollouts.weight_syncer
        self.dropped_long_prompts = rollout_source.preflight(self, drop_long_prompts)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._shuffle = torch.Generator().manual_seed(args.seed)
        self.summary_callback = attach_summary_callback(self)

    def _prepare_reference(self, ref):
        """Place the frozen reference the way TRL's GRPOTrainer does for its ref_model."""
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(ref, self.accelerator)
        if self.is_fsdp_enabled:
            return prepare_fsdp(ref, self.accelerator)
        return self.accelerator.prepare_model(ref, evaluation_mode=True)

    @property
    def policy(self):
        """The bare HF causal LM being trained (what the engine runs and what save_model writes)."""
        return unwrap_model(self.model, self.accelerator).policy

    # -- data --------------------------------------------------------------------------------------------

    def get_train_dataloader(self):
        """Batches of whole prompts: per_device_train_batch_size * num_mini_batches / num_generations rows."""
        if self.train_dataset is None:
            raise ValueError("PPOTrainer: training requires a train_dataset with a 'prompt' column")
        per_step = self.args.per_device_train_batch_size * self.args.num_mini_batches // self.args.num_generations
        return self._get_dataloader(self.train_dataset, "Training", batch_size=per_step,
                                    sampler_fn=self._get_train_sampler, is_training=True)

    # -- one step ----------------------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Rollout -> score -> experience -> PPO epochs; returns the mean loss of the updates (detached).
        Under the on_nonfinite policy (CheckpointMixin.guarded_step): the rollout comes first, so a batch
        whose logits are not finite is dropped before any update."""
        return self.guarded_step(self._ppo_step, model, inputs)

    def _ppo_step(self, model, inputs) -> torch.Tensor:
        start = time.perf_counter()
        model.train()
        batch = self._rollout(inputs)
        experience = self._experience(model, batch)
        loss = self._ppo_epochs(model, experience)
        self._metrics["train"]["step_time"].append(time.perf_counter() - start)
        return loss

    def _rollout(self, rows: list[dict]) -> RolloutBatch:
        """Sample num_generations completions per prompt and score them with the reward functions."""
        args, metrics = self.args, self._metrics["train"]
        prompts = [row["prompt"] for row in rows]
        results = self.rollouts.generate(
            self.policy, self.state.global_step, prompt_token_ids(self.processing_class, prompts),
            args.num_generations, temperature=args.temperature, max_new_tokens=args.max_completion_length,
            stop_token_ids=self.stop_token_ids)
        self.rollouts.log_metrics(metrics)
        pad_id = self.processing_class.pad_token_id
        batch = pad_results(results, self.stop_token_ids[0] if pad_id is None else pad_id, self.accelerator.device)
        repeat = [i for i in range(len(rows)) for _ in range(args.num_generations)]  # the engine's order
        texts = self.processing_class.batch_decode([r.completion_ids for r in results], skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] if isinstance(prompts[i], list) else t
                       for i, t in zip(repeat, texts)]
        columns = {k: [rows[i][k] for i in repeat] for k in rows[0] if k != "prompt"}
        totals, means = score_completions(self.reward_funcs, [prompts[i] for i in repeat], completions,
                                          [list(r.completion_ids) for r in results], columns)
        scores = torch.tensor(totals, device=self.accelerator.device)
        if args.missing_eos_penalty is not None:
            scores = scores - args.missing_eos_penalty * (~batch.finished).float()
        for key, value in means.items():
            metrics[key].append(value)
        self._log_mean("reward", scores)
        self._log_mean("reward_std", scores.std() if scores.numel() > 1 else torch.zeros(()))
        self._log_mean("completions/mean_length", batch.mask.sum(1))
        self._log_mean("completions/clipped_ratio", (~batch.finished).float())
        batch.scores = scores
        return batch

    @torch.no_grad()
    def _experience(self, model, batch: RolloutBatch) -> Experience:
        """Old logprobs and values of the frozen policy, reference logprobs, importance weights, GAE."""
        args, mask = self.args, batch.mask
        # the pass over the rollout also feeds the learned drafter its features (trainers/drafter_feed.py)
        with self.rollouts.drafter_pass(batch.input_ids, batch.attention_mask, batch.completion_len):
            old_logprobs, old_values, entropy = self._forward_chunks(model, batch)
        exp = Experience(**vars(batch), old_logprobs=old_logprobs, old_values=old_values)
        kl = None
        if self.ref_policy is not None:
            exp.ref_logprobs = self._ref_logprobs(batch)
            kl = ppo_math.kl_penalty(old_logprobs, exp.ref_logprobs, args.kl_estimator) * mask
            self._log_mean("objective/kl", kl.sum(1))
        if args.importance_sampling_correction:
            exp.is_weights, sampling = ppo_math.importance_weights(
                old_logprobs, batch.engine_logprobs, mask, args.importance_sampling_mode, args.importance_sampling_cap)
            for key, value in sampling.items():
                self._log_mean(key, value)
        rewards = ppo_math.token_rewards(batch.scores, mask, kl if args.kl_in_reward else None, args.kl_coef)
        self._log_mean("objective/non_score_reward", (rewards * mask).sum(1) - batch.scores)
        if args.whiten_rewards:
            rewards = ppo_math.whiten(rewards, mask, shift_mean=False)
        exp.advantages, exp.returns = ppo_math.gae(rewards, old_values, mask, args.gamma, args.lam)
        if args.value_lam is not None and args.value_lam != args.lam:  # decoupled GAE: the critic's own lambda
            _, exp.returns = ppo_math.gae(rewards, old_values, mask, args.gamma, args.value_lam)
        if args.whiten_advantages:
            exp.advantages = ppo_math.whiten(exp.advantages, mask)
        self._log_mean("objective/entropy", ppo_math.masked_mean(entropy, mask))
        self._log_mean("val/mean", ppo_math.masked_mean(old_values, mask))
        self._log_mean("val/returns", ppo_math.masked_mean(exp.returns, mask))
        self._log_mean("val/explained_variance", ppo_math.explained_variance(old_values, exp.returns, mask))
        # the critic's error on rollouts it has not trained on yet, and what predicting their mean would cost:
        # pooled over steps, 1 - sum(mse) / sum(returns_var) is the out-of-sample explained variance
        self._log_mean("val/mse", ppo_math.masked_mean((old_values - exp.returns) ** 2, mask))
        self._log_mean("val/returns_var", ppo_math.masked_var(exp.returns, mask, unbiased=False))
        return exp

    def _row_chunks(self, batch: RolloutBatch) -> list[slice]:
        """The rollout's rows per_device_train_batch_size at a time: the no-grad forwards of the
        experience run at the size of one update's minibatch, so they fit wherever the update fits."""
        size = self.args.per_device_train_batch_size
        return [slice(i, i + size) for i in range(0, batch.mask.shape[0], size)]

    def _forward_chunks(self, model, batch: RolloutBatch):
        """(logprobs, values, entropy) of the whole rollout, one row chunk at a time."""
        outs = []
        for rows in self._row_chunks(batch):
            with self.compute_loss_context_manager():
                logits, values = model(input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows],
                                       completion_len=batch.completion_len)
            logprobs = token_logprobs(logits, batch.completion_ids[rows], self.args.temperature)
            outs.append((logprobs, values, ppo_math.entropy_from_logits(logits / self.args.temperature)))
        return tuple(torch.cat(parts) for parts in zip(*outs))

    def _ref_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        parts = []
        ref = unwrap_model(self.ref_policy, self.accelerator)
        for rows in self._row_chunks(batch):
            with self.compute_loss_context_manager():
                logits = completion_logits(ref, batch.input_ids[rows], batch.attention_mask[rows],
                                           batch.completion_len)
            parts.append(token_logprobs(logits, batch.completion_ids[rows], self.args.temperature))
        return torch.cat(parts)

    # -- checkpoints: the policy as a plain HF directory, the value model beside it ----------------------

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Write the policy with save_pretrained (loadable by the engine, vLLM, export) and the value model
        to value_model.safetensors; `state_dict` (DeepSpeed's gathered one) is split the same way."""
        output_dir = output_dir or self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        wrapper = unwrap_model(self.model, self.accelerator)
        state_dict = state_dict if state_dict is not None else wrapper.state_dict()
        policy_state = {k[len("policy."):]: v for k, v in state_dict.items() if k.startswith("policy.")}
        wrapper.policy.save_pretrained(output_dir, state_dict=policy_state)
        value_state = {k: v.detach().contiguous() for k, v in state_dict.items() if not k.startswith("policy.")}
        save_file(value_state, os.path.join(output_dir, VALUE_FILE))
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Resume: the policy through the Trainer's own loader, then the value model."""
        wrapper = unwrap_model(self.model, self.accelerator)
        super()._load_from_checkpoint(resume_from_checkpoint, model=wrapper.policy)
        wrapper.load_value_model(resume_from_checkpoint)

    def rlspec_trainer_state(self) -> dict:
        """The minibatch shuffle generator (its draws order each rollout's updates)."""
        return {"shuffle": self._shuffle.get_state()}

    def load_rlspec_trainer_state(self, state: dict) -> None:
        self._shuffle.set_state(state["shuffle"])

    # -- logging -----------------------------------------------------------------------------------------

    def _log_mean(self, key: str, value: torch.Tensor) -> None:
        """The mean of `value` over this process's batch, averaged over processes, into the metric store."""
        value = torch.as_tensor(value, device=self.accelerator.device).float().mean().reshape(1)
        self._metrics["train"][key].append(self.accelerator.gather(value).mean().item())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Average the metric store since the last log into `logs` (TRL's convention), then log."""
        mode = "train" if self.model.training else "eval"
        for key, values in self._metrics[mode].items():
            valid = [v for v in values if v == v]  # drop NaN (a reward function with no verdict)
            logs[key] = sum(valid) / len(valid) if valid else None
        super().log(logs, start_time)
        self._metrics[mode].clear()


def _stop_token_ids(model, tokenizer, stop_token_id: int | None) -> list[int]:
    """The one EOS rule (rollout/eos.py) plus args.stop_token_id."""
    return resolve_eos(model, tokenizer, [stop_token_id])


def _check_reward_funcs(reward_funcs) -> list:
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs or not all(callable(f) for f in funcs):
        raise TypeError("reward_funcs must be a function or a list of functions f(prompts, completions, **columns) "
                        "-> list[float] (reward models by name are not supported by PPOTrainer)")
    return list(funcs)
