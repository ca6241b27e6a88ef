"""SpecGRPOTrainer's passes over a batch skip the completions' padding (trainers/trimmed_logps.py) and give what
TRL's padded pass gives: the same log-probabilities and entropies at every real token, zeros past each row's end,
the same gradients; the chunks are runs of similar length that save more than a call costs."""
from __future__ import annotations

import builtins

import pytest
import torch
import trl

from tests.trainers.conftest import build_tiny_llama
from rlspec.trainers import loss_forward
from rlspec.trainers.data import make_math_dataset
from rlspec.trainers.grpo import SpecGRPOTrainer
from rlspec.trainers.trimmed_logps import CHUNK_OVERHEAD_TOKENS, plan_chunks


def test_chunks_split_the_long_tail_from_the_rest():
    lengths = [1024, 300, 280, 290, 310, 1000, 20, 295]
    runs = plan_chunks(lengths, prompt_len=80)
    assert sorted(i for r in runs for i in r) == list(range(8))
    assert runs[0] == [0, 5]  # the two long rows together, the rest apart
    assert sorted(runs[1] + runs[-1]) == [1, 2, 3, 4, 6, 7]
    assert plan_chunks([100, 99, 98], prompt_len=10) == [[0, 1, 2]]  # a split would save less than a call costs
    assert all(len(r) <= 2 for r in plan_chunks(lengths, prompt_len=80, max_rows=2))
    cost = lambda runs: sum(len(r) * (80 + max(lengths[i] for i in r)) + CHUNK_OVERHEAD_TOKENS for r in runs)
    assert cost(runs) < cost([list(range(8))])


@pytest.fixture
def trainer(char_tokenizer, tmp_path):
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=24, report_to=[], max_steps=1)
    model = build_tiny_llama(len(char_tokenizer), char_tokenizer.eos_token_id, char_tokenizer.pad_token_id)
    return SpecGRPOTrainer(model=model, reward_funcs=[lambda completions, **k: [0.0] *
                           len(completions)], args=args, train_dataset=make_math_dataset(8, seed=0),
                           processing_class=char_tokenizer, engine_kwargs=dict(max_model_len=128))


def batch(vocab: int, lengths: list[int], prompt_len: int = 6, width: int = 300):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (len(lengths), prompt_len + width), generator=g)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        mask[r, r % 3:prompt_len] = 1  # left-padded prompts
        mask[r, prompt_len:prompt_len + n] = 1
    return ids, mask


@pytest.mark.parametrize("cut", [0, 1])
def test_trimmed_pass_equals_trls_padded_pass(trainer, cut, monkeypatch):
    """cut=1 plants a flaw (each chunk one token too short): the comparison must catch it."""
    import rlspec.trainers.trimmed_logps as tl

    if cut:  # the module's max() (each chunk's longest completion) one short
        monkeypatch.setattr(tl, "max", lambda *a, **k: builtins.max(*a, **k) - 1, raising=False)
    model, lengths = trainer.model, [300, 20, 40, 10, 280, 30]
    ids, mask = batch(model.config.vocab_size, lengths)
    parent = trl.GRPOTrainer._get_per_token_logps_and_entropies.__get__(trainer)  # TRL's own padded pass
    want, want_ent, _ = parent(model, ids, mask, 300, compute_entropy=True)
    got, got_ent, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, 300, compute_entropy=True)
    real = mask[:, 6:].bool()
    same = torch.allclose(got[real], want[real], atol=1e-5) and torch.allclose(got_ent[real], want_ent[real], atol=1e-5)
    assert same != bool(cut)
    if cut:
        return
    assert (got[~real] == 0).all()
    assert trainer._metrics["eval" if not model.training else "train"]["train/logps_token_frac"][-1] < 0.6
    # gradients of a masked loss through either pass agree
    model.train()
    grads = []
    for fn in (parent, trainer._get_per_token_logps_and_entropies):
        model.zero_grad()
        lp, _, _ = fn(model, ids, mask, 300)
        (lp * real).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*grads))


def test_a_step_trims_the_old_logprob_pass_and_the_loss_pass(trainer, monkeypatch):
    """Both of TRL's passes of a plain run skip the padding (here as two passes: the one pass that serves both,
    trainers/loss_forward.py, goes through the same method, tests/trainers/test_loss_forward.py); only a pass a
    learned drafter taps keeps TRL's shapes (none here: no drafter feed)."""
    monkeypatch.setattr(loss_forward, "reusable", lambda trainer, kwargs: False)
    grads = []
    real = SpecGRPOTrainer._trimmed_logps

    def spy(self, *a, **k):
        grads.append(torch.is_grad_enabled())
        return real(self, *a, **k)

    monkeypatch.setattr(SpecGRPOTrainer, "_trimmed_logps", spy)
    trainer.args.logging_steps = 1
    trainer.train()
    assert grads == [False, True], grads  # the no-grad old-logprob pass and the loss's forward
    assert not trainer.rollouts.feeds_drafter
