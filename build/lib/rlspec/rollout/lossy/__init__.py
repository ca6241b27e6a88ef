"""Lossy acceleration of reasoning chains, opt-in and honest (docs/lossy.md).

Two modes beyond lossless speculation: judge verification (judge.py: a per-token rule that keeps
draft tokens the exact test rejects) and Arbitrage step routing (router.py: a draft source writes a
whole step, the target scores it in one forward and a router keeps it or has the target regenerate
it). control.py is what the engine calls; every token records its source and the log-probability
with which the whole pipeline (draft, judge or router, residual) emitted it (law.py), so
importance-sampling corrections see the mismatch exactly.
"""
