"""The drafter trainer's own process: rebuild the trainer from a Recipe, then serve the proxy.

The child trains one step at a time while the engine reports idle compute, takes in every queued
message between steps (samples, commands), copies each newly published version into the shared
publishing area and refreshes a metrics snapshot at most every STATS_EVERY_S. It exits when asked
(after publishing its last weights) or when the rollout process is gone. See trainer_process.py.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from rlspec.rollout.runtime.model.llama import LlamaForCausalLM, RMSNorm

log = logging.getLogger(__name__)

STATS_BYTES = 1 << 16
STATS_EVERY_S = 0.5  # how often the child refreshes its metrics snapshot while training
FAILED = "drafter/failed"


@dataclass
class Recipe:
    """What the child needs to rebuild the drafter and the part of the target a trainer reads."""

    factory: str  # "module:name" of the trainer class (or any callable taking the drafter)
    kwargs: dict  # its keyword arguments
    threads: int  # torch threads of the child
    nice: int  # scheduling niceness added in the child (19: only cycles nobody else wants)
    device: str
    dtype: torch.dtype  # the target's (and the engine's drafter's) dtype
    cfg: Any  # the target's ModelConfig
    embed: torch.Tensor  # [V, H], shared memory
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor | None  # [V, H]; None when tied to the embedding
    rope: tuple[torch.Tensor, torch.Tensor] | None  # [max_len, hd] float32 cos, sin (None: built on demand)
    net_cls: type  # the drafter network's class, rebuilt as net_cls(net_cfg)
    net_cfg: Any
    name: str
    aux_layers: tuple


class TargetView(nn.Module):
    """The target as a trainer sees it: cfg, model.embed_tokens, model.norm, lm_head, rope_cos/sin and
    init_rope (the engine's own code, so tables match). No decoder layers: features come from rollouts."""

    init_rope = LlamaForCausalLM.init_rope

    def __init__(self, r: Recipe):
        super().__init__()
        self.cfg = r.cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding.from_pretrained(r.embed, freeze=True)
        self.model.norm = RMSNorm(r.cfg.hidden_size, r.cfg.rms_norm_eps)
        self.model.norm.weight = nn.Parameter(r.norm, requires_grad=False)
        self.lm_head = nn.Linear(r.cfg.hidden_size, r.cfg.vocab_size, bias=False, device="meta")
        self.lm_head.weight = self.model.embed_tokens.weight if r.lm_head is None else \
            nn.Parameter(r.lm_head, requires_grad=False)
        self.rope_cos, self.rope_sin = r.rope if r.rope is not None else (None, None)

    def to_device(self, device: torch.device) -> "TargetView":
        self.to(device)
        if self.rope_cos is not None:  # plain attributes, as in the engine's model: moved by hand
            self.rope_cos, self.rope_sin = self.rope_cos.to(device), self.rope_sin.to(device)
        return self

    def forward(self, *args, **kwargs):
        raise RuntimeError("the drafter trainer's process holds no decoder layers of the target")


class DrafterView:
    """The learned drafter as a trainer sees it: .target, .model / network(), name, aux_layers."""

    def __init__(self, target: TargetView, model: nn.Module, name: str, aux_layers: tuple):
        self.target, self.model, self.name, self.aux_layers, self.version = target, model, name, aux_layers, 0

    def network(self) -> nn.Module:
        return self.model


def build(recipe: Recipe, initial_state: dict) -> Any:
    """The trainer the recipe names, over views of the drafter (weights `initial_state`) and target."""
    dev = torch.device(recipe.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    target = TargetView(recipe).to_device(dev)
    net = network_from_state(recipe.net_cls, recipe.net_cfg, initial_state)
    net = net.to(device=dev, dtype=recipe.dtype).eval()  # as the engine holds it: the trainer makes its own master
    module, _, attr = recipe.factory.partition(":")
    factory = getattr(importlib.import_module(module), attr)
    return factory(DrafterView(target, net, recipe.name, recipe.aux_layers), **recipe.kwargs)


def network_from_state(cls, cfg, state: dict) -> nn.Module:
    """cls(cfg) holding copies of `state`, built without a throwaway random init (which would also
    draw from the global RNG)."""
    with torch.device("meta"):
        net = cls(cfg)
    # assign=True takes each tensor as it is: keep the network's own dtypes (a state whose floats were
    # cast for transport may carry d2t as float, and an index buffer must stay long)
    dtypes = {k: t.dtype for k, t in [*net.named_parameters(), *net.named_buffers()]}
    net.load_state_dict({k: v.to(dtypes.get(k, v.dtype), copy=True) for k, v in state.items()}, assign=True)
    return net


def _child_main(recipe: Recipe, ch) -> None:
    # Ctrl-C, and Slurm's or a container runtime's SIGTERM, hit the whole process group: the parent decides (it
    # saves this process's state in its checkpoint, then stops it); a parent gone is noticed in _serve
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # the parent started this process with them blocked
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    ch.outbox.cancel_join_thread()  # answers to a parent that stopped listening must not block exit
    if recipe.nice:
        os.nice(recipe.nice)
    torch.set_num_threads(recipe.threads)
    stats = _Stats(ch)
    try:
        trainer = build(recipe, ch.state)
        _serve(trainer, ch, stats, _Publisher(trainer, ch))
    except Exception as exc:  # reported through the metrics; the engine keeps its last drafter
        traceback.print_exc()
        stats.write({**stats.last, FAILED: 1.0, "error": repr(exc)[:2000]})


def _serve(trainer, ch, stats: "_Stats", pub: "_Publisher") -> None:
    parent = mp.parent_process()
    can_train = True  # False after a step that made no progress (no data yet), until something changes
    while not ch.stop.is_set():
        if parent is not None and not parent.is_alive():
            return  # the rollout process is gone (killed): nobody left to train for
        idle = ch.idle.is_set()
        try:
            msg = ch.inbox.get_nowait() if idle and can_train else ch.inbox.get(timeout=0.1)
        except queue.Empty:
            msg, can_train = None, True
        if msg is not None:
            _handle(msg, trainer, ch, stats, pub)
            can_train = True
            continue  # take in everything queued before the next step
        if idle and can_train:
            before = trainer.stats.steps
            trainer.train_steps(1)  # one step at a time: a busy engine gets its cycles back within a step
            can_train = trainer.stats.steps > before
            pub.maybe()
        stats.maybe(trainer)
    pub.flush()
    stats.maybe(trainer, force=True)


def _handle(msg: tuple, trainer, ch, stats: "_Stats", pub: "_Publisher") -> None:
    kind = msg[0]
    if kind == "add":
        (args, kwargs), nbytes = msg[1], msg[2]
        trainer.add(*args, **kwargs)
        ch.consumed.value += nbytes  # only the child writes it: the proxy's in-flight budget
    elif kind == "train":
        loss = trainer.train_steps(msg[2])
        pub.maybe()
        stats.maybe(trainer, force=True)
        ch.outbox.put((msg[1], float(loss)))
    elif kind == "load":
        trainer.load_weights(msg[2])
        pub.flush()
        ch.outbox.put((msg[1], pub.version))
    elif kind == "state":  # a plug-in trainer without state_dict has none to give (the proxy warns)
        ch.outbox.put((msg[1], trainer.state_dict() if hasattr(trainer, "state_dict") else None))
    elif kind == "load_state":
        trainer.load_state_dict(msg[2])
        pub.restored()
        stats.maybe(trainer, force=True)
        ch.outbox.put((msg[1], pub.version))
    elif kind == "flush":
        pub.flush()
        stats.maybe(trainer, force=True)
        ch.outbox.put((msg[1], pub.version))
    else:
        raise ValueError(f"unknown message {kind!r}")


class _Publisher:
    """Copies each new (version, state) of the trainer into the shared publishing area."""

    def __init__(self, trainer, ch):
        self.trainer, self.ch = trainer, ch
        self.version, self.steps_at = 0, 0

    def maybe(self) -> None:
        latest = self.trainer.latest()
        if latest is None or latest[0] <= self.version:
            return
        version, state = latest
        with self.ch.weights_lock:  # the proxy try-locks: it never waits on this copy
            for k, t in self.ch.state.items():
                t.copy_(state[k])
            self.ch.version.value = version
        self.version, self.steps_at = version, self.trainer.stats.steps

    def restored(self) -> None:
        """The trainer was restored from a checkpoint: publish what it had published (if anything),
        and count steps since its last publication from where it left off."""
        self.version = 0
        with self.ch.weights_lock:
            self.ch.version.value = 0
        self.maybe()
        self.steps_at = getattr(self.trainer, "published_at", self.trainer.stats.steps)

    def flush(self) -> None:
        """Publish the master weights now if they moved since the last publication (export, stop)."""
        if self.trainer.stats.steps > self.steps_at and hasattr(self.trainer, "publish"):
            self.trainer.publish()
        self.maybe()


class _Stats:
    """The trainer's metrics as JSON in shared memory (computed for policy version 0)."""

    def __init__(self, ch):
        self.ch, self.t, self.last = ch, 0.0, {}

    def maybe(self, trainer, force: bool = False) -> None:
        if force or time.monotonic() - self.t >= STATS_EVERY_S:
            self.t = time.monotonic()
            self.write(trainer.metrics(0))

    def write(self, m: dict) -> None:
        self.last = dict(m)
        raw = json.dumps(m).encode()
        if len(raw) > STATS_BYTES:
            raw = json.dumps({k: v for k, v in m.items() if k != "error"} | {"error": "(too long)"}).encode()
        with self.ch.stats_lock:
            self.ch.stats_buf[:len(raw)] = raw
            self.ch.stats_len.value = len(raw)
