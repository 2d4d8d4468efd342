"""Lower a rewritten step graph with Inductor, keeping the planned collective placement.

Why a module of its own: the passes decide *where* each all-reduce starts and
where it is waited; Inductor decides how the compute between them runs. Three
things make the two compatible:

* ``.item()`` reads (the learning rate) are rewritten into 0-dim tensor
  arithmetic first (:func:`deft_compile.passes.scalars.tensorize_item_reads`):
  Inductor cannot trace ``aten._local_scalar_dense``. The rate stays an input,
  so an LR scheduler still reuses one compiled graph.
* Inductor's reordering passes are off (``reorder_for_locality``,
  ``reorder_for_peak_memory``, ``reorder_for_compute_comm_overlap``), and
  :class:`PinnedCollectiveChoices` refuses any fusion whose kernel would span a
  collective or a wait: a fused kernel runs at the position of its first node,
  so fusing across a wait would move compute over it. Together, every compute
  kernel runs between the same collectives as in the FX graph.
* The graph is compiled under ``no_grad`` as an inference graph:
  AOTAutograd functionalises it and writes parameter, buffer and optimizer-state
  mutations back into the inputs (``keep_inference_input_mutations``), so they
  stay in place as on the aten path.

Two changes make the lowered step cheaper on CPU without changing its numbers
beyond float32 round-off (``benchmarks/inductor_speed.py`` measures them):

* :class:`RealizeScalars`: one-element values that feed whole tensors (the
  optimizer's per-parameter bias corrections and step sizes) are computed once,
  not once per vector of every parameter (Inductor's C++ backend does not hoist
  loop invariants). Bit-identical results.
* :func:`decompose_tanh_gelu`: the tanh-approximated GELU and its backward are
  written through ``sigmoid`` (an ``exp``) instead of Sleef's ``tanh``.

If Inductor fails, :func:`lower` logs the reason once and returns the aten
graph; ``LoweredGraph.compiler`` says which ran. Inductor's FX graph cache
(on by default) makes a second compile of the same graph, in this or another
process, fast; its entries are keyed by the CPU vector ISA the kernels were
written for (:mod:`deft_compile.step.isa_key`), which torch's own key leaves out.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from deft_compile.compilers import check_compiler
from deft_compile.step.capture import CAPTURE_ID, SYMBOLIC
from deft_compile.step.isa_key import keyed_by_isa, start_isa_check
from deft_compile.step.symbolic import is_symbolic
from deft_compile.passes.cat_layout import pin_cat_layouts
from deft_compile.passes.functional_collectives import functionalize_bucket_ops
from deft_compile.passes.random_fills import draw_bernoulli_out_of_place
from deft_compile.passes.scalars import tensorize_item_reads

log = logging.getLogger("deft_compile")



#: Inductor settings for step graphs: the FX order of collectives, waits and compute is kept, and
#: random ops (Dropout) call ATen's generator as the aten graph and eager do (Inductor's own RNG would
#: draw other numbers than DDP).
PINNED_ORDER_CONFIG: dict[str, Any] = {
    "fallback_random": True,
    "reorder_for_locality": False,
    "reorder_for_peak_memory": False,
    "reorder_for_compute_comm_overlap": False,
    "fx_graph_cache": True,
}

#: Regions compile with AOTAutograd's cache on as well as Inductor's FX graph cache: a second launch of the same
#: model traces and compiles nothing (on a hit no generated code is at hand; off, every region keeps its code).
REGION_CACHES = True
#: How many captures' region templates are kept (a capture's programs reuse its own segments only).
_TEMPLATE_CAPTURES = 8
#: Mark one-element values that feed whole tensors for computation once (:class:`RealizeScalars`).
REALIZE_SCALARS = True
#: Lower ``gelu(approximate="tanh")`` and its backward through ``sigmoid`` (:func:`decompose_tanh_gelu`).
FAST_TANH_GELU = True


def lazy_graph_modules() -> Any:
    """A context in which graph modules generate their Python code when first called, not at every
    ``recompile()``: building a step graph runs a dozen passes over thousands of nodes, and only the last
    graph's code is ever run."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(True)


