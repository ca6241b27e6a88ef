"""The `e2e` section: GRPO steps end to end on the device, SpecGRPOTrainer against trl.GRPOTrainer (the class
a TRL user swaps), seconds per step and the phase split.

One greedy-stable random-weight model shape (SmolLM2-135M's with untied embeddings on a GPU: `make_greedy_stable`,
so the model's sampled continuation is its greedy one and a drafter's acceptance is known), over a carried
tokenizer's vocabulary (no hub there), the embedded arithmetic task. Arms, each on a fresh copy of the same model:

  trl          trl.GRPOTrainer (transformers' generation)
  spec         SpecGRPOTrainer, plain decoding in the engine
  spec-oracle  SpecGRPOTrainer with `SuccessorOracle` drafting k tokens every step at per-token acceptance a

Per arm: seconds per step (the median after the first, which holds the arm's warm-up) and per phase (rollout,
weight sync, old logprobs, rewards, loss forward, backward, optimizer: bench/dropin.py's PhaseClock), and the
engine's tokens per verify. A machine without TRL (the GPU machine's python3 has none unless carried,
docs/gpu.md#the-device-check-make-gpu-check) records the section as skipped, and why."""
from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path


def why_not(tokenizer: str | None) -> str | None:
    """Why the section cannot run here (None: it can)."""
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        return (f"trl/datasets are not importable ({e}); carry them (docs/gpu.md#the-device-check-make-gpu-check) "
                f"or run the section where they are installed")
    if not tokenizer or not Path(tokenizer).is_dir():
        return (f"no tokenizer directory ({tokenizer!r}); pass --tokenizer DIR (a carried copy of the embedded "
                f"model's tokenizer files)")
    return None


class SuccessorOracle:
    """Drafts a greedy-stable model's own continuation: token i after the pending one is successor^i of it,
    each replaced at random with probability 1 - accept (benchmark-only, never registered)."""

    name = "oracle"

    def __init__(self, successor, accept: float, seed: int = 0):
        self.successor, self.accept = [int(t) for t in successor], accept
        self.rng = random.Random(seed)

    def begin(self, groups) -> None:
        pass

    def finish(self, seq) -> None:
        pass

    def propose(self, seqs, max_tokens: list[int], width: int):
        from rlspec.rollout.speculation.drafters.base import Draft

        out = []
        for seq, cap in zip(seqs, max_tokens):
            t, chain = (seq.completion_ids or seq.prompt_ids)[-1], []
            for _ in range(cap):
                t = self.successor[t]
                chain.append(t if self.rng.random() < self.accept else self._other(t))
            out.append(Draft.chain(chain))
        return out

    def _other(self, token: int) -> int:
        t = self.rng.randrange(len(self.successor) - 1)
        return t + (t >= token)


def distinct_chars(completions, **kwargs) -> list[float]:
    """A reward random-weight samples differ on, so advantages and the update are nonzero."""
    return [float(len(set(c[0]["content"]))) for c in completions]


def one_arm(arm: str, cfg: dict, tok, device, dtype) -> dict:
    import trl

    from rlspec.bench.dropin import PhaseClock
    from rlspec.bench.gpucheck.common import build_hf, make_greedy_stable
    from rlspec.rollout.metrics import ACCEPT_LEN
    from rlspec.rollout.types import SpecConfig
    from rlspec.trainers.data import make_math_dataset
    from rlspec.trainers.grpo import SpecGRPOTrainer

    model = build_hf(cfg["shape"], dtype, device, vocab=len(tok))
    successor = make_greedy_stable(model)
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    with tempfile.TemporaryDirectory(prefix="rlspec-gpu-e2e-") as tmp:
        args = trl.GRPOConfig(output_dir=tmp, use_cpu=device.type == "cpu", bf16=device.type == "cuda", seed=0,
                              per_device_train_batch_size=cfg["batch"], num_generations=cfg["generations"],
                              max_completion_length=cfg["max_completion_length"], max_steps=cfg["steps"],
                              temperature=cfg["temperature"], logging_steps=1, learning_rate=1e-5, report_to=[],
                              save_strategy="no", disable_tqdm=True)
        common = dict(model=model, reward_funcs=[distinct_chars], args=args, processing_class=tok,
                      train_dataset=make_math_dataset(4 * cfg["batch"], seed=0))
        if arm == "trl":
            trainer = trl.GRPOTrainer(**common)
        else:
            kwargs = dict(max_model_len=512, max_num_seqs=cfg["batch"])
            spec = None
            if arm == "spec-oracle":
                kwargs["drafter"] = SuccessorOracle(successor, cfg["accept"])
                spec = SpecConfig(drafter="ngram", selector="always", num_draft_tokens=cfg["num_draft_tokens"],
                                  online_training=False)
            trainer = SpecGRPOTrainer(**common, spec_config=spec, engine_kwargs=kwargs)
        clock = PhaseClock(trainer)
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
        accept = [log[ACCEPT_LEN] for log in trainer.state.log_history if ACCEPT_LEN in log]
        engine = getattr(trainer, "engine", None)
        if engine is not None:
            engine.close()
    # the first step of each arm holds its warm-up (TRL's first generate, our graph captures and draft calibration):
    # a step's cost is the median of the later ones, the first reported beside it
    step_times = [log["step_time"] for log in trainer.state.log_history if "step_time" in log] or [wall / cfg["steps"]]
    steady = step_times[1:] or step_times
    phases = {p: statistics.mean(v[1:] or v) if v else 0.0 for p, v in clock.per_step(cfg["steps"]).items()}
    return dict(arm=arm, steps=cfg["steps"], wall_s=wall, step_s=statistics.median(steady), first_step_s=step_times[0],
                step_times_s=step_times, rollout_s=phases["rollout"], phases_s_per_step=phases,
                accept_len=sum(accept) / len(accept) if accept else None)


def run(cfg: dict, device, dtype, left, save) -> dict:
    """cfg: shape, tokenizer, steps, batch, generations, max_completion_length, accept, num_draft_tokens, arms,
    temperature (the model's greedy margin must dominate sampling at it: the oracle's acceptance is then a)."""
    why = why_not(cfg["tokenizer"])
    if why:
        print(f"e2e: skipped: {why}", flush=True)
        return {"skipped": why}
    import datasets
    import trl
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg["tokenizer"])
    # which TRL the arms ran: the machine's own, or the carried one (.cache/gpu_carry/site, `make gpu-carry`)
    ran = {m.__name__: {"version": m.__version__, "from": str(Path(m.__file__).parent.parent)} for m in (trl, datasets)}
    out = {"shape": cfg["shape"], "vocab": len(tok), "accept": cfg["accept"], "packages": ran, "rows": []}
    for arm in cfg["arms"]:
        if left() <= 0:
            break
        out["rows"].append(one_arm(arm, cfg, tok, device, dtype))
        r = out["rows"][-1]
        print(f"  {arm}: {r['step_s']:.2f} s a step (rollout {r['rollout_s']:.2f} s), accept_len {r['accept_len']}",
              flush=True)
        save(out)
    trl_row = next((r for r in out["rows"] if r["arm"] == "trl"), None)
    for r in out["rows"]:
        r["speedup_vs_trl"] = trl_row["step_s"] / r["step_s"] if trl_row else None
    return out
