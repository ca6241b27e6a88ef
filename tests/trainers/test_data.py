"""rlspec.trainers.data: the embedded arithmetic set (seeded, correct, TRL-shaped) and hub-dataset loading errors."""
from __future__ import annotations

import re

import datasets
import pytest

from rlspec.trainers.data import extract_final_answer, load_dataset_by_name, make_math_dataset

_NUMBERS = re.compile(r"\d+")


def _operands_and_op(question: str) -> tuple[int, int, str]:
    a, b = map(int, _NUMBERS.findall(question.split("Put the final")[0]))
    if "+" in question or "more" in question or "red balls" in question:
        return a, b, "+"
    if "-" in question or "gives away" in question:
        return a, b, "-"
    return a, b, "*"


def test_embedded_math_is_a_conversational_dataset():
    ds = make_math_dataset(num_examples=16, seed=0)
    assert isinstance(ds, datasets.Dataset)
    assert ds.column_names == ["prompt", "answer"] and len(ds) == 16
    prompt = ds[0]["prompt"]
    assert [m["role"] for m in prompt] == ["user"]  # the chat template supplies its system prompt
    assert prompt[0]["content"].endswith("Put the final answer in \\boxed{}.")


def test_same_seed_same_rows_other_seed_other_rows():
    a, b = make_math_dataset(32, seed=3), make_math_dataset(32, seed=3)
    assert a.to_dict() == b.to_dict()
    assert make_math_dataset(32, seed=4).to_dict() != a.to_dict()


@pytest.mark.parametrize("ops", [("+",), ("-",), ("*",), ("+", "-", "*")])
def test_answers_are_correct(ops):
    ds = make_math_dataset(64, seed=1, max_operand=9, ops=ops)
    apply = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for row in ds:
        a, b, op = _operands_and_op(row["prompt"][-1]["content"])
        assert op in ops and 0 <= a <= 9 and 0 <= b <= 9
        assert row["answer"] == str(apply[op](a, b))
        assert int(row["answer"]) >= 0  # subtraction keeps a >= b


def test_bad_ops_and_custom_prompting():
    with pytest.raises(ValueError, match="ops must be"):
        make_math_dataset(4, ops=("/",))
    prompt = make_math_dataset(4, system_prompt="Be brief.", instruction="")[0]["prompt"]
    assert prompt[0] == {"role": "system", "content": "Be brief."}
    assert prompt[1]["role"] == "user" and prompt[1]["content"].endswith("?")


def test_load_by_name_embedded_passes_options():
    ds = load_dataset_by_name("embedded_math", split="train", num_examples=8, seed=5, ops=("*",))
    assert ds.to_dict() == make_math_dataset(8, seed=5, ops=("*",)).to_dict()


def test_gsm8k_answer_extraction():
    assert extract_final_answer("She has 3 + 4 = <<3+4=7>>7 apples.\n#### 1,007") == "1007"
    assert extract_final_answer(" 42 ") == "42"


def test_missing_hub_dataset_error_says_where_it_looked(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # read at import time; patch the live value
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        load_dataset_by_name("no-such-org/no-such-dataset", split="train", num_examples=4, seed=0)
    message = str(info.value)
    assert "no-such-org/no-such-dataset" in message
    assert "local path" in message and "datasets cache" in message and "Hugging Face Hub" in message
    assert "offline" in message and "embedded_math" in message
