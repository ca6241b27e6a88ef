"""The online drafter trainer in a process of its own, behind the trainer interface the engine uses.

Why a process: as a thread inside the rollout process the trainer shares the interpreter (GIL) and
torch's thread pool with decoding and with the policy update; on a 2-core CPU a GRPO run with it
took twice as long. In its own process it gets its own thread budget (`threads`) and runs at a low
scheduling priority (`nice`, 19 by default), so the kernel hands it only the cycles the rollout and
the policy update leave idle, and it trains only while the engine reports idle compute.

`ProcessTrainer(drafter, factory, **trainer_kwargs)` is a generic proxy: the child builds the real
trainer (`factory`, "module:name", DrafterTrainer by default) from a picklable recipe of what a
trainer may read of the drafter and its target: the drafter network (class, config, weights) and a
target view holding the embedding, the final norm, the LM head, the config and the RoPE tables (no
decoder layers: features come from the rollouts). The proxy forwards calls without knowing the
trainer's internals:
  add(*args, **kwargs)   tensors are copied into shared memory and queued (the engine's buffers
                         stay its own); when the child is `max_inflight_mb` behind, the NEWEST
                         sample is dropped (counted in drafter/dropped_samples): the producer cannot
                         take back what it already queued, and the rollout never blocks
  latest()               newest published (version, state_dict): the child copies published weights
                         into preallocated shared float32 tensors and bumps a shared version; the
                         proxy only reads an integer unless a newer version exists, and never waits
                         for the child's lock (it keeps the previous version instead)
  set_idle(bool)         a shared event; metrics() / stats from a JSON snapshot the child writes
  train_steps(n)         synchronous request/response (scripts, tests, warm start)
  publish()              the child publishes its current weights now
  state_dict()           the child's trainer state (weights, optimizer, buffer: checkpoints) and
  load_state_dict(s)     back; None from a child that is gone
  model                  float32 drafter network of the newest weights (export)
  stop()                 the child publishes its final weights and exits; joined, and at exit
A crash in the child is reported (drafter/failed = 1); the engine keeps its last drafter. On CUDA
features travel through host memory and the child trains on `device` (another GPU, or the same one
as a separate context; SpecConfig's "auto" keeps a thread with its own stream there instead).
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import queue
import signal
import sys
import time
import weakref
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

from rlspec.rollout.speculation.training.drafter_training import DEFAULT_LOSS, DEFAULT_TOPK
from rlspec.rollout.speculation.training.trainer_child import FAILED, STATS_BYTES, Recipe, _child_main, network_from_state

log = logging.getLogger(__name__)

DEFAULT_FACTORY = "rlspec.rollout.speculation.training.drafter_training:DrafterTrainer"


class ProcessTrainer:
    def __init__(self, drafter, factory: str = DEFAULT_FACTORY, threads: int | None = None,
                 device: str | None = None, nice: int = 19, max_inflight_mb: float = 256.0, **trainer_kwargs):
        """drafter: the engine's learned drafter (its .target and .network() are read once, here);
        threads: torch threads of the child (None: half the cores this process may use, at least 1);
        device: where the child trains (None: the target's device)."""
        ctx = mp.get_context("spawn")  # fork would copy a CUDA context and torch's thread pools
        net = drafter.network()
        self._net_cls, self._net_cfg = type(net), net.cfg
        # the publishing area, initialised to the drafter's current weights: `model` is valid at once
        self._state = {k: _shared_copy(v.float() if v.is_floating_point() else v) for k, v in net.state_dict().items()}
        self._version = ctx.RawValue("q", 0)
        self._weights_lock = ctx.Lock()
        self._stats_buf, self._stats_len, self._stats_lock = ctx.RawArray("c", STATS_BYTES), ctx.RawValue("i", 0), ctx.Lock()
        self._consumed = ctx.RawValue("q", 0)  # bytes of samples the child has taken in
        self._inbox, self._outbox = ctx.Queue(), ctx.Queue()
        self._inbox.cancel_join_thread()  # never hang interpreter exit on samples a dead child won't read
        self._idle, self._stop_evt = ctx.Event(), ctx.Event()
        self._sent, self._dropped, self._max_inflight = 0, 0, int(max_inflight_mb * 2**20)
        self._seen, self._latest, self._idle_now, self._stopped = 0, None, False, False
        self._stats_cache: dict[str, float] = {}
        self._req = itertools.count(1)
        # what the child's trainer keeps of the target's distribution per position (0 when its loss reads none),
        # so the engine and the trainer's feed send it the laws they send a trainer in this process
        self.topk = 0 if factory != DEFAULT_FACTORY or trainer_kwargs.get("loss", DEFAULT_LOSS) == "ce" else \
            int(trainer_kwargs.get("topk", DEFAULT_TOPK))
        recipe = _recipe(drafter, factory, trainer_kwargs, threads, device, nice)
        channels = SimpleNamespace(inbox=self._inbox, outbox=self._outbox, idle=self._idle, stop=self._stop_evt,
                                   state=self._state, version=self._version, weights_lock=self._weights_lock,
                                   stats_buf=self._stats_buf, stats_len=self._stats_len, stats_lock=self._stats_lock,
                                   consumed=self._consumed)
        self._proc = ctx.Process(target=_child_main, args=(recipe, channels), name="drafter-trainer", daemon=True)
        with _main_not_reimported(), _signals_blocked():
            self._proc.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._proc, self._stop_evt)

    # ---- the trainer interface ----------------------------------------------------------------
    def add(self, *args, **kwargs) -> None:
        """A finished sample, forwarded to the child's trainer.add (tensors via shared memory)."""
        if self._stopped or not self._proc.is_alive():
            return
        nbytes = sum(t.numel() * t.element_size() for t in _tensors((args, kwargs)))
        if self._sent - self._consumed.value + nbytes > self._max_inflight:
            self._dropped += 1
            return
        self._inbox.put(("add", _share((args, kwargs)), nbytes))
        self._sent += nbytes

    def latest(self) -> tuple[int, dict] | None:
        """(version, state_dict of float32 CPU tensors) of the newest weights the child published."""
        if self._version.value > self._seen and self._weights_lock.acquire(block=False):
            try:
                version = self._version.value
                state = {k: v.clone() for k, v in self._state.items()}
            finally:
                self._weights_lock.release()
            self._seen, self._latest = version, (version, state)
        return self._latest

    @property
    def version(self) -> int:
        return self._seen

    def set_idle(self, idle: bool) -> None:
        if idle != self._idle_now:  # the engine says this every decode step; the event is a syscall
            self._idle_now = idle
            (self._idle.set if idle else self._idle.clear)()

    def load_weights(self, state: dict) -> None:
        """Continue training from these drafter weights (a warm-started drafter); they are published."""
        self._request("load", {k: v.detach().cpu() for k, v in state.items()})
        self.latest()

    def publish(self) -> None:
        """Make the child publish its current weights now, and take them."""
        self._request("flush")
        self.latest()

    def train_steps(self, n: int) -> float:
        """n optimizer steps in the child now; the last loss (nan without data, or if the child is gone)."""
        reply = self._request("train", n)
        return float("nan") if reply is None else reply

    def state_dict(self) -> dict | None:
        """The child's trainer state (DrafterTrainer.state_dict: samples still queued are taken in
        first) plus the proxy's count of dropped samples, so a thread trainer loads it too; None
        when the child is gone (crashed, killed or stopped: its training state went with it) or its
        trainer has no state_dict."""
        try:
            reply = self._request("state")
        except DrafterTrainerTimeout as exc:
            log.warning("%s", exc)
            reply = None
        if reply is None:
            log.warning("the drafter trainer's process gave no state (it is gone, or its trainer has no "
                        "state_dict): its training state is not in the checkpoint")
            return None
        self.latest()
        return {**_cpu_copy(reply), "dropped": self._dropped}

    def load_state_dict(self, state: dict) -> None:
        """Continue from state_dict(): the child restores its trainer and republishes what it had
        published, which the engine's drafter takes as it would have."""
        reply = self._request("load_state", _share({k: v for k, v in state.items() if k != "dropped"}))
        if reply is None:
            raise RuntimeError("the drafter trainer's process is gone (crashed or stopped); build a new engine "
                               "to restore its training state")
        with self._weights_lock:  # what `model` falls back on while nothing is published: the master
            for k, t in self._state.items():
                t.copy_(state["model"][k])
        self._dropped = int(state.get("dropped", 0))
        self._seen, self._latest = 0, None
        self.latest()

    @property
    def stats(self) -> SimpleNamespace:
        m = self._snapshot()
        return SimpleNamespace(steps=int(m.get("drafter/train_steps", 0)), loss=m.get("drafter/loss", float("nan")),
                               error=m.get("error"))

    def metrics(self, policy_version: int) -> dict[str, float]:
        m = {"drafter/loss": float("nan"), "drafter/version": 0.0, "drafter/train_steps": 0.0,
             "drafter/train_time_s": 0.0, "drafter/buffer_tokens": 0.0, "drafter/policy_lag": 0.0}
        m.update({k: v for k, v in self._snapshot().items() if isinstance(v, (int, float))})
        m["drafter/policy_lag"] += policy_version  # the child reports it for policy version 0
        m["drafter/dropped_samples"] = float(self._dropped)
        m[FAILED] = float(bool(m.get(FAILED)) or self.failed)
        return m

    def acceptance_estimate(self) -> tuple[int, float | None] | None:
        """The child's DrafterTrainer.acceptance_estimate(), from its metrics snapshot (it may lag the
        newest version by a snapshot period; the engine asks again at the next version)."""
        m = self._snapshot()
        version, rate = int(m.get("drafter/est_accept_version", 0)), m.get("drafter/est_accept")
        if version <= 0:
            return None
        return version, None if rate is None or rate != rate else float(rate)

    @property
    def failed(self) -> bool:
        """The child reported an error, or died without being asked to stop."""
        return bool(self._snapshot().get("error")) or (not self._stopped and not self._proc.is_alive()
                                                       and self._proc.exitcode is not None)

    @property
    def model(self) -> torch.nn.Module:
        """The newest weights as a float32 network on the CPU (asks a live child to publish first)."""
        if not self._stopped:
            self._request("flush")
        self.latest()
        if self._latest is not None:
            state = self._latest[1]
        else:  # nothing published: the initial weights (the lock only guards against a first publication)
            with self._weights_lock:
                state = self._state
        return network_from_state(self._net_cls, self._net_cfg, state).float()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def stop(self) -> None:
        """The child publishes its last weights and exits; idempotent, also run at interpreter exit."""
        if self._stopped:
            return
        self._stopped = True
        self._finalizer()
        self.latest()
        self._stats_cache = self._snapshot(force=True)

    # ---- internals --------------------------------------------------------------------------------
    def _request(self, kind: str, *payload, timeout: float | None = None):
        """Send a command and wait for its answer; None if the child dies. A child alive but silent for
        `timeout` seconds (default: request_timeout_s()) raises DrafterTrainerTimeout."""
        if self._stopped or not self._proc.is_alive():
            return None
        req = next(self._req)
        self._inbox.put((kind, req, *payload))
        timeout = request_timeout_s() if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got, value = self._outbox.get(timeout=0.2)
            except queue.Empty:
                if not self._proc.is_alive():
                    return None
                continue
            if got == req:
                return value
        raise DrafterTrainerTimeout(
            f"the drafter trainer's process (pid {self._proc.pid}) did not answer a {kind!r} request within "
            f"{timeout:.0f} s (RLSPEC_DRAFTER_TIMEOUT_S): it is stuck (a stopped process, a swapping host, a "
            "deadlock in its torch threads). Its training state is not saved; resume=auto continues from the last "
            "checkpoint.")

    def _snapshot(self, force: bool = False) -> dict:
        """The child's last metrics snapshot (cached when its lock is busy: never wait on the child)."""
        if self._stopped and not force:
            return self._stats_cache
        if self._stats_lock.acquire(block=False):
            try:
                raw = bytes(self._stats_buf[:self._stats_len.value])
            finally:
                self._stats_lock.release()
            if raw:
                self._stats_cache = json.loads(raw)
        return self._stats_cache


