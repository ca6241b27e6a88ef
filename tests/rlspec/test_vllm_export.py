"""rlspec's EAGLE-3 export in vLLM (method eagle3) on the embedded SmolLM2-135M, on CPU or GPU.

vLLM loads the exported directory and speculates with it, losslessly (greedy tokens equal with a
useless and a useful drafter), and a drafter trained by a short warm start (rlspec's own, cached per
model under $RLSPEC_CACHE/drafters: the first run trains it for up to WARM_S seconds, later runs load
it) is accepted well above an untrained one. Runs in `make test-vllm` (.venv-vllm); skipped without vLLM.
"""
from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip("vllm", reason="the export check runs in the environment `make vllm-venv` builds")
torch = pytest.importorskip("torch")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

pytestmark = pytest.mark.slow

WARM_S = 180.0  # the warm start's budget when nothing is cached (what `rlspec.train` spends by default)
K = 3  # drafted tokens per verify
PROMPTS, TOKENS = 4, 40  # greedy completions compared: few, vLLM on 2 shared CPU cores is slow


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    """Chat prompts of the embedded math task, the distribution the warm start trains on."""
    from transformers import AutoTokenizer

    from rlspec.trainers.data import make_math_dataset, prompt_token_ids

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return prompt_token_ids(tok, make_math_dataset(64, seed=0)["prompt"])


@pytest.fixture(scope="module")
def untrained_drafter(smollm2_dir, tmp_path_factory):
    """A random drafter through rlspec's exporter, with a draft vocabulary smaller than the target's (d2t)."""
    import transformers as tf

    from rlspec.export import export_drafter
    from rlspec.rollout.runtime.model.config import ModelConfig
    from rlspec.rollout.speculation.drafters.eagle3_model import Eagle3Config, Eagle3Model

    cfg = ModelConfig.from_hf(tf.AutoConfig.from_pretrained(smollm2_dir))
    torch.manual_seed(0)
    drafter = Eagle3Model(Eagle3Config.for_target(cfg, draft_vocab_size=4096))
    drafter.set_draft_vocab(torch.arange(4096))
    return export_drafter(drafter, str(tmp_path_factory.mktemp("untrained") / "eagle3"), target=smollm2_dir)


@pytest.fixture(scope="module")
def trained_drafter(smollm2_dir, prompts, tmp_path_factory):
    """rlspec's warm-started drafter for SmolLM2 (cached), re-exported through rlspec.export."""
    from rlspec.export import export_drafter
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.speculation.training.warm_start import warm_start
    from rlspec.rollout.types import SpecConfig

    engine = RolloutEngine.from_pretrained(smollm2_dir, spec=SpecConfig(drafter="eagle3", online_training=False),
                                           dtype="bfloat16", max_num_seqs=16)
    result = warm_start(engine, prompts, budget_s=WARM_S, group=4, max_new_tokens=128, use_tqdm=False)
    engine.close()
    return export_drafter(result.path, str(tmp_path_factory.mktemp("trained") / "eagle3"), target=smollm2_dir)


def speculate(model_dir: str, drafter_dir: str, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    """(vLLM's accepted length per verify, greedy completions) with the drafter at K tokens per step."""
    from rlspec.rollout.vllm_backend.weights import spec_counters

    llm = vllm.LLM(model=model_dir, dtype="float32", max_model_len=512, enforce_eager=True, max_num_seqs=PROMPTS,
                   kv_cache_memory_bytes=2**29, disable_log_stats=False, seed=0,
                   speculative_config={"method": "eagle3", "model": drafter_dir, "num_speculative_tokens": K})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        vllm.SamplingParams(temperature=0.0, max_tokens=TOKENS), use_tqdm=False)
    c = spec_counters(llm)
    assert c["drafts"] > 0, "vLLM never drafted with the exported drafter"
    del llm
    return 1.0 + c["accepted"] / c["drafts"], [list(o.outputs[0].token_ids) for o in outs]


def test_vllm_speculates_with_rlspec_exports_and_a_trained_one_is_accepted(smollm2_dir, prompts, untrained_drafter,
                                                                          trained_drafter):
    cold_len, cold_out = speculate(smollm2_dir, untrained_drafter, prompts[:PROMPTS])
    warm_len, warm_out = speculate(smollm2_dir, trained_drafter, prompts[:PROMPTS])
    print(f"vLLM accepted length per verify (k={K}, greedy): untrained {cold_len:.3f}, trained {warm_len:.3f}")
    assert warm_out == cold_out  # lossless: the drafter changes speed, never the (greedy) tokens
    assert cold_len < 1.2  # a random drafter is (almost) never right
    assert warm_len > cold_len + 0.4, f"trained drafter accepted {warm_len:.3f} vs untrained {cold_len:.3f}"
