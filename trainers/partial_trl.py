"""Partial rollouts inside TRL's GRPO step (the pool itself: trainers/partial_rollouts.py).

TRL calls `_generate_and_score_completions(rows)` once per generation batch. With partial rollouts on,
SpecGRPOTrainer first runs a round here: the pool is topped up with the groups TRL will hand out in its later
generation batches (TrlGroups: a replica of TRL's sampler, rows and all, so the rewards see their columns; TRL's
rows, when they come, are checked off against them), the pool generates until enough groups are complete, and
TRL's own scoring then runs on the rows of those groups, its `_generate_single_turn` handing back their finished
samples instead of generating. Everything after (rewards, advantages per group, the old-logprob pass under the
current policy, the importance-sampling correction against the recorded behaviour logprobs, the loss) is TRL's
code.
"""
from __future__ import annotations

import copy
import math

import torch

import rlspec.rollout.metrics as M
from rlspec.trainers.partial_rollouts import GroupPool, PartialRolloutConfig, why_not_with_this_loss
from rlspec.trainers.sample_keys import sample_keys


class TrlGroups:
    """The groups TRL will generate for over the run, in its order: a replica of its train dataloader. A call
    gives the next group's rows; `drawn` (groups given) is the whole state: a resumed run rebuilds it there.

    TRL's dataloader reads the sampler `trainer._get_train_sampler` builds (TRL's RepeatSampler with the run's
    seed, or a subclass's) in generation batches of per_device_train_batch_size x steps_per_generation rows, one
    per micro-step, epoch after epoch (one sampler pass each, its generator running on); TRL generates for the
    batch of every (steps_per_generation x num_iterations)-th micro-step (the RepeatSampler repeats each batch that
    many times) and its groups are num_generations consecutive rows. Columns are removed as the dataloader does."""

    def __init__(self, trainer, drawn: int = 0):
        import datasets

        data, self._collate = trainer.train_dataset, trainer.data_collator
        if isinstance(data, datasets.Dataset):  # as Trainer._get_dataloader
            data = trainer._remove_unused_columns(data, description="training")
        else:
            self._collate = trainer._get_collator_with_removed_columns(self._collate, description="training")
        args = trainer.args
        self._data, self._sampler, self._n = data, trainer._get_train_sampler(data), trainer.num_generations
        self._batch = trainer._train_batch_size * args.steps_per_generation
        self._every, self._drop_last = args.steps_per_generation * trainer.num_iterations, args.dataloader_drop_last
        self._groups, self.drawn = self._all_groups(), 0
        for _ in range(drawn):
            self()

    def rounds_left(self, trainer) -> float:
        """TRL's generation batches left in the run, the current one included (inf: max_steps unknown). The
        Trainer's loop runs an epoch's L micro-steps in ceil(L / gradient_accumulation_steps) optimizer steps, the
        last one short when they do not divide, and TRL generates at every `_every`-th micro-step."""
        accumulate, max_steps = trainer.args.gradient_accumulation_steps, trainer.state.max_steps
        if max_steps <= 0 or not hasattr(self._sampler, "__len__"):
            return math.inf
        per_epoch = len(self._sampler) / self._batch
        per_epoch = math.floor(per_epoch) if self._drop_last else math.ceil(per_epoch)
        if not per_epoch:  # drawing says why
            return math.inf
        epochs, steps = divmod(max_steps, math.ceil(per_epoch / accumulate))
        micro_steps = epochs * per_epoch + min(steps * accumulate, per_epoch)
        # a batch on_nonfinite="skip_batch" skipped did not advance TRL's micro-step counter
        done = trainer._step + getattr(trainer, "nonfinite_skipped", 0)
        return math.ceil((micro_steps - done) / self._every)

    def __call__(self) -> list[dict]:
        self.drawn += 1
        return next(self._groups)

    def _all_groups(self):
        micro_step = 0
        while True:
            epoch = list(self._sampler)
            if len(epoch) < self._batch:
                raise ValueError(f"partial rollouts: the train sampler gives {len(epoch)} rows, less than one "
                                 f"generation batch of {self._batch}: use a larger train_dataset")
            for start in range(0, len(epoch), self._batch):
                indices = epoch[start:start + self._batch]
                if len(indices) < self._batch and self._drop_last:
                    break
                if micro_step % self._every == 0:  # TRL reuses the batches in between
                    rows = self._collate([copy.deepcopy(self._data[i]) for i in indices])
                    yield from (rows[k:k + self._n] for k in range(0, len(rows), self._n))
                micro_step += 1


