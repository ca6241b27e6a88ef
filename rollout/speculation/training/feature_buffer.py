"""The online drafter's training data: a ring buffer of finished samples, kept on the device.

Per buffered position t of a sample (positions 0..n-1 of its cache):
  feats[t]     [3H] bf16   the target's features of token t (what the drafter reads)
  next_tok[t]  int64       token t+1, the token the target sampled (or the prompt's next token)
  top_ids[t]   [k] int32   the k most likely target ids for token t+1, and
  top_p[t]     [k] fp16    their probabilities after the call's processing (temperature, top-k,
                           top-p): what a sampled draft must match (docs/drafter_training.md)
  rest[t]      fp16        1 - sum(top_p[t]): mass outside the top-k, kept so losses see it
  has_dist[t]  bool        False at prompt positions (the engine shows no logits there)
Bytes per position for SmolLM2-135M (H = 576) and k = 32: 3456 + 8 + 128 + 64 + 2 + 1 = 3659, of
which the distribution is 195 (5%); the full 49k-vocabulary distribution would be 98 KB in bf16.

Sampling: windows of `window` positions from segments picked with probability proportional to
their length times 0.5^(age / half_life), age = newest policy version in the buffer - the
segment's version. Proportional to length so every buffered token is equally likely to be trained
on (uniform over segments oversampled short ones); the decay so the drafter follows the moving
policy (data one half-life old counts half). A window's offset is drawn so that every position,
the last ones included, is covered at least half as often as any other (an offset drawn in
[0, n - window] covered the final positions of a sample 1/window as often as the middle ones).

Streams (CUDA): the engine writes samples on its stream, the online trainer reads windows on its own. The
lock orders the calls on the host, not their kernels: a StreamFence (runtime/device.py) makes each read wait
for the last write's event, and each write wait for the reads queued before it (a wrapped ring would
otherwise overwrite rows a queued read had not copied yet). On a CPU its events do nothing.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch

from rlspec.rollout.runtime.device import StreamFence


@dataclass
class Dist:
    """The target's processed next-token distribution per position, top-k compressed.
    ids [.., k] int32 target ids, probs [.., k] fp16, rest [..] fp16 (leftover mass), has [..] bool."""
    ids: torch.Tensor
    probs: torch.Tensor
    rest: torch.Tensor
    has: torch.Tensor


def law_top_k(logits: torch.Tensor, params, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids int32, probs, rest) [.., k]: the top-k of the processed next-token law a drafter trains toward,
    the call's processing of `logits` (temperature, top-k, top-p, min-p; softmax at temperature 1 for a
    greedy call or params None), and the mass outside it. Both producers stage it (Eagle3Drafter, FeatureTap)."""
    from rlspec.rollout.runtime.sampling import probs_from_logits

    probs = torch.softmax(logits, -1) if params is None or params.greedy else probs_from_logits(logits, params)
    top = probs.topk(k, -1)
    return top.indices.to(torch.int32), top.values, (1.0 - top.values.sum(-1)).clamp(min=0.0)


@dataclass
class Batch:
    """Training windows. feats [B, W, 3H], next_tokens [B, W] (token t+1 at t), valid [B, W] bool,
    dist: Dist with [B, W, ..] fields (None when the buffer keeps no distributions), temperature [B]
    (each window's sampling temperature; 1 for greedy calls), policy_version: the mean over windows."""
    feats: torch.Tensor
    next_tokens: torch.Tensor
    valid: torch.Tensor
    dist: Dist | None
    temperature: torch.Tensor
    policy_version: float


