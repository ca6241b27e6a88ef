"""VLLMBackend: the RolloutBackend protocol on an in-process vLLM `LLM` (colocated, like TRL's colocate mode).

What rlspec keeps when vLLM decodes (docs/vllm_backend.md):
- the speculation policy: SpecConfig maps to vLLM's speculative_config (spec_map.py); the fixed
  selector becomes vLLM's per-batch-size depth table, from step costs (depth.py);
- the learned drafter: the host (host.py) owns the network and its trainer, no copy of the policy; the
  trainer's own pass over vLLM's rollouts feeds it (drafter_intake, trainers/drafter_feed.py), the warm
  start samples with vLLM and feeds one pass of the policy; vLLM speculates with its EAGLE-3 export, and
  a new version is pushed into vLLM's draft model before a rollout (at most one push per rollout);
- the result shape: prompt-major RolloutResults with the sampling distribution's per-token logprobs.

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so weights move by reference: the trainer's
tensors go straight into vLLM's model through `collective_rpc` (weights.py), no serialization.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import rlspec.rollout.metrics as M
from rlspec.rollout.eos import resolve_eos
from rlspec.rollout.metrics import RolloutMetrics
from rlspec.rollout.runtime.model.loader import body_tensor
from rlspec.rollout.types import RolloutResult, SamplingParams, SpecConfig
from rlspec.rollout.speculation.drafter_health import DrafterHealth, HealthConfig, fingerprint
from rlspec.rollout.vllm_backend import cpu_fixes, step_costs, weights
from rlspec.rollout.vllm_backend.depth import depths
from rlspec.rollout.vllm_backend.host import DrafterHost
from rlspec.rollout.vllm_backend.scratch import ScratchDir
from rlspec.rollout.vllm_backend.spec_map import DepthTable, check_supported, speculative_config

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# drafts counted before the depth table follows a new acceptance figure (a few verifies of a batch are noise)
MIN_TABLE_DRAFTS = 32
# On a GPU vLLM takes this share of the device's memory (the trainer's policy and optimizer share it).
GPU_MEMORY_SHARE = 0.3
# What vLLM holds on a GPU beyond the weights and a stated KV cache: a step's activations and logits, CUDA graphs,
# the EAGLE-3 drafter (one layer and a head); counted into gpu_memory_utilization when kv_memory_gb is set.
RUNTIME_HEADROOM_GB = 4.0


class VLLMBackend:
    """A colocated vLLM holding a copy of `policy`. Build with build_backend("vllm", ...) (rollout.backend).

    dtype / max_model_len / max_num_seqs: as the engine's. kv_memory_gb: vLLM's KV cache size
    (kv_cache_memory_bytes); on a GPU gpu_memory_utilization then follows it (budget_share: weights + KV +
    RUNTIME_HEADROOM_GB over the device's memory; vLLM's 0.9 would refuse to start beside a trainer).
    Without it: on CPU what max_num_seqs full-length sequences need (vLLM's own
    CPU sizing subtracts this process's whole footprint, the trainer's included, from its share of RAM
    and fails when colocated); on GPU memory_share of the device (gpu_memory_utilization).
    graph_mode "off" forces eager mode (enforce_eager); CPU always runs eagerly here.
    drafter_push_every: push the learned drafter into vLLM once its version moved by at least this many
    versions since the last push (1: every new version; checked once per generate).
    Other engine settings (kv_block_size, free_kv_between_rollouts, ...) have no vLLM meaning and are ignored.
    """

    health: DrafterHealth | None = None  # drafter health, with speculation on (set at start)
    _readback = None  # reads vLLM's draft model back after a push (with a learned drafter)

    def __init__(self, policy, tokenizer, spec: SpecConfig | None = None, *, dtype=None, max_model_len: int = 2048,
                 max_num_seqs: int = 64, kv_memory_gb: float | None = None, memory_share: float | None = None,
                 graph_mode: str = "auto", seed: int = 0, drafter_push_every: int = 1, head_dtype=None,
                 **_engine_only):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights move by reference
        from vllm import LLM

        self.spec = spec or SpecConfig()
        check_supported(self.spec)  # fail before any model is copied
        if head_dtype is not None:  # as TRL's own vLLM path: vLLM computes the head in the model's dtype
            log.warning("rollout.backend=vllm: vLLM computes the LM head in %s, not %s (cast_lm_head_to_fp32 "
                           "applies to the trainer's forward only); TRL's importance-sampling correction covers it",
                           dtype, head_dtype)
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.policy_version = 0
        self.host = None
        if drafter_push_every < 1:
            raise ValueError(f"drafter_push_every must be >= 1 (versions between pushes), got {drafter_push_every}")
        self.drafter_push_every = drafter_push_every
        # the trainer's own policy, by reference (no copy): the warm start's pass runs it (host.warm_start)
        self._policy = policy
        # the policy copy vLLM loads from (GBs): removed by close(), at exit, or by the next run after a kill
        self._scratch = ScratchDir.create("rlspec-vllm-")
        self._dir = self._scratch.path
        try:
            self._start(LLM, policy, tokenizer, dtype, max_model_len, max_num_seqs, kv_memory_gb, memory_share,
                        graph_mode, seed)
        except BaseException:
            self.close()  # a failed start leaves neither the copy on disk nor the host's drafter thread
            raise

    def _start(self, LLM, policy, tokenizer, dtype, max_model_len, max_num_seqs, kv_memory_gb, memory_share,  # noqa: N803
               graph_mode, seed) -> None:
        on_cpu = next(policy.parameters()).device.type == "cpu"
        # the decoder layers' dtype, as the engine's default (a float32 cast_lm_head_to_fp32 head comes first)
        dtype = str(dtype or body_tensor(policy.named_parameters()).dtype).removeprefix("torch.")
        policy.save_pretrained(self._dir / "policy", safe_serialization=True)  # vLLM loads from a directory
        if tokenizer is not None:
            tokenizer.save_pretrained(self._dir / "policy")
        self.eos_token_ids = set(resolve_eos(policy, tokenizer))
        cpu_fixes.apply()  # vLLM's CPU build samples drafted positions at garbage temperatures (cpu_fixes.py)
        self.host = DrafterHost.build(policy, self.spec)
        # selector fixed: vLLM starts with up to num_draft_tokens at every batch size; the table from its own
        # measured step costs replaces it once it runs (below), and follows the measured acceptance
        k = self.spec.num_draft_tokens
        fixed = self.spec.enabled and self.spec.selector == "fixed"
        self.depth_table = DepthTable(((1, max_num_seqs, k),)) if fixed else None
        drafter_dir = self.host.export(self._dir / "drafter_v0") if self.host is not None else None
        if drafter_dir:
            _check_layer_ids(drafter_dir)
        self.speculative_config = speculative_config(self.spec, drafter_dir, self.depth_table)
        # processed_logprobs = log softmax(logits / T), ours at top_p = 1 and top_k = 0 (exact under speculation
        # too once cpu_fixes is in: the wrong and NaN ones measured before were its temperatures)
        memory = _memory_args(policy.config, dtype, on_cpu, kv_memory_gb, memory_share, max_num_seqs, max_model_len,
                              _weight_bytes(policy, dtype), None if on_cpu else _device_memory(policy))
        self.llm = LLM(model=str(self._dir / "policy"), dtype=dtype, max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, enforce_eager=on_cpu or graph_mode == "off", seed=seed,
                       speculative_config=self.speculative_config, disable_log_stats=False,
                       logprobs_mode="processed_logprobs", skip_tokenizer_init=tokenizer is None, **memory)
        self._pushed_drafter = self.host.version() if self.host is not None else 0
        self._drafter_pushes = 0
        self.acceptance: float | None = None  # vLLM's measured per-token acceptance the table rests on
        if fixed:
            probe = [i % policy.config.get_text_config().vocab_size for i in range(1, 17)]
            self.costs = step_costs.measure(self.llm, max_num_seqs, depths(k), probe)
            self._retable(weights.spec_counters(self.llm), force=True)
        self._metrics = RolloutMetrics()
        self._spec_counters = weights.spec_counters(self.llm)
        # drafter health (rollout/speculation/drafter_health.py, docs/gpu.md#what-the-metrics-should-look-like): each
        # push read back; speculation off while acceptance is below the floor, probes to turn it back on; a forced
        # arm ("always") only warns
        self.health = DrafterHealth(HealthConfig(enforce=self.spec.selector != "always"), "vllm") \
            if self.spec.enabled else None
        self._readback = None
        if self.host is not None:
            from rlspec.rollout.vllm_backend.drafter_readback import DraftReadback

            self._readback = DraftReadback(self.llm, self.host.drafter_tensors())

    # ---- RolloutBackend -----------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams | None = None) -> list[RolloutResult]:
        """params.n samples per prompt, prompt-major; logprobs of the temperature-scaled distribution."""
        params = params or SamplingParams()
        self._validate(prompt_token_ids, params)
        self.push_drafter()  # a drafter version published since the last rollout goes in first
        t0 = time.perf_counter()
        # one request per sample (vLLM refuses n > 1 at temperature 0); prompt-major like the engine, and its
        # prefix cache shares each prompt's KV among its samples
        requests = [{"prompt_token_ids": list(p)} for p in prompt_token_ids for _ in range(params.n)]
        sampling = [self._vllm_params(p, i, j, params) for i, p in enumerate(prompt_token_ids) for j in range(params.n)]
        if self.host is not None:
            self.host.set_idle(False)  # vLLM decodes: the drafter's trainer waits, as it does for the engine
        before = weights.spec_counters(self.llm) if self.health is not None else None
        speculate = self.health is None or self.health.speculate()
        try:
            with contextlib.nullcontext() if speculate else step_costs.forced_depth(self.llm, 0):
                outs = self.llm.generate(requests, sampling, use_tqdm=False)
        finally:
            if self.host is not None:
                self.host.set_idle(True)
        if before is not None:
            now = weights.spec_counters(self.llm)
            self.health.observe(*(int(now[k] - before[k]) for k in ("drafts", "draft_tokens", "accepted")))
        results = [_result(r["prompt_token_ids"], k // params.n, k % params.n, o.outputs[0], self.policy_version)
                   for k, (r, o) in enumerate(zip(requests, outs))]
        self._record(results, time.perf_counter() - t0)
        if self.depth_table is not None:
            self._retable(weights.spec_counters(self.llm))
        return results

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The policy's parameters (HF names) into vLLM's model; bumps policy_version. vLLM's prefix cache
        holds KV of the old weights: dropped."""
        weights.load_policy(self.llm, [(n, t.detach()) for n, t in named_tensors])
        self.policy_version += 1
        if self.health is not None:
            self.health.synced(self.policy_version)

    def push_drafter(self, force: bool = False) -> bool:
        """Push the host's learned drafter into vLLM's draft model when its version moved by drafter_push_every
        (force: by any amount); True if pushed."""
        if self.host is None:
            return False
        version = self.host.version()
        moved = version - self._pushed_drafter
        if moved <= 0 or (moved < self.drafter_push_every and not force):
            return False
        tensors = self.host.drafter_tensors()
        weights.load_drafter(self.llm, tensors)
        if self.health is not None and self._readback is not None:  # what vLLM drafts with now, read back
            self.health.pushed(version, fingerprint(tensors), {"vllm": self._readback.held(self.llm)}, by_name=False)
        self._pushed_drafter = version
        self._drafter_pushes += 1
        if self.depth_table is not None:
            # a new drafter: the table rests on its trainer's estimate of it (else the prior) until vLLM has
            # counted enough of its drafts; a table of zeros would otherwise never draft again to find out
            est = self.host.metrics(self.policy_version).get("drafter/est_accept", float("nan"))
            self.acceptance = est if math.isfinite(est) else None
            self._retable(weights.spec_counters(self.llm), force=True)
        return True

    def _retable(self, now: dict, force: bool = False) -> None:
        """Re-derive the depth table once MIN_TABLE_DRAFTS drafts measured the acceptance since the last
        table (or the last drafter push), and install it in vLLM's scheduler if it changed."""
        a, drafts = step_costs.acceptance(self._table_counters, now) if not force else (None, 0.0)
        if not force and drafts < MIN_TABLE_DRAFTS:
            return
        self.acceptance = a if a is not None else self.acceptance
        self._table_counters = now
        table = step_costs.table_for(self.costs, self.acceptance, self.spec.num_draft_tokens, self.max_num_seqs,
                                     self.spec.max_spec_batch)
        if force or table != self.depth_table:
            step_costs.install(self.llm, table)
            self.depth_table = table

    def drafter_intake(self):
        """Where the trainer's pass over vLLM's rollouts sends the drafter's samples (trainers/drafter_feed.py);
        None without a learned drafter trained online. vLLM banks nothing itself, so claim() changes nothing."""
        return self.host.intake() if self.host is not None else None

    def stats(self) -> dict[str, float]:
        """rollout/* as the engine names them (accept_len and accept_rate from vLLM's speculation
        counters), plus vllm/* (depth table, drafter pushes)."""
        out = self._metrics.as_dict()
        out[M.POLICY_VERSION] = float(self.policy_version)
        now = weights.spec_counters(self.llm)
        drafts, drafted, accepted = (now[k] - self._spec_counters[k] for k in ("drafts", "draft_tokens", "accepted"))
        self._spec_counters = now
        if drafts > 0:  # the engine's convention: accepted length counts the target's own token
            out[M.ACCEPT_LEN] = 1.0 + accepted / drafts
            out[M.ACCEPT_RATE] = accepted / max(drafted, 1)
            if self.spec.enabled:
                out[f"rollout/accept_len/{self.spec.drafter}"] = out[M.ACCEPT_LEN]
        out["vllm/max_depth"] = float(self.depth_table.max_depth if self.depth_table else
                                      (self.spec.num_draft_tokens if self.speculative_config else 0))
        out["vllm/drafter_pushes"] = float(self._drafter_pushes)
        if self.acceptance is not None:
            out["vllm/table_acceptance"] = self.acceptance
        if self.health is not None:
            out.update(self.health.metrics())
        if self.host is not None:
            out.update(self.host.metrics(self.policy_version))  # the trainer's loss, buffer, lag
            out["drafter/version"] = float(self._pushed_drafter)  # the version vLLM drafts with
            out["drafter/accept_len"] = out.get(M.ACCEPT_LEN, 1.0)
        self._metrics = RolloutMetrics()
        return out

    def release_kv(self) -> None:
        """vLLM keeps its KV cache allocated (its sleep mode is CUDA-only); nothing to hand back here."""

    @property
    def has_learned_drafter(self) -> bool:
        return self.host is not None

    def warm_start_drafter(self, prompts, *, budget_s: float, group: int, max_new_tokens: int, temperature: float,
                           **options):
        """Warm the learned drafter on vLLM's rollouts of `prompts`, their features from one no-grad pass of
        the policy (host.warm_start: options such as max_steps, or a warm-up trainer's min_tokens), then push
        it into vLLM."""
        result = self.host.warm_start(self.generate, self._policy, prompts, budget_s=budget_s, group=group,
                                      max_new_tokens=max_new_tokens, temperature=temperature, **options)
        self.push_drafter(force=True)
        return result

    def export_drafter(self, path: str, metadata: dict | None = None) -> str:
        return self.host.export(path, {"policy_version": self.policy_version, **(metadata or {})})

    def close(self) -> None:
        """Stops the host's drafter training and removes the policy copy vLLM loaded from; the drafter
        stays exportable. Never raises (a close() in a finally block must not hide the error that
        brought the run there): a failing host close is logged. Safe to call twice."""
        try:
            if self.host is not None:
                self.host.close()
        except Exception as err:  # noqa: BLE001 - see the docstring
            log.error("closing the vLLM backend's drafter host failed: %s: %s", type(err).__name__, err)
        finally:
            self._scratch.close()

    # ---- helpers ------------------------------------------------------------------------------
    def _vllm_params(self, prompt: list[int], i: int, j: int, params: SamplingParams):
        from vllm import SamplingParams as VParams

        stop = list(params.stop_token_ids or []) + ([] if params.ignore_eos else sorted(self.eos_token_ids))
        # sample j of prompt i draws from seed + i n + j: no two samples of a call share a seed, and the
        # call reproduces from params.seed
        seed = None if params.seed is None else (params.seed + i * params.n + j) % 2**31
        return VParams(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                       min_p=params.min_p,
                       max_tokens=min(params.max_new_tokens, self.max_model_len - len(prompt)), seed=seed,
                       stop_token_ids=stop, ignore_eos=True, logprobs=0, detokenize=False)

    def _validate(self, prompts: list[list[int]], params: SamplingParams) -> None:
        from rlspec.rollout.limits import check_prompt_lengths, prompt_too_long_error

        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        if params.min_p > 0 and params.top_p < 1:
            # vLLM applies min-p before top-p, transformers (and our engine) after: the two laws differ (min-p
            # commutes with top-k: both keep a top set by rank, the top token included)
            raise ValueError(f"min_p={params.min_p} with top_p={params.top_p}: vLLM applies min-p before top-p, "
                             "transformers after, so the vLLM backend would sample another law than the engine; "
                             "use one of the two, or the in-process engine")
        if params.penalised:
            # the same law as the engine's, but vLLM's logprobs (processed or raw) cannot be the engine's
            # temperature-only ones of the unpenalised logits (docs/verification.md#logprobs)
            raise ValueError(f"repetition_penalty={params.repetition_penalty} on the vLLM backend: vLLM's logprobs "
                             "would include the penalty where the engine's do not; use the in-process engine")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        long = check_prompt_lengths(prompts, self.max_model_len)
        if long:
            raise prompt_too_long_error([(i, len(prompts[i])) for i in long], self.max_model_len, total=len(prompts),
                                        where="vLLM's")

    def _record(self, results: list[RolloutResult], seconds: float) -> None:
        m = self._metrics
        m.time_s += seconds
        m.generate_calls += 1
        m.sequences += len(results)
        m.generated_tokens += sum(len(r.completion_ids) for r in results)
        m.completion_lens.extend(len(r.completion_ids) for r in results)