# why a backend cannot run a partial round (docs/partial_rollouts.md#limits)
BACKEND_WHY = {
    "VLLMBackend": "it runs each call through vLLM's LLM.generate to every sample's end; a round would need to stop "
                   "once enough groups are complete, abort the other requests and later resubmit each as prompt + "
                   "prefix under the new weights with the prefix's per-token behaviour logprobs kept, which this "
                   "backend does not do",
    "RayPool": "it cuts a call into tasks of whole groups that each worker runs to its end; a round's stop (enough "
               "groups complete, every sample in flight past its minimum of decode steps) is one decision over the "
               "groups of every worker, which the workers do not share",
}


def refuse_unsupported(trainer) -> None:
    """What partial rollouts cannot do, said at construction (docs/partial_rollouts.md#limits)."""
    import datasets

    why = None
    if trainer.rollouts is None:
        why = "TRL's own generation samples this run (the engine cannot run the policy)"
    elif not getattr(trainer.rollouts.engine, "supports_partial_rollouts", False):
        name = type(trainer.rollouts.engine).__name__
        why = (f"the rollout backend {name} cannot stop a round and carry samples: "
               f"{BACKEND_WHY.get(name, 'it runs every sample of a call to its end')}; use the in-process engine "
               "(rollout.backend=engine)")
    elif trainer.accelerator.num_processes > 1:
        why = (f"{trainer.accelerator.num_processes} processes would each hold part of the pool and a group must "
               "never split across ranks; run on one process")
    elif trainer.tools or trainer.environment_factories is not None or getattr(trainer, "rollout_func", None):
        why = "tool calls, environments and rollout_func generate in several turns; partial rollouts carry one turn"
    elif trainer.num_generations < 2:
        why = "GRPO groups of one sample have nothing to wait for"
    elif isinstance(trainer.train_dataset, (torch.utils.data.IterableDataset, datasets.IterableDataset)):
        why = ("an iterable train_dataset has no indices: the pool draws TRL's later prompts ahead through a "
               "replica of its sampler; use a map-style dataset (datasets.Dataset)")
    if why is not None:
        raise ValueError(f"partial_rollouts: {why}; or leave partial rollouts off")


def allow_uncapped_ratio(trainer) -> None:
    """vllm_importance_sampling_clip_max=None asks TRL for an uncapped per-token ratio, but its truncate modes
    call torch.clamp, which needs one bound: a lower bound of 0 cuts nothing (a ratio is never negative)."""
    if (trainer.vllm_importance_sampling_mode.endswith("_truncate") and trainer.vllm_importance_sampling_clip_max
            is None and trainer.vllm_importance_sampling_clip_min is None):
        trainer.vllm_importance_sampling_clip_min = 0.0


def refuse_loss_options(args) -> None:
    """Before TRL's __init__ (which would load a reference model for beta > 0): the GRPOConfig options that would
    train carried tokens uncorrected (why_not_with_this_loss). args None: TRL's defaults, all fine."""
    if args is None:
        return
    why = why_not_with_this_loss(args.vllm_importance_sampling_correction, args.beta, args.off_policy_mask_threshold,
                                 args.loss_type)
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
    metrics, trainer._partial_groups = trainer._metrics["train"], None  # prompt_ids below: TRL's tokenization

    def generate(prompts, plan, names):
        keys = sample_keys(trainer.args.seed, trainer.accelerator.process_index, names)
        results = trainer.rollouts.generate(trainer.model, step, prompts, 1, **trainer.engine_sampling,
                                            max_new_tokens=trainer.max_completion_length,
                                            stop_token_ids=list(trainer.eos_token_ids), partial=plan,
                                            sample_keys=keys)
        trainer.rollouts.log_metrics(metrics)
        steps, seconds = (metrics.get(k, [0.0])[-1] for k in (M.DECODE_STEPS, M.TIME_S))  # get: adds no empty key
        pool.note_step_time(seconds / steps if steps else 0.0)
        return results

    saved, drawn = copy.deepcopy(pool.__dict__), trainer.partial_future.drawn
    try:
        pool.fill([rows[k:k + n] for k in range(0, len(rows), n)], trainer.partial_future,
                  lambda row: prompt_ids(trainer, row), trainer.partial_future.rounds_left(trainer))
        groups = pool.round(generate, step)
    except BaseException:  # a round that fails (non-finite logits skipped, an interrupt) leaves the pool as it was
        pool.__dict__.clear()
        pool.__dict__.update(saved)
        if trainer.partial_future.drawn != drawn:
            trainer.partial_future = TrlGroups(trainer, drawn=drawn)
        raise
    for key, value in pool.metrics(groups, step).items():
        metrics[key].append(value)
    trainer._partial_groups = groups
    return [row for g in groups for row in g.rows]


