"""Which distillation loss makes the EAGLE-3 drafter accept most at T=1 (issue 10), and the ceiling.

One data set, one budget per run:
1. collect: the target's own rollouts of training prompts (T=1, groups of --group, plain decoding);
   the drafter stages features, sampled tokens and the top-k of the target's distribution per
   position; the buffer is cached on disk so every run trains on the same data;
2. per run (a loss, or a loss with another lever): the same initial drafter trained
   --train-steps synchronous steps (DrafterTrainer.train_steps), then measured on held-out prompts:
   a chain of 4 sampled drafts at T=1, forced on every step (selector "always"): accepted tokens
   per verify (1 + accepted drafts), mean 1 - TV(p, q) at the first draft position (p = the
   target's processed law at the pending token, q = the law the first draft was sampled from),
   the target mass inside the draft vocabulary, and both by position in the completion;
3. ceiling (--ceiling): at the same positions, 1 - TV between the target and its own LM head read
   off the residual stream after fewer layers (an oracle-ish drafter that has the pending token's
   deep features, which a real drafter does not).
Runs accumulate in the JSON (one process per run keeps each one bounded); the PNG shows them all.

    python scripts/bench_distill.py --runs ce kl tv --ceiling     # or one run per process
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from common import math_prompts, parser, png, table, write_json
from bench_engine import completion_tokens

BUCKETS = [(0, 32), (32, 64), (64, 128), (128, 10**9)]
# run name -> DrafterTrainer overrides (and drafter overrides under "draft_vocab_size")
VARIANTS = {
    "ce": {"loss": "ce"}, "kl": {"loss": "kl"}, "tv": {"loss": "tv"}, "tv_kl": {"loss": "tv_kl"},
    "kl_noprompt": {"loss": "kl", "prompt_loss": False},
    "tv_noprompt": {"loss": "tv", "prompt_loss": False},
    "kl_ttt4": {"loss": "kl", "ttt_steps": 4},
    "kl_vocab16k": {"loss": "kl", "draft_vocab_size": 16384},
}


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--runs", nargs="*", default=["ce", "kl", "tv"], help=f"of {sorted(VARIANTS)}")
    p.add_argument("--ceiling", action="store_true", help="also measure the LM-head-after-fewer-layers ceiling")
    p.add_argument("--collect-prompts", type=int, default=48)
    p.add_argument("--group", type=int, default=4, help="samples per training prompt")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--topk", type=int, default=32, help="target distribution entries kept per position")
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-prompts", type=int, default=12)
    p.add_argument("--eval-max-new-tokens", type=int, default=256)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--eval-at", type=int, nargs="*", default=[],
                   help="also evaluate (chain of k) after these many steps: the learning curve")
    p.add_argument("--trees", type=int, nargs="*", default=[],
                   help="after training, also evaluate trees of these widths (each branch k deep, w x k nodes)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 beats 2 on a shared 2-core box)")
    p.add_argument("--cache", default=os.path.expanduser(os.environ.get("RLSPEC_CACHE", "~/.cache/rlspec")))
    p.add_argument("--load", default=None, help="evaluate this saved drafter (chain, --trees, --ceiling) as run "
                                                "'loaded', without collecting or training")
    p.add_argument("--save", default=None, help="export the last run's drafter here (EAGLE-3 directory), e.g. "
                                                "for bench_rollout.py --workload longtail --drafter-path")
    p.add_argument("--out", default="bench_out/distill.json")
    return p.parse_args(argv)


def collect(eng, args) -> dict:
    """The training data set: the target's rollouts, collected in chunks of 16 prompts, each cached
    under --cache/bench/ (a larger --collect-prompts reuses the chunks it shares with a smaller one)."""
    import torch

    from rollout.speculation.drafter_training import DrafterTrainer
    from rollout.speculation.selectors.base import OFF
    from rollout.types import SamplingParams

    chunks, t_total = [], 0.0
    for i in range(0, args.collect_prompts, 16):
        n = min(16, args.collect_prompts - i)
        key = hashlib.sha1(json.dumps([args.model, args.dtype, n, i, args.group, args.max_new_tokens,
                                       args.topk]).encode()).hexdigest()[:12]
        path = Path(args.cache) / "bench" / f"distill_chunk_{key}.pt"
        if not path.exists():
            trainer = DrafterTrainer(eng.speculation.learned, loss="kl", topk=args.topk,
                                     buffer_tokens=n * args.group * (args.max_new_tokens + 96))
            eng.speculation.attach_trainer(trainer)
            t0 = time.perf_counter()
            with eng.speculation.forced(OFF):  # plain decoding: cheapest
                eng.generate(math_prompts(eng.tokenizer, n, seed=100 + i),
                             SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, n=args.group,
                                            seed=100 + i), use_tqdm=True)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"buffer": trainer.buffer.state(), "bytes_per_token": trainer.buffer.bytes_per_token(),
                        "collect_s": time.perf_counter() - t0}, path)
        chunks.append(torch.load(path))
        t_total += chunks[-1]["collect_s"]
    segs = [(c["buffer"], s) for c in chunks for s in c["buffer"]["segments"]]
    return {"chunks": [c["buffer"] for c in chunks], "bytes_per_token": chunks[0]["bytes_per_token"],
            "tokens": sum(s[1] for _, s in segs), "samples": len(segs), "collect_s": t_total,
            "with_dist": int(sum(c["buffer"]["dist"]["has"].sum() for c in chunks))}


def load_data(buffer, data) -> None:
    """Replay every cached sample into a trainer's buffer, in collection order."""
    from rollout.speculation.feature_buffer import Dist

    for st in data["chunks"]:
        d = st["dist"]
        for start, n, ver, temp in st["segments"]:
            sl = slice(start, start + n)
            buffer.add(st["feats"][sl], [0] + st["next_tokens"][sl].tolist(), ver,
                       Dist(d["ids"][sl], d["probs"][sl], d["rest"][sl], d["has"][sl]), temp)


