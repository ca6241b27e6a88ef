"""The rollout speedup speculation should give on a GPU (docs/gpu.md#predicted-rollout-speedup), and its check.

    speedup(B, k) = E_k / (c_B(1 + k) + k * d)

E_k: tokens a verify of a k-token chain yields (the target's own included; sum_{i=0..k} a^i when each draft
survives with probability a); c_B(T): a T-token verify at batch B relative to a plain step at B; d: drafting
one token relative to a plain step. `annotate` puts the formula's figure, from the same run's `spec_costs`,
beside each `oracle` row; without verify rows c_B(T) is read off plain steps (`from_plain`: a verify of T tokens
at batch B reads the weights once, as a plain step of B * T rows does).

    python -m rlspec.bench.gpucheck.predict bench_out/gpu_check.json     # the docs' table from plain steps
"""
from __future__ import annotations

import json
import math
import sys


def expected_tokens(a: float, k: int) -> float:
    return sum(a ** i for i in range(k + 1))


def speedup(tokens: float, verify_ratio: float, k: int, draft_ratio: float = 0.0) -> float:
    return tokens / (verify_ratio + k * draft_ratio)


def from_plain(steps: dict[int, float], batch: int, tokens: int) -> float:
    """c_B(T) from plain step ms by batch: the step of B * T rows (log-linear between measured batches, linear
    past the largest) over the step of B."""
    bs, x = sorted(steps), batch * tokens
    if x <= bs[0]:
        ms = steps[bs[0]]
    elif x >= bs[-1]:
        b1, b2 = bs[-2], bs[-1]
        ms = steps[b2] + (steps[b2] - steps[b1]) / (b2 - b1) * (x - b2)
    else:
        b1, b2 = max(b for b in bs if b <= x), min(b for b in bs if b >= x)
        w = 0.0 if b1 == b2 else (math.log(x) - math.log(b1)) / (math.log(b2) - math.log(b1))
        ms = steps[b1] + (steps[b2] - steps[b1]) * w
    return ms / steps[batch]


def annotate(report: dict) -> None:
    """Each oracle row gets predicted_speedup: the formula at its a, k and batch, c_B from this run's verify rows
    (a chain of 1 + k tokens at the row's batch), d = 0 (the oracle drafts from a table); predicted_at_measured: the
    same at the row's measured tokens per verify, so the gap to the measured speedup is time spent outside the
    verify (host work, drafting, transfers). vs_predicted and vs_predicted_at_measured: the row's decode speedup
    (its decode loop alone, oracle.py) over each."""
    oracle, costs = report.get("oracle") or {}, report.get("spec_costs") or {}
    ratio = {(r["batch"], r["tokens"]): r["vs_plain"] for r in costs.get("verify", []) if r["kind"] == "chain"}
    k = oracle.get("num_draft_tokens")
    for row in oracle.get("rows", []):
        c = ratio.get((row["batch"], 1 + k))
        if c is not None:
            row["predicted_speedup"] = speedup(expected_tokens(row["accept"], k), c, k)
            if row.get("accept_len"):  # the same at the acceptance the row measured: what is left is overhead
                row["predicted_at_measured"] = speedup(row["accept_len"], c, k)
            if row.get("decode_speedup"):
                row["vs_predicted"] = row["decode_speedup"] / row["predicted_speedup"]
                if "predicted_at_measured" in row:
                    row["vs_predicted_at_measured"] = row["decode_speedup"] / row["predicted_at_measured"]


def main(path: str) -> None:
    payload = json.load(open(path))
    for model in sorted({r["model"] for r in payload["results"]}):
        steps = {r["batch"]: r["step_graph_ms"] for r in payload["results"]
                 if r["model"] == model and r.get("compile", "off") == "off"}
        for b in (1, 8, 32):
            print(model, b, " ".join(f"c({t})={from_plain(steps, b, t):.2f}" for t in (2, 3, 5)))


if __name__ == "__main__":
    main(sys.argv[1])
