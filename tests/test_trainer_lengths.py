"""Which batches ``DeftTrainer`` treats as having lengths of their own (``pads_to_longest``), and what it marks
dynamic in them (``mark_lengths_dynamic``); the end-to-end check (one capture, Trainer's numbers) is
tests/test_shapes.py's dynamic-padding fine-tune."""

from __future__ import annotations

import torch
import transformers

from deft_compile.integrations.transformers import mark_lengths_dynamic, pads_to_longest


def test_transformers_padding_collators_pad_to_the_longest_sample_unless_told_a_length():
    tokenizer = object()  # the collators keep it; nothing here calls it
    assert pads_to_longest(transformers.DataCollatorWithPadding(tokenizer))
    assert pads_to_longest(transformers.DataCollatorWithPadding(tokenizer, padding="longest"))
    assert pads_to_longest(transformers.DataCollatorForSeq2Seq(tokenizer))
    assert not pads_to_longest(transformers.DataCollatorWithPadding(tokenizer, padding="max_length", max_length=64))
    assert not pads_to_longest(transformers.DataCollatorWithPadding(tokenizer, padding=False))
    assert not pads_to_longest(transformers.default_data_collator)  # stacks samples as they are
    assert not pads_to_longest(lambda samples: samples)  # a collator of the user's: not assumed


def test_the_length_of_token_tensors_is_marked_and_nothing_else():
    batch = {"input_ids": torch.ones(4, 9, dtype=torch.long), "attention_mask": torch.ones(4, 9, dtype=torch.long),
             "labels": torch.ones(4, 7, dtype=torch.long), "one_token": torch.ones(4, 1, dtype=torch.long),
             "pixel_values": torch.ones(4, 3, 8, 8), "scores": torch.ones(4, dtype=torch.long)}
    mark_lengths_dynamic(batch)
    marked = {k for k, v in batch.items() if getattr(v, "_dynamo_dynamic_indices", None)}
    assert marked == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"]._dynamo_dynamic_indices == {1}


def test_deft_trainer_decides_once_from_its_collator_unless_told(tmp_path):
    from deft_compile.integrations.transformers import DeftTrainer

    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no")

    def trainer(**kwargs):
        return DeftTrainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=[], **kwargs)

    padding = transformers.DataCollatorWithPadding(object())
    assert trainer(data_collator=padding).dynamic_lengths is True
    assert trainer(data_collator=padding, dynamic_lengths=False).dynamic_lengths is False
    assert trainer().dynamic_lengths is False  # Trainer's default_data_collator: samples stacked as they are
    assert trainer(dynamic_lengths=True).dynamic_lengths is True
