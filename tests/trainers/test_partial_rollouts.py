"""Partial rollouts in SpecGRPOTrainer (trainers/partial_rollouts.py, trainers/partial_trl.py), end to end on a
tiny random Llama whose EOS is likely enough that samples end at different lengths.

The gate: every token TRL trains on carries, as its sampling logprob, the log-probability that the policy of the
step that drew it gives it (recomputed here from a snapshot of the policy taken before each round), groups are
whole and of one prompt, and samples were really carried across updates. Tagging tokens with the wrong policy
(the newest) fails the same check. A run trains exactly the groups TRL's sampler hands out with partial rollouts
off, each once. A run resumed from a checkpoint holding carried samples ends bit-identical to a straight one.
"""
from __future__ import annotations

import collections
import copy

import pytest
import torch
import trl

from tests.trainers.conftest import build_tiny_llama
from rlspec.trainers import partial_rollouts, partial_trl
from rlspec.trainers.data import make_math_dataset
from rlspec.trainers.grpo import SpecGRPOTrainer

CAP, N = 20, 4
GENERATE_AND_SCORE, RUN_ROUND = SpecGRPOTrainer._generate_and_score_completions, partial_trl.run_round


def distinct_chars_reward(completions, **kwargs):
    return [float(len(set(c[0]["content"]))) for c in completions]


def eos_prone_llama(tok):
    """The tiny Llama with EOS at ~15% per token: samples end anywhere in the first CAP tokens, a few at CAP."""
    model = build_tiny_llama(len(tok), tok.eos_token_id, tok.pad_token_id)
    with torch.no_grad():
        h = model.model(torch.randint(3, len(tok), (64, 20))).last_hidden_state.reshape(-1, 64).mean(0)
        model.lm_head.weight[tok.eos_token_id] = 2.0 * h / h.dot(h)
    return model


PARTIAL = dict(oversample=2.0, max_staleness=3)  # enough in flight that samples are carried


def make_trainer(tok, out, steps=3, save_steps=None, partial=PARTIAL, examples=16, config=None, **kw):
    args = trl.GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False, seed=0, num_generations=N,
                          max_completion_length=CAP, max_steps=steps, logging_steps=1, learning_rate=1e-2,
                          report_to=[], disable_tqdm=True, save_strategy="steps" if save_steps else "no",
                          save_steps=save_steps or 500, **(config or dict(per_device_train_batch_size=8)))
    return SpecGRPOTrainer(model=eos_prone_llama(tok), reward_funcs=[distinct_chars_reward], args=args,
                           train_dataset=make_math_dataset(examples, seed=0), processing_class=tok,
                           engine_kwargs=dict(max_model_len=256), **kw, partial_rollouts=partial)


def recording_run(tok, out, monkeypatch):
    """Train; return [(policy snapshot before the round, the staged samples TRL got)] per round."""
    rounds, run_round, staged = [], partial_trl.run_round, partial_trl.staged_completions

    def snapshot_then_run(trainer, rows):
        rounds.append({"policy": {s: v.clone() for s, v in trainer.model.state_dict().items()},
                       "step": trainer.state.global_step})
        return run_round(trainer, rows)

    def capture(trainer, prompt_ids):
        completions, logprobs = staged(trainer, prompt_ids)
        pairs = [(g.prompt_ids, s) for g in trainer._partial_groups for s in g.samples]
        rounds[-1]["samples"] = [(p, list(s.completion_ids), lp, list(s.steps), s.finish_reason)
                                 for (p, s), lp in zip(pairs, logprobs)]
        return completions, logprobs

    monkeypatch.setattr(partial_trl, "run_round", snapshot_then_run)
    monkeypatch.setattr(partial_trl, "staged_completions", capture)
    trainer = make_trainer(tok, out, steps=3)
    policies = {}
    trainer.train()
    for r in rounds:
        policies.setdefault(r["step"], r["policy"])
    return trainer, rounds, policies


