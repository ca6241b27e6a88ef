"""The sections of the device check (`python -m rlspec.bench gpu`, rlspec/bench/gpu.py): CUDA tests with
per-test timeouts (tests.py), plain decode against transformers (plain.py), the cost of speculation
(spec_costs.py), rollouts with a drafter of known acceptance (oracle.py) and GRPO steps (grpo.py).
Shapes, model building and timing they share: common.py."""
