"""runtime: what runs the target model, and nothing about speculation.

The Llama-family model and its loader (`model/`), the preallocated KV cache, the model runner
(batch description -> tensors -> forward, with the CUDA graph pool and its eager fallback),
sequences (plain-Python bookkeeping of one sample) and the logit processing every sampler shares.
It never imports `rlspec.rollout.speculation`: speculation builds on the runtime, not the other way round, so
plain decoding can be read, tested and optimised without knowing drafters exist.
"""
