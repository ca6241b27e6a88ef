"""OnlineHead: a logistic head on the target's hidden states, trained online on the run's own labels.

Both learned rules use it: the judge (features: the target's last hidden state at a draft token;
label: the token lies in the target's nucleus there) and the router (features: the mean of those
states over a drafted step; label: the target agrees with the step). docs/lossy.md defines the
labels. The head is tiny (H + 1 weights), so it trains in the decode loop itself: a few Adam steps
on a bounded replay buffer every `train_every` new examples, no thread or process of its own.
Until it has seen `warmup` labels its caller uses the training-free rule instead. The head, its
buffer and its optimizer move to the device of the first features banked, so banking and training
never copy to the host: the decode step keeps its one host transfer (tests/rollout/test_host_transfers.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class OnlineHead:
    def __init__(self, dim: int, lr: float = 3e-3, capacity: int = 8192, batch: int = 256, warmup: int = 256,
                 train_every: int = 64, steps: int = 4, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.weight = (torch.randn(dim, generator=g) * dim ** -0.5).requires_grad_()
        self.bias = torch.zeros(1, requires_grad=True)
        self.lr, self._t = lr, 0  # Adam by hand (_adam_step): torch's reads its step counter with .item()
        self._moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in (self.weight, self.bias)]
        self.x = torch.zeros(capacity, dim)
        self.y = torch.zeros(capacity)
        self.capacity, self.batch, self.warmup = capacity, batch, warmup
        self.train_every, self.steps = train_every, steps
        self.seen = 0  # labels received in total (the buffer keeps the newest `capacity`)
        self.since_train = 0
        self.updates = 0
        self._gen = g

    @property
    def ready(self) -> bool:
        """Trained on enough labels to stand in for the training-free rule."""
        return self.seen >= self.warmup and self.updates > 0

    def score(self, h: torch.Tensor) -> torch.Tensor:
        """P(label = 1 | h) for h [..., H] (any device/dtype) -> [...] float32 on h's device."""
        w, b = self.weight.detach().to(h.device), self.bias.detach().to(h.device)
        return torch.sigmoid(_norm(h.float()) @ w + b)

    def add(self, h: torch.Tensor, y: torch.Tensor) -> None:
        """Bank examples h [N, H] with labels y [N] in {0, 1}; trains when enough new ones arrived."""
        n = h.shape[0]
        if n == 0:
            return
        if self.x.device != h.device:
            self._move(h.device)
        idx = (torch.arange(n, device=h.device) + self.seen) % self.capacity
        self.x[idx] = h.detach().float()
        self.y[idx] = y.detach().float()
        self.seen += n
        self.since_train += n
        if self.seen >= self.warmup and self.since_train >= self.train_every:
            self.train()

    def _move(self, device) -> None:
        """Weights, buffer and Adam moments on `device` (before any training: the moments are zeros)."""
        with torch.inference_mode(False):
            self.weight = self.weight.detach().to(device).requires_grad_()
            self.bias = self.bias.detach().to(device).requires_grad_()
            self.x, self.y = self.x.to(device), self.y.to(device)
            self._moments = [(m.to(device), v.to(device)) for m, v in self._moments]

    def _adam_step(self, betas=(0.9, 0.999), eps: float = 1e-8) -> None:
        """torch.optim.Adam's update (no weight decay) with the step count in Python, so it reads nothing back."""
        self._t += 1
        c1, c2 = 1 - betas[0] ** self._t, 1 - betas[1] ** self._t
        with torch.no_grad():
            for p, (m, v) in zip((self.weight, self.bias), self._moments):
                m.mul_(betas[0]).add_(p.grad, alpha=1 - betas[0])
                v.mul_(betas[1]).addcmul_(p.grad, p.grad, value=1 - betas[1])
                p.addcdiv_(m, (v.sqrt() / c2 ** 0.5).add_(eps), value=-self.lr / c1)
                p.grad = None

    def train(self) -> torch.Tensor:
        """`steps` Adam steps on random minibatches of the buffer; returns the last loss (a 0-dim tensor on
        the head's device: reading it is the caller's sync, not the decode loop's)."""
        held = min(self.seen, self.capacity)
        loss = torch.zeros(())
        with torch.inference_mode(False), torch.enable_grad():  # the engine decodes under inference_mode
            for _ in range(self.steps):
                pick = torch.randint(held, (min(self.batch, held),), generator=self._gen).to(self.x.device)
                logits = _norm(self.x[pick]) @ self.weight + self.bias
                loss = F.binary_cross_entropy_with_logits(logits, self.y[pick])
                loss.backward()
                self._adam_step()
        self.since_train = 0
        self.updates += 1
        return loss.detach()


def _norm(h: torch.Tensor) -> torch.Tensor:
    """Scale-free features: hidden states grow with depth and differ per model."""
    return F.layer_norm(h, h.shape[-1:])
