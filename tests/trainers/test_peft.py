"""PEFT (LoRA) policies: the engine samples from the merged weights (trainers/peft_sync.py), float32 parity with the
PEFT model's own forward, the adapters unmerged after every push, and a GRPO run whose LoRA weights move while the
engine follows them."""
from __future__ import annotations

import pytest
import torch
import trl

from rlspec.rollout.types import SamplingParams
from rlspec.trainers.data import make_math_dataset
from rlspec.trainers.rollout_source import build_engine
from rlspec.trainers.weight_sync import sync_weights

peft = pytest.importorskip("peft")

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)


def randomize_lora(model, seed: int) -> None:
    """LoRA starts with B = 0 (merged == base); give the adapters weight so a merge changes the model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)


def policy_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def assert_engine_matches(engine, model, prompts) -> None:
    results = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=0))
    for r in results:
        assert r.completion_ids
        torch.testing.assert_close(torch.tensor(r.logprobs), policy_logprobs(model, r.prompt_ids, r.completion_ids),
                                   rtol=0, atol=1e-4)


def test_engine_samples_the_merged_lora_model_and_follows_syncs(tiny_llama, char_tokenizer):
    model = peft.get_peft_model(tiny_llama, peft.LoraConfig(**LORA))
    randomize_lora(model, seed=0)
    model.eval()
    prompts = [char_tokenizer.encode("What is 7 + 5?"), char_tokenizer.encode("2+2=")]
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    # built from the base model (a plain LlamaForCausalLM for the runtime), then the merged weights pushed
    engine = build_engine(model, char_tokenizer, None, dict(max_model_len=128, max_num_seqs=4), {})
    assert type(model.base_model.model.model.layers[0].self_attn.q_proj).__module__.startswith("peft")  # restored
    sync_weights(model, engine)
    assert_engine_matches(engine, model, prompts)

    randomize_lora(model, seed=1)
    sync_weights(model, engine)
    assert engine.policy_version == 2
    assert_engine_matches(engine, model, prompts)  # the engine follows the new adapters
    for name, param in model.named_parameters():  # merged one layer at a time, restored bit for bit
        if "lora_" not in name:
            assert torch.equal(param, base_before[name]), name


@pytest.mark.parametrize("dora", [False, True])
def test_modules_to_save_and_dora_are_pushed_merged(dora, char_tokenizer):
    """A trained copy of a whole module (modules_to_save) goes under the module's own name; DoRA's merge (a
    magnitude-rescaled weight) goes through the same per-layer merge."""
    from tests.conftest import make_tiny_hf

    model = peft.get_peft_model(make_tiny_hf("qwen2", vocab=len(char_tokenizer)), peft.LoraConfig(
        r=4, target_modules=["q_proj", "o_proj", "down_proj"], modules_to_save=["lm_head"], use_dora=dora))
    randomize_lora(model, seed=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "modules_to_save" in name:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(2)) * 0.3)
    model.eval()
    engine = build_engine(model, char_tokenizer, None, dict(max_model_len=64, max_num_seqs=4), {})
    sync_weights(model, engine)
    assert_engine_matches(engine, model, [char_tokenizer.encode("hello"), char_tokenizer.encode("2+2=")])


def test_prefix_tuning_trains_on_trl_generation(tiny_llama, char_tokenizer, tmp_path):
    """A PEFT method with no merged weights (virtual tokens) is one the engine cannot run: TRL's generation."""
    from rlspec.trainers.grpo import SpecGRPOTrainer

    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                          num_generations=2, max_completion_length=4, max_steps=1, report_to="none",
                          save_strategy="no", disable_tqdm=True, logging_steps=1)
    config = peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    with pytest.warns(UserWarning, match="virtual tokens"):
        trainer = SpecGRPOTrainer(model=tiny_llama, reward_funcs=[_len_reward], args=args, peft_config=config,
                                  train_dataset=make_math_dataset(4, seed=0), processing_class=char_tokenizer)
    assert trainer.engine is None


def _len_reward(completions, **kwargs):
    return [float(len(set(c[0]["content"]))) for c in completions]


def test_grpo_trains_lora_and_the_engine_follows(tiny_llama, char_tokenizer, tmp_path):
    from rlspec.trainers.grpo import SpecGRPOTrainer

    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, seed=0,
                          per_device_train_batch_size=8,
                          num_generations=4, max_completion_length=8, max_steps=2, logging_steps=1, learning_rate=5e-2,
                          report_to="none", save_strategy="no", disable_tqdm=True)
    trainer = SpecGRPOTrainer(model=tiny_llama, reward_funcs=[_len_reward], args=args,
                              peft_config=peft.LoraConfig(**LORA),
                              train_dataset=make_math_dataset(16, seed=0), processing_class=char_tokenizer,
                              engine_kwargs=dict(max_model_len=256, max_num_seqs=8))
    model = trainer.model
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    trainer.train()

    assert any(not torch.equal(lora_before[n], p) for n, p in model.named_parameters() if "lora_" in n)
    assert all(torch.equal(base_before[n], p) for n, p in model.named_parameters() if "lora_" not in n)
    # pushed merged at construction (the engine is built from the base weights), then before step 2's rollout
    assert trainer.engine.policy_version == 2 and trainer.weight_syncer.num_syncs == 2
    steps = [log for log in trainer.state.log_history if "reward" in log]
    assert len(steps) == 2
    for log in steps:  # step 2 sampled from the merged weights of step 1's adapters: still on-policy
        assert log["sampling/sampling_logp_difference/max"] < 1e-4
    # the engine now holds the trained adapters merged in
    sync_weights(model, trainer.engine)
    model.eval()
    assert_engine_matches(trainer.engine, model, [char_tokenizer.encode("What is 3 + 4?")])
