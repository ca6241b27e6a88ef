"""rlspec.eval: held-out prompts, the paired difference and the tail speed, by hand."""
import math

import pytest

from rlspec.eval import TRAIN_SET, heldout_math, paired_difference, parse_spec, tail_speed


def test_heldout_prompts_avoid_the_training_set():
    from rlspec.trainers.data import make_math_dataset

    train = {str(p) for p in make_math_dataset(**TRAIN_SET)["prompt"]}
    prompts, answers = heldout_math(200)
    assert len(prompts) == len(answers) == len({str(p) for p in prompts}) == 200
    assert not train & {str(p) for p in prompts}


def test_paired_difference_by_hand():
    a = [1, 0, 1, 0, 1, 1, 0, 0]
    b = [1, 1, 0, 0, 1, 0, 0, 0]
    d = [0, 1, -1, 0, 0, -1, 0, 0]  # mean -1/8
    out = paired_difference(a, b, margin=0.02)
    var = sum((x + 1 / 8) ** 2 for x in d) / 7
    assert out["diff"] == pytest.approx(-1 / 8)
    assert out["se"] == pytest.approx(math.sqrt(var / 8))
    assert out["n_for_margin"] == math.ceil(1.96 ** 2 * var / 0.02 ** 2)


def test_tail_speed_counts_steps_with_a_quarter_of_the_rows_or_fewer():
    # (seconds since start, live, emitted, speculated): rows 8 -> tail = live <= 2
    trace = [(1.0, 8, 8, False), (2.0, 4, 4, False), (2.5, 2, 6, True), (3.5, 1, 4, True)]
    assert tail_speed(trace, 8) == pytest.approx((6 + 4) / (0.5 + 1.0))


def test_parse_spec_reads_yaml_values():
    spec = parse_spec(["drafter=suffix", "verification=judge", "judge_threshold=0.05", "accept_off_policy=true"])
    assert spec.verification == "judge" and spec.judge_threshold == 0.05 and spec.accept_off_policy is True
    with pytest.raises(ValueError, match="key=value"):
        parse_spec(["judge"])
    judge = ["drafter=suffix", "verification=judge", "accept_off_policy=true"]
    # YAML 1.1 reads 1e-9 (no dot) as a string: typed by the field, it is the float meant
    assert parse_spec([*judge, "judge_threshold=1e-9"]).judge_threshold == pytest.approx(1e-9)
    assert parse_spec(["step_delimiter=123"]).step_delimiter == "123"  # a string field keeps the text verbatim
    with pytest.raises(ValueError, match="judge_treshold.*judge_threshold"):  # a typo names the nearest key
        parse_spec(["judge_treshold=0.1"])
    with pytest.raises(ValueError, match="judge_threshold expects float"):
        parse_spec([*judge, "judge_threshold=high"])