def _capacity(args) -> int:
    return args.collect_prompts * args.group * (args.max_new_tokens + 96)  # prompts are ~50-60 tokens


def train(eng, data, init_state, args, name, held_out=None) -> dict:
    """A fresh trainer on the cached data, from the same initial drafter; trained and published."""
    import torch

    from rollout.speculation.drafter_training import DrafterTrainer
    from rollout.speculation.drafters.eagle3_model import Eagle3Config, Eagle3Model

    opts = dict(VARIANTS[name])
    drafter = eng.speculation.learned
    vocab = opts.pop("draft_vocab_size", None)
    torch.manual_seed(0)
    base = init_state["model"]
    if vocab is not None:  # another draft vocabulary: another (fresh) network of the same init law
        model = Eagle3Model(Eagle3Config.for_target(drafter.target.cfg, vocab))
        drafter.model = model.to(device=base.fc.weight.device, dtype=base.fc.weight.dtype).eval()
    else:
        drafter.model = base
        base.load_state_dict(init_state["state"])
    drafter.version = 0  # the new trainer publishes from version 1
    trainer = DrafterTrainer(drafter, lr=args.lr, batch=8, window=64, buffer_tokens=_capacity(args),
                             publish_every=10**9, topk=args.topk, min_tokens=1, **opts)
    eng.speculation.attach_trainer(trainer)
    load_data(trainer.buffer, data)
    curve, learning = [], []
    marks = sorted({*(s for s in args.eval_at if 0 < s < args.train_steps), *range(50, args.train_steps, 50),
                    args.train_steps})
    for mark in marks:
        trainer.train_steps(mark - trainer.stats.steps)
        curve.append((trainer.stats.steps, float(trainer.stats.loss)))
        print(f"[{name}] step {trainer.stats.steps} loss {trainer.stats.loss:.3f} "
              f"({trainer.stats.train_time_s:.0f} s)", flush=True)
        if mark in args.eval_at and mark < args.train_steps:
            trainer.publish()
            ev = evaluate(eng, held_out, args)
            learning.append({"steps": mark, "accept_len": ev["accept_len"],
                             "one_minus_tv_pos1": ev["one_minus_tv_pos1"]})
            print(f"[{name}] step {mark}: {ev['accept_len']:.3f} accepted / verify", flush=True)
    trainer.publish()
    return {"train_steps": trainer.stats.steps, "final_loss": float(trainer.stats.loss), "loss_curve": curve,
            "train_time_s": trainer.stats.train_time_s, "learning_curve": learning, **VARIANTS[name]}


def evaluate_trees(eng, prompts, args) -> dict:
    """Accepted tokens per verify with forced trees: w branches of k drafts each below the root."""
    from rollout.speculation.selectors.base import Arm

    out = {}
    for w in args.trees:
        with eng.speculation.forced(Arm("eagle3", args.k * w, w)):
            ev = evaluate(eng, prompts, args)
        out[str(w)] = {"nodes": args.k * w, "accept_len": ev["accept_len"], "verifies": ev["verifies"]}
        print(f"tree {w} x {args.k}: {ev['accept_len']:.3f} accepted / verify", flush=True)
    return out


