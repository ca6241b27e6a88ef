"""FeatureTap: the drafter's training samples from a forward pass of the policy someone runs anyway.

A trainer runs its policy, without grad, over prompt + completion of every rollout to get the old
logprobs (TRL's GRPOTrainer for its importance-sampling correction, PPOTrainer for its experience).
That pass computes every hidden state the EAGLE-3 drafter reads, whichever backend sampled the
rollout. Forward hooks on the decoder layers the drafter reads and on the final norm keep them,
only inside `capture()` and only in forwards run without grad (a training forward never keeps a
thing). With `on_forward`, each forward's states are handed over as soon as its final norm ran and
not kept, so a pass chunked by rows holds one chunk's states at a time, as the forward itself does.
`samples()` turns them into exactly what the engine banks when it finishes a sample
(Eagle3Drafter.finish, docs/drafter_training.md#data-featurebuffer):
  feats  [n, 3H]  the drafter's dtype, positions 0..n-1, n = prompt + completion - 1 (the last token
                  was sampled but never fed: the engine's cache_len at finish);
  tokens          the n + 1 tokens;
  dist            top-k of the processed law of the next token (temperature, top-k, top-p, min-p on
                  the final-norm state through the LM head, as the engine's verify stages it) at
                  completion positions P..n-1; prompt positions carry none (the engine shows no logits there).
Layout of the pass (TRL's and PPO's): rows of left-padded prompts then right-padded completions, the
completion block the last `completion_len` columns; a row's real tokens are contiguous.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlspec.rollout.speculation.training.feature_buffer import Dist, law_top_k
from rlspec.rollout.padding import pad_rollouts
from rlspec.rollout.types import RolloutResult, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class TapSample:
    feats: torch.Tensor  # [n, 3H]
    token_ids: list[int]  # n + 1
    dist: Dist | None  # [n, ..] fields


class FeatureTap:
    """Hooks on `policy` (an HF causal LM, or a PEFT model over one) for the hidden states with HF
    indices `aux_layers` (i = output of decoder layer i-1) and the final norm's output."""

    def __init__(self, policy: torch.nn.Module, aux_layers: tuple[int, ...]):
        lm = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        self.lm, self.backbone = lm, getattr(lm, lm.base_model_prefix)
        layers = self.backbone.layers
        bad = [i for i in aux_layers if not 1 <= i <= len(layers)]
        if bad:
            raise ValueError(f"the drafter reads hidden states {tuple(aux_layers)}; the tap can hook outputs of "
                             f"decoder layers only (indices 1..{len(layers)}), not {bad}")
        self.aux_layers = tuple(aux_layers)
        self._modules = {i: layers[i - 1] for i in self.aux_layers} | {"norm": self.backbone.norm}
        self._kept: dict | None = None  # key -> list of [b, S, H] per forward, while capturing
        self._on_forward: Callable[[dict], None] | None = None
        self.cap = getattr(lm.config.get_text_config(), "final_logit_softcapping", None)

    @contextlib.contextmanager
    def capture(self, on_forward: Callable[[dict], None] | None = None):
        """Keep what no-grad forwards inside the block compute; the hooks exist only within it.
        on_forward(states): called once per forward, when its final norm ran, with {key: [b, S, H]}
        (keys: the aux layer indices and "norm"); the states are then not kept."""
        self._kept, self._on_forward = {k: [] for k in self._modules}, on_forward
        handles = [m.register_forward_hook(self._hook(k)) for k, m in self._modules.items()]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self._on_forward = None

    def _hook(self, key):
        def keep(module, args, out):
            if torch.is_grad_enabled():  # the no-grad pass only: a training forward keeps nothing
                return
            self._kept[key].append((out[0] if isinstance(out, tuple) else out).detach())
            if key == "norm" and self._on_forward is not None:  # the forward's last hooked module
                states = {k: v.pop() for k, v in self._kept.items() if v}
                self._on_forward(states)
        return keep

    def hidden(self, key) -> torch.Tensor:
        """[B, S, H] of the kept forwards (capture without on_forward), rows in call order."""
        return torch.cat(self._kept[key], 0)

    def states(self) -> dict:
        """{key: [B, S, H]} of every kept forward."""
        return {k: self.hidden(k) for k in self._modules}

    @property
    def forwards(self) -> int:
        """Forwards kept so far (capture without on_forward)."""
        return 0 if self._kept is None else len(self._kept["norm"])

    def release(self) -> None:
        self._kept = None

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The policy's logits [.., V] float32 from final-norm states, soft-capped as the engine does (Gemma)."""
        logits = self.lm.get_output_embeddings()(normed)
        if self.cap is not None:
            logits = torch.tanh(logits / self.cap) * self.cap
        return logits.float()

    def samples(self, hid: dict, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int, *,
                topk: int, params: SamplingParams, dtype: torch.dtype) -> list[TapSample | None]:
        """One TapSample per row of a pass (None for a row the engine would not bank: no completion token,
        or n <= 2). hid: the pass's states ({key: [B, S, H]}); input_ids, attention_mask [B, S]; see the
        module docstring."""
        prompt_cols = input_ids.shape[1] - completion_len
        out = []
        with torch.no_grad():
            for b in range(input_ids.shape[0]):
                cols = attention_mask[b].nonzero().squeeze(-1)
                P = int(attention_mask[b, :prompt_cols].sum())
                n = len(cols) - 1
                if len(cols) == P or n <= 2:
                    out.append(None)
                    continue
                feats = torch.cat([hid[i][b, cols[:n]] for i in self.aux_layers], -1).to(dtype)
                dist = self._dist(hid["norm"][b, cols[P:n]], n, P, topk, params) if topk > 0 else None
                out.append(TapSample(feats, input_ids[b, cols].tolist(), dist))
        return out

    def _dist(self, normed: torch.Tensor, n: int, P: int, k: int, params: SamplingParams) -> Dist:
        """Top-k of the processed law at positions P..n-1 (normed [n - P, H]); zeros elsewhere."""
        ids, probs, rest = law_top_k(self.logits(normed), params, k)
        dev = probs.device
        dist = Dist(torch.zeros(n, k, dtype=torch.int32, device=dev), torch.zeros(n, k, dtype=torch.float16, device=dev),
                    torch.zeros(n, dtype=torch.float16, device=dev), torch.zeros(n, dtype=torch.bool, device=dev))
        dist.ids[P:], dist.probs[P:], dist.rest[P:] = ids, probs.to(torch.float16), rest.to(torch.float16)
        dist.has[P:] = True
        return dist