class DrafterTrainerTimeout(TimeoutError):
    """The drafter trainer's process is alive but did not answer a request in time."""


def request_timeout_s() -> float:
    """How long a request to the drafter trainer's process may take (RLSPEC_DRAFTER_TIMEOUT_S, default 600 s: a
    state copy of a large drafter, a train step on a busy CPU)."""
    raw = os.environ.get("RLSPEC_DRAFTER_TIMEOUT_S", "").strip()
    try:
        return float(raw) if raw else 600.0
    except ValueError:
        raise ValueError(f"RLSPEC_DRAFTER_TIMEOUT_S={raw!r} is not a number of seconds (e.g. 600)") from None


def make_trainer(drafter, spec):
    """The online trainer `spec` asks for (SpecConfig.online_trainer), started. "auto" picks a process
    on CPU, where a thread would share the interpreter and the cores with decoding and the policy
    update, and when trainer_device is another device; on a GPU shared with the engine a thread
    with its own stream overlaps kernels in one CUDA context, where a second process time-slices."""
    target_dev = next(drafter.target.parameters()).device
    mode = spec.online_trainer
    if mode == "auto":
        elsewhere = spec.trainer_device is not None and not _same_device(torch.device(spec.trainer_device), target_dev)
        mode = "process" if target_dev.type == "cpu" or elsewhere else "thread"
    if mode == "process":
        return ProcessTrainer(drafter, threads=spec.trainer_threads, device=spec.trainer_device)
    from rlspec.rollout.speculation.training.drafter_training import DrafterTrainer

    trainer = DrafterTrainer(drafter)
    trainer.start()
    return trainer


