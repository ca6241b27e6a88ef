"""rollout.backend = "vllm": rollouts from an in-process (colocated) vLLM, behind the RolloutBackend protocol.

Nothing here imports vLLM at module level: `spec_map` is plain Python (the SpecConfig -> vLLM mapping and
the fixed selector's depth table), and `backend` imports vLLM only when a backend is built, so the main
environment (which has no vLLM) can import, configure and test the mapping. The backend itself runs in
the separate environment `make vllm-venv` builds (docs/vllm_backend.md).
"""
