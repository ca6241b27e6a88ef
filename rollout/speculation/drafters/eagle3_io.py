"""Save and load EAGLE-3 drafters in the directory format vLLM and SGLang load (docs/export_format.md).

A drafter directory holds:
  config.json          a LlamaConfig for one decoder layer ("LlamaForCausalLMEagle3"), rope copied
                       from the target, plus the target layers the drafter reads (see LAYER IDS below)
  model.safetensors    fc, midlayer.*, norm, lm_head [Vd, H], and d2t [Vd] int64 only when Vd < V;
                       no `model.` prefix and no embed_tokens (both engines share the target's)
  rlspec_drafter.json  our own metadata (format version, policy version, steps, metrics); engines ignore it

LAYER IDS. Our `Eagle3Config.aux_layer_ids` are HF `hidden_states` indices (i = residual stream
after decoder layer i-1). What the engines do with the config (read from their sources):
  * vLLM (v1/worker/gpu_model_runner.py `_get_eagle3_aux_layers_from_config`) reads the top-level
    `eagle_aux_hidden_state_layer_ids` and hands it unchanged to the target; the target
    (models/llama.py `LlamaModel.forward`) appends `hidden_states + residual` *before* running layer
    idx when idx is in the list, i.e. HF hidden_states[idx]. Some builds fall back to
    `eagle_config.eagle_aux_hidden_state_layer_ids`, but only when the top-level key is absent.
    Without either, vLLM uses (2, L//2, L-3), also HF indices.
  * SGLang (model_runner.py) reads only `eagle_config["eagle_aux_hidden_state_layer_ids"]`, and
    the target's `set_eagle3_layers_to_capture` captures `[i + 1 for i in ids]`, again before the
    layer runs: an id i there means HF hidden_states[i + 1]. Its default (no eagle_config) is also
    (2, L//2, L-3) in HF terms. SGLang also sizes the fc input from len(ids) when
    `use_aux_hidden_state` is true.
  So for HF indices ids we write top-level `eagle_aux_hidden_state_layer_ids = ids` and
  `eagle_config = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": true}`:
  both engines then read the same three residual streams we trained on (ids must be >= 1).

D2T / T2D. vLLM (models/llama_eagle3.py `load_weights`) renames `d2t` to draft_id_to_target_id
(zeros, i.e. identity, when absent) and skips any `t2d`; SGLang (models/llama_eagle3.py) turns `d2t`
into hot token ids (d2t + arange) and skips `t2d`. Neither reads t2d, so we do not write it.
Both skip/replace a missing embed_tokens with the target's embedding. vLLM reads
`norm_before_residual` (default false = our layout: the residual is h before hidden_norm).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from rlspec.rollout.dtypes import as_dtype  # noqa: F401  (re-exported)
from rlspec.rollout.speculation.drafters.eagle3_model import Eagle3Config, Eagle3Model

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
META_FILE = "rlspec_drafter.json"
FORMAT_VERSION = 1
# tensors a third-party EAGLE-3 checkpoint may carry that we neither need nor train
IGNORED_TENSORS = ("embed_tokens.weight", "t2d")
def expected_shapes(c: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every floating-point tensor in the file (d2t is handled apart)."""
    H, I, q, kv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    m = "midlayer."
    return {
        "fc.weight": (H, 3 * H),
        m + "input_layernorm.weight": (H,), m + "hidden_norm.weight": (H,),
        m + "self_attn.q_proj.weight": (q, 2 * H), m + "self_attn.k_proj.weight": (kv, 2 * H),
        m + "self_attn.v_proj.weight": (kv, 2 * H), m + "self_attn.o_proj.weight": (H, q),
        m + "post_attention_layernorm.weight": (H,),
        m + "mlp.gate_proj.weight": (I, H), m + "mlp.up_proj.weight": (I, H), m + "mlp.down_proj.weight": (H, I),
        "norm.weight": (H,), "lm_head.weight": (c.draft_vocab_size, H),
    }


# ----------------------------------------------------------------------------------------- save

