"""Drafters: propose token trees for the target to verify (protocol and registry in base.py).

Model-free, deterministic ones: `ngram` (prompt lookup over a sample's own context) and `suffix`
(what this prompt's siblings, earlier rollouts and recent rollouts said after the same words).
Build one by name with `rlspec.rollout.speculation.drafters.base.make_drafter(name, **kwargs)`.
"""
