"""rlspec.trainers.rewards: strict about the value, lenient about the format; the registry names its choices."""
from __future__ import annotations

import pytest

from rlspec.trainers.rewards import accuracy_reward, format_reward, get_reward_funcs


def _conv(*texts: str) -> list:
    return [[{"role": "assistant", "content": t}] for t in texts]


def test_accuracy_right_wrong_missing():
    completions = _conv("3 + 4 = 7, so \\boxed{7}", "I think \\boxed{8}", "I do not know", "")
    assert accuracy_reward(completions, answer=["7"] * 4) == [1.0, 0.0, 0.0, 0.0]


def test_accuracy_is_lenient_about_format_strict_about_value():
    completions = _conv("The answer is 7.", "7.0", "\\boxed{7} (not 8)", "\\boxed{6} ... actually 7")
    # No box: the last number counts. A box wins over later numbers, whatever they are.
    assert accuracy_reward(completions, answer=["7"] * 4) == [1.0, 1.0, 1.0, 0.0]


def test_accuracy_plain_text_and_trl_solution_column():
    assert accuracy_reward(["\\boxed{12}", "11"], solution=["12", "12"]) == [1.0, 0.0]


def test_unparseable_gold_is_skipped_not_zero():
    assert accuracy_reward(_conv("\\boxed{7}"), answer=["no answer here"]) == [None]


def test_accuracy_without_gold_column_is_a_clear_error():
    with pytest.raises(ValueError, match="'answer'"):
        accuracy_reward(_conv("7"))


def test_format_reward_needs_a_filled_box():
    texts = _conv("\\boxed{7}", "\\boxed{\\frac{1}{2}}", "\\boxed{}", "7")
    assert format_reward(texts) == [1.0, 1.0, 0.0, 0.0]


def test_registry_returns_in_order_and_names_valid_choices():
    assert get_reward_funcs(["format", "accuracy"]) == [format_reward, accuracy_reward]
    assert get_reward_funcs("accuracy") == [accuracy_reward]
    with pytest.raises(ValueError, match=r"\['accuracy', 'format'\]"):
        get_reward_funcs(["accuracy", "lenght"])
