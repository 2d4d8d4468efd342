"""The loop features every trainer uses: clipping, accumulation, mixed precision with loss scaling, model outputs.

One-process tests compare with plain eager training; two-process tests (gloo) with torch DDP, or with the eager
reference of DeFT's delayed semantics (``workers.PlanReference``). The two-process runs go in one process pair, in
turn (``CASE_LIST``, tests/batched.py), and each test asserts its own run's results.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from batched import Case, launch_cases
from deft_compile import DeftConfig, deft_compile
from deft_compile.errors import LossError
from loop_workers import accumulation_with_ddp, clip_with_ddp, delayed_reference_run, loss_scaling_with_ddp
from workers import check_entry, compare_policy_with_ddp


def _mlp() -> nn.Module:
    torch.manual_seed(0)  # no bias before BatchNorm: its gradient is pure round-off (see models.BatchNormCNN)
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _worst(a: nn.Module, b: nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def _batches(n: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 8, generator=g) * scale, torch.randint(0, 4, (32,), generator=g)) for _ in range(n)]


# -- one process -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_clipping_equals_clip_grad_norm(optimizer: str) -> None:
    make = _sgd if optimizer == "sgd" else (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    eager, compiled = _mlp(), _mlp()
    eager_opt, compiled_opt = make(eager), make(compiled)
    step = deft_compile(compiled, compiled_opt, F.cross_entropy, config=DeftConfig(max_grad_norm=0.2))
    for x, y in _batches(5, scale=5.0):
        eager_opt.zero_grad()
        F.cross_entropy(eager(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.2)
        eager_opt.step()
        step(x, y)
        assert float(norm) > 0.2, "the test must actually clip"
        exact = optimizer == "sgd"  # Adam's capturable update is round-off away from eager (docs/API.md)
        assert step.last_grad_norm is not None
        assert float(step.last_grad_norm) == (float(norm) if exact else pytest.approx(float(norm), rel=1e-6))
        assert _worst(eager, compiled) <= (0.0 if exact else 1e-6)
        for p, q in zip(eager.parameters(), compiled.parameters()):
            assert torch.equal(p.grad, q.grad) or optimizer == "adamw"  # param.grad holds the clipped gradient


def test_clipping_infinity_norm() -> None:
    eager, compiled = _mlp(), _mlp()
    eager_opt, compiled_opt = _sgd(eager), _sgd(compiled)
    step = deft_compile(compiled, compiled_opt, F.cross_entropy, config=DeftConfig(max_grad_norm=0.05, norm_type=float("inf")))
    for x, y in _batches(3):
        eager_opt.zero_grad()
        F.cross_entropy(eager(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.05, norm_type=float("inf"))
        eager_opt.step()
        step(x, y)
        assert float(step.last_grad_norm) == float(norm) and _worst(eager, compiled) == 0.0


def test_accumulation_equals_eager_mean_over_micro_batches() -> None:
    eager, compiled = _mlp(), _mlp()
    eager_opt, compiled_opt = _sgd(eager), _sgd(compiled)
    step = deft_compile(compiled, compiled_opt, F.cross_entropy, config=DeftConfig(accumulation_steps=3))
    for t, (x, y) in enumerate(_batches(9)):
        before = [p.detach().clone() for p in compiled.parameters()]
        (F.cross_entropy(eager(x), y) / 3).backward()
        if t % 3 == 2:
            eager_opt.step()
            eager_opt.zero_grad()
        step(x, y)
        assert step.last_call_updated == (t % 3 == 2)
        if t % 3 != 2:
            assert all(torch.equal(a, b) for a, b in zip(before, compiled.parameters())), "updated mid-cycle"
        else:
            assert _worst(eager, compiled) <= 1e-7  # (g1 + g2 + g3) / 3 vs g1/3 + g2/3 + g3/3: round-off
        if t == 5:
            traced = step.trace_count  # a cycle creating optimizer state, then a steady cycle: 3 graphs each
    assert step.trace_count == traced == 6  # later cycles reuse the steady cycle's graphs


def test_graph_cache_holds_a_whole_accumulation_cycle() -> None:
    """Each call of a cycle has its own graph; a cache smaller than the cycle would retrace every call."""
    model = _mlp()
    step = deft_compile(model, _sgd(model), F.cross_entropy, config=DeftConfig(accumulation_steps=4, max_cached_graphs=1))
    batches = _batches(16)
    for x, y in batches[:8]:
        step(x, y)
    traced = step.trace_count
    for x, y in batches[8:]:
        step(x, y)
    assert step.trace_count == traced <= 8


def test_accumulation_flush_applies_a_partial_cycle() -> None:
    eager, compiled = _mlp(), _mlp()
    eager_opt, compiled_opt = _sgd(eager), _sgd(compiled)
    step = deft_compile(compiled, compiled_opt, F.cross_entropy, config=DeftConfig(accumulation_steps=4))
    for x, y in _batches(2):
        (F.cross_entropy(eager(x), y) / 2).backward()
        step(x, y)
    eager_opt.step()
    assert _worst(eager, compiled) > 0  # nothing applied yet
    step.flush()  # the mean over the two micro-batches so far
    assert _worst(eager, compiled) <= 1e-7


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_and_loss_scaling_equal_grad_scaler(dtype: torch.dtype) -> None:
    """Ambient autocast covers forward and loss only; scale, skip and scale schedule follow GradScaler exactly,
    including a skipped first update (no optimizer state created) and a skip once state exists."""
    eager, compiled = _mlp(), _mlp()
    eager_opt, compiled_opt = _sgd(eager), _sgd(compiled)
    eager_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=2)
    compiled_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=2)
    step = deft_compile(compiled, compiled_opt, F.cross_entropy,
                        config=DeftConfig(loss_scale=compiled_scaler, max_grad_norm=1.0))
    skipped = []
    for t, (x, y) in enumerate(_batches(30)):
        if t == 20:  # overflow again once momentum buffers exist: they must be restored too
            eager_scaler._scale.fill_(2.0**40)
            compiled_scaler._scale.fill_(2.0**40)
        eager_opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(eager(x), y)
        eager_scaler.scale(loss).backward()
        eager_scaler.unscale_(eager_opt)
        torch.nn.utils.clip_grad_norm_(eager.parameters(), 1.0)
        eager_scaler.step(eager_opt)
        eager_scaler.update()
        with torch.autocast("cpu", dtype=dtype):
            compiled_loss = step(x, y)
        skipped.append(step.last_update_skipped)
        assert float(compiled_loss) == float(loss.detach())
        assert compiled_scaler.get_scale() == eager_scaler.get_scale()
        assert _worst(eager, compiled) == 0.0, f"step {t}"
        assert len(compiled_opt.state) == len(eager_opt.state)
    if dtype == torch.float16:  # fp16 overflows at 2**40; bf16 has float32's range and does not
        assert skipped[0] and skipped[20] and not all(skipped), skipped
    else:
        assert not any(skipped)


def test_loss_scaling_with_accumulation_equals_the_grad_scaler_recipe() -> None:
    """``scaler.scale(loss / N).backward()`` per micro-batch, one ``unscale_``/clip/``step``/``update`` per cycle:
    the same skips (fp16 overflows at the same scales), scales and parameters."""
    eager, compiled = _mlp(), _mlp()
    eager_opt, compiled_opt = _sgd(eager), _sgd(compiled)
    eager_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=2)
    compiled_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=2)
    step = deft_compile(compiled, compiled_opt, F.cross_entropy,
                        config=DeftConfig(loss_scale=compiled_scaler, max_grad_norm=1.0, accumulation_steps=2))
    skipped = []
    for t, (x, y) in enumerate(_batches(24)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(eager(x), y)
        eager_scaler.scale(loss / 2).backward()
        if t % 2 == 1:
            eager_scaler.unscale_(eager_opt)
            torch.nn.utils.clip_grad_norm_(eager.parameters(), 1.0)
            eager_scaler.step(eager_opt)
            eager_scaler.update()
            eager_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            step(x, y)
        if t % 2 == 1:
            skipped.append(step.last_update_skipped)
        assert compiled_scaler.get_scale() == eager_scaler.get_scale(), f"step {t}"
        assert _worst(eager, compiled) <= 1e-6, f"step {t}"
    assert any(skipped) and not all(skipped), skipped


def test_dynamic_loss_scale_defaults_and_checkpoint() -> None:
    model = _mlp()
    step = deft_compile(model, _sgd(model), F.cross_entropy, config=DeftConfig(loss_scale="dynamic"))
    (x, y), = _batches(1)
    with torch.autocast("cpu", dtype=torch.float16):
        step(x, y)
    assert step.loss_scaler.get_scale() == 2.0**16 and not step.last_update_skipped
    state = step.state_dict()
    assert state["loss_scaler"] == {"scale": 2.0**16, "growth_tracker": 1}
    other = deft_compile(_mlp(), _sgd(_mlp()), F.cross_entropy, config=DeftConfig(loss_scale="dynamic"))
    state["loss_scaler"]["scale"] = 1024.0
    other.load_state_dict(state)
    assert other.loss_scaler.get_scale() == 1024.0


def test_autocast_is_part_of_the_cache_key() -> None:
    eager, compiled = _mlp(), _mlp()
    eager_opt, compiled_opt = _sgd(eager), _sgd(compiled)
    step = deft_compile(compiled, compiled_opt, F.cross_entropy)
    for t, (x, y) in enumerate(_batches(4)):
        region = torch.autocast("cpu", dtype=torch.bfloat16) if t % 2 else torch.autocast("cpu", enabled=False)
        eager_opt.zero_grad()
        with region:
            loss = F.cross_entropy(eager(x), y)
        loss.backward()
        eager_opt.step()
        with region:
            step(x, y)
        assert _worst(eager, compiled) == 0.0, f"step {t}"
    # the fp32 graph (its state created before the first capture: ``initialize_state``) and the bf16 one: never a
    # stale graph
    assert step.trace_count == 2


class _DictOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.linear(x)
        return {"loss": F.cross_entropy(logits, labels) if labels is not None else None, "logits": logits}


class _AttributeOutput(_DictOutput):
    def forward(self, x, labels=None):  # type: ignore[override]
        out = super().forward(x, labels)
        return type("Output", (), out)()


@pytest.mark.parametrize("kind", [_DictOutput, _AttributeOutput])
def test_model_outputs_with_loss(kind: type) -> None:
    torch.manual_seed(0)
    eager = kind()
    compiled = copy.deepcopy(eager)
    eager_opt, compiled_opt = _sgd(eager), _sgd(compiled)
    step = deft_compile(compiled, compiled_opt)
    x, labels = torch.randn(6, 4), torch.tensor([0, 1, 1, 0, 1, 0])
    eager_opt.zero_grad()
    out = eager(x, labels=labels)
    loss = out["loss"] if isinstance(out, dict) else out.loss
    loss.backward()
    eager_opt.step()
    assert float(step(x, labels=labels)) == float(loss.detach())
    assert _worst(eager, compiled) == 0.0
    with pytest.raises(LossError, match="no loss"):
        step(x)


def test_options_a_policy_cannot_honour_are_refused() -> None:
    model = _mlp()
    with pytest.raises(ValueError, match="accumulation_steps.*'dlcp'"):
        deft_compile(model, _sgd(model), F.cross_entropy, policy="dlcp", config=DeftConfig(accumulation_steps=2))
    with pytest.raises(ValueError, match="loss_scale.*'dlcp'"):
        deft_compile(model, _sgd(model), F.cross_entropy, policy="dlcp", config=DeftConfig(loss_scale="dynamic"))
    with pytest.raises(ValueError, match="max_grad_norm"):
        DeftConfig(max_grad_norm=0.0)
    with pytest.raises(ValueError, match="loss_scale"):
        DeftConfig(loss_scale="static")


# -- two processes ---------------------------------------------------------------------------------------------
CLIP_CASES = [("mlp_dropout_sgd", True), ("transformer_tied_adamw_groups", False)]
SEMANTICS = ["averaged", "compensated"]
DTYPES = ["float16", "bfloat16"]
CASE_LIST = (
    [Case(("clip", case), clip_with_ddp, (case, 6, 0.05),
          tests=(f"test_clipping_equals_ddp_then_clip_grad_norm[{case}-{exact}]",)) for case, exact in CLIP_CASES]
    + [Case(("clip", policy), compare_policy_with_ddp, ("mlp_dropout_sgd", 5, policy, 0.05),
            tests=(f"test_clipping_under_per_layer_policies_equals_ddp[{policy}]",)) for policy in ("bytescheduler", "usbyte")]
    + [Case(("clip delayed", semantics), delayed_reference_run, ("mlp_dropout_sgd", 6, "deft", 0.05, 1, semantics),
            tests=(f"test_clipping_with_delayed_buckets_matches_the_delayed_reference[{semantics}]",))
       for semantics in SEMANTICS]
    + [Case("accumulation", accumulation_with_ddp, ("mlp_dropout_sgd", 6, 3, "wfbp"),
            tests=("test_accumulation_equals_ddp_no_sync",))]
    + [Case(("accumulation delayed", semantics), delayed_reference_run, ("mlp_dropout_sgd", 9, "deft", None, 3, semantics),
            tests=(f"test_accumulation_with_delayed_buckets_matches_the_delayed_reference[{semantics}]",))
       for semantics in SEMANTICS]
    + [Case(("loss scaling", dtype), loss_scaling_with_ddp, (8, 4, dtype),
            tests=(f"test_loss_scaling_equals_ddp_with_grad_scaler[{dtype}]",)) for dtype in DTYPES]
)


@pytest.fixture(scope="module")
def outcome(request):
    """The per-rank values of a run of ``CASE_LIST`` by key (a failed run fails the test that reads it)."""
    return launch_cases(request, CASE_LIST)


@pytest.mark.parametrize("case, exact", CLIP_CASES)
def test_clipping_equals_ddp_then_clip_grad_norm(outcome, case: str, exact: bool) -> None:
    for rank, report in enumerate(outcome(("clip", case))):
        assert report["collectives"] >= 2
        for entry in report["steps"]:
            check_entry(entry, exact, f"{case} rank {rank} step {entry['step']}")
            assert entry["norm"] > 0.05, "the test must actually clip"
            assert entry["deft_norm"] == pytest.approx(entry["norm"], rel=1e-6)


@pytest.mark.parametrize("policy", ["bytescheduler", "usbyte"])
def test_clipping_under_per_layer_policies_equals_ddp(outcome, policy: str) -> None:
    """Updates deferred to the next forward clip what they apply: still DDP + clip_grad_norm_'s numbers."""
    for rank, report in enumerate(outcome(("clip", policy))):
        assert any(entry["deferred"] for entry in report["steps"]), "the plan must defer updates"
        for entry in report["steps"]:
            check_entry(entry, True, f"{policy} rank {rank} step {entry['step']}")
        check_entry(report["final"], True, f"{policy} rank {rank} after flush")


