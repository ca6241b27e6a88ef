"""rollout/runtime/model/kernels: every C++ op refuses a bad input with a RuntimeError naming it.

A table of cases: each op once with valid inputs (it must run), then with one input broken at a time (a slot or
block id past the pool, 1 << 40, negative ids, a mask of the wrong shape, a token id >= V, a negative draft
count, H = 0, KV = 0, a uniform outside [0, 1), a wrong dtype, device or layout). Each must raise a RuntimeError
whose message names what is wrong; an op that writes the KV pools (decoder_layer, draft_chain) must leave them
untouched. Unchecked, such inputs read or write outside a tensor (a segfault, SIGFPE, or silent heap corruption),
so the table runs in a subprocess, which reports each case before it runs it: a crash names the case and cannot
take pytest down."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

NB, BS, KV, D, HEADS, HID, INTER, V, VOCAB = 6, 16, 1, 32, 2, 64, 96, 50, 20
QKV = (HEADS + 2 * KV) * D
BIG = 1 << 40  # an id far past any pool: unchecked, a read or write there faults


def _bf(*shape):
    return (torch.randn(shape) * 0.3).bfloat16()


def _pack(n, k):
    from rlspec.rollout.runtime.model import kernels

    return kernels.pack(_bf(n, k))


def _mask(starts, T, S):
    """[B, 1, T, S] bool: row b's token t sees positions up to starts[b] + t (a chain)."""
    pos = torch.arange(S)
    return torch.stack([pos[None, :] <= (s + torch.arange(T))[:, None] for s in starts])[:, None]


def _linear():
    return dict(x=_bf(3, HID), w=_bf(40, HID), bias=_bf(40))


def _packed():
    return dict(x=_bf(3, HID), wp=_pack(40, HID), bias=_bf(40), N=40)


def _attention():
    return dict(q=_bf(2, HEADS, 2, D), k_pool=_bf(NB, BS, KV, D), v_pool=_bf(NB, BS, KV, D),
                blocks=torch.tensor([[1, 2], [3, 4]]), mask=_mask([10, 20], 2, 2 * BS), scale=D ** -0.5)


def _weights(k_in=HID):
    return dict(norm1=_bf(HID), qkv=_pack(QKV, k_in), qkv_bias=_bf(QKV), o=_pack(HID, HEADS * D), o_bias=_bf(HID),
                norm2=_bf(HID), gate_up=_pack(2 * INTER, HID), gate_up_bias=_bf(2 * INTER), down=_pack(HID, INTER),
                down_bias=_bf(HID), heads=HEADS, kv_heads=KV, inter=INTER, eps=1e-5, scale=D ** -0.5)


def _layer():
    return dict(x=_bf(1, 2, HID), cos=_bf(1, 2, 1, D), sin=_bf(1, 2, 1, D), k_pool=_bf(NB, BS, KV, D),
                v_pool=_bf(NB, BS, KV, D), slots=torch.tensor([[BS + 10, BS + 11]]), blocks=torch.tensor([[1, 2]]),
                mask=_mask([10], 2, 2 * BS), **_weights(), embeds=None, embed_norm=None)


def _eagle_layer():
    a = _layer()
    a.update(qkv=_pack(QKV, 2 * HID), qkv_bias=None, embeds=_bf(1, 2, HID), embed_norm=_bf(HID))
    return a


def _head():
    return dict(x=_bf(1, 2, HID), norm=_bf(HID), lm_head=_pack(VOCAB, HID), vocab=VOCAB, eps=1e-5)


def _sample():
    return dict(logits=torch.randn(3, V), r=torch.rand(3), temperature=1.0)


def _verify():
    return dict(logits=torch.randn(2, 3, V), tokens=torch.tensor([[3, 7], [0, V - 1]]), num=torch.tensor([2, 1]),
                q=torch.softmax(torch.randn(2, 2, V), -1), u=torch.rand(2, 2), r=torch.rand(2), temperature=1.0)


def _chain():
    w = _weights(2 * HID)
    return dict(h=_bf(1, HID), embed=_bf(V, HID), cos=_bf(2, 1, 1, 1, D), sin=_bf(2, 1, 1, 1, D),
                k_pool=_bf(NB, BS, KV, D), v_pool=_bf(NB, BS, KV, D), slots=torch.tensor([[BS + 10], [BS + 11]]),
                blocks=torch.tensor([[1, 2]]), masks=_mask([10, 11], 1, 2 * BS)[:, :, None],
                hidden_norm=w["norm1"], qkv=w["qkv"], o=w["o"], norm2=w["norm2"], gate_up=w["gate_up"],
                down=w["down"], embed_norm=_bf(HID), heads=HEADS, kv_heads=KV, inter=INTER, eps=1e-5,
                scale=D ** -0.5, head_norm=_bf(HID), lm_head=_pack(VOCAB, HID), vocab=VOCAB,
                ids=torch.arange(VOCAB) * 2, r=torch.rand(3, 1), temperature=1.0)


