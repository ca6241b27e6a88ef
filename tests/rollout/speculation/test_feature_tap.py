"""FeatureTap: a forward pass of the policy gives the drafter exactly the samples the engine banks.

The engine stages features and next-token laws while it decodes (prefill, verify forwards with drafts)
and banks them when a sample finishes; the tap hooks one plain pass of the HF policy over the same
prompt + completion. On a float32 model the two must agree to float noise, position by position.
"""
from __future__ import annotations

import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.speculation.training.feature_buffer import Dist
from rlspec.rollout.padding import pad_rollouts
from rlspec.rollout.speculation.training.feature_tap import FeatureTap, feed_pass, feed_results
from rlspec.rollout.speculation.training.intake import TrainerIntake
from rlspec.rollout.speculation.selectors.base import Arm
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import random_prompts


class Recorder:
    """A drafter trainer that only records what it is given (the engine's banking, or the tap's)."""

    topk = 8

    def __init__(self):
        self.samples = []

    def add(self, feats, token_ids, policy_version, dist, temperature):
        dist = None if dist is None else Dist(*(t.detach().clone() for t in (dist.ids, dist.probs, dist.rest, dist.has)))
        self.samples.append((feats.detach().clone(), list(token_ids), policy_version, dist, temperature))

    def latest(self):
        return None

    def set_idle(self, idle):
        pass

    def stop(self):
        pass

    def metrics(self, policy_version):
        return {}


def tiny_policy(layers: int = 8, seed: int = 3):
    """Float32 Llama with enough layers for three distinct EAGLE-3 feature layers (2, 4, 5)."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(cfg).float().eval()


def eagle_engine(policy, recorder):
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=3, online_training=False)
    eng = RolloutEngine(loader.from_hf_model(policy), None, spec=spec, eos_token_ids=[2], max_model_len=128,
                        max_num_seqs=8)
    eng.speculation.force(Arm("eagle3", 3, 1))  # drafts and verify forwards: the staging paths the tap must match
    eng.speculation.attach_trainer(recorder)
    return eng


PARAMS = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=14, n=2, seed=0)


def tap_samples(policy, results, params, aux, rows_per_forward=3):
    """The tap's samples of `results`, from HF forwards of a few rows at a time (TRL chunks its pass too)."""
    rec = Recorder()
    intake = TrainerIntake(lambda: rec, aux, torch.float32)
    ids, mask, C = pad_rollouts(results, pad_id=0)
    tap = FeatureTap(policy, aux)
    with torch.no_grad(), tap.capture():
        for lo in range(0, len(results), rows_per_forward):
            policy(input_ids=ids[lo:lo + rows_per_forward], attention_mask=mask[lo:lo + rows_per_forward])
    assert feed_pass(tap, intake, tap.states(), ids, mask, C, params, policy_version=0) == len(results)
    return rec.samples


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_tap_equals_what_the_engine_banks(ignore_eos):
    policy = tiny_policy()
    rec = Recorder()
    eng = eagle_engine(policy, rec)
    params = SamplingParams(**{**PARAMS.__dict__, "ignore_eos": ignore_eos})
    results = eng.generate(random_prompts(4, 4, 12, seed=5), params)
    assert eng.stats()["rollout/spec_step_share"] > 0.5  # most features came from verify forwards with drafts
    banked = {tuple(s[1]): s for s in rec.samples}
    assert len(banked) == len(results)
    tapped = tap_samples(policy, results, params, eng.speculation.aux_layers)
    for r, (feats, ids, version, dist, temp) in zip(results, tapped):
        e_feats, e_ids, e_version, e_dist, e_temp = banked[tuple(r.prompt_ids + r.completion_ids)]
        assert ids == e_ids and version == e_version and temp == pytest.approx(e_temp)
        assert feats.shape == e_feats.shape == (len(ids) - 1, 3 * 64)  # the last token was never fed
        torch.testing.assert_close(feats, e_feats, atol=1e-4, rtol=1e-4)
        assert torch.equal(dist.has, e_dist.has)
        P = len(r.prompt_ids)
        assert not dist.has[:P].any() and dist.has[P:].all()
        torch.testing.assert_close(dist.probs.float(), e_dist.probs.float(), atol=2e-3, rtol=0)
        same = dist.probs.float() > 1e-3  # below that, top_p/top_k cut-offs leave exact zeros in any order
        assert torch.equal(dist.ids[same], e_dist.ids[same])
        torch.testing.assert_close(dist.rest.float(), e_dist.rest.float(), atol=2e-3, rtol=0)


