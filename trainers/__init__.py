"""Trainers that route their rollouts through the rollout engine.

grpo.py         SpecGRPOTrainer, a drop-in subclass of trl.GRPOTrainer
data.py         the embedded arithmetic dataset and hub datasets mapped to prompt/answer columns
rewards.py      reward functions (TRL signature) and their registry
weight_sync.py  pushing the policy's weights into the engine after each optimizer step
callbacks.py    the run summary: rollout time vs step time, reward, throughput

Submodules import torch/transformers/trl; this package file stays empty of imports so that
`import trainers` is cheap.
"""