VALID = {"small_linear": _linear, "packed_linear": _packed, "paged_attention": _attention, "decoder_layer": _layer,
         "decoder_layer/eagle": _eagle_layer, "final_head": _head, "sample_rows": _sample,
         "verify_chain_rows": _verify, "draft_chain": _chain}
WRITES_POOLS = ("decoder_layer", "draft_chain")


def put(key, index, value):
    """A case's change: a[key][index] = value."""
    return lambda a: a[key].__setitem__(index, value)


def new(key, make):
    """A case's change: a[key] = make(a)."""
    return lambda a: a.__setitem__(key, make(a))


def _paged_cases(mask="mask"):
    """The bad pools, block ids and masks every op that reads the pool must refuse."""
    return [
        ("block id past the pool", put("blocks", (0, 1), NB), "blocks"),
        ("block id 1 << 40", put("blocks", (0, 0), BIG), "blocks"),
        ("negative block id", put("blocks", (0, 1), -1), "blocks"),
        ("int32 block ids", new("blocks", lambda a: a["blocks"].int()), "blocks"),
        ("mask one position short", new(mask, lambda a: a[mask][..., :-1].contiguous()), "mask"),
        ("float mask", new(mask, lambda a: a[mask].float()), "mask"),
        ("v_pool smaller than k_pool", new("v_pool", lambda a: a["v_pool"][:-1].clone()), "v_pool"),
        ("non-contiguous k_pool", new("k_pool", lambda a: a["k_pool"].transpose(0, 1).contiguous().transpose(0, 1)),
         "contiguous"),
    ]


def _layer_cases():
    return _paged_cases() + [
        ("slot past the pool", put("slots", (0, 1), NB * BS), "slots"),
        ("slot 1 << 40", put("slots", (0, 0), BIG), "slots"),
        ("negative slot", put("slots", (0, 1), -1), "slots"),
        ("float slots", new("slots", lambda a: a["slots"].float()), "slots"),
        ("one slot for two tokens", new("slots", lambda a: a["slots"][:, :1]), "slots"),
        ("float32 k_pool", new("k_pool", lambda a: a["k_pool"].float()), "k_pool"),
        ("int8 v_pool (half the bytes)", new("v_pool", lambda a: a["v_pool"].to(torch.int8)), "v_pool"),
        ("kv_heads not the pool's", new("kv_heads", lambda a: 2), "kv_heads"),
        ("no KV heads (KV = 0)", lambda a: a.update(k_pool=_bf(NB, BS, 0, D), v_pool=_bf(NB, BS, 0, D), kv_heads=0),
         "KV > 0"),
        ("no heads", new("heads", lambda a: 0), "heads"),
        ("inter 0", new("inter", lambda a: 0), "inter"),
        ("norm1 too short", new("norm1", lambda a: a["norm1"][:-1]), "norm1"),
        ("row-major qkv", new("qkv", lambda a: _bf(QKV, HID)), "qkv"),
        ("o of the wrong shape", new("o", lambda a: _pack(HID, D)), "o must be pack"),
        ("down_bias too short", new("down_bias", lambda a: _bf(HID - 1)), "down_bias"),
        ("cos of one token", new("cos", lambda a: a["cos"][:, :1]), "cos"),
        ("x 2-D", new("x", lambda a: a["x"][0]), "x must be"),
        ("H = 0", new("x", lambda a: _bf(1, 2, 0)), "x must be"),
        ("float32 x", new("x", lambda a: a["x"].float()), "x must be"),
    ]