def test_greedy_rollouts_are_tagged_as_the_engine_tags_them():
    policy = tiny_policy()
    rec = Recorder()
    eng = eagle_engine(policy, rec)
    params = SamplingParams(temperature=0.0, max_new_tokens=10, n=1, ignore_eos=True)
    results = eng.generate(random_prompts(2, 4, 8, seed=2), params)
    banked = {tuple(s[1]): s for s in rec.samples}
    for r, (feats, ids, _, dist, temp) in zip(results, tap_samples(policy, results, params, eng.speculation.aux_layers)):
        e = banked[tuple(ids)]
        assert temp == e[4] == 1.0
        torch.testing.assert_close(dist.probs.float(), e[3].probs.float(), atol=2e-3, rtol=0)


def test_claiming_the_intake_turns_the_engines_banking_off():
    policy = tiny_policy()
    rec = Recorder()
    eng = eagle_engine(policy, rec)
    prompts = random_prompts(2, 4, 8, seed=1)
    eng.generate(prompts, PARAMS)
    assert len(rec.samples) == 4  # alone, the engine banks every finished sample
    intake = eng.drafter_intake()
    assert intake.topk == Recorder.topk and intake.aux_layers == (2, 4, 5)
    intake.claim()
    results = eng.generate(prompts, PARAMS)
    assert len(rec.samples) == 4  # nothing banked twice: the claimant feeds from now on
    assert "eagle3/dist_ids" not in eng.speculation.side_buffers  # nor staged for banking
    assert all(len(r.completion_ids) > 0 for r in results)  # still drafting and decoding
    assert eng.stats()["rollout/spec_step_share"] > 0.5
    intake.add(*rec.samples[0][:2], 7, None, 1.0)  # the claimant's samples reach the same trainer
    assert len(rec.samples) == 5 and rec.samples[-1][2] == 7


def test_hooks_live_only_inside_capture_and_keep_nothing_with_grad():
    policy = tiny_policy()
    tap = FeatureTap(policy, (2, 4, 5))
    ids = torch.randint(3, 96, (2, 9))
    mask = torch.ones_like(ids)

    def hooks():
        return sum(len(m._forward_hooks) for m in policy.modules())

    assert hooks() == 0
    with tap.capture():
        assert hooks() == 4  # three feature layers and the final norm
        policy(input_ids=ids, attention_mask=mask).logits.sum().backward()  # a training forward
        assert tap.forwards == 0
        with torch.no_grad():
            policy(input_ids=ids, attention_mask=mask)
        assert tap.forwards == 1 and tap.hidden(4).shape == (2, 9, 64)
    assert hooks() == 0
    tap.release()
    policy(input_ids=ids, attention_mask=mask)  # outside capture nothing is hooked at all
    assert tap.forwards == 0
    handed = []
    with torch.no_grad(), tap.capture(on_forward=lambda states: handed.append({k: v.shape for k, v in states.items()})):
        policy(input_ids=ids[:1], attention_mask=mask[:1])
        policy(input_ids=ids[1:], attention_mask=mask[1:])
        assert tap.forwards == 0  # streamed: each forward's states handed over, none kept
    assert handed == [{2: (1, 9, 64), 4: (1, 9, 64), 5: (1, 9, 64), "norm": (1, 9, 64)}] * 2


def test_feed_results_runs_the_decoder_once_per_chunk_and_feeds_every_sample():
    """feed_results (the vLLM warm start's path): the same samples as the engine's, from the decoder alone."""
    policy = tiny_policy()
    rec = Recorder()
    eng = eagle_engine(policy, rec)
    results = eng.generate(random_prompts(3, 4, 10, seed=9), PARAMS)
    banked = {tuple(s[1]): s for s in rec.samples}
    got = Recorder()
    calls = []
    head = policy.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, a, o: calls.append(a[0].shape))
    try:
        n = feed_results(policy, TrainerIntake(lambda: got, (2, 4, 5), torch.float32), results, PARAMS, 3,
                         rows_per_forward=4)
    finally:
        handle.remove()
    assert n == len(results) == len(got.samples)
    assert all(len(shape) == 2 for shape in calls)  # the LM head saw completion positions only, never [B, S, H]
    for feats, ids, version, dist, _ in got.samples:
        assert version == 3
        torch.testing.assert_close(feats, banked[tuple(ids)][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dist.probs.float(), banked[tuple(ids)][3].probs.float(), atol=2e-3, rtol=0)


def test_tap_refuses_an_embedding_layer():
    with pytest.raises(ValueError, match="decoder layers only"):
        FeatureTap(tiny_policy(layers=4), (0, 2, 3))
