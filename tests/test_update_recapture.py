"""A capture made for new optimizer state by tracing only the update (``capture.recapture_with_state``) is the
capture a whole trace gives for that state: the same outputs and the same updated parameters, buffers and state,
bit for bit, for the test models (BatchNorm, Dropout, tied and frozen parameters, several groups) and the
optimizers the step captures; in a step, a delayed plan's second and third calls build their graphs from the
first capture without tracing the forward and backward again."""

from __future__ import annotations

import copy

import pytest
import torch

from deft_compile.step.capture import capture_step, recapture_with_state, split_user_inputs
from deft_compile.step.optim_support import hyperparameter_inputs, initialize_state
from models import CASES

OPTIMIZERS = {
    "own": None,
    "adamw-amsgrad": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True),
    "rmsprop-centered": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2, momentum=0.9, centered=True),
}


def _run(captured, model, optimizer, batch):
    """Run ``captured``'s graph as aten on copies of the live tensors: (outputs, the inputs after the run)."""
    params, layout = captured.model_state.params, captured.graph_module.meta["deft_layout"]
    inputs = [*[p.detach().clone() for p in params], *[b.clone() for b in captured.model_state.buffers],
              *[optimizer.state[params[i]][key].clone() for i, key in captured.state_inputs],
              *split_user_inputs(batch, {})[0], *hyperparameter_inputs(optimizer, layout.hyper_inputs)]
    if layout.num_scaler_inputs:  # a loss scale of 2^10 and its growth tracker
        inputs += [torch.tensor(1024.0), torch.tensor(0, dtype=torch.int32)]
    torch.manual_seed(7)  # Dropout draws the same numbers in both graphs
    return captured.graph_module(*inputs), inputs


#: capture_step's options: plain, loss scaling with accumulation, the batch dimension symbolic
OPTIONS = {"plain": {}, "scaled": {"scale_loss": True, "accumulation_steps": 2},
           "symbolic": {"dynamic_dims": frozenset({(0, 0), (1, 0)})}}


#: (model, optimizer, capture options): every model with its own optimizer, loss scaling and symbolic captures on
#: the SGD and the AdamW models, the other optimizers on the BatchNorm model
COMBINATIONS = ([(case, "own", "plain") for case in sorted(CASES)]
                + [(case, "own", options) for case in ("mlp_dropout_sgd", "transformer_tied_adamw_groups")
                   for options in ("scaled", "symbolic")]
                + [("cnn_batchnorm_adam", kind, "plain") for kind in ("adamw-amsgrad", "rmsprop-centered")])


@pytest.mark.parametrize("case,kind,options", COMBINATIONS)
def test_the_update_traced_alone_equals_the_whole_step_traced(case, kind, options):
    make_model, make_optimizer, make_batch, loss_fn, _, _ = CASES[case]
    torch.manual_seed(0)
    model = make_model()
    optimizer = (OPTIMIZERS[kind] or make_optimizer)(model)
    batch = make_batch(torch.Generator().manual_seed(0))
    first = capture_step(model, optimizer, loss_fn, batch, {}, [], **OPTIONS[options])
    params = first.model_state.params
    # the state of all but the first trained parameter, as a delayed bucket leaves it: some state appeared
    trained = [params[i] for i in first.gradient_outputs]
    if not initialize_state(optimizer, trained[1:]):
        pytest.skip(f"{type(optimizer).__name__} with these settings keeps its lazy state")  # never on these
    slots = [(i, key) for i, p in enumerate(params) for key, value in optimizer.state.get(p, {}).items()
             if isinstance(value, torch.Tensor)]
    whole = capture_step(model, optimizer, loss_fn, batch, {}, slots, **OPTIONS[options])
    alone = recapture_with_state(first, optimizer, slots)
    assert alone is not None and (alone.symbolic is None) == (options != "symbolic")
    ops = [(n.op, n.target) for n in alone.graph_module.graph.nodes if n.op not in ("placeholder", "get_attr")]
    if options != "symbolic":  # the same ops in the same order (a symbolic capture reorders its scalar reads)
        assert ops == [(n.op, n.target) for n in whole.graph_module.graph.nodes
                       if n.op not in ("placeholder", "get_attr")]
    assert (alone.state_inputs, alone.state_outputs, alone.gradient_outputs) == (
        whole.state_inputs, whole.state_outputs, whole.gradient_outputs)
    assert alone.graph_module.meta["deft_layout"] == whole.graph_module.meta["deft_layout"]
    (out_whole, in_whole), (out_alone, in_alone) = _run(whole, model, optimizer, batch), _run(alone, model,
                                                                                           optimizer, batch)
    assert len(out_whole) == len(out_alone) and all(torch.equal(a, b) for a, b in zip(out_whole, out_alone))
    assert all(torch.equal(a, b) for a, b in zip(in_whole, in_alone)), "updated parameters, buffers, state"
    assert first.graph_module is not alone.graph_module and len(first.state_inputs) == 0  # the first is kept


