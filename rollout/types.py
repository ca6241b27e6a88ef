"""Public value types of the rollout engine: what a caller asks for and what it gets back.

Plain dataclasses, no torch: they cross process boundaries (Ray) and config files unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class SamplingParams:
    """How to sample one generate call (the names follow vLLM's SamplingParams)."""

    temperature: float = 1.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus truncation; 1.0 keeps the whole distribution
    top_k: int = 0  # 0 keeps every token
    max_new_tokens: int = 256
    n: int = 1  # samples per prompt; they share the prompt's prefill
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
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _help(default, text: str):
    """A field with a help string: the run config's `drafter:` section is this dataclass, and
    `python -m rlspec.train --help` prints these."""
    return field(default=default, metadata={"help": text})


@dataclass
class SpecConfig:
    """How the engine speculates. The default is no speculation (plain autoregressive decoding)."""

    drafter: str = _help("none", "none (plain decoding), auto (suffix + ngram + eagle3, chosen per batch), or a "
                                 "registered drafter: ngram, suffix, eagle3 (learned), or a plug-in")
    num_draft_tokens: int = _help(4, "k: tokens drafted per verify along one path")
    tree_width: int = _help(1, "children per draft-tree node; 1 = a chain")
    selector: str = _help("fixed", "fixed: the configured drafter and shape where measured costs say it pays, "
                                   "deeper as the live batch shrinks; adaptive: a bandit over drafters and shapes "
                                   "per batch size; always: the configured arm on every step (benchmarks, tests)")
    drafter_path: str | None = _help(None, "directory of a trained learned (eagle3) drafter")
    max_spec_batch: int | None = _help(None, "speculate only when at most this many sequences are live "
                                             "(None = derive it from measured verify costs)")
    online_training: Literal["auto", True, False] = _help(
        "auto", "eagle3: train the drafter during the run on the rollouts' hidden states, on idle compute, "
                "swapping new weights in between steps. auto: on an accelerator; off on a CPU target, where "
                "decoding and the policy update already use every core (bench_out/trainer_overlap.json: "
                "decoding at live batch <= 4 runs 1.12-1.29x faster on 2 threads than on 1), so a trainer "
                "there only takes cycles from the rollout; the warm-started drafter is kept as it is")
    draft_vocab_size: int = _help(4096, "eagle3: size of the drafter's vocabulary (the most frequent target tokens)")
    online_trainer: Literal["auto", "process", "thread"] = _help(
        "auto", "eagle3: where online training runs. process: a process of its own (its own threads, lowest "
                "CPU priority, fed through shared memory), so it only takes cycles decoding and the policy "
                "update leave idle; thread: inside the rollout process, on a CUDA stream of its own on GPU; "
                "auto: process on CPU or when trainer_device is another device, else thread")
    trainer_threads: int | None = _help(None, "eagle3, process trainer: its torch threads (None = half the cores, "
                                              "at least 1)")
    trainer_device: str | None = _help(None, "eagle3, process trainer: its device, e.g. cuda:1 (None = the "
                                             "target's device)")

    def __post_init__(self) -> None:
        from rollout.spec.registry import DRAFTERS, SELECTORS  # plain Python: no torch at config time

        if self.drafter not in ("none", "auto"):
            try:
                DRAFTERS.check(self.drafter)
            except ValueError as e:
                raise ValueError(f"drafter: {e}; or 'none' / 'auto'") from None
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.tree_width < 1:
            raise ValueError(f"tree_width must be >= 1, got {self.tree_width}")
        if self.online_training not in ("auto", True, False):
            raise ValueError(f"online_training must be 'auto', true or false, got {self.online_training!r}")
        if self.online_trainer not in ("auto", "process", "thread"):
            raise ValueError(f"online_trainer must be one of 'auto', 'process', 'thread', got {self.online_trainer!r}")
        if self.trainer_threads is not None and self.trainer_threads < 1:
            raise ValueError(f"trainer_threads must be >= 1 (or None), got {self.trainer_threads}")
        try:
            SELECTORS.check(self.selector)
        except ValueError as e:
            raise ValueError(f"selector: {e}") from None

    @property
    def enabled(self) -> bool:
        return self.drafter != "none"


@dataclass
class RolloutResult:
    """One sample of one prompt.

    logprobs: one float per completion token, log p(token) under the target's
    temperature-scaled distribution before top-k/top-p truncation (what TRL recomputes).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    policy_version: int
    prompt_index: int = 0  # which prompt of the call this sample belongs to
    sample_index: int = 0  # which of that prompt's n samples
    extra: dict = field(default_factory=dict)
