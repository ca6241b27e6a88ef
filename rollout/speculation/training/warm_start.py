"""Warm start: train the EAGLE-3 drafter on the target's own rollouts before the first RL step,
and cache the result so later runs of the same target start warm.

A cold drafter is accepted ~1.0 tokens per verify until online training catches up. `warm_start`
gives it a bounded head start: rounds of (sample the given prompts with the target, plain decoding,
the drafter banking features and target distributions; then train), until a budget in seconds
and/or optimizer steps is spent, with a tqdm bar. The result is saved as an EAGLE-3 directory
(eagle3_io, the vLLM/SGLang format) under

    $RLSPEC_CACHE (default ~/.cache/rlspec) / drafters / <key> /

where key = sha256 of the target's weights + the drafter's config (+ an optional caller tag, e.g.
the data set's name). The prompts are not part of the key: a drafter warmed on some prompts of a
task serves the others, and online training adapts it from there. A second call with the same
target finds the directory and only loads it (`cached=True`). RL updates change the weights, so
the key also tells a fine-tuned checkpoint from its base.

Fingerprint: every tensor's name, shape and dtype, and up to `sample` of its elements at evenly
spaced positions (all of them for tensors that small); sampling keeps hashing a 7B model within
seconds, and an update that moves no sampled element of any tensor is not a realistic training
outcome. Pass sample=None for an exact hash of every byte.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

RECIPE_VERSION = 1  # bump when the warm-up recipe changes enough that cached drafters should retrain


@dataclass
class WarmStartResult:
    key: str
    path: str
    cached: bool  # True: loaded from the cache, no training
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0  # buffered training positions
    loss: float = float("nan")


def cache_dir(root: str | os.PathLike | None = None) -> Path:
    """$RLSPEC_CACHE/drafters (default ~/.cache/rlspec/drafters), or root/drafters."""
    base = root or os.environ.get("RLSPEC_CACHE") or Path.home() / ".cache" / "rlspec"
    return Path(base).expanduser() / "drafters"


def weights_fingerprint(model: torch.nn.Module, sample: int | None = 1 << 16) -> str:
    """sha256 hex of the model's state (see the module docstring for `sample`)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        flat = t.reshape(-1)
        if sample is not None and flat.numel() > sample:
            flat = flat[sample_positions(flat.numel(), sample).to(flat.device)]
        # bytes of the raw values, whatever the dtype (bf16 has no numpy view: go through int16)
        raw = flat.contiguous().view(torch.int16 if flat.element_size() == 2 else flat.dtype) \
            if flat.dtype.is_floating_point else flat
        h.update(raw.cpu().numpy().tobytes())
    return h.hexdigest()


def sample_positions(n: int, sample: int) -> torch.Tensor:
    """`sample` evenly spaced positions in [0, n), first and last included, in exact integer
    arithmetic (float32 linspace rounds n - 1 up to n for tensors past 2^24 elements)."""
    return torch.arange(sample, dtype=torch.long) * (n - 1) // max(sample - 1, 1)


