"""The planner's data model: what was measured (Profile) and what to do (Plan).

Why plain dataclasses with an exact JSON round trip: a Plan is computed from
rank-agreed numbers, hashed, compared across ranks and handed to the graph
passes; it must survive serialisation bit-for-bit and mean the same thing on
every machine. Nothing here imports torch.

Conventions (shared by the simulator, the solvers and the graph passes):

* Parameters are identified by their index into ``Profile.params``, which lists
  them in gradient-ready order: index 0 is the first gradient ready in backward
  (output side). ``ParamProfile.layer`` orders the forward pass: layer 0 is the
  input side and runs first.
* A ``CommItem`` is one all-reduce. It carries element ranges
  (``ParamSlice``) of one or more parameters, flattened in the order listed, on
  exactly one link (process group). A bucket split over two links is two items
  with the same ``bucket``.
* ``order`` is the issue order of the collectives inside one compiled step. Per
  link the collectives run FIFO in that order, so ``order`` must agree with the
  program position of each window: all ``forward-next`` items (issued at the
  start of the forward), then ``backward-next`` (start of backward), then
  ``backward`` (issued once the item's gradients are ready, never before an
  item of lower order), then ``exposed`` (after the whole backward).
* ``wire_dtype`` is the dtype an item crosses the link in: ``"float32"`` (the
  default) sends the gradients in their own dtype, as DDP does; ``"bfloat16"``
  or ``"float16"`` narrows float32 (or float64) gradients for the collective, as
  DDP's ``bf16_compress_hook`` / ``fp16_compress_hook`` do. Byte counts
  (``CommItem.nbytes``, the simulator's costs) are the bytes on the wire.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from deft_compile.planner.bucketing import (
    DDP_BUCKET_CAP_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    assign_buckets,
)

# --- vocabulary -------------------------------------------------------------

WINDOW_FORWARD_NEXT = "forward-next"
WINDOW_BACKWARD_NEXT = "backward-next"
WINDOW_BACKWARD = "backward"
WINDOW_EXPOSED = "exposed"
#: Windows in the order their issue points appear inside one step program.
WINDOWS: tuple[str, ...] = (
    WINDOW_FORWARD_NEXT,
    WINDOW_BACKWARD_NEXT,
    WINDOW_BACKWARD,
    WINDOW_EXPOSED,
)
#: Windows whose item carries the gradient of the *previous* step.
NEXT_STEP_WINDOWS: frozenset[str] = frozenset({WINDOW_FORWARD_NEXT, WINDOW_BACKWARD_NEXT})

WAIT_END_OF_BACKWARD = "end-of-backward"
WAIT_BEFORE_NEXT_UPDATE = "before-update-next-step"
BEFORE_FORWARD_PREFIX = "before-forward-of-layer:"

UPDATE_AT_STEP = "step"
UPDATE_AT_NEXT_STEP = "next-step"

DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "double": 8, "float32": 4, "float": 4, "float16": 2, "half": 2,
    "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "complex64": 8,
    "complex128": 16, "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1,
}


#: the dtypes a communication item may cross the link in; the first, full precision, is the default. ``"int8"`` is
#: the 8-bit wire: blocks of ``INT8_BLOCK`` elements, each sent as 8-bit integers with one float32 scale, gathered
#: from every rank and summed locally (``passes/schedule.py``)
WIRE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16", "int8")
#: the wire dtypes ``DeftConfig.wire_dtypes`` allows by default: full precision and the two 16-bit ones
DEFAULT_WIRE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
WIRE_FULL = "float32"
WIRE_INT8 = "int8"
#: elements per block of the 8-bit wire (one float32 scale each)
INT8_BLOCK = 256
#: gradient dtypes a narrower wire may narrow (floating and wider than 16 bits)
NARROWABLE_DTYPES: frozenset[str] = frozenset({"float32", "float", "float64", "double"})


def dtype_bytes(dtype: str) -> int:
    """Element size of a dtype given as ``"float32"`` or ``"torch.float32"``."""
    key = dtype[len("torch."):] if dtype.startswith("torch.") else dtype
    try:
        return DTYPE_BYTES[key]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


def may_narrow(dtype: str) -> bool:
    """Whether gradients of ``dtype`` may cross the link in a 16-bit wire dtype (floating, wider than 16 bits)."""
    return (dtype[len("torch."):] if dtype.startswith("torch.") else dtype) in NARROWABLE_DTYPES


def wire_element_bytes(dtype: str, wire_dtype: str, world_size: int) -> float:
    """Bytes per element on the link of a gradient of ``dtype`` sent as ``wire_dtype``, in the all-reduce bytes the
    link's cost (``LinkCost``, fitted on all-reduces) is in: the wire's where it narrows the gradient, the gradient's
    own otherwise (full precision, or a dtype that does not narrow). The 8-bit wire is an all-gather: each rank
    receives the other ranks' bytes, (W − 1)·n, where a ring all-reduce of n bytes moves 2(W − 1)/W·n, so its byte
    and its scale per ``INT8_BLOCK`` elements count ``W / 2`` times (at 2 ranks, as an all-reduce of them)."""
    if wire_dtype != WIRE_FULL and may_narrow(dtype):
        if wire_dtype == WIRE_INT8:
            return (1.0 + dtype_bytes("float32") / INT8_BLOCK) * max(1.0, world_size / 2.0)
        return dtype_bytes(wire_dtype)
    return dtype_bytes(dtype)


def check_wire_dtype(wire_dtype: str) -> str:
    """``wire_dtype`` if it is one of ``WIRE_DTYPES``; ``ValueError`` otherwise."""
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype {wire_dtype!r}; use one of {', '.join(map(repr, WIRE_DTYPES))}")
    return wire_dtype


def before_forward_of_layer(layer: int) -> str:
    """Wait/update point just before the forward of ``layer`` in the next step."""
    return f"{BEFORE_FORWARD_PREFIX}{int(layer)}"


def layer_of_point(point: str) -> int | None:
    """The layer of a ``before-forward-of-layer:L`` point, else None."""
    if point.startswith(BEFORE_FORWARD_PREFIX):
        return int(point[len(BEFORE_FORWARD_PREFIX):])
    return None


def _canonical(value: Any) -> Any:
    """JSON-compatible copy with tuples as lists; rejects NaN/inf and odd types."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"non-finite float {value!r} cannot go into a plan")
        return value
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalar
        return _canonical(value.item())
    raise TypeError(f"cannot store {type(value).__name__} in a plan")


