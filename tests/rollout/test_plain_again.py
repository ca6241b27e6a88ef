"""Plain steps that launch the next plain step themselves where nothing looks ahead (a CPU, or draws from the call's
generator: `DecodeSteps._plain_again`) give the loop's rollouts step for step: the same tokens, logprobs, finish
reasons and batch at every step, with the call's generator (whose draws follow the batch), while groups wait and are
admitted as rows end, while rows are preempted from a pool too small for them, and greedy with rows ended by a stop
token and by length; and most steps skipped the loop's pass."""
from __future__ import annotations

import pytest

from rlspec.rollout.decode import DecodeSteps
from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.types import SamplingParams
from tests.conftest import make_tiny_hf, random_prompts

BS = 4  # KV block size: rows cross into a new block every 4 tokens


@pytest.fixture(scope="module")
def hf():
    return make_tiny_hf("llama", seed=5)


def chaining(monkeypatch, again: bool) -> list[bool]:
    """`_plain_again` on (again) or off (the loop's step by step); the list it returns gets, for each time it is
    asked, whether a plain step launched the next one itself."""
    chained, real = [], DecodeSteps._plain_again

    def spy(self, live, ctx):
        arm = real(self, live, ctx) if again else None
        chained.append(arm is not None)
        return arm

    monkeypatch.setattr(DecodeSteps, "_plain_again", spy)
    return chained


def rollouts(hf, again: bool, monkeypatch, params, prompts, eos, **kw):
    """(rollouts, the batch at every step, preemptions, whether each plain step launched the next one itself)."""
    with monkeypatch.context() as m:
        chained = chaining(m, again)
        eng = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=eos, kv_block_size=BS, **kw)
        out = eng.generate(prompts, params)
    batches = [(rows, going) for _, rows, going, _ in eng.batch_trace]
    return [(r.completion_ids, r.logprobs, r.finish_reason) for r in out], batches, \
        eng.stats()["rollout/preemptions"], chained


CASES = {
    # 12 samples on 4 rows, ending by a stop token and by length: groups admitted as rows end
    "groups-wait": (SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=3), 6, 4, dict(max_num_seqs=4)),
    # a pool of 12 blocks where the longest sample needs 7: rows preempted and re-prefilled
    "preemption": (SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=16, n=3, seed=7), 4, 4,
                   dict(kv_memory_gb=12 * (2 * 2 * BS * 2 * 16 * 4) / 2**30)),
    "greedy": (SamplingParams(temperature=0.0, max_new_tokens=20, n=1), 8, 1, {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_plain_steps_launched_from_their_predecessor_are_the_loops(hf, case, monkeypatch):
    params, prompts, stoppers, kw = CASES[case]
    prompts = random_prompts(prompts, 4, 12, seed=6)
    first, _, _, _ = rollouts(hf, False, monkeypatch, params, prompts, [], **kw)
    eos = sorted({ids[3] for ids, _, _ in first[:stoppers]})  # tokens that end some rows early, not others
    want, want_batches, want_preempted, none = rollouts(hf, False, monkeypatch, params, prompts, eos, **kw)
    got, batches, preempted, chained = rollouts(hf, True, monkeypatch, params, prompts, eos, **kw)
    assert got == want  # tokens, logprobs (the same batches: the same bits) and finish reasons
    assert batches == want_batches and preempted == want_preempted
    assert {why for _, _, why in got} == {"stop", "length"}
    assert sum(chained) > len(chained) // 2 and not any(none), (sum(chained), len(chained))
    if case == "preemption":
        assert preempted > 0
    if case == "groups-wait":
        assert max(rows for rows, _ in batches) == 4 and len(got) == 12


@pytest.mark.parametrize("rows,blocks,live", [(8, 64, 0), (8, 64, 6), (8, 64, 7), (8, 17, 4), (8, 18, 4), (8, 64, 8)],
                         ids=["empty", "room", "rows-short", "blocks-short", "blocks-fit", "full"])
def test_admits_says_whether_admit_would(rows, blocks, live):
    """`Scheduler.admits` (what `_plain_again` asks before stepping on) answers as admit() then does, admitting
    nothing itself: with nothing live, with room, with too few rows or blocks for the next group of 2, with every
    row taken. (blocks-short / blocks-fit: 4 live rows hold 2 blocks each; the group takes 3 (its prompt's first
    block shared) and every row a block of headroom: 3 + 6 blocks wanted, 8 or 9 free.)"""
    from rlspec.rollout.runtime.blocks import BlockAllocator
    from rlspec.rollout.runtime.scheduler import Scheduler
    from rlspec.rollout.runtime.sequence import Sequence

    seqs = [Sequence(i, 0, list(range(6)), max_new_tokens=32) for i in range(live + 2)]
    groups = [[s] for s in seqs[:live]] + [seqs[live:]]  # live ones first, then a group of 2
    sched = Scheduler(groups, rows=rows, alloc=BlockAllocator(blocks, BS))
    for g in groups[:-1]:  # the live rows, with their blocks: prompt and first position
        sched.waiting.popleft()
        g[0].row = len(sched.live)
        sched.live.append(g[0])
        sched.alloc.ensure(id(g[0]), 7)
    waiting = [list(g) for g in sched.waiting]
    said = sched.admits()
    assert [list(g) for g in sched.waiting] == waiting and len(sched.live) == live  # admitted nothing
    assert said == bool(sched.admit())


@pytest.mark.parametrize("again", [False, True], ids=["loop", "again"])
def test_a_chain_chosen_after_a_plain_step_is_the_next_steps_arm(hf, again, monkeypatch):
    """A scripted choice (three plain steps, then a 2-token n-gram chain, over and over): a run of plain steps asks
    for one arm a step, as the loop does, and a chain it is given is the next step's arm (`Call.chosen`), not a
    second choice. Every step's arm is the script's, in order, with the path and without it."""
    from rlspec.rollout.speculation.decide import Decision
    from rlspec.rollout.speculation.selectors.base import OFF, Arm
    from rlspec.rollout.types import SpecConfig

    script, asked = [OFF, OFF, OFF, Arm("ngram", 2)], []
    monkeypatch.setattr(Decision, "decide", lambda self, selector, batch: asked.append(1) or
                        script[(len(asked) - 1) % len(script)])
    chained = chaining(monkeypatch, again)
    spec = SpecConfig(drafter="ngram", selector="always", num_draft_tokens=2, online_training=False)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[], kv_block_size=BS)
    eng.generate(random_prompts(3, 4, 12, seed=7), SamplingParams(temperature=1.0, max_new_tokens=24, seed=1))
    arms = [spec for *_, spec in eng.batch_trace]  # whether each step was the chain
    assert len(asked) == len(arms) and arms == [i % 4 == 3 for i in range(len(arms))]
    assert (sum(chained) > len(arms) // 3) == again
