"""Training loops people already run, on deft_compile's step.

- ``deft_compile.integrations.transformers``: ``DeftTrainer``, a ``transformers.Trainer`` whose training step is
  ``deft_compile``'s (``pip install deft-compile[transformers]``).
- ``accelerate``: a recipe, no code of its own (docs/INTEGRATIONS.md): ``accelerator.prepare`` the data loaders,
  ``accelerator.prepare_model(model, evaluation_mode=True)`` for device placement and mixed precision, and give
  ``deft_compile`` the plain model and optimizer.

``deft_compile.checkpoint`` saves a step with ``torch.distributed.checkpoint``; ``deft_compile()`` and
``backend="deft"`` unwrap or refuse ``DistributedDataParallel`` (``deft_compile.step.wrappers``).
"""
