"""rlspec.trainers.preflight: a prompt too long for the rollout context is named before step 1, or dropped on request,
with prompts tokenized exactly as TRL's GRPOTrainer tokenizes them for generation."""
from __future__ import annotations

import datasets
import pytest

from rlspec.rollout.errors import PromptTooLongError
from rlspec.trainers.data import make_math_dataset, prompt_token_ids
from rlspec.trainers.preflight import check_dataset_prompts, check_trainer_prompts, prompt_lengths

LONG_ROW = 7
MAX_LEN = 128


def _dataset_with_one_long_prompt(conversational: bool = True) -> datasets.Dataset:
    """15 short arithmetic prompts; row 7's question is 300 characters (one token each with the char tokenizer)."""
    ds = make_math_dataset(15, seed=0)
    rows = ds.to_dict()
    long = "What is 1 + 1? " + "x" * 285
    rows["prompt"][LONG_ROW] = [{"role": "user", "content": long}]
    if not conversational:
        rows["prompt"] = [p[-1]["content"] for p in rows["prompt"]]
    return datasets.Dataset.from_dict(rows)


def test_the_long_row_is_named_before_any_training(char_tokenizer):
    ds = _dataset_with_one_long_prompt()
    lengths = prompt_lengths(ds, char_tokenizer)
    with pytest.raises(PromptTooLongError) as err:
        check_dataset_prompts(ds, char_tokenizer, MAX_LEN)
    msg = str(err.value)
    assert f"1 of 15 prompt(s) too long: prompt {LONG_ROW} has {lengths[LONG_ROW]} tokens" in msg
    assert f"context is {MAX_LEN} tokens" in msg and "rollout.max_model_len" in msg and "drop_long_prompts" in msg
    assert sorted(i for i, n in enumerate(lengths) if n >= MAX_LEN) == [LONG_ROW]


def test_lengths_are_the_engine_input_lengths(char_tokenizer):
    """Same ids as trainers.data.prompt_token_ids (what PPO feeds the engine) for chat and plain prompts."""
    for conversational in (True, False):
        ds = _dataset_with_one_long_prompt(conversational)
        expected = [len(ids) for ids in prompt_token_ids(char_tokenizer, ds["prompt"])]
        assert prompt_lengths(ds, char_tokenizer) == expected


def test_drop_returns_the_rest_and_the_count(char_tokenizer):
    ds = _dataset_with_one_long_prompt(conversational=False)
    kept, dropped = check_dataset_prompts(ds, char_tokenizer, MAX_LEN, drop=True)
    assert dropped == 1 and len(kept) == 14
    assert kept["prompt"] == [p for i, p in enumerate(ds["prompt"]) if i != LONG_ROW]
    same, none = check_dataset_prompts(kept, char_tokenizer, MAX_LEN)
    assert same is kept and none == 0


def test_room_for_new_tokens_counts(char_tokenizer):
    """A prompt that fits with 1 new token but not with 64 is refused when 64 are required."""
    ds = make_math_dataset(15, seed=0)
    longest = max(prompt_lengths(ds, char_tokenizer))
    check_dataset_prompts(ds, char_tokenizer, longest + 1)
    with pytest.raises(PromptTooLongError, match="no room for 64 new tokens"):
        check_dataset_prompts(ds, char_tokenizer, longest + 1, max_new_tokens_min=64)


def test_a_trl_trainer_is_checked_with_its_own_tokenization(tiny_llama, char_tokenizer, tmp_path):
    """On a real trl.GRPOTrainer: lengths equal TRL's own _tokenize_prompts, and drop replaces train_dataset."""
    import trl

    ds = _dataset_with_one_long_prompt()
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=8, save_strategy="no")
    trainer = trl.GRPOTrainer(model=tiny_llama, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                              args=args, train_dataset=ds, processing_class=char_tokenizer)
    trl_ids, _, _ = trainer._tokenize_prompts(list(ds["prompt"]))
    assert prompt_lengths(ds, char_tokenizer) == [len(ids) for ids in trl_ids]
    with pytest.raises(PromptTooLongError, match=f"prompt {LONG_ROW} has"):
        check_trainer_prompts(trainer, MAX_LEN)
    assert check_trainer_prompts(trainer, MAX_LEN, drop=True) == 1 and len(trainer.train_dataset) == 14


