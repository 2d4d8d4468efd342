"""Imported by a fork server (``launcher.use_forkserver``): traces a few tiny training steps so that the workers
forked from it start with make_fx's one-time state built.

The first step a process captures pays for torch's lazy set-up of tracing (decomposition tables, fake-tensor
dispatch caches, the modules ``make_fx`` and autograd import on first use): measured on a 2-core host, the same
small MLP's capture took 0.4-1.1 s as a process's first and 0.1-0.2 s after one capture of another model. A
worker forked from a server that has captured once inherits that state and starts warm. The steps cover the
layers and optimizers the suite and the examples train (linear, convolution, BatchNorm, LayerNorm, embedding,
attention, Dropout; SGD with momentum and AdamW, each before and after its state exists), on sizes of a few
elements; nothing here is kept but torch's caches.

Importing this module anywhere else costs about a second and changes nothing.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from deft_compile.step.capture import capture_step


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.norm = nn.BatchNorm2d(2)
        self.layer_norm = nn.LayerNorm(4)
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4 + 2, 3)
        self.drop = nn.Dropout(0.1)

    def forward(self, tokens: torch.Tensor, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.layer_norm(self.embed(tokens))
        x, _ = self.attention(x, x, x, need_weights=False)
        pooled = F.relu(self.norm(self.conv(images))).mean(dim=(2, 3))
        return F.cross_entropy(self.head(self.drop(torch.cat([x.mean(dim=1), pooled], dim=1))), targets)


def _state_slots(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[int, str]]:
    return [(index, key) for index, p in enumerate(model.parameters())
            for key, value in optimizer.state.get(p, {}).items() if isinstance(value, torch.Tensor)]


def warm_up() -> None:
    """Capture the tiny model's step with each optimizer, before and after one eager step made its state. The
    global random state is restored afterwards: a worker forked from the server draws what it would have drawn."""
    with torch.random.fork_rng(devices=[]):
        _capture_each()


def _capture_each() -> None:
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 8, (2, 3), generator=generator), torch.randn(2, 1, 4, 4, generator=generator),
             torch.randint(0, 3, (2,), generator=generator))
    for make in (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.AdamW(p, lr=1e-3)):
        model = _Tiny()
        optimizer = make(model.parameters())
        capture_step(model, optimizer, None, batch, {}, [])
        optimizer.zero_grad()
        model(*batch).backward()
        optimizer.step()
        capture_step(model, optimizer, None, batch, {}, _state_slots(model, optimizer))


try:
    warm_up()
except Exception as exc:  # noqa: BLE001 - a warm-up that fails leaves the workers cold, never broken
    import warnings

    warnings.warn(f"deft_compile.tools.capture_warmup: the warm-up capture failed ({type(exc).__name__}: {exc}); "
                  "forked workers start cold", stacklevel=1)