class FeatureBuffer:
    def __init__(self, capacity: int, width: int, dtype, device, topk: int = 32, half_life: float = 2.0,
                 event=None):
        """event: makes the fence's events (tests pass a stand-in that logs record and wait; see StreamFence)."""
        self.feats = torch.zeros(capacity, width, dtype=dtype, device=device)
        self.next_tokens = torch.zeros(capacity, dtype=torch.long, device=device)
        self.topk = topk
        self.dist = Dist(torch.zeros(capacity, topk, dtype=torch.int32, device=device),
                         torch.zeros(capacity, topk, dtype=torch.float16, device=device),
                         torch.zeros(capacity, dtype=torch.float16, device=device),
                         torch.zeros(capacity, dtype=torch.bool, device=device)) if topk > 0 else None
        self.half_life = half_life
        self.segments: deque[tuple[int, int, int, float]] = deque()  # (start, length, policy version, T)
        self.head = 0
        self.lock = threading.Lock()
        self.fence = StreamFence(device, event)

    @property
    def tokens(self) -> int:
        return sum(s[1] for s in self.segments)

    def bytes_per_token(self) -> int:
        per = self.feats.shape[1] * self.feats.element_size() + self.next_tokens.element_size()
        if self.dist is not None:
            per += sum(t[0].numel() * t.element_size() for t in (self.dist.ids, self.dist.probs, self.dist.rest,
                                                                  self.dist.has))
        return per

    def add(self, feats: torch.Tensor, token_ids: list[int], policy_version: int, dist: Dist | None = None,
            temperature: float = 1.0) -> None:
        """feats [n, 3H] of positions 0..n-1; token_ids has n+1 tokens (position t predicts t+1);
        dist: Dist with [n, ..] fields, or None (then no position has a distribution)."""
        cap = self.feats.shape[0]
        n = min(len(feats), cap, len(token_ids) - 1)
        with self.lock:
            if self.head + n > cap:
                self.head = 0
            lo, hi = self.head, self.head + n
            self.segments = deque(s for s in self.segments if not (s[0] < hi and lo < s[0] + s[1]))
            self.fence.before_write()
            self._write(lo, hi, n, feats, token_ids, dist)
            self.fence.after_write()
            self.segments.append((lo, n, policy_version, float(temperature)))
            self.head = hi

    def _write(self, lo: int, hi: int, n: int, feats: torch.Tensor, token_ids: list[int], dist: Dist | None) -> None:
        """Rows lo..hi-1 <- the sample's first n positions (add, under the lock and the fence)."""
        self.feats[lo:hi] = feats[:n].to(self.feats.dtype)
        self.next_tokens[lo:hi] = torch.tensor(token_ids[1:n + 1], device=self.next_tokens.device)
        if self.dist is not None:
            k = self.topk
            if dist is None:
                self.dist.has[lo:hi] = False
            else:
                d = self.dist
                d.ids[lo:hi] = dist.ids[:n, :k].to(d.ids.device, d.ids.dtype)
                d.probs[lo:hi] = dist.probs[:n, :k].to(d.probs.device, d.probs.dtype)
                # a caller that kept more than k entries: the extra mass is leftover here
                d.rest[lo:hi] = (dist.rest[:n].float() + dist.probs[:n, k:].float().sum(-1)).to(
                    d.rest.device, d.rest.dtype)
                d.has[lo:hi] = dist.has[:n].to(d.has.device)
                # a position without a distribution carries whatever its KV block held before (never
                # read): zeros instead, so that what is buffered depends only on the samples
                none = ~d.has[lo:hi]
                d.ids[lo:hi][none], d.probs[lo:hi][none], d.rest[lo:hi][none] = 0, 0.0, 0.0

    def weights(self, segs) -> torch.Tensor:
        """Sampling weight per segment: length x 0.5^(age / half_life)."""
        newest = max(s[2] for s in segs)
        lengths = torch.tensor([float(s[1]) for s in segs])
        age = torch.tensor([float(newest - s[2]) for s in segs])
        decay = 0.5 ** (age / self.half_life) if self.half_life > 0 else torch.ones_like(age)
        return lengths * decay

    def sample(self, batch: int, window: int, gen: torch.Generator) -> Batch | None:
        """`batch` random windows of up to `window` positions (see the module docstring)."""
        with self.lock:
            segs = [s for s in self.segments if s[1] >= 4]
            if not segs:
                return None
            pick = torch.multinomial(self.weights(segs), batch, replacement=True, generator=gen).tolist()
            self.fence.before_read()
            dev = self.feats.device
            feats = self.feats.new_zeros(batch, window, self.feats.shape[1])
            nxt = torch.zeros(batch, window, dtype=torch.long, device=dev)
            valid = torch.zeros(batch, window, dtype=torch.bool, device=dev)
            d = self.dist
            out = None if d is None else Dist(d.ids.new_zeros(batch, window, self.topk),
                                              d.probs.new_zeros(batch, window, self.topk),
                                              d.rest.new_zeros(batch, window), d.has.new_zeros(batch, window))
            temps, versions = [], []
            for b, i in enumerate(pick):
                start, n, ver, temp = segs[i]
                half = min(window, n) // 2
                # offsets in [-half, n - window + half]: windows may hang over either end by half
                off = int(torch.randint(-half, max(n - window + half, -half) + 1, (1,), generator=gen))
                lo, hi = max(off, 0), min(off + window, n)
                w = hi - lo
                src = slice(start + lo, start + hi)
                feats[b, :w] = self.feats[src]
                nxt[b, :w] = self.next_tokens[src]
                valid[b, :w] = True
                if d is not None:
                    out.ids[b, :w], out.probs[b, :w] = d.ids[src], d.probs[src]
                    out.rest[b, :w], out.has[b, :w] = d.rest[src], d.has[src]
                temps.append(temp)
                versions.append(ver)
            self.fence.after_read()
        return Batch(feats, nxt, valid, out, torch.tensor(temps, device=dev), sum(versions) / len(versions))

    def token_mass(self, vocab: int) -> torch.Tensor:
        """[V] float32: expected count of each target token as the next token over the buffer (the
        top-k probabilities where a distribution is kept, the sampled token elsewhere)."""
        with self.lock:
            rows = torch.cat([torch.arange(s, s + n) for s, n, *_ in self.segments]) if self.segments \
                else torch.zeros(0, dtype=torch.long)
            rows = rows.to(self.feats.device)
            self.fence.before_read()
            mass = torch.zeros(vocab, dtype=torch.float32, device=self.feats.device)
            has = self.dist.has[rows] if self.dist is not None else torch.zeros_like(rows, dtype=torch.bool)
            mass.index_add_(0, self.next_tokens[rows][~has], torch.ones(int((~has).sum()), device=mass.device))
            if self.dist is not None and has.any():
                d = rows[has]
                mass.index_add_(0, self.dist.ids[d].long().flatten(), self.dist.probs[d].float().flatten())
            self.fence.after_read()
            return mass.cpu()

    def state(self) -> dict:
        """Everything buffered, for caching a collected data set (scripts) and restoring it."""
        with self.lock:
            st = {"feats": self.feats, "next_tokens": self.next_tokens, "segments": list(self.segments),
                  "head": self.head}
            if self.dist is not None:
                st["dist"] = vars(self.dist)
            self.fence.before_read()
            out = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
            self.fence.after_read()
            return out

    def load_state(self, st: dict) -> None:
        with self.lock:
            self.fence.before_write()
            self._load(st)
            self.fence.after_write()

    def _load(self, st: dict) -> None:
        """load_state's copies, under the lock and the fence."""
        self.feats.copy_(st["feats"].to(self.feats.device))
        self.next_tokens.copy_(st["next_tokens"].to(self.next_tokens.device))
        self.segments, self.head = deque(tuple(s) for s in st["segments"]), st["head"]
        if self.dist is not None:
            if "dist" in st:
                d, k, dev = st["dist"], self.topk, self.feats.device
                self.dist.ids.copy_(d["ids"][:, :k].to(dev))
                self.dist.probs.copy_(d["probs"][:, :k].to(dev))
                # entries beyond this buffer's k become leftover mass
                self.dist.rest.copy_((d["rest"].float() + d["probs"][:, k:].float().sum(-1)).to(dev))
                self.dist.has.copy_(d["has"].to(dev))
            else:
                self.dist.has.zero_()

    # ---- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """For checkpoints: CPU copies of the rows up to the end of the furthest buffered segment (rows
        past it hold nothing a read can reach) and the ring's bookkeeping (segments, head)."""
        with self.lock:
            end = max((s[0] + s[1] for s in self.segments), default=0)
            self.fence.before_read()
            st = {"shape": [self.feats.shape[0], self.feats.shape[1], self.topk],
                  "feats": self.feats[:end].to("cpu", copy=True),
                  "next_tokens": self.next_tokens[:end].to("cpu", copy=True),
                  "segments": [list(s) for s in self.segments], "head": self.head}
            if self.dist is not None:
                st["dist"] = {k: v[:end].to("cpu", copy=True) for k, v in vars(self.dist).items()}
            self.fence.after_read()
            return st

    def load_state_dict(self, st: dict) -> None:
        """Restore state_dict() into a buffer of the same capacity, feature width and top-k."""
        here = [self.feats.shape[0], self.feats.shape[1], self.topk]
        if list(st["shape"]) != here:
            raise ValueError(f"the checkpoint's drafter training buffer has (tokens, feature width, top-k) "
                             f"{list(st['shape'])}, this engine's has {here}; build the trainer with the same "
                             "buffer_tokens, target model and loss / topk as the run that saved it")
        with self.lock:
            self.fence.before_write()
            end = len(st["next_tokens"])
            self.feats[:end] = st["feats"].to(self.feats.device)
            self.next_tokens[:end] = st["next_tokens"].to(self.next_tokens.device)
            if self.dist is not None:
                for k, v in st["dist"].items():
                    getattr(self.dist, k)[:end] = v.to(self.feats.device)
            self.fence.after_write()
            self.segments = deque((int(a), int(n), int(v), float(t)) for a, n, v, t in st["segments"])
            self.head = int(st["head"])