def _hashable_json(value: Any) -> Any:
    """Floats as their exact hex form so the hash never depends on float printing."""
    if isinstance(value, float):
        return {"__float__": value.hex()}
    if isinstance(value, dict):
        return {k: _hashable_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_hashable_json(v) for v in value]
    return value


# --- profile ----------------------------------------------------------------


@dataclass(frozen=True)
class LinkCost:
    """All-reduce cost on one link: ``alpha_ms + beta_ms_per_byte * bytes``.

    The ring (or hierarchical) factor of the collective is folded into beta,
    so the cost is that of the whole all-reduce of a buffer of ``bytes``.
    """

    name: str
    alpha_ms: float
    beta_ms_per_byte: float

    def cost(self, nbytes: float) -> float:
        """Milliseconds to all-reduce ``nbytes`` bytes on this link."""
        return self.alpha_ms + self.beta_ms_per_byte * nbytes

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "alpha_ms": float(self.alpha_ms),
                "beta_ms_per_byte": float(self.beta_ms_per_byte)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LinkCost":
        return cls(str(data["name"]), float(data["alpha_ms"]), float(data["beta_ms_per_byte"]))


@dataclass(frozen=True)
class ParamProfile:
    """One parameter's size and the compute attributed to it.

    ``forward_ms``/``backward_ms`` are the compute of the ops that belong to
    this parameter's layer (put the whole layer's time on one of its
    parameters or split it; only sums per layer and the backward order
    matter). ``update_ms`` is its optimizer update. ``bucket_key`` separates
    tensors DDP never fuses (dtype/device); None means "group by dtype".
    """

    name: str
    numel: int
    dtype: str = "float32"
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    update_ms: float = 0.0
    layer: int = 0
    bucket_key: str | None = None

    @functools.cached_property
    def element_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @functools.cached_property
    def nbytes(self) -> int:
        return self.numel * self.element_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "numel": int(self.numel), "dtype": self.dtype,
                "forward_ms": float(self.forward_ms), "backward_ms": float(self.backward_ms),
                "update_ms": float(self.update_ms), "layer": int(self.layer),
                "bucket_key": self.bucket_key}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ParamProfile":
        return cls(name=str(data["name"]), numel=int(data["numel"]), dtype=str(data["dtype"]),
                   forward_ms=float(data["forward_ms"]), backward_ms=float(data["backward_ms"]),
                   update_ms=float(data["update_ms"]), layer=int(data["layer"]),
                   bucket_key=data.get("bucket_key"))