@pytest.mark.parametrize("delayed_update", SEMANTICS)
def test_clipping_with_delayed_buckets_matches_the_delayed_reference(outcome, delayed_update) -> None:
    """Clipping under deft clips what each update applies: fresh buckets and arrived delayed ones (with the
    compensated semantics, the delayed gradient clipped before its Nesterov-form update)."""
    for rank, report in enumerate(outcome(("clip delayed", delayed_update))):
        assert report["delayed_items"] >= 1
        for entry in report["steps"]:
            check_entry(entry, True, f"rank {rank} step {entry['step']}")
            deft_norm, reference_norm = entry["norms"]
            assert deft_norm == reference_norm
        check_entry(report["final"], True, f"rank {rank} after flush")


def test_accumulation_equals_ddp_no_sync(outcome) -> None:
    policy = "wfbp"  # deft's delayed buckets under accumulation: the next test, against the delayed reference
    for rank, report in enumerate(outcome("accumulation")):
        assert len(report["steps"]) == 2
        for entry in report["steps"]:
            assert "error" not in entry, entry
            assert entry["updated"]
            check_entry(entry, False, f"{policy} rank {rank} step {entry['step']}", tolerance=1e-6)


@pytest.mark.parametrize("delayed_update", SEMANTICS)
def test_accumulation_with_delayed_buckets_matches_the_delayed_reference(outcome, delayed_update) -> None:
    """Delayed buckets under accumulation communicate once per cycle, overlapping the next cycle's first
    micro-batch, and are applied at its update point (docs/POLICIES.md); compensated, every micro-batch of the
    cycle runs at the predicted weights."""
    for rank, report in enumerate(outcome(("accumulation delayed", delayed_update))):
        assert report["delayed_items"] >= 1
        assert [e["updated"] for e in report["steps"]] == [t % 3 == 2 for t in range(9)]
        for entry in report["steps"]:
            check_entry(entry, False, f"rank {rank} step {entry['step']}", tolerance=1e-6)
        check_entry(report["final"], False, f"rank {rank} after flush", tolerance=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_loss_scaling_equals_ddp_with_grad_scaler(outcome, dtype: str) -> None:
    for rank, report in enumerate(outcome(("loss scaling", dtype))):
        for entry in report["steps"]:
            check_entry(entry, True, f"{dtype} rank {rank} step {entry['step']}")
            assert entry["scales"][0] == entry["scales"][1]
            assert entry["loss_diff"] == 0.0
        skipped = [entry["skipped"] for entry in report["steps"]]
        assert skipped[4] == (dtype == "float16") and not skipped[3]
