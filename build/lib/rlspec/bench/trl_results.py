"""The pure half of `python -m rlspec.bench trl-suite`: JUnit XML and engine logs in, per-test outcomes, counts,
regressions (passing on plain, failing on spec) grouped by cause, and the printed summary out. No TRL, no pytest."""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

TEST_FILE = "test_grpo_trainer.py"
ENGINE_BAR = 68  # issue 28: at least this many spec-passing tests sample through the engine
OUTCOMES = ("passed", "failed", "error", "skipped")


def junit_key(classname: str, name: str) -> str:
    """'Class::test[param]' (or 'test[param]' for a module-level test) from a JUnit testcase's attributes."""
    last = classname.rsplit(".", 1)[-1] if classname else ""
    if last.startswith("Test"):
        return f"{last}::{name}"
    return name


def nodeid_key(nodeid: str) -> str:
    """The same key from a pytest nodeid ('dir/test_x.py::Class::test[param]')."""
    return nodeid.split("::", 1)[1] if "::" in nodeid else nodeid


def first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        line = line.strip()
        if line:
            return line[:300]
    return ""


def parse_junit(xml_text: str) -> dict[str, dict]:
    """{key: {"outcome": passed|failed|error|skipped, "message": first line, "time_s": float}} from JUnit XML.

    A testcase with both a failure and an error (a failing test whose teardown also errs) counts as failed;
    a setup/teardown error alone counts as error."""
    root = ET.fromstring(xml_text)
    out: dict[str, dict] = {}
    for case in root.iter("testcase"):
        key = junit_key(case.get("classname", ""), case.get("name", ""))
        outcome, message = "passed", ""
        for tag in ("skipped", "error", "failure"):  # later tags take precedence
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = first_line(el.get("message")) or first_line(el.text)
        out[key] = {"outcome": outcome, "message": message, "time_s": round(float(case.get("time") or 0.0), 2)}
    return out


def parse_engine_log(text: str) -> dict[str, dict]:
    """{key: {"constructed", "engine_calls", "engine_samples"}} from the plugin's JSON-lines log."""
    out = {}
    for line in text.splitlines():
        if line.strip():
            rec = json.loads(line)
            out[nodeid_key(rec["nodeid"])] = {k: rec.get(k, 0) for k in ("constructed", "on_trl_generation", "engine_calls",
                                                                   "engine_samples")}
    return out


def counts(results: dict[str, dict]) -> dict[str, int]:
    c = Counter(r["outcome"] for r in results.values())
    return {"total": len(results), **{o: c.get(o, 0) for o in OUTCOMES}}


def regressions(plain: dict[str, dict], spec: dict[str, dict]) -> list[dict]:
    """Tests passing on plain that do not pass on spec (skipped-on-spec counts too: it did not pass)."""
    out = []
    for key, p in sorted(plain.items()):
        s = spec.get(key)
        if p["outcome"] == "passed" and (s is None or s["outcome"] != "passed"):
            out.append({"test": key, "spec_outcome": s["outcome"] if s else "missing",
                        "error": s["message"] if s else "not run on spec"})
    return out


def group_by_cause(regs: list[dict]) -> dict[str, list[str]]:
    """Regressions grouped by their first error line, numbers and quoted values blurred so that the same
    cause with different parameters lands in one group."""
    groups: dict[str, list[str]] = defaultdict(list)
    for r in regs:
        cause = re.sub(r"\d+(\.\d+)?", "N", r["error"] or r["spec_outcome"])
        groups[cause[:200]].append(r["test"])
    return dict(sorted(groups.items(), key=lambda kv: -len(kv[1])))


# a failure whose last error says a file was not found offline (the model or dataset was not built)
OFFLINE_MISS = re.compile(r"couldn't connect to 'https://huggingface.co'|LocalEntryNotFoundError|not built offline|"
                          r"Cannot find the requested files in the disk cache|OfflineModeIsEnabled", re.I)


def test_sources(test_file: Path) -> dict[str, str]:
    """{'Class::test_name' or 'test_name': source text, decorators included} of every test function."""
    import ast

    src = test_file.read_text()
    lines = src.splitlines()
    out: dict[str, str] = {}

    def add(node, prefix: str) -> None:
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        out[prefix + node.name] = "\n".join(lines[start - 1:node.end_lineno])

    for node in ast.parse(src).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            add(node, "")
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name.startswith("test"):
                    add(sub, f"{node.name}::")
    return out


def unbuilt_needed(key: str, sources: dict[str, str], unbuilt: dict[str, str]) -> list[str]:
    """The not-built repo ids a test names: in its parameters (the nodeid) or in its own source."""
    base = key.split("[", 1)[0]
    params = key[len(base):]
    body = sources.get(base, "")
    return [rid for rid in sorted(unbuilt, key=len, reverse=True)
            if re.search(re.escape(rid) + r"(?![A-Za-z0-9_.\-])", params + "\n" + body)]


