"""A small causal LM and its loss, for the tests' transformer and ``benchmarks/convergence.py``'s char-LM (not
run by the ``deft-compile`` CLI, so not in the package)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalLM(nn.Module):
    """Decoder-only LM from ``nn.TransformerEncoder`` blocks: pre-norm, causal mask, learned positions, tied
    input/output embedding. The tests' transformer and the char-LM of ``benchmarks/convergence.py``.

    The blocks have no biases: the key projection's bias has a mathematically zero gradient (softmax
    ignores a per-row constant), pure round-off that AdamW would amplify into noise of size lr and make
    any two correct implementations differ. ``embed_std`` re-initialises the tied embedding GPT-style
    (PyTorch's N(0, 1) gives initial logits of std ~sqrt(dim)).
    """

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, context: int, ffn: int = 4,
                 embed_std: float | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(context, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=ffn * dim, dropout=0.0, batch_first=True,
                                           norm_first=True, bias=False)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied
        if embed_std is not None:
            nn.init.normal_(self.embed.weight, std=embed_std)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        h = self.embed(tokens) + self.position[:length]
        h = self.blocks(h, mask=self.causal_mask[:length, :length], is_causal=True)
        return self.lm_head(self.norm(h))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``(batch, length, vocab)`` logits against ``(batch, length)`` targets."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
