"""The time-to-accuracy benchmark's CNN workload: a BatchNorm ResNet with SGD momentum on a task it can learn.

Images are Gaussian noise; a fixed random linear teacher on their 4x4 average-pooled pixels gives the label
(10 classes; the same teacher for every seed and rank), so the gradients of different batches agree and the
validation loss falls steadily, unlike random labels. Step ``t``'s global batch comes from a generator seeded by
``(seed, t)`` (any step can be drawn in any order, nothing is held in memory), rank ``r`` takes its share; the
validation images are fixed (independent of the seed).

``label_noise`` p replaces each label, training and validation alike, by a uniformly drawn class with probability p
(drawn from the batch's own generator). Without it the loss falls towards 0 and round-off alone moves the final
validation loss by several percent (DDP from weights one ulp away: +9.4 % and +4.9 % after 2000 steps under
BatchNorm and SGD momentum), so a 1 % target cannot be resolved; with it the loss levels off at the noise's
entropy, where trajectories that part by round-off end at nearly the same loss.

Imported by ``tta`` (``TTAConfig(workload="cnn")``); ``bench_model_<size>`` are the ``module:function`` models
``deft_compile.tools.bench`` calibrates the link with.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from deft_compile.tools.presets import ResNetStyle

#: ResNet layouts: stage widths, basic blocks per stage, image side.
SIZES: dict[str, dict] = {
    "tiny": {"widths": (8, 16), "blocks": 1, "image": 16},  # 5 k parameters: tests
    "small": {"widths": (16, 32, 64), "blocks": 1, "image": 16},  # 78 k parameters: the long benchmark
    "medium": {"widths": (16, 32, 64, 128), "blocks": 2, "image": 32},  # 0.70 M parameters: the suite's resnet
}
CLASSES = 10
TEACHER_SEED = 0
VALIDATION_SEED = 10_000


class ClassifierLoss(nn.Module):
    """``model(images, labels)`` -> the cross-entropy of ``net(images)``: the loss inside the module, as the GPT-2
    workload's, so DDP, ``torch.compile`` and ``deft_compile`` all run the same callable."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(images), labels)


def build_model(size: str) -> nn.Module:
    if size not in SIZES:
        raise ValueError(f"unknown cnn size {size!r}; choose one of {', '.join(SIZES)}")
    layout = SIZES[size]
    return ClassifierLoss(ResNetStyle(widths=tuple(layout["widths"]), blocks=layout["blocks"], classes=CLASSES))


def make_optimizer(model: nn.Module, lr: float = 0.05, weight_decay: float = 5e-4,
                   momentum: float = 0.9) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)


def teacher_images(n: int, image: int, generator: torch.Generator,
                   label_noise: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images of ``image x image`` pixels and their teacher labels, each replaced by a uniformly drawn class
    with probability ``label_noise``."""
    teacher = torch.randn(3 * 4 * 4, CLASSES, generator=torch.Generator().manual_seed(TEACHER_SEED))
    x = torch.randn(n, 3, image, image, generator=generator)
    labels = (F.adaptive_avg_pool2d(x, 4).flatten(1) @ teacher).argmax(dim=1)
    if label_noise > 0:
        flip = torch.rand(n, generator=generator) < label_noise
        labels = torch.where(flip, torch.randint(0, CLASSES, (n,), generator=generator), labels)
    return x, labels


class ImageBatches:
    """Deterministic batches: the same for every variant given ``seed`` (the interface of ``tta.TextBatches``)."""

    def __init__(self, *, size: str, batch: int, seed: int, rank: int, world_size: int, val_images: int,
                 label_noise: float = 0.0) -> None:
        self.image, self.batch, self.seed = SIZES[size]["image"], batch, int(seed)
        self.rank, self.world_size, self.label_noise = rank, world_size, label_noise
        images, labels = teacher_images(val_images, self.image, torch.Generator().manual_seed(VALIDATION_SEED),
                                        label_noise)
        self.val = (images[rank::world_size], labels[rank::world_size])
        self.val_total = val_images

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, labels) of this rank at 0-based ``step``."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        images, labels = teacher_images(self.world_size * self.batch, self.image, generator, self.label_noise)
        mine = slice(self.rank * self.batch, (self.rank + 1) * self.batch)
        return images[mine], labels[mine]

    def validation(self, chunk: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of the validation images, in batches of ``chunk``."""
        return list(zip(self.val[0].split(chunk), self.val[1].split(chunk)))


def _bench_model(size: str) -> tuple[nn.Module, Callable, Callable, None]:
    image = SIZES[size]["image"]

    def batch(n: int, generator: torch.Generator) -> tuple[tuple[torch.Tensor, torch.Tensor], dict]:
        return teacher_images(n, image, generator), {}

    return build_model(size), make_optimizer, batch, None


def bench_model_tiny() -> tuple[nn.Module, Callable, Callable, None]:
    return _bench_model("tiny")


def bench_model_small() -> tuple[nn.Module, Callable, Callable, None]:
    return _bench_model("small")


def bench_model_medium() -> tuple[nn.Module, Callable, Callable, None]:
    return _bench_model("medium")
