"""GRPO's training passes over a long-tail batch: TRL's padded pass against SpecGRPOTrainer's trimmed one.

TRL runs the policy over every completion of a batch up to the batch's longest, in the old-logprob pass and in the
loss's forward and backward; SpecGRPOTrainer cuts the right padding in chunks of similar length
(trainers/trimmed_logps.py). One batch of the embedded model's shape, completion lengths of a long-tail GRPO batch
(--lengths: one sample at the cap, the rest spread below it, as the partial benchmark's runs), float32 weights
under bf16 autocast (GRPOConfig(bf16=True), as `dropin`; --precision fp32: none); each pass timed --reps times,
alternating: a no-grad pass (the old logprobs) and a forward + backward of a masked sum (the loss's shape).

    python -m rlspec.bench passes
    # a CPU without native bf16, as oneDNN and ATen see one with their ISA capped (docs/sampling_dtype.md)
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python -m rlspec.bench passes --precision fp32 ...
"""
from __future__ import annotations

import statistics
import tempfile
import time

from rlspec.bench import harness
from rlspec.bench.common import EMBEDDED, smoke_model

NAME = "passes"
HELP = "GRPO training passes on a long-tail batch: TRL's padded pass vs the trimmed one (seconds, tokens computed)"


def add_arguments(p) -> None:
    p.add_argument("--model", default=EMBEDDED)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 410, 330, 260, 210, 160, 120, 80],
                   help="completion lengths of the batch's rows (the longest sets TRL's padded width)")
    p.add_argument("--prompt-len", type=int, default=80)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                   help="bf16: float32 weights under bf16 autocast (GRPOConfig(bf16=True)); fp32: no autocast")


def run(args) -> dict:
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlspec.rollout.runtime.model.fetch import fetch_model
    from rlspec.trainers.data import load_dataset_by_name
    from rlspec.trainers.grpo import SpecGRPOTrainer

    lengths = [max(1, n // 16) for n in args.lengths] if args.smoke else args.lengths
    path = fetch_model(smoke_model(args.model, args.out) if args.smoke else args.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as out:
        cfg = trl.GRPOConfig(output_dir=out, bf16=args.precision == "bf16" and not args.smoke, use_cpu=True,
                             per_device_train_batch_size=len(lengths),
                             num_generations=len(lengths), max_completion_length=max(lengths), report_to="none")
        trainer = SpecGRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                                  args=cfg, processing_class=tok, train_dataset=load_dataset_by_name("embedded_math",
                                  num_examples=16, seed=args.seed))
        width = max(lengths)
        g = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(3, len(tok), (len(lengths), args.prompt_len + width), generator=g)
        mask = torch.zeros_like(ids)
        mask[:, :args.prompt_len] = 1
        for r, n in enumerate(lengths):
            mask[r, args.prompt_len:args.prompt_len + n] = 1
        real = mask[:, args.prompt_len:].bool()
        passes = {"trl_padded": super(SpecGRPOTrainer, trainer)._get_per_token_logps_and_entropies,
                  "trimmed": trainer._get_per_token_logps_and_entropies}
        times = {(name, kind): [] for name in passes for kind in ("no_grad", "fwd_bwd")}
        model.train()
        for _ in range(args.reps if not args.smoke else 1):
            for name, fn in passes.items():
                with torch.no_grad():
                    t0 = time.perf_counter()
                    fn(model, ids, mask, width)
                    times[(name, "no_grad")].append(time.perf_counter() - t0)
                model.zero_grad()
                t0 = time.perf_counter()
                lp, _, _ = fn(model, ids, mask, width, compute_entropy=True)
                (lp * real).sum().backward()
                times[(name, "fwd_bwd")].append(time.perf_counter() - t0)
        frac = trainer._metrics["train"]["train/logps_token_frac"][-1]
    rows = [dict(pass_=name, no_grad_s=statistics.median(times[(name, "no_grad")]),
                 fwd_bwd_s=statistics.median(times[(name, "fwd_bwd")]),
                 tokens_frac=1.0 if name == "trl_padded" else frac) for name in passes]
    for r in rows:
        r["speedup"] = (rows[0]["no_grad_s"] + rows[0]["fwd_bwd_s"]) / (r["no_grad_s"] + r["fwd_bwd_s"])
    return dict(rows=rows, columns=["pass_", "no_grad_s", "fwd_bwd_s", "tokens_frac", "speedup"],
                lengths=lengths, prompt_len=args.prompt_len,
                ratios={"trimmed_speedup": rows[1]["speedup"]})
