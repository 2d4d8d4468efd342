"""Small ``transformers`` models built from configs with random weights (nothing is downloaded)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

VOCAB, SEQ, BATCH = 64, 16, 4


def build_hf_model(family: str) -> tuple[nn.Module, Callable[[torch.Generator], dict]]:
    """(model, make_batch(generator) -> keyword arguments with ``labels``) for ``gpt2``, ``bert`` or ``llama``."""
    import transformers

    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4)
        model = transformers.GPT2LMHeadModel(config)
    elif family == "bert":
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, max_position_embeddings=SEQ)
        model = transformers.BertForMaskedLM(config)
    elif family == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
        model = transformers.LlamaForCausalLM(config)
    else:
        raise ValueError(f"unknown family {family!r}")

    def make_batch(generator: torch.Generator) -> dict:
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        return {"input_ids": ids, "labels": ids.clone()}

    return model, make_batch
