"""pytest plugin loaded by `python -m rlspec.bench trl-suite` (`-p rlspec.bench.trl_plugin`) into TRL's GRPO test run.

It never edits TRL's test files; everything is done from outside, driven by environment variables the
driver sets:

  RLSPEC_TRL_ARM          "plain" (trl.GRPOTrainer, untouched) or "spec" (the name `GRPOTrainer` in every
                          collected test module is bound to `SpecGRPOTrainerUnderTest`, a thin subclass of
                          trainers.grpo.SpecGRPOTrainer that counts its engine rollouts)
  RLSPEC_TRL_FIXTURES     fixtures.json written by the driver: local datasets ({repo id: {config: dir}}) and the
                          repo ids that could not be built offline ({repo id: reason})
  RLSPEC_TRL_ENGINE_LOG   JSON-lines file; one line per test: nodeid, trainers constructed, engine calls/samples
  RLSPEC_TRL_TIMEOUT_S    per-test limit (SIGALRM in the main thread; 0 = none)

Models come from a Hugging Face cache layout the driver populated (HF_HOME + HF_HUB_OFFLINE=1), so
`from_pretrained("trl-internal-testing/tiny-...")` resolves exactly as on a machine with the Hub.
`datasets.load_dataset` is redirected for the repo ids in fixtures.json. A test whose failure names a repo
id that could not be built offline is reported as skipped ("not built offline: ..."), in both arms alike.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal

import pytest

ARM = os.environ.get("RLSPEC_TRL_ARM", "plain")
_FIXTURES = json.loads(open(os.environ["RLSPEC_TRL_FIXTURES"]).read()) if os.environ.get("RLSPEC_TRL_FIXTURES") else {}
LOCAL_DATASETS: dict[str, dict[str, str]] = _FIXTURES.get("datasets", {})
UNBUILT: dict[str, str] = _FIXTURES.get("unbuilt", {})
ENGINE_LOG = os.environ.get("RLSPEC_TRL_ENGINE_LOG")
TIMEOUT_S = int(os.environ.get("RLSPEC_TRL_TIMEOUT_S", "0") or 0)
UNBUILT_PREFIX = "not built offline: "


class NotBuiltOffline(OSError):
    """A model or dataset repo id the driver could not build offline."""


# --- a test checkout older than the installed TRL may import `is_<pkg>_available` helpers that TRL has since
# dropped from trl.import_utils; answer those by package presence instead of failing the whole collection.
def _install_import_utils_fallback() -> None:
    import trl.import_utils as iu

    def __getattr__(name: str):
        if name.startswith("is_") and name.endswith("_available"):
            package = name[len("is_"):-len("_available")]
            return lambda *a, **k: importlib.util.find_spec(package) is not None
        raise AttributeError(f"module 'trl.import_utils' has no attribute {name!r}")

    if not hasattr(iu, "__getattr__"):
        iu.__getattr__ = __getattr__


def _install_dataset_redirect() -> None:
    import datasets

    original = datasets.load_dataset

    def load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
        if path in UNBUILT:
            raise NotBuiltOffline(f"{UNBUILT_PREFIX}{path} ({UNBUILT[path]})")
        if path not in LOCAL_DATASETS:
            return original(path, name, *args, split=split, streaming=streaming, **kwargs)
        configs = LOCAL_DATASETS[path]
        config = name or next(iter(configs))
        if config not in configs:
            raise NotBuiltOffline(f"{UNBUILT_PREFIX}{path} config {config!r} (built: {sorted(configs)})")
        dd = datasets.load_from_disk(configs[config])
        if split is not None:
            ds = dd[split]
            return ds.to_iterable_dataset() if streaming else ds
        if streaming:
            return datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in dd.items()})
        return dd

    datasets.load_dataset = load_dataset


_install_import_utils_fallback()
_install_dataset_redirect()

# --- the Spec arm: a thin subclass that records whether rollouts went through rlspec's engine
_STATE = {"constructed": 0, "on_trl_generation": 0, "engine_calls": 0, "engine_samples": 0}


def _spec_subclass():
    """SpecGRPOTrainer, counting the rollouts that came back from its RolloutSource (the engine)."""
    from rlspec.trainers.grpo import SpecGRPOTrainer

    class SpecGRPOTrainerUnderTest(SpecGRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            _STATE["constructed"] += 1
            if getattr(self, "rollouts", None) is None:  # the engine cannot run this policy: TRL's generation samples
                _STATE["on_trl_generation"] += 1
                return
            inner = self.rollouts.generate

            def generate(*a, **k):
                results = inner(*a, **k)
                _STATE["engine_calls"] += 1
                _STATE["engine_samples"] += len(results)
                return results

            self.rollouts.generate = generate

    return SpecGRPOTrainerUnderTest


SpecGRPOTrainerUnderTest = _spec_subclass() if ARM == "spec" else None


def pytest_collection_modifyitems(session, config, items):
    if ARM != "spec":
        return
    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        if hasattr(module, "GRPOTrainer"):
            module.GRPOTrainer = SpecGRPOTrainerUnderTest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    for key in _STATE:
        _STATE[key] = 0
    yield
    if ENGINE_LOG:
        with open(ENGINE_LOG, "a") as f:
            f.write(json.dumps({"nodeid": item.nodeid, "arm": ARM, **_STATE}) + "\n")


class HarnessTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise HarnessTimeout(f"harness per-test limit of {TIMEOUT_S}s exceeded")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if TIMEOUT_S > 0:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(TIMEOUT_S)
    try:
        yield
    finally:
        if TIMEOUT_S > 0:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)


def _exception_chain_text(excinfo) -> str:
    parts, seen, exc = [], set(), excinfo.value
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        stack += [e.__cause__, e.__context__]
    return "\n".join(parts)


def unbuilt_reason(text: str) -> str | None:
    """The skip reason when `text` (an exception chain) names a repo id that was not built offline."""
    for repo_id, reason in UNBUILT.items():
        if repo_id in text:
            return f"{UNBUILT_PREFIX}{repo_id} ({reason})"
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is None or report.outcome != "failed" or call.excinfo.errisinstance(pytest.skip.Exception):
        return
    reason = unbuilt_reason(_exception_chain_text(call.excinfo))
    if reason is not None:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {reason}")
