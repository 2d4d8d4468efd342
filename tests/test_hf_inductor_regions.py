"""``transformers`` models under Inductor: every region compiles, and the numbers are the aten route's.

GPT-2, BERT and Llama from tiny configs (``hf_models.build_hf_model``: random weights, nothing downloaded) train a
few SGD steps in one process: each with its eager and its SDPA attention on the default regional route
(``compiler="inductor"``), and each with SDPA, ``transformers``' default, on the whole-graph route
(``"inductor-graph"``). No region and no graph may fall
back to aten (``step.lowering.history``, ``lowering.lowered_counts``), and the losses and parameters must track
the aten route's (Dropout draws the same numbers on every route) within ``DRIFT_MULTIPLE`` times the yardstick:
the same steps with the model compiled by ``torch.compile`` against eager, measured once per family and attention
in the module's reference fixture (tests/bounds.py). Two graph-level checks pin the rules that make this hold
(passes/README.md, "Before Inductor"): a ``cat`` with one non-empty input keeps ATen's layout
(``pin_cat_layouts``), and a Bernoulli mask is drawn before its readers run (``draw_bernoulli_out_of_place``); each
compares one compiled kernel's output with ATen's within a written round-off bound.

The nine trained routes are marked slow: each compiles a step with Inductor, and each family and attention a
yardstick with ``torch.compile`` (minutes in all on a 2-core host with a cold Inductor cache). The two graph-level
checks take a few seconds.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import transformers  # noqa: F401  (a dev dependency: a missing install fails here, loudly)

from bounds import UNIT_ROUND_OFF, check_difference, check_scalars_within_drift, relative, summation_bound
from deft_compile import DeftConfig, deft_compile
from deft_compile.passes.cat_layout import pin_cat_layouts
from deft_compile.passes.random_fills import BERNOULLI_LIKE, draw_bernoulli_out_of_place
from deft_compile.step import lowering
from hf_models import build_hf_model

aten = torch.ops.aten
STEPS = 3  # the whole-graph route runs a graph as aten on its first call and lowered from its second
LEARNING_RATE = 0.1


def _train(model: torch.nn.Module, batches: list[dict], compiler: str):
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    step = deft_compile(model, optimizer, policy="wfbp", config=DeftConfig(compiler=compiler))
    torch.manual_seed(1)  # the same Dropout draws on every route
    losses = [float(step(**batch)) for batch in batches]
    return step, losses


def _train_eagerly(model: torch.nn.Module, batches: list[dict], forward=None) -> list[float]:
    """``_train``'s steps as a training loop runs them, the optimizer eager, the model called through ``forward``
    (default: itself): the yardstick's two sides."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    torch.manual_seed(1)
    losses = []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = (model if forward is None else forward)(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def _yardstick(start: torch.nn.Module, batches: list[dict]) -> dict:
    """torch.compile's own difference from eager on ``_train``'s model, batches and Dropout draws (Inductor drawing
    Dropout from ATen's generator, as deft's lowering does): per step the losses' relative difference, and the
    parameters' (``_update_distance``)."""
    import torch._inductor.config as inductor_config

    eager, compiled = copy.deepcopy(start), copy.deepcopy(start)
    eager_losses = _train_eagerly(eager, batches)
    torch._dynamo.reset()  # a fresh recompile budget: past it Dynamo runs the model eagerly
    with inductor_config.patch(fallback_random=True):
        compiled_losses = _train_eagerly(compiled, batches, torch.compile(compiled))
    torch._dynamo.reset()
    return {"losses": relative(compiled_losses, eager_losses), "params": _update_distance(compiled, eager, start)}


#: (family, attention, compiler): each family and attention on the regional default, and each family's default
#: attention (SDPA) through the whole-graph lowering
ROUTES = ([(f, a, "inductor") for f in ("gpt2", "bert", "llama") for a in ("eager", "sdpa")]
          + [(f, "sdpa", "inductor-graph") for f in ("gpt2", "bert", "llama")])


@pytest.fixture(scope="module")
def reference(request):
    """The model, its batches, the aten route's losses and parameters, and the yardstick (``_yardstick``)."""
    family, attention = request.param
    torch.manual_seed(0)
    model, make_batch = build_hf_model(family)
    model.set_attn_implementation(attention)
    generator = torch.Generator().manual_seed(0)
    batches = [make_batch(generator) for _ in range(STEPS)]
    trained = copy.deepcopy(model)
    _, losses = _train(trained, batches, "aten")
    return model, batches, losses, trained, _yardstick(model, batches)


@pytest.mark.slow
@pytest.mark.parametrize(("reference", "compiler"), [((f, a), c) for f, a, c in ROUTES], indirect=["reference"],
                         ids=[f"{f}-{a}-{c}" for f, a, c in ROUTES])
def test_every_region_compiles_and_tracks_the_aten_route(reference, compiler):
    start, batches, aten_losses, aten_trained, drift = reference
    model = copy.deepcopy(start)
    fallbacks_before = lowering.lowered_counts["aten"]
    step, losses = _train(model, batches, compiler)
    history = step.lowering.history
    assert history, "nothing was compiled"
    fallen = [(entry.get("region", entry["graph"]), entry["fallback_reason"]) for entry in history
              if entry["compiler"] != "inductor" or entry["fallback_reason"] is not None]
    assert not fallen, f"ran as aten: {fallen}"
    assert lowering.lowered_counts["aten"] == fallbacks_before
    assert step.compiler == "inductor"  # the last call ran compiled code (the whole graph: lowered on call 2)
    check_scalars_within_drift(relative(losses, aten_losses), drift["losses"], f"losses {losses} against {aten_losses}")
    check_difference(_update_distance(model, aten_trained, start), drift["params"], "parameters over the update")


def _update_distance(model: torch.nn.Module, reference: torch.nn.Module, start: torch.nn.Module) -> float:
    """``model``'s parameters' distance from ``reference``'s over ``reference``'s update from ``start``, over the whole
    model (a tensor alone can mislead: an attention key bias has a mathematically zero gradient, so its update is
    round-off on any route)."""
    return (_squared_distance(model, reference) / _squared_distance(reference, start)) ** 0.5


def _squared_distance(a: torch.nn.Module, b: torch.nn.Module) -> float:
    with torch.no_grad():
        return sum(float((p - q).double().pow(2).sum()) for p, q in zip(a.parameters(), b.parameters()))


def test_a_cat_of_one_nonempty_tensor_keeps_atens_layout_under_inductor():
    """A KV cache's first update, ``cat([tensor([]), key.transpose(1, 2)], -2)``, then the ``view`` matmul traced
    behind it. Inductor's ``cat`` decomposition alone (a ``clone`` keeping the transposed strides) cannot run that
    view ("Cannot view a tensor ..."); with the pass the graph compiles and computes what the aten graph computes,
    and on the aten path the pass's copy is the cat's."""

    def attention_scores(qkv: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor]:
        key = qkv.view(2, 8, 4, 16).transpose(1, 2)  # (batch, heads, seq, dim), strides of the (batch, seq) layout
        keys = torch.cat([cache, key], -2)  # ATen: contiguous
        return (torch.matmul(key, keys.transpose(-1, -2)),)

    qkv, cache = torch.randn(2, 8, 64), torch.tensor([])
    gm = make_fx(attention_scores)(qkv, cache)
    assert any(n.target is aten.cat.default for n in gm.graph.nodes)
    run, _, _ = lowering.compile_with_inductor(gm, [qkv, cache])
    (expected,) = gm(qkv, cache)
    pinned = pin_cat_layouts(copy.deepcopy(gm))
    assert not any(n.target is aten.cat.default for n in pinned.graph.nodes)
    assert torch.equal(pinned(qkv, cache)[0], expected)  # the same copy on the aten path
    # each score is a dot product of 16 float32 products, summed in whatever order the compiled kernel takes: within
    # summation_bound(16, sum of the products' magnitudes) of ATen's (tests/bounds.py)
    key = qkv.view(2, 8, 4, 16).transpose(1, 2).double()
    magnitude = key.abs() @ key.abs().transpose(-1, -2)
    assert ((run(qkv, cache)[0].double() - expected.double()).abs() <= summation_bound(16, magnitude)).all()


def test_a_dropout_mask_is_drawn_before_the_kernels_that_read_it():
    """LayerNorm then Dropout, the mask kept as an output (for the backward). Left as an in-place ``bernoulli_``,
    Inductor's C++ backend (torch 2.13) fuses the mask's readers into the LayerNorm kernel ahead of the draw and
    returns NaN; drawn out of place, the compiled mask and product are the aten graph's, from the same draws, and
    the rewritten graph run as aten draws the same numbers too."""

    def layer_norm_dropout(x, weight, bias):
        y, _, _ = aten.native_layer_norm.default(x, [32], weight, bias, 1e-12)
        mask = aten.div_.Scalar(aten.bernoulli_.float(aten.empty_like.default(y), 0.9), 0.9)
        return mask, aten.mul.Tensor(y, mask)

    inputs = [torch.randn(4, 16, 32), torch.randn(32), torch.randn(32)]
    gm = make_fx(layer_norm_dropout)(*inputs)
    torch.manual_seed(3)
    expected = gm(*inputs)
    drawn = draw_bernoulli_out_of_place(copy.deepcopy(gm))
    assert [n.target for n in drawn.graph.nodes].count(BERNOULLI_LIKE) == 1
    torch.manual_seed(3)
    assert all(torch.equal(a, b) for a, b in zip(drawn(*inputs), expected))  # the same draws, eagerly
    run, _, _ = lowering.compile_with_inductor(gm, inputs)
    torch.manual_seed(3)
    actual = run(*inputs)
    assert torch.equal(actual[0], expected[0])
    assert (actual[1].double() - expected[1].double()).abs().le(_layer_norm_bound(*inputs, expected[0])).all()


def _layer_norm_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """How far two float32 implementations of ``layer_norm(x) * mask`` over the last dimension (``n`` elements, eps
    1e-12, the same mask) may differ, per element, to first order in ``u`` (tests/bounds.py). The mean is a sum of
    ``n`` terms and a division: two implementations within ``e_mean = summation_bound(n + 1, sum|x|) / n``. The
    variance is a sum of the ``n`` squares ``d**2`` (``d = x - mean``; a shifted mean moves it only to second order,
    as ``sum d = 0``) and a division: within ``e_var = summation_bound(n + 1, sum d**2) / n``, whether summed in two
    passes or by Welford's update (on rows of condition number about 1, mean small against the spread, as these
    randn rows are: Chan, Golub and LeVeque 1983). So ``z = d / sqrt(var + eps)`` moves by at most
    ``r e_mean + |z| e_var / (2 (var + eps))`` (``r = 1 / sqrt(var + eps)``), and the rest is at most 10 roundings per
    implementation relative to the values they round (``d``, ``var + eps``, the square root, the division, ``z w``,
    ``+ b``, the mask's product), ``20 u (|z w| + |b|)`` between two; all times ``|mask|``."""
    n, u = x.shape[-1], UNIT_ROUND_OFF
    x, weight, bias, mask = (t.double() for t in (x, weight, bias, mask))
    mean = x.mean(-1, keepdim=True)
    d = x - mean
    var = d.pow(2).mean(-1, keepdim=True)
    r = (var + 1e-12).rsqrt()
    z = d * r
    e_mean = summation_bound(n + 1, x.abs().sum(-1, keepdim=True)) / n
    e_var = summation_bound(n + 1, d.pow(2).sum(-1, keepdim=True)) / n
    e_z = r * e_mean + z.abs() * e_var / (2 * (var + 1e-12))
    return mask.abs() * (weight.abs() * e_z + 20 * u * ((z * weight).abs() + bias.abs()))

