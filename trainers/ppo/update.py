"""The PPO update of one rollout: epochs over shuffled minibatches, one optimizer update each.

A mixin of PPOTrainer (it reads self.args, self.accelerator, self.optimizer, self._metrics), kept
apart so the trainer file reads as the step's outline and this one as the inner loop.
"""
from __future__ import annotations

import torch

from rlspec.trainers.ppo import maths as ppo_math
from rlspec.trainers.ppo.batch import Experience, token_logprobs


class PPOUpdateMixin:
    """num_ppo_epochs x num_mini_batches optimizer updates on one Experience (see docs/ppo.md)."""

    def _ppo_epochs(self, model, exp: Experience) -> torch.Tensor:
        """Runs the updates; logs the means of their statistics; returns the mean total loss (detached)."""
        args = self.args
        stats: dict[str, list[torch.Tensor]] = {}
        num_rows = exp.mask.shape[0]
        for _ in range(args.num_ppo_epochs):
            order = torch.randperm(num_rows, generator=self._shuffle).to(exp.mask.device)
            for start in range(0, num_rows, args.per_device_train_batch_size):
                step_stats = self._update(model, exp.select(order[start:start + args.per_device_train_batch_size]))
                for key, value in step_stats.items():
                    stats.setdefault(key, []).append(value)
        for key, values in stats.items():
            self._log_mean(key, torch.stack(values))
        return torch.stack(stats["loss/total"]).mean()

    def _update(self, model, mb: Experience) -> dict[str, torch.Tensor]:
        """One minibatch: forward, losses, backward, clip, optimizer step. Returns detached statistics."""
        args, mask = self.args, mb.mask
        warmup = self.state.global_step < args.value_warmup_steps  # critic only: the policy does not move
        with self.compute_loss_context_manager():
            logits, values = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                   completion_len=mb.completion_len, value_only=warmup)
        logprobs = token_logprobs(logits, mb.completion_ids, args.temperature)
        pg_loss, pg = ppo_math.policy_loss(logprobs, mb.old_logprobs, mb.advantages, mask, args.cliprange,
                                           mb.is_weights)
        vf_loss, vf = ppo_math.value_loss(values, mb.old_values, mb.returns, mask, args.cliprange_value)
        loss = args.vf_coef * vf_loss if warmup else pg_loss + args.vf_coef * vf_loss
        if mb.ref_logprobs is not None and not args.kl_in_reward and not warmup:
            kl_loss = ppo_math.masked_mean(ppo_math.kl_penalty(logprobs, mb.ref_logprobs, args.kl_estimator), mask)
            loss = loss + args.kl_coef * kl_loss
        self.accelerator.backward(loss)
        grad_norm = self._clip_and_step(model)
        with torch.no_grad():
            entropy = ppo_math.masked_mean(ppo_math.entropy_from_logits(logits.detach() / args.temperature), mask)
        return {"loss/policy": pg_loss.detach(), "loss/value": vf_loss.detach(), "loss/total": loss.detach(),
                "policy/approxkl": pg["approxkl"], "policy/clipfrac": pg["clipfrac"], "policy/entropy": entropy,
                "val/clipfrac": vf["clipfrac"], "grad_norm": grad_norm}

    def _clip_and_step(self, model) -> torch.Tensor:
        """Clip the gradient norm (args.max_grad_norm) and take one optimizer step; returns the norm."""
        norm = torch.zeros((), device=self.accelerator.device)
        if self.args.max_grad_norm and self.args.max_grad_norm > 0:
            clipped = self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)
            if clipped is None and hasattr(model, "get_global_grad_norm"):
                # DeepSpeed clips inside its own step (accelerator.backward ran it) and returns None above;
                # its engine keeps the norm it measured
                clipped = model.get_global_grad_norm()
            if clipped is not None:
                norm = torch.as_tensor(clipped, device=norm.device).float()
        self.optimizer.step()
        # set_to_none: the Trainer's own optimizer.step() after training_step then sees no gradient at all
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def create_optimizer(self, model=None):
        """The Trainer's optimizer, with the value model's parameters moved to groups at value_learning_rate."""
        optimizer = super().create_optimizer(model)
        if self.args.value_learning_rate is None:
            return optimizer
        value_params = {id(p) for name, p in self.model.named_parameters() if not name.startswith("policy.")}
        for group in list(optimizer.param_groups):
            moved = [p for p in group["params"] if id(p) in value_params]
            if moved:
                group["params"] = [p for p in group["params"] if id(p) not in value_params]
                optimizer.add_param_group({**{k: v for k, v in group.items() if k != "params"}, "params": moved,
                                           "lr": self.args.value_learning_rate})
        return optimizer
