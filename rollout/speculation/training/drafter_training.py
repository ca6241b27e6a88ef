"""Online training of the EAGLE-3 drafter on features the rollouts already computed (TLT-style).

Data: every finished sample leaves its target features (3 layers, every cached position) and its
tokens in a bounded ring buffer on the device, tagged with the policy version that produced them.

Loss (docs/drafter_training.md#losses): by default forward KL from the target's processed
distribution, kept per buffered position as its top-k plus the leftover mass (distill_losses.py),
unrolled for `ttt_steps` training-time-test steps (step s feeds the drafter's own output of step
s-1 back, weights 0.8^(s-1), as SpecForge does). Acceptance at T > 0 is 1 - TV(p, q), so the drafter
must match the whole distribution, not one sample of it: on the same data and budget KL reached
1.61 accepted tokens per verify against 1.42 for the sampled-token cross-entropy (bench_out/
distill.json). No hidden-state regression term: with a shared LM head it mostly helps EAGLE-1-style
feature prediction, which EAGLE-3 dropped.

Scheduling: `train_steps` runs synchronously (scripts, tests); `start` runs a daemon thread that
trains only while the engine reports idle compute (live batch in the tail, or between rollouts)
and publishes versioned weights that the engine swaps in between decode iterations. An out-of-memory
step (the GPU is shared with the rollout, its graphs and the policy update) backs off: the batch halves,
the thread waits and retries, and the batch doubles back after OOM_RECOVER_STEPS good steps
(docs/drafter_training.md#memory). Any other exception in the thread is logged and stops training; the
engine keeps the last good drafter. The same class
also runs in a process of its own behind rollout/speculation/training/trainer_process.py (SpecConfig.trainer).

On CUDA the trainer works on a stream of its own, so its kernels overlap the engine's instead of
queueing behind them; events order the shared buffer (the engine writes samples on its stream, the
trainer reads windows on its own: feature_buffer.py's fence, each read after the last write, each write after
the reads queued before it) and the published weights (read on the engine's stream). The loss
stays a device tensor: reading it per step would sync the trainer with the GPU every step.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlspec.rollout.speculation.checkpoint import cpu_clone
from rlspec.rollout.speculation.training.distill_losses import draft_target, get_loss
from rlspec.rollout.speculation.drafters.eagle3_model import Eagle3Model, draft_vocab_from_counts
from rlspec.rollout.speculation.training.feature_buffer import Batch, Dist, FeatureBuffer  # noqa: F401 (Batch, FeatureBuffer re-exported)

log = logging.getLogger(__name__)

def _record(device: torch.device) -> torch.cuda.Event | None:
    """An event at the current point of the calling thread's current stream (None off CUDA)."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


OOM_WAIT_S = 1.0  # the first wait after an out-of-memory step; doubles per OOM in a row, at most OOM_MAX_WAIT_S
OOM_MAX_WAIT_S = 30.0
OOM_RECOVER_STEPS = 50  # good steps at a backed-off batch before it doubles again
DEFAULT_TOPK = 32  # entries of the target's distribution kept per position (feature_buffer.py: 5% of its bytes)
ACCEPT_WINDOWS = 8  # buffered windows the acceptance estimate of a published version is taken on
DEFAULT_LOSS = "kl"  # forward KL to the top-k target won the comparison (bench_out/distill.json: 1.61 accepted
# per verify against 1.42 for the sampled-token cross-entropy and 1.07 for total variation, same data and steps)


