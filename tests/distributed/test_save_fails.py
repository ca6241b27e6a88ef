"""A full disk on one of two processes during a checkpoint: every rank fails at once with the error named (and
with one process: a clear stop, nothing published).

Two ranks forked from this process (torch and transformers already imported, so they start in a moment), each a
CheckpointMixin trainer on a one-layer model under torch.distributed (gloo, a 60 s collective timeout), three
steps with a checkpoint each. Rank 1's torch.save raises ENOSPC from step 2's checkpoint on. Rank 0 must not wait
out the timeout at the save's barrier: both raise CheckpointSaveFailed naming rank 1 and ENOSPC (the CLI's
exit 1) well within it, and nothing of checkpoint-2 is published."""
from __future__ import annotations

import errno
import json
import multiprocessing
import os
import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
TIMEOUT_S = 60  # a regression fails at this collective timeout rather than hanging for 30 minutes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(out: Path, rank: int, port: int, report: Path, world: int = 2) -> None:
    """One rank (a forked child) of `world`, the last one's disk full: train, and write what it raised to report."""
    import torch
    from accelerate.state import AcceleratorState, PartialState
    from transformers import Trainer, TrainingArguments

    from rlspec.train import _planned_exit_code
    from rlspec.trainers.run.checkpoint import CheckpointMixin

    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    AcceleratorState._reset_state(True)  # the parent's single-process state came along with the fork
    PartialState._reset_state()
    torch.set_num_threads(1)

    class Line(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(2, 1)

        def forward(self, x, labels):
            return {"loss": ((self.w(x).squeeze(-1) - labels) ** 2).mean()}

    class Tiny(CheckpointMixin, Trainer):
        rollouts = None

        def __init__(self, **kwargs):
            self.init_resilience("stop")
            super().__init__(**kwargs)

    args = TrainingArguments(output_dir=str(out), max_steps=3, save_steps=1, per_device_train_batch_size=2,
                             use_cpu=True, ddp_backend="gloo" if world > 1 else None, ddp_timeout=TIMEOUT_S,
                             report_to=[], disable_tqdm=True, logging_strategy="no", seed=0)
    torch.manual_seed(0)
    trainer = Tiny(model=Line(), args=args, train_dataset=[{"x": torch.randn(2), "labels": torch.randn(())}
                                                            for _ in range(16)])
    if rank == world - 1:
        save = torch.save

        def full_disk(obj, f, *a, **kw):
            if trainer.state.global_step >= 2:
                raise OSError(errno.ENOSPC, "No space left on device", str(f))
            return save(obj, f, *a, **kw)

        torch.save = full_disk
    start, outcome = time.time(), {"rank": rank, "error": None}
    try:
        trainer.train()
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
        outcome.update(error=type(exc).__name__, message=str(exc), exit_code=_planned_exit_code(exc))
    outcome.update(seconds=round(time.time() - start, 1), step=trainer.state.global_step)
    report.write_text(json.dumps(outcome))


def _run_rank(out, rank, port, report, world) -> None:
    try:
        _rank(out, rank, port, report, world)
    except BaseException:  # noqa: BLE001 - the harness broke: the test shows why
        import traceback

        report.write_text(json.dumps({"rank": rank, "error": "harness", "message": traceback.format_exc()}))
    finally:
        os._exit(0)  # no atexit of the parent's (pytest's) in a forked child


def _forked_ranks(out: Path, tmp_path: Path, world: int) -> list[Path]:
    # imported before the fork, so the ranks start at once
    from transformers import Trainer, TrainingArguments  # noqa: F401

    import rlspec.train  # noqa: F401
    from rlspec.trainers.run.checkpoint import CheckpointMixin  # noqa: F401

    port, fork = _free_port(), multiprocessing.get_context("fork")
    reports = [tmp_path / f"rank{r}.json" for r in range(world)]
    procs = [fork.Process(target=_run_rank, args=(out, r, port, reports[r], world)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=TIMEOUT_S + 30)
    finally:
        for p in procs:
            p.kill() if p.is_alive() else None
    return reports


def test_enospc_on_one_rank_fails_every_rank_at_once_naming_it(tmp_path):
    out, start = tmp_path / "out", time.time()
    for report in _forked_ranks(out, tmp_path, 2):
        assert report.is_file(), f"{report.name} missing: the rank died or hung"
        r = json.loads(report.read_text())
        assert r["error"] == "CheckpointSaveFailed", r
        assert "rank 1: OSError (ENOSPC)" in r["message"] and "checkpoint-2" in r["message"], r
        assert f"newest complete checkpoint is {out / 'checkpoint-1'}" in r["message"], r
        assert r["exit_code"] == 1 and r["step"] == 2, r
        assert r["seconds"] < TIMEOUT_S / 2, r  # told at once, not at the collective timeout
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-1"]
    assert time.time() - start < TIMEOUT_S


def test_enospc_with_one_process_is_a_clear_stop_with_nothing_published(tmp_path):
    out = tmp_path / "out"
    (report,) = _forked_ranks(out, tmp_path, 1)
    r = json.loads(report.read_text())
    assert r["error"] == "CheckpointSaveFailed" and r["exit_code"] == 1, r
    assert r["message"].startswith("checkpoint-2 could not be written (OSError (ENOSPC): [Errno 28] No space left"), r
    assert "free space on the output_dir's disk" in r["message"], r
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-1"]