def reclassify_unbuilt(results: dict[str, dict], sources: dict[str, str], unbuilt: dict[str, str]) -> int:
    """Failures caused by a model or dataset that was not built offline become skips (the same rule for both
    arms): the error says a file was missing offline and the test names a not-built repo id. Returns how many."""
    n = 0
    for key, r in results.items():
        if r["outcome"] in ("failed", "error") and OFFLINE_MISS.search(r["message"] or ""):
            ids = unbuilt_needed(key, sources, unbuilt)
            if ids:
                r.update(outcome="skipped", message=f"not built offline: {ids[0]} ({unbuilt[ids[0]]})",
                         original_message=r["message"])
                n += 1
    return n


def summarize(plain: dict[str, dict] | None, spec: dict[str, dict] | None, engine: dict[str, dict]) -> dict:
    summary: dict = {}
    if plain is not None:
        summary["plain"] = counts(plain)
    if spec is not None:
        summary["spec"] = counts(spec)
        passing = [k for k, r in spec.items() if r["outcome"] == "passed"]
        summary["spec_passing_sampled_through_engine"] = sum(engine.get(k, {}).get("engine_calls", 0) > 0 for k in passing)
        summary["spec_sampled_through_engine_any_outcome"] = sum(engine.get(k, {}).get("engine_calls", 0) > 0 for k in spec)
    if plain is not None and spec is not None:
        regs = regressions(plain, spec)
        summary["pass_on_plain_fail_on_spec"] = len(regs)
        summary["fixed_on_spec"] = sum(1 for k, r in spec.items()
                                       if r["outcome"] == "passed" and plain.get(k, {}).get("outcome") != "passed")
        summary["issue28_met"] = (len(regs) == 0 and summary["spec_passing_sampled_through_engine"] >= ENGINE_BAR)
    return summary


def per_test_table(plain: dict | None, spec: dict | None, engine: dict) -> dict[str, dict]:
    keys = sorted(set(plain or {}) | set(spec or {}))
    table = {}
    for k in keys:
        row = {}
        if plain is not None:
            row["plain"] = plain.get(k, {"outcome": "missing", "message": ""})
        if spec is not None:
            row["spec"] = spec.get(k, {"outcome": "missing", "message": ""})
            row["spec_sampled_through_engine"] = engine.get(k, {}).get("engine_calls", 0) > 0
            row["spec_engine"] = engine.get(k)
        table[k] = row
    return table


def format_summary(doc: dict) -> str:
    s = doc["summary"]
    lines = ["", f"TRL GRPOTrainer suite ({doc.get('trl_tests_source', '?')}, trl {doc.get('trl_version', '?')})",
             f"{'arm':8s} {'total':>6s} {'passed':>7s} {'failed':>7s} {'error':>6s} {'skipped':>8s} {'wall_s':>8s} {'test_s':>8s}"]
    for arm in ("plain", "spec"):
        if arm in s:
            c = s[arm]
            lines.append(f"{arm:8s} {c['total']:6d} {c['passed']:7d} {c['failed']:7d} {c['error']:6d} {c['skipped']:8d} "
                         f"{doc.get('wall_s', {}).get(arm, 0):8.0f} {doc.get('test_time_s', {}).get(arm, 0):8.0f}")
    w = doc.get("wall_s", {})
    if "total" in w:
        lines.append(f"wall: {w['total']:.0f}s in all ({w.get('fixtures', 0):.0f}s building fixtures); "
                     f"{doc.get('jobs', 1)} pytest processes at a time, so the arms' wall times overlap")
    if "spec_passing_sampled_through_engine" in s:
        lines.append(f"spec-passing tests that sampled through rlspec's engine: {s['spec_passing_sampled_through_engine']}"
                     f" (bar: {ENGINE_BAR})")
    if "pass_on_plain_fail_on_spec" in s:
        lines.append(f"pass on plain, not on spec: {s['pass_on_plain_fail_on_spec']}; fixed on spec: {s['fixed_on_spec']};"
                     f" issue 28 met: {s['issue28_met']}")
        for cause, tests in doc.get("regressions_by_cause", {}).items():
            lines.append(f"  [{len(tests)}] {cause}")
            for t in tests:
                lines.append(f"        {t}")
    if doc.get("unbuilt"):
        lines.append("not built offline (tests needing them are skipped in both arms):")
        for rid, why in doc["unbuilt"].items():
            lines.append(f"  {rid}: {why}")
    return "\n".join(lines)
