"""RolloutWorker: one RolloutEngine replica inside a Ray actor (the pool makes this class remote).

A worker builds its engine from the policy the pool put in the object store once (config + weights),
runs tasks (one engine.generate over a few whole prompt groups, rollout/workers/tasks.py), takes
policy weights by reference (one ray.put shared by all workers) and drafter weights between tasks.
Every task names the policy version the pool expects: a worker holding other weights refuses the
task instead of returning off-policy samples. With spot drafter training its engine's learned drafter
stages features as usual; a SpotLink (rollout/workers/spot.py) stands in for the online trainer and
ships them to the pool's one DrafterHub after each task.
"""
from __future__ import annotations

import os
import socket

import torch

from rlspec.rollout.types import RolloutResult, SpecConfig
from rlspec.rollout.workers.tasks import Task


class StaleWeightsError(RuntimeError):
    """A worker was asked for samples of a policy version it does not hold."""


class RolloutWorker:
    def __init__(self, rank: int, policy: dict, tokenizer, spec: SpecConfig | None, engine_kwargs: dict,
                 threads: int | None):
        """policy: {"config": HF config, "state": state_dict, "eos": ids} (Ray hands each worker the value
        of the pool's one put); threads: torch threads (CPU workers: 1 each, so N workers use N cores)."""
        if threads is not None:
            torch.set_num_threads(threads)
        self.rank = rank
        self.engine = _build_engine(policy, tokenizer, spec, dict(engine_kwargs))
        self.link = None
        self.spec_totals = [0, 0, 0]  # verifies, drafted, accepted over every task (drafter health)

    def attach_hub(self, hub, topk: int) -> None:
        """Ship this engine's training samples to the DrafterHub (which stages `topk` target probabilities
        per position for its loss) instead of training here."""
        from rlspec.rollout.workers.spot import SpotLink

        self.link = self.engine.speculation.attach_trainer(SpotLink(hub, self.rank, topk))

    # ---- tasks and weights ----------------------------------------------------------------------
    def info(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                "device": str(self.engine.runner.device), "threads": torch.get_num_threads(),
                "learned": self.engine.speculation.learned is not None}

    def run(self, task: Task, policy_version: int, drafter_version: int = 0,
            drafter_state: dict | None = None) -> list[RolloutResult]:
        """One task's samples (prompt_index local to the task). drafter_state: newer drafter weights to
        take first (they arrive between tasks, never inside one), or None."""
        if self.engine.policy_version != policy_version:
            raise StaleWeightsError(f"worker {self.rank} holds policy version {self.engine.policy_version}, the "
                                    f"pool asked for {policy_version}: a weight push did not reach it")
        if drafter_state is not None:
            self.set_drafter(drafter_version, drafter_state)
        before = _spec_counts(self.engine)
        results = self.engine.generate(task.prompts, task.params)
        self.spec_totals = [t + a - b for t, a, b in zip(self.spec_totals, _spec_counts(self.engine), before)]
        if self.link is not None:
            self.link.flush()  # this task's finished samples to the hub, without waiting for it
        return results

    def load_weights(self, named: dict, version: int) -> int:
        """The policy's parameters (HF names, the pool's one object-store copy); returns the version held."""
        self.engine.load_weights(named.items())
        # the pool counts versions: a worker that missed none agrees, and results carry the pool's count
        self.engine.policy_version = version
        self.engine.speculation.set_policy_version(version)
        return version

    def set_drafter(self, version: int, state: dict) -> int:
        """Take learned-drafter weights of `version` if it is newer than the drafter's; returns the version held."""
        learned = self.engine.speculation.learned
        if learned is not None and version > learned.version:
            # not strict: a push missing a tensor must not end the run; the pool reads every worker's drafter back
            # after a push and turns speculation off when what is held is not what was sent (drafter health)
            learned.model.load_state_dict(state, strict=False)
            learned.version = version
            learned.valid = {k: 0 for k in learned.valid}  # its KV came from the old weights
        return self.drafter_version()

    def drafter_fingerprint(self) -> tuple[int, dict]:
        """(version, fingerprint of the draft weights in use): what the pool compares with what it sent."""
        from rlspec.rollout.speculation.drafter_health import fingerprint

        learned = self.engine.speculation.learned
        return (learned.version, fingerprint(learned.model.state_dict())) if learned is not None else (0, {})

    def set_speculation(self, on: bool) -> bool:
        """Speculate (the selector chooses) or decode plainly (drafter health turned speculation off)."""
        self.engine.speculation.set_healthy(on)
        return on

    def spec_counts(self) -> list[int]:
        """Verifies, drafted and accepted tokens over every task so far."""
        return list(self.spec_totals)

    def drafter_version(self) -> int:
        learned = self.engine.speculation.learned
        return learned.version if learned is not None else 0

    # ---- the learned drafter ----------------------------------------------------------------------
    def drafter_recipe(self, trainer_kwargs: dict, threads: int, device: str | None):
        """What the DrafterHub needs to rebuild this drafter and the target's embedding/head (no layers)."""
        from rlspec.rollout.speculation.training.trainer_process import _recipe

        learned = self.engine.speculation.learned
        return _recipe(learned, "rlspec.rollout.speculation.training.drafter_training:DrafterTrainer", trainer_kwargs, threads, device, 0), \
            {k: v.detach().float().cpu() for k, v in learned.network().state_dict().items()}

    def drafter_network(self) -> torch.nn.Module:
        """The learned drafter's network, float32 on the CPU (the pool exports it where it runs)."""
        import copy

        return copy.deepcopy(self.engine.speculation.learned.network()).float().cpu()

    def drafter_state(self) -> dict:
        return {k: v.detach().float().cpu() for k, v in self.engine.speculation.learned.network().state_dict().items()}

    def warm_start(self, prompts, **kwargs) -> tuple[dict, dict]:
        """The engine's own warm start (rollout/speculation/training/warm_start.py) with the spot link set aside; returns
        (the WarmStartResult as a dict, the drafter's weights) for the pool to hand to the hub."""
        from dataclasses import asdict

        spec = self.engine.speculation
        link, spec.trainer = spec.trainer, None  # warm_start trains with a trainer of its own
        try:
            result = self.engine.warm_start_drafter(prompts, **kwargs)
        finally:
            spec.trainer = link
            spec.learned.attach(link)
            spec.learned.version = 0  # the pool numbers the run's drafter versions; it sends these weights back
        return asdict(result), self.drafter_state()

    def hf_config(self):
        return self.engine.model.cfg.hf_config

    def stats(self) -> dict[str, float]:
        out = self.engine.stats()
        out["drafter/version"] = float(self.drafter_version())
        return out

    def release_kv(self) -> None:
        self.engine.release_kv()

    def close(self) -> None:
        self.engine.close()


def _spec_counts(engine) -> tuple[int, int, int]:
    """The engine's verifies, drafted and accepted tokens since its last stats() (read, not reset: stats() is
    what the trainer logs)."""
    m = engine._metrics
    return sum(m.accept_hist.values()), m.drafted, m.accepted


def _build_engine(policy: dict, tokenizer, spec: SpecConfig | None, kwargs: dict):
    """The engine from_hf_model would build, straight from the config and weights (no HF model needed)."""
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.model import loader

    device = "cuda" if torch.cuda.is_available() else "cpu"  # Ray gives a GPU worker exactly one device
    dtype, head_dtype = kwargs.pop("dtype", None), kwargs.pop("head_dtype", None)
    body = loader.body_tensor(policy["state"].items())
    model = loader.build_model(policy["config"], loader.resolve_dtype(dtype) if dtype else body.dtype, device,
                               policy.get("family"))
    loader.cast_head(model, head_dtype)
    loader.load_named_tensors(model, policy["state"].items())  # checks every runtime tensor is written once
    return RolloutEngine(model, tokenizer, spec, eos_token_ids=policy["eos"], **kwargs)
