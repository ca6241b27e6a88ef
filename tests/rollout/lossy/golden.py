"""Today's lossless rollouts, recorded: the lossy modes must leave them bit-for-bit alone when off.

`lossless_runs()` samples a tiny random model at temperature 1 with a fixed seed, once without
speculation and once with a scripted drafter verified exactly (accepts, rejections, residual draws).
`python -m tests.rollout.lossy.golden` wrote tests/rollout/lossy/lossless_golden.json from the code
before the lossy modes existed; test_lossless_unchanged.py compares every later run against it.
"""
from __future__ import annotations

import json
from pathlib import Path

GOLDEN = Path(__file__).with_name("lossless_golden.json")


def lossless_runs(**spec_fields) -> dict[str, list[dict]]:
    """{"plain": [...], "spec": [...]}: completion ids and logprobs per sample; spec_fields go to SpecConfig."""
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.model import loader
    from rlspec.rollout.speculation.selectors.base import Arm
    from rlspec.rollout.types import SamplingParams, SpecConfig
    from tests.conftest import TINY_VOCAB, make_tiny_hf, random_prompts
    from tests.rollout.spec_helpers import ScriptedDrafter

    hf = make_tiny_hf("llama", seed=5)
    prompts = random_prompts(4, 3, 12, seed=5)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=7)
    out = {}
    for name in ("plain", "spec"):
        spec = SpecConfig(drafter="ngram" if name == "spec" else "none", num_draft_tokens=4, **spec_fields)
        drafter = ScriptedDrafter(TINY_VOCAB, None, corrupt=0.3, seed=1) if name == "spec" else None
        eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2], drafter=drafter)
        if name == "spec":
            eng.speculation.force(Arm("scripted", 4, 1))
        out[name] = [{"ids": r.completion_ids, "logprobs": r.logprobs, "extra": r} for r in eng.generate(prompts, params)]
    return out


if __name__ == "__main__":
    runs = lossless_runs()
    GOLDEN.write_text(json.dumps({k: [{"ids": r["ids"], "logprobs": r["logprobs"]} for r in v]
                                  for k, v in runs.items()}))
    print("wrote", GOLDEN)
