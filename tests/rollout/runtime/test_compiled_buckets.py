"""compile_mode=on under CUDA graphs: one compile of the captured layer call serves every batch bucket, although
FlexAttention sits behind a graph break (runtime/compiled.py, captured_layer_call). On the CPU a stand-in for
flex makes the same break; the CUDA run is tests/gpu/test_cuda_device_order.py."""
import torch

from rlspec.rollout.runtime.compiled import captured_layer_call
from rlspec.rollout.runtime.runner import compiled_frames

H = 8


@torch.compiler.disable
def flex_stand_in(q: torch.Tensor) -> torch.Tensor:
    """Runs outside the compiled graphs, as attention._flex_outside_graph does."""
    return q * 2


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.o = torch.nn.Linear(H, H), torch.nn.Linear(H, H)

    def forward(self, x):
        return self.o(flex_stand_in(self.q(x)).relu())


class Layer(torch.nn.Module):
    """A decoder layer's shape: a norm, attention behind the break, a residual and an MLP below it."""

    def __init__(self):
        super().__init__()
        self.attn, self.mlp = Attention(), torch.nn.Linear(H, H)

    def forward(self, x):
        h = x + self.attn(torch.nn.functional.layer_norm(x, (H,)))
        return h + self.mlp(h).sigmoid()


def test_one_compile_serves_every_batch_bucket_below_a_graph_break(dynamo_only):
    layer, call = Layer(), captured_layer_call()
    compiled = []
    try:
        with torch.no_grad():
            for B in (2, 4, 8, 16):  # graphs.batch_buckets; batch 1 specialises, as torch does for size 1
                before = compiled_frames()
                x = torch.randn(B, 3, H)
                torch.testing.assert_close(call(layer, x), layer(x))
                compiled.append(compiled_frames() - before)
    finally:
        torch._dynamo.reset()  # later tests compile afresh
    # static shapes with marks compiled the frames below the break again per bucket: [5, 2, 2, 2]
    assert compiled[0] > 0 and compiled[1:] == [0, 0, 0], compiled