def worst_record_error(tok, rounds, policies) -> float:
    """Largest |recorded sampling logprob - log p_step(token)| over every trained token, p_step being the
    policy of the step the pool says drew it (an HF forward over a snapshot of that policy)."""
    model, worst = eos_prone_llama(tok).eval(), 0.0
    for r in rounds:
        for prompt, completion, recorded, steps, _ in r["samples"]:
            ids = torch.tensor([prompt + completion])
            for step in set(steps):
                model.load_state_dict(policies[step])
                with torch.no_grad():
                    logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].double(), -1)
                for t, (tok_id, s) in enumerate(zip(completion, steps)):
                    if s == step:
                        worst = max(worst, abs(float(logp[t, tok_id]) - recorded[t]))
    return worst


def test_trained_groups_are_whole_and_every_token_records_the_policy_that_drew_it(char_tokenizer, tmp_path,
                                                                                  monkeypatch):
    trainer, rounds, policies = recording_run(char_tokenizer, tmp_path / "run", monkeypatch)
    eos = char_tokenizer.eos_token_id
    carried = 0
    for r in rounds:
        samples = r["samples"]
        assert len(samples) == 8  # the trained batch: two whole groups
        for k in range(0, len(samples), N):
            group = samples[k:k + N]
            assert all(p == group[0][0] for p, *_ in group), "a group mixes prompts"
            assert all(fr in ("stop", "length") for *_, fr in group), "a group trained incomplete"
            assert all(c[-1] == eos or len(c) == CAP for _, c, *_ in group)
        carried += sum(len(set(steps)) > 1 for *_, steps, _ in samples)
    assert carried >= 2, "no sample was carried across a policy update: the test did not exercise the path"
    assert len(policies) >= 3 and trainer.partial.dropped == 0
    assert worst_record_error(char_tokenizer, rounds, policies) < 1e-4


def test_tagging_tokens_with_the_newest_policy_fails_the_record_check(char_tokenizer, tmp_path, monkeypatch):
    """The planted flaw: the pool tags a carried sample's old tokens with the policy that finished it."""
    take = partial_rollouts.Sample.take

    def newest(self, r, step):
        take(self, r, step)
        self.steps = [step] * len(self.steps)

    monkeypatch.setattr(partial_rollouts.Sample, "take", newest)
    _, rounds, policies = recording_run(char_tokenizer, tmp_path / "run", monkeypatch)
    assert worst_record_error(char_tokenizer, rounds, policies) > 1e-2


def test_resume_with_carried_samples_equals_a_straight_run(char_tokenizer, tmp_path):
    """Resumed at step 2 of 6: the pool's carried samples, the groups drawn ahead and the replica of TRL's sampler
    (the run draws TRL's groups 8 to 11 after the checkpoint) come back as they were."""
    straight = make_trainer(char_tokenizer, tmp_path / "straight", steps=6, save_steps=2)
    straight.train()
    checkpoint = tmp_path / "straight" / "checkpoint-2"
    pool = torch.load(checkpoint / "rlspec_state.pt", weights_only=True)["trainer"]["partial"]["pool"]
    assert any(s["completion_ids"] and s["finish_reason"] is None for g in pool["groups"] for s in g["samples"]), \
        "checkpoint-2 holds no carried sample: the test would not exercise their resume"
    resumed = make_trainer(char_tokenizer, tmp_path / "resumed", steps=6)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.partial.state_dict()["counters"] == straight.partial.state_dict()["counters"]  # drawn, skipped...
    assert straight.partial.drawn == 12 and straight.partial.skipped == straight.partial.mismatched == 0
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    assert not all(torch.equal(a, b) for a, b in zip(straight.model.parameters(),
                                                     eos_prone_llama(char_tokenizer).parameters())), "nothing moved"