@dataclass
class Profile:
    """Everything the solvers need: parameters in ready order, links, extra compute.

    ``extra_forward_ms`` runs at the end of the forward (loss, a tied LM head);
    ``extra_backward_ms`` at the start of the backward, before any gradient is
    ready (the loss and head backward). Link 0 is the default process group.
    ``message_cpu_ms`` is the compute thread's own time per collective (launching
    it, waiting for it, the bucket's flatten and split ops; not the bytes, not the
    link): plans that send many small messages pay it on the critical path.
    ``contention`` is the share of a collective's time that slows compute running
    beside it (0: none, as on an accelerator; on a CPU host gloo's copies,
    reductions and the loopback's kernel work take cores the compute needs, and
    hiding communication behind compute is not free). The simulator adds
    ``contention x`` the time communication overlaps compute to the step.
    """

    params: list[ParamProfile]
    links: list[LinkCost]
    world_size: int = 1
    extra_forward_ms: float = 0.0
    extra_backward_ms: float = 0.0
    name: str = ""
    message_cpu_ms: float = 0.0
    contention: float = 0.0

    def __post_init__(self) -> None:
        self.params = list(self.params)
        self.links = list(self.links)
        if not self.params:
            raise ValueError("a profile needs at least one parameter")
        if not self.links:
            raise ValueError("a profile needs at least one link")
        for index, param in enumerate(self.params):
            if param.numel <= 0:
                raise ValueError(f"param {index} ({param.name}) has numel {param.numel}")
            dtype_bytes(param.dtype)
            if min(param.forward_ms, param.backward_ms, param.update_ms) < 0:
                raise ValueError(f"param {index} ({param.name}) has a negative time")
        for link in self.links:
            if link.alpha_ms < 0 or link.beta_ms_per_byte < 0:
                raise ValueError(f"link {link.name} has a negative cost")
        if not self.message_cpu_ms >= 0:
            raise ValueError(f"message_cpu_ms must be >= 0, got {self.message_cpu_ms}")
        if not 0.0 <= self.contention <= 1.0:
            raise ValueError(f"contention must be in [0, 1], got {self.contention}")

    # -- totals ----------------------------------------------------------------
    @property
    def forward_ms(self) -> float:
        """T_F: merged forward compute, including the extra forward work."""
        return math.fsum(p.forward_ms for p in self.params) + self.extra_forward_ms

    @property
    def backward_ms(self) -> float:
        """T_B: merged backward compute, including the extra backward work."""
        return math.fsum(p.backward_ms for p in self.params) + self.extra_backward_ms

    @property
    def update_ms(self) -> float:
        return math.fsum(p.update_ms for p in self.params)

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def bucket_keys(self) -> list[str]:
        return [p.bucket_key if p.bucket_key is not None else p.dtype for p in self.params]

    def buckets(
        self,
        first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES,
        bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES,
    ) -> list[list[int]]:
        """DDP's buckets as lists of param indices, bucket 0 ready first."""
        return assign_buckets(
            [p.nbytes for p in self.params], self.bucket_keys(),
            first_bucket_bytes=first_bucket_bytes, bucket_cap_bytes=bucket_cap_bytes,
        )

    # -- serialisation ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "world_size": int(self.world_size),
                "extra_forward_ms": float(self.extra_forward_ms),
                "extra_backward_ms": float(self.extra_backward_ms),
                "message_cpu_ms": float(self.message_cpu_ms),
                "contention": float(self.contention),
                "links": [link.to_dict() for link in self.links],
                "params": [p.to_dict() for p in self.params]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Profile":
        return cls(params=[ParamProfile.from_dict(p) for p in data["params"]],
                   links=[LinkCost.from_dict(link) for link in data["links"]],
                   world_size=int(data["world_size"]),
                   extra_forward_ms=float(data["extra_forward_ms"]),
                   extra_backward_ms=float(data["extra_backward_ms"]),
                   name=str(data.get("name", "")),
                   message_cpu_ms=float(data.get("message_cpu_ms", 0.0)),
                   contention=float(data.get("contention", 0.0)))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        return cls.from_dict(json.loads(text))


