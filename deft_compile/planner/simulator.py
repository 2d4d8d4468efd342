"""Steady-state timeline simulator for a Plan on a Profile (docs/PLANNER.md §2).

Model, and why it is enough to rank plans:

* One compute stream runs, per step p: the forward layer by layer (input side
  first; before a layer it waits for the items that must land there and runs
  the per-layer updates), the extra forward work (loss), the backward in
  gradient-ready order, then the update phase: wait for ``end-of-backward``
  items, run the synchronous updates, wait for the delayed items of the
  previous step (``before-update-next-step``), run the delayed updates.
* One FIFO stream per link. Collectives of step program p are issued in
  ``order``; an item starts at ``max(its issue time, end of the previous
  item on its link)``. Issue times: ``forward-next`` at the start of the
  forward, ``backward-next`` at the start of the backward, ``backward`` when
  the last of its gradients is ready, ``exposed`` at the end of the backward.
* Per message, the compute thread pays ``Profile.message_cpu_ms`` (launch,
  wait, the bucket's flatten and split ops) where it issues it: forward-next
  launches lengthen the forward, backward ones the backward (and delay the
  launches after them), exposed ones the time before the update.
* Contention (``Profile.contention``, γ): on a CPU host a collective takes
  cycles from the compute running beside it. After the recurrences, the time
  each link's collectives overlap the compute stream's busy spans, per step,
  is added to the step times γ (a first-order correction: what it delays
  is not re-simulated, and the recorded spans do not show it; its share is
  ``Timeline.contention_ms``). γ = 0 leaves the model as it was.
* Period K: an item communicates for gradient steps j with
  ``j % K == period_offset`` only; its parameters update only then. The
  simulation therefore runs whole multiples of lcm(K) steps.

Each stream is a max-plus recurrence, ``end_i = max(ready_i, end_{i-1}) +
cost_i``, which is evaluated as a prefix maximum with numpy
(``end = C + cummax(ready - C_prev)``), so one step costs a handful of vector
operations regardless of the number of items.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from deft_compile.planner.plan import (
    UPDATE_AT_NEXT_STEP,
    UPDATE_AT_STEP,
    WAIT_BEFORE_NEXT_UPDATE,
    WAIT_END_OF_BACKWARD,
    WINDOW_BACKWARD,
    WINDOW_BACKWARD_NEXT,
    WINDOW_EXPOSED,
    WINDOW_FORWARD_NEXT,
    Plan,
    Profile,
    layer_of_point,
    wire_element_bytes,
)

_WINDOW_CODE = {WINDOW_FORWARD_NEXT: 0, WINDOW_BACKWARD_NEXT: 1, WINDOW_BACKWARD: 2, WINDOW_EXPOSED: 3}
_WAIT_END, _WAIT_LAYER, _WAIT_NEXT = 0, 1, 2
_UPD_STEP, _UPD_NEXT, _UPD_LAYER = 0, 1, 2
_MAX_CYCLE = 840  # lcm(1..8): the longest period pattern we simulate in full


@dataclass
class _Model:
    """Plan and profile flattened into arrays (built once per simulate call)."""

    item_ids: np.ndarray
    cost: np.ndarray
    link: np.ndarray
    window: np.ndarray
    period: np.ndarray
    offset: np.ndarray
    wait_kind: np.ndarray
    wait_pos: np.ndarray
    ready_offset: np.ndarray
    link_items: list[np.ndarray]
    layers: np.ndarray
    layer_forward: np.ndarray
    layer_update: np.ndarray
    param_update: np.ndarray
    param_mode: np.ndarray
    param_period: np.ndarray
    param_offset: np.ndarray
    param_backward: np.ndarray
    extra_forward: float
    extra_backward: float
    backward_total: float
    cycle: int
    message_cpu: float = 0.0  # compute-thread ms per collective issued (Profile.message_cpu_ms)
    update_waits_for_all: bool = False  # clipping / loss scaling: no update before every applied gradient arrived
    next_window: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.next_window = self.window <= 1


# Plan option: every update waits for every gradient it applies (global-norm clipping, loss scaling's
# non-finite check), so the synchronous update also waits for the delayed buckets of the previous step.
UPDATE_WAITS_FOR_ALL = "update_waits_for_all"


@dataclass(frozen=True)
class _Times:
    """A profile's times, the part of a simulator model that scales: per-parameter forward, backward and update
    ms, the extra forward and backward ms, the compute thread's ms per message, and per link α and β."""

    forward: np.ndarray
    backward: np.ndarray
    update: np.ndarray
    extra_forward: float
    extra_backward: float
    message_cpu: float
    alpha: np.ndarray
    beta: np.ndarray

    @classmethod
    def of(cls, profile: Profile, compute: float = 1.0, link: float = 1.0, latency: float | None = None) -> "_Times":
        """``profile``'s times, compute scaled by ``compute``, each link's β by ``link`` and α by ``latency``
        (``link`` when None): the same floating-point products ``planner.refine.scaled_profile`` forms."""
        params = profile.params
        latency = link if latency is None else latency
        return cls(
            forward=np.array([p.forward_ms * compute for p in params], dtype=float),
            backward=np.array([p.backward_ms * compute for p in params], dtype=float),
            update=np.array([p.update_ms * compute for p in params], dtype=float),
            extra_forward=float(profile.extra_forward_ms * compute),
            extra_backward=float(profile.extra_backward_ms * compute),
            message_cpu=float(profile.message_cpu_ms * compute),
            alpha=np.array([entry.alpha_ms * latency for entry in profile.links], dtype=float),
            beta=np.array([entry.beta_ms_per_byte * link for entry in profile.links], dtype=float),
        )

    def forward_ms(self) -> float:
        """T_F as ``Profile.forward_ms`` sums it."""
        return math.fsum(self.forward.tolist()) + self.extra_forward

    def backward_ms(self) -> float:
        """T_B as ``Profile.backward_ms`` sums it."""
        return math.fsum(self.backward.tolist()) + self.extra_backward


