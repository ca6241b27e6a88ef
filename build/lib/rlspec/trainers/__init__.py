"""rlspec.trainers: trainers that route their rollouts through the rollout engine.

rollout_source.py  the engine side both trainers share: build, weight sync, seeds, rollout metrics
grpo.py         SpecGRPOTrainer, a drop-in subclass of trl.GRPOTrainer
trl_compat.py   what keeps it a drop-in: TRL's generation for a model the engine cannot run, VLM refusal,
                the importance-sampling settings, rollout_func outputs
peft_sync.py    PEFT (LoRA) policies: the merged weights the engine is built from and synced with
ppo.py          PPOTrainer (TRL has none any more): actor-critic PPO, rollouts through the same engine
ppo_config.py   PPOConfig, TrainingArguments + the former trl.PPOConfig's fields
ppo_math.py     GAE, whitening, clipped policy/value losses, KL estimators, IS weights (pure functions)
ppo_model.py    the policy + value head (or separate critic) module and its checkpoint file
ppo_batch.py    engine results -> padded tensors; ppo_update.py: the epochs x minibatches update loop
data.py         the embedded arithmetic dataset and hub datasets mapped to prompt/answer columns
rewards.py      reward functions (TRL signature) and their registry
weight_sync.py  pushing the policy's weights into the engine after each optimizer step
callbacks.py    the run summary: rollout time vs step time, reward, throughput

Submodules import torch/transformers/trl; this package file stays empty of imports so that
`import rlspec.trainers` is cheap.
"""

# Installed as rlspec.trainers through the link rlspec/trainers (see rlspec/rollout/__init__.py).
if __name__ != "rlspec.trainers":
    raise ImportError(f"import this package as rlspec.trainers, not {__name__}")
