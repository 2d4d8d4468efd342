"""Small models for the tests: each exercises a feature the step capture must keep exact."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm_models import CausalLM, lm_loss  # benchmarks/lm_models.py


class DropoutMLP(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, width), nn.ReLU(), nn.Dropout(0.3), nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.2), nn.Linear(width, 4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class BatchNormCNN(nn.Module):
    """Convolutions without bias before BatchNorm: such a bias has a mathematically zero
    gradient, pure round-off, which Adam would amplify into noise of size lr."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
        )
        self.head = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def TinyTransformerLM() -> CausalLM:
    """Tied-embedding LM with LayerNorm, small enough for 2-process tests (no biases: see ``CausalLM``)."""
    return CausalLM(vocab=50, dim=32, heads=4, layers=2, context=16, ffn=2)


class FrozenAndUnused(nn.Module):
    """A frozen layer, a trainable one, and a parameter that never receives a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 16)
        self.frozen.requires_grad_(False)
        self.trained = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))
        self.unused = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trained(torch.relu(self.frozen(x)))


def _adamw_two_groups(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}], lr=3e-3
    )


# name -> (model factory, optimizer factory, batch factory(generator), loss_fn, DDP kwargs, exact)
# ``exact``: SGD's update is the same float32 math as eager, so results must be bit-identical;
# Adam/AdamW run their capturable form (bias corrections in float32 tensors), so round-off.
CASES = {
    "mlp_dropout_sgd": (
        DropoutMLP,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
        lambda g: (torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)),
        F.cross_entropy,
        {},
        True,
    ),
    "cnn_batchnorm_adam": (
        BatchNormCNN,
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
        lambda g: (torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)),
        F.cross_entropy,
        {},
        False,
    ),
    "transformer_tied_adamw_groups": (
        TinyTransformerLM,
        _adamw_two_groups,
        lambda g: (torch.randint(0, 50, (4, 16), generator=g), torch.randint(0, 50, (4, 16), generator=g)),
        lm_loss,
        {},
        False,
    ),
    "frozen_unused_sgd": (
        FrozenAndUnused,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5, weight_decay=1e-2),
        lambda g: (torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)),
        F.cross_entropy,
        {"find_unused_parameters": True},
        True,
    ),
}


def captured_batchnorm_cnn():
    """The seeded ``BatchNormCNN`` step (SGD with momentum, a batch of 4) captured as the passes and the profiler
    see it: ``(captured, optimizer, batch)``."""
    from deft_compile.step.capture import capture_step

    torch.manual_seed(0)
    model = BatchNormCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = (torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)))
    captured = capture_step(model, optimizer, lambda out, y: F.cross_entropy(out, y), batch, {}, [])
    return captured, optimizer, batch
