"""The learned drafter's training life: its buffer of the rollouts' features and the tap that fills it, the
losses, the trainer (a thread, or a process of its own and its child), the warm start before step 1
(docs/drafter_training.md). The engine-facing drafter itself is drafters/eagle3*.py."""
