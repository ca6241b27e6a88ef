"""Partial rollouts for GRPO (docs/partial_rollouts.md): a step never waits for its longest sample.

A generation round keeps more groups in flight than it trains on (`oversample`), stops once enough groups are
complete, trains on those, and carries the unfinished samples into the next round, where they continue under the
newer policy (the engine prefills their prefix again: rollout/partial.py). What keeps that honest:

- a group trains only whole (every sample finished) and never with another prompt's samples;
- every token keeps the log-probability the policy that drew it gave it, and that policy's optimizer step, so
  TRL's importance-sampling correction divides the current policy by the right behaviour law, token by token;
- staleness is bounded: a round runs at least `min_decode_steps` decode steps, enough that a sample finishes
  within the rounds `max_staleness` allows; a sample older than that anyway (it waited for a row) restarts.

The groups in flight beyond TRL's current batch are the ones TRL will hand out in its later batches (prefetched
from a replica of its sampler: trainers/partial_trl.py), so a run trains exactly the prompts TRL's sampler gives,
each once. GroupPool knows nothing of TRL: SpecGRPOTrainer (trainers/grpo.py) feeds it TRL's rows and that
sequence, and reads back the groups to train; the pool's state is plain Python, saved in checkpoints beside
TRL's buffered inputs.
"""
from __future__ import annotations

import bisect
import logging
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from rlspec.rollout.types import Carried, PartialRound, RolloutResult
from rlspec.trainers.partial_rows import decode_rows, encode_rows

logger = logging.getLogger(__name__)
UNFORESEEN = 1 << 40  # ordinals of groups TRL handed out that its replica did not foresee start here: unique, apart


@dataclass
class PartialRolloutConfig:
    """Partial rollouts' settings (off unless a trainer is given one)."""

    oversample: float = 1.0  # groups in flight beyond those a round trains on, as a fraction of them
    max_staleness: int = 4  # most optimizer steps between the policy that drew a token and the one training on it

    def __post_init__(self) -> None:
        if not 0 < self.oversample <= 8:
            raise ValueError(f"partial rollouts: oversample must be in (0, 8], got {self.oversample} (the extra "
                             "groups in flight, as a fraction of the groups a round trains on)")
        if self.max_staleness < 1:
            raise ValueError(f"partial rollouts: max_staleness must be >= 1 optimizer step, got {self.max_staleness}")


def why_not_with_this_loss(correction: bool, beta: float, off_policy_mask_threshold: float | None,
                           loss_type: str) -> str | None:
    """Why TRL's loss, so configured, cannot train carried samples (None: it can). Shared with the CLI's check
    (rlspec/config/schema.py), so plain Python. A carried sample's tokens were drawn by several earlier policies; what makes that
    sound is TRL's per-token importance-sampling correction, and each option below would bypass it or turn it
    against the carried samples (docs/partial_rollouts.md#limits)."""
    if not correction:
        return ("vllm_importance_sampling_correction=False: carried tokens drawn by earlier policies would train as "
                "if the current policy had drawn them; partial rollouts need TRL's per-token importance-sampling "
                "correction on (vllm_importance_sampling_correction=True, TRL's default)")
    if beta:
        return (f"beta={beta:g}: TRL adds the KL penalty after its importance-sampling weights, so the KL of "
                "carried tokens would be estimated under the earlier policies that drew them, uncorrected; set "
                "beta=0 (TRL's default)")
    if off_policy_mask_threshold is not None:
        return (f"off_policy_mask_threshold={off_policy_mask_threshold:g}: TRL's off-policy sequence mask drops a "
                "negative-advantage sample whose mean log-ratio to the sampling policy passes the threshold, and "
                "a carried sample's older tokens raise that ratio by their staleness, so it would mask long carried "
                "samples first; leave off_policy_mask_threshold unset (the per-token correction bounds them)")
    if loss_type == "vespo":
        return ("loss_type='vespo' folds the correction into one weight per sample (the sum of its per-token log "
                "ratios), which for a carried sample spans several policies and shrinks or zeroes long carried "
                "samples as a whole; use a loss TRL corrects token by token (dapo, grpo, bnpo, dr_grpo, cispo, "
                "sapo)")
    return None


