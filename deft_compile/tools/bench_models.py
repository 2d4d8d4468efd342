"""Models for ``deft-compile bench``: the paper's families at CPU-friendly sizes, and user models.

Every model is a ``deft_compile.tools.presets.Preset`` (build, optimizer, loss, batch
factory, default batch). Names:

* the presets of ``deft-compile explain``: ``mlp``, ``vgg``, ``resnet``, ``gpt2``;
* VGG family (``vgg11``, ``vgg16``, ``vgg19``): the real VGG layouts (conv counts
  per stage, 3 fully-connected layers holding most parameters) with channels
  divided by 4 (16..128) and a 1024-wide head, on 32x32 images, SGD momentum;
* ResNet family (``resnet18`` basic blocks; ``resnet50``, ``resnet101``
  bottlenecks with the real block counts 3-4-6-3 / 3-4-23-3) at base width 8
  (torchvision: 64), CIFAR stem, 32x32 images, SGD momentum;
* GPT-2 family (``gpt2-tiny``: 2 blocks x 128, ``gpt2-mini``: 4 blocks x 256,
  vocab 4096, context 128), tied head, AdamW;
* ``module:function`` or ``path/to/file.py:function``: a user model.

User model contract: ``function()`` takes no arguments and returns
``(model, optimizer_factory, batch_factory, loss_fn)``:

* ``model``: an ``nn.Module`` (the bench seeds torch with 0 before the call and
  deep-copies the model for every variant, so all variants start equal);
* ``optimizer_factory(model) -> torch.optim.Optimizer`` (SGD, Adam, AdamW,
  RMSprop or Adagrad, see docs/API.md);
* ``batch_factory(batch_size, generator) -> (args, kwargs)``: the arguments of
  one training step, drawn from the ``torch.Generator`` (seeded per rank);
  returning a plain tuple ``(inputs, targets)`` means ``kwargs = {}``;
* ``loss_fn(output, targets) -> scalar`` called as ``loss_fn(model(inputs), targets)``,
  or ``None`` when ``model(*args, **kwargs)`` returns the loss itself.

Optionally the function may set ``function.default_batch = N`` (else 16).
"""

from __future__ import annotations

import dataclasses

import functools
import importlib
import importlib.util
import os
import sys
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from deft_compile.tools.presets import (
    PRESETS, QUICK_PRESETS, SUITE_PRESETS, GPT2Style, Preset, VGGStyle, _adamw, _images, _sgd, _tokens, get_preset,
)

# --------------------------------------------------------------------------- VGG family

_VGG_LAYOUT = {  # convolutions per stage, as in Simonyan & Zisserman (configurations A, D, E)
    "vgg11": (1, 1, 2, 2, 2),
    "vgg16": (2, 2, 3, 3, 3),
    "vgg19": (2, 2, 4, 4, 4),
}


class VGG(VGGStyle):
    """VGG-11/16/19 layout for 32x32 inputs: 5 conv stages with max-pool, then 3 FC layers."""

    def __init__(self, layout: tuple[int, ...], widths: tuple[int, ...] = (16, 32, 64, 128, 128),
                 hidden: int = 1024, classes: int = 10, image: int = 32) -> None:
        super().__init__(widths[: len(layout)], layout, hidden, classes, image)


# --------------------------------------------------------------------------- ResNet family


class _Basic(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.shortcut = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return F.relu(self.bn3(self.conv3(out)) + self.shortcut(x))


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


_RESNET_LAYOUT = {"resnet18": (_Basic, (2, 2, 2, 2)), "resnet50": (_Bottleneck, (3, 4, 6, 3)),
                  "resnet101": (_Bottleneck, (3, 4, 23, 3))}


class ResNet(nn.Module):
    """torchvision's ResNet-18/50/101 block layout with a CIFAR stem (3x3 conv, no max-pool) and base ``width``."""

    def __init__(self, block: type, counts: tuple[int, ...], width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        blocks: list[nn.Module] = []
        cin = width
        for stage, count in enumerate(counts):
            planes = width * 2 ** stage
            for b in range(count):
                blocks.append(block(cin, planes, 2 if (b == 0 and stage > 0) else 1))
                cin = planes * block.expansion
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))


