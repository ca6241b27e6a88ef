"""Partial rollouts' token weights (docs/partial_rollouts.md#token-weights): the share of the gradient weight that
cap-length samples get, partial rollouts off against on, for TRL's dapo, bnpo and grpo losses. Not a timing.

The runs are the pool's own (GroupPool, max_staleness 4) over a simulated decoder: each sample has a length fixed
by its name (its group's ordinal and its index), long-tailed (a prompt rambles to the cap with its own
probability, else ends after an exponential number of tokens), so off and on train the very same samples and
differ only in which train together. A round decodes one token per step for every sample in flight and stops as
the engine's partial round does (rlspec.rollout.partial.round_over's rule). Off: TRL's order, groups in
consecutive batches. Weights per token: dapo 1 / the generation batch's tokens, bnpo 1 / the tokens of the
micro-batch holding it (rows shuffled, --micro-rows each), grpo 1 / (its sample's tokens) (every sample alike).
On: the same with the batch's own counts ("uncorrected") and with partial_trl's off-policy normalisers
(trainers/partial_rollouts.py off_policy_normalisers, "corrected"). A cell: mean over --seeds runs of --steps.

    python -m rlspec.bench partial-weights
"""
from __future__ import annotations

import random
import statistics

from rlspec.rollout.types import RolloutResult
from rlspec.trainers.partial_rollouts import GroupPool, PartialRolloutConfig

NAME = "partial-weights"
HELP = "partial rollouts: cap-length samples' share of the loss weight, off vs on (dapo, bnpo, grpo; simulated decoder)"
LOSSES = ("dapo", "bnpo", "grpo")


def add_arguments(p) -> None:
    p.add_argument("--cap", type=int, default=1024, help="max_completion_length")
    p.add_argument("--short-mean", type=float, default=150.0, help="mean length of a sample that does not ramble")
    p.add_argument("--groups", type=int, default=2, help="groups a step trains (prompts per generation batch)")
    p.add_argument("--generations", type=int, default=4, help="num_generations")
    p.add_argument("--micro-rows", type=int, default=4, help="rows of a micro-batch (bnpo's normaliser)")
    p.add_argument("--steps", type=int, default=60, help="rounds (generation batches) per run")
    p.add_argument("--seeds", type=int, default=20, help="runs per cell")
    p.add_argument("--oversample", type=float, nargs="+", default=[1.0, 4.0])


def run(args) -> dict:
    if args.smoke:
        args.steps, args.seeds, args.cap, args.short_mean = 8, 2, 64, 10.0
    cells = shares(args.cap, args.short_mean, args.groups, args.generations, args.micro_rows, args.steps,
                   range(args.seed, args.seed + args.seeds), args.oversample)
    rows = []
    for loss in LOSSES:
        off = cells[("off", loss)]
        rows.append({"loss": loss, "arm": "off", "cap_share_pct": 100 * off, "vs_off_points": 0.0})
        for o in args.oversample:
            for kind in ("uncorrected", "corrected"):
                v = cells[(f"on-{o:g}-{kind}", loss)]
                rows.append({"loss": loss, "arm": f"on oversample {o:g} {kind}", "cap_share_pct": 100 * v,
                             "vs_off_points": 100 * (v - off)})
    return {"rows": rows, "columns": ["loss", "arm", "cap_share_pct", "vs_off_points"], "no_plot": True}


def shares(cap: int, short_mean: float, groups: int, n: int, micro_rows: int, steps: int, seeds, oversamples):
    """{(arm, loss): cap-length samples' share of the loss weight, mean over seeds}."""
    out: dict = {}
    for seed in seeds:
        length = lengths(cap, short_mean, seed)
        runs = {"off": off_batches(length, groups, n, steps)}
        for o in oversamples:
            runs[f"on-{o:g}"] = on_batches(length, groups, n, steps, o, cap, micro_rows)
        for arm, batches in runs.items():
            kinds = ("uncorrected", "corrected") if arm != "off" else ("",)
            for kind in kinds:
                name = f"{arm}-{kind}" if kind else arm
                for loss in LOSSES:
                    share = cap_share(batches, loss, cap, micro_rows, kind == "corrected", seed)
                    out.setdefault((name, loss), []).append(share)
    return {k: statistics.mean(v) for k, v in out.items()}


