"""Real, slow links on one machine: network namespaces shaped with ``tc`` (docs/LINKS.md).

Communication scheduling only matters when the link is the bottleneck, and a
simulated delay hides the effects that matter (TCP windows, contention, the
qdisc's queue). So benchmarks run gloo over links the kernel really throttles:

* ``ShapedLoopback``: one private namespace whose ``lo`` goes through a token
  bucket. All workers share it and use 127.0.0.1; every byte any worker sends
  crosses the same qdisc (one shared medium, not a full-duplex link).
* ``TwoHostLinks``: two namespaces ("hosts") joined by two veth pairs, each end
  shaped on its own, so two process groups can run over two different links.

Workers enter a namespace with ``enter_netns`` (``setns(2)``) before they create
any socket; ``deft_compile.tools.launcher.run_local_workers(..., netns=...)`` does it.
``link_group`` builds a second gloo group bound to another interface and
registered under a group name, so functional collectives can use it.

Needs root and iproute2 (``ip``, ``tc``). Everything created here is named
``<prefix>-<pid>-<counter>`` and recorded in a per-process registry that is
emptied on context exit, at interpreter exit and on SIGTERM/SIGHUP; only names
in that registry are ever deleted. A namespace left behind by a SIGKILLed run is
removed by hand: ``ip netns del <name>``.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import itertools
import json
import os
import shutil
import signal
import subprocess
import threading
from types import FrameType, TracebackType
from typing import Any, Sequence

from deft_compile.errors import NetnsError
from deft_compile.step.links import gloo_device_options, link_group

NETNS_DIR = "/var/run/netns"
_CLONE_NEWNET = 0x40000000



# --------------------------------------------------------------------------- prerequisites and commands


def check_prerequisites() -> None:
    """Raise ``NetnsError`` naming what is missing (root, ``ip``, ``tc``), so a test fails with the cause, not a stack of ``ip`` errors."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    problems = []
    if missing:
        problems.append(f"missing tools {missing} (install iproute2)")
    if os.geteuid() != 0:
        problems.append(f"not root (euid {os.geteuid()}); network namespaces and tc need CAP_NET_ADMIN/CAP_SYS_ADMIN")
    if problems:
        raise NetnsError("shaped links unavailable: " + "; ".join(problems))


