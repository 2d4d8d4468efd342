"""Capture one whole training step (forward, loss, backward, optimizer update) as an FX graph.

The step is traced with ``make_fx`` in fake-tensor mode, so tracing runs no real
kernels and consumes no random numbers: the graph, when run, draws exactly the
random numbers eager training would (Dropout stays exact). Parameters, buffers,
optimizer state and the user's tensor inputs are graph inputs, in that order;
the graph updates parameters, buffers and state *in place*, exactly like the
eager optimizer, so the live ``model`` and ``optimizer`` stay the source of
truth. Outputs are the detached loss, then any optimizer state the step created
instead of updating (first-step initialisation, e.g. Adam's moments), then the
gradients the optimizer applied (averaged, once the passes ran), which the
runtime stores in ``param.grad`` as DDP leaves them.

Marker ops from :mod:`deft_compile.ir.ops` tag each parameter's gradient and the end
of the forward pass; :mod:`deft_compile.step.annotate` reads them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import itertools
import linecache
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module
from torch.fx.passes.shape_prop import _extract_tensor_metadata
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.func import functional_call
from torch.utils import _pytree as pytree

from deft_compile.ir import ops
from deft_compile.errors import LossError, TraceError
from deft_compile.outputs import loss_of
from deft_compile.ir.layout import GraphInputs, GraphLayout
from deft_compile.step.optim_support import (hyperparameter_inputs, hyperparameter_slots, traceable_optimizer,
                                              traced_hyperparameters)
from deft_compile.step.recompute_check import check_no_random_after_forward
from deft_compile.step.symbolic import SymbolicShapes

StateSlot = tuple[int, str]  # (parameter index, optimizer-state key)
#: ``graph_module.meta`` key of the capture a graph was copied from: what is derived from one capture's nodes
#: (their names, shapes and baked-in constants) is never reused for another's
CAPTURE_ID = "deft_capture_id"
_capture_ids = itertools.count()
#: ``graph_module.meta`` key set on graphs of a capture with symbolic input dimensions (``step/symbolic.py``)
SYMBOLIC = "deft_symbolic"


@dataclass
class ModelState:
    """The live tensors a captured step reads and updates, in graph-input order.

    Tied parameters appear once (``named_parameters`` de-duplicates them), so a
    tied weight has one gradient, one bucket slot and one update, as in DDP.
    """

    param_names: list[str]
    params: list[nn.Parameter]
    buffer_names: list[str]
    buffers: list[torch.Tensor]

    @classmethod
    def of(cls, model: nn.Module) -> "ModelState":
        named_params = list(model.named_parameters())
        named_buffers = list(model.named_buffers())
        return cls(
            param_names=[n for n, _ in named_params],
            params=[p for _, p in named_params],
            buffer_names=[n for n, _ in named_buffers],
            buffers=[b for _, b in named_buffers],
        )

    def index_of(self) -> dict[torch.Tensor, int]:
        return {p: i for i, p in enumerate(self.params)}


@dataclass
class CapturedStep:
    """A traced step and the meaning of each of its inputs and outputs."""

    graph_module: fx.GraphModule
    model_state: ModelState
    state_inputs: list[StateSlot]
    state_outputs: list[StateSlot]
    gradient_outputs: list[int]
    num_user_inputs: int
    user_spec: pytree.TreeSpec
    user_constants: list[Any]
    trainable: list[bool]
    extra_state: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: the symbolic dimensions of a capture traced for a family of input shapes, else None
    symbolic: SymbolicShapes | None = None

    @property
    def num_params(self) -> int:
        return len(self.model_state.params)

    @property
    def num_buffers(self) -> int:
        return len(self.model_state.buffers)

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph_module.graph.nodes if n.op == "placeholder"]

    def param_placeholders(self) -> list[fx.Node]:
        return self.placeholders()[: self.num_params]

    def buffer_placeholders(self) -> list[fx.Node]:
        return self.placeholders()[self.num_params : self.num_params + self.num_buffers]

    def state_placeholders(self) -> list[fx.Node]:
        start = self.num_params + self.num_buffers
        return self.placeholders()[start : start + len(self.state_inputs)]

    def copy_for_passes(self) -> "CapturedStep":
        """The same capture on a copy of its graph and layout, for the passes to rewrite. Copying a graph takes
        milliseconds where tracing the step again takes seconds; node meta (shapes, the annotation) is kept."""
        graph = copy.deepcopy(self.graph_module.graph)
        # a lazy graph module under ``lowering.lazy_graph_modules()``: its code is generated when it first runs
        graph_module = _make_graph_module(self.graph_module, graph, class_name=type(self.graph_module).__name__)
        graph_module.meta = {**self.graph_module.meta, "deft_layout": copy.deepcopy(self.graph_module.meta["deft_layout"])}
        return dataclasses.replace(self, graph_module=graph_module)

    def graph_hash(self) -> str:
        """A digest of the graph's code; equal on every rank that traced the same step."""
        return hashlib.sha256(self.graph_module.code.encode()).hexdigest()