def save_learned(drafter, trainer, target_hf_config: Any, out_dir: str, metadata: dict | None = None) -> str:
    """save_eagle3 of a learned drafter as it stands: the trainer's float32 master weights when one trains
    it (else the drafter's own), its optimizer steps in the metadata."""
    model = trainer.model if trainer is not None else drafter.network()
    meta = {"train_steps": trainer.stats.steps if trainer is not None else 0, **(metadata or {})}
    return save_eagle3(model, target_hf_config, out_dir, metadata=meta)


def save_eagle3(model: Eagle3Model, target_hf_config: Any, out_dir: str,
                dtype: torch.dtype | str = torch.bfloat16, metadata: dict | None = None) -> str:
    """Write `model` as an EAGLE-3 directory at `out_dir` (atomically) and return its path.

    target_hf_config: the target's transformers config, its config.json as a dict, its ModelConfig,
    the target model, its local directory, or a drafter config.json we wrote (re-export): rope,
    max positions and bos/eos are copied from it. metadata: extra fields for rlspec_drafter.json.
    """
    dtype = as_dtype(dtype)
    c = model.cfg
    target = target_dict(target_hf_config)
    config = drafter_config(c, target, dtype)
    tensors = drafter_tensors(model, dtype)
    meta = {**(metadata or {}), "format": "eagle3", "rlspec_format_version": FORMAT_VERSION,
            "dtype": str(dtype).removeprefix("torch."), "eagle3_config": c.to_dict()}
    return _write_atomically(Path(out_dir), config, tensors, meta)


def target_dict(target: Any) -> dict:
    """The target's config as a plain dict, from any of the forms `save_eagle3` accepts."""
    if isinstance(target, dict):
        return dict(target)
    if isinstance(target, (str, os.PathLike)):
        path = Path(target) / CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"target {target!r}: no {CONFIG_FILE} there; pass the target model's directory")
        return json.loads(path.read_text())
    if hasattr(target, "to_dict"):  # transformers PretrainedConfig
        return target.to_dict()
    if getattr(target, "hf_config", None) is not None:  # rollout.runtime.model.config.ModelConfig
        return target_dict(target.hf_config)
    if getattr(target, "config", None) is not None:  # a transformers model
        return target_dict(target.config)
    raise TypeError(f"cannot read a target config from {type(target).__name__}; pass a transformers config, "
                    "a config dict, a ModelConfig or the target model's directory")


def drafter_config(c: Eagle3Config, target: dict, dtype: torch.dtype) -> dict:
    """config.json contents for drafter config `c` serving the target described by `target`."""
    _check_target(c, target)
    ids = [int(i) for i in c.aux_layer_ids]
    dtype_name = str(dtype).removeprefix("torch.")
    config = {
        "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
        "max_position_embeddings": target.get("max_position_embeddings", 2048),
        **rope_fields(target),
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "norm_before_residual": False,  # vLLM: residual = fc output before hidden_norm (our layout)
        "torch_dtype": dtype_name, "dtype": dtype_name,  # transformers 4 / 5 spellings
        # Layer ids: HF hidden_states indices for vLLM, minus one for SGLang (module docstring)
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True},
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if target.get(key) is not None:
            config[key] = target[key]
    return config


def rope_fields(target: dict) -> dict:
    """`rope_theta` and `rope_scaling` (None for plain RoPE) as vLLM/SGLang read them, and the
    transformers-5 `rope_parameters` they come from, built from either layout of the target config."""
    params = target.get("rope_parameters")
    if not params:  # transformers 4 layout: rope_theta + rope_scaling
        scaling = dict(target.get("rope_scaling") or {})
        params = {"rope_type": scaling.get("rope_type", scaling.get("type", "default")), **scaling}
    params = dict(params)
    theta = float(params.get("rope_theta", target.get("rope_theta", 10000.0)))
    params["rope_theta"] = theta
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_parameters": params}


