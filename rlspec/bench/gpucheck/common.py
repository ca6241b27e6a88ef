"""What the device check's sections share: the random-weight model shapes, building a transformers model of a
shape straight on the device (no hub, no download: a step's time does not depend on the weights' values), the
engine over it, random prompts; timing that waits for the device is bench/common.py's (DeviceTimer).

torch and transformers are imported inside the helpers: the check's parent process only starts children."""
from __future__ import annotations

from rlspec.bench.common import time_steps, timed_on as timed  # noqa: F401  (the one device timer, re-exported)

# transformers config fields of each shape; `tiny` is the CPU rehearsal's
SHAPES = {
    "smollm2-135m": ("LlamaConfig", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                         tie_word_embeddings=True, rope_theta=100000.0)),
    "qwen2.5-7b": ("Qwen2Config", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                       tie_word_embeddings=False, rope_theta=1000000.0)),
    # SmolLM2-135M's shape with untied embeddings: make_greedy_stable needs them (the e2e section)
    "smollm2-135m-untied": ("LlamaConfig", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                                tie_word_embeddings=False, rope_theta=100000.0)),
    "tiny": ("LlamaConfig", dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)),
}


def device_and_dtype(smoke: bool):
    """(device, dtype): CUDA in bf16 where there is one; the rehearsal on a CPU runs float32 (bf16 CPU kernels
    would time another code path than the one a GPU takes, and float32 compiles nothing)."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    if not smoke:
        raise SystemExit("CUDA is unavailable: run the device check on an NVIDIA GPU, or its CPU rehearsal "
                         "with --smoke (make gpu-rehearsal)")
    return torch.device("cpu"), torch.float32


def build_hf(shape: str, dtype, device, vocab: int | None = None, seed: int = 0):
    """A transformers model of `shape` with random weights, built in `dtype` on `device` (no float32 copy of a
    7B model on the way); vocab overrides the shape's (a carried tokenizer's size). EOS off: every sequence
    runs its full length, as the engine's rows do with ignore_eos."""
    import torch
    import transformers

    cls_name, fields = SHAPES[shape]
    fields = {**fields, **({"vocab_size": vocab} if vocab else {})}
    cfg = getattr(transformers, cls_name)(**fields, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    old = torch.get_default_dtype()
    torch.manual_seed(seed)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(old)
    hf.generation_config.eos_token_id = None
    return hf.eval()


def make_greedy_stable(hf, seed: int = 0):
    """Give a random-weight model a greedy choice that bf16 cannot flip: the next token is a fixed permutation of
    the current one, by a logit margin of ~sqrt(hidden) against noise of ~1. Random layers have near-flat logits
    (the top two of 152k tokens within bf16's rounding), so a verify of T rows and a decode step of one, which
    sum in other orders, pick different tokens and a recorded greedy continuation stops matching after a few
    steps. Here the embedding dominates the residual stream (the layers add ~2 per element, the embedding ~200),
    and lm_head row v is the unit embedding of the token that maps to v. Values only: shapes, kernels and step
    times are those of the random model. Returns the successor table [V] (the greedy token after each token)."""
    import torch

    emb, head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
    if emb.data_ptr() == head.data_ptr():
        raise ValueError("make_greedy_stable needs untied input and output embeddings")
    g = torch.Generator(emb.device).manual_seed(seed)
    with torch.no_grad():
        table = torch.randn(emb.shape, generator=g, device=emb.device)
        perm = torch.randperm(len(table), generator=torch.Generator().manual_seed(seed)).to(emb.device)
        emb.copy_(200 * table)
        head.copy_(torch.nn.functional.normalize(table, dim=-1)[perm])
    return torch.argsort(perm).cpu()  # logit v peaks where perm[v] is the current token


def engine_over(hf, device, dtype, max_seqs: int, max_len: int, spec=None, drafter=None):
    """A RolloutEngine over a copy of `hf`'s weights: graphs captured lazily, the KV pool kept between calls (the
    timed calls must not meet a new pool), eager layers (compiled ones recompile per pool size on CUDA)."""
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.model import loader

    model = loader.from_hf_model(hf, dtype, device)
    return RolloutEngine(model, None, spec, max_len, max_seqs, eos_token_ids=[-1], drafter=drafter,
                         graph_mode="lazy", free_kv_between_rollouts=False, compile_mode="off")


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n distinct random prompts of `length` tokens (ids from 3: clear of the specials)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def sync(device) -> None:
    """Wait for queued device work (a no-op on CPU)."""
    from rlspec.rollout.runtime.device import synchronize

    synchronize(device)


def release(device) -> None:
    """Hand the caching allocator's free blocks back between models (a no-op on CPU)."""
    import gc

    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


def fits(shape: str, batch: int, length: int, copies: int, device, dtype) -> str | None:
    """Why `copies` weight copies of `shape` plus the KV of `batch` rows of `length` do not fit in free device
    memory (None: they fit, or this is a CPU)."""
    if device.type != "cuda":
        return None
    import torch

    _, c = SHAPES[shape]
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    kv_dim = c["num_key_value_heads"] * h // c["num_attention_heads"]
    params = c["vocab_size"] * h * (1 if c["tie_word_embeddings"] else 2) + \
        layers * (2 * h * h + 2 * h * kv_dim + 3 * h * c["intermediate_size"])
    size = torch.finfo(dtype).bits // 8
    need = copies * params * size + 2 * 2 * batch * length * layers * kv_dim * size + 4 * 2**30
    free, _ = torch.cuda.mem_get_info(device)
    return None if need < free else f"needs ~{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"


def graph_captures(engine) -> int:
    """Graphs the engine captured so far: the target's step pool and the learned drafter's levels (0 eager)."""
    steps = getattr(engine.runner, "steps", None)
    n = getattr(steps, "counts", {}).get("captures", 0)
    learned = getattr(engine.speculation, "learned", None)
    graphs = getattr(learned, "_graphs", None)
    return n + (graphs.counts["captures"] if graphs is not None else 0)


def timed_calls(engine, fn, device, repeats: int) -> dict:
    """fn() (a generate call of `engine`) timed `repeats` times: the median seconds, every repetition's seconds,
    decode steps, graph captures and Triton compiles, the engine's stats of the last; `timed_captures` or
    `timed_compiles` > 0 flags a timed call that captured or compiled (its time then holds warm-ups and a capture,
    or a kernel's compile: no step's cost)."""
    import statistics

    from rlspec.bench.gpucheck import compiles as triton_compiles
    from rlspec.rollout.metrics import DECODE_STEPS

    seconds, steps, captures, compiles, value, stats = [], [], [], [], None, {}
    for _ in range(repeats):
        engine.stats()  # the counters restart: the stats after the call are this call's
        pool, before, compiled = engine.runner.steps, graph_captures(engine), triton_compiles.count()
        value, secs = timed(fn, device)
        seconds.append(secs)
        stats = engine.stats()
        steps.append(int(stats.get(DECODE_STEPS, 0)))
        # a new step pool (the KV pool was reallocated) starts counting again: all its captures are this call's
        captures.append(graph_captures(engine) - (before if engine.runner.steps is pool else 0))
        compiles.append(triton_compiles.count() - compiled)
    return dict(value=value, stats=stats, seconds=statistics.median(seconds), seconds_all=seconds, decode_steps=steps,
                captures=captures, timed_captures=sum(captures), compiles=compiles, timed_compiles=sum(compiles))


def median_time(run, iters: int, device, repeats: int) -> tuple[float, list[float]]:
    """Seconds per run() (after warm-up calls that capture), the median of `repeats` timings of `iters` calls."""
    import statistics

    times = [time_steps(run, iters, device, warmup=2 if i == 0 else 0) for i in range(repeats)]
    return statistics.median(times), times


def pdl_module():
    """rollout/runtime/model/pdl.py (programmatic dependent launch of our kernels) where Triton is installed (it
    imports triton), else None."""
    from rlspec.rollout.runtime.model import attention

    if not attention.triton_available():
        return None
    from rlspec.rollout.runtime.model import pdl

    return pdl