def split_user_inputs(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[Any], pytree.TreeSpec]:
    """Separate tensor leaves (graph inputs) from everything else (baked constants)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    return tensors, constants, spec


def join_user_inputs(tensors: list[torch.Tensor], constants: list[Any], spec: pytree.TreeSpec) -> tuple[tuple, dict]:
    it = iter(tensors)
    leaves = [next(it) if c is None else c for c in constants]
    return pytree.tree_unflatten(leaves, spec)


def _initial_state(optimizer: torch.optim.Optimizer, model_state: ModelState, state_inputs: list[StateSlot],
                   states: Sequence[torch.Tensor]) -> dict[int, dict[str, Any]]:
    """Each parameter's optimizer state as the traced step starts: the state tensors entering as graph inputs and
    the non-tensor entries (step counts kept as Python numbers)."""
    initial: dict[int, dict[str, Any]] = {i: {} for i in range(len(model_state.params))}
    for slot, tensor in zip(state_inputs, states):
        initial[slot[0]][slot[1]] = tensor
    for i, entries in _non_tensor_state(optimizer, model_state).items():
        initial[i].update(entries)
    return initial


def capture_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor] | None,
    args: tuple,
    kwargs: dict,
    state_inputs: list[StateSlot],
    *,
    scale_loss: bool = False,
    accumulation_steps: int = 1,
    dynamic_dims: frozenset[tuple[int, int]] = frozenset(),
) -> CapturedStep:
    """Trace one training step of ``model`` with ``optimizer`` on example inputs.

    ``state_inputs`` lists the optimizer-state tensors that already exist and
    enter the graph as inputs (empty before the first step, when the optimizer
    creates its state inside the graph).

    An ambient ``torch.autocast`` (the caller's, for any device type) applies to
    the forward pass and the loss only, as in an eager loop that calls
    ``backward()`` and ``optimizer.step()`` outside the autocast region.

    With ``scale_loss`` the graph takes two more inputs after the hyper-parameters,
    the loss scale (0-dim float32) and the scaler's growth tracker (0-dim int32):
    backward runs on ``loss * scale`` and every local gradient is multiplied by
    ``1 / scale`` right away (``GradScaler.unscale_``'s arithmetic; exact for the
    power-of-two scales dynamic scaling uses), so communication, delays and the
    update see unscaled gradients. The non-finite check, the skip and the scale
    update are added by the ``gradient_guards`` pass. With ``accumulation_steps`` N > 1
    the backward seed is ``(loss / N) * scale``, as in the usual recipe
    ``scaler.scale(loss / N).backward()``, so fp16 overflows where that recipe does;
    the unscale multiplies by ``N / scale`` (the schedule pass takes the mean).

    ``dynamic_dims`` (pairs of user-tensor index and dimension) are traced as symbols: the graph then serves every
    size of those dimensions its guards admit (``SymbolicShapes``); everything else, parameters and state
    included, keeps its static shape.
    """
    autocast_settings = ambient_autocast()
    model_state = ModelState.of(model)
    index_of = model_state.index_of()
    _check_param_groups(optimizer, index_of)
    user_tensors, user_constants, user_spec = split_user_inputs(args, kwargs)
    num_params, num_buffers, num_states = len(model_state.params), len(model_state.buffers), len(state_inputs)
    hyper_slots = hyperparameter_slots(optimizer)
    hyper_values = hyperparameter_inputs(optimizer, hyper_slots)
    num_user, num_hyper = len(user_tensors), len(hyper_values)
    state_outputs: list[StateSlot] = []
    gradient_outputs: list[int] = []
    extra_state: dict[int, dict[str, Any]] = {}
    tracker = _ModuleTracker(model)

    def step(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        params = list(flat[:num_params])
        buffers = flat[num_params : num_params + num_buffers]
        states = flat[num_params + num_buffers : num_params + num_buffers + num_states]
        user_start = num_params + num_buffers + num_states
        user = list(flat[user_start : user_start + num_user])
        hyper_end = user_start + num_user + num_hyper
        # each group's lr and other hyper-parameters as symbolic floats read from their graph inputs: derived values
        # (AdamW's 1 - lr * wd, Adam's lr / bias_correction) are computed in the graph, not baked in
        hyperparameters = traced_hyperparameters(hyper_slots,
                                                 [value.item() for value in flat[user_start + num_user : hyper_end]])
        scale = flat[hyper_end] if scale_loss else None
        call_args, call_kwargs = join_user_inputs(user, user_constants, user_spec)
        tensors = dict(zip(model_state.param_names, params))
        tensors.update(zip(model_state.buffer_names, buffers))
        with tracker.active("forward"), forward_autocast(autocast_settings):
            loss = _forward_loss(model, tensors, loss_fn, call_args, call_kwargs)
        _check_scalar_loss(loss)
        ops.phase(loss.detach(), "forward")
        with tracker.active("backward"):
            if scale is None:
                loss.backward()
            else:
                ((loss / accumulation_steps if accumulation_steps > 1 else loss) * scale).backward()
        _mark_gradients(params, scale, accumulation_steps)
        with tracker.active("optimizer.step"):
            new_state = _traced_update(optimizer, model_state, index_of, params, state_inputs, states, hyperparameters,
                                       state_outputs, extra_state)
        gradients = []
        for index, p in enumerate(params):
            if p.grad is not None:
                gradient_outputs.append(index)
                gradients.append(p.grad)
        return (loss.detach(), *new_state, *gradients)

    example, symbolic = _examples(model_state, optimizer, state_inputs, user_tensors, hyper_values, scale_loss,
                                  dynamic_dims)
    graph_module = _trace(step, example, tracker, symbolic=symbolic is not None)
    if symbolic is not None:
        graph_module = symbolic.rebase_sizes(graph_module)
        graph_module.meta[SYMBOLIC] = True
    check_no_random_after_forward(graph_module)  # activation checkpointing with Dropout (step/recompute_check.py)
    graph_module.meta[CAPTURE_ID] = next(_capture_ids)  # every step graph of this capture carries it
    graph_module.meta["deft_layout"] = GraphLayout(
        num_params=num_params,
        num_buffers=num_buffers,
        state_inputs=list(state_inputs),
        num_user_inputs=len(user_tensors),
        hyper_inputs=list(hyper_slots),
        num_scaler_inputs=2 if scale_loss else 0,
        state_outputs=list(state_outputs),
        gradient_outputs=list(gradient_outputs),
    )
    return CapturedStep(
        graph_module=graph_module,
        model_state=model_state,
        state_inputs=list(state_inputs),
        state_outputs=state_outputs,
        gradient_outputs=gradient_outputs,
        num_user_inputs=len(user_tensors),
        user_spec=user_spec,
        user_constants=user_constants,
        trainable=[p.requires_grad for p in model_state.params],
        extra_state=extra_state,
        symbolic=symbolic,
    )


def recapture_with_state(captured: CapturedStep, optimizer: torch.optim.Optimizer,
                         state_inputs: list[StateSlot]) -> CapturedStep | None:
    """``captured`` with the optimizer's update traced again for the state tensors ``state_inputs`` (optimizer
    state that appeared since, such as a delayed bucket's first update), its forward and backward nodes reused:
    the ops ``capture_step`` would trace for them, in the same order (a symbolic capture's scalar reads aside),
    for the update's trace alone. None where the capture does not split there: no gradient reaches the update,
    or a node before the update reads an optimizer-state input.

    The split: ``make_fx`` records ops in the order they run, and the capture marks every gradient
    (``deft.gradient``) after the backward and before the update, so the nodes up to the last marker are the
    forward and backward. The update is traced on the capture's own example values (its shape environment, so a
    symbolic capture stays one), its inputs mapped onto the capture's parameters, gradient markers and
    hyper-parameter inputs and onto new state inputs."""
    gm, layout = captured.graph_module, captured.graph_module.meta["deft_layout"]
    nodes = list(gm.graph.nodes)
    inputs = layout.inputs(gm.graph)
    markers = [i for i, n in enumerate(nodes) if n.op == "call_function" and n.target is ops.GRADIENT]
    output = nodes[-1]
    if not markers or output.op != "output":
        return None
    prefix = nodes[: markers[-1] + 1]
    num_params = captured.num_params
    position = {node: i for i, node in enumerate(nodes)}
    if any(position[user] <= markers[-1] for state in inputs.states for user in state.users):
        return None
    outputs = output.args[0]
    loss, gradients = outputs[0], outputs[len(outputs) - len(captured.gradient_outputs):]
    params = [n.meta["val"] for n in inputs.params]
    live = captured.model_state.params
    states = [_example_state(params[i], optimizer.state[live[i]][key]) for i, key in state_inputs]
    hyper_slots = list(layout.hyper_inputs)
    state_outputs: list[StateSlot] = []
    extra_state: dict[int, dict[str, Any]] = {}
    index_of = captured.model_state.index_of()

    def update(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        traced_params = list(flat[:num_params])
        grads = flat[num_params : num_params + len(gradients)]
        state_values = flat[num_params + len(gradients) : num_params + len(gradients) + len(states)]
        values = flat[num_params + len(gradients) + len(states):]
        hyperparameters = traced_hyperparameters(hyper_slots, [value.item() for value in values])
        for index, grad in zip(captured.gradient_outputs, grads):
            traced_params[index].grad = grad
        return tuple(_traced_update(optimizer, captured.model_state, index_of, traced_params, state_inputs,
                                    state_values, hyperparameters, state_outputs, extra_state))

    examples = [*params, *[g.meta["val"] for g in gradients], *states, *[h.meta["val"] for h in inputs.hyper]]
    saved = [(p, p.grad) for p in params]
    try:
        with _compile_session(), no_autocast():
            traced_update = make_fx(update, tracing_mode="symbolic" if captured.symbolic is not None else "fake",
                                    _allow_non_fake_inputs=True)(*examples)
    finally:
        for p, grad in saved:
            p.grad = grad
    return _spliced(captured, prefix, inputs, loss, gradients, traced_update, state_inputs, states, state_outputs,
                    extra_state)


_ITEM = torch.ops.aten._local_scalar_dense.default


def _example_state(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A state tensor's example value in the capture's fake mode (that of ``param``'s example)."""
    return param.fake_mode.from_tensor(value, static_shapes=True) if hasattr(param, "fake_mode") else value


def _spliced(captured: CapturedStep, prefix: list[fx.Node], inputs: GraphInputs, loss: fx.Node,
             gradients: Sequence[fx.Node], traced_update: fx.GraphModule, state_inputs: list[StateSlot],
             states: list[torch.Tensor], state_outputs: list[StateSlot],
             extra_state: dict[int, dict[str, Any]]) -> CapturedStep:
    """The capture's forward and backward (``prefix``) followed by ``traced_update``'s nodes, with the state inputs
    ``state_inputs`` in place of the capture's: its graph, layout and ``CapturedStep``."""
    gm = captured.graph_module
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attributes: dict[str, Any] = {}
    for node in (*inputs.params, *inputs.buffers):
        env[node] = graph.node_copy(node, lambda n: env[n])
    new_states = []
    for (index, key), example in zip(state_inputs, states):
        placeholder = graph.placeholder(f"state_{index}_{key}")
        placeholder.meta.update(val=example, tensor_meta=_extract_tensor_metadata(example))
        new_states.append(placeholder)
    for node in (*inputs.user, *inputs.hyper, *inputs.scaler, *inputs.carries):
        env[node] = graph.node_copy(node, lambda n: env[n])
    for node in prefix:
        if node.op == "placeholder":
            continue
        if node.op == "get_attr":
            attributes[node.target] = getattr(gm, node.target)
        env[node] = graph.node_copy(node, lambda n: env[n])
    update_nodes = list(traced_update.graph.nodes)
    update_inputs = [n for n in update_nodes if n.op == "placeholder"]
    sources = [env[n] for n in (*inputs.params, *gradients)]
    update_hyper = update_inputs[len(sources) + len(new_states):]
    update_env = dict(zip(update_inputs, [*sources, *new_states, *(env[h] for h in inputs.hyper)]))
    first_compute = next(n for n in graph.nodes if n.op != "placeholder")
    for node in update_nodes[len(update_inputs):-1]:
        if node.target is _ITEM and node.args[0] in update_hyper:  # read first, as in a whole trace
            with graph.inserting_before(first_compute):
                update_env[node] = graph.node_copy(node, lambda n: update_env[n])
            continue
        update_env[node] = graph.node_copy(node, lambda n: update_env[n])
        if node.op == "get_attr":
            update_env[node].target = f"_update_{node.target}"
            attributes[update_env[node].target] = getattr(traced_update, node.target)
    new_state = [update_env[n] for n in update_nodes[-1].args[0]]

    def copied(node: fx.Node) -> fx.Node:  # the loss output is detached after the update: copy what it needs
        if node not in env:
            env[node] = graph.node_copy(node, copied)
        return env[node]

    graph.output((copied(loss), *new_state, *[env[g] for g in gradients]))
    for node in [env[n] for n in prefix if n.op == "call_function" and n.target is _ITEM and n.args[0] in inputs.hyper]:
        if not node.users:  # the capture's reads of the hyper-parameters: the update read them again
            graph.erase_node(node)
    graph_module = fx.GraphModule(attributes, graph, class_name=type(gm).__name__)
    graph_module.meta = {**gm.meta, CAPTURE_ID: next(_capture_ids)}
    graph_module.meta["deft_layout"] = dataclasses.replace(gm.meta["deft_layout"], state_inputs=list(state_inputs),
                                                           state_outputs=list(state_outputs))
    check_no_random_after_forward(graph_module)
    return dataclasses.replace(captured, graph_module=graph_module, state_inputs=list(state_inputs),
                               state_outputs=list(state_outputs), extra_state=extra_state)


def _examples(model_state: ModelState, optimizer: torch.optim.Optimizer, state_inputs: list[StateSlot],
              user_tensors: list[torch.Tensor], hyper_values: list[torch.Tensor], scale_loss: bool,
              dynamic_dims: frozenset[tuple[int, int]]) -> tuple[list[Any], SymbolicShapes | None]:
    """The trace's example inputs in graph-input order, as fake tensors of a shape environment with
    ``dynamic_dims`` symbolic when there are any (and that environment), else the live tensors (and None)."""
    example = [p.detach().requires_grad_(p.requires_grad) for p in model_state.params]
    example += [b.detach() for b in model_state.buffers]
    example += [optimizer.state[model_state.params[i]][key] for i, key in state_inputs]
    user_start = len(example)
    example += list(user_tensors)
    example += hyper_values
    if scale_loss:  # values do not matter: fake tracing; the runtime passes the live scale and tracker
        example += [torch.ones((), dtype=torch.float32), torch.zeros((), dtype=torch.int32)]
    if not dynamic_dims:
        return example, None
    symbolic = SymbolicShapes.for_inputs(example, range(user_start, user_start + len(user_tensors)), dynamic_dims)
    return symbolic.fake_inputs, symbolic


def _check_param_groups(optimizer: torch.optim.Optimizer, index_of: dict) -> None:
    for group_index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p not in index_of:
                raise TraceError(
                    f"optimizer param group {group_index} holds a tensor of shape {tuple(p.shape)} that is "
                    f"not a parameter of the model; deft_compile updates the model's own parameters"
                )


def _forward_loss(model: nn.Module, tensors: dict, loss_fn: Callable[..., torch.Tensor] | None, call_args: tuple,
                  call_kwargs: dict) -> Any:
    """The forward on ``tensors`` and its loss: ``model``'s own (no ``loss_fn``) or ``loss_fn(output, targets)``."""
    if loss_fn is None:
        output = functional_call(model, tensors, call_args, call_kwargs)
        return loss_of(output)
    if len(call_args) != 2:
        raise TraceError(
            "with loss_fn given, call the step as step(inputs, targets); "
            f"got {len(call_args)} positional arguments"
        )
    output = functional_call(model, tensors, (call_args[0],), call_kwargs)
    return loss_of(loss_fn(output, call_args[1]))


def _mark_gradients(params: list[torch.Tensor], scale: torch.Tensor | None, accumulation_steps: int) -> None:
    """Wrap each gradient in ``deft.gradient(grad, index)``, unscaled first under loss scaling."""
    inv_scale = None
    if scale is not None:
        inv_scale = scale.double().reciprocal().float()
        if accumulation_steps > 1:
            inv_scale = inv_scale * accumulation_steps
    for index, p in enumerate(params):
        if p.grad is not None:
            p.grad = ops.gradient(p.grad * inv_scale if inv_scale is not None else p.grad, index)


def _traced_update(optimizer: torch.optim.Optimizer, model_state: ModelState, index_of: dict,
                   params: list[torch.Tensor], state_inputs: list[StateSlot], states: Sequence[torch.Tensor],
                   hyperparameters: list[dict[str, Any]], state_outputs: list[StateSlot],
                   extra_state: dict[int, dict[str, Any]]) -> list[torch.Tensor]:
    """``optimizer.step()`` on the traced ``params`` (their gradients set) from the state ``states`` holds: the state
    tensors it created (``_new_state``, recorded in ``state_outputs``; non-tensor state in ``extra_state``)."""
    initial = _initial_state(optimizer, model_state, state_inputs, states)
    with traceable_optimizer(optimizer, params, index_of, initial, hyperparameters) as traced:
        optimizer.step()
        return _new_state(traced, params, {id(t) for t in states}, state_outputs, extra_state)


def _new_state(traced: dict, params: list[torch.Tensor], state_input_ids: set[int], state_outputs: list[StateSlot],
               extra_state: dict[int, dict[str, Any]]) -> list[torch.Tensor]:
    """The optimizer-state tensors the traced update created (recorded in ``state_outputs``); its non-tensor state
    goes to ``extra_state``."""
    new_state = []
    for index, p in enumerate(params):
        for key, value in traced.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                if id(value) not in state_input_ids:
                    state_outputs.append((index, key))
                    new_state.append(value)
            else:
                extra_state.setdefault(index, {})[key] = value
    return new_state


def _trace(step: Callable[..., tuple], example: list[torch.Tensor], tracker: "_ModuleTracker", *,
           symbolic: bool = False) -> fx.GraphModule:
    """``make_fx`` of ``step`` with fake tensors (``symbolic``: the examples are fake tensors of a shape environment,
    some of their sizes symbols); a failure names the op and module (``TraceError``)."""
    try:
        with _compile_session(), tracker.hooks(), no_autocast():
            return make_fx(step, tracing_mode="symbolic" if symbolic else "fake", _allow_non_fake_inputs=True)(*example)
    except (TraceError, LossError):
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the op and module named
        raise TraceError(tracker.describe_failure(exc)) from exc


AutocastSettings = tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) of every enabled autocast
_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


