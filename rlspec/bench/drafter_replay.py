"""What the model-free drafters would be accepted for on GRPO-shaped rollouts (`python -m rlspec.bench drafter --part
replay`).

--epochs rollouts of the same --prompts prompts of the embedded math data x --group samples each, at T = 1 until EOS
(at most --max-new-tokens), decoded plainly; then every drafter proposes --k tokens at every position of every
sample, the samples of a prompt in lockstep (position t of each, the siblings at t too, finished ones whole), prompt
after prompt and epoch after epoch, as a GRPO run meets them, and a draft counts the tokens it shares with what the
sample went on to be. Deterministic drafts are verified by drawing and matching
(docs/verification.md#deterministic-drafts): each position's token is drawn from the target's law given the text before
it and a draft token is accepted where it equals that draw, so what a verify at that position accepts has the law
of that common prefix. Per epoch and drafter: accepted tokens a position, the share of positions it drafted at,
and accepted tokens per drafted token. The drafters: the host n-gram and suffix drafters (their `propose`, fed as the
engine feeds them: one drafter for the whole run, so suffix has the earlier prompts' samples in its global window and
a prompt's earlier epochs in its history) and the device lookup (drafters/ngram_device.py `lookup`, the computation
its proposals run) over the sample's own text, with its siblings', and with its siblings' and the prompt's earlier
samples (the drafter's default: its `PromptHistory`, kept over the run and filled as samples finish), and suffix's
drafts with the last one's where suffix has none.
"""
from __future__ import annotations

# the last: suffix's draft where it drafts, the device lookup's (with siblings) where it does not, as the suffix_device
# drafter proposes (a verify pads every row to the step's longest draft: the fallback costs no nodes)
DRAFTERS = ("ngram", "suffix", "ngram_device_own", "ngram_device_siblings", "ngram_device", "suffix_device")


def rollouts(args) -> list[list[tuple[list[int], list[list[int]]]]]:
    """Per epoch, (prompt, the group's completions) of a plain sampled rollout of the embedded model."""
    from rlspec.bench.common import math_prompts
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.types import SamplingParams

    engine = RolloutEngine.from_pretrained(args.model, dtype=args.dtype, max_num_seqs=args.prompts * args.group,
                                           max_model_len=1024)
    prompts = math_prompts(engine.tokenizer, args.prompts, seed=args.seed)
    epochs = []
    for epoch in range(args.epochs):
        out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens,
                                                      n=args.group, seed=args.seed + epoch))
        epochs.append([(list(p), [out[i * args.group + g].completion_ids for g in range(args.group)])
                       for i, p in enumerate(prompts)])
    return epochs


def replay(groups, k: int, host: dict | None = None, history=None) -> dict[str, list[float]]:
    """Per drafter: [accepted tokens, positions, positions drafted, drafted tokens] over every group (prompt index,
    prompt, completions). host: the host drafters by name, and history: the device lookup's PromptHistory, kept from
    one call to the next (new ones by default)."""
    import torch

    from rlspec.rollout.runtime.sequence import Sequence
    from rlspec.rollout.speculation.drafters.base import make_drafter
    from rlspec.rollout.speculation.drafters.ngram_device import DeviceNgramDrafter, lookup

    host = host if host is not None else {name: make_drafter(name) for name in ("ngram", "suffix")}
    history = history if history is not None else DeviceNgramDrafter().history
    totals = {name: [0.0, 0, 0, 0] for name in DRAFTERS}

    def count(name, draft, cont):
        t = totals[name]
        a = 0
        while a < min(len(draft), len(cont)) and draft[a] == cont[a]:
            a += 1
        t[0], t[1], t[2], t[3] = t[0] + a, t[1] + 1, t[2] + (len(draft) > 0), t[3] + len(draft)

    for index, prompt, comps in groups:
        G = len(comps)
        earlier = [t.tolist() for t in history.texts(prompt, history.per_prompt)]  # oldest first, as the drafter
        seqs = {name: [Sequence(index, g, list(prompt), 10**6, completion_ids=[comps[g][0]]) for g in range(G)]
                for name in host}
        for name, d in host.items():
            d.begin([seqs[name]])
        for t in range(1, max(map(len, comps))):
            live = [g for g in range(G) if t < len(comps[g])]
            if not live:
                break
            conts = [comps[g][t:t + k] for g in live]
            proposed = {name: [draft.tokens for draft in d.propose([seqs[name][g] for g in live], [k] * len(live), 1)]
                        for name, d in host.items()}
            for name, drafts in proposed.items():
                for cont, draft in zip(conts, drafts):
                    count(name, draft, cont)
            texts = earlier + [prompt + c[:t] for c in comps]  # each sample's text at step t (a finished one: whole)
            L = max(map(len, texts))
            docs = torch.tensor([[x + [0] * (L - len(x)) for x in texts]], dtype=torch.int32).expand(len(live), -1, -1)
            lens = torch.tensor([len(x) for x in texts]).expand(len(live), -1)
            own = torch.tensor(live) + len(earlier)
            drafts, _ = lookup(docs, lens, own, 4, k)
            sib, _ = lookup(docs[:, len(earlier):], lens[:, len(earlier):], own - len(earlier), 4, k)
            rows = torch.arange(len(live))
            alone, _ = lookup(docs[rows, own][:, None], lens[rows, own][:, None], torch.zeros_like(own), 4, k)
            for cont, both, sibs, mine, suffix in zip(conts, drafts.tolist(), sib.tolist(), alone.tolist(),
                                                      proposed["suffix"]):
                count("ngram_device", both, cont)
                count("ngram_device_siblings", sibs, cont)
                count("ngram_device_own", mine, cont)
                count("suffix_device", suffix or both, cont)
            for name in host:  # the sample takes its next token; one that ends is finished
                for g in live:
                    s = seqs[name][g]
                    s.completion_ids.append(comps[g][t])
                    if t + 1 == len(comps[g]):
                        s.finish_reason = "stop"
                        host[name].finish(s)
            for g in live:
                if t + 1 == len(comps[g]):
                    history.add(prompt, comps[g])
    return totals


def run_replay(args) -> dict:
    from rlspec.rollout.speculation.drafters.base import make_drafter

    from rlspec.rollout.speculation.drafters.ngram_device import DeviceNgramDrafter

    host = {name: make_drafter(name) for name in ("ngram", "suffix")}  # the whole run's: suffix remembers
    history = DeviceNgramDrafter().history  # and so does the device lookup, its default bounds
    rows, lengths = [], []
    for epoch, groups in enumerate(rollouts(args)):
        totals = replay([(i, p, cs) for i, (p, cs) in enumerate(groups)], args.k, host, history)
        lengths.append([len(c) for _, cs in groups for c in cs])
        for name, (accepted, positions, drafting, drafted) in totals.items():
            row = {"epoch": epoch, "drafter": name, "accepted_per_position": accepted / max(positions, 1),
                   "drafted_share": drafting / max(positions, 1), "accepted_per_drafted": accepted / max(drafted, 1),
                   "positions": positions}
            rows.append(row)
            print(f"[drafter replay] epoch {epoch}, {name}: {row['accepted_per_position']:.3f} tokens accepted a "
                  f"position, drafting at {row['drafted_share']:.0%} of positions, {row['accepted_per_drafted']:.3f} "
                  "per drafted token", flush=True)
    return {"part": "replay", "k": args.k, "prompts": args.prompts, "group": args.group, "epochs": args.epochs,
            "completion_lengths": lengths, "rows": rows}
