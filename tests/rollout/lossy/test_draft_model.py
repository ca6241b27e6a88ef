"""step_source=draft_model=<dir>: a smaller model with the target's tokenizer writes whole steps."""
import math

import pytest

from rlspec.rollout.lossy.judge import ROUTED, TARGET
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.trainers.conftest import build_char_tokenizer, build_tiny_llama


# transformers 5.24 renamed forward's past_key_values to cache, and drops the old name in 5.40 (loader.hf_cache_arg)
@pytest.mark.filterwarnings("error:`past_key_values` is deprecated:FutureWarning")
def test_draft_model_writes_greedy_steps_recorded_as_point_masses(tmp_path):
    """A routed step is the draft model's argmax chain, so given the context it is emitted with
    probability 1 (behaviour log 1 = 0): both samples of a prompt open with the same kept step."""
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.model import loader

    tok = build_char_tokenizer()
    target = build_tiny_llama(len(tok), tok.eos_token_id, tok.pad_token_id, seed=0)
    draft = build_tiny_llama(len(tok), tok.eos_token_id, tok.pad_token_id, seed=1)
    draft.save_pretrained(tmp_path / "draft")
    tok.save_pretrained(tmp_path / "draft")
    spec = SpecConfig(step_routing="arbitrage", step_source=f"draft_model={tmp_path / 'draft'}", step_max_tokens=6,
                      route_threshold=-50.0, accept_off_policy=True)  # keep every drafted step
    eng = RolloutEngine(loader.from_hf_model(target), tok, spec=spec, eos_token_ids=[tok.eos_token_id])
    prompts = [tok.encode("12+3=")[:5], tok.encode("ab\n")]
    results = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=20, n=2, seed=3))
    routed = 0
    for r in results:
        for src, lp, blp in zip(r.token_source, r.logprobs, r.behaviour_logprobs):
            assert src in (TARGET, ROUTED)
            if src == ROUTED:  # a kept greedy step: a point mass given the context
                routed += 1
                assert blp == 0.0 and lp < 0
            else:
                assert blp == lp
    assert routed > 0
    for r in results:  # each routed run is the draft model's argmax continuation of its context
        start = r.token_source.index(ROUTED) if ROUTED in r.token_source else None
        if start is not None:
            end = start + next((i for i, s in enumerate(r.token_source[start:]) if s != ROUTED), 0)
            run = r.completion_ids[start:end] if end > start else r.completion_ids[start:]
            assert run == _argmax_chain(draft, r.prompt_ids + r.completion_ids[:start], len(run))
    stats = eng.stats()
    assert stats["rollout/steps_kept"] == stats["rollout/steps_routed"] > 0
    assert stats["rollout/is_ratio/lossy_mean"] != 1.0 and math.isfinite(stats["rollout/is_ratio/max"])


def _argmax_chain(model, ids: list[int], n: int) -> list[int]:
    import torch

    out = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out
