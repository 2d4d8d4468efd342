"""Compile the step's compute once, in regions; a plan only arranges collectives between them.

Regions are fixed by the captured step, never by the plan (``tag_regions``, a pass that runs before the plan's
passes). A computing node belongs to:

* ``("forward", l)``: the forward from the first use of the ``l``-th layer's parameters up to the next layer's
  (``l = -1`` before the first layer);
* ``("backward", k)``: the backward after the ``k-1``-th gradient-ready node up to and including the ``k``-th
  (``k = -1`` from the end of the forward to the first; the last index after the last gradient is ready);
* ``("update", p)``: the optimizer update of parameter ``p``;
* ``SCALAR``: a Python number computed from graph inputs alone (the learning rate's ``.item()`` and the arithmetic
  on it), copied into every segment that reads it, so that regions take the rate as a tensor and an LR schedule
  compiles nothing.

These are the points where a plan may launch a collective (after a gradient is ready), wait for one (before a
layer's first use, before an update) or hand a delayed gradient on. The plan's passes insert their nodes (bucket
copies, collectives, waits, carries, guards) between regions and move whole update regions, so a region's nodes
are the same whatever the plan.

``RegionalProgram`` splits a rewritten step graph into segments in graph order: consecutive nodes of one region,
and runs of the nodes the passes inserted ("glue", run as aten: collectives, waits and bucket copies are the
plan's arrangement). ``RegionCache`` compiles each region segment with Inductor once per structure and input
shapes, dtypes and strides: the same region in another plan's graph, in the flush graph or in a repeated
transformer block is one compile, and a re-plan, a closed-loop trial, a duel or a flush compiles nothing new.
Values are dropped after their last use, as in one graph.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import operator
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module

from deft_compile.ir.layout import layout_of
from deft_compile.step.annotate import annotate
from deft_compile.step.flat_updates import FlatUpdate, flat_callable
from deft_compile.step.region_keys import input_signature, structure_key

log = logging.getLogger("deft_compile")

REGION = "deft_region"  # node.meta key
SCALAR = ("scalar",)
_PLACEHOLDER_LIKE = ("placeholder", "output", "get_attr")


# -- tagging ------------------------------------------------------------------------------------------------


def tag_regions(gm: fx.GraphModule, param_names: Sequence[str] | None = None) -> fx.GraphModule:
    """Record each computing node's region in ``node.meta["deft_region"]`` (see the module docstring).

    ``param_names`` (the captured parameters' names) group parameters into blocks (``block_of``): a forward
    region starts at a block's first parameter use and a backward region ends at the last gradient of a block
    made ready before the next block's; without names every parameter is a block of its own."""
    layout = layout_of(gm)
    inputs = layout.inputs(gm.graph)
    params = inputs.params
    states: dict[int, list[fx.Node]] = {}
    for (index, _key), node in zip(layout.state_inputs, inputs.states):
        states.setdefault(index, []).append(node)
    annotation = annotate(gm.graph, params, states)
    order = annotation.order
    block = [block_of(param_names[i]) if param_names is not None else str(i) for i in range(len(params))]
    forward_end = order[annotation.forward_end]
    first_use: dict[str, int] = {}
    for a in annotation.params:
        if a.first_forward_use is not None:
            first_use[block[a.index]] = min(first_use.get(block[a.index], len(order)), order[a.first_forward_use])
    layer_starts = sorted(set(first_use.values()))
    ready = sorted((order[a.gradient_ready], block[a.index]) for a in annotation.params if a.gradient_ready is not None)
    # a backward region ends where the next gradient made ready belongs to another block
    ready_ends = [position for i, (position, name) in enumerate(ready) if i + 1 == len(ready) or ready[i + 1][1] != name]
    update_of: dict[fx.Node, int] = {}
    for a in annotation.params:
        for node in a.update_nodes:
            update_of.setdefault(node, a.index)
    for node in gm.graph.nodes:
        if node.op in _PLACEHOLDER_LIKE:
            continue
        position = order[node]
        if _is_scalar(node):
            region: tuple = SCALAR
        elif node in update_of:
            region = ("update", update_of[node])
        elif position < forward_end:
            region = ("forward", _last_at_or_before(layer_starts, position))
        elif ready_ends and position <= ready_ends[-1]:
            region = ("backward", _first_at_or_after(ready_ends, position))
        else:
            region = ("backward", len(ready_ends))
        node.meta[REGION] = region
    # the optimizer's nodes that read no parameter, state or gradient (a step counter created with ``zeros``, the
    # bias corrections computed from it) belong to the one update that reads them, not to the end of the backward:
    # otherwise a plan that leaves some updates out of a graph would change that region
    update_start = max((order[a.gradient_marker] for a in annotation.params if a.gradient_marker is not None),
                       default=len(order))
    for node in reversed(list(gm.graph.nodes)):
        if node.op in _PLACEHOLDER_LIKE or order[node] <= update_start or node.meta.get(REGION) in (None, SCALAR):
            continue
        if node.meta[REGION][0] == "update":
            continue
        users = {user.meta.get(REGION) for user in node.users if user.op != "output"}
        if len(users) == 1 and next(iter(users)) is not None and next(iter(users))[0] == "update":
            node.meta[REGION] = next(iter(users))
    for node in gm.graph.nodes:  # a tuple's elements stay with the op that made the tuple
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            if REGION in node.args[0].meta:
                node.meta[REGION] = node.args[0].meta[REGION]
    return gm


def block_of(name: str) -> str:
    """The block a parameter belongs to: its name up to the first numeric part (``transformer.h.3`` of
    ``transformer.h.3.attn.c_attn.weight``: one block of a stack), else its module (``transformer.wte``)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def _is_scalar(node: fx.Node) -> bool:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor) or isinstance(value, (list, tuple)) or value is None:
        return False
    return all(arg.op == "placeholder" or arg.meta.get(REGION) == SCALAR for arg in node.all_input_nodes)


def _last_at_or_before(positions: list[int], position: int) -> int:
    index = -1
    for i, start in enumerate(positions):
        if start <= position:
            index = i
        else:
            break
    return index


def _first_at_or_after(positions: list[int], position: int) -> int:
    for i, end in enumerate(positions):
        if end >= position:
            return i
    return len(positions)


# -- the program ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Segment:
    """Consecutive nodes of one region (``region`` set) or of glue (``region`` None), as a graph module of their
    own: ``inputs`` are the values it reads from before it, ``outputs`` those read after it."""

    region: tuple | None
    module: fx.GraphModule
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    release: list[fx.Node] = dataclasses.field(default_factory=list)  # values last read here
    key: str = ""  # structure digest (regions)

    @property
    def is_region(self) -> bool:
        return self.region is not None


class RegionalProgram:
    """A rewritten step graph as segments run in order (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, templates: dict[tuple, "Segment"] | None = None) -> None:
        """``templates``: region segments of earlier programs of the same capture, by what decides their extracted
        graphs (``_template_signature``), reused instead of extracted again."""
        self.gm = gm
        self._templates = templates if templates is not None else {}
        graph = gm.graph
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.output_node = next(n for n in graph.nodes if n.op == "output")
        runs: list[tuple[tuple | None, list[fx.Node]]] = []
        for node in _glue_to_region_edges(graph):
            region = _region_of(node)
            if runs and runs[-1][0] == region:
                runs[-1][1].append(node)
            else:
                runs.append((region, [node]))
        self.segments = [self._segment(region, nodes) for region, nodes in runs]
        self._plan_release()
        regions = [s.region for s in self.segments if s.is_region]
        self.split_regions = sorted({r for r in regions if regions.count(r) > 1}, key=str)
        if self.split_regions:
            log.debug("regions split by the plan's nodes (compiled per piece): %s", self.split_regions)

    def _segment(self, region: tuple | None, nodes: list[fx.Node]) -> Segment:
        members = set(nodes)
        inputs = _extracted_inputs(nodes, members)
        outputs = [n for n in nodes if any(user not in members for user in n.users)]
        if region is None:
            return self._extract(region, nodes, inputs, outputs)
        signature = _template_signature(region, nodes, inputs, outputs)
        template = self._templates.get(signature)
        if template is not None:
            return dataclasses.replace(template, inputs=inputs, outputs=outputs, release=[])
        segment = self._templates[signature] = self._extract(region, nodes, inputs, outputs)
        return segment

    def _extract(self, region: tuple | None, nodes: list[fx.Node], inputs: list[fx.Node],
                 outputs: list[fx.Node]) -> Segment:
        """``nodes`` as a graph module of their own: a placeholder per input, in ``inputs``' order, then the nodes,
        with the scalars they read copied in."""
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for index, arg in enumerate(inputs):
            env[arg] = graph.placeholder(f"in_{index}")
            env[arg].meta.update({k: v for k, v in arg.meta.items() if k == "val"})

        def value_of(arg: fx.Node) -> fx.Node:
            if arg not in env:  # a scalar (``_extracted_inputs``): its computation copied here, from graph inputs
                env[arg] = graph.node_copy(arg, value_of)
            return env[arg]

        for node in nodes:
            env[node] = graph.node_copy(node, value_of)
        graph.output(tuple(env[n] for n in outputs))
        module = _make_graph_module(self.gm, graph)  # lazy under lowering.lazy_graph_modules()
        segment = Segment(region, module, inputs, outputs)
        if region is not None:
            segment.key = structure_key(graph)
        return segment

    def event_order(self) -> list[str]:
        """What the program runs, in order: ``"region"`` per compiled region, and the plan's collectives (``"all_reduce"``,
        ``"all_gather"``, ``"wait"``, ``"broadcast"``) where its glue runs them (for tests and ``explain``)."""
        c10d = torch.ops._c10d_functional
        names = {c10d.all_reduce.default: "all_reduce", c10d.all_reduce_.default: "all_reduce",
                 c10d.wait_tensor.default: "wait", c10d.broadcast.default: "broadcast",
                 c10d.broadcast_.default: "broadcast", c10d.all_gather_into_tensor.default: "all_gather"}
        events: list[str] = []
        for segment in self.segments:
            if segment.is_region:
                events.append("region")
                continue
            events += [names[n.target] for n in segment.module.graph.nodes if n.op == "call_function" and n.target in names]
        return events

    def _plan_release(self) -> None:
        last: dict[fx.Node, int] = {}
        for index, segment in enumerate(self.segments):
            for value in segment.inputs:
                last[value] = index
        kept = set(self.output_node.all_input_nodes)
        for value, index in last.items():
            if value not in kept and value.op != "placeholder":
                self.segments[index].release.append(value)

    def run(self, inputs: Sequence[Any], call: Callable[[Segment, list[Any]], Sequence[Any]]) -> Any:
        env: dict[fx.Node, Any] = dict(zip(self.placeholders, inputs))
        for segment in self.segments:
            results = call(segment, [env[value] for value in segment.inputs])
            for node, value in zip(segment.outputs, results):
                env[node] = value
            for value in segment.release:
                env.pop(value, None)
        return fx.node.map_arg(self.output_node.args[0], lambda node: env[node] if node in env else _scalar(node, env))


def _extracted_inputs(nodes: list[fx.Node], members: set[fx.Node]) -> list[fx.Node]:
    """A segment's inputs: each value ``nodes`` read from outside, first read first, where a scalar (copied into the
    segment) reads its own inputs at its place (the learning rate's graph input, behind the ``.item()`` arithmetic
    an update reads)."""
    seen: set[fx.Node] = set()
    inputs: list[fx.Node] = []

    def visit(arg: fx.Node) -> None:
        if arg in members or arg in seen:
            return
        seen.add(arg)
        if arg.meta.get(REGION) == SCALAR:
            for inner in arg.all_input_nodes:
                visit(inner)
            return
        inputs.append(arg)

    for node in nodes:
        for arg in node.all_input_nodes:
            visit(arg)
    return inputs


def _template_signature(region: tuple, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> tuple:
    """What decides a region segment's extracted graph, without extracting it: its nodes (by name: a capture's nodes
    keep their names in every step graph copied from it), which of them are outputs, each input's shape, stride
    and dtype, and for each node which member, input or copied-in scalar each of its arguments is. Why not the
    inputs' names: a pass names the nodes it inserts (a bucket view, a waited gradient, a carried learning rate)
    afresh in each step graph, so by name no update region would match a graph of another plan, while the graph
    extracted from its nodes is the same."""
    position = {node: i for i, node in enumerate(nodes)}
    slot = {node: i for i, node in enumerate(inputs)}
    scalars: dict[fx.Node, tuple] = {}

    def role(arg: fx.Node) -> tuple:
        if arg in position:
            return ("node", position[arg])
        if arg in slot:
            return ("input", slot[arg])
        if arg not in scalars:  # copied in: by what it computes (a pass's copy of the rate's ``.item()`` is named anew)
            scalars[arg] = ("scalar", str(arg.target), repr(fx.node.map_arg((arg.args, arg.kwargs), role)))
        return scalars[arg]

    pattern = tuple(tuple(role(arg) for arg in node.all_input_nodes) for node in nodes)
    return (region, tuple(n.name for n in nodes), tuple(_value_signature(a) for a in inputs), pattern,
            tuple(n.name for n in outputs))


def _value_signature(node: fx.Node) -> tuple:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return (str(tuple(value.shape)), str(tuple(value.stride())), value.dtype)
    return (type(value).__name__,)


def _region_of(node: fx.Node) -> tuple | None:
    return None if node.op == "get_attr" else node.meta.get(REGION)


def _glue_to_region_edges(graph: fx.Graph) -> list[fx.Node]:
    """The graph's computing nodes in run order, scalars left out, with the nodes that sit inside a region's span
    (the plan's glue, or another region: an update the plan moved before a layer's forward) moved to its edge:
    after the region when nothing later in it depends on them (a launch after a gradient made ready inside a
    block's backward), else before it when they depend on nothing of it (a wait before a layer). Dependencies are
    the graph's edges and in-place writes: a node that writes a tensor (or a view of it) that a later member reads
    or writes, or reads one a later member writes, must stay before those members (an update of a parameter that
    the layer's forward reads after it). A node that depends both ways stays, and splits the region."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output") and _region_of(n) != SCALAR]
    position = {node: i for i, node in enumerate(nodes)}
    access = _Access()
    members_of: dict[tuple, list[fx.Node]] = {}
    for node in nodes:
        region = _region_of(node)
        if region is not None:
            members_of.setdefault(region, []).append(node)
    for region, members in members_of.items():
        first, last = position[members[0]], position[members[-1]]
        if last - first + 1 == len(members):
            continue
        member_set = set(members)
        intruders = [node for node in nodes[first: last + 1] if node not in member_set]
        split = _split_intruders(intruders, members, member_set, position, access)
        if split is None:
            continue  # the region stays split (each piece compiles on its own)
        before, after = split
        span = before + members + after
        nodes[first: last + 1] = span
        for offset, node in enumerate(span):
            position[node] = first + offset
    return nodes


def _split_intruders(intruders: list[fx.Node], members: list[fx.Node], member_set: set[fx.Node],
                     position: dict[fx.Node, int], access: "_Access") -> tuple[list[fx.Node], list[fx.Node]] | None:
    """The nodes inside a region's span that run before it and those that run after it, each in graph order, or
    None when they cannot all leave it. A node goes before when a later member depends on it (reads its value,
    or a tensor it writes in place; or writes one it reads), and so does every earlier intruder such a node
    depends on; the rest go after. A node going before that depends on an earlier member cannot leave."""
    member_positions = [position[m] for m in members]
    # the storages that members read and write from each member on (suffix) and before it (prefix)
    suffix: list[tuple[frozenset, frozenset]] = [(frozenset(), frozenset())] * (len(members) + 1)
    for i in range(len(members) - 1, -1, -1):
        reads, writes = suffix[i + 1]
        suffix[i] = (reads | access.reads(members[i]), writes | access.writes(members[i]))
    prefix: list[tuple[frozenset, frozenset]] = [(frozenset(), frozenset())]
    for member in members:
        reads, writes = prefix[-1]
        prefix.append((reads | access.reads(member), writes | access.writes(member)))

    before: set[fx.Node] = set()
    need_values: set[fx.Node] = set()  # what the nodes going before read, as values and as storages
    need_reads: set[fx.Node] = set()
    need_writes: set[fx.Node] = set()
    for node in reversed(intruders):
        here = position[node]
        later = bisect.bisect_right(member_positions, here)
        forced = (any(u in member_set and position[u] > here for u in node.users) or _writes_region(node, member_set)
                  or access.clashes(node, *suffix[later]))
        feeds = node in need_values or access.clashes(node, need_reads, need_writes)
        if not (forced or feeds):
            continue
        if any(a in member_set for a in node.all_input_nodes) or access.clashes(node, *prefix[later]):
            return None
        before.add(node)
        need_values.update(node.all_input_nodes)
        need_reads |= access.reads(node)
        need_writes |= access.writes(node)
    return [n for n in intruders if n in before], [n for n in intruders if n not in before]


class _Access:
    """The tensors a node reads and writes, as the nodes that own their storage (a view's or an in-place op's
    result is its input's storage; ``wait_tensor`` returns the tensor it waited for), memoised."""

    def __init__(self) -> None:
        self._storage: dict[fx.Node, fx.Node] = {}
        self._reads: dict[fx.Node, frozenset[fx.Node]] = {}
        self._writes: dict[fx.Node, frozenset[fx.Node]] = {}

    def storage(self, node: fx.Node) -> fx.Node:
        known = self._storage.get(node)
        if known is not None:
            return known
        base = node
        if node.op == "call_function":
            if node.target is torch.ops._c10d_functional.wait_tensor.default and isinstance(node.args[0], fx.Node):
                base = self.storage(node.args[0])
            else:
                schema = getattr(node.target, "_schema", None)
                aliased = {name for r in (schema.returns if schema else ()) if r.alias_info for name in r.alias_info.before_set}
                for argument, value in zip(schema.arguments if schema else (), node.args):
                    if (argument.alias_info is not None and aliased & argument.alias_info.before_set
                            and isinstance(value, fx.Node)):
                        base = self.storage(value)
                        break
        self._storage[node] = base
        return base

    def reads(self, node: fx.Node) -> frozenset[fx.Node]:
        if node not in self._reads:
            self._reads[node] = frozenset(self.storage(a) for a in node.all_input_nodes)
        return self._reads[node]

    def writes(self, node: fx.Node) -> frozenset[fx.Node]:
        if node not in self._writes:
            self._writes[node] = frozenset(self.storage(v) for v in _written_args(node))
        return self._writes[node]

    def clashes(self, node: fx.Node, reads: frozenset | set, writes: frozenset | set) -> bool:
        """Whether ``node`` must keep its order against nodes that read ``reads`` and write ``writes`` (storages):
        it writes what they read or write, or reads what they write."""
        return bool(self.writes(node) & (reads | writes)) or bool(writes & self.reads(node))


def _written_args(node: fx.Node) -> list[fx.Node]:
    """The nodes whose tensors ``node`` writes in place (its schema's written arguments, lists included)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    written: list[fx.Node] = []
    for argument, value in zip(schema.arguments if schema else (), node.args):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node)]
    return written


def _writes_region(node: fx.Node, members: set[fx.Node]) -> bool:
    """Whether ``node`` writes in place into a tensor computed by the region (it must then stay where it is)."""
    return any(value in members for value in _written_args(node))


def _scalar(node: fx.Node, env: dict[fx.Node, Any]) -> Any:
    """A scalar node's value computed from the graph inputs (an output that is a Python number)."""
    args = fx.node.map_arg(node.args, lambda a: env[a] if a in env else _scalar(a, env))
    kwargs = fx.node.map_arg(node.kwargs, lambda a: env[a] if a in env else _scalar(a, env))
    return node.target(*args, **kwargs)


# -- compiling and running ---------------------------------------------------------------------------------


class RegionCache:
    """Compiled regions by (structure, input signature); one per compiled step, shared by all its graphs.

    An element-wise update region runs flattened on one compile per optimizer form (``flat_updates``): every
    parameter's update with the same optimizer, hyper-parameters and dtypes shares it.

    A region of a symbolic capture (``step/symbolic.py``) compiles once for its symbolic input metadata, and serves
    every call whose inputs are instances of it (``conforms``); inputs that are not (a stride the capture did not
    record) get a compile for their own signature, as static regions do."""

    def __init__(self, compile_region: Callable[..., Callable[..., Any]]) -> None:
        self._compile = compile_region
        self.compiled: dict[tuple, Callable[..., Any]] = {}
        self._keys: dict[tuple, tuple] = {}  # (structure, concrete signature) -> the key it runs under
        self.compiles = 0
        self.aten_keys: set[str] = set()  # structures of regions that run as aten (Inductor failed on them)
        self._flat_forms: dict[str, Any] = {}  # structure -> its FlatUpdate, or None
        self._flat_compiled: dict[str, tuple] = {}  # flat key -> (compiled for 1-D inputs, its fakes, fake mode)
        self.seconds = 0.0

    def __len__(self) -> int:
        """How many compiles the regions took (a flat update's one compile serves many regions)."""
        return self.compiles

    def get(self, segment: Segment, inputs: Sequence[Any]) -> tuple[Callable[..., Any], bool]:
        """The compiled region for ``segment`` with these inputs, and whether it was compiled just now."""
        concrete = (segment.key, input_signature(inputs))
        key = self._keys.get(concrete)
        if key is not None:
            return self.compiled[key], False
        compiled_before = len(self.compiled)
        runnable = self._flat(segment, inputs)
        if runnable is not None:
            key = (segment.key, FLAT_SIGNATURE)
            self.compiled.setdefault(key, runnable)
        else:
            from deft_compile.step.symbolic import conforms, is_symbolic

            examples = recorded_inputs(segment)
            if examples is not None and any(is_symbolic(e) for e in examples) and conforms(examples, inputs):
                key = (segment.key, SYMBOLIC_SIGNATURE)
                self.precompile(segment, examples)
            else:
                key = concrete
                if key not in self.compiled:
                    self._compile_now(key, segment, inputs, symbolic=False)
        self._keys[concrete] = key
        return self.compiled[key], len(self.compiled) > compiled_before

    def identity(self, segment: Segment) -> str:
        """What one compile of ``segment`` serves: its optimizer form's flat key for an element-wise update region,
        else its structure (the key a compile is dealt out and recorded by)."""
        flat = self._flat_form(segment)
        return flat.key if flat is not None else segment.key

    def _flat_form(self, segment: Segment) -> Any:
        flat = self._flat_forms.get(segment.key, False)
        if flat is False:
            flat = self._flat_forms[segment.key] = FlatUpdate.of(segment)
        return flat

    def _flat(self, segment: Segment, inputs: Sequence[Any]) -> Callable[..., Any] | None:
        """The region run flattened on the one compile of its optimizer form (``flat_updates``), if it can be."""
        flat = self._flat_form(segment)
        if flat is None or not flat.conforms(inputs):
            return None
        entry = self._flat_compiled.get(flat.key)
        if entry is None:
            fakes, mode = flat.fake_inputs(inputs)
            started = time.perf_counter()
            compiled = self._compile(segment, fakes, symbolic=True, key=flat.key)
            self.seconds += time.perf_counter() - started
            self.compiles += 1
            entry = self._flat_compiled[flat.key] = (compiled, fakes, mode)
        compiled, fakes, mode = entry
        if not flat.admits(fakes, mode, inputs):
            return None
        if isinstance(compiled, fx.GraphModule):  # Inductor failed: the region's aten graph, flattened
            self.aten_keys.add(segment.key)
        return flat_callable(compiled, segment)

    def precompile(self, segment: Segment, examples: Sequence[Any]) -> Callable[..., Any]:
        """Compile a symbolic capture's region for its recorded (symbolic) input metadata, if not yet compiled."""
        key = (segment.key, SYMBOLIC_SIGNATURE)
        compiled = self.compiled.get(key)
        return compiled if compiled is not None else self._compile_now(key, segment, examples, symbolic=True)

    def _compile_now(self, key: tuple, segment: Segment, inputs: Sequence[Any], *, symbolic: bool) -> Callable[..., Any]:
        started = time.perf_counter()
        compiled = self._compile(segment, inputs, symbolic=symbolic)
        self.seconds += time.perf_counter() - started
        self.compiles += 1
        if isinstance(compiled, fx.GraphModule):  # Inductor failed: the region runs its aten graph
            self.aten_keys.add(segment.key)
        self.compiled[key] = compiled
        return compiled


#: the input signature under which a symbolic region's one compile is cached
SYMBOLIC_SIGNATURE = "symbolic"
#: the signature of an update region run flattened on its optimizer form's one compile (``flat_updates``)
FLAT_SIGNATURE = "flat"


def recorded_inputs(segment: Segment) -> list[Any] | None:
    """A region's inputs as the capture recorded them (fake tensors), or None where one lacks that metadata."""
    examples = [node.meta.get("val") for node in segment.module.graph.nodes if node.op == "placeholder"]
    return examples if all(isinstance(value, torch.Tensor) for value in examples) else None
