"""The n-gram and suffix drafters propose exactly the drafts they proposed before their lookups were made faster
(recorded in tests/rollout/speculation/drafts_golden.py: chains and trees, every anchor length, siblings, history,
the global window, budgets 0-6)."""
import json

import pytest

from tests.rollout.speculation.drafts_golden import DRAFTERS, GOLDEN, replay


@pytest.mark.parametrize("name, overrides", DRAFTERS, ids=[f"{n}-{json.dumps(kw)}" for n, kw in DRAFTERS])
def test_drafts_are_the_recorded_ones(name, overrides):
    want = json.loads(GOLDEN.read_text())[f"{name} {json.dumps(overrides, sort_keys=True)}"]
    got = json.loads(json.dumps(replay(name, overrides)))  # tuples as lists, as recorded
    drafts = [d for call in want for d in call]
    assert sum(1 for d in drafts if d[0]) > len(drafts) // 4  # the run drafted: matches were found
    assert any(d[1] != list(range(-1, len(d[1]) - 1)) for d in drafts)  # and trees branched
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"propose call {i}: drafts changed"
    assert len(got) == len(want)
