"""``transformers`` models under Inductor: every region compiles, and the numbers are the aten route's.

GPT-2, BERT and Llama from tiny configs (``hf_models.build_hf_model``: random weights, nothing downloaded) train a
few SGD steps in one process: each with its eager and its SDPA attention on the default regional route
(``compiler="inductor"``), and each with SDPA, ``transformers``' default, on the whole-graph route
(``"inductor-graph"``). No region and no graph may fall
back to aten (``step.lowering.history``, ``lowering.lowered_counts``), and the losses and parameters must track
the aten route's to float32 round-off (Dropout draws the same numbers on every route). Two graph-level checks
pin the rules that make this hold (passes/README.md, "Before Inductor"): a ``cat`` with one non-empty input
keeps ATen's layout (``pin_cat_layouts``), and a Bernoulli mask is drawn before its readers run
(``draw_bernoulli_out_of_place``).

The nine trained routes are marked slow: each compiles a step with Inductor (minutes in all on a 2-core host
with a cold Inductor cache). The two graph-level checks take about a second.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import transformers  # noqa: F401  (a dev dependency: a missing install fails here, loudly)

from deft_compile import DeftConfig, deft_compile
from deft_compile.passes.cat_layout import pin_cat_layouts
from deft_compile.passes.random_fills import BERNOULLI_LIKE, draw_bernoulli_out_of_place
from deft_compile.step import lowering
from hf_models import build_hf_model

aten = torch.ops.aten
STEPS = 3  # the whole-graph route runs a graph as aten on its first call and lowered from its second
ROUND_OFF = 1e-5


def _train(model: torch.nn.Module, batches: list[dict], compiler: str):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = deft_compile(model, optimizer, policy="wfbp", config=DeftConfig(compiler=compiler))
    torch.manual_seed(1)  # the same Dropout draws on every route
    losses = [float(step(**batch)) for batch in batches]
    return step, losses


#: (family, attention, compiler): each family and attention on the regional default, and each family's default
#: attention (SDPA) through the whole-graph lowering
ROUTES = ([(f, a, "inductor") for f in ("gpt2", "bert", "llama") for a in ("eager", "sdpa")]
          + [(f, "sdpa", "inductor-graph") for f in ("gpt2", "bert", "llama")])


@pytest.fixture(scope="module")
def reference(request):
    """The model, its batches and the aten route's losses and parameters."""
    family, attention = request.param
    torch.manual_seed(0)
    model, make_batch = build_hf_model(family)
    model.set_attn_implementation(attention)
    generator = torch.Generator().manual_seed(0)
    batches = [make_batch(generator) for _ in range(STEPS)]
    trained = copy.deepcopy(model)
    _, losses = _train(trained, batches, "aten")
    return model, batches, losses, trained


@pytest.mark.slow
@pytest.mark.parametrize(("reference", "compiler"), [((f, a), c) for f, a, c in ROUTES], indirect=["reference"],
                         ids=[f"{f}-{a}-{c}" for f, a, c in ROUTES])
def test_every_region_compiles_and_tracks_the_aten_route(reference, compiler):
    start, batches, aten_losses, aten_trained = reference
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
    for t, (a, b) in enumerate(zip(losses, aten_losses)):
        assert abs(a - b) <= ROUND_OFF * max(1.0, abs(b)), f"step {t}: loss {a} against aten's {b}"
    # the parameters: their difference against what the steps changed, over the whole model (a tensor alone can
    # mislead: an attention key bias has a mathematically zero gradient, so its update is round-off on any route)
    difference = _squared_distance(model, aten_trained)
    update = _squared_distance(aten_trained, start)
    assert (difference / update) ** 0.5 <= ROUND_OFF


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
    assert torch.allclose(run(qkv, cache)[0], expected, rtol=1e-6, atol=1e-6)


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
    assert torch.allclose(actual[1], expected[1], rtol=1e-6, atol=1e-6)

