"""`python -m rlspec.train` with checks, for tests/distributed/test_accelerate.py to start under `accelerate launch`.

    accelerate launch --config_file configs/accelerate/zero3.yaml tests/distributed/run_checked.py \\
        <report dir> <expected zero stage or "none"> config=grpo_math.yaml model=... [key=value ...]

Runs rlspec.train.main unchanged, with test-only additions:
- a `spread` reward (distinct characters / 10) that differs between samples, so GRPO's advantages are not
  zero and the policy really moves between syncs (with the embedded task's accuracy on a random model
  every reward is 0 and a sync would compare two copies of the initial weights);
- after every weight push into this rank's engine, the engine's weights are compared with a runtime
  model built from the gathered policy (exact equality: same conversion, same dtype), the number of
  ZeRO-3 gathers with the planned groups, and the weights with the engine's copy before the first push
  (they must differ: the check is not vacuous);
- a record of this rank's drafter warm start;
- RLSPEC_TEST_FAIL_AT=k (and RLSPEC_TEST_FAIL_RANK=r) makes the reward raise at its k-th call (on rank r),
  to try the crash path by hand.
Each rank writes <report dir>/rank<i>.json; any failed check raises, so the process exits non-zero.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


_CALLS = []


def spread_reward(completions, **kwargs) -> list[float]:
    # RLSPEC_TEST_FAIL_AT=k [RLSPEC_TEST_FAIL_RANK=r]: raise at the k-th call (on rank r only), to try the crash path
    _CALLS.append(1)
    fail_at, fail_rank = os.environ.get("RLSPEC_TEST_FAIL_AT"), os.environ.get("RLSPEC_TEST_FAIL_RANK")
    if fail_at and len(_CALLS) == int(fail_at) and fail_rank in (None, os.environ.get("RANK")):
        raise RuntimeError(f"test failure in the reward on rank {os.environ.get('RANK')}")
    texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
    return [len(set(t)) / 10 for t in texts]


def synced_policy(trainer):
    """The bare HF model the trainer pushes into its engine (PPO's sits inside its policy+value wrapper)."""
    from rlspec.trainers.weight_sync import unwrap_model

    return trainer.policy if hasattr(trainer, "policy") else unwrap_model(trainer.model, trainer.accelerator)


def engine_matches_policy(trainer, record: dict, initial: dict) -> None:
    """Compare this rank's engine with the gathered policy right after a push (a collective under ZeRO-3:
    every rank pushes at the same step, so every rank reaches it)."""
    import torch

    from rlspec.rollout.runtime.model import loader
    from rlspec.trainers.weight_sync import NamedWeights, gathered_model

    engine, syncer = trainer.engine, trainer.weight_syncer
    policy = synced_policy(trainer)
    planned = len(NamedWeights(policy, trainer.accelerator, syncer.bucket_bytes).groups)
    with gathered_model(policy):  # the engine's own conversion of the whole policy, in the engine's dtype
        expected = dict(loader.from_hf_model(policy, dtype=next(engine.model.parameters()).dtype).named_parameters())
    actual = dict(engine.model.named_parameters())
    assert actual.keys() == expected.keys(), f"engine params {sorted(actual)} != policy's {sorted(expected)}"
    bad = [n for n in actual if not torch.equal(actual[n], expected[n])]
    assert not bad, f"after push {engine.policy_version} the engine differs from the gathered policy in {bad}"
    moved = [n for n in actual if not torch.equal(actual[n], initial[n])]
    assert moved, "the policy did not move between syncs: the equality check would prove nothing"
    record["syncs_checked"].append({"gathers": syncer.last_gathers,
                                    "planned_groups": planned, "params": len(list(policy.parameters())),
                                    "moved": len(moved), "policy_version": engine.policy_version})
    assert syncer.last_gathers == (planned if record["zero_stage"] == 3 else 0), record["syncs_checked"][-1]


def instrument(trainer, record: dict) -> None:
    """Wrap this rank's engine.load_weights with the check (after the push it makes)."""
    import rlspec.trainers.weight_sync as weight_sync

    engine = trainer.engine
    initial = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    load = engine.load_weights
    pushed = []  # the NamedWeights of each push: load_weights receives a plain iterator over it
    make = weight_sync.iter_named_weights
    weight_sync.iter_named_weights = lambda *a, **kw: pushed.append(make(*a, **kw)) or pushed[-1]

    def checked_load(named_tensors):
        load(named_tensors)
        # the syncer sets last_gathers after load_weights returns; count this push's gathers here
        trainer.weight_syncer.last_gathers = pushed[-1].gathers if pushed else 0
        engine_matches_policy(trainer, record, initial)

    engine.load_weights = checked_load


def skip_deepspeed_shm_op() -> None:
    """Keep DeepSpeed's CPU collectives on plain gloo: its shared-memory all-reduce op is compiled on first use
    (~50 s of CPU on the 2-core CI machine, and a C++ compiler), a CPU-only speed-up these checks do not need.
    DeepSpeed reads the flag from this dict (deepspeed.comm.torch.build_shm_op)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def main() -> int:
    report_dir, expected_stage, argv = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    skip_deepspeed_shm_op()
    import rlspec.train as train
    import rlspec.trainers.rewards as rewards
    from rlspec.distributed import zero_stage

    rewards.REWARD_FUNCS["spread"] = spread_reward
    record: dict = {"syncs_checked": []}
    build, warm = train.build_trainer, train.warm_start_drafter

    def build_and_instrument(cfg, out):
        trainer, summary_cb = build(cfg, out)
        record.update(rank=trainer.args.process_index, world_size=trainer.args.world_size,
                      zero_stage=zero_stage(trainer), distributed_type=str(trainer.accelerator.distributed_type))
        instrument(trainer, record)
        return trainer, summary_cb

    def record_warm(cfg, trainer):
        record["warm_start"] = warm(cfg, trainer)
        return record["warm_start"]

    train.build_trainer, train.warm_start_drafter = build_and_instrument, record_warm
    rc = train.main(argv)
    record["rc"] = rc
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / f"rank{record['rank']}.json").write_text(json.dumps(record, indent=2, default=str))
    want = None if expected_stage == "none" else int(expected_stage)
    assert record["zero_stage"] == want, f"ran under ZeRO stage {record['zero_stage']}, expected {want}"
    assert record["world_size"] == 2 and record["syncs_checked"], record
    return rc


if __name__ == "__main__":
    sys.exit(main())
