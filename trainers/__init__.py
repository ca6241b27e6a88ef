"""rlspec.trainers: trainers that route their rollouts through the rollout engine.

rollout_source.py  the engine side both trainers share: build, weight sync, seeds, rollout metrics
trl_engine.py   the seam between a TRL online trainer and the engine, shared by the two drop-ins below
grpo.py         SpecGRPOTrainer, a drop-in subclass of trl.GRPOTrainer
rloo.py         SpecRLOOTrainer, a drop-in subclass of trl.RLOOTrainer
trl_compat.py   what keeps it a drop-in: TRL's generation for a model the engine cannot run, VLM refusal,
                the importance-sampling settings, rollout_func outputs
peft_sync.py    PEFT (LoRA) policies: the merged weights the engine is built from and synced with
ppo/            PPOTrainer (TRL has none any more): trainer.py, config.py (PPOConfig), maths.py (GAE, whitening,
                clipped losses, KL estimators, IS weights: pure functions), model.py (policy + value head or
                critic), batch.py (engine results -> padded tensors), update.py (epochs x minibatches)
run/            a run's files: checkpoint.py (atomic, durable, finite checkpoints and exact resume),
                checkpoint_dirs.py, checkpoint_verify.py, resume_point.py, run_files.py (the manifest),
                run_lock.py (the output_dir lease), interrupts.py (signals, non-finite logits)
partial_*.py    partial rollouts for GRPO (docs/partial_rollouts.md)
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
