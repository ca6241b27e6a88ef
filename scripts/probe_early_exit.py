"""The acceptance ceiling of an early-exit drafter, measured with transformers alone (no rlspec code).

At T = 1 a draft sampled from q is accepted with probability 1 - TV(p, q). This probe asks how
well the target itself, cut after l of its L layers (its own final norm and LM head read off the
residual stream, HF `hidden_states[l]`), matches its full distribution p at the same position:
an "oracle-sized" drafter that costs l/L of the target. Data: the target's own T = 1 answers to
held-out embedded math prompts (HF `generate`), teacher-forced once with all hidden states.
Per layer: mean 1 - TV over the answer positions, and the tokens per verify a chain of k drafts
would yield at that per-position acceptance a, sum_{i=0..k} a^i (independent positions).

    python scripts/probe_early_exit.py --prompts 16 --out bench_out/early_exit.json
"""
from __future__ import annotations

from common import math_prompts, parser, table, write_json
from bench_engine import hf_model


def main(argv=None) -> dict:
    p = parser(__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default="bench_out/early_exit.json")
    args = p.parse_args(argv)

    import torch

    tok, model = hf_model(args.model, getattr(torch, args.dtype))
    L = model.config.num_hidden_layers
    layers = sorted({L // 2, L - 6, L - 3, L - 2, L - 1})
    overlap, entropy = {l: [] for l in layers}, []
    torch.manual_seed(0)
    for ids in math_prompts(tok, args.prompts, seed=12345):
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(x, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=args.max_new_tokens, pad_token_id=tok.eos_token_id)
            full = model(out, output_hidden_states=True)
        n = len(ids)
        ans = slice(n - 1, out.shape[1] - 1)  # positions whose next token is an answer token
        pf = torch.softmax(full.logits[0, ans].float(), -1)
        entropy += (-(pf * pf.clamp(min=1e-30).log()).sum(-1)).tolist()
        for l in layers:
            h = full.hidden_states[l][0, ans]
            pl = torch.softmax(model.lm_head(model.model.norm(h)).float(), -1)
            overlap[l] += torch.minimum(pf, pl).sum(-1).tolist()
    rows = []
    for l in layers:
        a = sum(overlap[l]) / len(overlap[l])
        rows.append({"layers": l, "of": L, "one_minus_tv": a, "positions": len(overlap[l]),
                     f"chain{args.k}_tokens_per_verify": sum(a ** i for i in range(args.k + 1))})
    print(table(rows, list(rows[0])))
    print(f"target entropy: {sum(entropy) / len(entropy):.2f} nats per answer position")
    result = {"config": vars(args), "results": rows, "target_entropy_nats": sum(entropy) / len(entropy)}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