def _check_target(c: Eagle3Config, target: dict) -> None:
    for key, ours in (("vocab_size", c.vocab_size), ("hidden_size", c.hidden_size)):
        if key in target and target[key] != ours:
            raise ValueError(f"target {key} is {target[key]} but the drafter was built for {ours}: "
                             "export with the target model the drafter was trained on")
    if min(c.aux_layer_ids) < 1:
        raise ValueError(f"aux_layer_ids {list(c.aux_layer_ids)} must be HF hidden_states indices >= 1 "
                         "(0 is the embedding, which SGLang cannot capture)")
    if len(set(c.aux_layer_ids)) < len(c.aux_layer_ids):
        # the engines capture each listed layer once, so fc would get fewer than 3H features
        warnings.warn(f"aux_layer_ids {list(c.aux_layer_ids)} repeat a layer: vLLM and SGLang capture each "
                      "layer once and will fail to run this drafter (fine for tests on tiny targets)", stacklevel=3)
    if ARCHITECTURE not in (target.get("architectures") or []):  # a real target: ids must be inside it
        L = target.get("num_hidden_layers")
        if L is not None and max(c.aux_layer_ids) >= L:
            raise ValueError(f"aux_layer_ids {list(c.aux_layer_ids)} reach past the target's {L} layers")


def drafter_tensors(model: Eagle3Model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors to write: every weight cast to `dtype`, plus d2t int64 when the draft vocab is smaller."""
    c = model.cfg
    out = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items() if k != "d2t"}
    d2t = model.d2t.detach().to("cpu", torch.int64)
    targets = torch.arange(c.draft_vocab_size) + d2t
    if c.draft_vocab_size < c.vocab_size:
        if targets.min() < 0 or targets.max() >= c.vocab_size or not bool((targets.diff() > 0).all()):
            raise ValueError("d2t must map draft ids to distinct, increasing target ids in "
                             f"[0, {c.vocab_size}); set it with Eagle3Model.set_draft_vocab")
        out["d2t"] = d2t.contiguous()
    elif bool(d2t.any()):
        raise ValueError("a drafter whose draft vocabulary is the full target vocabulary must have d2t == 0 "
                         "(the engines read a missing d2t as the identity)")
    return out


def _write_atomically(out: Path, config: dict, tensors: dict, meta: dict) -> str:
    """Write into a temp dir beside `out`, then swap it in, so readers never see half a drafter."""
    from safetensors.torch import save_file

    out = out.expanduser().resolve()
    if out.exists() and any(out.iterdir()) and not _is_drafter_dir(out):
        raise FileExistsError(f"{out} exists and is not an EAGLE-3 drafter directory; choose an empty or new --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str) + "\n")
        _make_readable(tmp)
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(out)


def _make_readable(tmp: Path) -> None:
    """mkdtemp makes 0700 dirs (and safetensors 0600 files); an export is served by other users/containers,
    so give it the permissions a plain mkdir/open would have had under the current umask."""
    umask = _current_umask()
    os.chmod(tmp, 0o777 & ~umask)
    for f in tmp.iterdir():
        os.chmod(f, 0o666 & ~umask)


def _current_umask() -> int:
    # read, not set-and-restore: os.umask(0) would briefly open every other thread's new files
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _swap_in(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.replace(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, old / "d")  # a directory cannot be replaced in place; move the old one aside first
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _is_drafter_dir(path: Path) -> bool:
    try:
        return ARCHITECTURE in json.loads((path / CONFIG_FILE).read_text()).get("architectures", [])
    except (OSError, ValueError):
        return False


# ----------------------------------------------------------------------------------------- load

def read_config(path: str) -> dict:
    """The drafter's config.json as a dict."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no {CONFIG_FILE}; expected an EAGLE-3 drafter directory")
    return json.loads(file.read_text())


def read_metadata(path: str) -> dict:
    """rlspec_drafter.json as a dict ({} for drafters not written by rlspec)."""
    file = Path(path) / META_FILE
    return json.loads(file.read_text()) if file.is_file() else {}


def load_eagle3(path: str, device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32,
                target_num_layers: int | None = None) -> Eagle3Model:
    """Read an EAGLE-3 directory back into an Eagle3Model (d2t absent -> identity).

    target_num_layers is needed only for third-party drafters that name no layer ids: they then
    use the engines' default (2, L//2, L-3). Raises ValueError naming any missing, misshapen or
    unknown tensor.
    """
    from safetensors.torch import load_file

    config = read_config(path)
    c = config_from_dict(config, target_num_layers)
    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{path}: no {WEIGHTS_FILE}")
    raw = {k.removeprefix("model."): v for k, v in load_file(str(weights)).items()}
    state = _checked_state(c, raw, path, as_dtype(dtype))
    with torch.device("meta"):
        model = Eagle3Model(c)
    model.load_state_dict(state, strict=True, assign=True)  # no throwaway random init
    return model.to(device)


def config_from_dict(config: dict, target_num_layers: int | None = None) -> Eagle3Config:
    """Eagle3Config from a drafter config.json (ours, or a SpecForge/EAGLE-3 one)."""
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"drafter has num_hidden_layers={config['num_hidden_layers']}; only 1 is supported")
    if config.get("target_hidden_size", config["hidden_size"]) != config["hidden_size"]:
        raise ValueError("drafters whose hidden size differs from the target's (target_hidden_size) are not supported")
    H, nh = config["hidden_size"], config["num_attention_heads"]
    V = config["vocab_size"]
    return Eagle3Config(
        hidden_size=H, intermediate_size=config["intermediate_size"], num_heads=nh,
        num_kv_heads=config.get("num_key_value_heads") or nh, head_dim=config.get("head_dim") or H // nh,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6), vocab_size=V,
        draft_vocab_size=config.get("draft_vocab_size") or V,
        aux_layer_ids=_layer_ids(config, target_num_layers))