@dataclass
class LoweredGraph:
    """What runs for one step graph.

    Attributes:
        run: called with the graph's inputs, returns its outputs (a sequence).
        compiler: ``"inductor"`` or ``"aten"`` (what actually runs).
        compile_seconds: time spent in Inductor (0 for aten).
        source_code: Inductor's generated Python wrapper (kernel calls and
            collectives in execution order), empty for aten.
        fallback_reason: why Inductor was asked but aten runs, else None.
    """

    run: Callable[..., Sequence[Any]]
    compiler: str
    compile_seconds: float = 0.0
    source_code: str = ""
    fallback_reason: str | None = None
    cache_hit: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)


_warned: set[str] = set()
#: How many graphs this process lowered, by what ran them ("inductor", "aten" after a fallback).
lowered_counts: collections.Counter[str] = collections.Counter()


def lower(gm: fx.GraphModule, example_inputs: Sequence[Any], compiler: str) -> LoweredGraph:
    """Lower ``gm`` (run with ``example_inputs``) with ``compiler``; fall back to aten if Inductor fails.

    ``gm`` itself is not changed (Inductor gets a copy with tensorized scalars).
    """
    check_compiler(compiler)
    if compiler == "aten":
        return LoweredGraph(run=gm, compiler="aten")
    started = time.perf_counter()
    try:
        run, source, hit = compile_with_inductor(gm, example_inputs)
    except Exception as exc:  # noqa: BLE001 - any Inductor failure falls back to the exact aten graph
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        if reason not in _warned:
            _warned.add(reason)
            log.warning("Inductor could not compile the step graph; running it as aten (%s)", reason)
        lowered_counts["aten"] += 1
        return LoweredGraph(run=gm, compiler="aten", fallback_reason=reason,
                            compile_seconds=time.perf_counter() - started)
    lowered_counts["inductor"] += 1
    return LoweredGraph(run=run, compiler="inductor", compile_seconds=time.perf_counter() - started,
                        source_code=source, cache_hit=hit)