@dataclass(frozen=True)
class _Structure:
    """What a plan fixes on a profile, whatever its times: per item its bytes, link, window, period, wait and the
    last parameter it carries; per parameter its layer position and update mode."""

    item_ids: np.ndarray
    nbytes: np.ndarray
    last_param: np.ndarray
    link: np.ndarray
    window: np.ndarray
    period: np.ndarray
    offset: np.ndarray
    wait_kind: np.ndarray
    wait_pos: np.ndarray
    layers: np.ndarray
    param_layer_pos: np.ndarray
    param_mode: np.ndarray
    param_update_pos: np.ndarray
    param_period: np.ndarray
    param_offset: np.ndarray
    link_items: list[np.ndarray]
    cycle: int
    update_waits_for_all: bool


def _structure(profile: Profile, plan: Plan) -> _Structure:
    params = profile.params
    n_params = len(params)
    layers = np.array(sorted({p.layer for p in params}), dtype=np.int64)
    layer_pos = {int(layer): i for i, layer in enumerate(layers)}
    param_layer_pos = np.array([layer_pos[p.layer] for p in params], dtype=np.int64)

    items = plan.items
    n_items = len(items)
    nbytes_of = np.empty(n_items)
    last_params = np.empty(n_items, dtype=np.int64)
    link = np.empty(n_items, dtype=np.int64)
    window = np.empty(n_items, dtype=np.int64)
    period = np.empty(n_items, dtype=np.int64)
    offset = np.empty(n_items, dtype=np.int64)
    wait_kind = np.empty(n_items, dtype=np.int64)
    wait_pos = np.zeros(n_items, dtype=np.int64)
    param_mode = np.zeros(n_params, dtype=np.int64)
    param_update_pos = np.full(n_params, -1, dtype=np.int64)
    param_period = np.ones(n_params, dtype=np.int64)
    param_offset = np.zeros(n_params, dtype=np.int64)
    element_bytes = [p.element_bytes for p in params]
    for i, item in enumerate(items):
        nbytes = 0
        last_param = 0
        narrowed = item.narrowed  # the bytes on the wire: a narrowed item's elements at the wire dtype's size
        for s in item.slices:
            nbytes += s.count * (wire_element_bytes(params[s.param].dtype, item.wire_dtype, profile.world_size) if narrowed
                                 else element_bytes[s.param])
            if s.param > last_param:
                last_param = s.param
        nbytes_of[i] = nbytes
        last_params[i] = last_param
        link[i] = item.link
        window[i] = _WINDOW_CODE[item.window]
        period[i] = item.period
        offset[i] = item.period_offset
        layer = layer_of_point(item.wait_at)
        if item.wait_at == WAIT_END_OF_BACKWARD:
            wait_kind[i] = _WAIT_END
        elif item.wait_at == WAIT_BEFORE_NEXT_UPDATE:
            wait_kind[i] = _WAIT_NEXT
        elif layer is not None:
            wait_kind[i] = _WAIT_LAYER
            wait_pos[i] = _layer_position(layers, layer)
        else:
            raise ValueError(f"item {item.id}: unknown wait point {item.wait_at!r}")
        update_layer = layer_of_point(item.update_at)
        for p in {s.param for s in item.slices}:
            param_period[p] = item.period
            param_offset[p] = item.period_offset
            if item.update_at == UPDATE_AT_STEP:
                param_mode[p] = _UPD_STEP
            elif item.update_at == UPDATE_AT_NEXT_STEP:
                param_mode[p] = _UPD_NEXT
            elif update_layer is not None:
                param_mode[p] = _UPD_LAYER
                param_update_pos[p] = max(param_update_pos[p], _layer_position(layers, update_layer))
            else:
                raise ValueError(f"item {item.id}: unknown update point {item.update_at!r}")
    orders = np.array([item.order for item in items], dtype=np.int64)
    link_items = []
    for index in range(len(profile.links)):
        members = np.flatnonzero(link == index)
        link_items.append(members[np.argsort(orders[members], kind="stable")])
    cycle = 1
    for k in set(int(k) for k in period) | set(int(k) for k in param_period):
        cycle = math.lcm(cycle, k)
    if cycle > _MAX_CYCLE:
        raise ValueError(f"period pattern repeats every {cycle} steps; at most {_MAX_CYCLE} supported")
    return _Structure(
        item_ids=np.array([item.id for item in items], dtype=np.int64), nbytes=nbytes_of, last_param=last_params,
        link=link, window=window, period=period, offset=offset, wait_kind=wait_kind, wait_pos=wait_pos,
        layers=layers, param_layer_pos=param_layer_pos, param_mode=param_mode, param_update_pos=param_update_pos,
        param_period=param_period, param_offset=param_offset, link_items=link_items, cycle=cycle,
        update_waits_for_all=bool(plan.options.get(UPDATE_WAITS_FOR_ALL, False)))