def _run(command: Sequence[str], what: str) -> str:
    """Run an iproute2 command; on failure raise ``NetnsError("<what> failed: <cmd>: <stderr>")``."""
    completed = subprocess.run(list(command), capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        detail = (completed.stderr or completed.stdout).strip()
        raise NetnsError(f"{what} failed: {' '.join(command)}: {detail} (exit {completed.returncode})")
    return completed.stdout


# --------------------------------------------------------------------------- registry and cleanup

_lock = threading.RLock()  # re-entrant: the SIGTERM handler may run while the main thread holds it
_counter = itertools.count()
_created: dict[str, int] = {}  # namespace name -> pid of the process that created it
_handlers_installed = False
_previous_handlers: dict[int, Any] = {}


def _unique_name(prefix: str, suffix: str = "") -> str:
    """``<prefix>-<pid>-<n>[-suffix]``: unique across processes (pid) and instances (counter)."""
    name = f"{prefix}-{os.getpid()}-{next(_counter)}{suffix}"
    if len(name) > 200 or "/" in name or name.startswith("."):
        raise NetnsError(f"invalid namespace name {name!r}: choose a shorter prefix without '/'")
    return name


def _add_namespace(name: str) -> None:
    """Create a namespace and record it; ``ip netns add`` refuses existing names, so a foreign one is never adopted."""
    _install_cleanup_handlers()
    _run(["ip", "netns", "add", name], "ip netns add")
    with _lock:
        _created[name] = os.getpid()


def _delete_namespace(name: str) -> None:
    """Delete a namespace this process created (its veths and qdiscs go with it); ignore names it did not create."""
    with _lock:
        owner = _created.get(name)
        if owner != os.getpid():
            return
        del _created[name]
    if os.path.exists(os.path.join(NETNS_DIR, name)):
        _run(["ip", "netns", "del", name], "ip netns del")


def created_namespaces() -> list[str]:
    """Namespaces this process created and has not deleted yet (for tests and diagnostics)."""
    with _lock:
        return sorted(name for name, pid in _created.items() if pid == os.getpid())


def cleanup_all() -> list[str]:
    """Delete every namespace this process created; returns the errors, never raises (runs from atexit and signal handlers)."""
    errors = []
    for name in created_namespaces():
        try:
            _delete_namespace(name)
        except Exception as error:  # noqa: BLE001 - best effort at exit
            errors.append(str(error))
    return errors


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """Clean up, then let the signal do what it would have done (previous handler or default action)."""
    cleanup_all()
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_cleanup_handlers() -> None:
    """Register atexit once; hook SIGTERM/SIGHUP (which skip atexit) when called from the main thread."""
    global _handlers_installed
    with _lock:
        if _handlers_installed:
            return
        _handlers_installed = True
    atexit.register(cleanup_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(signum)
        if previous is None:  # set from C; we cannot chain it, leave it alone
            continue
        _previous_handlers[signum] = previous
        signal.signal(signum, _on_signal)


def _shape(namespace: str, device: str, rate: str, burst: str, latency: str) -> None:
    """Put a token-bucket qdisc on ``device``'s egress inside ``namespace``."""
    _run(
        ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
         "rate", rate, "burst", burst, "latency", latency],
        f"tc qdisc add (tbf rate {rate}) on {device} in {namespace}",
    )


class _NamespaceSet:
    """Shared context-manager plumbing: build on enter, always delete what was built on exit."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._active = False

    def _build(self) -> None:
        raise NotImplementedError

    def _new_namespace(self, name: str) -> str:
        _add_namespace(name)
        self._names.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"], f"ip link set lo up in {name}")
        return name

    def __enter__(self) -> Any:
        check_prerequisites()
        if self._active:
            raise NetnsError(f"{type(self).__name__} is already entered; create a new instance")
        self._active = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Delete the namespaces (and with them veths and qdiscs); safe to call twice."""
        errors = []
        while self._names:
            name = self._names.pop()
            try:
                _delete_namespace(name)
            except NetnsError as error:
                errors.append(str(error))
        self._active = False
        if errors:
            raise NetnsError("; ".join(errors))

    @property
    def namespaces(self) -> list[str]:
        return list(self._names)


# --------------------------------------------------------------------------- one shaped loopback


class ShapedLoopback(_NamespaceSet):
    """One private namespace whose ``lo`` is rate-limited; all workers run in it on 127.0.0.1.

    ``rate=None`` leaves ``lo`` unshaped (an in-namespace baseline). Remember the
    shared-medium effect: a 2-worker ring all-reduce of S bytes pushes 2·S bytes
    through this one qdisc.
    """

    def __init__(self, name_prefix: str = "deft", rate: str | None = "1gbit", burst: str = "128kb", latency: str = "20ms") -> None:
        super().__init__()
        self.name_prefix = name_prefix
        self.rate = rate
        self.burst = burst
        self.latency = latency
        self.name = ""

    def _build(self) -> None:
        self.name = self._new_namespace(_unique_name(self.name_prefix))
        if self.rate is not None:
            _shape(self.name, "lo", self.rate, self.burst, self.latency)

    def __enter__(self) -> ShapedLoopback:
        return super().__enter__()

    @property
    def master_addr(self) -> str:
        return "127.0.0.1"

    def exec_prefix(self) -> list[str]:
        """Prefix a command with this to run it inside the namespace (``subprocess.run(lo.exec_prefix() + cmd)``)."""
        return ["ip", "netns", "exec", self.name]

    def launch_kwargs(self, world_size: int) -> dict[str, Any]:
        """Keyword arguments for ``run_local_workers`` that put every rank in this namespace."""
        if not self.name:
            raise NetnsError("ShapedLoopback is not entered; use it as a context manager")
        return {"netns": [self.name] * world_size, "master_addr": self.master_addr}


# --------------------------------------------------------------------------- two hosts, two links


class TwoHostLinks(_NamespaceSet):
    """Two namespaces ("hosts" A and B) joined by veth pairs ``link1``, ``link2``, ..., each end shaped on its own.

    Rank 0 lives in A, rank 1 in B. Link k uses ``<subnet_base>.k.0/24`` with A
    at ``.1`` and B at ``.2``. The default group runs over ``link1``
    (``master_addr`` is A's link1 address, ``GLOO_SOCKET_IFNAME=link1``); bind a
    second group to ``link2`` with ``link_group("link2")``. Veths are created
    directly inside the namespaces (never in the root namespace), so deleting the
    two namespaces removes everything. Only 2 workers: more need one bridge per
    link in a third namespace, which this class does not build.
    """

    def __init__(
        self,
        rates: Sequence[str | None] = ("1gbit", "500mbit"),
        name_prefix: str = "deft",
        burst: str = "128kb",
        latency: str = "20ms",
        subnet_base: str = "10.201",
    ) -> None:
        super().__init__()
        if not rates:
            raise ValueError("TwoHostLinks needs at least one link rate")
        octets = subnet_base.split(".")
        if len(octets) != 2 or not all(o.isdigit() and 0 <= int(o) <= 255 for o in octets):
            raise ValueError(f"subnet_base must be two octets like '10.201', got {subnet_base!r}")
        if len(rates) > 254:
            raise ValueError("at most 254 links")
        self.rates = tuple(rates)
        self.name_prefix = name_prefix
        self.burst = burst
        self.latency = latency
        self.subnet_base = subnet_base
        self.hosts: tuple[str, str] = ("", "")

    @property
    def interfaces(self) -> tuple[str, ...]:
        return tuple(f"link{k + 1}" for k in range(len(self.rates)))

    def address(self, rank: int, link: str = "link1") -> str:
        """IPv4 address of ``rank``'s end of ``link``."""
        self._check_rank(rank)
        index = self._link_index(link)
        return f"{self.subnet_base}.{index}.{rank + 1}"

    @property
    def master_addr(self) -> str:
        """Address for the default group's rendezvous: host A's end of link1."""
        return self.address(0, "link1")

    def namespace(self, rank: int) -> str:
        self._check_rank(rank)
        return self.hosts[rank]

    def rank_env(self, link: str = "link1") -> list[dict[str, str]]:
        """Per-rank environment pinning gloo's default device to ``link``."""
        self._link_index(link)
        return [{"GLOO_SOCKET_IFNAME": link} for _ in range(2)]

    def launch_kwargs(self, world_size: int = 2, link: str = "link1") -> dict[str, Any]:
        """Keyword arguments for ``run_local_workers``: one host per rank, default group over ``link``."""
        if world_size != 2:
            raise NetnsError(
                f"TwoHostLinks supports exactly 2 workers, got world_size={world_size}; "
                "more workers need one bridge per link in a third namespace (not implemented)"
            )
        if not self.hosts[0]:
            raise NetnsError("TwoHostLinks is not entered; use it as a context manager")
        return {"netns": list(self.hosts), "master_addr": self.address(0, link), "rank_env": self.rank_env(link)}

    def sent_bytes(self, rank: int, link: str) -> int:
        """Bytes ``rank``'s end of ``link`` has transmitted (kernel counters): proves which link carried the traffic."""
        output = _run(["ip", "-j", "-s", "-n", self.namespace(rank), "link", "show", "dev", link], f"ip link show {link}")
        return int(json.loads(output)[0]["stats64"]["tx"]["bytes"])

    def _build(self) -> None:
        base = _unique_name(self.name_prefix)
        host_a = self._new_namespace(base + "-a")
        host_b = self._new_namespace(base + "-b")
        self.hosts = (host_a, host_b)
        for index, (interface, rate) in enumerate(zip(self.interfaces, self.rates), start=1):
            _run(
                ["ip", "-n", host_a, "link", "add", interface, "type", "veth", "peer", "name", interface, "netns", host_b],
                f"ip link add veth {interface}",
            )
            for rank, host in enumerate(self.hosts):
                _run(["ip", "-n", host, "addr", "add", f"{self.subnet_base}.{index}.{rank + 1}/24", "dev", interface],
                     f"ip addr add on {interface} in {host}")
                _run(["ip", "-n", host, "link", "set", interface, "up"], f"ip link set {interface} up in {host}")
                if rate is not None:
                    _shape(host, interface, rate, self.burst, self.latency)

    def close(self) -> None:
        super().close()
        self.hosts = ("", "")

    def __enter__(self) -> TwoHostLinks:
        return super().__enter__()

    def _check_rank(self, rank: int) -> None:
        if rank not in (0, 1):
            raise NetnsError(f"TwoHostLinks has ranks 0 and 1 only, got {rank}; more workers need a bridge per link")

    def _link_index(self, link: str) -> int:
        if link not in self.interfaces:
            raise NetnsError(f"unknown link {link!r}; this TwoHostLinks has {list(self.interfaces)}")
        return self.interfaces.index(link) + 1


# --------------------------------------------------------------------------- entering a namespace


def enter_netns(name: str) -> None:
    """Move the calling thread into namespace ``name`` with ``setns(2)``.

    Call it first thing in a worker, before torch or gloo start threads or open
    sockets: setns changes only the calling thread, threads started afterwards
    inherit it, sockets keep the namespace they were created in.
    """
    path = os.path.join(NETNS_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise NetnsError(f"enter_netns({name!r}) failed: cannot open {path}: {error.strerror}") from error
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise NetnsError(f"enter_netns({name!r}) failed: setns: {os.strerror(errno)} (errno {errno}); needs CAP_SYS_ADMIN")
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- measuring a link


__all__ = [
    "NETNS_DIR",
    "NetnsError",
    "ShapedLoopback",
    "TwoHostLinks",
    "check_prerequisites",
    "cleanup_all",
    "created_namespaces",
    "enter_netns",
    "gloo_device_options",
    "link_group",
]