# --------------------------------------------------------------------------- registry

_GPT2 = {"gpt2-tiny": dict(vocab=1024, dim=128, heads=4, layers=2, context=64),
         "gpt2-mini": dict(vocab=4096, dim=256, heads=4, layers=4, context=128)}


def _gpt2_preset(name: str, cfg: dict[str, int], batch: int) -> Preset:
    return Preset(
        name, f"GPT-2 layout, {cfg['layers']} blocks x {cfg['dim']}, vocab {cfg['vocab']}, context {cfg['context']}, "
        "tied head, AdamW", functools.partial(GPT2Style, **cfg), _adamw, None,
        functools.partial(_tokens, vocab=cfg["vocab"], context=cfg["context"]), batch)


BENCH_MODELS: dict[str, Preset] = {
    **PRESETS,
    **{name: Preset(name, f"{name.upper()} layout (convs {'-'.join(map(str, layout))}), channels 16-128, FC 1024, "
                    "32x32 images, SGD momentum", functools.partial(VGG, layout), _sgd, F.cross_entropy, _images, 16)
       for name, layout in _VGG_LAYOUT.items()},
    **{name: Preset(name, f"{name} block layout {'-'.join(map(str, counts))} ({block.__name__[1:].lower()}), "
                    "base width 8, CIFAR stem, 32x32 images, SGD momentum",
                    functools.partial(ResNet, block, counts), _sgd, F.cross_entropy, _images, 8)
       for name, (block, counts) in _RESNET_LAYOUT.items()},
    **{name: _gpt2_preset(name, cfg, 8) for name, cfg in _GPT2.items()},
}