# (examples, max_steps, GRPOConfig, groups TRL hands out): 4 rounds of 2 groups, each serving 2 steps as TRL's
# sampler repeats it, over 6 prompts (TRL's sampler starts a second epoch); 2 rounds of 3 groups 1.5 optimizer steps
# apart; 2 rounds of 2 groups each trained twice (num_iterations)
RUNS = {"two-epochs": (6, 8, dict(per_device_train_batch_size=4, steps_per_generation=2), 8),
        "1.5-steps-per-round": (16, 3, dict(per_device_train_batch_size=4, steps_per_generation=3,
                                            gradient_accumulation_steps=2), 6),
        "two-iterations": (16, 4, dict(per_device_train_batch_size=8, num_iterations=2), 4)}
# two optimizer steps a round: a group waits (1 + oversample) rounds on average, 6 steps: max_staleness 4 allows it
PARTIAL_FOR = {"two-epochs": dict(oversample=2.0, max_staleness=4),
               "two-iterations": dict(oversample=2.0, max_staleness=4)}


def handed_out_and_trained(tok, out, monkeypatch, partial, run):
    """Returns the prompts TRL handed out in run RUNS[run], group by group, and the (prompt, ordinal) of the
    groups trained (partial on; else None) with the trainer."""
    handed, trained = [], []

    def record_handed(trainer, rows):
        handed.extend(str(rows[k]["prompt"]) for k in range(0, len(rows), N))
        return GENERATE_AND_SCORE(trainer, rows)

    def record_trained(trainer, rows):
        out_rows = RUN_ROUND(trainer, rows)
        for g in trainer._partial_groups:
            assert len(g.rows) == N and all(r["prompt"] == g.rows[0]["prompt"] for r in g.rows) and g.done
            trained.append((str(g.rows[0]["prompt"]), g.ordinal))
        return out_rows

    monkeypatch.setattr(SpecGRPOTrainer, "_generate_and_score_completions", record_handed)
    monkeypatch.setattr(partial_trl, "run_round", record_trained)
    examples, steps, config, _ = RUNS[run]
    partial = PARTIAL_FOR.get(run, partial) if partial else partial
    trainer = make_trainer(tok, out, steps=steps, partial=partial, examples=examples, config=config)
    trainer.train()
    return handed, trained if partial else None, trainer


@pytest.mark.parametrize("run", RUNS)
def test_a_partial_run_trains_exactly_the_prompts_trl_hands_out_each_once(char_tokenizer, tmp_path, monkeypatch, run):
    """Partial on trains the very groups TRL's sampler hands out with partial off, each whole and once, in its
    sequence's ordinals, skipping none and leaving none in flight: the pool drew TRL's later groups ahead, not
    other prompts, and knew how many rounds were left."""
    off, _, _ = handed_out_and_trained(char_tokenizer, tmp_path / "off", monkeypatch, None, run)
    handed, trained, trainer = handed_out_and_trained(char_tokenizer, tmp_path / "on", monkeypatch, PARTIAL, run)
    assert len(off) == RUNS[run][-1]
    assert run != "two-epochs" or len(set(off)) < len(off), "TRL's sampler did not start a second epoch"
    assert handed == off  # partial rollouts leave TRL's own sampling alone
    assert sorted(p for p, _ in trained) == sorted(off)
    assert sorted(o for _, o in trained) == list(range(len(off)))
    assert [off[o] for _, o in trained] == [p for p, _ in trained]  # ordinal: the index in TRL's sequence
    logged = [h for h in trainer.state.log_history if "partial/skipped_groups" in h]
    assert len(logged) == len(off) // trainer.partial.train_groups  # one per round
    assert all(h["partial/skipped_groups"] == h["partial/replica_mismatch"] == 0 for h in logged)
    assert not trainer.partial.groups and not trainer.partial.ahead


