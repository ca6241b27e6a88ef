"""RolloutBackend: what a trainer may use of whatever produces its rollouts, and the registry of them.

Trainers (trainers/rollout_source.py) and the run (rlspec/train.py) talk to a backend only through
this protocol, never to an engine's internals, so the in-process engine, a pool of Ray workers and
a vLLM instance are interchangeable (`rollout.backend` in the config). The shape follows TRL's own
vLLM generation object: generate, load_weights, stats, close, plus the learned drafter's life
cycle (warm start, export), which only rlspec has.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from rlspec.rollout.registry import BACKENDS
from rlspec.rollout.types import RolloutResult, SamplingParams

if TYPE_CHECKING:
    import torch

    from rlspec.rollout.speculation.training.warm_start import WarmStartResult
    from rlspec.rollout.types import SpecConfig


@runtime_checkable
class RolloutBackend(Protocol):
    """A rollout producer holding a copy of the policy (and, optionally, a learned drafter)."""

    policy_version: int  # how many load_weights calls it has taken; results carry it

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[RolloutResult]:
        """params.n samples of each prompt, one flat list, prompt-major (prompt 0's n samples first)."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take the policy's parameters (HF names); bumps policy_version."""

    def stats(self) -> dict[str, float]:
        """Slash-named metrics (rollout/..., spec/...) accumulated since the previous call."""

    def release_kv(self) -> None:
        """Hand the KV cache's memory back (to the policy update); the next generate() takes it again."""

    @property
    def has_learned_drafter(self) -> bool:
        """Whether a drafter is trained or loaded for this run (warm start and export apply)."""

    def warm_start_drafter(self, prompts: list[list[int]], *, budget_s: float, group: int, max_new_tokens: int,
                           temperature: float) -> WarmStartResult:
        """Train the learned drafter on the policy's own rollouts of `prompts` (or load the cached result)."""

    def export_drafter(self, path: str, metadata: dict | None = None) -> str:
        """Write the learned drafter in the EAGLE-3 format vLLM and SGLang load; returns the directory."""

    def close(self) -> None:
        """Stop background work (drafter training, workers); a learned drafter stays exportable."""


def drafter_intake(backend):
    """The backend's optional `drafter_intake()` (rollout/speculation/training/intake.py): where a trainer that runs the
    policy over every rollout anyway sends the learned drafter's training samples (trainers/drafter_feed.py).
    None when the backend has none (a Ray pool: its engines keep banking their own) or nothing trains a drafter."""
    get = getattr(backend, "drafter_intake", None)
    return get() if get is not None else None


# name -> factory(policy, tokenizer, spec, **engine_kwargs) -> RolloutBackend. `policy` is a bare HF causal
# LM (already gathered when ZeRO-3 partitions it); engine_kwargs are the rollout section's engine settings.
BackendFactory = Callable[..., RolloutBackend]
register_backend = BACKENDS.register  # @register_backend("mine") above a factory


def build_backend(name: str, policy, tokenizer, spec: SpecConfig | None, **engine_kwargs) -> RolloutBackend:
    """The backend `name` (rollout.backend) holding a copy of `policy`."""
    return BACKENDS.build(name, policy, tokenizer, spec, **engine_kwargs)


# Every backend registers here, with a factory that imports its module (and Ray or vLLM) only when built.
@register_backend("engine")
def _engine_backend(policy, tokenizer, spec, **engine_kwargs) -> RolloutBackend:
    from rlspec.rollout.engine import RolloutEngine

    return RolloutEngine.from_hf_model(policy, tokenizer, spec=spec, **engine_kwargs)


@register_backend("ray")
def _ray_backend(policy, tokenizer, spec, **kwargs) -> RolloutBackend:
    """N engine replicas as Ray actors (rollout/workers/); kwargs: the engine's settings plus workers,
    ray_address, groups_per_task, worker_threads, drafter_trainer, drafter_trainer_gpus."""
    try:
        from rlspec.rollout.workers.pool import RayPool
    except ImportError as e:
        raise ImportError(f"rollout.backend=ray needs Ray ({e}); install it with pip install 'rlspec[ray]'") from None
    return RayPool(policy, tokenizer, spec, **kwargs)


@register_backend("vllm")
def _vllm_backend(policy, tokenizer, spec, **engine_kwargs) -> RolloutBackend:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ImportError("rollout.backend=vllm needs vLLM, which this environment lacks; run inside the one "
                          "`make vllm-venv` builds (.venv-vllm), see docs/vllm_backend.md")
    from rlspec.rollout.vllm_backend.backend import VLLMBackend

    return VLLMBackend(policy, tokenizer, spec, **engine_kwargs)