def compile_with_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                          caches: bool = False) -> tuple[Callable[..., Any], str, bool | None]:
    """``(callable, generated wrapper code, cache hit)`` for a copy of ``gm`` compiled by Inductor.

    ``caches``: AOTAutograd's cache on as well as Inductor's FX graph cache, so a second launch traces nothing
    (regions); off, every compile keeps its generated code at hand (whole graphs: ``explain`` and the
    placement checks read it). On an AOTAutograd cache hit there is no generated code."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._functorch import config as functorch_config
    from torch._guards import TracingContext, tracing
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    lowered = functionalize_bucket_ops(tensorize_item_reads(draw_bernoulli_out_of_place(pin_cat_layouts(_copy(gm)))))
    if FAST_TANH_GELU:
        lowered = decompose_tanh_gelu(lowered)
    sources: list[str] = []
    hits: list[bool] = []

    autograd_hits = _autograd_cache_hits()

    def inner_compile(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        before = _cache_hits()
        compiled = compile_fx_inner(graph, inputs, **kwargs)
        hits.append(_cache_hits() > before)
        source = getattr(compiled, "source_code", None)
        if source:
            sources.append(source)
        return compiled

    # A tracing context with a shape environment, as Dynamo gives its backends: without one Inductor's
    # FX graph cache and AOTAutograd's cache bypass the graph ("No shape env"). A symbolic capture's inputs bring
    # their own: its symbols and guards are the capture's.
    fake_mode = _symbolic_fake_mode(example_inputs) or FakeTensorMode(shape_env=ShapeEnv())
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(inductor_config.patch(PINNED_ORDER_CONFIG))
        stack.enter_context(keyed_by_isa())
        if REALIZE_SCALARS:
            stack.enter_context(inductor_config.patch(post_grad_custom_post_pass=RealizeScalars()))
        # AOTAutograd's own cache would skip inner_compile on a hit, and with it the generated code we keep
        # (for explain and the placement checks); Inductor's FX graph cache below it still makes hits fast.
        stack.enter_context(functorch_config.patch(enable_autograd_cache=caches))
        stack.enter_context(V.set_choices_handler(PinnedCollectiveChoices()))
        stack.enter_context(tracing(TracingContext(fake_mode)))
        fake_inputs = [_fake_like(fake_mode, x) for x in example_inputs]
        compiled = compile_fx(lowered, fake_inputs, inner_compile=inner_compile)
    # compile_fx returns Dynamo's backend convention: called with the inputs as positional arguments
    if caches and _autograd_cache_hits() > autograd_hits:
        return compiled, "", True
    return compiled, "\n".join(sources), (all(hits) if hits else None)


# -- cheaper element-wise work -------------------------------------------------------------------------


_GELU_2K = 2.0 * math.sqrt(2.0 / math.pi)  # twice the tanh approximation's sqrt(2/pi)
_GELU_KAPPA = 0.044715


def _gelu_tanh(x: Any) -> Any:
    """``gelu(x, approximate="tanh")`` as ``x * sigmoid(2 z)`` (tensors or FX proxies)."""
    aten = torch.ops.aten
    cube = aten.mul.Tensor(aten.mul.Tensor(x, x), x)
    u = aten.mul.Tensor(aten.add.Tensor(x, aten.mul.Tensor(cube, _GELU_KAPPA)), _GELU_2K)
    return aten.mul.Tensor(x, aten.sigmoid.default(u))


def _gelu_tanh_backward(grad: Any, x: Any) -> Any:
    """``gelu_backward(grad, x, approximate="tanh")``: ``grad * (s + x s (1 - s) du/dx)``, ``1 - s = sigmoid(-u)``."""
    aten = torch.ops.aten
    square = aten.mul.Tensor(x, x)
    u = aten.mul.Tensor(aten.add.Tensor(x, aten.mul.Tensor(aten.mul.Tensor(square, x), _GELU_KAPPA)), _GELU_2K)
    s = aten.sigmoid.default(u)
    du = aten.mul.Tensor(aten.add.Tensor(aten.mul.Tensor(square, 3 * _GELU_KAPPA), 1.0), _GELU_2K)
    slope = aten.mul.Tensor(aten.mul.Tensor(aten.mul.Tensor(x, s), aten.sigmoid.default(aten.neg.default(u))), du)
    return aten.mul.Tensor(grad, aten.add.Tensor(s, slope))


def decompose_tanh_gelu(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``gelu``/``gelu_backward`` with ``approximate="tanh"`` into ``sigmoid`` arithmetic, in place.

    ``0.5 * x * (1 + tanh(z)) == x * sigmoid(2 z)`` exactly. Inductor's decomposition keeps the
    ``tanh``, which its C++ backend computes with Sleef's ``tanh``: about three times the cost of the
    ``exp`` a sigmoid needs, and the GELU of a GPT-2 block (forward, and its recomputation in the
    backward) were the step's largest element-wise kernels. The sigmoid form is also the more
    accurate one: ``1 + tanh(z)`` cancels for negative ``x`` and ``1 - tanh(z)**2`` near saturation,
    the sigmoids do not. Forward and backward stay within float32 round-off of ATen's kernels
    (relative to the tensor's largest value). Half and bfloat16 compute in float32, as Inductor's
    own decomposition does. The exact (erf) GELU is left to Inductor. (A pre-pass on the FX graph
    rather than a ``decompositions=`` table for ``compile_fx``: a custom table makes Inductor's FX
    graph cache bypass every graph.)
    """
    aten = torch.ops.aten
    graph = gm.graph
    tracer = fx.proxy.GraphAppendingTracer(graph)
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.gelu.default, aten.gelu_backward.default):
            continue
        val = node.meta.get("val")
        if node.kwargs.get("approximate") != "tanh" or not isinstance(val, torch.Tensor) or not val.is_floating_point():
            continue
        low_precision = val.dtype in (torch.float16, torch.bfloat16)
        with graph.inserting_before(node):
            args = [fx.Proxy(a, tracer) for a in node.args]
            if low_precision:
                args = [aten._to_copy.default(a, dtype=torch.float32) for a in args]
            out = _gelu_tanh(*args) if node.target is aten.gelu.default else _gelu_tanh_backward(*args)
            if low_precision:
                out = aten._to_copy.default(out, dtype=val.dtype)
        node.replace_all_uses_with(out.node)
        graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()
    return gm


def _custom_pass_base() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def _numel(node: Any) -> int:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.numel() if isinstance(val, torch.Tensor) else 0


