"""Distillation data and losses: the drafter stages the target's own distribution at every generated
position, the buffer keeps it, and each loss is the divergence it claims to be."""
import pytest
import torch

from rlspec.rollout.speculation.training.distill_losses import LOSSES, draft_target, get_loss
from rlspec.rollout.speculation.training.drafter_training import DrafterTrainer
from rlspec.rollout.speculation.training.feature_buffer import Dist, FeatureBuffer
from tests.conftest import make_tiny_hf, random_prompts
from tests.rollout.speculation.test_eagle3 import eagle_engine

pytestmark = pytest.mark.filterwarnings("ignore:aux_layer_ids .* repeat a layer")


def full_target(p: torch.Tensor, k: int, t2d=None):
    """A DraftTarget of p [M, V] kept to its top k, with the sampled token = argmax."""
    top = p.topk(k, -1)
    M, V = p.shape
    t2d = torch.arange(V) if t2d is None else t2d
    return draft_target(top.indices.int(), top.values, 1 - top.values.sum(-1), torch.ones(M, dtype=torch.bool),
                        p.argmax(-1), t2d)


def test_kl_and_tv_are_exact_with_the_whole_distribution():
    torch.manual_seed(0)
    p = torch.softmax(3 * torch.randn(5, 40), -1)
    logits = torch.randn(5, 40)
    q = torch.softmax(logits, -1)
    t = full_target(p, 40)
    torch.testing.assert_close(LOSSES["kl"](logits, t)[0], (p * (p / q).log()).sum(-1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(LOSSES["tv"](logits, t)[0], 0.5 * (p - q).abs().sum(-1), atol=1e-5, rtol=1e-5)
    # with fewer kept entries the KL of the coarsened pair is a lower bound, TV an upper bound
    t8 = full_target(p, 8)
    assert (LOSSES["kl"](logits, t8)[0] <= LOSSES["kl"](logits, t)[0] + 1e-5).all()
    assert (LOSSES["tv"](logits, t8)[0] >= LOSSES["tv"](logits, t)[0] - 1e-6).all()
    with pytest.raises(ValueError, match="unknown drafter loss"):
        get_loss("nope")


def test_tokens_outside_the_draft_vocabulary_count_as_leftover():
    torch.manual_seed(1)
    p = torch.softmax(3 * torch.randn(4, 30), -1)
    t2d = torch.where(torch.arange(30) % 2 == 0, torch.arange(30) // 2, -1)  # even ids -> draft ids 0..14
    t = full_target(p, 6, t2d)
    assert ((t.ids >= 0) | (t.probs == 0)).all()
    torch.testing.assert_close(t.probs.sum(-1) + t.rest, torch.ones(4))
    logits = torch.randn(4, 15, requires_grad=True)
    for name, fn in LOSSES.items():
        loss, counts = fn(logits, t)
        assert torch.isfinite(loss).all(), name
        loss[counts].sum().backward()
        assert torch.isfinite(logits.grad).all(), name


def test_positions_without_a_distribution_train_on_their_sampled_token():
    logits = torch.randn(3, 10)
    t = draft_target(torch.zeros(3, 4, dtype=torch.int32), torch.zeros(3, 4), torch.zeros(3),
                     torch.zeros(3, dtype=torch.bool), torch.tensor([1, 5, 7]), torch.arange(10))
    ce = torch.nn.functional.cross_entropy(logits, torch.tensor([1, 5, 7]), reduction="none")
    torch.testing.assert_close(LOSSES["kl"](logits, t)[0], ce)  # forward KL to a one-hot
    torch.testing.assert_close(LOSSES["ce"](logits, t)[0], ce)


def test_buffer_weights_recent_versions_and_covers_sample_ends():
    buf = FeatureBuffer(4096, 4, torch.float32, "cpu", topk=2, half_life=1.0)
    for ver in (0, 2):  # two samples of 100 positions, two policy versions apart
        buf.add(torch.randn(100, 4), list(range(101)), ver)
    w = buf.weights(list(buf.segments))
    assert w[1] / w[0] == pytest.approx(4.0)  # age 2 at half-life 1
    gen = torch.Generator().manual_seed(0)
    covered = torch.zeros(100)
    for _ in range(300):
        b = buf.sample(1, 32, gen)
        hit = b.next_tokens[0][b.valid[0]] - 1
        covered[hit] += 1
    assert covered.min() > 0.3 * covered.max()  # the last positions of a sample are trained too


def test_engine_stages_the_targets_distribution_at_generated_positions():
    """What the buffer holds for each completion position is the target's own next-token law there."""
    hf = make_tiny_hf("llama", seed=11)
    eng = eagle_engine(hf, k=3)
    trainer = eng.speculation.attach_trainer(DrafterTrainer(eng.speculation.learned, loss="kl", topk=8,
                                                            min_tokens=1))
    prompts = random_prompts(3, 4, 9, seed=11)
    from rlspec.rollout.types import SamplingParams

    eng.generate(prompts, SamplingParams(temperature=0.8, max_new_tokens=16, seed=0, ignore_eos=True))
    buf = trainer.buffer
    assert len(buf.segments) == 3
    for (start, n, _, temp), prompt in zip(sorted(buf.segments), prompts):
        assert temp == pytest.approx(0.8)
        ids = [0] + buf.next_tokens[start:start + n].tolist()  # token 0 unknown: not compared below
        with torch.no_grad():
            ref = torch.softmax(hf(torch.tensor([prompt + ids[len(prompt):]])).logits[0].float() / 0.8, -1)
        has = buf.dist.has[start:start + n]
        assert not has[:len(prompt)].any() and has[len(prompt):].all()
        for t in range(len(prompt), n):
            got_ids, got_p = buf.dist.ids[start + t].long(), buf.dist.probs[start + t].float()
            torch.testing.assert_close(got_p, ref[t, got_ids], atol=2e-3, rtol=1e-2)
            assert got_p[0] == pytest.approx(float(ref[t].max()), abs=2e-3)
            assert float(buf.dist.rest[start + t]) == pytest.approx(1 - float(ref[t, got_ids].sum()), abs=5e-3)
    assert buf.bytes_per_token() == 4 * 3 * 64 // 2 + 8 + 8 * 4 + 8 * 2 + 2 + 1  # bf16 features + the rest


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_every_loss_trains_the_drafter(loss):
    hf = make_tiny_hf("llama", seed=12)
    eng = eagle_engine(hf)
    trainer = eng.speculation.attach_trainer(DrafterTrainer(eng.speculation.learned, lr=3e-3, min_tokens=16,
                                                            batch=4, window=16, loss=loss, topk=8))
    from rlspec.rollout.types import SamplingParams

    eng.generate(random_prompts(4, 4, 8), SamplingParams(temperature=1.0, max_new_tokens=30, seed=0, ignore_eos=True))
    first = trainer.train_steps(1)
    trainer.train_steps(50)
    losses = [trainer.train_steps(1) for _ in range(10)]
    assert torch.isfinite(torch.tensor(first)) and sum(losses) / 10 < first


def test_dist_round_trips_through_buffer_state():
    buf = FeatureBuffer(64, 4, torch.float32, "cpu", topk=4)
    d = Dist(torch.randint(0, 50, (10, 6), dtype=torch.int32), torch.full((10, 6), 0.1), torch.full((10,), 0.4),
             torch.ones(10, dtype=torch.bool))
    buf.add(torch.randn(10, 4), list(range(11)), 0, d, 0.7)
    torch.testing.assert_close(buf.dist.rest[:10].float(), torch.full((10,), 0.6), atol=1e-3, rtol=0)  # 2 extra
    small = FeatureBuffer(64, 4, torch.float32, "cpu", topk=2)
    small.load_state(buf.state())
    torch.testing.assert_close(small.dist.rest[:10].float(), torch.full((10,), 0.8), atol=1e-3, rtol=0)
    assert list(small.segments) == [(0, 10, 0, 0.7)]
