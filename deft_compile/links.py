"""Extra communication channels ("links") named in ``DeftConfig.links``.

DeFT adds bandwidth by sending some buckets, or shares of buckets, over a
second channel: on GPUs NCCL plus gloo over the host NIC; here two gloo groups
bound to two network interfaces. A spec is one of:

* ``"gloo"``: another gloo group on the default interface (a second set of
  connections; useful to test, adds no bandwidth on one NIC);
* ``"gloo:IFNAME"``: a gloo group bound to interface ``IFNAME``
  (``ProcessGroupGloo.create_device(interface=...)``, see ``deft_compile.netns.link_group``);
* ``"nccl"``: an NCCL group (GPUs).

Every rank must open the same links in the same order (group creation is a
collective call).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

LINK_KINDS = ("gloo", "nccl")


def parse_link(spec: str) -> tuple[str, str | None]:
    kind, _, interface = spec.partition(":")
    if kind not in LINK_KINDS or (kind == "nccl" and interface):
        raise ValueError(f"unknown link {spec!r}: use 'gloo', 'gloo:IFNAME' or 'nccl'")
    return kind, interface or None


def open_link(spec: str, ranks: list[int] | None = None, timeout: timedelta | None = None) -> dist.ProcessGroup:
    """Create the process group for one link spec (a collective call on every rank)."""
    kind, interface = parse_link(spec)
    timeout = timeout or timedelta(seconds=60)
    if interface is not None:
        from deft_compile.netns import link_group

        return link_group(interface, ranks=ranks, timeout=timeout)
    return dist.new_group(ranks=ranks, backend=kind, timeout=timeout)