def ambient_autocast() -> AutocastSettings:
    """The caller's enabled ``torch.autocast`` regions, per device type: part of the graph cache key."""
    return tuple(
        (device_type, torch.get_autocast_dtype(device_type))
        for device_type in _AUTOCAST_DEVICE_TYPES
        if torch.is_autocast_enabled(device_type)
    )


@contextlib.contextmanager
def no_autocast() -> Iterator[None]:
    """Autocast off for every device type: backward and the optimizer run outside it, as in eager loops."""
    with contextlib.ExitStack() as stack:
        for device_type in _AUTOCAST_DEVICE_TYPES:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


@contextlib.contextmanager
def forward_autocast(settings: AutocastSettings) -> Iterator[None]:
    """Re-enter the caller's autocast regions (``settings``) for the forward pass and the loss."""
    with contextlib.ExitStack() as stack:
        for device_type, dtype in settings:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        yield


def _check_scalar_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor):
        raise LossError(f"the step must produce a scalar loss tensor; got {type(loss).__name__}")
    if loss.numel() != 1 or loss.dim() != 0:
        raise LossError(
            f"the loss must be a scalar (0-dim) tensor; got shape {tuple(loss.shape)}. "
            f"Reduce it (e.g. .mean()) in the model or loss_fn"
        )
    if not loss.requires_grad:
        raise LossError("the loss does not require grad: no trainable parameter contributes to it")


