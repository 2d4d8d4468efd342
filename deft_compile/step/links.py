"""Extra communication channels ("links") named in ``DeftConfig.links``.

DeFT adds bandwidth by sending some buckets, or shares of buckets, over a
second channel: on GPUs NCCL plus gloo over the host NIC; here two gloo groups
bound to two network interfaces. A spec is one of:

* ``"gloo"``: another gloo group on the default interface (a second set of
  connections; useful to test, adds no bandwidth on one NIC);
* ``"gloo:IFNAME"``: a gloo group bound to interface ``IFNAME``
  (``ProcessGroupGloo.create_device(interface=...)``, see ``link_group``);
* ``"nccl"``: an NCCL group (GPUs).

Every rank must open the same links in the same order (group creation is a
collective call). The spec grammar is ``deft_compile.config.parse_link``'s.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Sequence

import torch.distributed as dist

from deft_compile.config import parse_link
from deft_compile.errors import NetnsError
from deft_compile.step.distributed import new_group

_LINK_BACKEND = "deft_gloo_if"  # the registered backend name of a gloo group bound to one interface


def open_link(spec: str, ranks: list[int] | None = None, timeout: timedelta | None = None) -> dist.ProcessGroup:
    """Create the process group for one link spec (a collective call on every rank)."""
    kind, interface = parse_link(spec)
    timeout = timeout or timedelta(seconds=60)
    if interface is not None:
        return link_group(interface, ranks=ranks, timeout=timeout)
    return new_group(ranks=ranks, backend=kind, timeout=timeout)


def _create_link_backend(backend_options: Any, pg_options: Any) -> Any:
    """Backend factory for ``dist.new_group``: a ``ProcessGroupGloo`` whose devices come from ``pg_options``.

    torch's gloo branch of ``new_group`` ignores ``pg_options``, so the device
    list (the interface) cannot be passed there; registering this factory as a
    backend lets ``new_group`` do everything else (store prefix, group name,
    registration for functional collectives) exactly as for built-in gloo.
    """
    from torch.distributed import ProcessGroupGloo

    if not isinstance(pg_options, ProcessGroupGloo._Options):
        raise NetnsError(f"{_LINK_BACKEND} needs ProcessGroupGloo._Options as pg_options, got {type(pg_options).__name__}")
    pg_options._timeout = backend_options.timeout
    pg_options.global_ranks_in_group = list(backend_options.global_ranks_in_group)
    pg_options.group_name = backend_options.group_id
    backend = ProcessGroupGloo(backend_options.store, backend_options.group_rank, backend_options.group_size, pg_options)
    backend._set_sequence_number_for_group()
    return backend


def _register_link_backend() -> None:
    if _LINK_BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(_LINK_BACKEND, _create_link_backend, extended_api=True, devices=["cpu", "cuda"])


def gloo_device_options(interface: str, threads: int = 2) -> Any:
    """``ProcessGroupGloo._Options`` with one device bound to ``interface``."""
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    try:
        options._devices = [ProcessGroupGloo.create_device(interface=interface)]
    except RuntimeError as error:
        raise NetnsError(f"gloo cannot use interface {interface!r} in this namespace: {error}") from error
    options._threads = threads
    return options


def link_group(interface: str, ranks: Sequence[int] | None = None, timeout: timedelta = timedelta(seconds=60)) -> Any:
    """A gloo process group whose traffic goes over ``interface`` (e.g. ``"link2"``), usable by functional collectives.

    Collective over the default group (every rank must call it, as for
    ``dist.new_group``). Returns the ``ProcessGroup``; its name is
    ``group.group_name`` and its ``ProcessGroupGloo`` is
    ``group._get_backend(torch.device("cpu"))``. The store is a ``PrefixStore``
    of the default store, set up by ``new_group``.
    """
    if not dist.is_initialized():
        raise NetnsError("link_group needs an initialized default process group (init_process_group first)")
    _register_link_backend()
    options = gloo_device_options(interface)
    return new_group(ranks=list(ranks) if ranks is not None else None, timeout=timeout, backend=_LINK_BACKEND, pg_options=options)
