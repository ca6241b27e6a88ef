"""rlspec.rollout: the speculative rollout engine (model runtime, KV cache, sampling, verification, drafters).

This package never imports `rlspec.trainers` or the rest of `rlspec` (imports point one way: rlspec -> trainers -> rollout).
"""

# The folder sits at the repository's top level (the design's layout) and is installed as rlspec.rollout through the
# link rlspec/rollout; imported under its bare name it would be a second copy of every module and class.
if __name__ != "rlspec.rollout":
    raise ImportError(f"import this package as rlspec.rollout, not {__name__}")
