"""Public value types of the rollout engine: what a caller asks for and what it gets back.

Plain dataclasses, no torch: they cross process boundaries (Ray) and config files unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlspec.rollout import rules as R  # plain Python: the rules the CLI config checks too


def _ruled(default, rule):
    """A field with the rule its values must follow (rollout/rules.py)."""
    return field(default=default, metadata={"rule": rule})


def _help(default, text: str, rule=None):
    """A field with a help string and its rule: the run config's `drafter:` section is SpecConfig, and
    `python -m rlspec.train --help` prints these."""
    return field(default=default, metadata={"help": text, **({"rule": rule} if rule is not None else {})})


@dataclass
class SamplingParams:
    """How to sample one generate call (the names follow vLLM's SamplingParams)."""

    temperature: float = _ruled(1.0, R.NON_NEGATIVE)  # 0 means greedy (argmax)
    top_p: float = _ruled(1.0, R.FRACTION)  # nucleus truncation; 1.0 keeps the whole distribution
    top_k: int = _ruled(0, R.at_least(0, "0 disables it"))  # 0 keeps every token
    # drop tokens below min_p x the top token's probability (after top-k/top-p); 0 = off
    min_p: float = _ruled(0.0, R.closed(0, 1, "0 disables it"))
    # HF/vLLM repetition penalty over the prompt and every token generated so far: a seen token's logit is
    # divided by it when positive, multiplied when negative, before temperature; 1.0 = off
    repetition_penalty: float = _ruled(1.0, R.Rule("a finite number > 0 (1.0 disables it; > 1 discourages repeats)",
                                                   R.POSITIVE.test))
    max_new_tokens: int = _ruled(256, R.AT_LEAST_1)
    n: int = _ruled(1, R.AT_LEAST_1)  # samples per prompt; they share the prompt's prefill
    # None draws fresh randomness each call. What a seed reproduces: on the same device and dtype, with
    # the same prompts, params, weights and engine settings (the KV budget included: preemption decides
    # which rows share a step), identical rollouts (tokens and logprobs)
    # when speculation is off. With speculation on, the drafts decide which random numbers are used,
    # so identical rollouts also need the same arm at every step (selector "always"; "fixed" and
    # "adaptive" choose from measured step times, which vary) and the same drafter state (a learned
    # drafter's weights, a suffix/n-gram drafter's index of earlier rollouts). Rollouts with and
    # without speculation, or with other arms, have the same law but are different samples.
    seed: int | None = None
    stop_token_ids: list[int] | None = None  # extra stop tokens besides the tokenizer's EOS
    ignore_eos: bool = False  # benchmarks: always run to max_new_tokens

    def __post_init__(self) -> None:
        R.check_fields(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """A repetition penalty is on: the law of each token depends on the tokens before it."""
        return self.repetition_penalty != 1.0


def _drafters() -> list[str]:
    from rlspec.rollout.registry import DRAFTERS  # plain Python: no torch at config time

    return DRAFTERS.names()


def _selectors() -> list[str]:
    from rlspec.rollout.registry import SELECTORS

    return SELECTORS.names()


_DRAFTER = R.Rule(lambda: f"'none', 'auto' or a registered drafter; registered: {', '.join(_drafters())} (a plug-in "
                          "registers with @DRAFTERS.register(name))", lambda v: v in ("none", "auto", *_drafters()))
_SELECTOR = R.registered("selector", _selectors)


@dataclass
class SpecConfig:
    """How the engine speculates. The default is no speculation (plain autoregressive decoding)."""

    drafter: str = _help("none", "none (plain decoding), auto (suffix + ngram + eagle3, chosen per batch), or a "
                                 "registered drafter: ngram, suffix, eagle3 (learned), ngram_device (ngram's chains, "
                                 "looked up on the engine's device in the sample's, its siblings' and its prompt's "
                                 "earlier samples' texts), suffix_device (suffix's chains, ngram_device's "
                                 "where suffix has none), or a plug-in", rule=_DRAFTER)
    num_draft_tokens: int = _help(4, "k: tokens drafted per verify along one path", rule=R.AT_LEAST_1)
    tree_width: int = _help(1, "children per draft-tree node; 1 = a chain", rule=R.AT_LEAST_1)
    selector: str = _help("fixed", "fixed: the configured drafter and shape where measured costs say it pays, "
                                   "deeper as the live batch shrinks; adaptive: a bandit over drafters and shapes "
                                   "per batch size; always: the configured arm on every step (benchmarks, tests)",
                            rule=_SELECTOR)
    drafter_path: str | None = _help(None, "directory of a trained learned (eagle3) drafter")
    max_spec_batch: int | None = _help(None, "speculate only when at most this many sequences are live "
                                             "(None = derive it from measured verify costs)", rule=R.AT_LEAST_1)
    online_training: Literal["auto", True, False] = _help(
        "auto", "eagle3: train the drafter during the run on the rollouts' hidden states, on idle compute, "
                "swapping new weights in between steps. auto: on an accelerator; off on a CPU target, where "
                "decoding and the policy update already use every core (bench_out/trainer_overlap.json: "
                "decoding at live batch <= 4 runs 1.12-1.29x faster on 2 threads than on 1), so a trainer "
                "there only takes cycles from the rollout; the warm-started drafter is kept as it is",
        rule=R.Rule("'auto', true or false", lambda v: v in ("auto", True, False)))
    draft_vocab_size: int = _help(4096, "eagle3: size of the drafter's vocabulary (the most frequent target tokens)",
                                  rule=R.AT_LEAST_1)
    online_trainer: Literal["auto", "process", "thread"] = _help(
        "auto", "eagle3: where online training runs. process: a process of its own (its own threads, lowest "
                "CPU priority, fed through shared memory), so it only takes cycles decoding and the policy "
                "update leave idle; thread: inside the rollout process, on a CUDA stream of its own on GPU; "
                "auto: process on CPU or when trainer_device is another device, else thread",
        rule=R.Rule("one of 'auto', 'process', 'thread'", lambda v: v in ("auto", "process", "thread")))
    trainer_threads: int | None = _help(None, "eagle3, process trainer: its torch threads (None = half the cores, "
                                              "at least 1)", rule=R.at_least(1, "or None"))
    trainer_device: str | None = _help(None, "eagle3, process trainer: its device, e.g. cuda:1 (None = the "
                                             "target's device)", rule=R.DEVICE)
    # ---- lossy modes (docs/lossy.md): off by default; each accepts text the policy would not sample ----
    verification: Literal["exact", "judge"] = _help(
        "exact", "exact: lossless rejection sampling (the default); judge: LOSSY, a draft token the exact test "
                 "rejects is still kept when the judge accepts it (needs a drafter and accept_off_policy)",
        rule=R.one_of("exact", "judge"))
    judge: Literal["prob", "relative", "typical", "learned"] = _help(
        "prob", "verification=judge: prob: keep a draft token whose target probability >= judge_threshold; "
                "relative: keep it when p(x) >= judge_threshold * max p (a near-tie with the target's choice); "
                "typical: keep it when p(x) > min(eps, sqrt(eps) exp(-H(p))) with eps = judge_threshold (typical "
                "acceptance); learned: a logistic head on the target's last hidden state at the draft token, "
                "trained online (labels: docs/lossy.md#judge-labels), score >= judge_threshold",
        rule=R.one_of("prob", "relative", "typical", "learned"))
    judge_threshold: float = _help(0.1, "verification=judge: the judge's threshold in (0, 1]; lower keeps more "
                                        "draft tokens (faster, further from the policy)", rule=R.FRACTION)
    step_routing: Literal["off", "arbitrage"] = _help(
        "off", "arbitrage: LOSSY, a draft source writes a whole reasoning step, the target scores it in one "
               "forward and a router keeps it or has the target regenerate it with lossless speculation "
               "(needs accept_off_policy)", rule=R.one_of("off", "arbitrage"))
    router: Literal["likelihood", "learned"] = _help(
        "likelihood", "step_routing: likelihood: keep a step when the mean over its tokens of log p(x) + H(p) "
                      "(the target's log-likelihood of the draft against its own entropy) >= route_threshold; "
                      "learned: a logistic head on the target's hidden states of the step, trained online "
                      "(labels: docs/lossy.md#router-labels), probability >= route_threshold",
        rule=R.one_of("likelihood", "learned"))
    route_threshold: float = _help(-1.0, "step_routing: the router's threshold: nats per token for likelihood "
                                         "(<= 0; higher keeps fewer drafted steps), a probability in [0, 1] for "
                                         "learned", rule=R.FINITE)
    step_delimiter: str = _help("\n\n", "step_routing: the text that ends a reasoning step",
                                rule=R.Rule("a non-empty string (e.g. '\\n\\n')", lambda v: isinstance(v, str) and v != ""))
    step_source: str | None = _help(None, "step_routing: who writes a step: eagle3 or suffix (a drafter of this "
                                          "engine: drafter must be it or auto), draft_model=<local HF dir> (a "
                                          "smaller model with the target's tokenizer), None = the drafter",
                                     rule=R.Rule("eagle3, suffix, ngram or draft_model=<local dir>",
                                                 lambda v: v in ("eagle3", "suffix", "ngram") or
                                                 v.startswith("draft_model=")))
    step_max_tokens: int = _help(48, "step_routing: most tokens drafted for one step", rule=R.AT_LEAST_1)
    accept_off_policy: bool = _help(False, "the opt-in every lossy mode needs: rollouts then hold tokens the "
                                           "policy would not have sampled, recorded per token (token_source, "
                                           "behaviour_logprobs) so TRL's importance-sampling correction sees them")

    def __post_init__(self) -> None:
        R.check_fields(self)  # each field's rule; then what depends on several fields
        from rlspec.rollout.config_checks import check_lossy  # plain Python too

        check_lossy(self)

    @property
    def enabled(self) -> bool:
        return self.drafter != "none"

    @property
    def lossy(self) -> bool:
        """A lossy mode is on: rollouts may hold tokens the policy would not have sampled."""
        return self.verification != "exact" or self.step_routing != "off"


@dataclass
class Carried:
    """A sample carried into a generate() call from an earlier one (partial rollouts, docs/partial_rollouts.md):
    the completion tokens it holds, with what was recorded for them when they were sampled. It continues under
    the engine's current weights: its prefix is prefilled again and the next token is drawn from there."""

    completion_ids: list[int]
    logprobs: list[float]
    behaviour_logprobs: list[float] | None = None  # None: equal to logprobs
    token_source: list[int] | None = None  # None: all the target's

    def __post_init__(self) -> None:
        if not self.completion_ids:
            raise ValueError("a carried sample holds at least one token (a sample with none is a fresh one: None)")
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(f"a carried sample has {len(self.completion_ids)} tokens but {len(self.logprobs)} "
                             "logprobs")


@dataclass
class PartialRound:
    """What makes a generate() call one round of partial rollouts (docs/partial_rollouts.md).

    samples: per prompt, its samples in this call: a Carried one continues, None starts afresh (the fresh
        samples of a prompt share its prefill). Replaces SamplingParams.n; every prompt has at least one.
    stop_after_groups / min_decode_steps: the call stops after the first step at which at least
        stop_after_groups prompts have every sample finished and at least min_decode_steps decode steps ran;
        the samples still going come back with finish_reason "partial". Both count tokens and steps, never
        seconds, so a seeded round is reproducible.
    must_finish: prompts (indices into the call's prompts) that must have every sample finished before the call
        stops, whatever stop_after_groups says (the groups a round is due to train).
    """

    samples: list[list[Carried | None]]
    stop_after_groups: int
    min_decode_steps: int = 0
    must_finish: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if any(not group for group in self.samples):
            raise ValueError("every prompt of a partial round needs at least one sample (None = a fresh one)")
        if self.stop_after_groups < 0 or self.min_decode_steps < 0:
            raise ValueError("stop_after_groups and min_decode_steps must be >= 0")
        if any(not 0 <= i < len(self.samples) for i in self.must_finish):
            raise ValueError(f"must_finish {list(self.must_finish)} names prompts outside the call's "
                             f"{len(self.samples)}")


# token_source codes of RolloutResult: who produced each completion token (docs/lossy.md#honest-results)
TOKEN_SOURCES = ("target", "draft-exact", "judge", "routed-step")
LOSSY_SOURCES = (2, 3)  # judge, routed-step: tokens the exact test did not accept


@dataclass
class RolloutResult:
    """One sample of one prompt.

    logprobs: one float per completion token, log p(token) under the target's
    temperature-scaled distribution before any other processing (repetition penalty, top-k/top-p/min-p
    truncation): what TRL recomputes (docs/verification.md#logprobs).
    behaviour_logprobs: log-probability of each token under the distribution it was actually drawn
    from (docs/lossy.md#honest-results); equal to logprobs when no lossy mode is on. None from a
    backend that does not record it: then it is logprobs.
    token_source: per token an index into TOKEN_SOURCES (target, draft-exact, judge, routed-step).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    # partial: a partial round (PartialRound) stopped before the sample ended; it may be carried into the next
    finish_reason: Literal["stop", "length", "partial"]
    policy_version: int
    prompt_index: int = 0  # which prompt of the call this sample belongs to
    sample_index: int = 0  # which of that prompt's n samples
    extra: dict = field(default_factory=dict)
    behaviour_logprobs: list[float] | None = None
    token_source: list[int] | None = None

    def sampling_logprobs(self) -> list[float]:
        """What the sampler's law gave each token: the logprobs an importance-sampling correction divides by."""
        return self.logprobs if self.behaviour_logprobs is None else self.behaviour_logprobs

    def lossy_mask(self) -> list[bool]:
        """Per token: produced by a lossy rule (judge or routed step)."""
        return [s in LOSSY_SOURCES for s in (self.token_source or [0] * len(self.completion_ids))]
