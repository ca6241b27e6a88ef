"""Drafter health (rollout/speculation/drafter_health.py), plain Python: a push read back and compared, acceptance
that collapses after a sync turning speculation off, probes turning it back on; faults injected into a real
EAGLE-3 drafter's weights (a dropped tensor, random weights, a bf16 holder that must still pass)."""
from __future__ import annotations

import pytest
import torch

from rlspec.rollout.runtime.model.config import ModelConfig
from rlspec.rollout.speculation.drafter_health import DrafterHealth, HealthConfig, compare, fingerprint
from rlspec.rollout.speculation.drafters.eagle3_model import Eagle3Config, Eagle3Model
from tests.conftest import make_tiny_hf


@pytest.fixture(scope="module")
def drafter_state():
    cfg = ModelConfig.from_hf(make_tiny_hf("llama").config)
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in Eagle3Model(Eagle3Config.for_target(cfg)).state_dict().items()}


def health(**kw) -> DrafterHealth:
    return DrafterHealth(HealthConfig(floor=0.2, min_verifies=10, probe_every=3, **kw))


def test_an_intact_push_passes_even_from_a_bf16_holder(drafter_state):
    h = health()
    held = {k: v.to(torch.bfloat16) for k, v in drafter_state.items()}  # a GPU holder's precision
    assert h.pushed(1, fingerprint(drafter_state), {"worker 0": fingerprint(held)})
    assert h.on and h.metrics()["drafter/health/bad_pushes"] == 0


def test_a_push_that_drops_a_tensor_turns_speculation_off(drafter_state):
    h = health()
    name = sorted(drafter_state)[0]
    dropped = {k: v for k, v in drafter_state.items() if k != name}
    assert not h.pushed(2, fingerprint(drafter_state), {"worker 0": fingerprint(drafter_state),
                                                        "worker 1": fingerprint(dropped)})
    assert not h.on and f"worker 1: {name}: sent, not held" in h.reason and "worker 0" not in h.reason
    assert h.metrics()["drafter/health/bad_pushes"] == 1 and h.metrics()["drafter/health/turned_off"] == 1
    assert not h.speculate()  # the next rollout decodes plainly


def test_a_drafter_replaced_by_random_weights_is_caught_by_totals_too(drafter_state):
    """vLLM renames and fuses tensors (q/k/v into one): compared by totals, random weights still differ."""
    torch.manual_seed(1)
    scrambled = {k: torch.randn_like(v) * v.std().clamp_min(1e-3) if v.is_floating_point() else v
                 for k, v in drafter_state.items()}
    sent = fingerprint(drafter_state)
    fused = {"fused": torch.cat([v.flatten() for v in drafter_state.values()])}  # one tensor of the same values
    assert compare(sent, fingerprint(fused), by_name=False) == []
    assert compare(sent, fingerprint(scrambled), by_name=False)
    h = health()
    assert not h.pushed(3, sent, {"vllm": fingerprint(scrambled)}, by_name=False)
    assert not h.on


def test_collapse_after_a_sync_turns_off_and_a_probe_brings_it_back():
    h = health()
    h.observe(verifies=20, drafted=40, accepted=30)  # 0.75 per token: healthy
    assert h.on and h.speculate()
    h.synced(5)
    h.observe(verifies=4, drafted=8, accepted=0)  # too few verifies for a verdict
    assert h.on
    h.observe(verifies=8, drafted=16, accepted=1)  # 12 verifies, 1/24 per token: collapsed
    assert not h.on and "policy sync v5" in h.reason and h.metrics()["drafter/health/turned_off"] == 1
    # off: two plain rollouts, then the third is a probe; a probe that still fails keeps it off
    assert [h.speculate(), h.speculate(), h.speculate()] == [False, False, True]
    h.observe(verifies=12, drafted=24, accepted=2)
    assert not h.on and not h.speculate()
    # a verified push makes the next rollout a probe at once; the fresh drafter recovers
    state = {"w": torch.ones(3)}
    assert h.pushed(7, fingerprint(state), {"w0": fingerprint(state)})
    assert h.speculate() and h.probing
    h.observe(verifies=12, drafted=24, accepted=12)
    assert h.on and h.speculate()
    m = h.metrics()
    assert m["drafter/health/recovered"] == 1 and m["drafter/health/probes"] == 2 and m["drafter/health/ok"] == 1


def test_not_enforced_it_judges_and_warns_but_keeps_speculating(caplog):
    h = health(enforce=False)
    h.observe(verifies=20, drafted=40, accepted=0)
    assert not h.on and h.speculate()  # a forced arm stays on
    assert "speculation stays on" in caplog.text


def test_a_tensor_that_missed_one_small_update_is_caught_in_float32(drafter_state):
    """A push whose fc.weight never arrived leaves the previous values in use, a small step away."""
    sent = {k: v + 1e-4 * torch.randn_like(v) if v.is_floating_point() else v for k, v in drafter_state.items()}
    held = {**sent, "fc.weight": drafter_state["fc.weight"]}
    assert compare(fingerprint(sent), fingerprint(held)) == [
        f"fc.weight: values differ (sum {fingerprint(sent)['fc.weight'][1]:.6g} sent, "
        f"{fingerprint(held)['fc.weight'][1]:.6g} held)"]