@dataclass
class Sample:
    """One sample of a group: its tokens so far and, per token, what was recorded when it was drawn."""

    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the sampling policy's (the engine's target logprobs)
    behaviour: list[float] = field(default_factory=list)  # the law it was drawn from (differs only in lossy modes)
    token_source: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # per token: the optimizer step of the policy that drew it
    finish_reason: str | None = None
    stopped_at: int = -1  # the round (GroupPool.rounds) that first stopped it unfinished; -1: never
    stop_len: int = 0  # its length then

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def carried(self) -> Carried | None:
        """What the engine continues from (None: a fresh sample)."""
        if not self.completion_ids:
            return None
        return Carried(self.completion_ids, self.logprobs, self.behaviour, self.token_source)

    def check(self, r: RolloutResult) -> None:
        """The engine's result continues this sample: its old tokens come back as they went in."""
        if r.completion_ids[:len(self.completion_ids)] != self.completion_ids:
            raise RuntimeError("partial rollouts: the engine changed a carried sample's prefix")

    def take(self, r: RolloutResult, step: int) -> None:
        """The engine's result for this sample (check()ed): its old tokens and records come back as they went in."""
        new = len(r.completion_ids) - len(self.completion_ids)
        self.completion_ids, self.logprobs = list(r.completion_ids), list(r.logprobs)
        self.behaviour, self.token_source = list(r.sampling_logprobs()), list(r.token_source or [0] * len(r.logprobs))
        self.steps = self.steps + [step] * new
        self.finish_reason = None if r.finish_reason == "partial" else r.finish_reason


@dataclass
class Group:
    """One prompt's num_generations samples, with TRL's rows for them (dataset columns, for the rewards)."""

    rows: list[dict]
    prompt_ids: list[int]
    samples: list[Sample]
    order: int  # when it entered the pool: complete groups train oldest first
    ordinal: int  # its index in TRL's sequence of groups over the run (UNFORESEEN + k: one TRL gave unforeseen)

    @property
    def done(self) -> bool:
        return all(s.done for s in self.samples)


# (prompts, the round's plan, each sample's (group ordinal, index in group) in result order) -> results
Generate = Callable[[list[list[int]], PartialRound, list[tuple[int, int]]], list[RolloutResult]]


