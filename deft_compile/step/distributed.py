"""Process-group plumbing: which group, initial broadcast, cross-rank checks, naming dead peers."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable, ContextManager, Iterable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from deft_compile.errors import DeftError, ModelMismatchError, PeerFailureError
from deft_compile.step.pipeline import CommGroup

log = logging.getLogger("deft_compile")

#: the context every process group the library opens is created in (``set_group_context``)
_group_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext


def set_group_context(context: Callable[[], ContextManager[Any]] | None) -> None:
    """Create every later process group the library opens (side groups, links, DS-Sync's groups) inside
    ``context()``; None: plainly. A launcher that places threads on cores registers its placement here, since a
    group's communication threads start at its creation and inherit the creating thread's affinity."""
    global _group_context
    _group_context = context if context is not None else contextlib.nullcontext


def new_group(**kwargs: Any) -> dist.ProcessGroup:
    """``torch.distributed.new_group(**kwargs)`` (a collective call) inside the registered group context.

    Without a ``timeout`` the group gets the default group's: torch's own default for a new gloo group is 30
    minutes whatever the default group was created with, so a stopped peer would hold its collectives that long."""
    if kwargs.get("timeout") is None:
        kwargs["timeout"] = group_timeout(dist.group.WORLD)
    with _group_context():
        return dist.new_group(**kwargs)


def resolve_group(process_group: dist.ProcessGroup | None) -> tuple[CommGroup | None, dist.ProcessGroup | None]:
    """The group to communicate over, or (None, None) when training is local."""
    if not dist.is_available() or not dist.is_initialized():
        if process_group is not None:
            raise ValueError("process_group was given but torch.distributed is not initialised")
        return None, None
    group = process_group if process_group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return None, None
    return CommGroup(name=group.group_name, rank=dist.get_rank(group), world_size=world_size), group


def group_timeout(group: dist.ProcessGroup, default: timedelta = timedelta(seconds=60)) -> timedelta:
    """The collective timeout ``group`` was created with, so groups we open beside it fail as fast as it does.

    torch keeps it only on the backend's options (``new_group`` without a timeout would give gloo's 30 minutes,
    and a dead peer would hang a broadcast that long); ``default`` where the backend does not say."""
    try:
        backend = group._get_backend(torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu"))
        return backend.options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return default


def open_side_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A second process group over ``group``'s ranks and backend (and its timeout), for what the step sends
    beside its gradients: the per-step buffer broadcast, and the small all-reduces with which the Preserver
    and the closed loop agree on losses and measured times.

    Why: a backend works through one group's collectives in order (gloo: two at a time). Under ByteScheduler,
    US-Byte or a delayed plan, all-reduces of the previous step are still in flight when the next step starts
    (and when the step returns). On the data-parallel group the buffer broadcast, waited before the forward,
    would queue behind all of them, so the next forward could not start until every carried gradient had
    arrived, which is exactly the overlap those plans are for; and a loss all-reduce after the step would wait
    there for all of them, exposing the carried communication of that step in full. On its own group such a collective
    only shares the link's bandwidth. A collective call on every rank of ``group``."""
    ranks = dist.get_process_group_ranks(group)
    return new_group(ranks=ranks, backend=dist.get_backend(group), timeout=group_timeout(group))


def comm_group_of(group: dist.ProcessGroup) -> CommGroup:
    """``group`` as the graph's functional collectives name it."""
    return CommGroup(name=group.group_name, rank=dist.get_rank(group), world_size=dist.get_world_size(group))