def pool_prompt_ids(trainer, prompts: list) -> tuple[list[list[int]], None, dict]:
    """What TRL's `_tokenize_prompts` returns for the rows of the staged groups (text only: no images, no
    multimodal fields), with each group's prompt ids as the pool tokenized them when it drew the group."""
    ids = [list(g.prompt_ids) for g in trainer._partial_groups for _ in g.samples]
    if len(ids) != len(prompts):
        raise RuntimeError(f"partial rollouts: TRL asked for {len(prompts)} prompts, the staged groups hold {len(ids)}")
    return ids, None, {}


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
    if trainer.vllm_importance_sampling_mode.endswith("_mask"):
        cut = ratio == 0
    else:  # clip_max None: TRL clamps at nothing, so nothing is cut
        cut = (ratio >= cap) if cap is not None else torch.zeros_like(mask)
    out = {}
    for name, rows in (("carried", carried), ("fresh", ~carried)):
        m = mask[rows.to(mask.device)]
        out[f"partial/is_cut_token_frac_{name}"] = float((cut[rows.to(mask.device)] & m).sum()) / max(int(m.sum()), 1)
    return out


def prompt_ids(trainer, row: dict) -> list[int]:
    """The row's prompt as TRL tokenizes it for generation (its chat template), so staged rows match."""
    ids, _, _ = trainer._tokenize_prompts([copy.deepcopy(row["prompt"])])
    return list(ids[0])


# losses whose normaliser is the batch's token count (the others weigh each sample alike whatever it trains beside)
BATCH_NORMALISED = {"dapo": None, "cispo": None, "bnpo": "micro"}


def loss_weights(trainer, output: dict) -> None:
    """After TRL scored a partial batch: each row's 1 / normaliser as with partial rollouts off
    (GroupPool.normalisers), stored as output["partial_weight"] for `reweighted`; the batch's loss tokens are
    recorded for the batches after."""
    mask = output["completion_mask"] if "tool_mask" not in output else output["completion_mask"] * output["tool_mask"]
    tokens, n, pool = [int(t) for t in mask.sum(1).tolist()], trainer.num_generations, trainer.partial
    groups = [tokens[k:k + n] for k in range(0, len(tokens), n)]
    if trainer.loss_type in BATCH_NORMALISED:
        micro = trainer.args.per_device_train_batch_size if BATCH_NORMALISED[trainer.loss_type] else None
        weights = pool.normalisers(trainer._partial_groups, groups, micro, trainer.max_completion_length,
                                   seed=trainer.args.seed * 1000003 + pool.rounds)
        output["partial_weight"] = torch.tensor(weights, dtype=torch.float32, device=mask.device)
    pool.record_trained(trainer._partial_groups, groups)


def reweighted(trainer, inputs: dict) -> dict:
    """The micro-batch with each row's advantage scaled so that TRL's loss divides its tokens by the off-policy
    normaliser instead of this batch's token count (the clipped objective is linear in a positive advantage
    scale, so the scale is exactly a weight on the row's loss)."""
    weight = inputs.get("partial_weight")
    if weight is None or not trainer.model.training:
        return inputs
    if BATCH_NORMALISED[trainer.loss_type]:
        mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
        normaliser = mask.sum().clamp(min=1.0)
    else:
        normaliser = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
    scale = weight * normaliser
    advantages = inputs["advantages"]
    return {**inputs, "advantages": advantages * (scale if advantages.dim() == 1 else scale[:, None])}
