"""DrafterHost: an rlspec RolloutEngine beside vLLM, for what only rlspec has.

vLLM decodes the rollouts; this engine (a second copy of the policy, no rollouts of its own) supplies
- the cost model: calibrated on the policy here, it turns the long-tail selector into vLLM's
  per-batch-size depth table (docs/vllm_backend.md#the-depth-table);
- the learned EAGLE-3 drafter: loaded from drafter_path or created cold, warmed on the policy's own
  rollouts (they need the target's hidden states, which vLLM does not hand out), exported in the
  format vLLM loads, and versioned so the backend pushes each new version into vLLM's draft model.
"""
from __future__ import annotations

from pathlib import Path

from rollout.types import SpecConfig
from rollout.vllm_backend.spec_map import DepthTable, depth_table


class DrafterHost:
    def __init__(self, engine, spec: SpecConfig):
        self.engine = engine
        self.spec = spec

    @classmethod
    def build(cls, policy, tokenizer, spec: SpecConfig, **engine_kwargs) -> "DrafterHost | None":
        """A host when the spec needs one: a learned drafter, or a depth table (selector fixed); else None."""
        if not spec.enabled or (spec.selector != "fixed" and spec.drafter != "eagle3"):
            return None
        from rollout.engine import RolloutEngine

        return cls(RolloutEngine.from_hf_model(policy, tokenizer, spec, **engine_kwargs), spec)

    @property
    def learned(self) -> bool:
        return self.engine.has_learned_drafter

    def version(self) -> int:
        return self.engine.speculation.version()

    def depth_table(self) -> DepthTable | None:
        """The long-tail selector's depth at every batch-size bucket, from forwards timed on the policy
        (one calibration, the engine's own); None when the selector is not the long-tail one."""
        if self.spec.selector != "fixed":
            return None
        engine = self.engine
        sel = engine.speculation.selector
        cache = engine.runner.ensure_cache(engine.max_num_seqs, engine.max_model_len, engine.speculation.extra_kv_layers)
        engine.speculation.calibrate(engine.runner, cache.rows, cache.length)
        engine.release_kv()  # the table is all we keep of the calibration

        def choose(batch: int) -> int:
            sel.on = False  # no hysteresis across buckets: each is judged on its own costs
            return sel.choose(batch).depth

        return depth_table(choose, engine.max_num_seqs, self.spec.max_spec_batch)

    def drafter_tensors(self) -> list:
        """The learned drafter's newest weights under the names of the exported file (what vLLM loads)."""
        import torch

        from rollout.speculation.drafters.eagle3_io import drafter_tensors

        spec = self.engine.speculation
        model = spec.trainer.model if spec.trainer is not None else spec.learned.network()
        return list(drafter_tensors(model, torch.float32).items())

    def export(self, path: str | Path, metadata: dict | None = None) -> str:
        return self.engine.export_drafter(str(path), metadata)

    def warm_start(self, prompts, **kwargs):
        result = self.engine.warm_start_drafter(prompts, **kwargs)
        self.engine.release_kv()  # its rollouts are over; vLLM's are the run's
        return result

    def load_weights(self, named) -> None:
        self.engine.load_weights(named)

    def close(self) -> None:
        self.engine.close()