def feed_pass(tap: FeatureTap, intake, hid: dict, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              completion_len: int, params: SamplingParams, policy_version: int) -> int:
    """The samples of a pass's rows (states `hid`) into `intake` (a DrafterIntake); returns how many went in."""
    temperature = 1.0 if params.greedy else params.temperature  # as the engine tags greedy calls
    fed = 0
    for s in tap.samples(hid, input_ids, attention_mask, completion_len, topk=intake.topk, params=params,
                         dtype=intake.dtype):
        if s is not None:
            intake.add(s.feats, s.token_ids, policy_version, s.dist, temperature)
            fed += 1
    return fed


class RowFeeder:
    """An on_forward for FeatureTap.capture over a pass chunked by rows, in order (TRL's, PPO's): each
    forward's states go to feed_pass with the rows they belong to, and are dropped after."""

    def __init__(self, tap: FeatureTap, intake, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 completion_len: int, params: SamplingParams, policy_version: int):
        self.tap, self.intake, self.ids, self.mask, self.C = tap, intake, input_ids, attention_mask, completion_len
        self.params, self.version = params, policy_version
        self.row, self.fed = 0, 0

    def __call__(self, hid: dict) -> None:
        b, S = hid["norm"].shape[:2]
        lo, self.row = self.row, self.row + b
        if self.row > len(self.ids) or S != self.ids.shape[1]:
            # a forward that is not the next chunk of these rows: feeding it would mislabel samples
            log.warning("drafter feed: a forward of %d x %d tokens does not fit rows %d.. of the %d x %d pass; "
                        "its states are not fed", b, S, lo, *self.ids.shape)
            return
        self.fed += feed_pass(self.tap, self.intake, hid, self.ids[lo:lo + b], self.mask[lo:lo + b], self.C,
                              self.params, self.version)


@torch.no_grad()
def feed_results(policy: torch.nn.Module, intake, results: list[RolloutResult], params: SamplingParams,
                 policy_version: int, rows_per_forward: int = 8, pad_id: int = 0) -> int:
    """Run `policy`'s decoder (no grad, no LM head over all positions) over the results' prompt +
    completion through a tap and feed their samples: the warm start of a backend whose sampler shows
    no hidden states (vLLM). Returns how many samples went in."""
    tap = FeatureTap(policy, intake.aux_layers)
    dev = next(policy.parameters()).device
    ids, mask, C = (t.to(dev) if isinstance(t, torch.Tensor) else t for t in pad_rollouts(results, pad_id))
    feeder = RowFeeder(tap, intake, ids, mask, C, params, policy_version)
    with tap.capture(feeder):
        for lo in range(0, len(results), rows_per_forward):
            tap.backbone(input_ids=ids[lo:lo + rows_per_forward], attention_mask=mask[lo:lo + rows_per_forward])
    tap.release()
    return feeder.fed