def cache_key(target: torch.nn.Module, drafter_cfg, tag: str | None = None, sample: int | None = 1 << 16) -> str:
    """The cache key of a drafter for `target`: 24 hex chars of sha256(weights, Eagle3Config, tag)."""
    cfg = drafter_cfg.to_dict() if hasattr(drafter_cfg, "to_dict") else dict(drafter_cfg)
    payload = json.dumps({"weights": weights_fingerprint(target, sample), "drafter": cfg, "tag": tag,
                          "recipe": RECIPE_VERSION}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def load_cached(engine, path: str | os.PathLike) -> bool:
    """Install the drafter saved at `path` into the engine (its trainer too, so online training goes
    on from it); False when there is no readable drafter there."""
    spec = engine.speculation
    return spec.learned is not None and install_drafter(spec.learned, spec.trainer, path)


def install_drafter(drafter, trainer, path: str | os.PathLike) -> bool:
    """The EAGLE-3 directory at `path` as `drafter`'s weights (through `trainer` when one trains it, which
    publishes them: the drafter swaps them in at its next proposal); False when there is no readable
    drafter of the same shape there."""
    from rlspec.rollout.speculation.drafters.eagle3_io import load_eagle3

    try:
        model = load_eagle3(str(path))
    except (FileNotFoundError, ValueError):
        return False
    if model.cfg != drafter.model.cfg:
        return False
    if trainer is not None:
        trainer.load_weights(model.state_dict())
    else:
        drafter.model.load_state_dict(model.state_dict())
        drafter.version += 1
    return True


def warm_start(engine, prompts: list[list[int]], budget_s: float | None = 600.0, max_steps: int | None = None,
               *, group: int = 4, prompts_per_round: int = 16, steps_per_round: int = 50,
               max_new_tokens: int = 256, temperature: float = 1.0, tag: str | None = None,
               root: str | os.PathLike | None = None, use_tqdm: bool = True, **trainer_kwargs) -> WarmStartResult:
    """Warm the engine's learned drafter before RL: load it from the cache, or train and cache it.

    engine: a RolloutEngine with a learned drafter (SpecConfig drafter "eagle3" or "auto");
    prompts: token-id lists (the RL prompts: the target's own rollouts of them are the data);
    budget_s / max_steps: stop when either is spent (at least one must be set); a round that has
    started collecting finishes, so the wall time may exceed budget_s by one round's rollouts.
    Uses the engine's own online trainer when it has one (its buffer keeps the data); otherwise a
    DrafterTrainer(**trainer_kwargs) built here for the warm-up and detached after it (the drafter
    keeps its weights).
    """
    if budget_s is None and max_steps is None:
        raise ValueError("warm_start needs a budget: budget_s and/or max_steps")
    spec = engine.speculation
    if spec.learned is None:
        raise ValueError("warm_start needs a learned drafter: SpecConfig(drafter='eagle3' or 'auto')")
    key = cache_key(engine.model, spec.learned.model.cfg, tag)
    out = cache_dir(root) / key
    if (out / "config.json").is_file() and load_cached(engine, out):
        return WarmStartResult(key, str(out), cached=True)

    trainer, own_trainer = spec.trainer, spec.trainer is None
    if own_trainer:
        from rlspec.rollout.speculation.training.drafter_training import DrafterTrainer

        trainer = spec.attach_trainer(DrafterTrainer(spec.learned, publish_every=10**9, **trainer_kwargs))
    from rlspec.rollout.speculation.selectors.base import OFF

    def collect(batch, params):
        with spec.forced(OFF):  # collect plainly (a cold drafter only costs time); features are still captured
            engine.generate(batch, params)

    result = train_rounds(collect, trainer, prompts, key, out, budget_s=budget_s, max_steps=max_steps, group=group,
                          prompts_per_round=prompts_per_round, steps_per_round=steps_per_round,
                          max_new_tokens=max_new_tokens, temperature=temperature, use_tqdm=use_tqdm)
    if result.steps > 0:  # the trainer's weights, in-thread or from its process (export reads either)
        engine.export_drafter(str(out), metadata={"warm_start": asdict(result), "cache_key": key, "tag": tag})
    if own_trainer:  # no online training follows: keep the weights, stop staging data nobody trains on
        spec.detach_trainer()
    return result


def train_rounds(collect, trainer, prompts: list[list[int]], key: str, out: Path, *, budget_s: float | None,
                 max_steps: int | None, group: int, prompts_per_round: int, steps_per_round: int, max_new_tokens: int,
                 temperature: float, use_tqdm: bool) -> WarmStartResult:
    """The warm-up loop of every backend: rounds of collect(batch, params) (the target's rollouts of the next
    prompts_per_round prompts, whose features reach `trainer`: the engine banks them, the vLLM backend feeds
    the policy's pass), then up to steps_per_round optimizer steps, until budget_s or max_steps is spent; a
    round that started collecting finishes. Publishes the weights and says what the warm-up did."""
    from rlspec.rollout.types import SamplingParams

    t0, steps0, rnd = time.perf_counter(), trainer.stats.steps, 0
    left_s = lambda: float("inf") if budget_s is None else budget_s - (time.perf_counter() - t0)  # noqa: E731
    left_steps = lambda: 10**12 if max_steps is None else max_steps - (trainer.stats.steps - steps0)  # noqa: E731
    bar = _bar(budget_s, max_steps, use_tqdm)
    while left_s() > 0 and left_steps() > 0 and prompts:
        batch = [prompts[(rnd * prompts_per_round + i) % len(prompts)] for i in range(min(prompts_per_round,
                                                                                          len(prompts)))]
        collect(batch, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, n=group, seed=rnd))
        _tick(bar, t0, budget_s, trainer.stats.loss, step=False)
        for _ in range(min(steps_per_round, left_steps())):
            if left_s() <= 0:
                break
            trainer.train_steps(1)
            _tick(bar, t0, budget_s, trainer.stats.loss)
        rnd += 1
    if bar is not None:
        bar.close()
    trainer.publish()
    tokens = int(trainer.metrics(0).get("drafter/buffer_tokens", 0))
    return WarmStartResult(key, str(out), cached=False, steps=trainer.stats.steps - steps0,
                           seconds=time.perf_counter() - t0, tokens=tokens, loss=float(trainer.stats.loss))


def _bar(budget_s, max_steps, use_tqdm):
    if not use_tqdm:
        return None
    from tqdm.auto import tqdm

    if budget_s is not None:
        return tqdm(total=round(budget_s), desc="drafter warm-up", unit="s")
    return tqdm(total=max_steps, desc="drafter warm-up", unit="step")


def _tick(bar, t0, budget_s, loss, step: bool = True) -> None:
    """Seconds bars move to the elapsed time; steps bars by one per optimizer step."""
    if bar is None:
        return
    bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
    if budget_s is not None:
        bar.n = min(round(time.perf_counter() - t0), bar.total)
        bar.refresh()
    elif step:
        bar.update(1)
