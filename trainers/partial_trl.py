"""Partial rollouts inside TRL's GRPO step (the pool itself: trainers/partial_rollouts.py).

TRL calls `_generate_and_score_completions(rows)` once per generation batch. With partial rollouts on,
SpecGRPOTrainer first runs a round here: TRL's rows become new groups of the pool (topped up with extra prompts
from a second RepeatSampler over the same dataset, so the rewards see their columns), the pool generates until
enough groups are complete, and TRL's own scoring then runs on the rows of those groups, its
`_generate_single_turn` handing back their finished samples instead of generating. Everything after (rewards,
advantages per group, the old-logprob pass under the current policy, the importance-sampling correction against
the recorded behaviour logprobs, the loss) is TRL's code.
"""
from __future__ import annotations

import copy
import math

import torch

import rollout.metrics as M
from trainers.partial_rollouts import GroupPool, PartialRolloutConfig


class ExtraPrompts:
    """Prompts beyond TRL's batches: TRL's RepeatSampler (shuffled, seed + 1) over the train dataset, endless.
    `drawn` is its whole state: a resumed run draws the same rows."""

    def __init__(self, dataset, seed: int, drawn: int = 0):
        from trl.trainer.utils import RepeatSampler

        self.dataset, self.drawn = dataset, 0
        self._sampler = RepeatSampler(dataset, mini_repeat_count=1, seed=seed + 1)
        self._it = self._indices()
        for _ in range(drawn):
            self.next()

    def _indices(self):
        while True:
            yield from iter(self._sampler)

    def next(self) -> dict:
        self.drawn += 1
        return self.dataset[next(self._it)]


def refuse_unsupported(trainer) -> None:
    """What partial rollouts cannot do, said at construction (docs/partial_rollouts.md#limits)."""
    why = None
    if trainer.rollouts is None:
        why = "TRL's own generation samples this run (the engine cannot run the policy)"
    elif not getattr(trainer.rollouts.engine, "supports_partial_rollouts", False):
        why = (f"the rollout backend {type(trainer.rollouts.engine).__name__} cannot stop and carry samples; use the "
               "in-process engine (rollout.backend=engine)")
    elif trainer.accelerator.num_processes > 1:
        why = (f"{trainer.accelerator.num_processes} processes would each hold part of the pool and a group must "
               "never split across ranks; run on one process")
    elif trainer.tools or trainer.environment_factories is not None or getattr(trainer, "rollout_func", None):
        why = "tool calls, environments and rollout_func generate in several turns; partial rollouts carry one turn"
    elif trainer.num_generations < 2:
        why = "GRPO groups of one sample have nothing to wait for"
    if why is not None:
        raise ValueError(f"partial_rollouts: {why}; or leave partial rollouts off")


def make_pool(trainer, config: PartialRolloutConfig) -> GroupPool:
    """The pool for this trainer's generation batches (one process: refuse_unsupported). Its capacity x
    num_generations is the engine's rows, so every sample of a full pool decodes at once."""
    args = trainer.args
    rows = args.per_device_train_batch_size * args.steps_per_generation
    if rows % trainer.num_generations:
        raise ValueError(f"partial_rollouts: a generation batch of {rows} rows does not hold whole groups of "
                         f"num_generations={trainer.num_generations}")
    steps = args.steps_per_generation * trainer.num_iterations / args.gradient_accumulation_steps
    return GroupPool(config, trainer.num_generations, rows // trainer.num_generations, steps,
                     trainer.max_completion_length)


def run_round(trainer, rows: list[dict]) -> list[dict]:
    """One round for TRL's generation batch `rows`: returns the rows to score (whole groups, group after group)
    and stages their samples for `_generate_single_turn`."""
    pool, n, step = trainer.partial, trainer.num_generations, trainer.state.global_step
    left = math.ceil((trainer.state.max_steps - step) / pool.steps_per_round) if trainer.state.max_steps > 0 \
        else math.inf
    def extra() -> list[dict]:
        row = trainer.partial_extras.next()
        return [copy.deepcopy(row) for _ in range(n)]

    pool.fill([rows[k:k + n] for k in range(0, len(rows), n)], extra, lambda row: prompt_ids(trainer, row), left)
    metrics = trainer._metrics["train"]

    def generate(prompts, plan):
        results = trainer.rollouts.generate(trainer.model, step, prompts, 1, **trainer.engine_sampling,
                                            max_new_tokens=trainer.max_completion_length,
                                            stop_token_ids=list(trainer.eos_token_ids), partial=plan)
        trainer.rollouts.log_metrics(metrics)
        steps, seconds = (metrics.get(k, [0.0])[-1] for k in (M.DECODE_STEPS, M.TIME_S))  # get: adds no empty key
        pool.note_step_time(seconds / steps if steps else 0.0)
        return results

    groups = pool.round(generate, step)
    for key, value in pool.metrics(groups, step).items():
        metrics[key].append(value)
    trainer._partial_groups = groups
    return [row for g in groups for row in g.rows]


def staged_completions(trainer, prompt_ids_in: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """The staged samples, in TRL's row order, for `_generate_single_turn` (which TRL calls with the rows'
    tokenized prompts: they must be the groups' own)."""
    samples = [(g.prompt_ids, s) for g in trainer._partial_groups for s in g.samples]
    if [list(p) for p in prompt_ids_in] != [p for p, _ in samples]:
        raise RuntimeError("partial rollouts: TRL tokenized the staged rows to other prompts than the pool's")
    return [list(s.completion_ids) for _, s in samples], [list(s.behaviour) for _, s in samples]


def carried_is_metrics(trainer, output: dict) -> dict[str, float]:
    """What TRL's token-level correction cut on carried samples and on the others, apart: the share of their
    completion tokens whose ratio reached the cap (token_truncate) or was zeroed (token_mask)."""
    if "importance_sampling_ratio" not in output or trainer._partial_groups is None:
        return {}
    step = trainer.state.global_step
    carried = torch.tensor([any(t < step for t in s.steps) for g in trainer._partial_groups for s in g.samples])
    ratio, mask = output["importance_sampling_ratio"], output["completion_mask"].bool()
    if ratio.shape != mask.shape:  # a sequence-level mode: partial rollouts set a token-level one
        return {}
    cap = trainer.vllm_importance_sampling_clip_max
    cut = (ratio == 0) if trainer.vllm_importance_sampling_mode.endswith("_mask") else (ratio >= cap)
    out = {}
    for name, rows in (("carried", carried), ("fresh", ~carried)):
        m = mask[rows.to(mask.device)]
        out[f"partial/is_cut_token_frac_{name}"] = float((cut[rows.to(mask.device)] & m).sum()) / max(int(m.sum()), 1)
    return out


def prompt_ids(trainer, row: dict) -> list[int]:
    """The row's prompt as TRL tokenizes it for generation (its chat template), so staged rows match."""
    ids, _, _ = trainer._tokenize_prompts([copy.deepcopy(row["prompt"])])
    return list(ids[0])
