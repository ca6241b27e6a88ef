"""`import rlspec` stays cheap (no torch) and its lazy names resolve to the defining modules."""
from __future__ import annotations

import subprocess
import sys

import pytest

import rlspec


def test_import_rlspec_does_not_import_torch():
    code = "import rlspec, sys; assert 'torch' not in sys.modules, 'import rlspec pulled in torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_value_types_resolve_without_torch():
    code = ("import sys; from rlspec import SamplingParams, SpecConfig, RolloutResult; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lazy_names_are_the_defining_objects():
    from rlspec.rollout.runtime.model.fetch import fetch_model
    from rlspec.rollout.types import SamplingParams

    assert rlspec.SamplingParams is SamplingParams
    assert rlspec.fetch_model is fetch_model


def test_all_and_dir_list_the_public_names():
    expected = {"RolloutEngine", "SamplingParams", "SpecConfig", "RolloutResult", "fetch_model",
                "SpecGRPOTrainer", "SpecRLOOTrainer", "PPOTrainer", "export_drafter"}
    assert set(rlspec.__all__) == expected
    assert expected <= set(dir(rlspec))


def test_unknown_name_is_an_attribute_error_naming_the_public_ones():
    with pytest.raises(AttributeError, match="SamplingParams"):
        rlspec.not_a_name  # noqa: B018


@pytest.mark.parametrize("name", sorted(rlspec._EXPORTS))
def test_every_export_resolves_or_says_which_module_is_missing(name):
    # A name whose module is not written yet fails with a message naming that module; a module that
    # exists but cannot import (a missing dependency, a typo) is a real failure and propagates.
    try:
        getattr(rlspec, name)
    except ImportError as exc:
        assert "not available in this version" in str(exc) and rlspec._EXPORTS[name] in str(exc), exc