def evaluate(eng, prompts, args, ceiling_layers=()) -> dict:
    """Generate the held-out prompts with a forced chain of k sampled drafts; per verify record the
    completion position, the accepted drafts, 1 - TV at the first draft and (ceiling_layers) 1 - TV of
    the target's LM head on the pending token's residual after those layers."""
    import torch

    from rollout.runtime.sampling import probs_from_logits
    from rollout.types import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=args.eval_max_new_tokens, seed=1)
    spec, runner, target = eng.speculation, eng.runner, eng.model
    recs, drafts_box = [], {}
    propose, observe, step = spec.propose, spec.observe_verify, runner.step
    vocab = None

    def spy_propose(arm, seqs, caps):
        drafts_box["d"] = propose(arm, seqs, caps)
        return drafts_box["d"]

    def spy_step(tokens, start, depths=None, tree_mask=None, hidden_layers=()):
        return step(tokens, start, depths, tree_mask, tuple(hidden_layers) + tuple(ceiling_layers))

    def spy_observe(seqs, hiddens, path, acc, logits):
        p = probs_from_logits(logits[:, 0].float(), params)  # [B, V] the law of the first draft's token
        oracle = {}
        with torch.no_grad():
            for layer in ceiling_layers:
                h = hiddens[layer][:, 0]
                lg = target.lm_head(target.model.norm(h)).float().cpu()
                oracle[layer] = torch.minimum(p, probs_from_logits(lg, params)).sum(-1).tolist()
        for i, (s, d) in enumerate(zip(seqs, drafts_box["d"])):
            rec = {"pos": s.cache_len - len(s.prompt_ids), "drafted": len(d), "accepted": acc[i],
                   "in_vocab": float(p[i, vocab].sum())}
            if len(d) and d.q is not None:
                rec["overlap1"] = float(torch.minimum(p[i], d.q[0].float()).sum())
            rec.update({f"oracle_{layer}": oracle[layer][i] for layer in ceiling_layers})
            recs.append(rec)
        return observe(seqs, hiddens, path, acc, logits)

    spec.learned.swap_latest()  # take the trained weights (and draft vocabulary) in now, as propose would
    m = spec.learned.model
    vocab = m.to_target(torch.arange(m.cfg.draft_vocab_size, device=m.d2t.device)).cpu()
    spec.propose, spec.observe_verify, runner.step = spy_propose, spy_observe, spy_step
    try:
        t0 = time.perf_counter()
        out = eng.generate(prompts, params)
        stats = eng.stats()
    finally:
        spec.propose, spec.observe_verify, runner.step = propose, observe, step
    spec_recs = [r for r in recs if r["drafted"] > 0]
    res = summarize(spec_recs, ceiling_layers)
    res.update({"engine_accept_len": stats.get("rollout/accept_len", 1.0), "eval_s": time.perf_counter() - t0,
                "completion_tokens": completion_tokens(out),
                "by_position": {f"{lo}-{hi - 1}" if hi < 10**9 else f"{lo}+":
                                summarize([r for r in spec_recs if lo <= r["pos"] < hi], ceiling_layers)
                                for lo, hi in BUCKETS}})
    return res


