"""Shared fixtures: tiny random-weight Llama/Qwen2/Qwen3 models (fast) and the embedded SmolLM2 (real)."""
from __future__ import annotations

import os
from pathlib import Path

# Under pytest-xdist (`make test` runs two workers on two cores) each worker computes on one thread: two workers
# of two OpenMP threads each oversubscribe the cores, and OpenMP's spinning then slows every step many times over.
# Set before torch loads; subprocesses a test starts inherit it.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU, Triton's kernels (model/paged_decode.py) run on CPU tensors through its interpreter, which must
# be on before triton is first imported (torch does not import it on a CPU).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# there every load and store of a kernel launch must lie inside the launch's tensors (tests/triton_bounds.py); a test
# whose kernels reached past one fails (`_triton_in_bounds`)
_bounds = None
if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        from tests import triton_bounds as _bounds

        _bounds.install()
    except ImportError:  # no triton: nothing is interpreted
        _bounds = None

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every engine times its own calibration: a table cached by an earlier test (or run) would make a test's
# arm choices depend on what ran before it (rollout/speculation/calibration_cache.py)
os.environ["RLSPEC_CALIBRATION_CACHE"] = "off"

TINY_VOCAB = 96


def make_tiny_hf(kind: str = "llama", seed: int = 0, tie: bool = False, vocab: int = TINY_VOCAB, **overrides):
    """A 2-layer random model of the given layout, float32. Weights are drawn wide (std 0.1) so that
    logits are peaked and greedy argmaxes are far from ties. overrides: config fields (head_dim=32, ...)."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.1, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[kind]
    extra = {"head_dim": 16} if kind == "qwen3" else {}
    extra.update(overrides)
    torch.manual_seed(seed)
    model = cls[1](cls[0](**{**common, **extra})).float().eval()
    if kind == "qwen2":  # random init leaves biases at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    return model


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """The slowest tests first, dealt to the xdist workers so that both end together (tests/schedule.py)."""
    from tests.schedule import order

    items[:] = order(items, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


@pytest.fixture(autouse=True)
def _triton_in_bounds():
    yield
    if _bounds is not None:
        bad = _bounds.take()
        assert not bad, "a Triton kernel reached outside its tensors:\n" + "\n".join(bad[:5])


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def tiny_hf(request):
    return make_tiny_hf(request.param)


def random_prompts(n: int, lo: int = 3, hi: int = 20, seed: int = 0, vocab: int = TINY_VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (n_,), generator=g).tolist() for n_ in lens]


def cache_with_the_machines_kernels(cache: Path) -> Path:
    """A fresh RLSPEC_CACHE at `cache` (for a test whose drafter warm start or calibration must start cold) whose
    kernels/ is the machine's: the fused CPU kernels are built once per machine (~20 s of C++), and a
    bf16 engine in a process that has not loaded them yet would otherwise build them again into `cache`. The build's
    own lock and trust checks apply as ever (the link resolves to the machine's private directory)."""
    from rlspec.rollout.runtime.model.fetch import cache_root
    from rlspec.rollout.runtime.model.kernels.trust import make_private_dirs

    shared = cache_root() / "kernels"
    make_private_dirs(shared)
    cache.mkdir(parents=True)
    (cache / "kernels").symlink_to(shared, target_is_directory=True)
    return cache


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded real model, converted once into the cache (see rollout/model/fetch.py)."""
    from rlspec.rollout.runtime.model.fetch import fetch_model

    return fetch_model("smollm2-135m-instruct")


@pytest.fixture
def dynamo_only(monkeypatch):
    """torch.compile without inductor's code generation (dynamo's "eager" backend) for this test: dynamo still
    traces, guards, recompiles and counts frames as it does for the real backend, which is what tests of when
    steps compile look at; each graph then costs milliseconds where inductor's costs seconds of C++. Tests of
    what compiled code computes (test_compiled.py, the law's compiled case) keep inductor."""
    from rlspec.rollout.runtime import compiled
    from rlspec.rollout.runtime.model import attention

    real = torch.compile
    # the compiled calls (layers, FlexAttention) are built afresh through the patch, and dropped afterwards
    monkeypatch.setattr(compiled, "_LAYER_CALLS", {})
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kw: real(fn, **{**kw, "backend": "eager"}))
    attention._compiled_flex.cache_clear()
    yield
    attention._compiled_flex.cache_clear()
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Code a test runs in this process may change torch's thread count (a benchmark's 2-thread arm): the tests
    after it on this xdist worker get the count back, since two workers of two threads each oversubscribe the two
    cores and every later step then takes many times as long."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _isolate_wandb():
    """W&B keeps process-wide state (its settings singleton, WANDB_* variables set by our CLI):
    restore both after every test so one test's offline run directory never captures the next's."""
    import sys

    saved = {k: v for k, v in os.environ.items() if k.startswith("WANDB_")}
    yield
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()
        wandb.teardown()
    for k in [k for k in os.environ if k.startswith("WANDB_")]:
        del os.environ[k]
    os.environ.update(saved)