def _teacher_vectors(size: int, g: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """256-d Gaussian inputs labelled by a fixed random linear teacher (learnable, same teacher on every rank)."""
    teacher = torch.randn(256, 10, generator=torch.Generator().manual_seed(0))
    x = torch.randn(size, 256, generator=g)
    return (x, (x @ teacher).argmax(dim=1)), {}


#: The demo's model: the ``mlp`` preset trained on a learnable synthetic task.
BENCH_MODELS["mlp-teacher"] = Preset(
    "mlp-teacher", "MLP 256-512x3-10 (the mlp preset), SGD momentum, labels from a fixed linear teacher",
    PRESETS["mlp"].build, PRESETS["mlp"].optimizer, F.cross_entropy, _teacher_vectors, 64)

BENCH_MODELS.update(SUITE_PRESETS)  # benchmarks/suite.py
BENCH_MODELS.update(QUICK_PRESETS)


def _teacher_images(size: int, g: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """32x32 Gaussian images labelled by a fixed random linear teacher on their 4x4 average-pooled pixels: a task
    a CNN can learn (the same teacher on every rank), where the image presets' random labels can only be
    memorised."""
    teacher = torch.randn(3 * 4 * 4, 10, generator=torch.Generator().manual_seed(0))
    x = torch.randn(size, 3, 32, 32, generator=g)
    return (x, (F.adaptive_avg_pool2d(x, 4).flatten(1) @ teacher).argmax(dim=1)), {}


#: The suite's CNNs on a learnable task (``-teacher``): the same models, optimizers and batch sizes. The bench
#: reuses a pool of 8 batches; with random labels a CNN memorises them, a regime where gradients change sign from
#: step to step and the Preserver prices delays high. With teacher labels the gradients agree across batches.
for _name in ("resnet50", "vgg16-bn"):
    _base = BENCH_MODELS[_name]
    BENCH_MODELS[f"{_name}-teacher"] = dataclasses.replace(
        _base, name=f"{_name}-teacher", description=f"{_base.description}; labels from a fixed linear teacher",
        batch=_teacher_images)

#: Default bench selection: one member of each paper family.
DEFAULT_MODELS = ("vgg19", "resnet101", "gpt2-mini")  # mirrored in deft_compile.tools.bench (no torch import there)


def _load_user_function(spec: str) -> Callable[[], Any]:
    """The function ``module:function`` or ``path/to/file.py:function`` names, imported (its module's code runs).
    ``spec`` is the model the user names on the bench command line (``--models``), code they choose to run; no
    name read from a file, a checkpoint or the environment reaches it."""
    module_name, _, function_name = spec.rpartition(":")
    if not module_name or not function_name:
        raise ValueError(f"user model {spec!r}: use module:function or path/to/file.py:function")
    if module_name.endswith(".py") or os.sep in module_name:
        path = os.path.abspath(module_name)
        if not os.path.exists(path):
            raise ValueError(f"user model {spec!r}: no file {path}")
        key = "deft_bench_user_" + str(abs(hash(path)))
        module = sys.modules.get(key)
        if module is None:
            loader = importlib.util.spec_from_file_location(key, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[key] = module
            loader.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    try:
        function = getattr(module, function_name)
    except AttributeError:
        raise ValueError(f"user model {spec!r}: {module_name} has no attribute {function_name!r}") from None
    if not callable(function):
        raise ValueError(f"user model {spec!r}: {function_name} is not callable")
    return function


def _normalise_batch(factory: Callable[[int, torch.Generator], Any]) -> Callable[[int, torch.Generator], Any]:
    def batch(size: int, generator: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
        result = factory(size, generator)
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], tuple) and isinstance(result[1], dict):
            return result
        if isinstance(result, (tuple, list)):
            return tuple(result), {}
        return (result,), {}

    return batch


def user_model(spec: str) -> Preset:
    """Wrap a user ``module:function`` (see the module docstring for the contract) as a ``Preset``.

    The function is called once, with ``torch.manual_seed(0)``; ``build()`` returns deep copies of its model.
    """
    import copy

    function = _load_user_function(spec)
    torch.manual_seed(0)
    result = function()
    if not (isinstance(result, tuple) and len(result) == 4):
        raise ValueError(f"user model {spec!r} must return (model, optimizer_factory, batch_factory, loss_fn), "
                         f"got {type(result).__name__}")
    model, optimizer_factory, batch_factory, loss_fn = result
    if not isinstance(model, nn.Module):
        raise ValueError(f"user model {spec!r}: the first element must be an nn.Module, got {type(model).__name__}")
    if not callable(optimizer_factory) or not callable(batch_factory):
        raise ValueError(f"user model {spec!r}: optimizer_factory and batch_factory must be callable")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"user model {spec!r}: loss_fn must be callable or None")
    return Preset(spec, f"user model {spec} ({type(model).__name__})", lambda: copy.deepcopy(model),
                  optimizer_factory, loss_fn, _normalise_batch(batch_factory),
                  int(getattr(function, "default_batch", 16)))


def resolve_model(name: str) -> Preset:
    """The bench model called ``name``: a registry name, a preset alias, or ``module:function``."""
    if ":" in name:
        return user_model(name)
    if name in BENCH_MODELS:
        return BENCH_MODELS[name]
    try:
        return get_preset(name)
    except ValueError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(BENCH_MODELS)} "
                         "or give module:function") from None


def model_names() -> list[str]:
    return list(BENCH_MODELS)


def describe(preset: Preset) -> dict[str, Any]:
    torch.manual_seed(0)
    model = preset.build()
    params = [p for p in model.parameters() if p.requires_grad]
    return {"name": preset.name, "description": preset.description,
            "params": sum(p.numel() for p in params),
            "gradient_bytes": sum(p.numel() * p.element_size() for p in params),
            "tensors": len(params)}