def _timed_model(structure: _Structure, times: _Times) -> _Model:
    """The simulator's model: a plan's structure with a profile's times."""
    st = structure
    ready = times.extra_backward + np.cumsum(times.backward)
    cost = times.alpha[st.link] + times.beta[st.link] * st.nbytes
    per_layer = st.param_mode == _UPD_LAYER
    layer_update = np.bincount(st.param_update_pos[per_layer], weights=times.update[per_layer],
                               minlength=len(st.layers)).astype(float)
    layer_forward = np.bincount(st.param_layer_pos, weights=times.forward, minlength=len(st.layers))
    return _Model(
        item_ids=st.item_ids, cost=cost, link=st.link, window=st.window, period=st.period, offset=st.offset,
        wait_kind=st.wait_kind, wait_pos=st.wait_pos, ready_offset=ready[st.last_param], link_items=st.link_items,
        layers=st.layers, layer_forward=layer_forward.astype(float), layer_update=layer_update,
        param_update=times.update, param_mode=st.param_mode, param_period=st.param_period,
        param_offset=st.param_offset, param_backward=times.backward,
        extra_forward=times.extra_forward, extra_backward=times.extra_backward,
        backward_total=times.backward_ms(), cycle=st.cycle, message_cpu=times.message_cpu,
        update_waits_for_all=st.update_waits_for_all)


def _build_model(profile: Profile, plan: Plan) -> _Model:
    return _timed_model(_structure(profile, plan), _Times.of(profile))


def _layer_position(layers: np.ndarray, layer: int) -> int:
    """Position of the first forward layer >= ``layer`` (waiting earlier is harmless)."""
    pos = int(np.searchsorted(layers, layer))
    return min(pos, len(layers) - 1)


