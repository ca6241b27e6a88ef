"""The aims the device check steers by, read off one report: each aim, the figure it is judged on and where that
comes from, and whether it is met (None: not measured in this report). They are set for an H200 and the
Qwen2.5-7B shape in bf16 (docs/gpu.md#the-aims); on another device the report says so and judges nothing.

    python -m rlspec.bench.gpucheck.aims bench_out/gpu/report.json     # an earlier report, judged again
"""
from __future__ import annotations

import json
import sys

from rlspec.bench.gpucheck.presets import CORE, SECTIONS

DEVICE = "H200"
PLAIN_MS = {1: 4.0, 8: 4.6, 32: 5.5, 128: 8.0}  # the plain decode step at 256 cached positions, ms, by batch
LONG = (8192, 32, 1.3)  # context, batch: the plain step at most this many times its weights-plus-KV limit
LEVEL = 0.1  # one EAGLE-3 draft level for the whole batch, over the plain step of the batch, batch 1-32
ORACLE = (0.7, (1, 8), 0.9)  # acceptance, batches: the decode loop's speedup at least this share of the formula's
CHECK_S, CORE_S = 600, 300  # the whole check and its core (presets.CORE), every section completed


def _get(row, key: str):
    return row.get(key) if isinstance(row, dict) else None


def _rows(report: dict, section: str, key: str) -> list[dict]:
    """report[section][key] as a list of rows; [] where a section did not run, was cut short or failed before
    writing them (the check still ends with its judgement)."""
    rows = _get(report.get(section), key)
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def _first(rows: list[dict], **match) -> dict | None:
    """The first row with these values: the contexts section's default pass comes before its comparisons."""
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def evaluate(report: dict) -> dict:
    """{"rows": [{aim, value, target, met, source}]} for an H200's report, else {"skipped": why}."""
    if DEVICE not in str(report.get("device")):
        return {"skipped": f"the aims are set for an {DEVICE}; this report is from {report.get('device')}"}
    contexts, oracle = _rows(report, "contexts", "rows"), _rows(report, "oracle", "rows")
    verify, levels = _rows(report, "spec_costs", "verify"), _rows(report, "spec_costs", "eagle3_draft")
    rows = []

    def aim(name: str, value, target: float, at_most: bool, source: str, completed: bool = True) -> None:
        met = None if value is None else completed and (value <= target if at_most else value >= target)
        rows.append(dict(aim=name, value=value, bound="<=" if at_most else ">=", target=target, met=met,
                         source=source))

    for b, ms in PLAIN_MS.items():  # batch 128 is spec_costs' plain row (contexts stops at 32)
        if b <= 32:
            row, source = _first(contexts, context=256, batch=b), "contexts"
        else:
            row, source = _first(verify, batch=b, kind="chain", tokens=1), "spec_costs verify (chain of 1)"
        aim(f"plain step ms, context 256, batch {b}", _get(row, "step_ms"), ms, True, source)
    ctx, b, over = LONG
    aim(f"plain step over its limit, context {ctx}, batch {b}", _get(_first(contexts, context=ctx, batch=b),
                                                                     "over_limit"), over, True, "contexts")
    for b in (1, 8, 32):
        aim(f"EAGLE-3 level over a plain step, batch {b}", _get(_first(levels, batch=b), "vs_plain_step"), LEVEL,
            True, "spec_costs eagle3_draft")
    a, batches, share = ORACLE
    for b in batches:  # at the acceptance the row measured: the gap left is the engine's (oracle.py, predict.py)
        aim(f"oracle a = {a}, batch {b}: decode speedup over the formula's", _get(_first(oracle, batch=b, accept=a),
                                                                                  "vs_predicted_at_measured"),
            share, False, "oracle (formula at the measured acceptance)")
    # judged on a run of the whole check: met where it took no longer and each of its sections completed (a skipped
    # one says why it could not run); a section cut short by its limit fails the budget whatever the seconds
    whole = set(SECTIONS) <= set(report.get("sections_run", []))

    def completed(names) -> bool:
        return all(isinstance(report.get(s), dict) and report[s].get("status") in ("ok", "skipped") for s in names)

    aim("the whole check's seconds, every section completed", report.get("elapsed_s") if whole else None, CHECK_S,
        True, "elapsed_s and each section's status", completed(SECTIONS))
    aim("the core's seconds (tests, plain, spec_costs), each completed",
        sum(_get(report.get(s), "seconds") or 0 for s in CORE) if whole else None, CORE_S, True,
        "its sections' seconds and status", completed(CORE))
    return {"rows": rows, "met": sum(r["met"] is True for r in rows), "of": len(rows)}


def lines(aims: dict) -> list[str]:
    """The aims as the check's summary prints them."""
    if "skipped" in aims:
        return [f"  aims: {aims['skipped']}"]
    out = [f"  aims met: {aims['met']} of {aims['of']}"]
    for r in aims["rows"]:
        value = "not measured" if r["value"] is None else f"{r['value']:.3g}"
        verdict = {True: "met", False: "not met", None: "-"}[r["met"]]
        out.append(f"    {r['aim']}: {value} (aim {r['bound']} {r['target']}) {verdict}")
    return out


if __name__ == "__main__":
    print("\n".join(lines(evaluate(json.load(open(sys.argv[1]))))))
