"""``transformers.Trainer`` on deft_compile's step: ``DeftTrainer``, one line for the user.

::

    from deft_compile import DeftConfig
    from deft_compile.integrations.transformers import DeftTrainer

    trainer = DeftTrainer(model=model, args=args, train_dataset=train, eval_dataset=val,   # Trainer's arguments
                          policy="deft", deft_config=DeftConfig())
    trainer.train()

What the Trainer still does: data loading and sharding across ranks, the optimizer it builds from
``args.optim`` (weight-decay groups) or the one given, the LR scheduler, logging, evaluation,
callbacks, ``save_steps`` checkpoints and resuming. What runs instead:

- Each ``training_step`` calls the compiled step: forward, the Trainer's own ``compute_loss``
  (label smoothing, ``compute_loss_func``, ``num_items_in_batch``, ``average_tokens_across_devices``),
  backward, the plan's all-reduces, clipping and the optimizer update, in one graph. The step trains
  a ``ModelView`` of the model (same parameters and names), so plans and profiles name the model's
  own parameters.
- The model is never wrapped in ``DistributedDataParallel``: accelerate prepares it in evaluation mode
  only (device placement and the mixed-precision forward of ``bf16``/``fp16``, as Trainer's own).
  The Trainer's ``optimizer.step()`` does nothing (the step applied the update), and the LR scheduler
  sets the learning rate the next update reads.
- ``TrainingArguments`` settle the step's ``DeftConfig``: ``gradient_accumulation_steps`` →
  ``accumulation_steps`` (one communication per update), ``max_grad_norm`` → ``max_grad_norm``
  (0: none), fp16's ``GradScaler`` → ``loss_scale`` (a skipped update does not step the scheduler),
  ``ddp_bucket_cap_mb`` → ``bucket_cap_mb``, ``ddp_broadcast_buffers`` → ``broadcast_buffers``.
  A ``deft_config`` that sets one of them differently raises ``ValueError``.
- Where each batch has its own sequence length (``dynamic_lengths=True``, or by default transformers'
  ``DataCollatorWithPadding`` / ``DataCollatorForSeq2Seq`` padding to the longest sample), the sequence
  dimension of the token tensors is marked dynamic (``torch._dynamo.mark_dynamic``): the step is captured and
  compiled once, symbolic in the length, from the first call. ``dynamic_lengths=False`` leaves the first length
  static (a second, symbolic capture follows the first new length).
- The logged ``grad_norm`` is the step's ``last_grad_norm`` (before clipping, as Trainer's).
- A cycle of fewer micro-batches than ``gradient_accumulation_steps`` (the end of an epoch) is
  applied by ``flush()`` with the mean over its micro-batches, as Trainer does.
- ``evaluate()`` and ``predict()`` flush pending delayed gradients first, and so does the step
  that ends training, before its checkpoint.
- Each checkpoint folder gets ``deft_step_rank<r>.pt`` per rank (``step.state_dict()``: plan,
  profile, pending gradients, accumulations, the Preserver's state, as tensors and plain data:
  ``deft_compile.step_state``); ``train(resume_from_checkpoint=...)`` reads it before training starts,
  with ``torch.load(weights_only=True)`` (no code in the file runs; a file that is not a step state raises
  ``DeftError``, a truncated one ``TornCheckpointError``), so a resumed run continues exactly. A checkpoint
  of a plain ``Trainer`` (no such files) resumes with a new step.

Only ``policy="wfbp"`` reproduces Trainer's numbers under an LR schedule: an update a policy defers to
the next call reads the learning rate of that call, which Trainer's scheduler has already stepped.
Activation checkpointing with Dropout in the recomputed layers raises ``TraceError``
(``deft_compile.step.recompute_check``).

Refused with ``ValueError`` at construction: DeepSpeed, FSDP, ``torch_compile`` (the step is
compiled already; ``DeftConfig(compiler="inductor")`` lowers it with Inductor), tensor/context/sequence
parallelism, and ``DataParallel`` over several GPUs in one process. An optimizer deft_compile cannot
capture raises ``UnsupportedOptimizerError`` when the Trainer creates it.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from transformers import DataCollatorForSeq2Seq, DataCollatorWithPadding, Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from deft_compile import step_state
from deft_compile.api import deft_compile
from deft_compile.checkpoint import refuse_together
from deft_compile.config import DeftConfig
from deft_compile.errors import DeftError
from deft_compile.integrations.model_view import ModelView
from deft_compile.planner.plan import Profile
from deft_compile.step.optim_support import check_optimizer
from deft_compile.step.runtime import CompiledStep
from deft_compile.step.wrappers import check_unwrapped_optimizer

__all__ = ["DeftTrainer", "STEP_STATE_FILE"]

log = logging.getLogger("deft_compile")

#: the step's state in a checkpoint folder, one file per rank
STEP_STATE_FILE = "deft_step_rank{rank}.pt"

# Trainer methods DeftTrainer overrides besides its public ones; a transformers without them would train with DDP
_TRAINER_HOOKS = ("_wrap_model", "_clip_grad_norm", "_get_grad_norm", "_save_checkpoint")


class DeftTrainer(Trainer):
    """``transformers.Trainer`` whose training step is ``deft_compile``'s (module docstring).

    Args (besides ``Trainer``'s):
        policy: the communication policy (``deft_compile``'s ``policy``).
        deft_config: the step's ``DeftConfig``; ``TrainingArguments`` fill in accumulation, clipping,
            fp16 loss scaling and DDP's bucket and buffer settings.
        profile: a ``Profile`` to plan from (parameter names are the model's own), as ``deft_compile``'s.
    """

    def __init__(self, *args: Any, policy: str = "deft", deft_config: DeftConfig | None = None,
                 profile: Profile | None = None, dynamic_lengths: bool | None = None, **kwargs: Any) -> None:
        missing = [name for name in _TRAINER_HOOKS if not callable(getattr(Trainer, name, None))]
        if missing:
            import transformers

            raise DeftError(f"DeftTrainer needs Trainer.{', Trainer.'.join(missing)}, which transformers "
                            f"{transformers.__version__} does not have")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            _check_arguments(training_args)
        self.deft_policy = policy
        self.deft_config = deft_config if deft_config is not None else DeftConfig()
        self.deft_profile = profile
        self.deft_step: CompiledStep | None = None
        self._deft_resume: dict[str, Any] | None = None  # the step state read from the checkpoint being resumed
        super().__init__(*args, **kwargs)
        _check_arguments(self.args)
        for enabled, what in ((self.is_deepspeed_enabled, "DeepSpeed"), (self.is_fsdp_enabled, "FSDP")):
            if enabled:
                raise ValueError(_refusal(what))
        self.add_callback(_FlushAtEnd(self))
        # whether each batch has its own sequence length: as given, else by the data collator Trainer settled on
        self.dynamic_lengths = pads_to_longest(self.data_collator) if dynamic_lengths is None else dynamic_lengths

    # -- the step ---------------------------------------------------------------------------------------------
    def step_config(self) -> DeftConfig:
        """``deft_config`` with what ``TrainingArguments`` decide (module docstring)."""
        args, config = self.args, self.deft_config
        norm = float(args.max_grad_norm) if args.max_grad_norm and args.max_grad_norm > 0 else None
        scaler = self.accelerator.scaler  # fp16 with native AMP (an accelerator device); None otherwise
        wanted = {"accumulation_steps": (args.gradient_accumulation_steps, "gradient_accumulation_steps", 1),
                  "max_grad_norm": (norm, "max_grad_norm", None),
                  "loss_scale": (scaler, "fp16", None)}
        if args.ddp_bucket_cap_mb is not None:
            wanted["bucket_cap_mb"] = (float(args.ddp_bucket_cap_mb), "ddp_bucket_cap_mb", DeftConfig.bucket_cap_mb)
        if args.ddp_broadcast_buffers is not None:
            wanted["broadcast_buffers"] = (bool(args.ddp_broadcast_buffers), "ddp_broadcast_buffers", True)
        changes = {}
        for field, (value, argument, default) in wanted.items():
            current = getattr(config, field)
            if current != default and current != value:
                raise ValueError(f"deft_config.{field}={current!r} but TrainingArguments.{argument} makes it "
                                 f"{value!r}: set it in TrainingArguments only")
            changes[field] = value
        return dataclasses.replace(config, **changes)

    def compiled_step(self, model: nn.Module) -> CompiledStep:
        """The compiled step for the model Trainer trains (built at the first training step, loaded from the
        checkpoint being resumed)."""
        optimizer = self.optimizer.optimizer if isinstance(self.optimizer, _UpdatedByStep) else None
        step = self.deft_step
        if step is not None and step.model is model and step.optimizer is optimizer:
            return step
        if not isinstance(model, ModelView) or optimizer is None:
            raise DeftError("DeftTrainer's training step got a model or optimizer it did not prepare "
                            f"({type(model).__name__}, {type(self.optimizer).__name__})")
        step = deft_compile(model, optimizer, policy=self.deft_policy, config=self.step_config(),
                            profile=self.deft_profile)
        if self._deft_resume is not None:
            step.load_state_dict(self._deft_resume)
            log.info("resumed the deft step (step %d, %d pending item(s))", step.step_count, len(step.pending))
            self._deft_resume = None
        self.deft_step = step
        return step

    def flush(self) -> None:
        """Apply every pending delayed gradient now (call on every rank)."""
        if self.deft_step is not None:
            self.deft_step.flush()

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        step = self.compiled_step(model)
        model.train()
        inputs = self._prepare_inputs(inputs)
        if self.dynamic_lengths:
            mark_lengths_dynamic(inputs)
        micro_batches = self.current_gradient_accumulation_steps
        # the step averages the micro-batches' gradients (sum / count); Trainer sums those of losses that are
        # already divided by the count, either by itself (then the step gets the plain loss) or by compute_loss
        # (num_items_in_batch over the whole cycle: the step gets that loss times the count)
        factor = micro_batches if self._loss_scaled_for_accumulation(num_items_in_batch) else 1
        with self.compute_loss_context_manager():
            loss = step(inputs, num_items_in_batch, factor)
        cycle_ends = self.accelerator.sync_gradients
        if cycle_ends and not step.last_call_updated:
            _finish_short_cycle(step)
        elif step.last_call_updated and not cycle_ends:
            raise DeftError(f"the step updated after {micro_batches} micro-batch(es) of an accumulation cycle that "
                            f"Trainer had not ended (step count {step.step_count})")
        return loss.detach() / micro_batches

    def _loss_scaled_for_accumulation(self, num_items_in_batch: Any) -> bool:
        """Trainer's rule: is ``compute_loss``'s loss already divided over the whole accumulation cycle?"""
        if getattr(self, "loss_is_scaled_for_ga", None) is not None:
            return bool(self.loss_is_scaled_for_ga)
        return bool((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                    or self.compute_loss_func is not None)

    # -- Trainer's hooks ----------------------------------------------------------------------------------------
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if not training or isinstance(model, ModelView):
            return super()._wrap_model(model, training, dataloader) if not training else model
        if self.args.n_gpu > 1:
            raise ValueError(_refusal(f"DataParallel over {self.args.n_gpu} GPUs in one process"))
        # device placement and the mixed-precision forward, never DDP: the step averages the gradients
        prepared = self.accelerator.prepare_model(model, evaluation_mode=True)
        return ModelView(prepared, self._compute_step_loss)

    def _compute_step_loss(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any,
                           factor: int) -> torch.Tensor:
        """The forward the step traces: Trainer's ``compute_loss`` on the model, times ``factor``."""
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        return loss * factor if factor != 1 else loss

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        if not isinstance(optimizer, _UpdatedByStep):
            check_unwrapped_optimizer(optimizer)
            check_optimizer(optimizer)
            optimizer = self.optimizer = _UpdatedByStep(optimizer, self)
        return optimizer

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor | None:
        """The step clipped inside its graph; its norm (None before an update applied any gradient)."""
        return self.deft_step.last_grad_norm if self.deft_step is not None else None

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> float | None:
        if grad_norm is None:  # no clipping: the norm of the gradients the update applied (param.grad)
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        return grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        if self.deft_step is not None:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, STEP_STATE_FILE.format(rank=_rank()))
            step_state.write(self.deft_step.state_dict(), path)
        super()._save_checkpoint(model, trial)

    # -- public entry points ------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True  # True: Trainer's error
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            self._deft_resume = _read_step_state(os.fspath(resume_from_checkpoint))  # refused before training
            self.deft_step = None  # a new step, loaded from the checkpoint
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        self.flush()
        return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any):
        self.flush()
        return super().predict(*args, **kwargs)


def pads_to_longest(collator: Any) -> bool:
    """Whether ``collator`` pads each batch to its own longest sample: transformers' ``DataCollatorWithPadding`` and
    ``DataCollatorForSeq2Seq`` with ``padding`` True or ``"longest"`` (their default). Others (a fixed length, a
    collator of the user's, language-model collators over fixed-size blocks) are not assumed to."""
    return (isinstance(collator, (DataCollatorWithPadding, DataCollatorForSeq2Seq))
            and collator.padding in (True, "longest"))


def mark_lengths_dynamic(inputs: dict[str, Any]) -> None:
    """Mark the sequence dimension (1) of every integer batch tensor of two or more dimensions (token ids, masks,
    labels) dynamic (``torch._dynamo.mark_dynamic``), where it has at least two positions: the step captures it
    symbolic from the first call, instead of a static capture (and its compiles) for the first length and a
    symbolic one at the second. A length of 1 stays static (a symbolic size is never 0 or 1), and so do
    floating-point features (images, embeddings), whose dimension 1 is no length."""
    for value in inputs.values():
        if (isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dim() >= 2
                and value.shape[1] >= 2):
            torch._dynamo.mark_dynamic(value, 1)


class _UpdatedByStep(torch.optim.Optimizer):
    """The optimizer as Trainer holds it: the compiled step applies the update, so ``step()`` does nothing; param
    groups, state and state dicts are the optimizer's own. Marked prepared, so accelerate does not wrap it (its
    wrapper would step a ``GradScaler`` of its own); ``step_was_skipped`` reports the step's loss-scaling skips."""

    _is_accelerate_prepared = True

    def __init__(self, optimizer: torch.optim.Optimizer, trainer: DeftTrainer) -> None:  # noqa: D107
        self.optimizer = optimizer
        self._trainer = trainer

    param_groups = property(lambda self: self.optimizer.param_groups,
                            lambda self, value: setattr(self.optimizer, "param_groups", value))
    state = property(lambda self: self.optimizer.state, lambda self, value: setattr(self.optimizer, "state", value))
    defaults = property(lambda self: self.optimizer.defaults,
                        lambda self, value: setattr(self.optimizer, "defaults", value))

    @property
    def step_was_skipped(self) -> bool:
        step = self._trainer.deft_step
        return bool(step is not None and step.last_update_skipped)

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise DeftError("DeftTrainer's optimizer takes no closure: the compiled step applies the update")
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise DeftError("add_param_group after the step was built changes what it traced; add groups before training")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


class _FlushAtEnd(TrainerCallback):
    """Flush when the step that ends training is done, before its checkpoint, so the model saved and evaluated
    last holds every gradient."""

    def __init__(self, trainer: DeftTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps or control.should_training_stop:
            self.trainer.flush()

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.flush()


def _finish_short_cycle(step: CompiledStep) -> None:
    """Apply a cycle Trainer ended early (fewer micro-batches than ``accumulation_steps``): ``flush()`` applies the
    mean over its micro-batches; the step counter then moves to the next cycle's start, where the step counts its
    accumulation cycles from."""
    step.flush()
    steps = step.config.accumulation_steps
    step.step_count += -step.step_count % steps


def _read_step_state(folder: str) -> dict[str, Any] | None:
    """This rank's step state in a Trainer checkpoint folder (``STEP_STATE_FILE``), read as tensors and plain
    data (``deft_compile.step_state``: no code in the file runs); None for a plain Trainer checkpoint. A rank that
    refuses its file makes every rank raise (``refuse_together``), so none waits in Trainer's collectives."""
    path = os.path.join(folder, STEP_STATE_FILE.format(rank=_rank()))
    state, refusal = None, None
    try:
        if os.path.exists(path):
            state = step_state.read(path, f"{path} (DeftTrainer's step state of rank {_rank()})")
        elif saved := glob.glob(os.path.join(folder, STEP_STATE_FILE.format(rank="*"))):
            raise DeftError(f"{folder} holds the deft step of {len(saved)} rank(s) but not of rank {_rank()}: resume "
                            f"with the world size it was saved with")
    except DeftError as error:
        refusal = error
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        refuse_together(refusal, None, folder)
    elif refusal is not None:
        raise refusal
    if state is None:
        log.warning("%s holds no deft step state (a plain Trainer checkpoint): the step starts afresh", folder)
    else:
        log.info("read the deft step state from %s", path)
    return state


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _refusal(what: str) -> str:
    return (f"DeftTrainer trains data parallel with deft_compile's compiled step, which does not combine with "
            f"{what}; use transformers.Trainer for it, or turn it off")


def _check_arguments(args: Any) -> None:
    """Refuse the ``TrainingArguments`` DeftTrainer cannot honour (``ValueError`` naming the setting)."""
    if getattr(args, "torch_compile", False) or getattr(args, "torch_compile_backend", None):
        raise ValueError(
            "DeftTrainer compiles the whole training step (forward, backward, communication, update) with "
            "deft_compile; TrainingArguments(torch_compile=True) would compile the model a second time, inside it "
            "(and accelerate does not know the backend name 'deft'). Leave torch_compile and torch_compile_backend "
            "unset; DeftConfig(compiler='inductor') lowers the step with Inductor")
    if getattr(args, "deepspeed", None):
        raise ValueError(_refusal("DeepSpeed (TrainingArguments.deepspeed)"))
    if getattr(args, "fsdp", None):
        raise ValueError(_refusal("FSDP (TrainingArguments.fsdp)"))
    if getattr(args, "parallelism_config", None) is not None:
        raise ValueError(_refusal("tensor, context or sequence parallelism (TrainingArguments.parallelism_config)"))