def _result(prompt: list[int], i: int, j: int, c, version: int) -> RolloutResult:
    """One vLLM CompletionOutput as a RolloutResult: logprobs=0 returns the sampled token's logprob."""
    ids = list(c.token_ids)
    lps = [float(step[tok].logprob) for tok, step in zip(ids, c.logprobs)]
    return RolloutResult(list(prompt), ids, lps, "stop" if c.finish_reason == "stop" else "length", version,
                         prompt_index=i, sample_index=j)


def _check_layer_ids(drafter_dir: str) -> None:
    """vLLM captures each target layer once: an EAGLE-3 drafter reading one layer twice (the default ids
    (2, L//2, L-3) collide on targets of fewer than 7 layers) would get too few features."""
    import json

    ids = json.loads((Path(drafter_dir) / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    if len(set(ids)) != len(ids):
        raise ValueError(f"the EAGLE-3 drafter reads target layers {ids}, one of them twice, which vLLM cannot "
                         "feed (it captures each layer once); use a target of at least 7 layers or a drafter "
                         "trained on three distinct layers")


def _memory_args(config, dtype: str, on_cpu: bool, kv_memory_gb, memory_share, max_num_seqs: int,
                 max_model_len: int, weight_bytes: int = 0, device_memory: tuple[int, int] | None = None) -> dict:
    """vLLM's memory settings (see VLLMBackend's docstring). weight_bytes: the policy copy vLLM loads;
    device_memory: the GPU's (free, total) bytes now, with the trainer's tensors already on it."""
    if kv_memory_gb:
        kv = int(kv_memory_gb * 2**30)
        if on_cpu:
            return dict(kv_cache_memory_bytes=kv)
        # vLLM sizes the KV cache from kv_cache_memory_bytes, but still refuses to start unless the free memory
        # covers gpu_memory_utilization x total (default 0.9): colocated with a trainer it never does. The share
        # follows the stated budget instead.
        return dict(kv_cache_memory_bytes=kv, gpu_memory_utilization=budget_share(kv, weight_bytes, *device_memory))
    if on_cpu:
        return dict(kv_cache_memory_bytes=kv_bytes_needed(config, dtype, max_num_seqs, max_model_len))
    return dict(gpu_memory_utilization=memory_share or GPU_MEMORY_SHARE)


def budget_share(kv_bytes: int, weight_bytes: int, free: int, total: int) -> float:
    """gpu_memory_utilization for a stated KV budget: (weights + KV + RUNTIME_HEADROOM) / total, rounded up to a
    percent but never past what is free; an error when the budget does not fit in the free memory."""
    need = weight_bytes + kv_bytes + int(RUNTIME_HEADROOM_GB * 2**30)
    if need > free:
        gib = 2**30
        raise ValueError(
            f"rollout.kv_memory_gb={kv_bytes / gib:.1f} does not fit on this GPU: vLLM needs ~{need / gib:.1f} GiB "
            f"(policy weights {weight_bytes / gib:.1f} + KV cache {kv_bytes / gib:.1f} + {RUNTIME_HEADROOM_GB:.0f} "
            f"for activations, CUDA graphs and the drafter) and {free / gib:.1f} of {total / gib:.1f} GiB are free. "
            f"Lower rollout.kv_memory_gb, or free memory for it (a smaller policy/optimizer footprint: ZeRO, "
            f"offload, LoRA).")
    return min(math.ceil(need / total * 100) / 100, math.floor(free / total * 1000) / 1000)


def kv_bytes_needed(config, dtype: str, max_num_seqs: int, max_model_len: int) -> int:
    """K and V of every layer (+1: an EAGLE-3 drafter's own layer) for max_num_seqs full sequences."""
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = 2 * (text.num_hidden_layers + 1) * text.num_key_value_heads * head_dim * \
        (4 if dtype == "float32" else 2)
    return max(per_token * max_num_seqs * max_model_len, 2**26)


def _weight_bytes(policy, dtype: str) -> int:
    """Bytes of the policy copy vLLM loads, in its dtype (parameters() counts a tied embedding once)."""
    return sum(p.numel() for p in policy.parameters()) * (4 if dtype == "float32" else 2)


def _device_memory(policy) -> tuple[int, int]:
    """(free, total) bytes of the policy's GPU now."""
    import torch

    return torch.cuda.mem_get_info(next(policy.parameters()).device)