def test_both_trainers_refuse_a_long_prompt_at_construction_or_drop_it(tiny_llama, char_tokenizer, tmp_path):
    """SpecGRPOTrainer and PPOTrainer run the check in __init__ against their engine's context, before any
    step: the row is named, or dropped with drop_long_prompts=True (and never reaches the engine)."""
    import trl

    from rlspec.trainers.grpo import SpecGRPOTrainer
    from rlspec.trainers.ppo.trainer import PPOTrainer
    from rlspec.trainers.ppo.config import PPOConfig

    reward = [lambda completions, **kw: [0.0] * len(completions)]
    engine_kwargs = dict(max_model_len=MAX_LEN, max_num_seqs=8)
    grpo_args = trl.GRPOConfig(output_dir=str(tmp_path / "g"), use_cpu=True, bf16=False, report_to=[], per_device_train_batch_size=4,
                               num_generations=4, max_completion_length=8, save_strategy="no")
    ppo_args = PPOConfig(output_dir=str(tmp_path / "p"), use_cpu=True, bf16=False, report_to=[], per_device_train_batch_size=4,
                         num_mini_batches=1, num_generations=4, max_completion_length=8, kl_coef=0.0,
                         save_strategy="no")
    builds = {
        "grpo": lambda **kw: SpecGRPOTrainer(model=tiny_llama, reward_funcs=reward, args=grpo_args,
                                             train_dataset=_dataset_with_one_long_prompt(),
                                             processing_class=char_tokenizer, engine_kwargs=engine_kwargs, **kw),
        "ppo": lambda **kw: PPOTrainer(tiny_llama, reward, args=ppo_args, train_dataset=_dataset_with_one_long_prompt(),
                                       processing_class=char_tokenizer, engine_kwargs=engine_kwargs, **kw),
    }
    for name, build in builds.items():
        with pytest.raises(PromptTooLongError, match=f"prompt {LONG_ROW} has .* context is {MAX_LEN} tokens"):
            build()
        trainer = build(drop_long_prompts=True)
        assert trainer.dropped_long_prompts == 1 and len(trainer.train_dataset) == 14, name
        assert max(prompt_lengths(trainer.train_dataset, char_tokenizer)) < MAX_LEN, name
        trainer.engine.close()


def _rows_with(**changes) -> datasets.Dataset:
    rows = make_math_dataset(15, seed=0).to_dict()
    for column, (row, value) in changes.items():
        rows[column][row] = value
    return datasets.Dataset.from_dict(rows)


@pytest.mark.parametrize("prompt", [[{"role": "user", "content": "  "}], None, []])
def test_an_empty_prompt_is_refused_naming_the_row(char_tokenizer, prompt):
    from rlspec.trainers.preflight import DatasetRowError

    with pytest.raises(DatasetRowError, match=r"row 4 of the train dataset has an empty or missing 'prompt'"):
        check_dataset_prompts(_rows_with(prompt=(4, prompt)), char_tokenizer, MAX_LEN)
    plain = datasets.Dataset.from_dict({"prompt": ["1 + 1 =", "", "2 + 2 ="]})
    with pytest.raises(DatasetRowError, match="row 1 of"):
        check_dataset_prompts(plain, char_tokenizer, MAX_LEN)


def test_a_shuffled_datasets_bad_row_is_also_named_as_the_row_of_the_data_as_loaded(char_tokenizer):
    """load_dataset_by_name shuffles (seeded) and selects: the message also names the row of the user's file."""
    from rlspec.trainers.preflight import DatasetRowError

    loaded = datasets.Dataset.from_dict({"prompt": [f"{a} + 1 =" if a != 5 else "" for a in range(16)]})
    ds = loaded.shuffle(seed=0).select(range(12))
    row = ds["prompt"].index("")
    assert row != 5  # the shuffle moved it, or the test would not tell the two apart
    with pytest.raises(DatasetRowError, match=rf"row {row} \(row 5 of the data as loaded, before the run's seeded "):
        check_dataset_prompts(ds, char_tokenizer, MAX_LEN)


def test_a_token_id_beyond_the_models_vocabulary_and_a_none_a_reward_reads_are_refused(char_tokenizer):
    from rlspec.trainers.preflight import DatasetRowError

    ds = make_math_dataset(15, seed=0)
    lengths = prompt_lengths(ds, char_tokenizer)
    top = max(max(x) for x in prompt_token_ids(char_tokenizer, list(ds["prompt"])))
    check_dataset_prompts(ds, char_tokenizer, MAX_LEN, vocab_size=top + 1)  # every id in range: fine
    with pytest.raises(DatasetRowError, match=f"token id {top} .* outside the model's vocabulary of {top} ids"):
        check_dataset_prompts(ds, char_tokenizer, MAX_LEN, vocab_size=top)
    assert lengths  # the same tokenization

    def accuracy(completions, answer, **kwargs):
        return [0.0] * len(completions)

    bad = _rows_with(answer=(9, None))
    with pytest.raises(DatasetRowError, match="row 9 of the train dataset have None in 'answer'"):
        check_dataset_prompts(bad, char_tokenizer, MAX_LEN, reward_funcs=[accuracy])
    check_dataset_prompts(bad, char_tokenizer, MAX_LEN, reward_funcs=[lambda completions, **kw: [0.0]])  # reads none


def test_spec_grpo_refuses_an_out_of_vocabulary_row_at_construction(tiny_llama, char_tokenizer, tmp_path):
    """A model whose embedding has fewer rows than the tokenizer has tokens: the first row using such a token is
    named before step 1 (the engine would index past its embedding at that row's step)."""
    import trl

    from rlspec.trainers.grpo import SpecGRPOTrainer
    from rlspec.trainers.preflight import DatasetRowError

    vocab = len(char_tokenizer)
    tiny_llama.resize_token_embeddings(vocab - 1)  # the last id ("~") has no row
    ds = _rows_with(prompt=(6, [{"role": "user", "content": "What is 1 ~ 1?"}]))
    args = trl.GRPOConfig(output_dir=str(tmp_path / "g"), use_cpu=True, bf16=False, report_to=[],
                          per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                          save_strategy="no")
    with pytest.raises(DatasetRowError, match=f"row 6 of the train dataset hold token id {vocab - 1}"):
        SpecGRPOTrainer(model=tiny_llama, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                        args=args, train_dataset=ds, processing_class=char_tokenizer,
                        engine_kwargs=dict(max_model_len=MAX_LEN, max_num_seqs=8))
