"""Small, CPU-friendly preset models for ``deft-compile explain``, ``bench`` and the demo (the tests use them too).

Each preset is a scaled-down member of a family the paper benchmarks (an MLP,
VGG, ResNet and GPT-2), small enough to trace and profile on one laptop core in
a few seconds, with the optimizer its family is usually trained with. A preset
builds everything one step needs::

    model, optimizer, loss_fn, args, kwargs = get_preset("resnet").make(seed=0)
    loss = deft_compile(model, optimizer, loss_fn)(*args, **kwargs)

``loss_fn`` is ``None`` for the transformer, whose ``forward(tokens,
targets=...)`` returns the loss itself (the ``deft_compile`` calling
convention without ``loss_fn``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

# --- models ---------------------------------------------------------------------------


def mlp(width: int = 512, depth: int = 3, inputs: int = 256, classes: int = 10) -> nn.Module:
    """Fully connected classifier (the demo's model): ``inputs -> width x depth -> classes``."""
    layers: list[nn.Module] = []
    features = inputs
    for _ in range(depth):
        layers += [nn.Linear(features, width), nn.ReLU()]
        features = width
    layers.append(nn.Linear(features, classes))
    return nn.Sequential(*layers)


class VGGStyle(nn.Module):
    """VGG-style CNN for 32x32 images: stacks of 3x3 conv + ReLU, max-pool per stage, FC head.

    Like VGG, most of the parameters sit in the fully connected head, i.e. in
    the *first* gradients to become ready in backward and the *last* layers of
    the forward.
    """

    def __init__(self, widths: tuple[int, ...] = (32, 64, 128, 128), convs_per_stage: int | tuple[int, ...] = 2,
                 hidden: int = 512, classes: int = 10, image: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        convs = (convs_per_stage,) * len(widths) if isinstance(convs_per_stage, int) else tuple(convs_per_stage)
        if len(convs) != len(widths):
            raise ValueError("convs_per_stage needs one count per stage width")
        for width, count in zip(widths, convs):
            for _ in range(count):
                layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU()]
                channels = width
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        side = max(1, image // 2 ** len(widths))
        self.classifier = nn.Sequential(
            nn.Linear(channels * side * side, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


class BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 convs, BatchNorm, identity or 1x1 projection shortcut)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetStyle(nn.Module):
    """ResNet-style CNN for 32x32 images (CIFAR ResNet layout): stem, 4 stages of basic blocks, pooled FC.

    Most parameters sit in the *last* stage (input side of the backward), the
    opposite of VGG: the largest gradients become ready last.
    """

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64, 128), blocks: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        stages: list[nn.Module] = []
        cin = widths[0]
        for index, width in enumerate(widths):
            for b in range(blocks):
                stages.append(BasicBlock(cin, width, 2 if (b == 0 and index > 0) else 1))
                cin = width
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class GPTBlock(nn.Module):
    """GPT-2 block: pre-LayerNorm causal self-attention and a 4x GELU MLP, both residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.mlp_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(dim, dim=2)
        shape = (batch, length, self.heads, dim // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(attended.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2Style(nn.Module):
    """Decoder-only GPT-2 layout (token + learned position embeddings, tied LM head), scaled down.

    ``forward(tokens, targets=None)`` returns the logits, or the mean
    next-token cross-entropy when ``targets`` is given.
    """

    def __init__(self, vocab: int = 1024, dim: int = 128, heads: int = 4, layers: int = 4, context: int = 64) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        self.h = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * layers) if "proj" in name else 1.0))
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --- presets --------------------------------------------------------------------------

Batch = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class Preset:
    """A model family with its optimizer, loss and a batch factory.

    ``batch(size, generator)`` returns ``(args, kwargs)`` for one call of the
    compiled step: ``(inputs, targets), {}`` with a ``loss_fn``, or
    ``(tokens,), {"targets": labels}`` for a model that returns its loss.
    """

    name: str
    description: str
    build: Callable[[], nn.Module]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    loss_fn: Callable[..., torch.Tensor] | None
    batch: Callable[[int, torch.Generator], Batch]
    default_batch: int

    def make(self, seed: int = 0, batch_size: int | None = None, rank: int = 0) -> tuple[
            nn.Module, torch.optim.Optimizer, Callable[..., torch.Tensor] | None, tuple[Any, ...], dict[str, Any]]:
        """``(model, optimizer, loss_fn, args, kwargs)``; the model depends on ``seed``, the batch also on ``rank``."""
        torch.manual_seed(seed)
        model = self.build()
        generator = torch.Generator().manual_seed(1000 * (seed + 1) + rank)
        args, kwargs = self.batch(batch_size or self.default_batch, generator)
        return model, self.optimizer(model), self.loss_fn, args, kwargs

    def parameter_count(self) -> int:
        torch.manual_seed(0)
        return sum(p.numel() for p in self.build().parameters())


def _images(size: int, g: torch.Generator) -> Batch:
    return (torch.randn(size, 3, 32, 32, generator=g), torch.randint(0, 10, (size,), generator=g)), {}


def _vectors(size: int, g: torch.Generator) -> Batch:
    return (torch.randn(size, 256, generator=g), torch.randint(0, 10, (size,), generator=g)), {}


def _tokens(size: int, g: torch.Generator, vocab: int = 1024, context: int = 64) -> Batch:
    tokens = torch.randint(0, vocab, (size, context + 1), generator=g)
    return (tokens[:, :-1],), {"targets": tokens[:, 1:]}


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)


PRESETS: dict[str, Preset] = {
    "mlp": Preset("mlp", "MLP 256-512x3-10, SGD momentum",
                  mlp, _sgd, F.cross_entropy, _vectors, 64),
    "vgg": Preset("vgg", "VGG-style CNN, 8 conv + 3 FC, 32x32 images, SGD momentum",
                  VGGStyle, _sgd, F.cross_entropy, _images, 16),
    "resnet": Preset("resnet", "ResNet-style CNN, 4 stages x 2 basic blocks, 32x32 images, "
                     "SGD momentum", ResNetStyle, _sgd, F.cross_entropy, _images, 16),
    "gpt2": Preset("gpt2", "GPT-2-style decoder, 4 blocks, dim 128, vocab 1024, context 64, tied head, "
                   "AdamW", GPT2Style, _adamw, None, _tokens, 8),
}
#: Other names accepted on the command line.
ALIASES: dict[str, str] = {"cnn": "vgg", "transformer": "gpt2"}
PRESET_NAMES: tuple[str, ...] = tuple(PRESETS) + tuple(ALIASES)


def get_preset(name: str) -> Preset:
    """The preset called ``name`` (or one of its aliases: ``cnn`` = vgg, ``transformer`` = gpt2)."""
    key = ALIASES.get(name, name)
    try:
        return PRESETS[key]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESET_NAMES)}") from None


# --- benchmark-suite models: models nobody tuned the planner for ----------------------------


class VGGBN(nn.Module):
    """VGG-16 with BatchNorm (configuration D: convs 2-2-3-3-3) for 32x32 images.

    ``width`` divides torchvision's channels (64..512); the head is 512/width·… ->
    ``hidden`` -> ``hidden`` -> classes, so most parameters sit in the FC head, as
    in VGG. Convolutions have no bias (BatchNorm follows).
    """

    def __init__(self, width: int = 4, hidden: int = 1024, classes: int = 10, layout=(2, 2, 3, 3, 3)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for stage, count in enumerate(layout):
            out = min(512, 64 * 2**stage) // width
            for _ in range(count):
                layers += [nn.Conv2d(channels, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU()]
                channels = out
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Linear(channels, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                  nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class HFLoss(nn.Module):
    """A ``transformers`` model built from a config with random weights; ``forward(ids, labels)`` returns its loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def hf_gpt2(layers: int = 2, dim: int = 768, heads: int = 12, vocab: int = 8192, context: int = 64) -> nn.Module:
    """GPT-2-small-like (dim 768, 12 heads, GELU MLP x4, tied head) with fewer blocks and a smaller vocabulary."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=context,
                        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, loss_type="ForCausalLM")
    return HFLoss(GPT2LMHeadModel(config))


def hf_bert(layers: int = 2, dim: int = 768, heads: int = 12, vocab: int = 8192, context: int = 64) -> nn.Module:
    """BERT-base-like masked LM (dim 768, 12 heads, FFN 3072) with fewer layers and a smaller vocabulary."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(num_hidden_layers=layers, hidden_size=dim, num_attention_heads=heads, intermediate_size=4 * dim,
                        vocab_size=vocab, max_position_embeddings=context, attention_probs_dropout_prob=0.0,
                        hidden_dropout_prob=0.0, loss_type="ForMaskedLM")
    return HFLoss(BertForMaskedLM(config))


def _hf_tokens(size: int, g: torch.Generator, vocab: int = 8192, context: int = 64) -> Batch:
    tokens = torch.randint(0, vocab, (size, context), generator=g)
    return (tokens, tokens.clone()), {}


SUITE_PRESETS: dict[str, Preset] = {
    "vgg16-bn": Preset("vgg16-bn", "VGG-16 with BatchNorm (convs 2-2-3-3-3, channels /4, FC 1024), 32x32, SGD momentum",
                       VGGBN, _sgd, F.cross_entropy, _images, 32),
    "gpt2-small-hf": Preset("gpt2-small-hf", "transformers GPT-2 (dim 768, 12 heads) 2 blocks, vocab 8192, context 64, "
                            "random weights, AdamW", hf_gpt2, _adamw, None, _hf_tokens, 2),
    "bert-base-hf": Preset("bert-base-hf", "transformers BERT (dim 768, 12 heads, FFN 3072) 2 layers, vocab 8192, "
                           "context 64, random weights, AdamW", hf_bert, _adamw, None, _hf_tokens, 2),
}
#: Tiny versions for ``benchmarks/suite.py --quick`` and its test.
QUICK_PRESETS: dict[str, Preset] = {
    "vgg16-bn-tiny": Preset("vgg16-bn-tiny", "VGG-16-BN, channels /16, FC 128", lambda: VGGBN(width=16, hidden=128),
                            _sgd, F.cross_entropy, _images, 4),
    "gpt2-hf-tiny": Preset("gpt2-hf-tiny", "transformers GPT-2, 1 block x 64, vocab 256",
                           lambda: hf_gpt2(layers=1, dim=64, heads=4, vocab=256, context=16), _adamw, None,
                           lambda size, g: _hf_tokens(size, g, vocab=256, context=16), 2),
}