class RealizeScalars(_custom_pass_base()):  # type: ignore[misc]
    """Computes each one-element value that feeds a larger tensor once, not once per vector of it.

    The optimizer's per-parameter scalars (AdamW's bias corrections ``1 - beta ** step``, with two
    ``pow`` in float64, the step size, ``eps / step_size``) are 0-dim tensors of the step graph.
    Inductor inlines such a cheap pointwise value into every kernel that reads it, and its C++
    backend does not hoist loop invariants: the scalars were recomputed for every 16 elements of the
    parameter (a 1M-parameter AdamW update took 1.5 ms instead of 0.2). Marked here (Inductor's
    ``inductor_realize_to_strides`` node flag), they become 0-dim buffers computed once and read by
    the element-wise kernel. Same operations in the same precision, so the same numbers.
    """

    def __call__(self, graph: fx.Graph) -> None:
        for node in graph.nodes:
            if node.op != "call_function" or _numel(node) != 1:
                continue
            val = node.meta["val"]
            if val.dtype.is_floating_point and any(_numel(user) > 1 for user in node.users):
                node.meta["inductor_realize_to_strides"] = True

    def uuid(self) -> Any:
        return "deft_compile.RealizeScalars.v1"


def _symbolic_fake_mode(inputs: Sequence[Any]) -> Any:
    """The fake mode of the symbolic fake tensors among ``inputs`` (a symbolic capture's metadata), else None."""
    for x in inputs:
        if is_symbolic(x):
            return x.fake_mode
    return None


