"""The same-batch staleness error (deft_compile.preserver.staleness): exact values, no side effects."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from deft_compile.preserver.staleness import same_batch_gradient_change


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.bn(self.fc(x))))


def _state(model: nn.Module):
    names = [n for n, _ in model.named_parameters()]
    return names, [p.detach().clone() for p in model.parameters()], dict(model.named_buffers())


def _reference_gradients(names, values, bn_stats, x, y):
    """Gradients of a fresh ``Net`` at ``values`` with the function's dropout seed (0x5EED), so masks match."""
    clone = Net().train()
    clone.load_state_dict({**dict(zip(names, values)), **{k: v.clone() for k, v in bn_stats.items()}})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0x5EED)
        F.cross_entropy(clone(x), y).backward()
        return [q.grad for q in clone.parameters()]


def test_matches_autograd_at_both_weights_and_leaves_training_untouched():
    torch.manual_seed(0)
    model = Net().train()
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    names, before, buffers = _state(model)
    after = [b + 0.1 * torch.randn_like(b) for b in before]
    bn_stats = {k: v.clone() for k, v in buffers.items()}
    rng = torch.get_rng_state()
    change = same_batch_gradient_change(model, names, before, after, buffers, F.cross_entropy, (x, y), {}, [0, 1, 4])
    assert torch.equal(torch.get_rng_state(), rng), "the training RNG stream is not consumed"
    assert all(torch.equal(buffers[k], bn_stats[k]) for k in buffers), "BatchNorm running stats untouched"
    assert all(p.grad is None for p in model.parameters())
    assert sorted(change) == [0, 1, 4]

    g_before, g_after = (_reference_gradients(names, v, bn_stats, x, y) for v in (before, after))
    for index in (0, 1, 4):
        diff, norm = change[index]
        assert abs(diff - float((g_after[index] - g_before[index]).double().square().sum())) < 1e-9
        assert abs(norm - float(g_before[index].double().square().sum())) < 1e-9
        assert diff > 0


def test_no_update_means_no_error_even_with_dropout():
    """Both passes draw the same dropout mask, so identical weights give exactly zero change."""
    torch.manual_seed(1)
    model = Net().train()
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    names, before, buffers = _state(model)
    change = same_batch_gradient_change(model, names, before, before, buffers, F.cross_entropy, (x, y), {}, [0, 2])
    assert all(diff == 0.0 and norm > 0 for diff, norm in change.values())


def test_update_metric_weights_gradients_as_the_optimizer_applies_them():
    """Adam-family steps move p by −lr·P·m with P = 1/(√v + eps): the trade's norms are √P-weighted, so a
    parameter whose tiny second moment makes its steps large weighs as much as its steps do. SGD: no metric."""
    from deft_compile.preserver.staleness import update_metric

    torch.manual_seed(2)
    model = Net().train()
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    assert update_metric(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)) == {}
    adam = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    assert update_metric(adam) == {}, "no second moment before the first step"
    F.cross_entropy(model(x), y).backward()
    adam.step()
    metric = update_metric(adam)
    params = list(model.parameters())
    assert set(metric) == set(params)
    for p in params:
        expected = 1.0 / (adam.state[p]["exp_avg_sq"].sqrt() + 1e-6)
        torch.testing.assert_close(metric[p].square(), expected)
    names, before, buffers = _state(model)
    after = [b + 0.1 * torch.randn_like(b) for b in before]
    by_index = {i: metric[p] for i, p in enumerate(params)}
    plain = same_batch_gradient_change(model, names, before, after, buffers, F.cross_entropy, (x, y), {}, [0, 4])
    weighted = same_batch_gradient_change(model, names, before, after, buffers, F.cross_entropy, (x, y), {}, [0, 4],
                                          by_index)
    bn_stats = {k: v.clone() for k, v in buffers.items()}

    g_before, g_after = (_reference_gradients(names, v, bn_stats, x, y) for v in (before, after))
    for index in (0, 4):
        w = by_index[index]
        diff, norm = weighted[index]
        assert abs(diff - float(((g_after[index] - g_before[index]) * w).double().square().sum())) < 1e-7 * max(1.0, diff)
        assert abs(norm - float((g_before[index] * w).double().square().sum())) < 1e-7 * max(1.0, norm)
        assert (diff, norm) != plain[index]
    # with a metric of ones the result is the plain one, exactly
    ones = {i: torch.ones_like(p) for i, p in enumerate(params)}
    assert same_batch_gradient_change(model, names, before, after, buffers, F.cross_entropy, (x, y), {}, [0, 4],
                                      ones) == plain


def test_compensated_staleness_is_measured_from_the_predicted_weights():
    """``predicted_weights`` gives w − lr·v for momentum SGD (w where there is no momentum yet) and w − lr·m̂/(√v̂+ε)
    for Adam; on a smooth least-squares problem deep in a momentum run, the gradient at the predicted weights is
    much closer to the gradient after the step than the gradient before it: compensated staleness prices lower."""
    from deft_compile.preserver.staleness import predicted_weights

    torch.manual_seed(0)
    model = nn.Linear(8, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    assert torch.equal(predicted_weights(optimizer, list(model.parameters()))[0], model.weight.detach())
    loss_fn = nn.functional.mse_loss
    for _ in range(20):
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    buffer = optimizer.state[model.weight]["momentum_buffer"]
    predicted = predicted_weights(optimizer, [model.weight])[0]
    assert torch.allclose(predicted, model.weight.detach() - 0.02 * buffer)
    before = model.weight.detach().clone()
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()
    optimizer.step()
    after = [model.weight.detach().clone()]
    names = ["weight"]
    plain = same_batch_gradient_change(model, names, [before], after, {}, loss_fn, (x, y), {}, [0])[0]
    compensated = same_batch_gradient_change(model, names, [predicted], after, {}, loss_fn, (x, y), {}, [0])[0]
    assert compensated[0] < 0.2 * plain[0], (compensated, plain)
    adam_model = nn.Linear(8, 1, bias=False)
    adam = torch.optim.Adam(adam_model.parameters(), lr=0.01)
    loss_fn(adam_model(x), y).backward()
    adam.step()
    state = adam.state[adam_model.weight]
    expected = adam_model.weight.detach() - 0.01 * (state["exp_avg"] / 0.1) / ((state["exp_avg_sq"] / 0.001).sqrt() + 1e-8)
    assert torch.allclose(predicted_weights(adam, [adam_model.weight])[0], expected)
