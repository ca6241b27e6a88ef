"""The GPU path's timing, ordering and memory on CUDA: calibration times each anchor by its own kernels, a Span the
device work queued inside it; the drafter's feature ring is ordered across the engine's and the trainer's streams;
rollouts reuse their CUDA graphs; one compile of the captured layer serves every batch bucket beside FlexAttention;
a growing pool leaves its reserve; an out-of-memory drafter step backs off. The CPU versions:
tests/rollout/speculation/test_cost_timing.py, test_feature_fence.py, test_drafter_oom.py;
tests/rollout/runtime/test_graph_reuse.py, test_compiled_buckets.py."""
import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.device import DeviceTimer, Span
from rlspec.rollout.runtime.graphs import EagerRunner, GraphPool
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.runtime.runner import compiled_frames
from rlspec.rollout.speculation.cost_model import CostModel
from rlspec.rollout.speculation.training.feature_buffer import FeatureBuffer
from rlspec.rollout.types import SamplingParams
from tests.conftest import make_tiny_hf, random_prompts
from tests.rollout.runtime.test_graphs import _cuda_setup, _tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s of one stream's time on an H100


def _engine(**kw):
    model = loader.from_hf_model(make_tiny_hf("llama", seed=3), torch.float32, "cuda")
    return RolloutEngine(model, None, eos_token_ids=[2], **kw)


def test_calibration_times_each_anchor_by_its_own_kernels():
    eng = _engine()
    eng.generate(random_prompts(8, 3, 9, seed=1), SamplingParams(temperature=0, max_new_tokens=4))
    runner = eng.runner
    runner.release()
    runner.ensure_cache(8, 256)
    timed = CostModel().calibrate(runner, 8, [1, 4, 8], context=64, repeats=3)
    for (b, T), seconds in timed.items():
        tokens, start = torch.zeros(b, T, dtype=torch.long), torch.full((b,), 64)
        runner.step(tokens, start)
        with DeviceTimer("cuda") as clock:
            for _ in range(3):
                runner.step(tokens, start)
        # unsynchronised, an anchor measured its launch (a graph replay: microseconds)
        assert seconds >= 0.3 * clock.seconds / 3, ((b, T), seconds, clock.seconds / 3)


def test_a_span_times_the_device_work_queued_inside_it():
    """The drafting's seconds (decode.py) come from a Span: the device's time over work the host only queued, read
    after a later wait; the host's clock would give ~0 here and charge the work to whatever waits next."""
    torch.cuda.synchronize()
    span = Span("cuda").start()
    torch.cuda._sleep(SLEEP_CYCLES)
    span.stop()
    queued = span.t1 - span.t0
    with DeviceTimer("cuda") as clock:
        torch.cuda._sleep(SLEEP_CYCLES)
    assert queued < 0.2 * clock.seconds and 0.7 * clock.seconds <= span.seconds() <= 1.3 * clock.seconds, \
        (queued, span.seconds(), clock.seconds)


def test_feature_ring_reads_wait_for_writes_and_wrapped_writes_for_reads():
    """Each stream is kept busy where a missing order would show. (The buffer's host copies with
    non_blocking=False also synchronise their own stream; the fence does not rely on them.)"""
    buf = FeatureBuffer(16, 8, torch.float32, "cuda", topk=0)
    engine_stream, trainer_stream = torch.cuda.Stream(), torch.cuda.Stream()
    gen = torch.Generator().manual_seed(0)
    with torch.cuda.stream(engine_stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the engine's stream is busy: the write lands late
        buf.add(torch.full((10, 8), 1.0, device="cuda"), list(range(11)), 0)
    with torch.cuda.stream(trainer_stream):
        first = buf.sample(4, 8, gen)  # must see the write, not the zeros before it
        torch.cuda._sleep(SLEEP_CYCLES)  # the trainer's stream is busy: its next read lands late
        second = buf.sample(4, 8, gen)
    with torch.cuda.stream(engine_stream):
        buf.add(torch.full((10, 8), 2.0, device="cuda"), list(range(11)), 1)  # wraps onto rows 0..9
    torch.cuda.synchronize()
    for got in (first, second):
        assert bool((got.feats[got.valid] == 1.0).all())


def test_rollouts_reuse_their_graphs_and_stay_greedy_exact():
    eng = _engine()  # free_kv_between_rollouts is on by default on CUDA
    prompts = random_prompts(4, 3, 9, seed=2)
    params = SamplingParams(temperature=0, max_new_tokens=16, n=2)
    pools, captures, outs, total = {}, [], [], 0
    for _ in range(4):
        outs.append([r.completion_ids for r in eng.generate(prompts, params)])
        assert isinstance(eng.runner.steps, GraphPool)  # kept over the release at the call's end
        pools[id(eng.runner.steps)] = eng.runner.steps
        now = sum(p.counts["captures"] for p in pools.values())
        captures.append(now - total)
        total = now
    assert captures[0] > 0 and captures[2:] == [0, 0], captures
    assert all(o == outs[0] for o in outs) and eng.runner.kept_bytes > 0


def test_one_compile_of_the_captured_layer_serves_every_batch_bucket():
    from rlspec.rollout.runtime.compiled import captured_layer_call

    model, cache = _cuda_setup(rows=16, length=256)
    pool = GraphPool(model, cache, "cuda", max_t=1, layer_call=captured_layer_call())
    eager = EagerRunner(model, cache, "cuda")
    compiled = []
    for B in (2, 4, 8, 16):
        tokens, start = _tokens(B, 1, seed=B), torch.full((B,), 100)
        before = compiled_frames()
        got = pool.run(tokens, start)[0]
        compiled.append(compiled_frames() - before)
        torch.testing.assert_close(got, eager.run(tokens, start)[0], atol=1e-4, rtol=0)
    # FlexAttention, compiled on its own, may turn its batch dynamic at the second bucket; the layer's frames
    # compile once: static shapes compiled the frames below flex's graph break again per bucket
    assert compiled[2:] == [0, 0], compiled


def test_a_growing_pool_leaves_the_steps_reserve_free():
    eng = _engine()
    runner = eng.runner
    free = torch.cuda.mem_get_info()[0]
    cache = runner.ensure_cache(64, 2048)
    reserve = runner.reserve_bytes(64)
    assert reserve > 0
    assert (cache.alloc.max_blocks - 1) * cache.block_nbytes() <= 0.9 * free - reserve + cache.block_nbytes()


def test_an_out_of_memory_drafter_step_backs_off_on_cuda():
    from tests.rollout.speculation.test_drafter_oom import _oom_while_batch_above, _run_until
    from rlspec.rollout.speculation.training.drafter_training import DrafterTrainer
    from tests.rollout.speculation.test_eagle3 import eagle_engine

    eng = eagle_engine(make_tiny_hf("llama", seed=10).cuda())
    trainer = eng.speculation.attach_trainer(DrafterTrainer(eng.speculation.learned, batch=8, window=8, min_tokens=1))
    eng.generate(random_prompts(2, 4, 6), SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
    trainer.oom_wait_s = 0.01
    _oom_while_batch_above(trainer, 2)
    _run_until(trainer, lambda: trainer.stats.steps >= 3)
    assert trainer.stats.error is None and trainer.stats.ooms == 2 and trainer.batch == 2