def _non_tensor_state(optimizer: torch.optim.Optimizer, model_state: ModelState) -> dict[int, dict[str, Any]]:
    """Optimizer state that is not a tensor (kept as-is; the graph cannot change it)."""
    found: dict[int, dict[str, Any]] = {}
    for index, p in enumerate(model_state.params):
        for key, value in optimizer.state.get(p, {}).items():
            if not isinstance(value, torch.Tensor):
                found.setdefault(index, {})[key] = value
    return found


@contextlib.contextmanager
def _compile_session() -> Iterator[None]:
    """Tell torch code (e.g. optimizers) it is being traced, as torch.export does.

    Under it ``torch.compiler.is_compiling()`` is true, which lets ``capturable``
    optimizers run on CPU tensors and keeps step counters as tensors.
    """
    session = getattr(torch.compiler, "_compile_session_context", None)
    if session is not None:
        with session():
            yield
        return
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


class _ModuleTracker:
    """Remembers which module and phase were running, to name them when tracing fails."""

    def __init__(self, model: nn.Module) -> None:
        self._names = {m: (n or type(model).__name__) for n, m in model.named_modules()}
        self._stack: list[nn.Module] = []
        self._phase = "setup"

    @contextlib.contextmanager
    def active(self, phase: str) -> Iterator[None]:
        self._phase = phase
        yield

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        def pre(module: nn.Module, _args: Any) -> None:
            if module in self._names:
                self._stack.append(module)

        def post(module: nn.Module, _args: Any, _out: Any) -> None:
            if self._stack and self._stack[-1] is module:
                self._stack.pop()

        handles = [
            nn.modules.module.register_module_forward_pre_hook(pre),
            nn.modules.module.register_module_forward_hook(post),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def describe_failure(self, exc: Exception) -> str:
        op = getattr(exc, "func", None)
        where = "the model"
        if self._stack:
            module = self._stack[-1]
            where = f"module '{self._names[module]}' ({type(module).__name__})"
        kind = type(exc).__name__
        if op is not None:
            what = f"op {op}"
        elif "DataDependent" in kind:
            what = "a branch on a tensor's value (bool(), if or while on a tensor)"
        else:
            what = kind
        hint = ""
        if "DataDependent" in kind or (op is not None and "_local_scalar_dense" in str(op)):
            hint = " (data-dependent control flow cannot be captured in one static graph; use torch.where or torch.cond)"
        source = _user_source_line(exc)
        at = f" at {source}" if source else ""
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else kind
        return f"cannot capture the training step: {what} in {where} during {self._phase}{at}{hint}: {first_line}"


def _user_source_line(exc: BaseException) -> str | None:
    """``file:line: code`` of the innermost traceback frame outside torch and deft_compile."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)) + os.sep + "deft_compile")
    found = None
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not filename.startswith(skip) and "/contextlib.py" not in filename and not filename.startswith("<"):
            found = (filename, tb.tb_lineno)
        tb = tb.tb_next
    if found is None:
        return None
    code = linecache.getline(found[0], found[1]).strip()
    return f"{os.path.basename(found[0])}:{found[1]}: {code}"
