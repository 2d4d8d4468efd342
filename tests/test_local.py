"""World size 1 (no process group): the compiled step equals plain eager training."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from deft_compile import deft_compile
from models import CASES, DropoutMLP
from workers import compare_with_eager


def _assert_matches(report, exact):
    for t, step in enumerate(report):
        assert step["same_keys"], f"step {t}: parameters/buffers/state differ in keys"
        if exact:
            assert step["max_abs"] == 0.0 and step["loss_diff"] == 0.0, f"step {t}: {step}"
        else:
            assert step["max_rel"] <= 1e-6, f"step {t}: {step}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_eager(case):
    _assert_matches(compare_with_eager(case, 6), CASES[case][5])


@pytest.mark.parametrize(
    "name, make_optimizer, exact",
    [
        ("sgd_foreach", lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, foreach=True), True),
        ("sgd_dampening", lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, dampening=0.3), True),
        ("adam_foreach_amsgrad", lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, foreach=True, amsgrad=True), False),
        ("adamw_no_foreach", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False), False),
        ("rmsprop", lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.5), False),
        ("adagrad", lambda m: torch.optim.Adagrad(m.parameters(), lr=1e-2), False),
    ],
)
def test_optimizer_variants_match_eager(name, make_optimizer, exact):
    _assert_matches(compare_with_eager("mlp_dropout_sgd", 5, optimizer_override=make_optimizer), exact)


def test_changed_input_shape_retraces_and_stays_exact():
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)) for n in (8, 8, 5, 5, 8)]
    report = compare_with_eager("mlp_dropout_sgd", 5, batches=batches)
    _assert_matches(report, exact=True)
    # step 0: the steady graph (the state is created before the first capture); step 2: new shape; step 4: cached
    assert [r["traces"] for r in report] == [1, 1, 2, 2, 2]


def _twin_mlps() -> tuple[DropoutMLP, DropoutMLP]:
    """Two ``DropoutMLP`` of the same weights (seed 0), in eval mode: one for eager training, one to compile."""
    torch.manual_seed(0)
    eager, compiled = DropoutMLP(), DropoutMLP()
    compiled.load_state_dict(eager.state_dict())
    eager.eval(), compiled.eval()
    return eager, compiled


@pytest.mark.parametrize(
    "make_optimizer, exact, lr_is_input",
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01), True, True),
        (lambda ps: torch.optim.Adam(ps, lr=1e-2), False, True),
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), False, True),
        (lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5), False, True),
        (lambda ps: torch.optim.Adagrad(ps, lr=1e-2), False, False),
    ],
    ids=["sgd", "adam", "adamw", "rmsprop", "adagrad"],
)
def test_a_per_step_lr_schedule_matches_eager_without_retracing(make_optimizer, exact, lr_is_input):
    """Two param groups with different learning rates, a scheduler stepping every step: the same numbers as
    eager, and (the lr being a graph input) one graph for the whole run; Adagrad's lr is a graph constant,
    so it retraces on each new value."""
    eager, compiled = _twin_mlps()

    def groups(model):
        params = list(model.parameters())
        return [{"params": params[:2]}, {"params": params[2:], "lr_scale": 0.5}]

    opt_e, opt_c = make_optimizer(groups(eager)), make_optimizer(groups(compiled))
    for opt in (opt_e, opt_c):
        opt.param_groups[1]["lr"] *= 0.5
    lambdas = [lambda t: 1.0 / (1 + t), lambda t: 0.9**t]
    sched_e = torch.optim.lr_scheduler.LambdaLR(opt_e, lambdas)
    sched_c = torch.optim.lr_scheduler.LambdaLR(opt_c, lambdas)
    step = deft_compile(compiled, opt_c, F.cross_entropy)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    traces = []
    for _ in range(6):
        opt_e.zero_grad()
        F.cross_entropy(eager(x), y).backward()
        opt_e.step()
        sched_e.step()
        step(x, y)
        sched_c.step()
        traces.append(step.trace_count)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # after step 2 the optimizer state exists and the graph is final; only a baked-in lr retraces
    new_traces = traces[-1] - traces[1]
    assert new_traces == (0 if lr_is_input else 4), traces


@pytest.mark.parametrize(
    "make_optimizer, slots",
    [
        (lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.01),
         [(0, "lr"), (0, "momentum"), (0, "weight_decay"), (1, "lr"), (1, "momentum")]),
        (lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
         [(0, "lr"), (0, "weight_decay"), (1, "lr"), (1, "weight_decay")]),
        (lambda groups: torch.optim.Adam(groups, lr=1e-2, weight_decay=0.1),
         [(0, "lr"), (0, "weight_decay"), (1, "lr")]),
        (lambda groups: torch.optim.RMSprop(groups, lr=1e-3, momentum=0.5),
         [(0, "lr"), (0, "alpha"), (0, "eps"), (0, "momentum"), (1, "lr"), (1, "alpha"), (1, "eps"), (1, "momentum")]),
        (lambda groups: torch.optim.Adagrad(groups, lr=1e-2), []),
    ],
    ids=["sgd", "adamw", "adam", "rmsprop", "adagrad"],
)
def test_hyperparameters_are_graph_inputs_where_their_value_decides_no_branch(make_optimizer, slots):
    """The second group has no weight decay. A weight decay, momentum or dampening of 0 decides a branch of the
    update (no decay term): a constant, except AdamW's decoupled decay, whose branch at 0 multiplies by exactly 1.
    The graph takes the others as 0-dim float64 inputs, in group order, with the groups' values."""
    from deft_compile.step.optim_support import hyperparameter_inputs, hyperparameter_slots

    model = DropoutMLP()
    params = list(model.parameters())
    optimizer = make_optimizer([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}])
    assert hyperparameter_slots(optimizer) == slots
    values = hyperparameter_inputs(optimizer)
    assert all(v.dtype == torch.float64 and v.dim() == 0 for v in values)
    assert [v.item() for v in values] == [float(optimizer.param_groups[g][name]) for g, name in slots]
    step = deft_compile(model, optimizer, F.cross_entropy)
    step(torch.randn(8, 16), torch.randint(0, 4, (8,)))
    assert step.runner.last_graph.layout.hyper_inputs == slots


