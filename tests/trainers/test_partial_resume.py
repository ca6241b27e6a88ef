"""Partial rollouts across what a real run meets: a chat template that stamps today's date (the pool's prompt ids
are TRL's, tokenized once), dataset columns of ordinary types in checkpoints (datetime, numpy, nested), a round
that fails (the pool as it was), batches on_nonfinite="skip_batch" skips and a resume with a smaller oversample
(the counters stay true, every group trains)."""
from __future__ import annotations

import datetime
import io

import numpy as np
import pytest
import torch

from rlspec.rollout.errors import NonFiniteLogitsError
from rlspec.trainers import partial_trl
from rlspec.trainers.data import make_math_dataset
from rlspec.trainers.partial_rollouts import GroupPool, PartialRolloutConfig
from tests.trainers.conftest import CHATML_TEMPLATE, build_char_tokenizer
from tests.trainers.test_partial_rollouts import make_trainer


class ClockPastMidnight(datetime.datetime):
    """now() moves on 7 hours a call from 22:00: the pool's tokenization and TRL's fall on different days."""
    calls = 0

    @classmethod
    def now(cls, tz=None):
        cls.calls += 1
        return datetime.datetime(2026, 11, 28, 22) + datetime.timedelta(hours=7 * cls.calls)


def test_a_date_stamped_chat_template_crossing_midnight_trains(tmp_path, monkeypatch):
    from transformers.utils import chat_template_utils

    tok = build_char_tokenizer()
    tok.chat_template = "Today: {{ strftime_now('%d %b') }}\n" + CHATML_TEMPLATE
    monkeypatch.setattr(chat_template_utils, "datetime", ClockPastMidnight)
    trainer = make_trainer(tok, tmp_path, steps=2)
    trainer.train()
    assert ClockPastMidnight.calls >= 2 and trainer.partial.trained_samples == 2 * 8


def with_columns(ds):
    """The math set with a datetime column and a nested one: what a user's dataset carries to its rewards."""
    start = datetime.datetime(2026, 11, 28, 23, 59)
    ds = ds.add_column("asked_at", [start + datetime.timedelta(minutes=i) for i in range(len(ds))])
    return ds.add_column("meta", [{"tags": ["a", str(i)], "score": [float(i), 0.5]} for i in range(len(ds))])


def seen_columns_reward(completions, asked_at, meta, **kwargs):
    assert all(isinstance(t, datetime.datetime) for t in asked_at) and all("tags" in m for m in meta)
    return [float(len(set(c[0]["content"]))) for c in completions]


def columns_trainer(tok, out, partial, steps=4, save_steps=None):
    trainer = make_trainer(tok, out, steps=steps, save_steps=save_steps, partial=partial)
    trainer.train_dataset = with_columns(trainer.train_dataset)
    trainer.reward_funcs = [seen_columns_reward]
    trainer.partial_future = partial_trl.TrlGroups(trainer)
    return trainer


def test_resume_with_a_datetime_column_and_a_smaller_oversample(char_tokenizer, tmp_path):
    """Checkpoint-2 of a run at oversample 3 holds rows with a datetime and a nested column, and 6 groups drawn
    ahead of TRL; resumed with oversample 0.5 (a pool of 3), those still train: none is counted skipped or
    unforeseen, and the pool ends empty."""
    straight = columns_trainer(char_tokenizer, tmp_path / "straight", dict(oversample=3.0, max_staleness=3),
                               steps=6, save_steps=2)
    straight.train()
    resumed = columns_trainer(char_tokenizer, tmp_path / "resumed", dict(oversample=0.5, max_staleness=3), steps=6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    pool = resumed.partial
    assert len(pool.groups) == 0 and pool.skipped == pool.mismatched == 0 and not pool.ahead
    assert pool.trained_samples == straight.partial.trained_samples == 6 * 8
    assert pool.capacity < straight.partial.capacity


def test_pool_rows_of_ordinary_types_survive_a_weights_only_load():
    pool = GroupPool(PartialRolloutConfig(), 2, 1, 1, 8)
    row = {"prompt": [{"role": "user", "content": "q"}], "when": datetime.datetime(2026, 1, 1, 0, 0, 1),
           "day": datetime.date(2026, 1, 1), "n": np.int64(7), "x": np.float32(0.25), "arr": np.arange(6.0).reshape(2, 3),
           "nested": {"list": [1, (2, "3")], 4: None}}
    pool.add([row, row], [1, 2, 3], 0)
    buffer = io.BytesIO()
    torch.save(pool.state_dict(), buffer)
    buffer.seek(0)
    copy = GroupPool(PartialRolloutConfig(), 2, 1, 1, 8)
    copy.load_state_dict(torch.load(buffer, weights_only=True))
    back = copy.groups[0].rows[0]
    assert back.keys() == row.keys() and np.array_equal(back.pop("arr"), row["arr"])
    assert back == {k: v for k, v in row.items() if k != "arr"}
    assert type(back["n"]) is np.int64 and type(back["x"]) is np.float32
    with pytest.raises(TypeError, match="a dataset row holds a builtins.object"):
        pool.add([{"prompt": "p", "bad": object()}] * 2, [1], 1)
        pool.state_dict()


def test_a_failed_round_leaves_the_pool_as_it_was(char_tokenizer, tmp_path, monkeypatch):
    trainer = make_trainer(char_tokenizer, tmp_path, steps=3)
    replica = partial_trl.TrlGroups(trainer)
    rows = replica() + replica()  # TRL's first generation batch
    partial_trl.run_round(trainer, rows)
    before, drawn = trainer.partial.state_dict(), trainer.partial_future.drawn

    def fail(*args, **kwargs):
        raise NonFiniteLogitsError("planted", 3, [0])

    monkeypatch.setattr(trainer.rollouts, "generate", fail)
    with pytest.raises(NonFiniteLogitsError):
        partial_trl.run_round(trainer, replica() + replica())
    assert trainer.partial.state_dict() == before and trainer.partial_future.drawn == drawn


def test_a_skipped_batch_leaves_no_group_untrained(char_tokenizer, tmp_path, monkeypatch):
    """on_nonfinite="skip_batch" skips round 2 (TRL's micro-step counter does not move): the drain still knows how
    many rounds are left, so the run ends with the pool empty and nothing unforeseen. The skipped batch's groups
    were drawn and train anyway, in place of TRL's last two, which the counter reports left out."""
    trainer = make_trainer(char_tokenizer, tmp_path, steps=4, on_nonfinite="skip_batch")
    generate, calls = trainer.rollouts.generate, []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise NonFiniteLogitsError("planted", 3, [0])
        return generate(*args, **kwargs)

    monkeypatch.setattr(trainer.rollouts, "generate", second_fails)
    trainer.train()
    pool = trainer.partial
    assert trainer.nonfinite_skipped == 1 and trainer.state.global_step == 4
    assert pool.mismatched == 0 and not pool.groups and not pool.ahead
    assert pool.trained_samples == 3 * 8 and pool.skipped == 2