def summarize(recs, ceiling_layers=()) -> dict:
    n = len(recs)
    if n == 0:
        return {"verifies": 0}
    mean = lambda key: sum(r[key] for r in recs if key in r) / max(sum(key in r for r in recs), 1)  # noqa: E731
    out = {"verifies": n, "accept_len": 1.0 + mean("accepted"), "one_minus_tv_pos1": mean("overlap1"),
           "p_mass_in_draft_vocab": mean("in_vocab"),
           "accept_len_full_chains": 1.0 + sum(r["accepted"] for r in recs if r["drafted"] == 4)
           / max(sum(r["drafted"] == 4 for r in recs), 1)}
    out.update({f"one_minus_tv_lmhead_after_{layer}_layers": mean(f"oracle_{layer}") for layer in ceiling_layers})
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from rollout.engine import RolloutEngine
    from rollout.types import SpecConfig

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = SpecConfig(drafter="eagle3", selector="always", num_draft_tokens=args.k, online_training=False)
    eng = RolloutEngine.from_pretrained(args.model, spec=spec, dtype=args.dtype, max_model_len=512)
    base = eng.speculation.learned.model
    init_state = {"model": base, "state": {k: v.clone() for k, v in base.state_dict().items()}}
    held_out = math_prompts(eng.tokenizer, args.eval_prompts, seed=12345)
    result = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {"runs": {}}
    result["config"] = vars(args)
    L = eng.model.cfg.num_layers
    if args.load and args.runs:
        raise SystemExit("--load evaluates a saved drafter: give it no --runs")
    if args.load:
        from rollout.speculation.drafters.eagle3_io import read_metadata
        from rollout.speculation.warm_start import load_cached

        if not load_cached(eng, args.load):
            raise SystemExit(f"no drafter for this target at {args.load}")
        run = {"loaded_from": args.load, "metadata": read_metadata(args.load), **evaluate(eng, held_out, args)}
        if args.trees:
            run["trees"] = evaluate_trees(eng, held_out, args)
        result["runs"]["loaded"] = run
        write_json(args.out, result)
    else:
        data = collect(eng, args)
        result["data"] = {k: v for k, v in data.items() if k != "chunks"}
    for name in args.runs:
        run = train(eng, data, init_state, args, name, held_out)
        run.update(evaluate(eng, held_out, args))
        if args.trees:
            run["trees"] = evaluate_trees(eng, held_out, args)
        if args.save:
            eng.export_drafter(args.save, metadata={"bench_distill_run": name, "train_steps": run["train_steps"]})
        result["runs"][name] = run
        print(table([_row(name, run)], list(_row(name, run))), flush=True)
        write_json(args.out, result)
    if args.ceiling:
        layers = (L - 3, L - 2, L - 1)
        c = evaluate(eng, held_out, args, ceiling_layers=layers)
        result["ceiling"] = {"note": "1 - TV(p, softmax(lm_head(norm(h_l)))) at the pending token, where h_l is "
                                     "the target's residual stream after l of its layers (HF hidden_states[l])",
                             "num_layers": L, "drafter": args.runs[-1] if args.runs else "untrained",
                             **{k: v for k, v in c.items()}}
        print(json.dumps({k: v for k, v in c.items() if "lmhead" in k}, indent=1))
        write_json(args.out, result)
    rows = [_row(n, r) for n, r in result["runs"].items()]
    print(table(rows, list(rows[0])) if rows else "no runs yet")
    plot(result, args.out.replace(".json", ".png"))
    return result


def _row(name, r) -> dict:
    steps = r.get("train_steps", r.get("metadata", {}).get("train_steps"))
    row = {"run": name, "steps": steps, "accept/verify": r["accept_len"],
           "1-TV@1": r["one_minus_tv_pos1"], "p in vocab": r["p_mass_in_draft_vocab"]}
    for b, v in r["by_position"].items():
        row[f"acc {b}"] = v.get("accept_len", float("nan"))
    return row


def plot(result, path) -> None:
    """Accepted tokens per verify and 1 - TV at draft 1 per run (with the ceiling's lines), and the accepted
    tokens by position in the completion."""
    runs = result["runs"]
    if not runs:
        return
    with png(path, 1, 2, figsize=(11, 4)) as (fig, (a1, a2)):
        names = list(runs)
        x = range(len(names))
        a1.bar([i - 0.2 for i in x], [runs[n]["accept_len"] for n in names], 0.4, label="accepted tokens / verify")
        a1.bar([i + 0.2 for i in x], [runs[n]["one_minus_tv_pos1"] * 5 for n in names], 0.4,
               label="1 - TV at draft 1 (x5)")
        c = result.get("ceiling", {})
        for key, style in (("one_minus_tv_lmhead_after_%d_layers" % (c.get("num_layers", 0) - 1), "--"),
                           ("one_minus_tv_lmhead_after_%d_layers" % (c.get("num_layers", 0) - 2), ":")):
            if key in c:
                a1.axhline(c[key] * 5, ls=style, color="gray",
                           label=key.replace("one_minus_tv_", "ceiling ") + " (x5)")
        a1.set_xticks(list(x), names, rotation=20)
        a1.set_title("chain of 4, T=1, held-out prompts")
        a1.legend(fontsize=7)
        for n in names:
            bp = runs[n]["by_position"]
            pts = [(i, v["accept_len"]) for i, v in enumerate(bp.values()) if v.get("verifies")]
            a2.plot(*zip(*pts), marker="o", label=n)
        a2.set_xticks(range(len(BUCKETS)), list(runs[names[0]]["by_position"]))
        a2.set_xlabel("position in the completion")
        a2.set_ylabel("accepted tokens / verify")
        a2.legend(fontsize=7)
        a2.grid(alpha=0.3)


if __name__ == "__main__":
    main()
