"""CheckpointMixin: atomic checkpoints that hold every state a step depends on, and exact resume.

A mixin for SpecGRPOTrainer and PPOTrainer (first in their bases). What it adds to the HF Trainer's
checkpoint (policy, optimizer, scheduler, RNG states of python/numpy/torch/the device, trainer_state.json
whose global_step is the data position) is rlspec_state.pt (rlspec_state_<rank>.pt with several
processes), docs/resume.md:

    engine          engine.state_dict(): policy_version, selector statistics, suffix/sibling history, the
                    learned drafter's weights, optimizer and training buffer (None for a backend without
                    state_dict, with a warning)
    rollout_calls   RolloutSource.calls: each rollout's sampling seed derives from it
    trainer         the trainer's own counters and generators (TRL's micro-step counter and generation
                    buffer; PPO's minibatch shuffle generator; skipped non-finite batches)
    sampler         the train sampler's generator at the start of the current epoch and now, so later
                    epochs draw the same permutations as an uninterrupted run

Atomic: the Trainer writes into tmp-checkpoint-N/checkpoint-N (its output-dir lookup is redirected while
saving), callbacks with a `write_checkpoint(checkpoint_dir, trainer)` method add their files there, the
completion marker goes in last, then one rename makes it checkpoint-N. Nothing is published from non-finite
weights (checked on the trainer's device first: the save is skipped with a line, so rotation never pushes a
finite checkpoint out); files are fsynced before the marker, which lists their sizes and the batch geometry
(a resume with another geometry is refused, GeometryChanged). With several processes each barrier of the save
is an agreement (trainers/run/save_agreement.py): a rank whose part fails (a full disk) makes every rank raise
CheckpointSaveFailed at once rather than leave them at the barrier until the collective timeout. Rotation
(trainers/run/checkpoint_dirs.py) never deletes the newest complete checkpoint. `train(resume_from_checkpoint=True)` resumes from the newest
complete checkpoint, reporting half-written ones it passes over; a named older checkpoint is a rollback
(trainers/run/resume_point.py). Every name written in output_dir is recorded first (trainers/run/run_files.py), TRL's
model card goes into the checkpoint rather than output_dir/README.md, train() holds output_dir's lock
(trainers/run/run_lock.py), and save_final_model writes the final model through a temporary directory.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

from rlspec.rollout.errors import NonFiniteLogitsError, RolloutBackendLost
from rlspec.trainers.run import checkpoint_dirs as dirs
from rlspec.trainers.run import run_files, run_lock
from rlspec.trainers.run.interrupts import (NonFiniteWeightsError, StopOnSignal, TrainingInterrupted, check_on_nonfinite,
                                        first_nonfinite_parameter, nonfinite_message, stop_on_signals, weights_finite)
from rlspec.trainers.run.resume_point import explicit_checkpoint, roll_back
from rlspec.trainers.run.save_agreement import CheckpointSaveFailed, agree, run_part

STATE_FORMAT = 1
# the batch geometry a checkpoint is tied to (those of these the trainer's args have)
GEOMETRY = ("per_device_train_batch_size", "gradient_accumulation_steps", "world_size", "steps_per_generation",
            "num_generations", "generation_batch_size", "num_iterations", "num_mini_batches", "num_ppo_epochs")


class GeometryChanged(ValueError):
    """A resume with another batch geometry than the checkpoint's (the keys are named). exit_code: the CLI's."""

    exit_code = 2


class CheckpointMixin:
    """Atomic checkpoints, rlspec state, resume, signals and the non-finite policy for an HF Trainer subclass.

    The trainer sets `self.on_nonfinite` ("stop" | "skip_batch") and `self.rollouts` (a RolloutSource, or None
    when it generates without the engine: SpecGRPOTrainer on TRL's generation, whose sampling state is the torch
    RNG the Trainer's own checkpoint saves), and may override `rlspec_trainer_state()` /
    `load_rlspec_trainer_state(state)` for its own counters."""

    _staging_run_dir: str | None = None
    _resumed_from: tuple[int, Path] | None = None  # (step, path): rotation keeps it until a newer one is complete
    on_nonfinite: str = "stop"
    nonfinite_skipped: int = 0

    def init_resilience(self, on_nonfinite: str) -> None:
        """Call in __init__ (before the Trainer's): the non-finite policy and the per-run bookkeeping."""
        self.on_nonfinite = check_on_nonfinite(on_nonfinite)
        self.nonfinite_skipped = 0
        self._pending_sampler_state = None
        self._epoch_sampler_state = None

    # -- train: resume resolution, signals, the stop path -------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """transformers' train(), plus: True resumes from the newest *complete* checkpoint (half-written ones
        are reported and skipped); SIGTERM/SIGINT stop at the step's end with a checkpoint, then raise
        TrainingInterrupted; non-finite logits follow on_nonfinite; a lost rollout backend (RolloutBackendLost)
        stops with a checkpoint of the last finished step. One process per output_dir (run_lock)."""
        lock = run_lock.hold(self.args.output_dir) if self.is_world_process_zero() else contextlib.nullcontext()
        with lock:
            return self._train_locked(resume_from_checkpoint, *args, **kwargs)

    def _train_locked(self, resume_from_checkpoint, *args, **kwargs):
        resume = self._resolve_resume(resume_from_checkpoint)
        stopper, sampler_cb = StopOnSignal(), _SamplerStateCallback(self)
        for cb in (stopper, sampler_cb):
            self.add_callback(cb)
        try:
            with stop_on_signals(stopper):
                output = super().train(resume, *args, **kwargs)
        except NonFiniteLogitsError as exc:
            raise self._stop_on_nonfinite(exc) from exc
        except RolloutBackendLost as exc:
            raise self._stop_on_backend_lost(exc) from exc
        finally:
            for cb in (stopper, sampler_cb):
                self.remove_callback(cb)
        if stopper.signum is not None and self.state.global_step < self.state.max_steps:
            done = Path(self._run_dir()) / dirs.checkpoint_name(self.state.global_step)
            raise TrainingInterrupted(stopper.signum, self.state.global_step,
                                      str(done) if dirs.is_complete(done) else None)
        return output

    def _resolve_resume(self, resume) -> str | None:
        """True -> the newest complete checkpoint of output_dir; a path must be a complete checkpoint, or one
        without rlspec's marker whose files verify. A path older than output_dir's newest checkpoint is a
        rollback: the newer ones are set aside (trainers/run/resume_point.py)."""
        self._resumed_from = None
        if resume is None or resume is False:
            return None
        if resume is True:
            path, skipped = dirs.find_resumable_checkpoint(self.args.output_dir)
            for s in skipped:
                print(f"rlspec: resume skips the {s.kind} {s}", file=sys.stderr, flush=True)
            if path is None:
                raise ValueError(f"no complete checkpoint in {self.args.output_dir} to resume from")
        else:
            path = explicit_checkpoint(resume)
            if self.args.should_save:
                roll_back(self.args.output_dir, path)
            self.accelerator.wait_for_everyone()
        self._check_geometry(Path(path))
        step = dirs.checkpoint_step(path)
        self._resumed_from = (step, Path(path)) if step is not None else None
        return str(path)

    def batch_geometry(self) -> dict:
        """The settings that index TRL's buffered inputs and the data position (recorded in the marker): a
        resume with others would draw a generation batch's slices, or the sampler's batches, wrongly."""
        args = self.args
        return {k: getattr(args, k) for k in GEOMETRY if isinstance(getattr(args, k, None), int)}

    def _check_geometry(self, path: Path) -> None:
        saved = (dirs.read_marker(path) or {}).get("geometry")
        if not isinstance(saved, dict):
            return  # a checkpoint of an older rlspec, or not rlspec's: nothing recorded to compare
        now = self.batch_geometry()
        changed = {k: (saved[k], now[k]) for k in saved.keys() & now.keys() if saved[k] != now[k]}
        if changed:
            what = ", ".join(f"{k}: {a} in the checkpoint, {b} now" for k, (a, b) in sorted(changed.items()))
            raise GeometryChanged(f"resume from {path}: the batch geometry differs ({what}). These settings place "
                                  "the data and the generation batch being consumed; resume with the checkpoint's "
                                  "values (the config and overrides of the run you continue), or start a new run "
                                  "in another output_dir.")

    def _stop_on_nonfinite(self, exc: NonFiniteLogitsError) -> NonFiniteLogitsError:
        """on_nonfinite=stop: keep the state before the failing step as a checkpoint, and return the error to
        raise (the failing step's number, the rows, the first non-finite layer, where the state is)."""
        step = self.state.global_step
        outcome = self._checkpoint_before_failing_step(first_nonfinite_parameter(self.model))
        error = NonFiniteLogitsError(nonfinite_message(exc, step + 1, outcome), exc.step, exc.rows, exc.first_bad)
        path = Path(self._run_dir()) / dirs.checkpoint_name(step)
        error.train_step, error.checkpoint = step + 1, str(path) if dirs.is_complete(path) else None
        return error

    def _stop_on_backend_lost(self, exc: RolloutBackendLost) -> RolloutBackendLost:
        """The rollout backend is gone (a Ray head, every worker): keep the state before the failing step as a
        checkpoint while this process still can (Ray ends it a while after its head is lost), then stop."""
        outcome = self._checkpoint_before_failing_step(None)
        return RolloutBackendLost(f"step {self.state.global_step + 1}: {exc}\nrlspec: {outcome}")

    def _checkpoint_before_failing_step(self, bad_param: str | None) -> str:
        """Save the state after the last finished step as checkpoint-<step> (a failing step applied nothing:
        its rollout comes first) and say where the run can continue from. bad_param: a non-finite parameter
        of the policy, in which case nothing is saved (it would only push good checkpoints out of the
        rotation)."""
        self.optimizer.zero_grad(set_to_none=True) if self.optimizer is not None else None
        step = self.state.global_step
        path = Path(self._run_dir()) / dirs.checkpoint_name(step)
        if bad_param is not None:
            newest, _ = dirs.find_resumable_checkpoint(self._run_dir())
            return (f"no checkpoint written: the policy's weights are already non-finite ({bad_param}); "
                    f"the newest complete checkpoint is {newest or 'none'}.")
        if dirs.is_complete(path):
            return f"the state after step {step} is checkpoint {path}."
        if self.args.world_size > 1:  # a failure path never enters a collective (rlspec/distributed.py)
            newest, _ = dirs.find_resumable_checkpoint(self._run_dir())
            return f"no checkpoint written (several processes); the newest complete one is {newest or 'none'}."
        self._save_checkpoint(self.model_wrapped, trial=None)
        return f"the state after step {step} (before the failing one) was saved to {path}."

    def guarded_step(self, step_fn, model, *args):
        """Run one training step; on non-finite logits with on_nonfinite=skip_batch, drop the batch (no
        gradient, so the optimizer step that follows changes nothing), count it in rollout/nonfinite_skipped
        and return a zero loss. With "stop" the error goes on up to train()."""
        try:
            return step_fn(model, *args)
        except NonFiniteLogitsError as exc:
            if self.on_nonfinite != "skip_batch":
                raise
            model.zero_grad(set_to_none=True)
            self.nonfinite_skipped += 1
            self._metrics["train"]["rollout/nonfinite_skipped"].append(float(self.nonfinite_skipped))
            print(f"rlspec: step {self.state.global_step + 1}: non-finite logits (rows {exc.rows[:8]}, first "
                  f"non-finite: {exc.first_bad or 'not located'}); on_nonfinite=skip_batch: batch skipped, "
                  f"{self.nonfinite_skipped} so far", file=sys.stderr, flush=True)
            return torch.zeros((), device=self.args.device)

    # -- saving ---------------------------------------------------------------------------------------------

    def _run_dir(self, trial=None) -> str:
        return super()._get_output_dir(trial)

    def _get_output_dir(self, trial) -> str:
        # while a checkpoint is written, the Trainer's checkpoint-N lands under tmp-checkpoint-N/
        return self._staging_run_dir or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint plus rlspec_state.pt and the callbacks' files, under a temporary name;
        then the completion marker and one rename; then rotation of complete checkpoints only."""
        run_dir, step = Path(self._run_dir(trial)), self.state.global_step
        staging, name = run_dir / f"{dirs.TMP_PREFIX}{step}", dirs.checkpoint_name(step)
        problem = self.nonfinite_weights(f"checkpoint-{step}")
        if problem is not None:  # never published: it would push finite checkpoints out of the rotation
            print(f"rlspec: {problem}", file=sys.stderr, flush=True)
            return
        # each barrier of the save is an agreement: a rank whose part failed (a full disk) tells the others at once
        self._agree(run_part(self._prepare_staging, run_dir, staging, name), step, staging)
        self._staging_run_dir = str(staging)
        try:
            error = run_part(super()._save_checkpoint, model, trial)
            if error is not None and self.args.world_size > 1 and self._sharded_save():
                # it failed inside a collective the others are still in: agreeing would hang this rank with them;
                # its exit ends them instead (torchrun)
                raise error
            error = error or run_part(self._write_own_parts, staging / name)
        finally:
            self._staging_run_dir = None
        self._agree(error, step, staging)
        self._agree(run_part(self._publish, staging, name, run_dir) if self.args.should_save else None, step, staging)

    def _prepare_staging(self, run_dir: Path, staging: Path, name: str) -> None:
        if self.args.should_save:
            run_files.record(run_dir, staging.name, name)  # before they exist: overwrite and rotation may delete them
            shutil.rmtree(staging, ignore_errors=True)  # a leftover of a run killed while writing this step

    def _sharded_save(self) -> bool:
        """The Trainer's save is a collective (DeepSpeed's engine save, FSDP's sharded state dict)."""
        return bool(getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False))

    def _write_own_parts(self, checkpoint_dir: Path) -> None:
        self._write_rlspec_state(checkpoint_dir)
        for cb in self.callback_handler.callbacks:
            if hasattr(cb, "write_checkpoint"):
                cb.write_checkpoint(str(checkpoint_dir), self)

    def _agree(self, error: BaseException | None, step: int, staging: Path) -> None:
        """A collective in place of a barrier: CheckpointSaveFailed on every rank when any rank's part failed."""
        try:
            agree(error, self.args.world_size, f"checkpoint-{step}",
                  lambda: dirs.find_resumable_checkpoint(self._run_dir())[0])
        except CheckpointSaveFailed:
            if self.args.should_save:
                shutil.rmtree(staging, ignore_errors=True)  # give back the space the partial copy took
            raise

    def nonfinite_weights(self, what: str) -> str | None:
        """None when every weight of the policy is finite; else a message saying that `what` (a checkpoint, the
        final model) is not written from them. On every process (one flag reduced across them)."""
        finite = weights_finite(self.model)
        if self.args.world_size > 1:
            flag = torch.tensor([0.0 if finite else 1.0], device=self.args.device)
            finite = float(self.accelerator.reduce(flag, reduction="sum").item()) == 0.0
        if finite:
            return None
        self._nonfinite_param = bad = first_nonfinite_parameter(self.model)
        newest, _ = dirs.find_resumable_checkpoint(self._run_dir())
        self._newest_finite = str(newest) if newest else None
        return (f"step {self.state.global_step}: the policy's weights are NaN/inf ({bad or 'on another process'}): "
                f"{what} was not written, so no finite checkpoint is rotated out; the newest complete checkpoint is "
                f"{newest or 'none'}. Fix the cause (a lower learning rate, max_grad_norm, dtype=float32, a reward "
                "that can be inf), then continue with resume=auto.")

    def _publish(self, staging: Path, name: str, run_dir: Path) -> None:
        # the files are fsynced before the marker, the marker last, the rename fsynced, then rotation
        dirs.write_marker(staging / name, self.state.global_step, current_wandb_run_id(), finite=True,
                          geometry=self.batch_geometry())
        dirs.publish(staging / name, run_dir / name)
        shutil.rmtree(staging, ignore_errors=True)
        best = self.state.best_model_checkpoint
        if best and str(staging) in best:  # the Trainer named the staging path
            self.state.best_model_checkpoint = best = best.replace(str(staging / name), str(run_dir / name))
        protect = [run_dir / name] + ([Path(best)] if best else [])
        if self._resumed_from is not None and self.state.global_step <= self._resumed_from[0]:
            protect.append(self._resumed_from[1])  # no newer checkpoint of this branch is complete yet
        dirs.rotate(run_dir, self.args.save_total_limit, protect=protect)

    def create_model_card(self, *args, **kwargs):
        """TRL writes its model card to <output_dir>/README.md at every checkpoint save, where it would overwrite
        a README of the user's: while a checkpoint is written, the card goes into that checkpoint instead."""
        if self._staging_run_dir is None:
            return super().create_model_card(*args, **kwargs)
        target = Path(self._staging_run_dir) / dirs.checkpoint_name(self.state.global_step)
        target.mkdir(parents=True, exist_ok=True)
        saved, self.args.output_dir = self.args.output_dir, str(target)
        try:
            return super().create_model_card(*args, **kwargs)
        finally:
            self.args.output_dir = saved

    def save_final_model(self, path: str | os.PathLike) -> None:
        """save_model into a temporary sibling directory, then one rename (a same-named directory is replaced
        whole, dirs.publish): a crash while saving never leaves a half-written final model. A collective under
        ZeRO-3: every process calls it."""
        final = Path(path)
        tmp = final.with_name(f"tmp-{final.name}")
        problem = self.nonfinite_weights(f"the final model {final}")
        if problem is not None:
            raise NonFiniteWeightsError(problem, self._nonfinite_param, self._newest_finite)
        if self.args.should_save:
            run_files.record(final.parent, tmp.name, final.name)
            shutil.rmtree(tmp, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self.save_model(str(tmp))
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            dirs.sync_tree(tmp)
            dirs.publish(tmp, final)
        self.accelerator.wait_for_everyone()

    def _write_rlspec_state(self, checkpoint_dir: Path) -> None:
        rollouts = self.rollouts
        state = {"format": STATE_FORMAT, "global_step": self.state.global_step,
                 "engine": engine_state(rollouts.engine) if rollouts is not None else None,
                 "rollout_calls": rollouts.calls if rollouts is not None else 0,
                 "trainer": {"nonfinite_skipped": self.nonfinite_skipped, **self.rlspec_trainer_state()},
                 "sampler": self._sampler_state()}
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        torch.save(state, checkpoint_dir / self._state_file())

    def _state_file(self) -> str:
        if self.args.world_size <= 1:
            return dirs.STATE_FILE
        return dirs.STATE_FILE.replace(".pt", f"_{self.args.process_index}.pt")

    def rlspec_trainer_state(self) -> dict:
        """The trainer's own state a step depends on, beyond the Trainer's checkpoint (override)."""
        return {}

    def load_rlspec_trainer_state(self, state: dict) -> None:
        """Restore what rlspec_trainer_state() returned (override)."""

    # -- loading --------------------------------------------------------------------------------------------

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        """The Trainer's loader (called on resume, before the first step) then rlspec_state.pt."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self._load_rlspec_state(Path(checkpoint))

    def _load_rlspec_state(self, checkpoint: Path) -> None:
        path = checkpoint / self._state_file()
        if not path.is_file():
            print(f"rlspec: {checkpoint} has no {path.name} (not written by rlspec?): the rollout engine's state "
                  "and the rollout seeds start afresh; the run will not match an uninterrupted one", file=sys.stderr)
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        if self.rollouts is None:
            if state["engine"] is not None:
                print(f"rlspec: {checkpoint} holds rollout engine state, but this run generates with TRL's own "
                      "generation: the engine state is not used", file=sys.stderr)
        else:
            if state["engine"] is not None:
                load_engine_state(self.rollouts.engine, state["engine"], checkpoint)
            self.rollouts.calls = int(state["rollout_calls"])
        self.nonfinite_skipped = int(state["trainer"].get("nonfinite_skipped", 0))
        self.load_rlspec_trainer_state(state["trainer"])
        self._pending_sampler_state = state["sampler"]

    # -- the train sampler's generator ----------------------------------------------------------------------

    def _sampler_state(self) -> dict | None:
        gen = sampler_generator(self.callback_handler.train_dataloader)
        if gen is None:
            return None
        return {"epoch_start": self._epoch_sampler_state, "now": gen.get_state()}


class _SamplerStateCallback(TrainerCallback):
    """At each epoch's start (before the dataloader draws the epoch's permutation): on resume, put back the
    generator state the saved run had for this epoch; then remember it for the next checkpoint."""

    def __init__(self, trainer: CheckpointMixin):
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, train_dataloader=None, **kwargs):
        trainer = self.trainer
        gen = sampler_generator(train_dataloader)
        pending, trainer._pending_sampler_state = trainer._pending_sampler_state, None
        if gen is None:
            return
        if pending is not None:
            per_epoch = max(len(train_dataloader) // max(args.gradient_accumulation_steps, 1), 1)
            # saved exactly at an epoch's end, this is the next epoch: its permutation comes from "now"
            at_boundary = state.global_step > 0 and state.global_step % per_epoch == 0
            saved = pending["now"] if at_boundary or pending["epoch_start"] is None else pending["epoch_start"]
            gen.set_state(saved)
        trainer._epoch_sampler_state = gen.get_state()


def sampler_generator(dataloader) -> torch.Generator | None:
    """The torch.Generator of the sampler behind a (possibly accelerate-wrapped) DataLoader, if it has one
    (TRL's RepeatSampler does; a RandomSampler without a generator does not)."""
    seen, todo = set(), [dataloader]
    while todo:
        obj = todo.pop(0)
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        gen = getattr(obj, "generator", None)
        if isinstance(gen, torch.Generator) and obj is not dataloader:
            return gen
        todo += [getattr(obj, a, None) for a in ("base_dataloader", "batch_sampler", "sampler")]
    return None


def engine_state(engine) -> dict | None:
    """engine.state_dict(), or None with a one-line warning for a backend that has none (Ray pool, vLLM)."""
    state_dict = getattr(engine, "state_dict", None)
    if state_dict is not None:
        try:
            return state_dict()
        except NotImplementedError:
            pass
    print(f"rlspec: the {type(engine).__name__} rollout backend has no state_dict: checkpoints leave out its "
          "speculation state (selector statistics, drafter history and training), which a resume starts afresh",
          file=sys.stderr)
    return None


def load_engine_state(engine, state: dict, checkpoint: Path) -> None:
    loader = getattr(engine, "load_state_dict", None)
    if loader is None:
        print(f"rlspec: the {type(engine).__name__} rollout backend cannot load the engine state saved in "
              f"{checkpoint}: its speculation state starts afresh", file=sys.stderr)
        return
    try:
        loader(state)
    except ValueError as exc:
        raise ValueError(f"resume from {checkpoint}: {exc}\nResume with the drafter/rollout settings the "
                         "checkpoint was written with.") from None


def current_wandb_run_id() -> str | None:
    """The W&B run this process logs to (the live run's id, else WANDB_RUN_ID), for the checkpoint marker."""
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    return getattr(run, "id", None) or os.environ.get("WANDB_RUN_ID")
