"""DrafterHost: the learned EAGLE-3 drafter beside vLLM: its network, trainer and export, no policy copy.

vLLM decodes the rollouts and speculates with the drafter's EAGLE-3 export. The host owns
- the drafter network (loaded from drafter_path, or created cold) and its version;
- its online trainer (SpecConfig.online_training / online_trainer, as the engine builds it), fed through
  the intake (rollout/speculation/training/intake.py) by the trainer's own no-grad pass over vLLM's rollouts
  (trainers/drafter_feed.py): vLLM shows no hidden states, the policy's pass has them all;
- the warm start: vLLM samples, one no-grad pass of the policy through the same tap feeds the buffer;
- the export, and the tensors the backend pushes into vLLM's draft model.
A trainer reads of the target only its embedding, final norm, LM head and RoPE tables: a TargetView
over the policy's own tensors (shared storage, not a copy), the same view a trainer process builds.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import torch

from rlspec.rollout.speculation.training.intake import TrainerIntake
from rlspec.rollout.types import SpecConfig


def target_view(policy: torch.nn.Module):
    """The policy as a drafter trainer sees it (trainer_child.TargetView), over its own tensors."""
    from rlspec.rollout.runtime.model.config import ModelConfig
    from rlspec.rollout.runtime.model.families import family_of_model
    from rlspec.rollout.speculation.training.trainer_child import TargetView

    lm = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    embed, head = lm.get_input_embeddings().weight, lm.get_output_embeddings().weight
    parts = SimpleNamespace(cfg=ModelConfig.from_hf(lm.config, family_of_model(lm)), embed=embed.detach(),
                            norm=getattr(lm, lm.base_model_prefix).norm.weight.detach(),
                            lm_head=None if head is embed else head.detach(), rope=None)
    return TargetView(parts)


class DrafterHost:
    def __init__(self, drafter, trainer, spec: SpecConfig):
        self.drafter, self.trainer, self.spec = drafter, trainer, spec

    @classmethod
    def build(cls, policy, spec: SpecConfig) -> "DrafterHost | None":
        """A host when the spec has a learned drafter (eagle3), else None."""
        if not spec.enabled or spec.drafter != "eagle3":
            return None
        from rlspec.rollout.speculation.drafters.base import make_drafter
        from rlspec.rollout.speculation.speculation import trains_online
        from rlspec.rollout.speculation.training.trainer_process import make_trainer

        target = target_view(policy)
        drafter = make_drafter("eagle3", target=target, spec=spec)
        trainer = make_trainer(drafter, spec) if trains_online(spec, target) else None
        if trainer is not None:
            drafter.attach(trainer)
        return cls(drafter, trainer, spec)

    def version(self) -> int:
        """The newest published drafter version (taken in first, as the engine does between steps)."""
        self.drafter.swap_latest()
        return self.drafter.version

    def intake(self) -> TrainerIntake | None:
        """Where the trainer's pass sends samples; None without online training (nothing would read them)."""
        if self.trainer is None:
            return None
        return TrainerIntake(lambda: self.trainer, self.drafter.aux_layers, self._dtype())

    def set_idle(self, idle: bool) -> None:
        """The online trainer trains between rollouts, as the engine lets it; vLLM's decoding is busy time."""
        if self.trainer is not None:
            self.trainer.set_idle(idle)

    def drafter_tensors(self) -> list:
        """The version version() reports, under the names of the exported file (what vLLM loads)."""
        from rlspec.rollout.speculation.drafters.eagle3_io import drafter_tensors

        return list(drafter_tensors(self.drafter.network(), torch.float32).items())

    def export(self, path: str | Path, metadata: dict | None = None) -> str:
        from rlspec.rollout.speculation.drafters.eagle3_io import save_learned

        return save_learned(self.drafter, self.trainer, self.drafter.target.cfg.hf_config, str(path), metadata)

    def metrics(self, policy_version: int) -> dict[str, float]:
        return self.trainer.metrics(policy_version) if self.trainer is not None else {}

    def _dtype(self) -> torch.dtype:
        return next(self.drafter.network().parameters()).dtype

    def warm_start(self, generate, policy, prompts: list[list[int]], *, budget_s: float, group: int,
                   max_new_tokens: int, temperature: float, max_steps: int | None = None, prompts_per_round: int = 16,
                   steps_per_round: int = 50, root=None, use_tqdm: bool = True, **trainer_kwargs):
        """Rounds of (generate: the backend's sampler; one no-grad pass of `policy` over the samples through
        the tap into the trainer; train) until budget_s (or max_steps optimizer steps) is spent, then cache
        the drafter, as the engine's warm start does (rollout/speculation/training/warm_start.py; cached per policy
        weights). With online training the online trainer keeps the data; otherwise a
        DrafterTrainer(**trainer_kwargs) lives for the warm-up only."""
        from rlspec.rollout.speculation.training.feature_tap import feed_results
        from rlspec.rollout.speculation.training.warm_start import WarmStartResult, cache_dir, cache_key, train_rounds

        key = cache_key(policy, self.drafter.model.cfg, tag="hf")  # an HF model's names: not the engine's key
        out = cache_dir(root) / key
        if (out / "config.json").is_file() and self._load(out):
            return WarmStartResult(key, str(out), cached=True)
        trainer = self.trainer or self._own_trainer(**trainer_kwargs)
        intake = TrainerIntake(lambda: trainer, self.drafter.aux_layers, self._dtype())

        def collect(batch, params):  # vLLM samples, the policy's pass feeds the drafter
            feed_results(policy, intake, generate(batch, params), params, policy_version=0)

        result = train_rounds(collect, trainer, prompts, key, str(out), budget_s=budget_s, max_steps=max_steps,
                              group=group, prompts_per_round=prompts_per_round, steps_per_round=steps_per_round,
                              max_new_tokens=max_new_tokens, temperature=temperature, use_tqdm=use_tqdm)
        self._take(trainer)
        if result.steps > 0:
            self.export(out, {"warm_start": asdict(result), "cache_key": key})
        return result

    def _own_trainer(self, **kwargs):
        from rlspec.rollout.speculation.training.drafter_training import DrafterTrainer

        return DrafterTrainer(self.drafter, **{"publish_every": 10**9, **kwargs})  # publishes once, at the end

    def _take(self, trainer) -> None:
        """The drafter takes the trainer's newest published weights (a warm-up trainer is then dropped)."""
        if trainer is self.trainer:
            self.drafter.swap_latest()
            return
        self.drafter.model.load_state_dict(trainer.latest()[1])
        self.drafter.version += 1

    def _load(self, path: Path) -> bool:
        """Install a cached drafter (the online trainer too, which publishes it); False if unreadable."""
        from rlspec.rollout.speculation.training.warm_start import install_drafter

        if not install_drafter(self.drafter, self.trainer, path):
            return False
        if self.trainer is not None:
            self.drafter.swap_latest()
        return True

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.stop()