def _layer_ids(config: dict, target_num_layers: int | None) -> tuple[int, int, int]:
    """HF hidden_states indices, read the way the engines read them (module docstring)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    sglang = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids and sglang and [i - 1 for i in ids] != list(sglang):
        raise ValueError(f"config.json layer ids disagree: top-level (vLLM) {ids} vs eagle_config (SGLang) "
                         f"{sglang}; SGLang's must be vLLM's minus one")
    if not ids and sglang:
        ids = [i + 1 for i in sglang]
    if not ids:
        if target_num_layers is None:
            raise ValueError("config.json names no target layers (eagle_aux_hidden_state_layer_ids); pass "
                             "target_num_layers to use the engines' default (2, L//2, L-3)")
        L = target_num_layers
        ids = [2, L // 2, L - 3]
    if len(ids) != 3:
        raise ValueError(f"EAGLE-3 fuses 3 target layers; config.json names {list(ids)}")
    return tuple(int(i) for i in ids)


def _checked_state(c: Eagle3Config, raw: dict, path: str, dtype: torch.dtype) -> dict:
    expected = expected_shapes(c)
    missing = sorted(set(expected) - set(raw))
    unknown = sorted(set(raw) - set(expected) - {"d2t", *IGNORED_TENSORS})
    wrong = [f"{k}: {tuple(raw[k].shape)} (expected {v})" for k, v in expected.items()
             if k in raw and tuple(raw[k].shape) != v]
    problems = ([f"missing: {', '.join(missing)}"] if missing else []) + \
               ([f"unexpected: {', '.join(unknown)}"] if unknown else []) + \
               ([f"wrong shape: {'; '.join(wrong)}"] if wrong else [])
    if problems:
        raise ValueError(f"{path}/{WEIGHTS_FILE} does not match its config.json: " + " | ".join(problems))
    state = {k: raw[k].to(dtype) for k in expected}
    state["d2t"] = _checked_d2t(c, raw.get("d2t"), path)
    return state


def _checked_d2t(c: Eagle3Config, d2t: torch.Tensor | None, path: str) -> torch.Tensor:
    Vd, V = c.draft_vocab_size, c.vocab_size
    if d2t is None:
        if Vd < V:
            raise ValueError(f"{path}: draft_vocab_size {Vd} < vocab_size {V} but the file has no d2t")
        return torch.zeros(Vd, dtype=torch.long)
    if tuple(d2t.shape) != (Vd,):
        raise ValueError(f"{path}: d2t has shape {tuple(d2t.shape)}, expected ({Vd},)")
    targets = torch.arange(Vd) + d2t.long()
    if targets.min() < 0 or targets.max() >= V:
        raise ValueError(f"{path}: d2t maps draft ids outside the target vocabulary [0, {V})")
    return d2t.long()