def _fake_like(fake_mode: Any, x: Any) -> Any:
    """A static-shape fake tensor of ``fake_mode`` like ``x`` (real, or fake from another mode); a symbolic fake
    tensor of ``fake_mode`` itself as it is."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(x, torch.Tensor):
        return x
    if isinstance(x, FakeTensor) and x.fake_mode is fake_mode:
        return x
    if any(isinstance(d, torch.SymInt) for d in (*x.shape, *x.stride())):
        raise ValueError("the graph has dynamic shapes; deft_compile lowers static-shape graphs only")
    if isinstance(x, FakeTensor):
        with fake_mode:
            return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device=x.device)
    return fake_mode.from_tensor(x, static_shapes=True)


class LazyLowered:
    """Lowers ``gm`` with ``compiler`` on its first call (real inputs) and runs the result from then on.

    For graphs whose example inputs are not at hand when they are built (the
    ``deft`` backend's backward graphs with extra pending-bucket inputs).
    """

    def __init__(self, gm: fx.GraphModule, compiler: str, label: str) -> None:
        self.gm = gm
        self.compiler = compiler
        self.label = label
        self.lowered: LoweredGraph | None = None

    def __call__(self, *inputs: Any) -> Any:
        if self.lowered is None:
            self.lowered = lower(self.gm, inputs, self.compiler)
            if self.lowered.compiler == "inductor":
                log.info("Inductor compiled %s graph (%d nodes) in %.2f s%s", self.label, len(self.gm.graph.nodes),
                         self.lowered.compile_seconds, " (FX graph cache hit)" if self.lowered.cache_hit else "")
        return self.lowered.run(*inputs)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = copy.deepcopy(gm.graph)
    copied = fx.GraphModule(gm, graph)
    copied.meta.update(gm.meta)
    return copied


def _cache_hits() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"])


def _autograd_cache_hits() -> int:
    from torch._dynamo.utils import counters

    return int(counters["aot_autograd"]["autograd_cache_hit"])


# -- keeping the order ---------------------------------------------------------------------------------


def _is_collective(snode: Any) -> bool:
    from torch._inductor import ir

    node = getattr(snode, "node", None)
    return isinstance(node, (ir._CollectiveKernel, ir._WaitKernel))


def _choices_base() -> type:
    from torch._inductor.choices import InductorChoices

    return InductorChoices


class PinnedCollectiveChoices(_choices_base()):  # type: ignore[misc]
    """Inductor's default heuristics, except that no fused kernel spans a collective or a wait.

    Scheduler nodes are numbered in FX order (``min_order``/``max_order``); a
    fusion of two nodes covers the range between their extremes. If a
    collective launch or a wait lies strictly inside that range, the fusion
    would run compute on the wrong side of it, so it is refused.
    """

    _boundaries: "weakref.WeakKeyDictionary[Any, list[int]]"

    def __init__(self) -> None:
        super().__init__()
        self._boundaries = weakref.WeakKeyDictionary()

    def _orders(self, scheduler: Any) -> list[int]:
        orders = self._boundaries.get(scheduler)
        if orders is None:
            orders = sorted(n.min_order for n in scheduler.nodes if _is_collective(n))
            self._boundaries[scheduler] = orders
        return orders

    def can_fuse(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        low = min(node1.min_order, node2.min_order)
        high = max(node1.max_order, node2.max_order)
        if any(low < b < high for b in self._orders(scheduler)):
            return False
        return super().can_fuse(scheduler, node1, node2, shared_data_score)


def collective_order(source_code: str) -> list[str]:
    """The generated wrapper's calls, in order, as ``"all_reduce"``, ``"all_gather"``, ``"wait"``, ``"broadcast"`` or
    ``"kernel"``.

    For tests and ``deft-compile explain``: shows where Inductor launches and
    waits each collective relative to its compute kernels.
    """
    events: list[str] = []
    in_call = False
    for raw in source_code.splitlines():
        line = raw.strip()
        if line.startswith("#"):
            continue
        if line.startswith("def call(") or line.startswith("def _call("):
            in_call = True
            continue
        if not in_call:
            continue
        if raw and not raw.startswith((" ", "\t")):
            in_call = False
            continue
        if "_c10d_functional.all_reduce" in line:
            events.append("all_reduce")
        elif "_c10d_functional.all_gather_into_tensor" in line:
            events.append("all_gather")
        elif "_c10d_functional.broadcast" in line:
            events.append("broadcast")
        elif "_c10d_functional.wait_tensor" in line:
            events.append("wait")
        elif line.startswith(("cpp_fused", "triton_", "extern_kernels.", "aten.", "torch.ops.aten.")) or (
            "(" in line and line.split("(")[0].startswith("cpp_")
        ):
            events.append("kernel")
    return events


# -- the compiled step's use ---------------------------------------------------------------------------


class StepLowering:
    """Runs the step graphs of one ``CompiledStep`` with the configured compiler.

    ``"inductor"`` (the default): regional (``deft_compile.step.regions``). Every graph runs as its segments from
    its first call on, flush graphs too (the step's own first call on a static capture aside, which compiles only
    what Inductor's cache holds: ``DeftConfig.aten_first_call``): the plan's glue as aten, each region compiled
    once per structure and input signature for all the step's graphs. So a graph runs the same kernels in every
    process from its first call (a resumed run is bit-identical to a straight one), and a new plan compiles only
    regions no earlier graph had (none, when only the collectives moved).

    ``"inductor-graph"`` (opt-in): the whole graph lowered at once, fusing across region boundaries. A graph runs
    as aten on its first call and is lowered on its second (the first step and flushes usually run once); flush
    graphs always run as aten; every new plan is a new compile.

    ``"aten"``: the graph's aten ops, called from Python.

    Regions compile shared across the data-parallel processes (``share_compiles``): before a graph's first run,
    each process compiles its share of the regions no earlier graph had (every ``world``-th, from its rank) from
    the regions' recorded input metadata, then runs the graph and compiles the rest as it reaches them. Processes
    that share Inductor's cache folder (the ranks of one host) find the others' share there and load it instead
    of compiling it; others compile it as without sharing. No collective is involved: a process whose peer has
    not finished a region yet compiles it itself.
    """

    def __init__(self, compiler: str) -> None:
        check_compiler(compiler)
        self.compiler = compiler
        if compiler != "aten":
            start_isa_check()  # Inductor's first compile waits for it (step/isa_key.py)
        self._lowered: "weakref.WeakKeyDictionary[fx.GraphModule, LoweredGraph]" = weakref.WeakKeyDictionary()
        self._seen: "weakref.WeakKeyDictionary[fx.GraphModule, int]" = weakref.WeakKeyDictionary()
        self._programs: "weakref.WeakKeyDictionary[fx.GraphModule, Any]" = weakref.WeakKeyDictionary()
        # region segments by node names, shared by the programs of one capture (names repeat across captures, the
        # shapes and constants they were traced with do not); the most recent captures'
        self._templates: collections.OrderedDict[Any, dict[tuple, Any]] = collections.OrderedDict()
        self.regions = None
        self._share: tuple[int, int] | None = None  # (rank, world size) the cold compiles are split across
        self._shared: set[str] = set()  # region structure keys already dealt out
        self._dealt: "weakref.WeakSet[Any]" = weakref.WeakSet()  # programs whose new regions were dealt out
        self._prepared: "weakref.WeakSet[Any]" = weakref.WeakSet()  # symbolic programs compiled ahead
        if compiler == "inductor":
            from deft_compile.step.regions import RegionCache

            self.regions = RegionCache(self._compile_region)
        self.last: LoweredGraph | None = None  # what ran in the most recent call
        self.history: list[dict[str, Any]] = []  # one entry per Inductor compile (seconds, cache hit, fallback)
        # runs that were not a graph's steady state: a run that compiled (or, whole-graph, the first aten run of a
        # graph Inductor will compile). Timings of steps with one are not the plan's (the closed loop leaves them out)
        self.cold_runs = 0

    def run(self, gm: fx.GraphModule, inputs: Sequence[Any], *, flush: bool = False, label: str = "step",
            cached_only: bool = False) -> Sequence[Any]:
        """Run ``gm`` on ``inputs`` with the compiler. ``cached_only`` (the step's first call on a static capture,
        ``DeftConfig.aten_first_call``): regions compile only while Inductor's cache holds them; from the first
        region compiled from scratch on, the others run as aten this time."""
        if self.regions is not None:
            return self._run_regions(gm, inputs, label, cached_only)
        lowered = self._lowered.get(gm)
        if lowered is None:
            calls = self._seen.get(gm, 0)
            self._seen[gm] = calls + 1
            if self.compiler == "aten" or flush or calls == 0:
                self.cold_runs += self.compiler != "aten" and not flush
                self.last = LoweredGraph(run=gm, compiler="aten")
                return gm(*inputs)
            self.cold_runs += 1
            lowered = self._lower_graph(gm, inputs, label)
        self.last = lowered
        return lowered.run(*inputs)

    def _lower_graph(self, gm: fx.GraphModule, inputs: Sequence[Any], label: str) -> LoweredGraph:
        """Lower a whole graph (``"inductor-graph"``) for ``inputs`` (real, or a symbolic capture's fake ones)."""
        lowered = lower(gm, inputs, self.compiler)
        self._lowered[gm] = lowered
        self.history.append({"graph": label, "compiler": lowered.compiler, "seconds": round(lowered.compile_seconds, 3),
                             "cache_hit": lowered.cache_hit, "fallback_reason": lowered.fallback_reason})
        if lowered.compiler == "inductor":
            log.info("Inductor compiled %s graph (%d nodes) in %.2f s%s", label, len(gm.graph.nodes),
                     lowered.compile_seconds, " (FX graph cache hit)" if lowered.cache_hit else "")
        return lowered

    # -- regions ----------------------------------------------------------------------------------------------
    def program(self, gm: fx.GraphModule) -> Any:
        """The regional program of ``gm`` (built once per graph module)."""
        from deft_compile.step.regions import RegionalProgram

        program = self._programs.get(gm)
        if program is None:
            capture = gm.meta.get(CAPTURE_ID)
            templates = self._templates.setdefault(capture, {})
            self._templates.move_to_end(capture)
            while len(self._templates) > _TEMPLATE_CAPTURES:
                self._templates.popitem(last=False)
            with lazy_graph_modules():
                program = self._programs[gm] = RegionalProgram(gm, templates)
        return program

    def share_compiles(self, rank: int, world_size: int) -> None:
        """Split the regions' cold compiles across ``world_size`` processes, this one being ``rank`` (see the class
        docstring); the step calls it for its data-parallel group."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self._share = (rank, world_size) if world_size > 1 else None

    def _compile_share(self, program: Any) -> None:
        """Compile this process's share of ``program``'s regions that no earlier graph dealt out, from the input
        metadata the capture recorded (a region whose inputs lack it compiles when it runs)."""
        rank, world_size = self._share
        new = []
        for segment in program.segments:
            identity = self.regions.identity(segment) if segment.is_region else None
            if segment.is_region and identity not in self._shared:
                self._shared.add(identity)
                new.append(segment)
        for segment in new[rank::world_size]:
            self._compile_ahead(segment)

    def _compile_ahead(self, segment: Any) -> None:
        """Compile a region from the input metadata the capture recorded, if it has it."""
        from deft_compile.step.regions import recorded_inputs
        from deft_compile.step.symbolic import is_symbolic

        examples = recorded_inputs(segment)
        if examples is None:
            return
        if any(is_symbolic(e) for e in examples):
            self.regions.precompile(segment, examples)
        else:
            self.regions.get(segment, examples)

    def prepare(self, gm: fx.GraphModule, inputs: Sequence[Any]) -> None:
        """Compile now what the first run of a graph of a symbolic capture would compile (every region, or the whole
        graph), so that the guards Inductor adds to the capture's shape environment are known before it runs."""
        if not gm.meta.get(SYMBOLIC):
            return
        if self.regions is not None:
            program = self.program(gm)
            if program not in self._prepared:
                self._prepared.add(program)
                for segment in program.segments:
                    if segment.is_region:
                        self._compile_ahead(segment)
        elif self.compiler == "inductor-graph" and gm not in self._lowered:
            examples = [node.meta.get("val") for node in gm.graph.nodes if node.op == "placeholder"]
            examples = [e if is_symbolic(e) else x for e, x in zip(examples, inputs)]
            self._lower_graph(gm, examples, "step")

    def _run_regions(self, gm: fx.GraphModule, inputs: Sequence[Any], label: str,
                     cached_only: bool = False) -> Sequence[Any]:
        program = self.program(gm)
        compiled_before = len(self.history)
        if self._share is not None and program not in self._dealt and not cached_only:
            self._dealt.add(program)
            self._compile_share(program)
        missed, as_aten = False, 0  # cached_only: a compile missed Inductor's cache; regions run as aten since

        def call(segment: Any, values: list[Any]) -> Sequence[Any]:
            nonlocal missed, as_aten
            if not segment.is_region or missed:
                as_aten += segment.is_region
                return segment.module(*values)
            compiled_now = len(self.history)
            compiled, _ = self.regions.get(segment, values)
            missed = cached_only and any(entry.get("cache_hit") is not True for entry in self.history[compiled_now:])
            return compiled(*values)

        outputs = program.run(inputs, call)
        new = self.history[compiled_before:]
        if new or as_aten:
            self.cold_runs += 1
            log.info("Inductor compiled %d region(s) of the %s graph in %.2f s (%d regions compiled in all)%s",
                     len(new), label, sum(entry["seconds"] for entry in new), len(self.regions),
                     f"; {as_aten} ran as aten, to compile from the next call: the first call compiles only what "
                     f"Inductor's cache holds (aten_first_call)" if as_aten else "")
        keys = {segment.key for segment in program.segments if segment.is_region}
        lowered = not as_aten and any(key not in self.regions.aten_keys for key in keys)
        identities = {self.regions.identity(s) for s in program.segments if s.is_region}
        sources = [entry.get("source", "") for entry in self.history if entry.get("source") and entry["key"] in identities]
        self.last = LoweredGraph(run=gm, compiler="inductor" if lowered else "aten", source_code="\n".join(sources),
                                 extra={"segments": len(program.segments), "regions": len(keys)})
        return outputs

    def _compile_region(self, segment: Any, inputs: Sequence[Any], *, symbolic: bool = False,
                        key: str | None = None) -> Callable[..., Any]:
        """Compile one region for ``inputs`` (``symbolic``: fake inputs with symbolic sizes, used as they are);
        ``key``: what the compile serves, if not the segment's structure alone (a flat update's optimizer form)."""
        from deft_compile.step.region_keys import input_signature
        from deft_compile.step.regions import recorded_inputs

        module = segment.module
        examples = recorded_inputs(segment)
        if not symbolic and examples is not None and input_signature(examples) == input_signature(inputs):
            # the capture's metadata, as a peer's share compiled it: the same cache key in every process
            inputs = examples
        started = time.perf_counter()
        entry: dict[str, Any] = {"graph": "region", "region": str(segment.region), "key": key or segment.key,
                                 "compiler": "inductor", "nodes": len(module.graph.nodes)}
        try:
            run, source, hit = compile_with_inductor(module, inputs, caches=REGION_CACHES)
            entry.update(cache_hit=hit, fallback_reason=None, source=source)
        except Exception as exc:  # noqa: BLE001 - a region Inductor cannot compile runs as aten
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            if reason not in _warned:
                _warned.add(reason)
                log.warning("Inductor could not compile a region of the step; it runs as aten (%s)", reason)
            lowered_counts["aten"] += 1
            entry.update(compiler="aten", cache_hit=None, fallback_reason=reason)
            run = module
        else:
            lowered_counts["inductor"] += 1
        entry["seconds"] = round(time.perf_counter() - started, 3)
        self.history.append(entry)
        return run
