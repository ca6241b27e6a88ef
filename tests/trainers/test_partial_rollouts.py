"""Partial rollouts in SpecGRPOTrainer (trainers/partial_rollouts.py, trainers/partial_trl.py), end to end on a
tiny random Llama whose EOS is likely enough that samples end at different lengths.

The gate: every token TRL trains on carries, as its sampling logprob, the log-probability that the policy of the
step that drew it gives it (recomputed here from a snapshot of the policy taken before each round), groups are
whole and of one prompt, and samples were really carried across updates. Tagging tokens with the wrong policy
(the newest) fails the same check. A run resumed from a checkpoint holding carried samples ends bit-identical
to a straight one.
"""
from __future__ import annotations

import copy

import pytest
import torch
import trl

from tests.trainers.conftest import build_tiny_llama
from trainers import partial_rollouts, partial_trl
from trainers.data import make_math_dataset
from trainers.grpo import SpecGRPOTrainer

CAP, N = 20, 4


def distinct_chars_reward(completions, **kwargs):
    return [float(len(set(c[0]["content"]))) for c in completions]


def eos_prone_llama(tok):
    """The tiny Llama with EOS at ~15% per token: samples end anywhere in the first CAP tokens, a few at CAP."""
    model = build_tiny_llama(len(tok), tok.eos_token_id, tok.pad_token_id)
    with torch.no_grad():
        h = model.model(torch.randint(3, len(tok), (64, 20))).last_hidden_state.reshape(-1, 64).mean(0)
        model.lm_head.weight[tok.eos_token_id] = 2.0 * h / h.dot(h)
    return model


def make_trainer(tok, out, steps=3, save_steps=None, partial=None, **kw):
    args = trl.GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False, seed=0, per_device_train_batch_size=8,
                          num_generations=N, max_completion_length=CAP, max_steps=steps, logging_steps=1,
                          learning_rate=1e-2, report_to=[], disable_tqdm=True,
                          save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500)
    return SpecGRPOTrainer(model=eos_prone_llama(tok), reward_funcs=[distinct_chars_reward], args=args,
                           train_dataset=make_math_dataset(16, seed=0), processing_class=tok,
                           engine_kwargs=dict(max_model_len=256), **kw,
                           partial_rollouts=partial or dict(oversample=1.0, max_staleness=3))


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
    straight = make_trainer(char_tokenizer, tmp_path / "straight", steps=4, save_steps=2)
    straight.train()
    checkpoint = tmp_path / "straight" / "checkpoint-2"
    pool = torch.load(checkpoint / "rlspec_state.pt", weights_only=True)["trainer"]["partial"]["pool"]
    assert any(s["completion_ids"] and s["finish_reason"] is None for g in pool["groups"] for s in g["samples"]), \
        "checkpoint-2 holds no carried sample: the test would not exercise their resume"
    resumed = make_trainer(char_tokenizer, tmp_path / "resumed", steps=4)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    assert not all(torch.equal(a, b) for a, b in zip(straight.model.parameters(),
                                                     eos_prone_llama(char_tokenizer).parameters())), "nothing moved"


@pytest.mark.parametrize("partial, kw, match", [
    (dict(oversample=0), {}, "oversample must be in"),
    (dict(max_staleness=0), {}, "max_staleness must be >= 1"),
    (dict(max_staleness=1), dict(steps_per_generation=2), "below the 2 optimizer steps"),
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


def test_a_checkpoint_resumes_only_with_the_same_setting(char_tokenizer, tmp_path):
    trainer = make_trainer(char_tokenizer, tmp_path)
    state = copy.deepcopy(trainer.rlspec_trainer_state())
    state["partial"] = None
    with pytest.raises(ValueError, match="written with partial rollouts off"):
        trainer.load_rlspec_trainer_state(state)