def test_a_delayed_plan_traces_its_forward_and_backward_once():
    """The seeded MLP under momentum SGD with a plan that delays all but one bucket (one process: the runtime's own
    path): state appears after the first call, and every capture for it comes from the first by tracing the
    update alone; the parameters equal those of the same run with whole traces."""
    from deft_compile import DeftConfig, deft_compile
    from deft_compile.step import graph_cache
    from workers import delaying_profile

    make_model, make_optimizer, make_batch, loss_fn, _, _ = CASES["mlp_dropout_sgd"]
    generator = torch.Generator().manual_seed(3)
    batches = [make_batch(generator) for _ in range(4)]
    results = []
    for split in (True, False):
        torch.manual_seed(0)
        model = make_model()
        optimizer = make_optimizer(model)
        scratch = copy.deepcopy(model)
        profile = delaying_profile(scratch, make_optimizer(scratch), loss_fn, batches[0], 1)
        step = deft_compile(model, optimizer, loss_fn, policy="deft", profile=profile,
                            config=DeftConfig(first_bucket_mb=1e-6, bucket_cap_mb=1e-6))
        original = graph_cache.recapture_with_state
        if not split:
            graph_cache.recapture_with_state = lambda *args: None
        try:
            for x, y in batches:
                torch.manual_seed(11)
                step(x, y)
            step.flush()
        finally:
            graph_cache.recapture_with_state = original
        cache = step.runner.cache
        results.append(([p.detach().clone() for p in model.parameters()], cache.capture_count,
                        cache.update_recaptures))
    (split_params, split_traces, recaptures), (whole_params, whole_traces, none) = results
    # whole traces: one per state the calls met; split: one, and the update alone for each later state
    assert none == 0 and split_traces == 1 and recaptures == whole_traces - 1 >= 1, (results[0][1:], whole_traces)
    assert all(torch.equal(a, b) for a, b in zip(split_params, whole_params))


def test_an_update_that_cannot_be_traced_alone_traces_the_whole_step(monkeypatch, caplog):
    """A failure of the update's trace is logged and the whole step is traced, counted as a capture."""
    import logging

    import torch.nn.functional as F

    from deft_compile import DeftConfig, deft_compile
    from deft_compile.step import graph_cache

    def fails(*args):
        raise RuntimeError("no split here")

    monkeypatch.setattr(graph_cache, "recapture_with_state", fails)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = deft_compile(model, optimizer, F.cross_entropy, policy="bytescheduler", config=DeftConfig(compiler="aten"))
    with caplog.at_level(logging.INFO, logger="deft_compile"):
        for _ in range(2):
            step(torch.randn(6, 8), torch.randint(0, 4, (6,)))
    overheads = step.overheads
    assert overheads["captures"] == 2 and overheads["update_recaptures"] == 0, overheads
    assert "the update alone could not be traced (RuntimeError: no split here)" in caplog.text
    cache = step.runner.cache
    assert overheads["capture_seconds"] > 0 and cache.last_trace_seconds > 0