def _same_device(a: torch.device, b: torch.device) -> bool:
    def index(d):  # "cuda" means the current device
        return d.index if d.index is not None else (torch.cuda.current_device() if d.type == "cuda" else 0)

    return a.type == b.type and index(a) == index(b)


def _shutdown(proc, stop_evt) -> None:
    """Ask the child to stop, then insist: it must never outlive the rollout process."""
    stop_evt.set()
    proc.join(timeout=60)
    for kill in (proc.terminate, proc.kill):
        if proc.is_alive():
            kill()
            proc.join(timeout=5)


@contextlib.contextmanager
def _signals_blocked():
    """SIGTERM and SIGINT blocked in this thread while the child starts: the child inherits the mask, so a
    signal to the process group during its start (imports take seconds) waits until it ignores them."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _recipe(drafter, factory, kwargs, threads, device, nice) -> Recipe:
    target = drafter.target
    p = next(target.parameters())
    cpu = lambda t: _shared_copy(t.detach())  # noqa: E731  (copies: the engine's weights stay untouched)
    tied = target.lm_head.weight is target.model.embed_tokens.weight
    rope = None if target.rope_cos is None else (cpu(target.rope_cos.float()), cpu(target.rope_sin.float()))
    if threads is None:
        threads = max(1, len(os.sched_getaffinity(0)) // 2)
    net = drafter.network()
    return Recipe(factory, dict(kwargs), threads, nice, str(device or p.device), p.dtype, target.cfg.portable(),
                  cpu(target.model.embed_tokens.weight), cpu(target.model.norm.weight),
                  None if tied else cpu(target.lm_head.weight), rope, type(net), net.cfg, drafter.name,
                  tuple(drafter.aux_layers))


def _shared_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of t in shared memory (pickling it to the child then passes a handle, not bytes)."""
    out = torch.empty(t.shape, dtype=t.dtype).share_memory_()
    out.copy_(t)
    return out


def _is_record(obj) -> bool:
    """A dataclass instance (the buffer's Dist of a sample's target distribution) whose fields are tensors."""
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _fields(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif _is_record(obj):
        yield from _tensors(_fields(obj))
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _map_tensors(obj, fn):
    """obj with every tensor t (in records, lists, tuples and dicts) replaced by fn(t)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if _is_record(obj):
        return dataclasses.replace(obj, **_map_tensors(_fields(obj), fn))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _cpu_copy(obj):
    """obj with every tensor replaced by a private copy (received ones live in shared memory)."""
    return _map_tensors(obj, torch.Tensor.clone)


def _share(obj):
    """obj with every tensor replaced by a shared-memory copy (views of engine buffers never leave)."""
    return _map_tensors(obj, lambda t: _shared_copy(t.detach()))


@contextlib.contextmanager
def _main_not_reimported():
    """Spawn re-imports the parent's __main__ in the child, which re-runs unguarded scripts (and
    imports a whole training CLI). The child needs nothing from it: hide it while starting."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)
            if "__spec__" not in saved:
                main.__dict__.pop("__spec__", None)