# --- plan -------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class ParamSlice:
    """Elements ``[offset, offset + count)`` of the flattened parameter ``param``."""

    param: int
    offset: int
    count: int

    def to_list(self) -> list[int]:
        return [int(self.param), int(self.offset), int(self.count)]


@dataclass(frozen=True)
class CommItem:
    """One all-reduce of the plan and where the step waits for it and applies it.

    Fields:
        id: unique id inside the plan (stable name for graph nodes).
        slices: element ranges it carries, flattened in this order.
        link: index into ``Profile.links`` (the process group to use).
        window: when it is issued (see module docstring).
        delay: 0 = gradient of step t applied at step t; 1 = applied at the
            update of step t+1 (staleness 1).
        period: K; it communicates (and its params update) every K steps,
            accumulating the local gradient in between.
        period_offset: it communicates at steps t with t % K == period_offset.
        order: issue order inside one step program (FIFO per link).
        wait_at: ``end-of-backward``, ``before-forward-of-layer:L`` (in step
            t+1) or ``before-update-next-step``.
        update_at: ``step`` (the optimizer step of step t),
            ``before-forward-of-layer:L`` (per layer in step t+1) or
            ``next-step`` (the update of step t+1). A parameter split over
            several items is updated once, after the last of its items.
        bucket: the DDP bucket/block group this item came from (-1 if none).
        wire_dtype: the dtype it crosses the link in: ``"float32"`` sends the
            gradients as they are; ``"bfloat16"``/``"float16"`` narrows float32
            or float64 gradients (divided by the world size, cast, summed,
            cast back), as DDP's compression hooks do. Only written to the
            JSON when narrowed, so a full-precision plan's JSON and hash are
            those of a plan without the field.
    """

    id: int
    slices: tuple[ParamSlice, ...]
    link: int = 0
    window: str = WINDOW_BACKWARD
    delay: int = 0
    period: int = 1
    period_offset: int = 0
    order: int = 0
    wait_at: str = WAIT_END_OF_BACKWARD
    update_at: str = UPDATE_AT_STEP
    bucket: int = -1
    wire_dtype: str = WIRE_FULL

    def __post_init__(self) -> None:
        slices = self.slices
        if type(slices) is not tuple or not all(type(s) is ParamSlice for s in slices):
            object.__setattr__(self, "slices", tuple(
                s if isinstance(s, ParamSlice) else ParamSlice(*s) for s in slices))

    @property
    def numel(self) -> int:
        return sum(s.count for s in self.slices)

    def nbytes(self, profile: Profile) -> int:
        """Bytes it sends over the link: its elements at the wire dtype's size."""
        return int(sum(s.count * wire_element_bytes(profile.params[s.param].dtype, self.wire_dtype, profile.world_size)
                       for s in self.slices))

    @property
    def narrowed(self) -> bool:
        """Whether it crosses the link in a narrower wire dtype (16 or 8 bits)."""
        return self.wire_dtype != WIRE_FULL

    def params(self) -> list[int]:
        """Distinct parameter indices, in slice order."""
        seen: dict[int, None] = {}
        for s in self.slices:
            seen.setdefault(s.param, None)
        return list(seen)

    @property
    def wait_layer(self) -> int | None:
        return layer_of_point(self.wait_at)

    def to_dict(self) -> dict[str, Any]:
        data = {"id": int(self.id), "slices": [s.to_list() for s in self.slices],
                "link": int(self.link), "window": self.window, "delay": int(self.delay),
                "period": int(self.period), "period_offset": int(self.period_offset),
                "order": int(self.order), "wait_at": self.wait_at,
                "update_at": self.update_at, "bucket": int(self.bucket)}
        if self.narrowed:  # full precision is the absence of the key: such plans keep their JSON and hash
            data["wire_dtype"] = self.wire_dtype
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CommItem":
        return cls(id=int(data["id"]), slices=tuple(ParamSlice(*map(int, s)) for s in data["slices"]),
                   link=int(data["link"]), window=str(data["window"]), delay=int(data["delay"]),
                   period=int(data["period"]), period_offset=int(data["period_offset"]),
                   order=int(data["order"]), wait_at=str(data["wait_at"]),
                   update_at=str(data["update_at"]), bucket=int(data["bucket"]),
                   wire_dtype=str(data.get("wire_dtype", WIRE_FULL)))


