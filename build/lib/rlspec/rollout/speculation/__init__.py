"""spec: the speculation policy, everything that decides what the target verifies.

Drafters propose token trees (`drafters/`, one registry); `draft_batch` pads them into tensors;
`verify` is the pure lossless rejection sampler (chains and trees); selectors choose per decode step
whether and how to speculate from measured costs (`selectors/`, one registry; `cost_model` holds the
measurements); `drafter_training` keeps the learned drafter aligned with the moving policy;
`speculation` assembles the drafters and the selector a `SpecConfig` asks for. It imports
`rlspec.rollout.runtime` (sampling, sequences, the model) and never the engine.
The algorithms are written out in the repository's `docs/`.
"""