CASES = [(op, *case) for op, cases in {
    "small_linear": [
        ("float32 x", new("x", lambda a: a["x"].float()), "x must be"),
        ("1-D w", new("w", lambda a: a["w"][0]), "w [N, K]"),
        ("K mismatch", new("x", lambda a: _bf(3, HID - 1)), "w [N, K]"),
        ("0-dim x", new("x", lambda a: _bf()), "x [..., K]"),
        ("bias too short", new("bias", lambda a: _bf(39)), "bias"),
    ],
    "packed_linear": [
        ("row-major weight", new("wp", lambda a: _bf(40, HID)), "pack"),
        ("negative N", new("N", lambda a: -1), "positive"),
        ("N of another weight", new("N", lambda a: 48), "pack"),
        ("0-dim x", new("x", lambda a: _bf()), "x [..., K]"),
        ("bias too short", new("bias", lambda a: _bf(39)), "bias"),
    ],
    "paged_attention": _paged_cases() + [
        ("blocks 1-D", new("blocks", lambda a: a["blocks"][0]), "blocks"),
        ("mask [B, 2, T, S]", new("mask", lambda a: a["mask"].expand(-1, 2, -1, -1)), "mask"),
        ("no KV heads (KV = 0)", lambda a: a.update(k_pool=_bf(NB, BS, 0, D), v_pool=_bf(NB, BS, 0, D)), "KV > 0"),
        ("head size 48", lambda a: a.update(q=_bf(2, HEADS, 2, 48), k_pool=_bf(NB, BS, KV, 48),
                                            v_pool=_bf(NB, BS, KV, 48)), "multiple of 32"),
        ("float32 q", new("q", lambda a: a["q"].float()), "q must be"),
    ],
    "decoder_layer": _layer_cases(),
    "decoder_layer/eagle": [
        ("embeds without embed_norm", new("embed_norm", lambda a: None), "embed_norm"),
        ("embed_norm expanded from one element", new("embed_norm", lambda a: _bf(1).expand(HID)), "embed_norm"),
        ("embeds of one token", new("embeds", lambda a: a["embeds"][:, :1]), "embeds"),
        ("qkv for x alone", new("qkv", lambda a: _pack(QKV, HID)), "qkv"),
    ],
    "final_head": [
        ("H = 0", lambda a: a.update(x=_bf(1, 2, 0), norm=_bf(0), lm_head=_pack(VOCAB, 0)), "H > 0"),
        ("0-dim x", new("x", lambda a: _bf()), "x must be"),
        ("vocab 0", new("vocab", lambda a: 0), "vocab"),
        ("negative vocab", new("vocab", lambda a: -3), "vocab"),
        ("norm too short", new("norm", lambda a: a["norm"][:-1]), "norm"),
        ("lm_head of another vocab", new("lm_head", lambda a: _pack(VOCAB + 8, HID)), "lm_head"),
        ("float32 x", new("x", lambda a: a["x"].float()), "x must be"),
    ],
    "sample_rows": [
        ("V = 0", new("logits", lambda a: torch.randn(3, 0)), "V > 0"),
        ("r of another batch", new("r", lambda a: torch.rand(2)), "r must be"),
        ("float64 r", new("r", lambda a: a["r"].double()), "r must be"),
        ("bf16 logits", new("logits", lambda a: a["logits"].bfloat16()), "logits must be"),
        ("temperature 0", new("temperature", lambda a: 0.0), "temperature"),
        ("temperature NaN", new("temperature", lambda a: float("nan")), "temperature"),
        ("uniform 1.5", put("r", 1, 1.5), "r holds"),
        ("uniform NaN", put("r", 0, float("nan")), "r holds"),
    ],
    "verify_chain_rows": [
        ("token id = V", put("tokens", (1, 0), V), "tokens"),
        ("token id 1 << 40", put("tokens", (0, 1), BIG), "tokens"),
        ("negative token id", put("tokens", (0, 0), -1), "tokens"),
        ("negative draft count", put("num", 1, -1), "num"),
        ("float tokens", new("tokens", lambda a: a["tokens"].float()), "tokens"),
        ("q over another vocabulary", new("q", lambda a: torch.rand(2, 2, V - 1)), "q must be"),
        ("V = 0", lambda a: a.update(logits=torch.randn(2, 3, 0), q=torch.empty(0)), "V > 0"),
        ("K = 0", new("logits", lambda a: a["logits"][:, :1]), "K >= 1"),
        ("u of one draft", new("u", lambda a: a["u"][:, :1]), "u [B, K]"),
        ("temperature 0", new("temperature", lambda a: 0.0), "temperature"),
        ("negative uniform u", put("u", (1, 1), -0.5), "u holds"),
        ("uniform r = 1", put("r", 0, 1.0), "r holds"),
        ("logits on another device", new("logits", lambda a: a["logits"].to("meta")), "Meta"),
    ],
    "draft_chain": _paged_cases("masks") + [
        ("slot past the pool at step 1", put("slots", (1, 0), NB * BS), "slots"),
        ("slot 1 << 40 at step 0", put("slots", (0, 0), BIG), "slots"),
        ("negative slot", put("slots", (1, 0), -1), "slots"),
        ("slots 1-D", new("slots", lambda a: a["slots"][:, 0]), "slots"),
        ("target id past the embedding", put("ids", 3, V), "ids"),
        ("negative target id", put("ids", 0, -1), "ids"),
        ("float ids", new("ids", lambda a: a["ids"].float()), "ids"),
        ("vocab 0", new("vocab", lambda a: 0), "vocab"),
        ("r of one draw", new("r", lambda a: a["r"][:1]), "r must be"),
        ("uniform 2 at the last draw", put("r", (2, 0), 2.0), "r holds"),
        ("cos of one step", new("cos", lambda a: a["cos"][:1]), "cos"),
        ("masks 4-D", new("masks", lambda a: a["masks"][:, :, 0]), "masks"),
        ("non-contiguous embedding table", new("embed", lambda a: _bf(HID, V).t()), "embed"),
        ("qkv for h alone", new("qkv", lambda a: _pack(QKV, HID)), "qkv"),
        ("lm_head of another vocab", new("lm_head", lambda a: _pack(VOCAB + 8, HID)), "lm_head"),
        ("temperature NaN", new("temperature", lambda a: float("nan")), "temperature"),
        ("h on another device", new("h", lambda a: a["h"].to("meta")), "Meta"),
    ],
}.items() for case in cases]


