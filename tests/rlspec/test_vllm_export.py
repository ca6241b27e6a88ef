"""An exported drafter loads and runs in vLLM as an EAGLE-3 speculator (skipped without vLLM and CUDA).

The drafter is untrained (random weights), so this checks the format, not the acceptance rate.
"""
from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.gpu]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM needs a CUDA device")
def test_vllm_loads_and_runs_the_exported_drafter(smollm2_dir, tmp_path):
    import transformers as tf

    from rlspec.export import export_drafter
    from rollout.spec.drafters.eagle3_model import Eagle3Config, Eagle3Model
    from rollout.runtime.model.config import ModelConfig

    cfg = ModelConfig.from_hf(tf.AutoConfig.from_pretrained(smollm2_dir))
    torch.manual_seed(0)
    drafter = Eagle3Model(Eagle3Config.for_target(cfg, draft_vocab_size=4096))
    drafter.set_draft_vocab(torch.arange(4096))  # Vd < V, so d2t is written and read
    out = export_drafter(drafter, str(tmp_path / "eagle3"), target=smollm2_dir)

    llm = vllm.LLM(model=smollm2_dir, dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.3,
                   enforce_eager=True,
                   speculative_config={"method": "eagle3", "model": out, "num_speculative_tokens": 3})
    params = vllm.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(["The capital of France is"], params)
    assert len(outputs[0].outputs[0].token_ids) == 16