class GroupPool:
    """The groups in flight between rounds, and the round itself.

    group_size: samples per group (num_generations). train_groups: groups a round trains on.
    steps_per_round: optimizer steps between two rounds (TRL's steps_per_generation x num_iterations /
    gradient_accumulation_steps). max_new_tokens: the completion cap, which sets the rounds' minimum length.
    """

    def __init__(self, config: PartialRolloutConfig, group_size: int, train_groups: int, steps_per_round: float,
                 max_new_tokens: int):
        if config.max_staleness < steps_per_round:
            raise ValueError(f"partial rollouts: max_staleness={config.max_staleness} is below the {steps_per_round:g} "
                             "optimizer steps between two generation rounds, so nothing could be carried; raise "
                             f"max_staleness to at least {math.ceil(steps_per_round)}")
        self.config, self.group_size, self.train_groups = config, group_size, train_groups
        self.steps_per_round = steps_per_round
        # a sample generating in every round it spends in the pool finishes within `rounds` rounds, so its first
        # token is at most (rounds - 1) x steps_per_round <= max_staleness optimizer steps old when it trains
        rounds = int(config.max_staleness // steps_per_round) + 1
        self.min_decode_steps = math.ceil(max_new_tokens / rounds)
        self.capacity = train_groups + math.ceil(config.oversample * train_groups)  # groups in flight at a round
        if self.capacity > rounds * train_groups:
            # a full pool trains train_groups a round, so its groups wait capacity / train_groups rounds on average
            raise ValueError(f"partial rollouts: oversample={config.oversample:g} keeps {self.capacity} groups in "
                             f"flight for {train_groups} trained a round, so a group waits {self.capacity / train_groups:g} "
                             f"rounds on average, but max_staleness={config.max_staleness} lets it wait at most "
                             f"{rounds} ({steps_per_round:g} optimizer steps a round): lower oversample to at most "
                             f"{rounds - 1} or raise max_staleness to at least "
                             f"{math.ceil((self.capacity / train_groups - 1) * steps_per_round)}")
        self.groups: list[Group] = []
        self.rounds = self.entered = self.round_restarts = 0  # round_restarts: samples restarted by the last round
        self.dropped = self.trained_samples = self.skipped = 0  # skipped: TRL's groups a draining pool left out
        self.drawn = self.mismatched = 0  # groups drawn from TRL's future sequence; TRL's groups it did not foresee
        self.ahead: deque = deque()  # the prompts of drawn groups TRL has not handed out yet, in its order
        self.ahead_bound = 0  # what a resumed pool drew ahead beyond its capacity (load_state_dict)
        self.tail_steps: dict[int, int] = {}  # round -> most tokens a sample it stopped still needed (so far)
        self.step_s: dict[int, float] = {}  # round -> its mean decode step seconds (note_step_time)
        self.trained_tokens: dict[int, list[int]] = {}  # ordinal -> its samples' loss tokens, once trained

    # ---- the round ---------------------------------------------------------------------------------------------
    def wants(self, rounds_left: float = math.inf) -> int:
        """Groups to add before the next round, when `rounds_left` rounds remain in the run (the current one
        included). Near the end the pool drains: it never holds more groups than the remaining rounds will train,
        so every group that enters is trained, and a run trains exactly the groups TRL hands out over it (all
        drawn ahead in TRL's order): none left in flight, none of TRL's skipped, long ones included
        (docs/partial_rollouts.md#bias-and-when-not-to-use-it)."""
        return max(0, min(self.capacity, self.train_groups * rounds_left) - len(self.groups))

    def add(self, rows: list[dict], prompt_ids: list[int], ordinal: int) -> None:
        self.groups.append(Group(rows, list(prompt_ids), [Sample() for _ in rows], self.entered, ordinal))
        self.entered += 1

    def fill(self, batch: list[list[dict]], future: Callable[[], list[dict]], prompt_ids: Callable[[dict], list[int]],
             rounds_left: float = math.inf) -> None:
        """Before a round. `future()`: the next group (its rows) of the sequence TRL hands out over the run;
        `batch`: TRL's generation batch now (each a group's rows), normally the sequence's next groups. The pool
        draws ahead of TRL up to what it wants; a group of `batch` already drawn (matched in order by prompt) is in
        the pool or trained and is only checked off; one the sequence did not foresee (a sampler the replica does
        not reproduce) enters as a new group, counted in `mismatched`. prompt_ids(row): a group's tokenized
        prompt, asked only for groups that enter."""
        for rows in batch:
            prompt = rows[0]["prompt"]
            if prompt not in self.ahead and self.wants(rounds_left):
                self._draw(future, prompt_ids)  # TRL's group is normally the sequence's next: it enters now
            if prompt in self.ahead:  # drawn already; any drawn before it TRL passed over (they train anyway)
                while self.ahead.popleft() != prompt:
                    pass
            elif self.ahead:
                self._unforeseen(rows, prompt_ids, rounds_left)
            else:  # a draining pool with nothing drawn ahead: the rounds left train what it holds
                self.skipped += 1
        while self.wants(rounds_left):
            self._draw(future, prompt_ids)
        while len(self.ahead) > max(self.capacity, self.ahead_bound):  # never when the sequence is TRL's: bounds
            # a diverged one
            self.ahead.popleft()

    def _draw(self, future: Callable[[], list[dict]], prompt_ids: Callable[[dict], list[int]]) -> None:
        rows = future()
        self.add(rows, prompt_ids(rows[0]), self.drawn)
        self.ahead.append(rows[0]["prompt"])
        self.drawn += 1

    def _unforeseen(self, rows: list[dict], prompt_ids: Callable[[dict], list[int]], rounds_left: float) -> None:
        """A group of TRL's that the sequence did not foresee: it trains as a new group (if the pool wants it)."""
        if not self.mismatched:
            logger.warning("partial rollouts: TRL handed out a prompt that the replica of its sampler did not "
                           "foresee (a custom sampler or dataloader, or a resume that changed TRL's data order?); it "
                           "trains as a new group, and the run no longer trains exactly TRL's prompts "
                           "(partial/replica_mismatch counts them)")
        self.mismatched += 1
        if self.wants(rounds_left):
            self.add(rows, prompt_ids(rows[0]), UNFORESEEN + self.mismatched - 1)
        else:
            self.skipped += 1

    def round(self, generate: Generate, step: int) -> list[Group]:
        """One round at optimizer step `step`: generate until enough groups are complete (and the groups due now
        are), then hand back the train_groups complete ones due soonest (removed from the pool). Every sample in
        flight decodes, even when enough complete groups already wait: that is what bounds staleness."""
        self.rounds += 1
        self.round_restarts = self._restart_stale(step)
        work = [g for g in self.groups if not g.done]
        due = self._due(step)
        if work:  # even when enough complete groups wait: every sample in flight decodes every round (the bound)
            need = self.train_groups - sum(g.done for g in self.groups)
            plan = PartialRound([[s.carried() for s in g.samples if not s.done] for g in work],
                                stop_after_groups=max(need, 0), min_decode_steps=self.min_decode_steps,
                                must_finish=tuple(i for i, g in enumerate(work) if id(g) in due))
            # each sample's name for the engine's keyed draws: its group's ordinal and its index in the group
            names = [(g.ordinal, j) for g in work for j, s in enumerate(g.samples) if not s.done]
            results = list(generate([g.prompt_ids for g in work], plan, names))
            taken = iter(results)
            updates = [(s, next(taken)) for g in work for s in g.samples if not s.done]
            for s, r in updates:  # all checked before any is applied: a failed round leaves the pool as it was
                s.check(r)
            for s, r in updates:
                s.take(r, step)
                self._account_tail(s)
        ready = sorted((g for g in self.groups if g.done), key=lambda g: (id(g) not in due, self._first_step(g, step),
                                                                         g.order))[:self.train_groups]
        if len(ready) < self.train_groups:
            raise RuntimeError(f"partial round {self.rounds}: {len(ready)} complete groups for {self.train_groups}")
        taken = {id(g) for g in ready}
        self.groups = [g for g in self.groups if id(g) not in taken]
        self.trained_samples += sum(len(g.samples) for g in ready)
        return ready

    @staticmethod
    def _first_step(g: Group, step: int) -> int:
        """The step of the group's oldest token (`step` for a group that holds none yet)."""
        return min((s.steps[0] for s in g.samples if s.steps), default=step)

    def _due(self, step: int) -> set[int]:
        """The groups (ids) this round must train so that every group in the pool can still train within
        max_staleness: a group whose oldest token is from step s may wait floor((s + max_staleness - step) / r)
        more rounds; if more than h x train_groups groups may wait at most h rounds, the most urgent of them train
        now (earliest deadline first). The rounds' minimum length makes each due group complete in time."""
        slack = sorted((math.floor((self._first_step(g, step) + self.config.max_staleness - step) /
                                   self.steps_per_round + 1e-9), g.order, id(g)) for g in self.groups)
        must = max([0] + [k + 1 - h * self.train_groups for k, (h, _, _) in enumerate(slack)])
        return {key for _, _, key in slack[:min(must, self.train_groups)]}

    def _restart_stale(self, step: int) -> int:
        """A sample whose first token would be more than max_staleness steps old at this round's training starts
        over (only one that could not decode in some round, for want of KV blocks, falls behind the bound)."""
        restarted = 0
        for g in self.groups:
            for i, s in enumerate(g.samples):
                if s.steps and step - s.steps[0] > self.config.max_staleness:
                    g.samples[i] = Sample()
                    restarted += 1
        self.dropped += restarted
        return restarted

    def _account_tail(self, s: Sample) -> None:
        """Tail steps saved: for each round, the most tokens one of the samples it stopped still needed, learnt as
        they finish (an estimate of the decode steps a round that waited would have run on)."""
        if not s.done:
            if s.stopped_at < 0:
                s.stopped_at, s.stop_len = self.rounds, len(s.completion_ids)
            return
        if s.stopped_at >= 0:
            more = len(s.completion_ids) - s.stop_len
            self.tail_steps[s.stopped_at] = max(self.tail_steps.get(s.stopped_at, 0), more)

    def note_step_time(self, seconds: float) -> None:
        """The current round's mean decode step, to price its tail steps saved in seconds."""
        self.step_s[self.rounds] = seconds

    # ---- what the trainer logs -----------------------------------------------------------------------------
    def metrics(self, groups: list[Group], step: int) -> dict[str, float]:
        """partial/*: the trained samples' staleness (token-weighted histogram, mean, max; the on-policy share),
        how many were carried, the pool after the round, drops so far, tail steps saved (rounds now known)."""
        ages = [step - t for g in groups for s in g.samples for t in s.steps]
        samples = [s for g in groups for s in g.samples]
        out = {"partial/carried_samples": float(sum(any(t < step for t in s.steps) for s in samples)),
               "partial/in_flight_samples": float(sum(not s.done for g in self.groups for s in g.samples)),
               "partial/waiting_groups": float(sum(g.done for g in self.groups)),
               "partial/dropped_stale_frac": self.dropped / max(self.trained_samples, 1),
               "partial/restarted_samples": float(self.round_restarts),
               "partial/skipped_groups": float(self.skipped),
               "partial/replica_mismatch": float(self.mismatched),
               "partial/on_policy_token_frac": sum(a == 0 for a in ages) / max(len(ages), 1),
               "partial/staleness_mean": sum(ages) / max(len(ages), 1),
               "partial/staleness_max": float(max(ages, default=0)),
               "partial/min_decode_steps": float(self.min_decode_steps)}
        for age in range(self.config.max_staleness + 1):
            out[f"partial/staleness_{age}_frac"] = sum(a == age for a in ages) / max(len(ages), 1)
        known = [r for r in self.tail_steps if all(s.stopped_at != r for g in self.groups for s in g.samples)]
        if known:  # seconds at the round's own mean step time: an upper estimate (a waiting round's tail is thinner)
            out["partial/tail_s_saved"] = sum(self.tail_steps[r] * self.step_s.pop(r, 0.0) for r in known)
            out["partial/tail_steps_saved"] = sum(self.tail_steps.pop(r) for r in known) / len(known)
        return out

    # ---- token weights ---------------------------------------------------------------------------------------------
    def normalisers(self, groups: list[Group], tokens: list[list[int]], micro_rows: int | None, cap: int,
                    seed: int) -> list[float]:
        """off_policy_normalisers for the trained `groups` (their samples' loss tokens `tokens`): each group's
        batch-mates in TRL's order (ordinal // train_groups) as trained (their loss tokens), in flight (their
        samples so far), or not drawn yet; unforeseen groups have none known, and draw all theirs."""
        here = {g.ordinal: [(t, True) for t in ts] for g, ts in zip(groups, tokens)}
        known = {o: [(t, True) for t in ts] for o, ts in self.trained_tokens.items()}
        known.update({g.ordinal: [(len(s.completion_ids), s.done) for s in g.samples] for g in self.groups})
        known.update(here)
        mates = []
        for g in groups:
            if g.ordinal >= UNFORESEEN:
                mates.append([None] * (self.train_groups - 1))
                continue
            first = g.ordinal - g.ordinal % self.train_groups
            mates.append([known.get(o) for o in range(first, first + self.train_groups) if o != g.ordinal])
        return off_policy_normalisers(tokens, mates, list(known.values()), micro_rows, cap, seed=seed)

    def record_trained(self, groups: list[Group], tokens: list[list[int]]) -> None:
        """The trained groups' loss tokens, for the token weights of the batches after."""
        self.trained_tokens.update({g.ordinal: list(ts) for g, ts in zip(groups, tokens)})

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain Python a weights_only load reads: the rows and prompts (dataset columns of any ordinary type) as
        encode_rows writes them."""
        return {"groups": [{"rows": encode_rows(g.rows), "prompt_ids": g.prompt_ids, "order": g.order,
                            "ordinal": g.ordinal,
                            "samples": [asdict(s) for s in g.samples]}
                           for g in self.groups],
                "counters": [self.rounds, self.entered, self.dropped, self.trained_samples, self.skipped, self.drawn,
                             self.mismatched],
                "ahead": encode_rows(list(self.ahead)),
                "tail_steps": [[k, v] for k, v in self.tail_steps.items()],
                "step_s": [[k, v] for k, v in self.step_s.items()],
                "trained_tokens": [[k, list(v)] for k, v in self.trained_tokens.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.groups = []
        for g in state["groups"]:
            samples = [Sample(**dict(raw)) for raw in g["samples"]]
            self.groups.append(Group(decode_rows(g["rows"]), list(g["prompt_ids"]), samples, int(g["order"]),
                                     int(g["ordinal"])))
        (self.rounds, self.entered, self.dropped, self.trained_samples, self.skipped, self.drawn,
         self.mismatched) = (int(x) for x in state["counters"])
        self.ahead = deque(decode_rows(state["ahead"]))
        # a run resumed with a smaller oversample still holds what it drew ahead: TRL hands those out later
        self.ahead_bound = max(self.capacity, len(self.ahead))
        self.tail_steps = {int(k): int(v) for k, v in state["tail_steps"]}
        self.step_s = {int(k): float(v) for k, v in state["step_s"]}
        self.trained_tokens = {int(k): [int(t) for t in v] for k, v in state.get("trained_tokens", [])}



def off_policy_normalisers(batch: list[list[int]], mates: list[list[list[tuple[int, bool]] | None]],
                           population: list[list[tuple[int, bool]]], micro_rows: int | None, cap: int,
                           draws: int = 64, seed: int = 0) -> list[float]:
    """Per sample of `batch` (its groups' per-sample loss token counts, in row order): E[1 / N], N being the token
    count TRL's dapo loss (micro_rows None: its generation batch's) or bnpo loss (the micro-batch of micro_rows rows
    holding it, rows shuffled as TRL shuffles them) would divide its tokens by with partial rollouts off, where the
    group trains beside its batch-mates in TRL's order. mates[g]: those of group g, each as its samples'
    (tokens so far, done), or None when not drawn yet (then a group drawn from `population`, the run's groups known
    so far). A sample not done counts as one of the finished samples of `population` that ran longer, drawn at
    random (the cap when none did). Monte-Carlo over `draws` seeded draws: reproducible. A partial batch is formed
    in finish order, so its own token count would weigh long groups less whenever they happen to finish together;
    this does not depend on what finished together (docs/partial_rollouts.md#token-weights)."""
    rng, out = random.Random(seed), []
    finished = sorted(t for g in population for t, done in g if done)

    def final(tokens: int, done: bool) -> int:
        if done:
            return tokens
        i = bisect.bisect_right(finished, tokens)
        return finished[rng.randrange(i, len(finished))] if i < len(finished) else cap

    for group, theirs in zip(batch, mates):
        acc = [0.0] * len(group)
        for _ in range(draws):
            rows = [final(t, done) for mate in theirs for t, done in (mate if mate is not None else
                                                                          rng.choice(population))]
            if micro_rows is None:
                n = sum(group) + sum(rows)
                acc = [a + 1.0 / max(n, 1) for a in acc]
                continue
            for j, tokens in enumerate(group):
                others = group[:j] + group[j + 1:] + rows
                acc[j] += 1.0 / max(tokens + sum(rng.sample(others, min(micro_rows - 1, len(others)))), 1)
        out += [a / draws for a in acc]
    return out

