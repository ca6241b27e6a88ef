"""Exact sampling laws computed independently of the code under test, and the goodness-of-fit test.

The exact law of a completion comes from transformers alone: the HF model's own forward on every
prefix of positive probability, its own warpers (TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper, in the order `generate` applies them) and a softmax. Nothing of rollout.* is used,
so a bug in our logit processing, sampling or verification cannot hide in the reference.

Significance: every law test passes at p > ALPHA = 1e-4. The Pearson statistic is chi-square under
the null once every cell expects >= 5 samples (smaller cells are pooled into one, never dropped; a
sample outside the law's support gives p = 0), so a correct implementation fails a given law test for
about 1 seed in 10,000. Seeds are fixed, so each test is deterministic: a failure after a change means
the samples changed, and rerunning with a few other seeds tells a fluke from a bias. With the suite's
~40 law tests, a fresh choice of all seeds would show a spurious failure somewhere with probability
about 0.4%. Each known-wrong variant in a flaw table must give p <= ALPHA in the same test (the ones
here do by many orders of magnitude).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chi2

ALPHA = 1e-4


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson goodness of fit of observed counts [S] to the exact cell probabilities probs [S] (sum 1).

    Cells expecting fewer than min_expected samples are pooled into one cell (with the next smallest
    until the pool expects that many), so the chi-square approximation holds and rare sequences still
    count through their total mass. An observation in a cell of probability 0 is impossible under the
    law: the p-value is then 0.
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    if (counts[probs <= 0] > 0).any():
        return 0.0
    counts, expected = counts[probs > 0], probs[probs > 0] * counts.sum()
    order = expected.argsort()
    counts, expected = counts[order], expected[order]
    pool = int((expected < min_expected).sum())
    if pool:
        pool = max(pool, int((expected.cumsum(0) < min_expected).sum()) + 1)
        counts = torch.cat([counts[:pool].sum()[None], counts[pool:]])
        expected = torch.cat([expected[:pool].sum()[None], expected[pool:]])
    if len(counts) < 2:
        return 1.0
    stat = float(((counts - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, len(counts) - 1))


def sequence_pvalue(samples: torch.Tensor, seqs: torch.Tensor, probs: torch.Tensor) -> float:
    """samples [n, L] observed token sequences, seqs [S, L] every sequence of positive probability with
    probs [S] -> the chi-square p-value; a sample outside seqs (probability 0) gives 0."""
    base = int(max(samples.max(), seqs.max())) + 1
    weights = base ** torch.arange(samples.shape[1] - 1, -1, -1, dtype=torch.float64)
    code_s, code_o = (seqs.double() @ weights).long(), (samples.double() @ weights).long()
    index = {c: i for i, c in enumerate(code_s.tolist())}
    counts = torch.zeros(len(seqs) + 1, dtype=torch.float64)
    for c, m in zip(*torch.unique(code_o, return_counts=True)):
        counts[index.get(int(c), len(seqs))] += int(m)
    return chi2_pvalue(counts, torch.cat([probs.double(), torch.zeros(1, dtype=torch.float64)]))


def hf_warpers(params):
    """transformers' own processors for SamplingParams-like settings, in `generate`'s order
    (generation/utils.py _get_logits_processor): the repetition penalty (a processor, over the ids
    passed in: prompt and completion), then the warpers temperature, top-k, top-p, min-p."""
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    out = LogitsProcessorList()
    if getattr(params, "repetition_penalty", 1.0) != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty)))
    if params.temperature != 1.0:
        out.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        out.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        out.append(TopPLogitsWarper(params.top_p))
    if getattr(params, "min_p", 0.0) > 0:
        out.append(MinPLogitsWarper(params.min_p))
    return out


def hf_exact_law(hf, prompt: list[int], length: int, params, margin: float = 1e-4):
    """Exact law of the first `length` sampled tokens after `prompt` -> (seqs [S, length] long,
    probs [S] float64), enumerating every sequence of positive probability with the HF model's
    forward and warpers, plus prefix -> tokens by decreasing probability (an oracle for test drafters).

    Asserts that no truncation decision is within `margin` of flipping (top-k: the k-th and the next
    scaled logit; top-p: the cumulative mass at the boundary and the scores either side of it). Our
    runtime's logits equal HF's to ~1e-6, so the engine then truncates exactly as HF does and its
    target law is this one.
    """
    warpers = hf_warpers(params)
    seqs = torch.zeros(1, 0, dtype=torch.long)
    probs = torch.ones(1, dtype=torch.float64)
    ranked: dict[tuple, list[int]] = {}
    for _ in range(length):
        ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)
        with torch.no_grad():
            logits = hf(ids).logits[:, -1].float()
        _check_margins(_penalised(ids, logits, params), params, margin)
        p = torch.softmax(warpers(ids, logits.clone()), -1).double()
        for s, row in zip(seqs.tolist(), p):
            ranked[tuple(s)] = [t for t in row.argsort(descending=True).tolist() if row[t] > 0]
        parent, tok = (p > 0).nonzero(as_tuple=True)
        seqs = torch.cat([seqs[parent], tok[:, None]], 1)
        probs = probs[parent] * p[parent, tok]
    return seqs, probs, ranked


def _penalised(ids: torch.Tensor, logits: torch.Tensor, params) -> torch.Tensor:
    """HF's repetition penalty alone (the margins are about what the warpers see)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    pen = float(getattr(params, "repetition_penalty", 1.0))
    return logits if pen == 1.0 else RepetitionPenaltyLogitsProcessor(pen)(ids, logits.clone())