def _fifo(ready: np.ndarray, cost: np.ndarray, free_at: float) -> np.ndarray:
    """End times of a FIFO stream: end_i = max(ready_i, end_{i-1}) + cost_i."""
    total = np.cumsum(cost)
    before = total - cost
    return total + np.maximum.accumulate(np.maximum(ready - before, free_at))


@dataclass
class CommEvent:
    """One collective as simulated: item ``item_id`` for gradient step ``step``."""

    item_id: int
    program: int
    step: int
    link: int
    start_ms: float
    end_ms: float


@dataclass
class ComputeEvent:
    """One span on the compute stream (kind: forward, loss, backward, update, wait)."""

    name: str
    kind: str
    program: int
    start_ms: float
    end_ms: float


@dataclass
class _ProgramRecord:
    forward_start: float
    layer_start: np.ndarray
    layer_update: np.ndarray
    backward_start: float
    backward_end: float
    sync_update: tuple[float, float]
    delayed_update: tuple[float, float]
    item_active: np.ndarray
    item_start: np.ndarray
    item_end: np.ndarray


@dataclass
class Timeline:
    """Result of ``simulate``: steady-state averages plus the recorded spans.

    iteration_ms: forward start to next forward start, averaged over the
        measured steps (a whole number of period cycles).
    compute_ms: compute-stream busy time per step (forward, loss, backward,
        updates); ``floor_ms`` is the same from the profile alone.
    exposed_comm_ms: iteration_ms - compute_ms, the time the compute stream
        waited for communication.
    link_busy_ms: per link, all-reduce time per step.
    contention_ms: what ``Profile.contention`` adds per step (included in
        iteration_ms and exposed_comm_ms).
    """

    iteration_ms: float
    compute_ms: float
    floor_ms: float
    exposed_comm_ms: float
    link_busy_ms: list[float]
    forward_starts: list[float]
    measured: tuple[int, int]
    policy: str = ""
    link_names: list[str] = field(default_factory=list)
    contention_ms: float = 0.0
    _model: _Model | None = field(default=None, repr=False)
    _records: list[_ProgramRecord] = field(default_factory=list, repr=False)

    def comm_events(self) -> list[CommEvent]:
        """Every simulated collective, by program then issue order."""
        model = self._model
        if model is None or not self._records:
            return []
        events = []
        for program, record in enumerate(self._records):
            for link_members in model.link_items:
                for i in link_members:
                    if not record.item_active[i]:
                        continue
                    step = program - 1 if model.next_window[i] else program
                    events.append(CommEvent(int(model.item_ids[i]), program, step, int(model.link[i]),
                                            float(record.item_start[i]), float(record.item_end[i])))
        return events

    def compute_events(self) -> list[ComputeEvent]:
        """Compute-stream spans: per-layer updates and forwards, loss, backward per param, updates."""
        model = self._model
        if model is None or not self._records:
            return []
        events: list[ComputeEvent] = []
        backward_offsets = model.extra_backward + np.cumsum(model.param_backward) - model.param_backward
        for program, r in enumerate(self._records):
            for pos, layer in enumerate(model.layers):
                start = float(r.layer_start[pos])
                upd = float(r.layer_update[pos])
                if upd > 0:
                    events.append(ComputeEvent(f"update before layer {layer}", "update", program,
                                               start, start + upd))
                events.append(ComputeEvent(f"forward layer {layer}", "forward", program, start + upd,
                                           start + upd + float(model.layer_forward[pos])))
            forward_end = r.backward_start - model.extra_forward
            if model.extra_forward > 0:
                events.append(ComputeEvent("loss/extra forward", "loss", program, forward_end,
                                           r.backward_start))
            if model.extra_backward > 0:
                events.append(ComputeEvent("extra backward", "backward", program, r.backward_start,
                                           r.backward_start + model.extra_backward))
            for q, duration in enumerate(model.param_backward):
                if duration > 0:
                    start = r.backward_start + float(backward_offsets[q])
                    events.append(ComputeEvent(f"backward p{q}", "backward", program, start,
                                               start + float(duration)))
            for name, (start, end) in (("synchronous update", r.sync_update),
                                       ("delayed update", r.delayed_update)):
                if end > start:
                    events.append(ComputeEvent(name, "update", program, start, end))
        return events

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome trace (``chrome://tracing``/Perfetto): ph "X" spans, µs, pid 0 compute, pid 1 links."""
        trace: list[dict[str, Any]] = [
            {"ph": "M", "pid": 0, "tid": 0, "name": "process_name", "args": {"name": "compute"}},
            {"ph": "M", "pid": 1, "tid": 0, "name": "process_name", "args": {"name": "links"}},
        ]
        for index, name in enumerate(self.link_names):
            trace.append({"ph": "M", "pid": 1, "tid": index, "name": "thread_name",
                          "args": {"name": f"link {index}: {name}"}})
        for ev in self.compute_events():
            trace.append({"name": ev.name, "cat": ev.kind, "ph": "X", "pid": 0, "tid": 0,
                          "ts": ev.start_ms * 1000.0, "dur": (ev.end_ms - ev.start_ms) * 1000.0,
                          "args": {"program": ev.program}})
        for ev in self.comm_events():
            trace.append({"name": f"all_reduce item {ev.item_id}", "cat": "comm", "ph": "X", "pid": 1,
                          "tid": ev.link, "ts": ev.start_ms * 1000.0,
                          "dur": (ev.end_ms - ev.start_ms) * 1000.0,
                          "args": {"program": ev.program, "gradient_step": ev.step}})
        return {"traceEvents": trace, "displayTimeUnit": "ms",
                "otherData": {"policy": self.policy, "iteration_ms": self.iteration_ms}}

    def summary(self) -> dict[str, Any]:
        return {"iteration_ms": self.iteration_ms, "compute_ms": self.compute_ms,
                "floor_ms": self.floor_ms, "exposed_comm_ms": self.exposed_comm_ms,
                "link_busy_ms": list(self.link_busy_ms)}


def compute_floor_ms(profile: Profile, plan: Plan) -> float:
    """Pure compute per step: T_F + T_B + updates (amortised over each param's period)."""
    periods = {p: k for p, (_, k, _) in plan.param_schedule().items()}
    updates = math.fsum(param.update_ms / periods.get(i, 1) for i, param in enumerate(profile.params))
    return profile.forward_ms + profile.backward_ms + updates


def simulate(
    profile: Profile,
    plan: Plan,
    iterations: int | None = None,
    *,
    warmup: int | None = None,
    record: bool = True,
    check: bool = True,
) -> Timeline:
    """Simulate ``warmup + iterations`` steps and report the steady state.

    Args:
        iterations: measured steps; rounded up to a whole number of period
            cycles (lcm of all K). Default: two cycles, at least 2 steps.
        warmup: steps simulated before measuring (default 2 + cycle) so that
            cross-step effects (per-layer waits, delayed items) are in.
        record: keep per-step spans for ``comm_events``/``to_chrome_trace``.
        check: run ``plan.validate(profile)`` first.
    """
    if check:
        plan.validate(profile)
    model = _build_model(profile, plan)
    timeline = _run(model, len(profile.links), iterations, warmup, record, profile.contention)
    timeline.floor_ms = (profile.forward_ms + profile.backward_ms
                         + math.fsum(model.param_update / model.param_period))
    timeline.policy = plan.policy
    timeline.link_names = [link.name for link in profile.links]
    return timeline


class ScaledSimulation:
    """One plan on one profile, simulated with the compute and link times scaled (what the closed loop's
    refinement asks hundreds of times per plan): the plan's structure is flattened once, and each call rebuilds
    only the times. ``run(compute, link, latency, contention)`` equals ``simulate(record=False, check=False)`` of
    ``planner.refine.scaled_profile(profile, compute, link, contention, latency)``, to the bit."""

    def __init__(self, profile: Profile, plan: Plan) -> None:
        self._profile = profile
        self._structure = _structure(profile, plan)
        self._policy = plan.policy

    def run(self, compute: float = 1.0, link: float = 1.0, latency: float | None = None,
            contention: float | None = None) -> Timeline:
        times = _Times.of(self._profile, compute, link, latency)
        model = _timed_model(self._structure, times)
        gamma = self._profile.contention if contention is None else contention
        timeline = _run(model, len(self._profile.links), None, None, False, gamma)
        timeline.floor_ms = (times.forward_ms() + times.backward_ms()
                             + math.fsum(model.param_update / model.param_period))
        timeline.policy = self._policy
        timeline.link_names = [entry.name for entry in self._profile.links]
        return timeline


def _overlap_ms(compute: list[tuple[float, float]], comm: list[tuple[np.ndarray, np.ndarray]],
                window: tuple[float, float]) -> float:
    """Total time within ``window`` that the communication intervals (start and end arrays, any order, may
    overlap each other: several links) overlap the compute spans (in time order, disjoint)."""
    spans = np.array([s for s in compute if s[1] > s[0]], dtype=float).reshape(-1, 2)
    if not len(spans) or not comm:
        return 0.0
    starts, ends = spans[:, 0], spans[:, 1]
    before = np.concatenate([[0.0], np.cumsum(ends - starts)])  # compute time before each span starts

    def compute_before(t: np.ndarray) -> np.ndarray:
        k = np.searchsorted(starts, t, side="right") - 1
        inside = np.clip(t - starts[np.maximum(k, 0)], 0.0, (ends - starts)[np.maximum(k, 0)])
        return np.where(k >= 0, before[np.maximum(k, 0)] + inside, 0.0)

    lo, hi = window
    a = np.clip(np.concatenate([s for s, _ in comm]), lo, hi)
    b = np.clip(np.concatenate([e for _, e in comm]), lo, hi)
    return float(np.sum(compute_before(b) - compute_before(a)))


def _run(model: _Model, n_links: int, iterations: int | None, warmup: int | None,
         record: bool, contention: float = 0.0) -> Timeline:
    """The step loop of ``simulate`` on a prepared model."""
    cycle = model.cycle
    measure = max(2, iterations or 2 * cycle)
    measure = -(-measure // cycle) * cycle
    warmup = 2 + cycle if warmup is None else warmup
    total = warmup + measure
    n_layers = len(model.layers)
    next_window = model.next_window
    wait_layer = model.wait_kind == _WAIT_LAYER
    forward_plain = model.layer_forward
    forward_with_updates = model.layer_forward + model.layer_update
    has_layer_waits = bool(wait_layer.any())
    forward_before_plain = np.cumsum(forward_plain) - forward_plain

    link_free = np.zeros(n_links)
    ends_prev = np.full(len(model.cost), -np.inf)
    active_prev = np.zeros(len(model.cost), dtype=bool)
    forward_starts = [0.0]
    busy: list[float] = []
    link_busy = np.zeros(n_links)
    records: list[_ProgramRecord] = []
    now = 0.0
    message_cpu = model.message_cpu
    compute_spans: list[tuple[float, float]] = []  # the compute stream's busy spans (contention)
    comm_spans: list[tuple[np.ndarray, np.ndarray]] = []
    for program in range(total):
        forward_start = now
        grad_step = np.where(next_window, program - 1, program)
        active = (grad_step >= 0) & ((grad_step - model.offset) % model.period == 0)
        # the compute thread's time for the messages this program issues, per window (Profile.message_cpu_ms)
        launches = message_cpu * np.bincount(model.window[active], minlength=4) if message_cpu else np.zeros(4)
        # -- forward, with per-layer waits for the previous step's items ------
        if program >= 1 and has_layer_waits:
            durations = forward_with_updates
            waits = np.full(n_layers, -np.inf)
            mask = wait_layer & active_prev
            if mask.any():
                np.maximum.at(waits, model.wait_pos[mask], ends_prev[mask])
            before = np.cumsum(durations) - durations
            layer_start = before + np.maximum.accumulate(np.maximum(waits - before, forward_start))
        else:
            durations = forward_with_updates if program >= 1 else forward_plain
            before = np.cumsum(durations) - durations if program >= 1 else forward_before_plain
            layer_start = before + forward_start
        forward_end = float(layer_start[-1] + durations[-1]) + launches[0]
        backward_start = forward_end + model.extra_forward
        backward_end = backward_start + launches[1] + model.backward_total + launches[2]
        if contention:  # the forward's layers (split where a layer waits), then loss and backward
            layer_end = layer_start + durations
            gap = np.flatnonzero(layer_start[1:] > layer_end[:-1] + 1e-12) + 1
            first = np.concatenate([[0], gap])
            last = np.concatenate([gap - 1, [n_layers - 1]])
            compute_spans += list(zip(layer_start[first].tolist(), layer_end[last].tolist()))
            compute_spans[-1] = (compute_spans[-1][0], backward_end)
        # -- collectives issued by this program ---------------------------------
        ready = backward_start + launches[1] + model.ready_offset
        if message_cpu:  # each backward launch delays the compute after it, and so the later launches
            in_backward = active & (model.window == 2)
            order = np.argsort(np.where(in_backward, model.ready_offset, np.inf), kind="stable")
            launched = np.empty(len(order))
            launched[order] = np.arange(1, len(order) + 1)
            ready = ready + np.where(in_backward, launched * message_cpu, 0.0)
        issue = np.choose(model.window, [forward_start, backward_start, ready, backward_end])
        starts, ends = _run_links(model, active, issue, link_free, link_busy if program >= warmup else None,
                                  comm_spans if contention else None)
        # -- update phase ---------------------------------------------------------
        sync_ms, sync_span, delayed_ms, delayed_span = _update_phase(model, program, backward_end + launches[3],
                                                                     active, ends, active_prev, ends_prev)
        now = delayed_span[1]
        if contention:
            compute_spans += [sync_span, delayed_span]
        busy.append(float(durations.sum()) + model.extra_forward + model.backward_total
                    + sync_ms + delayed_ms + float(launches.sum()))
        forward_starts.append(now)
        if record:
            records.append(_ProgramRecord(
                forward_start=forward_start, layer_start=layer_start,
                layer_update=durations - forward_plain, backward_start=backward_start,
                backward_end=backward_end, sync_update=sync_span, delayed_update=delayed_span,
                item_active=active, item_start=starts, item_end=ends))
        ends_prev, active_prev = ends, active

    iteration = (forward_starts[total] - forward_starts[warmup]) / measure
    compute = math.fsum(busy[warmup:]) / measure
    contention_ms = 0.0
    if contention:
        window = (forward_starts[warmup], forward_starts[total])
        contention_ms = contention * _overlap_ms(compute_spans, comm_spans, window) / measure
        iteration += contention_ms
    return Timeline(
        iteration_ms=iteration, compute_ms=compute, floor_ms=math.nan, contention_ms=contention_ms,
        exposed_comm_ms=max(0.0, iteration - compute),
        link_busy_ms=[float(x) / measure for x in link_busy], forward_starts=forward_starts,
        measured=(warmup, total), _model=model if record else None, _records=records)


def _run_links(model: _Model, active: np.ndarray, issue: np.ndarray, link_free: np.ndarray,
               link_busy: np.ndarray | None, comm_spans: list | None) -> tuple[np.ndarray, np.ndarray]:
    """One program's collectives, FIFO per link from ``link_free`` (updated): each item's (start, end), NaN and
    -inf for items this program does not run. Adds each link's busy time to ``link_busy`` and the items' spans to
    ``comm_spans`` where given."""
    starts = np.full(len(model.cost), np.nan)
    ends = np.full(len(model.cost), -np.inf)
    for index, members in enumerate(model.link_items):
        if len(members) == 0:
            continue
        on = active[members]
        cost = np.where(on, model.cost[members], 0.0)
        ready = np.where(on, issue[members], -np.inf)
        link_end = _fifo(ready, cost, link_free[index])
        link_free[index] = max(link_free[index], float(link_end[-1]))
        ends[members] = np.where(on, link_end, -np.inf)
        starts[members] = link_end - cost
        if comm_spans is not None and on.any():
            comm_spans.append(((link_end - cost)[on], link_end[on]))
        if link_busy is not None:
            link_busy[index] += float(cost.sum())
    return starts, ends


def _update_phase(model: _Model, program: int, now: float, active: np.ndarray, ends: np.ndarray,
                  active_prev: np.ndarray, ends_prev: np.ndarray) -> tuple[float, tuple, float, tuple]:
    """The update phase of ``program`` from ``now`` (the end of its backward): wait for end-of-backward items, run
    the synchronous updates, wait for the delayed items of the previous step, run the delayed updates. Returns
    (synchronous ms, its (start, end), delayed ms, its (start, end))."""
    next_window = model.next_window
    wait_next = model.wait_kind == _WAIT_NEXT
    mask = (model.wait_kind == _WAIT_END) & active
    if mask.any():
        now = max(now, float(ends[mask].max()))
    if model.update_waits_for_all and program >= 1:  # the synchronous update waits for the delayed ones too
        waited = np.concatenate([ends_prev[wait_next & active_prev & ~next_window],
                                 ends[wait_next & active & next_window]])
        if waited.size:
            now = max(now, float(waited.max()))
    param_steps = program - model.param_offset
    sync_params = model.param_mode == _UPD_STEP
    sync_ms = float(model.param_update[sync_params & (param_steps % model.param_period == 0)].sum())
    sync_span = (now, now + sync_ms)
    now += sync_ms
    delayed_ms = 0.0
    if program >= 1:
        waited = np.concatenate([ends_prev[wait_next & active_prev & ~next_window],
                                 ends[wait_next & active & next_window]])
        if waited.size:
            now = max(now, float(waited.max()))
        prev_steps = program - 1 - model.param_offset
        delayed_ms = float(model.param_update[(model.param_mode == _UPD_NEXT)
                                              & (prev_steps % model.param_period == 0)].sum())
    return sync_ms, sync_span, delayed_ms, (now, now + delayed_ms)


class BucketScheduleEvaluator:
    """Fast re-simulation of one set of items under different schedules.

    Why: DeFT's solver scores many candidate schedules of the *same* items
    (which buckets are delayed, in which window, with which period). Building
    a Plan and a simulator model per candidate costs more than simulating;
    this builds the model once and swaps the schedule arrays. Only schedules
    without per-layer waits (end-of-backward or before-next-update) are
    supported; ``group`` maps each item to the unit that shares one schedule
    (a bucket whose shares sit on several links).
    """

    def __init__(self, profile: Profile, plan: Plan, group: Sequence[int]) -> None:
        self._base = _build_model(profile, plan)
        self._n_links = len(profile.links)
        self._group = np.asarray(group, dtype=np.int64)
        param_item = np.zeros(len(profile.params), dtype=np.int64)
        for i, item in enumerate(plan.items):
            for p in item.params():
                param_item[p] = i
        self._param_group = self._group[param_item]
        self._link = self._base.link

    def iteration_ms(self, window: np.ndarray, delay: np.ndarray, period: np.ndarray,
                     offset: np.ndarray, rank: np.ndarray, iterations: int | None = None,
                     warmup: int | None = None) -> float:
        """Iteration time when group g gets window/delay/period/offset[g]; items issue by rank.

        Without ``iterations``/``warmup`` it measures one period cycle after
        1 + cycle warm-up steps (enough to rank candidates); pass both to get
        exactly what ``simulate`` would report with the same settings.
        """
        g = self._group
        model = copy.copy(self._base)
        model.window = np.asarray(window)[g]
        model.next_window = model.window <= 1
        model.period = np.asarray(period)[g]
        model.offset = np.asarray(offset)[g]
        model.wait_kind = np.where(np.asarray(delay)[g] == 1, _WAIT_NEXT, _WAIT_END)
        pg = self._param_group
        model.param_mode = np.where(np.asarray(delay)[pg] == 1, _UPD_NEXT, _UPD_STEP)
        model.param_period = np.asarray(period)[pg]
        model.param_offset = np.asarray(offset)[pg]
        rank = np.asarray(rank)
        model.link_items = [members[np.argsort(rank[members], kind="stable")]
                            for members in (np.flatnonzero(self._link == i)
                                            for i in range(self._n_links))]
        cycle = 1
        for k in np.unique(period):
            cycle = math.lcm(cycle, int(k))
        model.cycle = cycle
        # a search only ranks schedules: one cycle of warm-up and one measured cycle
        measure = cycle if iterations is None else iterations
        warmup = 1 + cycle if warmup is None else warmup
        return _run(model, self._n_links, measure, warmup, record=False).iteration_ms


def coverage_rate(profile: Profile, plan: Plan) -> float:
    """Communication per step on the busiest link over the compute it may hide behind.

    CR = max_l sum_{items on l} cost / K  /  (T_F + T_B). Above 1, no schedule
    of this plan's collectives can hide them all.
    """
    load = [0.0] * len(profile.links)
    for item in plan.items:
        load[item.link] += profile.links[item.link].cost(item.nbytes(profile)) / item.period
    capacity = profile.forward_ms + profile.backward_ms
    return max(load) / capacity if capacity > 0 else math.inf