def lengths(cap: int, short_mean: float, seed: int):
    """name (ordinal, index) -> the sample's length, fixed by its name: arms train the same samples."""
    def length(name: tuple[int, int]) -> int:
        group = random.Random(f"{seed}/{name[0]}")
        ramble = group.random() ** 2 * 0.8  # this prompt's chance that a sample runs to the cap
        r = random.Random(f"{seed}/{name[0]}/{name[1]}")
        return cap if r.random() < ramble else min(cap, 1 + int(r.expovariate(1 / short_mean)))
    return length


def off_batches(length, groups: int, n: int, steps: int) -> list:
    return [([[length((b * groups + g, j)) for j in range(n)] for g in range(groups)], {}) for b in range(steps)]


def on_batches(length, groups: int, n: int, steps: int, oversample: float, cap: int, micro_rows: int) -> list:
    """Per round: (the trained groups' lengths, {loss: the corrected weights per row, as the trainer computes them
    (GroupPool.normalisers, then record_trained)})."""
    pool = GroupPool(PartialRolloutConfig(oversample=oversample, max_staleness=4), n, groups, 1, cap)
    drawn, batches = iter(range(10**9)), []

    def generate(prompts, plan, names):
        live = iter(names)
        state = [[[len(c.completion_ids) if c else 0, length(next(live))] for c in samples] for samples in plan.samples]
        steps_run = 0
        while any(have < want for g in state for have, want in g):
            for g in state:
                for s in g:
                    s[0] += s[0] < s[1]
            steps_run += 1
            complete = [all(have >= want for have, want in g) for g in state]
            if (steps_run >= plan.min_decode_steps and sum(complete) >= plan.stop_after_groups
                    and all(complete[i] for i in plan.must_finish)):
                break
        return [RolloutResult([], [7] * have, [-1.0] * have, "length" if have >= want else "partial", 0)
                for g in state for have, want in g]

    for step in range(steps):
        while pool.wants(steps - step):
            i = next(drawn)
            pool.add([{}] * n, [1, i], i)
        trained = pool.round(generate, step)
        tokens = [[len(s.completion_ids) for s in g.samples] for g in trained]
        weights = {"dapo": pool.normalisers(trained, tokens, None, cap, seed=step),
                   "bnpo": pool.normalisers(trained, tokens, micro_rows, cap, seed=step)}
        pool.record_trained(trained, tokens)
        batches.append((tokens, weights))
    return batches


def cap_share(batches, loss: str, cap: int, micro_rows: int, corrected: bool, seed: int) -> float:
    """Cap-length samples' share of the summed per-token loss weight over the run."""
    rng, capped, total = random.Random(seed), 0.0, 0.0
    for batch, weights in batches:
        rows = [t for g in batch for t in g]
        if loss == "grpo":
            token_w = [1.0 / max(t, 1) for t in rows]
        elif corrected:
            token_w = weights[loss]
        elif loss == "dapo":
            token_w = [1.0 / max(sum(rows), 1)] * len(rows)
        else:  # bnpo: TRL shuffles the rows and splits them into micro-batches
            order = list(range(len(rows)))
            rng.shuffle(order)
            token_w = [0.0] * len(rows)
            for k in range(0, len(order), micro_rows):
                chunk = order[k:k + micro_rows]
                for i in chunk:
                    token_w[i] = 1.0 / max(sum(rows[j] for j in chunk), 1)
        for t, w in zip(rows, token_w):
            total += t * w
            capped += t * w * (t >= cap)
    return capped / total
