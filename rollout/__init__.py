"""rollout: the speculative rollout engine (model runtime, KV cache, sampling, verification, drafters).

This package never imports `trainers` or `rlspec` (imports point one way: rlspec -> trainers -> rollout).
"""
