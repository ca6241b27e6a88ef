"""`python -m rlspec.train` on a tiny random Llama, for the resume tests: in-process or as a process to kill.

    python tests/rlspec/resume_driver.py MODEL_DIR [key=value ...]

runs rlspec.train.main with the tiny run's arguments plus the given overrides. The reward is "spread"
(distinct characters / 10), which differs between samples, so every step moves the policy and a resume
that lost any state would show in the weights. RLSPEC_TEST_HANG_AT_STEP=k makes the process write
<output_dir>/hanging and sleep when step k begins (after checkpoint k-1 is complete): the test then kills it
with SIGKILL at a known point. RLSPEC_TEST_PAUSE_AT_STEP=k writes <output_dir>/paused when step k begins and
sleeps a few seconds, then goes on: time for the test to send a signal that the step's end acts on.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def spread_reward(completions, **kwargs) -> list[float]:
    texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
    return [len(set(t)) / 10 for t in texts]


def register_reward(monkeypatch=None) -> None:
    """Add "spread" to the reward registry; with pytest's monkeypatch, only for the test (no leak into others)."""
    import rlspec.trainers.rewards as rewards

    if monkeypatch is None:
        rewards.REWARD_FUNCS["spread"] = spread_reward
    else:
        monkeypatch.setitem(rewards.REWARD_FUNCS, "spread", spread_reward)


def build_model(model_dir: Path) -> Path:
    """The tiny random Llama + char tokenizer of tests/trainers/conftest.py, saved once to model_dir."""
    from tests.trainers.conftest import build_char_tokenizer, build_tiny_llama

    if not (model_dir / "config.json").is_file():
        tok = build_char_tokenizer()
        build_tiny_llama(len(tok), tok.eos_token_id, tok.pad_token_id).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    return model_dir


def cli_args(model_dir: Path, trainer: str = "grpo") -> list[str]:
    """A short float32 run on CPU: a checkpoint every step, 8-token completions, lr large enough to move."""
    if trainer == "ppo":
        return ["config=ppo_math.yaml", f"model={model_dir}", "rewards=[spread]", "dtype=float32",
                "ppo.save_steps=1", "ppo.max_completion_length=8", "ppo.learning_rate=1e-3", "ppo.num_ppo_epochs=1",
                "ppo.value_warmup_steps=0", "data.num_examples=16", "rollout.max_model_len=256",
                "rollout.max_num_seqs=8", "ppo.extra.disable_tqdm=true"]
    return ["config=grpo_math.yaml", f"model={model_dir}", "rewards=[spread]", "dtype=float32", "grpo.save_steps=1",
            "grpo.max_completion_length=8", "grpo.learning_rate=1e-3", "data.num_examples=16",
            "rollout.max_model_len=256", "rollout.max_num_seqs=8", "grpo.extra.disable_tqdm=true"]


def hang_callback(step: int):
    """A TrainerCallback that, when step `step` begins, marks <output_dir>/hanging and sleeps (to be killed)."""
    from transformers import TrainerCallback

    class Hang(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == step:
                (Path(args.output_dir) / "hanging").write_text(str(os.getpid()))
                time.sleep(600)

    return Hang()


def pause_callback(step: int, seconds: float = 5.0):
    """A TrainerCallback that, when step `step` begins, marks <output_dir>/paused and sleeps `seconds`."""
    from transformers import TrainerCallback

    class Pause(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == step:
                (Path(args.output_dir) / "paused").write_text(str(os.getpid()))
                time.sleep(seconds)

    return Pause()


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(REPO))
    register_reward()
    import rlspec.train as train

    hang_at, pause_at = os.environ.get("RLSPEC_TEST_HANG_AT_STEP"), os.environ.get("RLSPEC_TEST_PAUSE_AT_STEP")
    if hang_at or pause_at:
        build = train.build_trainer

        def build_with_hook(cfg, out):
            trainer, summary_cb = build(cfg, out)
            trainer.add_callback(hang_callback(int(hang_at)) if hang_at else pause_callback(int(pause_at)))
            return trainer, summary_cb

        train.build_trainer = build_with_hook
    model_dir = build_model(Path(argv[0]))
    trainer = "ppo" if any(a == "trainer=ppo" for a in argv[1:]) else "grpo"
    return train.main(cli_args(model_dir, trainer) + [a for a in argv[1:] if a != "trainer=ppo"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