def ttt_loss(model: Eagle3Model, embed: torch.nn.Embedding, cos, sin, feats, nxt, valid, t2d, steps: int,
             dist: Dist | None = None, loss: str = "ce", temperature: torch.Tensor | None = None,
             prompt_loss: bool = True):
    """Training-time-test loss over windows. feats [B, W, 3H], nxt [B, W] (token t+1 at t), valid [B, W];
    dist: the target's top-k distribution of token t+1 at t (Dist with [B, W, ..] fields) or None;
    loss: a name in distill_losses.LOSSES; temperature [B] per window (drafter logits are divided by
    it, as the drafter's are at inference); prompt_loss False drops positions without a
    distribution (prompt positions) from the loss instead of training them on the sampled token.

    Step s (1-based) at row t: input = (step s-1 output at t, or target features when s = 1;
    token t+s), label = token t+s+1 and its distribution (both at column t+s), RoPE position
    t+s-1. It attends to step-1 keys of positions <= t and to its own chain's keys of earlier steps
    (the diagonal): what the engine's speculative steps see at inference. Step losses weigh 0.8^(s-1).
    """
    B, W, _ = feats.shape
    fn = get_loss(loss)
    idx = torch.arange(W, device=feats.device)
    causal = idx[None, :] <= idx[:, None]  # [W, W]
    eye = torch.eye(W, dtype=torch.bool, device=feats.device)
    if dist is None:  # no distributions kept: every position trains on its sampled token
        k1 = torch.zeros(B, W, 1, dtype=torch.long, device=feats.device)
        dist = Dist(k1, k1.float(), k1[..., 0].float(), torch.zeros_like(valid))
    inv_t = None if temperature is None else (1.0 / temperature.clamp(min=1e-3))[:, None, None]
    keys, vals, total, weight_sum = [], [], 0.0, 0.0
    hidden = feats
    for s in range(1, steps + 1):
        shift = s - 1
        tok = _shift(nxt, shift)  # token t+s sits at nxt[t+s-1]
        at = shift + 1  # label token t+s+1 and its distribution sit at column t+s
        ok = _shift(valid, at) & valid
        has = _shift(dist.has, at)
        if not prompt_loss:
            ok = ok & has
        pos = (idx + shift).clamp(max=cos.shape[0] - 1)
        mask = torch.cat([causal] + [eye] * shift, dim=1)  # [W, W * s]

        def attend(q, k, v):
            keys.append(k)
            vals.append(v)
            return F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(vals, 2), attn_mask=mask,
                                                  enable_gqa=True)

        hidden = model(hidden, embed(tok), cos[pos][None, :, None], sin[pos][None, :, None], attend)
        logits = model.logits(hidden)
        if inv_t is not None:
            logits = logits * inv_t
        if not ok.any():
            continue
        target = draft_target(_shift(dist.ids, at)[ok], _shift(dist.probs, at)[ok], _shift(dist.rest, at)[ok],
                              has[ok], _shift(nxt, at)[ok], t2d)
        per, counts = fn(logits[ok], target)
        if counts.any():
            w = 0.8 ** shift
            total = total + w * per[counts].mean()
            weight_sum += w
    return total / max(weight_sum, 1e-9)


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, t + k] at column t (zeros / False past the end)."""
    if k == 0:
        return x
    out = torch.zeros_like(x)
    out[:, :-k] = x[:, k:]
    return out


@dataclass
class TrainerStats:
    steps: int = 0
    loss: float | torch.Tensor = float("nan")  # a device tensor while training: read only when reported
    train_time_s: float = 0.0
    data_policy_version: float = 0.0
    error: str | None = None
    ooms: int = 0  # out-of-memory steps backed off from (drafter/ooms)


class DrafterTrainer:
    """Trains a copy of the drafter's network on buffered rollouts and publishes its weights.

    loss: a name in distill_losses.LOSSES; topk: entries of the target's distribution kept per
    buffered position (0 keeps none: sampled tokens only); prompt_loss: train prompt positions on
    their next token (they have no target distribution) or skip them; half_life: policy versions
    after which a sample's sampling weight halves."""

    def __init__(self, drafter, lr: float = 1e-3, batch: int = 8, window: int = 64, ttt_steps: int = 3,
                 buffer_tokens: int = 32768, min_tokens: int = 1024, publish_every: int = 10, seed: int = 0,
                 loss: str = DEFAULT_LOSS, topk: int = DEFAULT_TOPK, prompt_loss: bool = True, half_life: float = 2.0):
        get_loss(loss)  # fail on an unknown name now, not in the training thread
        self.drafter = drafter
        target = drafter.target
        dev = next(target.parameters()).device
        self.model: Eagle3Model = copy.deepcopy(drafter.model).float().train()
        self.embed = torch.nn.Embedding.from_pretrained(target.model.embed_tokens.weight.detach().float().clone())
        self.cos, self.sin = (t.to(dev) for t in _rope_tables(target, window + ttt_steps + 1))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        # the drafter stages `topk` entries per position only when the loss reads them
        self.topk = topk if loss != "ce" else 0
        self.buffer = FeatureBuffer(buffer_tokens, 3 * target.cfg.hidden_size, torch.bfloat16, dev,
                                    topk=self.topk, half_life=half_life)
        self.batch, self.window, self.ttt_steps = batch, window, ttt_steps
        self.max_batch, self.oom_wait_s = batch, OOM_WAIT_S  # the batch an OOM backs off from (_back_off)
        self._ooms_in_row, self._good_steps = 0, 0
        self.loss_name, self.prompt_loss = loss, prompt_loss
        self.min_tokens, self.publish_every = min_tokens, publish_every
        self.gen = torch.Generator().manual_seed(seed)  # CPU generator: window picks are host-side ints
        self.stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None  # see the module docstring
        self._publish_event: torch.cuda.Event | None = None
        self._handed_out = 0  # CUDA: the last published version whose tensors were marked for the reader
        self.stats = TrainerStats()
        self.version = 0
        self._published: tuple[int, dict] | None = None
        self._estimate: tuple[int, torch.Tensor | None] | None = None  # see acceptance_estimate()
        self.published_at = 0  # stats.steps at the latest publication
        self._vocab_chosen = False
        # one optimizer step or publish at a time: the background thread, a synchronous caller
        # (scripts, warm_start) and cache loads may all touch the network
        self.lock = threading.RLock()
        self._idle = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- data and weights ------------------------------------------------------------------------
    def add(self, feats: torch.Tensor, token_ids: list[int], policy_version: int, dist: Dist | None = None,
            temperature: float = 1.0) -> None:
        """A finished sample: features [n, 3H] of its positions, its n+1 tokens and, when the drafter
        staged them, the target's top-k distributions (Dist, [n, ..] fields) and its temperature."""
        self.buffer.add(feats, token_ids, policy_version, dist, temperature)

    def latest(self) -> tuple[int, dict] | None:
        """(version, state_dict) of the newest published weights; on CUDA usable on the caller's stream."""
        pub = self._published
        if pub is not None and self.stream is not None and pub[0] != self._handed_out:
            reader = torch.cuda.current_stream(self.stream.device)
            reader.wait_event(self._publish_event)  # recorded before _published was set: covers this version
            for t in pub[1].values():  # made on the trainer's stream: not reused while the reader copies
                t.record_stream(reader)
            self._handed_out = pub[0]
        return pub

    def publish(self) -> None:
        with self.lock, self._on_stream():
            self.version += 1
            state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self._estimate = (self.version, self._judge())  # before _published: whoever sees the version sees it
            self._publish_event = _record(self.cos.device)
            self._published = (self.version, state)
            self.published_at = self.stats.steps

    def acceptance_estimate(self) -> tuple[int, float | None] | None:
        """(version, expected per-token acceptance) of the newest published weights, measured on buffered
        rollouts without the engine spending a verify on them (the selector's gate, selectors/gate.py);
        the rate is None when there was nothing to judge them by (weights loaded before any data)."""
        est = self._estimate
        if est is None or est[1] is None:
            return est
        with self._on_stream():  # read on the trainer's stream: ordered after the forward that made it
            return est[0], float(est[1])

    def _judge(self) -> torch.Tensor | None:
        """Acceptance of a sampled draft is sum_x min(p(x), q(x)) = 1 - TV(p, q) per position: one minus
        the "tv" loss over the target's buffered top-k (mass outside it counts as unmatched, so this is a
        lower bound), unrolled over the training-time-test steps as drafting is, on ACCEPT_WINDOWS windows
        drawn with a generator of their own (training's window sequence stays as it was). Kept as a tensor,
        read when asked for (acceptance_estimate); None without target distributions in the buffer."""
        if self.buffer.dist is None:
            return None
        b = self.buffer.sample(ACCEPT_WINDOWS, self.window, torch.Generator().manual_seed(self.version))
        if b is None or not bool(b.dist.has.any()):
            return None
        with torch.no_grad():
            tv = ttt_loss(self.model, self.embed, self.cos, self.sin, b.feats.float(), b.next_tokens, b.valid,
                          self.model.target_to_draft(), self.ttt_steps, dist=b.dist, loss="tv",
                          temperature=b.temperature, prompt_loss=False)
        return (1.0 - tv).clamp(0.0, 1.0) if isinstance(tv, torch.Tensor) else None

    def load_weights(self, state: dict) -> None:
        """Continue from these drafter weights (a warm-started drafter): its draft vocabulary (d2t)
        and head are kept, never re-chosen, and the weights are published for the engine."""
        with self.lock:
            self.model.load_state_dict(state)
            self._vocab_chosen = True
            self.publish()

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _choose_vocab(self) -> None:
        """Draft vocabulary = the target tokens with the most probability mass seen so far (chosen once;
        expected counts where distributions were kept, sampled counts elsewhere). The head
        starts as the target's own rows for those tokens (and its final norm): the drafter's output
        lives in the target's residual space, so this is a far better start than random."""
        if self._vocab_chosen:
            return
        counts = self.buffer.token_mass(self.model.cfg.vocab_size)
        self.model.set_draft_vocab(draft_vocab_from_counts(counts, self.model.cfg.draft_vocab_size))
        target = self.drafter.target
        with torch.no_grad():
            ids = self.model.draft_vocab()
            self.model.lm_head.weight.copy_(target.lm_head.weight[ids.to(target.lm_head.weight.device)].float())
            self.model.norm.weight.copy_(target.model.norm.weight.float())
        self._vocab_chosen = True

    # ---- training ----------------------------------------------------------------------------------
    def ready(self) -> bool:
        return self.buffer.tokens >= self.min_tokens

    def train_steps(self, n: int) -> float:
        """n optimizer steps now; returns the last loss (nan when there is no data yet)."""
        self._train(n)
        return self._loss_value()

    def _train(self, n: int) -> None:
        """Up to n steps; an out-of-memory step backs off (_back_off) and ends this call: the caller (the thread,
        the trainer process's loop, a script) comes back later, at the smaller batch."""
        with self._on_stream():
            for _ in range(n):
                if not self.ready():
                    break
                try:
                    with self.lock:
                        self._step()
                        if self.stats.steps % self.publish_every == 0:
                            self.publish()
                except torch.OutOfMemoryError:
                    self._back_off()
                    return
                self._recover()

    def _loss_value(self) -> float:
        with self._on_stream():  # .item() on the trainer's stream: ordered after the step that made it
            return float(self.stats.loss)

    def _step(self) -> None:
        t0 = time.perf_counter()
        self._choose_vocab()
        b = self.buffer.sample(self.batch, self.window, self.gen)
        t2d = self.model.target_to_draft()
        loss = ttt_loss(self.model, self.embed, self.cos, self.sin, b.feats.float(), b.next_tokens, b.valid, t2d,
                        self.ttt_steps, dist=b.dist, loss=self.loss_name, temperature=b.temperature,
                        prompt_loss=self.prompt_loss)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        s = self.stats
        s.steps += 1
        s.loss = loss.detach()
        s.train_time_s += time.perf_counter() - t0
        s.data_policy_version = b.policy_version

    # ---- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything training goes on from, as CPU tensors and plain values: the float32 master
        weights, the optimizer's state, the buffered samples, the window sampler's generator, the
        counters and the newest published weights (the engine may not have swapped them in yet).
        Taken under the training lock: a background thread is between steps."""
        with self.lock:
            if self.stream is not None:
                self.stream.synchronize()  # the master weights and optimizer state are written on it
            s, pub = self.stats, self._published
            return {"model": cpu_clone(self.model.state_dict()), "optimizer": cpu_clone(self.opt.state_dict()),
                    "buffer": self.buffer.state_dict(), "generator": self.gen.get_state(), "version": self.version,
                    "published": None if pub is None else [pub[0], cpu_clone(pub[1])],
                    "published_at": self.published_at, "vocab_chosen": self._vocab_chosen,
                    "stats": {"steps": s.steps, "loss": float(s.loss), "train_time_s": s.train_time_s,
                              "data_policy_version": s.data_policy_version}}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where state_dict() was taken (a trainer built with the same settings)."""
        dev = self.cos.device
        with self.lock:
            self.buffer.load_state_dict(state["buffer"])  # first: it checks its shape before changing anything
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
            self.gen.set_state(state["generator"])
            self.version, self.published_at = int(state["version"]), int(state["published_at"])
            pub = state["published"]
            self._published = None if pub is None else (int(pub[0]), {k: v.to(dev) for k, v in pub[1].items()})
            self._publish_event, self._handed_out = _record(dev), 0
            self._vocab_chosen = bool(state["vocab_chosen"])
            st = state["stats"]
            self.stats = TrainerStats(int(st["steps"]), float(st["loss"]), float(st["train_time_s"]),
                                      float(st["data_policy_version"]))
            if self.stream is not None:  # the next step, on the trainer's stream, reads what was copied here
                self.stream.wait_stream(torch.cuda.current_stream(dev))

    # ---- background -------------------------------------------------------------------------------
    def set_idle(self, idle: bool) -> None:
        """The engine says whether compute is spare (tail of a rollout, or between rollouts)."""
        (self._idle.set if idle else self._idle.clear)()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="drafter-trainer", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._idle.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._idle.wait(timeout=0.5)
                if self._stop.is_set() or not self._idle.is_set() or not self.ready():
                    time.sleep(0.05)
                    continue
                self._train(1)
        except Exception as exc:  # never let drafter training take the RL run down
            log.exception("drafter training stopped; the engine keeps the last published drafter")
            self.stats.error = repr(exc)

    def memory_bytes(self) -> int:
        """Device bytes training allocates beyond what exists when it is built (the buffer, the master weights):
        gradients and AdamW's two moments of the float32 network (12 bytes a parameter) and one step's
        activations, ~ batch x window x ttt_steps positions of draft-vocabulary float32 logits (twice: softmax,
        gradient) and 16 float32 hidden-width tensors. An estimate the KV pool keeps free on CUDA (ModelRunner
        .reserves["drafter"]; docs/runtime.md#memory-plan); an OOM beyond it backs off (_back_off)."""
        c = self.model.cfg
        params = sum(p.numel() for p in self.model.parameters())
        positions = self.max_batch * self.window * self.ttt_steps
        return 12 * params + positions * 4 * (2 * c.draft_vocab_size + 16 * c.hidden_size)

    def _back_off(self) -> None:
        """After an out-of-memory step: free what it held, halve the batch, wait (longer each OOM in a row; stop()
        ends the wait)."""
        self.stats.ooms += 1
        self._ooms_in_row, self._good_steps = self._ooms_in_row + 1, 0
        self.batch = max(1, self.batch // 2)
        self.opt.zero_grad(set_to_none=True)  # gradients of the failed step
        if self.stream is not None:
            torch.cuda.empty_cache()
        wait = min(OOM_MAX_WAIT_S, self.oom_wait_s * 2 ** (self._ooms_in_row - 1))
        log.warning("drafter training ran out of device memory (%d so far); retrying in %.1f s at batch %d",
                    self.stats.ooms, wait, self.batch)
        self._stop.wait(wait)

    def _recover(self) -> None:
        """A good step: after OOM_RECOVER_STEPS of them at a backed-off batch, double it (up to the configured)."""
        self._ooms_in_row, self._good_steps = 0, self._good_steps + 1
        if self.batch < self.max_batch and self._good_steps >= OOM_RECOVER_STEPS:
            self.batch, self._good_steps = min(self.max_batch, 2 * self.batch), 0

    def metrics(self, policy_version: int) -> dict[str, float]:
        s = self.stats
        return {"drafter/loss": self._loss_value(), "drafter/version": float(self.version), "drafter/train_steps": float(s.steps),
                "drafter/train_time_s": s.train_time_s, "drafter/buffer_tokens": float(self.buffer.tokens),
                "drafter/policy_lag": float(policy_version - s.data_policy_version),
                "drafter/failed": float(s.error is not None), "drafter/ooms": float(s.ooms),
                "drafter/batch": float(self.batch)} | self._estimate_metrics()

    def _estimate_metrics(self) -> dict[str, float]:
        """drafter/est_accept (nan: none yet, or nothing to judge by) and the version it is of."""
        est = self.acceptance_estimate()
        rate = float("nan") if est is None or est[1] is None else est[1]
        return {"drafter/est_accept": rate, "drafter/est_accept_version": float(est[0]) if est else 0.0}


def _rope_tables(target, length: int):
    target.init_rope(length)  # a no-op when the engine's tables already cover it (they only grow)
    return target.rope_cos[:length].float().cpu(), target.rope_sin[:length].float().cpu()
