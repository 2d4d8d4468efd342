"""Small models for the tests: each exercises a feature the step capture must keep exact."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


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


class TinyTransformerLM(nn.Module):
    """Decoder-only LM with tied input/output embeddings and LayerNorm.

    The blocks have no biases: the key projection's bias has a mathematically zero
    gradient (softmax ignores a per-row constant), pure round-off that AdamW would
    amplify into noise of size lr and make any two correct implementations differ.
    """

    def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 4, layers: int = 2, context: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(context, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True, norm_first=True, bias=False)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        h = self.embed(tokens) + self.position[:length]
        h = self.blocks(h, mask=self.causal_mask[:length, :length], is_causal=True)
        return self.lm_head(self.norm(h))


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


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


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