@pytest.mark.parametrize("partial, kw, match", [
    (dict(oversample=0), {}, "oversample must be in"),
    (dict(max_staleness=0), {}, "max_staleness must be >= 1"),
    (dict(max_staleness=1), dict(steps_per_generation=2), "below the 2 optimizer steps"),
    (dict(oversample=4.0, max_staleness=1), {}, "a group waits 5 rounds on average, but max_staleness=1 lets it "
                                                "wait at most 2"),
])
def test_settings_that_cannot_work_are_refused_at_construction(char_tokenizer, tmp_path, partial, kw, match):
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=8,
                          num_generations=N, max_completion_length=CAP, report_to=[], **kw)
    with pytest.raises(ValueError, match=match):
        SpecGRPOTrainer(model=eos_prone_llama(char_tokenizer), reward_funcs=[distinct_chars_reward], args=args,
                        train_dataset=make_math_dataset(16, seed=0), processing_class=char_tokenizer,
                        engine_kwargs=dict(max_model_len=256), partial_rollouts=partial)


def test_a_rollout_func_is_refused(char_tokenizer, tmp_path):
    def rollout_func(prompts, trainer):
        return {}

    with pytest.raises(ValueError, match="partial_rollouts: tool calls, environments and rollout_func"):
        make_trainer(char_tokenizer, tmp_path, rollout_func=rollout_func)


def test_an_iterable_dataset_is_refused(char_tokenizer, tmp_path):
    """The pool draws TRL's later groups through a replica of its sampler, which needs indices."""
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=8,
                          num_generations=N, max_completion_length=CAP, max_steps=2, report_to=[])
    with pytest.raises(ValueError, match="an iterable train_dataset has no indices"):
        SpecGRPOTrainer(model=eos_prone_llama(char_tokenizer), reward_funcs=[distinct_chars_reward], args=args,
                        train_dataset=make_math_dataset(16, seed=0).to_iterable_dataset(),
                        processing_class=char_tokenizer, engine_kwargs=dict(max_model_len=256),
                        partial_rollouts=PARTIAL)


def test_a_checkpoint_resumes_only_with_the_same_setting(char_tokenizer, tmp_path):
    trainer = make_trainer(char_tokenizer, tmp_path)
    state = copy.deepcopy(trainer.rlspec_trainer_state())
    state["partial"] = None
    with pytest.raises(ValueError, match="written with partial rollouts off"):
        trainer.load_rlspec_trainer_state(state)


def scored_samples(tok, out, monkeypatch, partial, keyed=True):
    """Every (prompt tokens, completion tokens) TRL scored over a 4-step run whose policy never moves (lr 0)."""
    seen = []

    def record(trainer, rows):
        output = GENERATE_AND_SCORE(trainer, rows)
        for p, pm, c, cm in zip(output["prompt_ids"], output["prompt_mask"], output["completion_ids"],
                                output["completion_mask"]):
            seen.append((tuple(p[pm.bool()].tolist()), tuple(c[cm.bool()].tolist())))
        return output

    monkeypatch.setattr(SpecGRPOTrainer, "_generate_and_score_completions", record)
    trainer = make_trainer(tok, out, steps=4, partial=partial)
    trainer.args.learning_rate = 0.0
    trainer.rollouts.keyed = keyed
    trainer.train()
    return collections.Counter(seen), trainer


def test_partial_rollouts_on_and_off_draw_the_same_samples(char_tokenizer, tmp_path, monkeypatch):
    """Common random numbers: each sample is drawn from its key (its group's place in TRL's sequence and its index),
    so under a policy that does not move, partial rollouts on (other batches, samples stopped and carried into later
    rounds) train exactly the samples of partial off. Without keys the two runs draw different samples."""
    off, _ = scored_samples(char_tokenizer, tmp_path / "off", monkeypatch, None)
    on, trainer = scored_samples(char_tokenizer, tmp_path / "on", monkeypatch, PARTIAL)
    assert trainer.partial.trained_samples == sum(off.values()) == 4 * 8
    assert any(m.get("partial/carried_samples", 0) > 0 for m in trainer.state.log_history), "nothing was carried"
    assert on == off
    unkeyed, _ = scored_samples(char_tokenizer, tmp_path / "unkeyed", monkeypatch, PARTIAL, keyed=False)
    assert unkeyed != off