@dataclass
class Plan:
    """A policy's decision: the collectives of one step, in issue order.

    ``options`` are the solver options used (after tuning), ``metadata`` holds
    solver diagnostics (search results, coverage rate); neither changes what
    the passes do. ``predicted_iteration_ms`` is the simulator's estimate.
    Only ``policy``, ``items`` and ``options`` enter ``hash()``. A plan is a value: nothing changes its items or
    options after construction (``dataclasses.replace`` makes a new one), so ``hash()`` is computed once; the
    running step asks for it on every call.
    """

    policy: str
    items: list[CommItem]
    options: dict[str, Any] = field(default_factory=dict)
    predicted_iteration_ms: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.items = sorted(self.items, key=lambda item: item.order)
        self.options = _canonical(dict(self.options))
        self.metadata = _canonical(dict(self.metadata))
        if self.predicted_iteration_ms is not None:
            self.predicted_iteration_ms = float(self.predicted_iteration_ms)

    # -- serialisation ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "items": [item.to_dict() for item in self.items],
                "options": self.options, "predicted_iteration_ms": self.predicted_iteration_ms,
                "metadata": self.metadata}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        return cls(policy=str(data["policy"]),
                   items=[CommItem.from_dict(item) for item in data["items"]],
                   options=dict(data.get("options", {})),
                   predicted_iteration_ms=data.get("predicted_iteration_ms"),
                   metadata=dict(data.get("metadata", {})))

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    def hash(self) -> str:
        """sha256 of the canonical decision (policy, items, options), hex.

        Sorted keys, no whitespace, floats as ``float.hex`` so two processes
        on two machines get the same digest for the same plan.
        """
        # the cache is checked against the objects it was computed from: a plan rebuilt field by field, or
        # given a new item list or options, is hashed anew
        identity = (self.policy, id(self.items), len(self.items), id(self.options), len(self.options))
        cached = self.__dict__.get("_hash_cache")
        if cached is not None and cached[0] == identity:
            return cached[1]
        decision = {"policy": self.policy, "items": [item.to_dict() for item in self.items],
                    "options": self.options}
        text = json.dumps(_hashable_json(decision), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=True)
        digest = hashlib.sha256(text.encode("ascii")).hexdigest()
        self.__dict__["_hash_cache"] = (identity, digest)
        return digest

    # -- queries for the passes ------------------------------------------------------
    def items_on_link(self, link: int) -> list[CommItem]:
        return [item for item in self.items if item.link == link]

    def items_of_param(self) -> dict[int, list[CommItem]]:
        """Param index -> the items that carry some of its elements, in order."""
        result: dict[int, list[CommItem]] = {}
        for item in self.items:
            for param in item.params():
                result.setdefault(param, []).append(item)
        return result

    def param_schedule(self) -> dict[int, tuple[int, int, int]]:
        """Param index -> (delay, period, period_offset), uniform per param by validation."""
        return {param: (items[0].delay, items[0].period, items[0].period_offset)
                for param, items in self.items_of_param().items()}

    def communication(self) -> list[tuple[tuple[ParamSlice, ...], int]]:
        """Which elements go over which link, in issue order: (slices, link) per collective (the wire dtype
        is each item's ``wire_dtype``)."""
        return [(item.slices, item.link) for item in self.items]

    # -- checks ------------------------------------------------------------------------
    def validate(self, profile: Profile) -> None:
        """Raise ValueError unless the plan is executable and loses no gradient.

        Checks: unique ids; order is 0..n-1 and agrees with the windows'
        program positions; links, windows, wait/update points are known and
        consistent with the delay; each item is non-empty and single-dtype;
        its wire dtype is known and narrows only float32/float64 gradients;
        every element of every parameter is carried by exactly one item
        (once per update); all items of a parameter share delay, period and
        offset; per-layer waits happen no later than the first forward use.
        """
        n_params = len(profile.params)
        ids = [item.id for item in self.items]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate item ids")
        if sorted(item.order for item in self.items) != list(range(len(self.items))):
            raise ValueError("item orders must be exactly 0..n-1")
        rank = {w: i for i, w in enumerate(WINDOWS)}
        last_rank = -1
        for item in self.items:  # sorted by order
            if item.window not in rank:
                raise ValueError(f"item {item.id}: unknown window {item.window!r}")
            if rank[item.window] < last_rank:
                raise ValueError(f"item {item.id}: window {item.window} issued after a later window")
            last_rank = rank[item.window]
        covered: list[list[tuple[int, int, int]]] = [[] for _ in range(n_params)]
        schedule: dict[int, tuple[int, int, int]] = {}
        for item in self.items:
            self._validate_item(item, profile)
            for s in item.slices:
                covered[s.param].append((s.offset, s.count, item.id))
                key = (item.delay, item.period, item.period_offset)
                if schedule.setdefault(s.param, key) != key:
                    raise ValueError(f"param {s.param} has items with different delay/period")
        for param, ranges in enumerate(covered):
            numel = profile.params[param].numel
            position = 0
            for offset, count, item_id in sorted(ranges):
                if offset != position:
                    kind = "overlap" if offset < position else "gap"
                    raise ValueError(f"param {param}: {kind} at element {min(offset, position)} "
                                     f"(item {item_id})")
                position = offset + count
            if position != numel:
                raise ValueError(f"param {param}: elements {position}..{numel} are never communicated")

    @staticmethod
    def _validate_item(item: CommItem, profile: Profile) -> None:
        if not item.slices:
            raise ValueError(f"item {item.id} carries nothing")
        if not 0 <= item.link < len(profile.links):
            raise ValueError(f"item {item.id}: link {item.link} does not exist")
        if item.delay not in (0, 1):
            raise ValueError(f"item {item.id}: delay must be 0 or 1")
        if item.period < 1 or not 0 <= item.period_offset < item.period:
            raise ValueError(f"item {item.id}: bad period {item.period}/{item.period_offset}")
        dtypes = set()
        for s in item.slices:
            if not 0 <= s.param < len(profile.params):
                raise ValueError(f"item {item.id}: param {s.param} does not exist")
            if s.count <= 0 or s.offset < 0 or s.offset + s.count > profile.params[s.param].numel:
                raise ValueError(f"item {item.id}: slice {s} out of range")
            dtypes.add(profile.params[s.param].dtype)
        if len(dtypes) != 1:
            raise ValueError(f"item {item.id} mixes dtypes {sorted(dtypes)}")
        if item.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"item {item.id}: unknown wire dtype {item.wire_dtype!r}; "
                             f"use one of {', '.join(WIRE_DTYPES)}")
        if item.narrowed and not may_narrow(next(iter(dtypes))):
            raise ValueError(f"item {item.id}: {next(iter(dtypes))} gradients cannot cross the link as "
                             f"{item.wire_dtype} (only float32 and float64 gradients narrow)")
        wait_layer = layer_of_point(item.wait_at)
        if item.delay == 1:
            if item.wait_at != WAIT_BEFORE_NEXT_UPDATE or item.update_at != UPDATE_AT_NEXT_STEP:
                raise ValueError(f"item {item.id}: a delayed item waits before the next update "
                                 f"and updates at the next step")
            return
        if item.window in NEXT_STEP_WINDOWS:
            raise ValueError(f"item {item.id}: window {item.window} needs delay 1")
        if item.wait_at == WAIT_END_OF_BACKWARD:
            if item.update_at != UPDATE_AT_STEP:
                raise ValueError(f"item {item.id}: waited at end of backward, must update at step")
        elif wait_layer is not None:
            if item.update_at != item.wait_at:
                raise ValueError(f"item {item.id}: per-layer wait needs the same update point")
            if item.period != 1:
                raise ValueError(f"item {item.id}: per-layer waits need period 1")
            first_use = min(profile.params[p].layer for p in item.params())
            if wait_layer > first_use:
                raise ValueError(f"item {item.id}: waits before layer {wait_layer} but layer "
                                 f"{first_use} uses it first")
        else:
            raise ValueError(f"item {item.id}: unknown wait point {item.wait_at!r}")

    # -- display -----------------------------------------------------------------------
    def table(self, profile: Profile | None = None) -> str:
        """Readable table: id, params, bytes (on the wire), wire dtype, link, window, d, K, order, wait."""
        header = ("id", "order", "bucket", "params", "bytes", "wire", "link", "window", "d", "K", "wait")
        rows = [header]
        for item in self.items:
            nbytes = item.nbytes(profile) if profile is not None else item.numel
            rows.append((str(item.id), str(item.order), str(item.bucket),
                         _describe_slices(item.slices, profile), str(nbytes), item.wire_dtype, str(item.link),
                         item.window, str(item.delay),
                         f"{item.period}" + (f"+{item.period_offset}" if item.period > 1 else ""),
                         item.wait_at))
        widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
        lines = [f"policy={self.policy} items={len(self.items)} hash={self.hash()[:12]}"
                 + (f" predicted={self.predicted_iteration_ms:.3f} ms"
                    if self.predicted_iteration_ms is not None else "")]
        for i, row in enumerate(rows):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        if profile is None:
            lines.append("(bytes column shows elements: no profile given)")
        return "\n".join(lines)


