"""Moving tensors into an in-process vLLM and reading its speculation counters.

The functions passed to `collective_rpc` run on vLLM's worker with the worker as first argument; in
process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker) the tensor list is handed over by reference.
Both models take HF-named tensors through vLLM's in-place reload (model_loader/reload): a plain
`model.load_weights` after start-up, as TRL's colocate mode calls it, fails on vLLM's CPU build, whose
post-load processing replaces the parameters it would write (they lose their weight loaders); the reload
restores them layer by layer, loads, and processes again. The drafter's names are those of the exported
EAGLE-3 file, which vLLM's draft model loads at start-up.
"""
from __future__ import annotations

# vLLM's Prometheus-style counters for speculation (cumulative since the engine started)
COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
            "accepted": "vllm:spec_decode_num_accepted_tokens"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"  # a vector: one count per draft position


def _load_policy(worker, named) -> int:
    worker.model_runner.reload_weights(weights_iterator=iter(named))
    _repack_cpu_gemms(worker.model_runner.get_model())
    return len(named)


def _repack_cpu_gemms(model) -> None:
    """vLLM's CPU build packs the lm_head's weight into a GEMM handle at load time and keeps the weight
    too. A tied lm_head is never reloaded (its weight is the embedding's, which the reload updates in
    place), so its handle would go on computing logits with the old weights: pack again every layer that
    kept a weight beside its handle (layers whose weight was dropped were packed by the reload itself)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in model.modules():
        w = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and w is not None and w.ndim == 2 and w.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def _load_draft(worker, named) -> int:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    runner = worker.model_runner
    draft = runner.get_draft_model()
    if draft is None:
        raise RuntimeError("vLLM has no draft model to update: the backend was built without eagle3 speculation")
    initialize_layerwise_reload(draft)
    draft.load_weights(iter(named))
    finalize_layerwise_reload(draft, runner.vllm_config.speculative_config.draft_model_config)
    _repack_cpu_gemms(draft)
    return len(named)


def load_policy(llm, named: list) -> None:
    """The policy's tensors (HF names) into vLLM's model; its prefix cache held KV of the old weights."""
    llm.collective_rpc(_load_policy, args=(named,))
    llm.reset_prefix_cache()


def load_drafter(llm, named: list) -> None:
    """A learned drafter's tensors (exported names) into vLLM's draft model."""
    llm.collective_rpc(_load_draft, args=(named,))
    llm.reset_prefix_cache()


def spec_counters(llm) -> dict:
    """drafts / draft_tokens / accepted so far (0 without speculation), and per_pos: accepted drafts at
    each draft position (cumulative since vLLM started)."""
    out: dict = dict.fromkeys(COUNTERS, 0.0)
    out["per_pos"] = []
    names = {v: k for k, v in COUNTERS.items()}
    for m in llm.get_metrics():
        if m.name in names and hasattr(m, "value"):
            out[names[m.name]] += float(m.value)
        elif m.name == PER_POS and hasattr(m, "values"):
            vals = [float(v) for v in m.values]
            out["per_pos"] = [a + b for a, b in zip(vals, out["per_pos"] + [0.0] * len(vals))]
    return out
