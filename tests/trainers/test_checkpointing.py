"""trainers/checkpointing.py: activation checkpointing turned on and off under the transformers installed, by the
name it knows, with no deprecation warning; the Trainer's own keys kept out of torch.utils.checkpoint's; PPO's
policy-and-value module checkpointing both of its models when the Trainer asks, by either name."""
from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch
import transformers

from rlspec.trainers import checkpointing
from tests.trainers.test_ppo import make_trainer, ppo_args

FIELD = ("activation_checkpointing" if "activation_checkpointing" in
         {f.name for f in dataclasses.fields(transformers.TrainingArguments)} else "gradient_checkpointing")


def _layers_on(model) -> list[bool]:
    return [bool(getattr(layer, "gradient_checkpointing", False)) for layer in model.model.layers]


def _no_checkpointing_warning(caught) -> None:
    said = [str(w.message) for w in caught if "checkpointing" in str(w.message)]
    assert not said, said


def test_on_and_off_by_the_installed_name_and_the_trainers_keys_kept_apart(tiny_llama):
    model = tiny_llama.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not checkpointing.is_on(model)
        # every_n_layers is the Trainer's key: passed on to torch.utils.checkpoint it fails at the forward
        checkpointing.enable(model, {"use_reentrant": False, "every_n_layers": 2})
        assert checkpointing.is_on(model) and _layers_on(model) == [True, False]
        model(ids, labels=ids).loss.backward()
        checkpointing.disable(model)
        assert not checkpointing.is_on(model) and _layers_on(model) == [False, False]
    _no_checkpointing_warning(caught)
    assert checkpointing.is_on(torch.nn.Linear(2, 2))  # a module that cannot checkpoint is never turned on


def test_what_the_arguments_ask_is_read_by_either_name():
    assert checkpointing.asked(SimpleNamespace(activation_checkpointing=True,  # 5.24 on (v6: the new names only)
                                               activation_checkpointing_kwargs={"use_reentrant": True})) == \
        (True, {"use_reentrant": True})
    assert checkpointing.asked(SimpleNamespace(gradient_checkpointing=False)) == (False, None)  # before 5.24
    args = transformers.TrainingArguments(output_dir="unused", **{FIELD: True}, use_cpu=True, report_to=[])
    assert checkpointing.asked(args) == (True, None)


@pytest.mark.parametrize("value_model", ["head", "separate"])
def test_ppo_checkpoints_its_policy_and_critic_where_the_trainer_asks(tiny_llama, char_tokenizer, tmp_path,
                                                                      value_model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(tiny_llama, char_tokenizer, ppo_args(tmp_path, value_model=value_model,
                                                                    max_steps=1, **{FIELD: True}))
        models = [trainer.model.policy] + ([trainer.model.critic] if value_model == "separate" else [])
        trainer.train()  # the Trainer turns it on as training starts
    _no_checkpointing_warning(caught)
    assert trainer.state.global_step == 1 and all(checkpointing.is_on(m) for m in models)
    # the name transformers before 5.24 calls
    for m in models:
        checkpointing.disable(m)
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=None, every_n_layers=1, offload=False)
    assert all(checkpointing.is_on(m) for m in models)
