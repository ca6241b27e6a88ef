"""PPO for language models with rollouts through the engine (docs/ppo.md); PPOTrainer lives in trainer.py."""
