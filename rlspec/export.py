"""Export a trained EAGLE-3 drafter to the directory vLLM and SGLang load (docs/export_format.md).

    python -m rlspec.export --drafter runs/grpo/drafter --target smollm2-135m-instruct --out exports/eagle3
    vLLM:   LLM(model=TARGET, speculative_config={"method": "eagle3", "model": OUT, "num_speculative_tokens": 3})
    SGLang: --speculative-algorithm EAGLE3 --speculative-draft-model-path OUT

The drafter is an in-memory Eagle3Model or a directory we saved (re-export, e.g. to change dtype).
torch is imported inside the functions only, so `import rlspec.export` stays cheap.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from rlspec import __version__
from rlspec.rollout.dtypes import NAMES as DTYPE_CHOICES  # plain Python: the one dtype table


def export_drafter(drafter_or_path: Any, out_dir: str, target: Any = None, dtype: str = "bfloat16",
                   metadata: dict | None = None) -> str:
    """Write an EAGLE-3 directory at `out_dir` and return its path.

    drafter_or_path: an Eagle3Model, or a drafter directory written by rlspec (or any EAGLE-3 one).
    target: the target's transformers config, config dict, model, local directory or fetch_model
    alias; it supplies rope, max positions and bos/eos. Optional when re-exporting a directory
    (its config.json already carries them). metadata: extra fields for rlspec_drafter.json
    (policy_version, training steps, metrics, ...).
    """
    from rlspec.rollout.speculation.drafters.eagle3_io import as_dtype, load_eagle3, read_config, read_metadata, save_eagle3

    target_cfg = resolve_target(target) if target is not None else None
    meta: dict = {}
    if isinstance(drafter_or_path, (str, os.PathLike)):
        src = str(drafter_or_path)
        layers = _num_layers(target_cfg) if target_cfg is not None else None
        model = load_eagle3(src, target_num_layers=layers)  # float32: every dtype converts exactly from it
        meta = read_metadata(src)
        target_cfg = target_cfg if target_cfg is not None else read_config(src)
    elif target_cfg is None:
        raise ValueError("export_drafter needs `target` (the target model's config or directory) for an "
                         "in-memory drafter: rope and max positions are copied from it")
    else:
        model = drafter_or_path
    meta.update(metadata or {})
    meta["rlspec_version"] = __version__
    return save_eagle3(model, target_cfg, out_dir, dtype=as_dtype(dtype), metadata=meta)


def resolve_target(target: Any) -> Any:
    """A target given by name or path becomes its config.json dict (aliases via fetch_model);
    configs, dicts and models pass through for save_eagle3 to read."""
    if not isinstance(target, (str, os.PathLike)):
        return target
    from rlspec.rollout.runtime.model.fetch import fetch_model

    return json.loads((Path(fetch_model(str(target))) / "config.json").read_text())


def _num_layers(target: Any) -> int | None:
    from rlspec.rollout.speculation.drafters.eagle3_io import target_dict

    return target_dict(target).get("num_hidden_layers")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlspec.export", description=__doc__.split("\n\n")[0],
                                epilog="The output loads in vLLM (method eagle3) and SGLang (EAGLE3).")
    p.add_argument("--drafter", required=True, help="drafter directory saved by rlspec (or any EAGLE-3 drafter)")
    p.add_argument("--target", default=None,
                   help="target model directory, hub id or alias (e.g. smollm2-135m-instruct); "
                        "default: the rope/positions recorded in the drafter's own config.json")
    p.add_argument("--out", required=True, help="output directory (created, or replaced if it holds a drafter)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_CHOICES, help="weight dtype on disk")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = export_drafter(args.drafter, args.out, target=args.target, dtype=args.dtype)
    except (ValueError, FileNotFoundError, FileExistsError, TypeError) as exc:
        print(f"rlspec.export: error: {exc}", file=sys.stderr)
        return 2
    _print_summary(out)
    return 0


def _print_summary(out: str) -> None:
    cfg = json.loads((Path(out) / "config.json").read_text())
    rows = [("output", out), ("dtype", cfg["torch_dtype"]),
            ("hidden / heads / kv heads", f"{cfg['hidden_size']} / {cfg['num_attention_heads']} / "
                                          f"{cfg['num_key_value_heads']}"),
            ("draft vocab / target vocab", f"{cfg['draft_vocab_size']} / {cfg['vocab_size']}"),
            ("target layers (HF indices)", str(cfg["eagle_aux_hidden_state_layer_ids"])),
            ("rope_theta / rope_scaling", f"{cfg['rope_theta']} / {cfg['rope_scaling']}")]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    print(f'\nvLLM:   LLM(model=TARGET, speculative_config={{"method": "eagle3", "model": "{out}", '
          '"num_speculative_tokens": 3})')
    print(f"SGLang: --speculative-algorithm EAGLE3 --speculative-draft-model-path {out}")


if __name__ == "__main__":
    sys.exit(main())
