"""With both lossy modes off, rollouts are bit-for-bit what they were before the modes existed."""
import json

import pytest

from tests.rollout.lossy.golden import GOLDEN, lossless_runs


@pytest.mark.parametrize("fields", [{}, {"verification": "exact", "step_routing": "off", "judge": "typical",
                                         "router": "learned", "route_threshold": 0.5}])
def test_modes_off_reproduce_recorded_rollouts(fields):
    """Recorded before the change (tests/rollout/lossy/golden.py): plain decoding and exact speculation
    with rejections and residual draws; lossy fields set but their modes off change nothing either."""
    want = json.loads(GOLDEN.read_text())
    got = lossless_runs(**fields)
    for name in ("plain", "spec"):
        assert [r["ids"] for r in got[name]] == [r["ids"] for r in want[name]]
        flat = lambda runs: [lp for r in runs for lp in r["logprobs"]]  # noqa: E731
        assert flat(got[name]) == pytest.approx(flat(want[name]), abs=1e-5)
        for r in got[name]:  # honest results, lossless: behaviour == target, no lossy source
            res = r["extra"]
            assert res.behaviour_logprobs == res.logprobs
            assert not any(res.lossy_mask())
    sources = {s for r in got["spec"] for s in r["extra"].token_source}
    assert sources == {0, 1}  # the scripted drafter's tokens were accepted (draft-exact) and the target's drawn