def _check_margins(logits: torch.Tensor, params, margin: float) -> None:
    scaled = logits / params.temperature
    V = scaled.shape[-1]
    if 0 < params.top_k < V:
        top = scaled.sort(-1, descending=True).values
        gap = (top[:, params.top_k - 1] - top[:, params.top_k]).min()
        assert gap > margin, f"top-k boundary within {gap:.2e} of a tie: pick another seed"
        scaled = scaled.masked_fill(scaled < top[:, params.top_k - 1:params.top_k], float("-inf"))
    if params.top_p < 1.0:
        s, _ = scaled.sort(-1)
        c = s.softmax(-1).cumsum(-1)
        cut = 1 - params.top_p
        dropped = (c <= cut).sum(-1)  # HF drops the ascending prefix with cumulative mass <= 1 - top_p
        live = torch.isfinite(s)
        assert ((c - cut).abs()[live] > margin).all(), "top-p boundary too close to a cumulative sum"
        rows = torch.arange(len(s))
        has = (dropped > 0) & torch.isfinite(s[rows, (dropped - 1).clamp(min=0)])
        gap = (s[rows, dropped.clamp(max=V - 1)] - s[rows, (dropped - 1).clamp(min=0)])[has]
        assert (gap > margin).all(), "tied scores straddle the top-p boundary"
        from transformers.generation.logits_process import TopPLogitsWarper

        scaled = TopPLogitsWarper(params.top_p)(None, scaled.clone())  # what min-p sees
    min_p = getattr(params, "min_p", 0.0)
    if min_p > 0:  # HF keeps a token iff its probability >= min_p x the top one's, i.e. log-ratio >= log(min_p)
        gap = (scaled - scaled.amax(-1, keepdim=True) - torch.log(torch.tensor(min_p))).abs()
        assert (gap[torch.isfinite(scaled)] > margin).all(), "a token sits on the min-p threshold: pick another seed"


def make_law_model(vocab: int = 8, seed: int = 0, std: float = 0.3):
    """A 2-layer Llama smaller than conftest's (hidden 32): the law tests push 10k samples through the
    engine, and the forwards' cost is what the test time is made of. std sets how peaked it is."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=64,
                         initializer_range=std, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(cfg).float().eval()


@pytest.fixture
def one_thread():
    """Law tests run thousands of small ops on 10k-40k rows: a second intra-op thread only adds
    hand-offs (several times slower on a busy 2-core machine). Use with autouse in a test module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def engine_samples(hf, prompt: list[int], params, n: int, length: int, drafter_for, width: int, k: int,
                   seed: int = 0, keyed: bool = False, look_ahead: bool = False, **engine_kw):
    """n completions of `length` tokens from the engine with speculation forced on every decode step
    (selector "always"), the drafter built by drafter_for(runtime model; None: no speculation) ->
    (samples [n, length] long, engine.stats()). keyed: each sample's draws from its key (0..n-1); look_ahead: the
    engine's (steps launched before the host reads the one in front, as on CUDA). engine_kw: more RolloutEngine
    arguments (a KV budget)."""
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.model import loader
    from rlspec.rollout.types import SamplingParams, SpecConfig

    runtime = loader.from_hf_model(hf)
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=k, tree_width=width, selector="always",
                      online_training=False)
    drafter = drafter_for(runtime) if drafter_for is not None else None
    eng = RolloutEngine(runtime, None, spec=spec if drafter is not None else None, eos_token_ids=[], max_num_seqs=n,
                        drafter=drafter, **engine_kw)
    eng.look_ahead = look_ahead
    run = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                         min_p=params.min_p, repetition_penalty=params.repetition_penalty,
                         max_new_tokens=length, n=n, seed=seed, ignore_eos=True)
    out = eng.generate([prompt], run, sample_keys=list(range(n)) if keyed else None)
    return torch.tensor([r.completion_ids for r in out]), eng.stats()


def sibling_events(children: torch.Tensor, path: torch.Tensor) -> Counter:
    """Over the nodes a tree verify reached that have two or more children (children [B, N+1, W], the verdict's
    path [B, N]), which child the walk moved into: the "first", a "later" one, or "none"."""
    seen = Counter()
    rows, valid = torch.arange(len(path)), (children >= 0).sum(-1)  # [B, N+1] children per node
    for level in range(path.shape[1]):
        parent = torch.zeros_like(path[:, 0]) if level == 0 else path[:, level - 1]
        reached = parent >= 0
        several = reached & (valid[rows, parent.clamp(min=0)] >= 2)
        chosen = path[:, level]
        slot = (children[rows, parent.clamp(min=0)] == chosen[:, None]).long().argmax(-1)
        seen["first"] += int((several & (chosen >= 0) & (slot == 0)).sum())
        seen["later"] += int((several & (chosen >= 0) & (slot > 0)).sum())
        seen["none"] += int((several & (chosen < 0)).sum())
    return seen


def spy_siblings(monkeypatch) -> Counter:
    """Patch verify_tree (where the engine and the tests call it) to count, over nodes verified with two or more
    children, which child was accepted ("first", "later") or that all were rejected ("none")."""
    import rlspec.rollout.speculation.strategies as strategies
    import rlspec.rollout.speculation.verify as verify

    seen, real = Counter(), verify.verify_tree

    def spy(logits, tokens, children, *a, **kw):
        v = real(logits, tokens, children, *a, **kw)
        seen.update(sibling_events(children, v.path))
        return v

    monkeypatch.setattr(verify, "verify_tree", spy)
    monkeypatch.setattr(strategies, "verify_tree", spy)
    return seen

