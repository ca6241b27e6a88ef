"""TRL options that partial rollouts refuse or handle (trainers/partial_rollouts.py why_not_with_this_loss,
trainers/partial_trl.py): each refusal says why, at construction and in the CLI's config check, and
vllm_importance_sampling_clip_max=None (TRL: no cap) runs."""
from __future__ import annotations

import types

import pytest
import torch
import trl

from rlspec.config import ConfigError, load_config
from rlspec.trainers import partial_trl
from rlspec.trainers.data import make_math_dataset
from rlspec.trainers.grpo import SpecGRPOTrainer
from tests.trainers.test_partial_rollouts import CAP, N, PARTIAL, distinct_chars_reward, eos_prone_llama

# (GRPOConfig field, value, what the refusal says, the CLI override)
REFUSED = [
    ("vllm_importance_sampling_correction", False, "would train as if the current policy had drawn them",
     "grpo.extra.vllm_importance_sampling_correction=false"),
    ("beta", 0.04, "KL of carried tokens would be estimated under the earlier policies", "grpo.beta=0.04"),
    ("off_policy_mask_threshold", 0.5, "would mask long carried samples first",
     "grpo.extra.off_policy_mask_threshold=0.5"),
    ("loss_type", "vespo", "shrinks or zeroes long carried samples", "grpo.extra.loss_type=vespo"),
]


def build(tok, out, **config):
    args = trl.GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False, per_device_train_batch_size=8,
                          num_generations=N, max_completion_length=CAP, max_steps=2, logging_steps=1,
                          report_to=[], disable_tqdm=True, save_strategy="no", seed=0, **config)
    return SpecGRPOTrainer(model=eos_prone_llama(tok), reward_funcs=[distinct_chars_reward], args=args,
                           train_dataset=make_math_dataset(16, seed=0), processing_class=tok,
                           engine_kwargs=dict(max_model_len=256), partial_rollouts=PARTIAL)


@pytest.mark.parametrize("field, value, why, _", REFUSED, ids=[r[0] for r in REFUSED])
def test_options_that_would_train_carried_tokens_uncorrected_are_refused_at_construction(char_tokenizer, tmp_path,
                                                                                           field, value, why, _):
    with pytest.raises(ValueError, match=f"partial_rollouts: .*{why}"):
        build(char_tokenizer, tmp_path, **{field: value})


@pytest.mark.parametrize("field, value, why, override", REFUSED, ids=[r[0] for r in REFUSED])
def test_the_cli_refuses_them_before_step_one(field, value, why, override):
    with pytest.raises(ConfigError, match=f"partial_rollouts.enabled: .*{why}"):
        load_config(None, ["partial_rollouts.enabled=true", override])
    load_config(None, [override])  # the option alone is TRL's business


def test_an_uncapped_correction_runs_and_reports_no_cut(char_tokenizer, tmp_path):
    """clip_max=None: TRL's token_truncate clamps at nothing; the cut fractions are 0, not a TypeError."""
    trainer = build(char_tokenizer, tmp_path, vllm_importance_sampling_clip_max=None)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "partial/is_cut_token_frac_carried" in h]
    assert logged and all(h["partial/is_cut_token_frac_carried"] == h["partial/is_cut_token_frac_fresh"] == 0
                          for h in logged)
    # and a capped ratio is counted as cut (the metric can see a cut)
    g = types.SimpleNamespace(samples=[types.SimpleNamespace(steps=[0, 1]), types.SimpleNamespace(steps=[1])])
    fake = types.SimpleNamespace(_partial_groups=[g], state=types.SimpleNamespace(global_step=1),
                                 vllm_importance_sampling_clip_max=2.0,
                                 vllm_importance_sampling_mode="token_truncate")
    out = {"importance_sampling_ratio": torch.tensor([[2.0, 1.0], [1.0, 0.0]]),
           "completion_mask": torch.tensor([[1, 1], [1, 0]])}
    assert partial_trl.carried_is_metrics(fake, out) == {"partial/is_cut_token_frac_carried": 0.5,
                                                         "partial/is_cut_token_frac_fresh": 0.0}


@pytest.mark.parametrize("backend, why", [("VLLMBackend", "abort the other requests and later resubmit each as "
                                                          "prompt \\+ prefix"),
                                          ("RayPool", "one decision over the groups of every worker")])
def test_the_vllm_backend_and_the_ray_pool_are_refused_with_the_reason(backend, why):
    engine = type(backend, (), {})()  # what the trainer's RolloutSource holds for that backend
    trainer = types.SimpleNamespace(rollouts=types.SimpleNamespace(engine=engine))
    with pytest.raises(ValueError, match=f"the rollout backend {backend} cannot stop a round and carry samples: .*"
                                         f"{why}.*rollout.backend=engine"):
        partial_trl.refuse_unsupported(trainer)