def _call(name, args):
    return getattr(torch.ops.rlspec_kernels, name.split("/")[0])(*args.values())


def _case(name, change, fragment) -> str | None:
    """None when the op raised a RuntimeError naming the problem (and left the pools as they were), else why not."""
    torch.manual_seed(0)
    args = VALID[name]()
    change(args)
    pools = [args[k].clone() for k in ("k_pool", "v_pool") if name.startswith(WRITES_POOLS)]
    try:
        _call(name, args)
    except RuntimeError as exc:
        if fragment not in str(exc):
            return f"the error does not mention {fragment!r}: {str(exc).splitlines()[0]}"
    except Exception as exc:  # noqa: BLE001 - another exception type is a finding, reported with the case
        return f"{type(exc).__name__} instead of a RuntimeError: {str(exc).splitlines()[0]}"
    else:
        return "no error"
    if any(not torch.equal(before, args[k]) for before, k in zip(pools, ("k_pool", "v_pool"))):
        return "raised, but only after writing the KV pool"
    return None


def run_cases() -> int:
    """Every op with valid inputs, then every case; one line each ('run' first, so a crash names its case).
    -> the number of failures."""
    failures = 0
    for name, make in VALID.items():
        print(f"run {name}/valid", flush=True)
        torch.manual_seed(0)
        out = _call(name, make())
        out = out if isinstance(out, tuple) else (out,)
        ok = all(not t.is_floating_point() or bool(t.float().isfinite().all()) for t in out if t.numel())
        print(f"ok {name}/valid" if ok else f"FAIL {name}/valid: nonfinite output", flush=True)
        failures += not ok
    for name, label, change, fragment in CASES:
        print(f"run {name}/{label}", flush=True)
        why = _case(name, change, fragment)
        print(f"ok {name}/{label}" if why is None else f"FAIL {name}/{label}: {why}", flush=True)
        failures += why is not None
    return failures


def main() -> int:
    from rlspec.rollout.runtime.model import kernels

    assert kernels.available(), "the kernels did not build"
    return min(run_cases(), 100)


def test_every_op_refuses_bad_inputs_with_a_runtime_error():
    from rlspec.rollout.runtime.model import kernels

    if not kernels.available():
        pytest.skip("no AVX-512 BF16 CPU or no C++ toolchain")
    root = Path(__file__).resolve().parents[3]
    script = "import sys, tests.rollout.runtime.test_kernel_checks as t; sys.exit(t.main())"
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    lines = proc.stdout.splitlines()
    started = [line[4:] for line in lines if line.startswith("run ")]
    failed = [line for line in lines if line.startswith("FAIL ")]
    assert proc.returncode >= 0, f"the op crashed (signal {-proc.returncode}) on case {started[-1]!r}"
    assert not failed and proc.returncode == 0, "\n".join(failed) or proc.stderr[-2000:]
    assert sum(line.startswith("ok ") for line in lines) == len(VALID) + len(CASES)
