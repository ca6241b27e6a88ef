"""TLT's spot drafter trainer on Ray: every worker's features feed one trainer; one drafter per run.

SpotLink sits in each worker where the engine expects its online trainer (Speculation.attach_trainer):
the learned drafter hands it every finished sample (features of three target layers, tokens, the
target's top-k law), as it would a DrafterTrainer; after each task the link ships the task's samples
to the hub in one fire-and-forget call (the rollout never waits for the trainer). The link never
publishes weights itself: the pool broadcasts the hub's versions to every worker between tasks.

DrafterHub is the one trainer: rollout/speculation/drafter_training.DrafterTrainer (its buffer, loss,
optimizer and background loop, unchanged) over the views rollout/speculation/trainer_child.build rebuilds
from a worker's recipe: the drafter network and the target's embedding, final norm and LM head, no
decoder layers. Two placements (rollout.drafter_trainer):
  spot       the hub reserves no resources of its own and trains only while the pool says some
             worker's share of the batch is done (set_idle), i.e. on the cycles that worker leaves;
             on one machine it runs at the lowest CPU priority, so it never takes a busy core
  dedicated  the hub reserves a CPU (or a GPU: rollout.drafter_trainer_gpus) and trains continuously
See docs/workers.md#spot-training.
"""
from __future__ import annotations

import os
import time

import torch

from rlspec.rollout.speculation.training.feature_buffer import Dist


class SpotLink:
    """The online-trainer interface inside a worker (what Eagle3Drafter and Speculation call)."""

    def __init__(self, hub, rank: int, topk: int = 32):
        self.hub, self.rank, self.topk = hub, rank, topk
        self._outbox: list[tuple] = []
        self.shipped_samples = 0
        self.shipped_tokens = 0
        self.stats = _Steps()

    def add(self, feats: torch.Tensor, token_ids: list[int], policy_version: int, dist: Dist | None = None,
            temperature: float = 1.0) -> None:
        """A finished sample, copied out of the engine's staging buffers (they are reused next call)."""
        d = None if dist is None else Dist(*(t.detach().cpu().clone() for t in (dist.ids, dist.probs, dist.rest,
                                                                                dist.has)))
        self._outbox.append((feats.detach().cpu().clone(), list(token_ids), policy_version, d, temperature))

    def flush(self) -> None:
        """Send the samples gathered since the last flush to the hub (no wait for its answer)."""
        if not self._outbox:
            return
        self.shipped_samples += len(self._outbox)
        self.shipped_tokens += sum(len(s[1]) - 1 for s in self._outbox)
        self.hub.add.remote(self._outbox)
        self._outbox = []

    def latest(self):
        return None  # weights come from the pool's broadcast (RolloutWorker.set_drafter), not from here

    def set_idle(self, idle: bool) -> None:
        pass  # the pool, which sees every worker, decides when the hub may train

    def metrics(self, policy_version: int) -> dict[str, float]:
        return {"drafter/shipped_samples": float(self.shipped_samples),
                "drafter/shipped_tokens": float(self.shipped_tokens)}

    def stop(self) -> None:
        self.flush()


class _Steps:
    steps = 0  # warm_start and export read trainer.stats.steps; the link trains nothing itself


class DrafterHub:
    """The run's one drafter trainer (made a Ray actor by the pool)."""

    def __init__(self, recipe, initial_state: dict, mode: str):
        from rlspec.rollout.speculation.training.trainer_child import build

        torch.set_num_threads(max(1, recipe.threads))
        if mode == "spot" and recipe.device == "cpu":
            os.nice(19)  # only cycles the rollout workers leave idle
        self.mode = mode
        self.trainer = build(recipe, initial_state)
        self.trainer.start()
        self.trainer.set_idle(mode == "dedicated")
        self.idle_s, self._idle_since = 0.0, None
        self.samples = 0

    def add(self, samples: list[tuple]) -> int:
        for feats, ids, version, dist, temperature in samples:
            self.trainer.add(feats, ids, version, dist, temperature)
        self.samples += len(samples)
        return self.samples

    def set_idle(self, idle: bool) -> None:
        """spot: some worker's share is done (True) / every worker is busy or the step is over (False)."""
        if self.mode != "spot":
            return
        now = time.perf_counter()
        if idle and self._idle_since is None:
            self._idle_since = now
        elif not idle and self._idle_since is not None:
            self.idle_s += now - self._idle_since
            self._idle_since = None
        self.trainer.set_idle(idle)

    def latest(self, newer_than: int):
        """(version, float32 CPU weights) when a version newer than `newer_than` is published, else None."""
        pub = self.trainer.latest()
        if pub is None or pub[0] <= newer_than:
            return None
        return pub[0], {k: v.detach().float().cpu() for k, v in pub[1].items()}

    def train_steps(self, n: int) -> float:
        """n steps now, then publish (between RL steps, scripts and tests); the last loss."""
        loss = self.trainer.train_steps(n)
        self.trainer.publish()
        return loss

    def load_weights(self, state: dict) -> int:
        """Continue from these weights (a warm-started drafter); published as a new version."""
        self.trainer.load_weights(state)
        return self.trainer.version

    def weights(self) -> tuple[int, dict]:
        """(version, float32 master weights): what the pool exports once for the run."""
        with self.trainer.lock:
            return self.trainer.version, {k: v.detach().float().cpu() for k, v in self.trainer.model.state_dict().items()}

    def metrics(self, policy_version: int) -> dict[str, float]:
        m = self.trainer.metrics(policy_version)
        m["drafter/samples_received"] = float(self.samples)
        m["drafter/spot_idle_s"] = self.idle_s
        return m

    def stop(self) -> None:
        self.trainer.stop()
