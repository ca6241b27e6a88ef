"""A Ray worker builds its engine from the policy blob without the model's classes (no Ray started here): the
family the driver recognised from the live policy travels with the config, so a trust_remote_code subclass
with its own model_type builds in the worker as it does in-process."""
from __future__ import annotations

import pytest

pytest.importorskip("ray")

from rlspec.rollout.types import SamplingParams  # noqa: E402
from rlspec.rollout.workers.pool import _policy_blob  # noqa: E402
from rlspec.rollout.workers.worker import _build_engine  # noqa: E402
from tests.conftest import random_prompts  # noqa: E402
from tests.rollout.family_helpers import make_family  # noqa: E402
from tests.rollout.test_engine_ar import engine_for  # noqa: E402


def test_a_custom_model_type_builds_in_the_worker_as_in_process():
    hf = make_family("custom_llama")
    blob = _policy_blob(hf, None)
    assert blob["family"] == "llama" and blob["config"].model_type == "custom_llama"
    engine = _build_engine(blob, None, None, {"max_model_len": 64})
    params = SamplingParams(temperature=0, max_new_tokens=8)
    prompts = random_prompts(2, 3, 6)
    assert [r.completion_ids for r in engine.generate(prompts, params)] == \
        [r.completion_ids for r in engine_for(hf).generate(prompts, params)]