def broadcast_from_rank0(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite ``tensors`` on every rank with rank 0's values (coalesced per dtype), like DDP's constructor."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.numel():
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for group_tensors in by_dtype.values():
            flat = _flatten_dense_tensors([t.detach() for t in group_tensors])
            dist.broadcast(flat, src=src, group=group)
            for tensor, value in zip(group_tensors, _unflatten_dense_tensors(flat, group_tensors)):
                tensor.copy_(value)


def average_tensors(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Replace each tensor by its mean over ``group``, in place: one all-reduce per device and dtype, not one
    per tensor (sum, then divide by the group size)."""
    size = dist.get_world_size(group)
    by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    with torch.no_grad():
        for same in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            dist.all_reduce(flat, group=group)
            flat.div_(size)
            for tensor, value in zip(same, flat.split([t.numel() for t in same])):
                tensor.detach().copy_(value.view_as(tensor))


def average_parameters_and_state(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
                                 group: dist.ProcessGroup) -> None:
    """Average ``params`` and their floating-point optimizer state (momentum, Adam's moments; not step counts,
    which are equal) over ``group``: replicas that drifted apart (``delayed_update="local"``) become identical."""
    tensors = list(params)
    for p in params:
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and key != "step" and value.numel():
                tensors.append(value)
    average_tensors(tensors, group)


def check_same_across_ranks(what: dict[str, Any], group: dist.ProcessGroup) -> None:
    """Raise ``ModelMismatchError`` naming the ranks and fields that differ from rank 0."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, what, group=group)
    reference = gathered[0]
    problems = []
    for rank, other in enumerate(gathered[1:], start=1):
        for key in reference:
            if other.get(key) != reference[key]:
                problems.append(f"rank {rank} differs from rank 0 in {key}: {_first_difference(reference[key], other.get(key))}")
    if problems:
        raise ModelMismatchError(
            "ranks would train different models; refusing to start:\n  " + "\n  ".join(problems)
        )


def _first_difference(a: Any, b: Any) -> str:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        for index, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"entry {index}: {x!r} vs {y!r}"
        return f"length {len(a)} vs {len(b)}"
    return f"{a!r} vs {b!r}"


def model_fingerprint(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple]:
    """(name, shape, dtype, requires_grad) per tensor: what ranks must agree on to train one model."""
    return [(name, tuple(t.shape), str(t.dtype), bool(t.requires_grad)) for name, t in named_tensors]


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is how a collective, or the rendezvous store, reports a peer that left or did not answer
    (torch's ``DistError`` family, gloo's and NCCL's errors, a timeout, a closed connection)."""
    if isinstance(exc, DeftError):
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return any(word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))


@contextlib.contextmanager
def lost_peers_named(group: dist.ProcessGroup | None, step: int | Callable[[], int],
                     timeout_s: float) -> Iterator[None]:
    """Turn a failed collective inside the block into ``PeerFailureError`` naming the ranks that are gone
    (``diagnose_peer_failure``); every other exception, and a ``DeftError`` already raised, passes unchanged.
    ``step``: the step number the survivors agree on in the store (a callable: read when the failure happens)."""
    try:
        yield
    except Exception as exc:
        if group is None or not is_collective_failure(exc):
            raise
        raise diagnose_peer_failure(exc, group, step() if callable(step) else step, timeout_s) from exc


_Method = TypeVar("_Method", bound=Callable[..., Any])


def names_lost_peers(method: _Method) -> _Method:
    """Decorate a method of the compiled step (an object with ``groups.process_group``, ``runner.step_count`` and
    ``config.peer_check_timeout_s``) so that any collective failing inside it, whoever issued it (the step's graph,
    the profiler, the closed loop, the Preserver, a flush, the construction's checks and broadcast), raises
    ``PeerFailureError`` naming the ranks that are gone."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            groups = getattr(self, "groups", None)
            group = getattr(groups, "process_group", None)
            if group is None or not is_collective_failure(exc):
                raise
            step = getattr(getattr(self, "runner", None), "step_count", 0)
            raise diagnose_peer_failure(exc, group, step, self.config.peer_check_timeout_s) from exc

    return wrapper  # type: ignore[return-value]


def diagnose_peer_failure(exc: BaseException, group: dist.ProcessGroup, step: int,
                          timeout_s: float) -> PeerFailureError:
    """Find out which ranks are gone after a collective failed, and say so.

    Every surviving rank writes ``deft/alive/<step>/<rank>`` into the rendezvous
    store and waits up to ``timeout_s`` for the others' keys; ranks whose key
    never appears are named (a dead rank and a stopped one alike). If the store
    itself fails, or does not answer within ``timeout_s`` (a stopped host: the
    store client's calls then wait forever, so they run on a helper thread that
    is left behind), the process that hosts it is named: rank 0 under ``tcp://``
    init, torchrun's agent under torchrun.
    """
    me = dist.get_rank(group)
    world = dist.get_world_size(group)
    global_ranks = [dist.get_global_rank(group, r) for r in range(world)]
    cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = f"rank {global_ranks[me]}: a collective failed in step {step} ({cause})"
    host = "the process hosting it (rank 0 under tcp:// or env:// init, torchrun's agent under torchrun)"
    outcome: dict[str, Any] = {}

    def report_and_wait() -> None:
        try:
            store = dist.distributed_c10d._get_default_store()
            prefix = f"deft/alive/{step}/"
            store.set(prefix + str(global_ranks[me]), "1")
            deadline = time.monotonic() + timeout_s
            missing = [g for g in global_ranks if g != global_ranks[me]]
            while missing and time.monotonic() < deadline:
                missing = [g for g in missing if not store.check([prefix + str(g)])]
                if missing:
                    time.sleep(0.05)
            outcome["missing"] = missing
        except Exception as store_exc:  # noqa: BLE001 - the store failing is itself the diagnosis
            outcome["store_error"] = type(store_exc).__name__

    helper = threading.Thread(target=report_and_wait, name="deft-peer-check", daemon=True)
    helper.start()
    helper.join(timeout_s + 1.0)
    if "store_error" in outcome:
        return PeerFailureError(f"{where} and the rendezvous store is unreachable ({outcome['store_error']}); "
                                f"{host} has most likely died or hung")
    if "missing" not in outcome:
        return PeerFailureError(f"{where} and the rendezvous store did not answer within {timeout_s:g} s; {host} "
                                f"has most likely died or hung")
    if outcome["missing"]:
        names = ", ".join(f"rank {g}" for g in outcome["missing"])
        return PeerFailureError(f"{where}; {names} did not respond within {timeout_s:g} s and has most likely died "
                                f"or hung")
    return PeerFailureError(
        f"{where}; every rank is still alive, so the ranks most likely ran different collectives (different models, "
        f"inputs that change the graph on one rank, or a collective timeout that is too short)"
    )