def test_groups_that_differ_in_input_hyperparameters_train_as_eager_and_a_change_of_them_applies():
    """SGD in two groups that differ in momentum and weight decay: bit-identical to eager on the aten route; the
    first group's weight decay then changes, and the next step applies it (another capture: the values are part of
    the capture key, so a compensated plan's constants follow them too)."""
    eager, compiled = _twin_mlps()

    def make(model):
        params = list(model.parameters())
        return torch.optim.SGD([{"params": params[:2], "momentum": 0.9, "weight_decay": 0.01},
                                {"params": params[2:], "momentum": 0.5, "weight_decay": 0.001}], lr=0.1)

    opt_e, opt_c = make(eager), make(compiled)
    step = deft_compile(compiled, opt_c, F.cross_entropy)
    g = torch.Generator().manual_seed(1)
    for index in range(5):
        if index == 3:
            for opt in (opt_e, opt_c):
                opt.param_groups[0]["weight_decay"] = 0.05
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt_e.zero_grad()
        F.cross_entropy(eager(x), y).backward()
        opt_e.step()
        step(x, y)
        for a, b in zip(eager.parameters(), compiled.parameters()):
            assert torch.equal(a, b), index


def test_train_and_eval_modes_get_their_own_graphs():
    torch.manual_seed(0)
    model = DropoutMLP()
    step = deft_compile(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    step(x, y)
    model.eval()
    step(x, y)
    dropout_ops = [n for n in step.graph.graph_module.graph.nodes if "bernoulli" in str(n.target)]
    assert dropout_ops == [], "eval mode must trace without Dropout"
    assert step.trace_count == 2


def test_model_that_returns_its_own_loss_with_kwargs():
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 1)

        def forward(self, x, *, target, scale=1.0):
            return scale * ((self.linear(x) - target) ** 2).mean()

    torch.manual_seed(0)
    model = WithLoss()
    reference = WithLoss()
    reference.load_state_dict(model.state_dict())
    step = deft_compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, target = torch.randn(4, 3), torch.randn(4, 1)
    for _ in range(3):
        loss = step(x, target=target, scale=2.0)
        opt.zero_grad()
        expected = reference(x, target=target, scale=2.0)
        expected.backward()
        opt.step()
        assert torch.equal(loss, expected.detach())
        assert not loss.requires_grad
    assert torch.equal(model.linear.weight, reference.linear.weight)


def test_state_dicts_stay_usable_by_eager_training():
    torch.manual_seed(0)
    model = DropoutMLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = deft_compile(model, optimizer, F.cross_entropy)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for _ in range(3):
        step(x, y)
    state = optimizer.state_dict()
    assert len(state["state"]) == len(list(model.parameters()))
    assert all(float(s["step"]) == 3.0 for s in state["state"].values())
    fresh = DropoutMLP()
    fresh.load_state_dict(model.state_dict())
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    fresh_optimizer.load_state_dict(state)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_deft_dump_environment_variable_writes_every_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("DEFT_DUMP", str(tmp_path))
    model = DropoutMLP()
    step = deft_compile(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy)
    step(torch.randn(8, 16), torch.randint(0, 4, (8,)))
    files = sorted(p.name for p in (tmp_path / "graph_00").iterdir())
    assert files[0] == "00_captured.py" and "passes.json" in files
    assert any(name.endswith("strip_markers.py") for name in files)
    last = sorted(f for f in files if f.endswith(".py"))[-1]
    assert "torch.ops.deft.gradient" not in (tmp_path / "graph_00" / last).read_text()
    assert "torch.ops.deft.gradient" in (tmp_path / "graph_00" / "00_captured.py").read_text()


def test_a_step_state_of_the_earlier_format_carries_its_learning_rates_as_hyperparameter_inputs():
    """A step state saved while updates were moved into the next call carries each group's learning rate as
    ``lr:<group>``; loaded now, each becomes its slot's ``hp:<index>`` carry, and the other inputs (constants of the
    earlier graphs) carry the groups' present values."""
    from deft_compile.step.runner import carried_hyperparameters

    model = DropoutMLP()
    params = list(model.parameters())
    optimizer = torch.optim.SGD([{"params": params[:2], "weight_decay": 0.01}, {"params": params[2:], "lr": 0.05}],
                                lr=0.1, momentum=0.9)
    pending = torch.randn(4)
    earlier = {"pending:3": pending, "lr:0": torch.tensor(0.2, dtype=torch.float64),
               "lr:1": torch.tensor(0.07, dtype=torch.float64)}
    carry = carried_hyperparameters(earlier, optimizer)
    assert carry["pending:3"] is pending
    assert {k: v.item() for k, v in carry.items() if k.startswith("hp:")} == {
        "hp:0": 0.2, "hp:1": 0.9, "hp:2": 0.01, "hp:3": 0.07, "hp:4": 0.9}
    assert not any(key.startswith("lr:") for key in carry)
    assert carried_hyperparameters({"pending:3": pending}, optimizer) == {"pending:3": pending}