def _describe_slices(slices: Sequence[ParamSlice], profile: Profile | None, limit: int = 40) -> str:
    """Compact text: runs of whole consecutive params as ``p3..7``, partial ones with ranges."""
    parts: list[str] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            parts.append(f"p{run[0]}" if len(run) == 1 else f"p{run[0]}..{run[-1]}")
            run.clear()

    for s in slices:
        whole = profile is not None and s.offset == 0 and s.count == profile.params[s.param].numel
        if whole and run and s.param == run[-1] + 1:
            run.append(s.param)
            continue
        flush()
        if whole:
            run.append(s.param)
        else:
            parts.append(f"p{s.param}[{s.offset}:{s.offset + s.count}]")
    flush()
    text = ",".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def whole_param_slices(profile: Profile, params: Iterable[int]) -> tuple[ParamSlice, ...]:
    """Slices covering the given parameters entirely, in the given order."""
    return tuple(ParamSlice(p, 0, profile.params[p].numel) for p in params)


def wire_for(profile: Profile, slices: Sequence[ParamSlice], wire_dtype: str) -> str:
    """The wire dtype an item of ``slices`` takes when ``wire_dtype`` is asked for: it where the item's
    gradients narrow, full precision otherwise (16-bit, integer or complex gradients keep their dtype)."""
    if wire_dtype == WIRE_FULL or not slices or not may_narrow(profile.params[slices[0].param].dtype):
        return WIRE_FULL
    return wire_dtype


def replace_item(item: CommItem, **changes: Any) -> CommItem:
    """Copy of a frozen CommItem with some fields changed."""
    return dataclasses.replace(item, **changes)
