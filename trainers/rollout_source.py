"""RolloutSource: the one way GRPO and PPO get rollouts out of the engine.

Both trainers need the same things around `engine.generate`: an engine built from the policy (its
weights gathered under ZeRO-3), a weight push when the policy moved since the last rollout, a fresh
reproducible sampling seed per call, a check that one result came back per requested sample, and the
engine's metrics plus our timings (rollout/wall_s, rollout/sync_s) in the trainer's metric store so
they are logged at the step they belong to. Keeping that here means speculation, weight sync and
metrics behave identically whichever algorithm consumes the samples.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import rlspec.rollout.metrics as M
from rlspec.rollout.types import PartialRound, RolloutResult, SamplingParams, SpecConfig
from rlspec.trainers.peft_sync import engine_source, is_peft_model
from rlspec.trainers.policy_attention import eager_where_capped
from rlspec.trainers.weight_sync import DEFAULT_BUCKET_MB, WeightSyncer, gathered_model


def build_engine(policy, tokenizer, spec_config: SpecConfig | None, defaults: dict, engine_kwargs: dict):
    """A rollout backend (engine_kwargs["backend"], default the in-process RolloutEngine) holding a copy of
    `policy` (a bare HF causal LM, or a PEFT model: its base model's weights, trainers/peft_sync.py). engine_kwargs
    (the user's: max_model_len, max_num_seqs, dtype, graph_mode, KV settings) override the trainer's `defaults`.
    Raises rollout.errors.UnsupportedModelError for a policy the runtime cannot compute."""
    from rlspec.rollout.backend import build_backend

    kwargs = {**defaults, **engine_kwargs}
    name = kwargs.pop("backend", "engine")
    # ZeRO-3 partitions weights at load time; the engine needs them whole (and merged, for PEFT)
    with gathered_model(policy), engine_source(policy) as source:
        return build_backend(name, source, tokenizer, spec_config, **kwargs)


def for_trainer(trainer, policy, tokenizer, spec_config: SpecConfig | None, engine, engine_kwargs: dict,
                max_num_seqs: int, max_model_len: int | None) -> "RolloutSource":
    """The RolloutSource of an HF/TRL trainer (SpecGRPOTrainer, PPOTrainer): `engine` if given, else one
    built from `policy` (max_num_seqs rows, max_model_len or the model's own limit, engine_kwargs
    overriding both); weight sync through the trainer's accelerator (ZeRO-3 gathers of at most
    engine_kwargs["sync_bucket_mb"] MB, a sync setting rather than the engine's), seeds from its args.seed,
    TRL's profiling around sync and generation."""
    from trl.extras.profiling import profiling_context

    # the trainer's forwards compute the attention the engine does (a Gemma 2 on SDPA would drop its soft-cap)
    eager_where_capped(policy, getattr(trainer, "ref_model", None), getattr(trainer, "ref_policy", None))
    engine_kwargs = dict(engine_kwargs)
    bucket_mb = engine_kwargs.pop("sync_bucket_mb", None) or DEFAULT_BUCKET_MB
    built_here = engine is None
    context = None  # the engine's own max_model_len unless we build it (a Ray pool does not expose one)
    dtypes = {}
    if built_here:
        dtypes = sampling_dtypes(trainer.args, policy, engine_kwargs)
        defaults = dict(max_model_len=max_model_len or default_max_model_len(policy), max_num_seqs=max_num_seqs,
                        **dtypes)
        context = {**defaults, **engine_kwargs}["max_model_len"]
        engine = build_engine(policy, tokenizer, spec_config, defaults, engine_kwargs)
    # An engine built from the policy right now already holds its weights: no first push needed, except for a
    # PEFT policy, built from its base weights and pushed merged here (trainers/peft_sync.py).
    peft = is_peft_model(policy)
    source = RolloutSource(engine, trainer.accelerator, trainer.state.global_step if built_here and not peft else None,
                           seed=trainer.args.seed, process_index=trainer.accelerator.process_index,
                           profile=lambda name: profiling_context(trainer, name), bucket_bytes=int(bucket_mb * 2**20),
                           max_model_len=context)
    source.sampling_dtype = dtypes.get("dtype")  # None: an engine the caller built, in its own dtype
    if peft:
        source.weight_syncer.maybe_sync(policy, trainer.state.global_step)
    from rlspec.trainers.drafter_feed import DrafterFeed

    source.drafter_feed = DrafterFeed.for_backend(engine, policy)  # the learned drafter learns from our own pass
    return source


def sampling_dtypes(args, policy, engine_kwargs: dict) -> dict:
    """The engine's dtype and head_dtype for a trainer with TrainingArguments `args` (trainers/sampling_dtype.py:
    its compute dtype, not the master weights'; the user's engine_kwargs dtype wins)."""
    from rlspec.rollout.runtime.model.loader import body_tensor
    from rlspec.trainers.sampling_dtype import head_dtype, sampling_dtype

    body = body_tensor(policy.named_parameters())
    dtype = sampling_dtype(args, policy, engine_kwargs.get("dtype"), engine_kwargs.get("device", body.device),
                           body.dtype)
    head = head_dtype(args)
    return dict(dtype=dtype, **({"head_dtype": head} if head is not None and head != dtype else {}))


def preflight(trainer, drop_long_prompts: bool) -> int:
    """Before step 1: every prompt of the trainer's train_dataset must fit its rollout context
    (trainers/preflight.py). Raises PromptTooLongError naming the rows, or drops them when asked; returns how
    many were dropped. A backend whose context is unknown is not checked (it refuses at generate)."""
    from rlspec.trainers.preflight import check_trainer_prompts

    if trainer.rollouts.max_model_len is None:
        return 0
    return check_trainer_prompts(trainer, trainer.rollouts.max_model_len, drop=drop_long_prompts)


def default_max_model_len(policy) -> int:
    """The model's own position limit, capped at 2048 (prompt + completion tokens per sequence)."""
    return min(getattr(policy.config.get_text_config(), "max_position_embeddings", 2048), 2048)


class RolloutSource:
    """Sync-if-needed, generate, record metrics: what a trainer calls once per rollout.

    engine: the rollout backend (rollout/backend.py: the RolloutEngine, or any RolloutBackend).
    accelerator: the trainer's accelerator (weight sync unwraps and gathers through it).
    synced_step: the optimizer step whose weights the engine holds (None forces the first push).
    seed / process_index: make every call's sampling seed reproducible and distinct per process.
    profile: name -> context manager around sync and generation (TRL's profiling_context), optional.
    bucket_bytes: the most bytes one ZeRO-3 gather of a weight sync brings in.
    max_model_len: the context every prompt must fit (None: the engine's own, if it has one).
    """

    def __init__(self, engine, accelerator, synced_step: int | None, seed: int, process_index: int = 0,
                 profile: Callable[[str], contextlib.AbstractContextManager] | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_MB * 2**20, max_model_len: int | None = None):
        self.engine = engine
        self.weight_syncer = WeightSyncer(engine, accelerator, synced_step=synced_step, bucket_bytes=bucket_bytes)
        self.seed, self.process_index = seed, process_index
        self.calls = 0
        self.max_model_len: int | None = max_model_len or getattr(engine, "max_model_len", None)
        self._profile = profile or (lambda name: contextlib.nullcontext())
        self.last_wall_s = 0.0
        # trainers/drafter_feed.py: feeds the drafter from the trainer's pass over the rollouts (None: the
        # backend banks its own samples, or trains no drafter); it needs the last call's law and policy version
        self.drafter_feed = None
        self.last_params: SamplingParams | None = None
        self.sampling_dtype = None  # the dtype the backend samples in, when this source chose it (for_trainer)
        self.last_policy_version = 0
        self.keyed = getattr(engine, "supports_sample_keys", False)  # draws per sample key (trainers/sample_keys.py)

    def generate(self, policy, step: int, prompt_ids: list[list[int]], n: int, *, temperature: float,
                 max_new_tokens: int, stop_token_ids: list[int], top_p: float = 1.0, top_k: int = 0,
                 min_p: float = 0.0, repetition_penalty: float = 1.0,
                 partial: PartialRound | None = None, sample_keys: list[int] | None = None) -> list[RolloutResult]:
        """n samples of each prompt from the policy as of optimizer step `step`, prompt 0's n first.
        The sampling options are SamplingParams' (trainers/sampling_args.py maps TRL's onto them).

        policy: the module whose parameters go to the engine when `step` differs from the synced step.
        Raises rollout.errors.NonFiniteLogitsError when the policy's logits are NaN/inf; the trainer's
        on_nonfinite policy handles it (trainers/run/checkpoint.py).
        partial: a round of partial rollouts (rollout/types.py PartialRound; n is then ignored): the results are
        its samples, prompt by prompt, the unfinished ones with finish_reason "partial".
        sample_keys: one per result (trainers/sample_keys.py): each sample's draws come from its key alone; ignored
        by a backend without `supports_sample_keys` (its samples then depend on the call's seed).
        """
        start = time.perf_counter()
        with self._profile("sync_weights"):
            self.weight_syncer.maybe_sync(policy, step)
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                repetition_penalty=repetition_penalty, max_new_tokens=max_new_tokens,
                                n=n, seed=self._next_seed(), stop_token_ids=list(stop_token_ids))
        if self.drafter_feed is not None:
            self.drafter_feed.claim()  # from the first rollout on, our pass feeds the drafter, not the backend
        with self._profile("RolloutEngine.generate"):
            try:
                extra = {} if partial is None else {"partial": partial}
                if sample_keys is not None and self.keyed:
                    extra["sample_keys"] = sample_keys
                results = self.engine.generate(prompt_ids, params, **extra)
            except BaseException:
                # a failed call consumes no seed: a checkpoint taken now (on_nonfinite=stop, a lost backend) is
                # the state before this step, and the resumed run draws this step's samples with its seed
                self.calls -= 1
                raise
        wanted = len(prompt_ids) * n if partial is None else sum(len(s) for s in partial.samples)
        if len(results) != wanted:
            raise RuntimeError(f"engine returned {len(results)} results for {wanted} requested samples")
        self.last_wall_s = time.perf_counter() - start
        self.last_params, self.last_policy_version = params, results[0].policy_version if results else 0
        return results

    @property
    def feeds_drafter(self) -> bool:
        """Whether the trainer's next pass over the last rollout feeds the learned drafter (drafter_pass acts)."""
        feed = self.drafter_feed
        return feed is not None and feed.claimed and self.last_params is not None

    def drafter_pass(self, input_ids, attention_mask, completion_len: int):
        """Context for the trainer's no-grad forward over the last rollout's rows: feeds the learned drafter
        (DrafterFeed.around_pass) when a feed has claimed the backend's intake; else does nothing."""
        if not self.feeds_drafter:
            return contextlib.nullcontext()
        return self.drafter_feed.around_pass(input_ids, attention_mask, completion_len, self.last_params, self.last_policy_version)

    def _next_seed(self) -> int:
        # A fresh, reproducible seed per call and per process: same seed -> same rollouts.
        seed = hash((self.seed, self.process_index, self.calls)) % (2**31)
        self.calls += 1
        return seed

    def log_engine_stats(self, metrics) -> dict:
        """The engine's stats since the last call into a metric store (key -> list of floats), the shape of
        TRL's `self._metrics[mode]`, which the trainer averages and logs at the next log(); returns them."""
        stats = self.engine.stats()
        for key, value in stats.items():
            metrics[key].append(float(value))
        return stats

    def log_metrics(self, metrics) -> None:
        """log_engine_stats, plus the last generate call's timings and its sync's gathers."""
        self.log_engine_stats(metrics)
        metrics[M.WALL_S].append(self.last_wall_s)
        metrics["rollout/sync_s"].append(self.weight_syncer.last_time_s)
        # ZeRO-3 collective gathers of the last push (0 without ZeRO-3 or without a push)
        metrics["rollout/sync_gathers"].append(float(self.weight_syncer.last_gathers))
