"""Moving tensors into an in-process vLLM and reading its speculation counters.

The functions passed to `collective_rpc` run on vLLM's worker with the worker as first argument; in
process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker) the tensor list is handed over by reference.
Both models take HF-named tensors through their own `load_weights`, as TRL's colocate mode does for the
policy; the drafter's names are those of the exported EAGLE-3 file, which vLLM's draft model loads.
"""
from __future__ import annotations

# vLLM's Prometheus-style counters for speculation (cumulative since the engine started)
COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
            "accepted": "vllm:spec_decode_num_accepted_tokens"}


def _load_policy(worker, named) -> int:
    worker.model_runner.get_model().load_weights(iter(named))
    return len(named)


def _load_draft(worker, named) -> int:
    draft = worker.model_runner.get_draft_model()
    if draft is None:
        raise RuntimeError("vLLM has no draft model to update: the backend was built without eagle3 speculation")
    draft.load_weights(iter(named))
    return len(named)


def load_policy(llm, named: list) -> None:
    """The policy's tensors (HF names) into vLLM's model; its prefix cache held KV of the old weights."""
    llm.collective_rpc(_load_policy, args=(named,))
    llm.reset_prefix_cache()


def load_drafter(llm, named: list) -> None:
    """A learned drafter's tensors (exported names) into vLLM's draft model."""
    llm.collective_rpc(_load_draft, args=(named,))
    llm.reset_prefix_cache()


def spec_counters(llm) -> dict[str, float]:
    """drafts / draft_tokens / accepted so far (0 without speculation)."""
    out = dict.fromkeys(COUNTERS, 0.0)
    names = {v: k for k, v in COUNTERS.items()}
    for m in llm.get_metrics():
        if m.name in names and hasattr(m, "value"):
            out[names[m.name]] += float(m.value)
    return out
