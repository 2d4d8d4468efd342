"""Shaped links are real: traffic in a shaped namespace is slower, each link carries its group, nothing is left behind.

Needs root with ``ip`` and ``tc`` (CI has both); without them every test fails
with the reason instead of skipping silently.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from deft_compile.tools.launcher import run_local_workers
from deft_compile.tools.netns import (
    NETNS_DIR,
    NetnsError,
    ShapedLoopback,
    TwoHostLinks,
    check_prerequisites,
    cleanup_all,
    created_namespaces,
    link_group,
)
from deft_compile.planner.link_fit import fit_alpha_beta
from deft_compile.step.profiler import measure_allreduce

MB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _root_with_iproute2():
    try:
        check_prerequisites()
    except NetnsError as error:
        pytest.fail(f"{error} -- tests/test_netns.py must run as root with iproute2 installed")


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(NETNS_DIR, name))


# --------------------------------------------------------------------------- workers (module level: spawned by name)


def allreduce_ms(rank: int, world_size: int, nbytes: int) -> float:
    return measure_allreduce(None, [nbytes], repeats=3)[0][1]


def two_links(rank: int, world_size: int, nbytes: int) -> dict:
    group2 = link_group("link2")
    small = torch.ops._c10d_functional.all_reduce.default(torch.full((4,), float(rank + 1)), "sum", group2.group_name)
    small = torch.ops._c10d_functional.wait_tensor.default(small)
    big = torch.full((nbytes // 4,), float(rank + 1))
    dist.all_reduce(big, group=group2)
    return {
        "functional_link2": small.tolist(),
        "big_ok": bool((big == 3.0).all()),
        "link1_ms": measure_allreduce(None, [nbytes], repeats=3)[0][1],
        "link2_ms": measure_allreduce(group2, [nbytes], repeats=3)[0][1],
    }


# --------------------------------------------------------------------------- tests


def test_shaped_loopback_is_slower_and_removed():
    outside = run_local_workers(allreduce_ms, 2, (4 * MB,), timeout_s=120)[0].value
    with ShapedLoopback(rate="200mbit") as lo:
        name = lo.name
        assert _exists(name) and name in created_namespaces()
        qdisc = subprocess.run(lo.exec_prefix() + ["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "200Mbit" in qdisc, qdisc
        inside = run_local_workers(allreduce_ms, 2, (4 * MB,), timeout_s=120, **lo.launch_kwargs(2))[0].value
    assert not _exists(name) and name not in created_namespaces()
    # 2 x 4 MB through one 200 Mbit/s qdisc is ~335 ms; unshaped it is a few ms.
    assert inside >= 3 * outside, (inside, outside)
    assert inside >= 150, inside


def test_cleanup_on_exception_and_keyboard_interrupt():
    for error in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            with ShapedLoopback() as lo:
                name = lo.name
                assert _exists(name)
                raise error
        assert not _exists(name)
    with pytest.raises(RuntimeError):
        with TwoHostLinks() as links:
            hosts = links.namespaces
            raise RuntimeError("boom")
    assert not any(_exists(h) for h in hosts)


def test_names_are_unique_and_foreign_namespaces_are_untouched():
    foreign = f"deft-{os.getpid()}-foreign"
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    try:
        with ShapedLoopback() as a, ShapedLoopback() as b:
            assert a.name != b.name
            assert cleanup_all() == []
            assert not _exists(a.name) and not _exists(b.name)
        assert _exists(foreign), "cleanup deleted a namespace it did not create"
    finally:
        subprocess.run(["ip", "netns", "del", foreign], check=False)


@pytest.mark.parametrize("how", ["sigterm", "atexit"])
def test_process_exit_removes_its_namespaces(how: str):
    """The child makes a namespace, names it, and then either sleeps until SIGTERM or, once this process has seen
    the namespace and answered on its stdin, returns (its exit handlers run)."""
    code = (
        "import sys, time\n"
        "from deft_compile.tools.netns import ShapedLoopback\n"
        "lo = ShapedLoopback().__enter__()\n"
        "print(lo.name, flush=True)\n"
        f"time.sleep(30) if {how == 'sigterm'!r} else sys.stdin.readline()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=REPO)
    name = child.stdout.readline().strip()
    assert name and _exists(name)
    if how == "sigterm":
        child.send_signal(signal.SIGTERM)
    else:
        child.stdin.write("exit\n")
        child.stdin.close()
    child.wait(timeout=20)
    if how == "sigterm":
        assert child.returncode == -signal.SIGTERM
    assert not _exists(name)


def test_two_host_links_each_group_uses_its_link():
    with TwoHostLinks(rates=("1gbit", "200mbit")) as links:
        hosts = links.namespaces
        assert links.master_addr == "10.201.1.1" and links.address(1, "link2") == "10.201.2.2"
        with pytest.raises(NetnsError, match="exactly 2 workers.*bridge"):
            links.launch_kwargs(3)
        sent_before = {link: links.sent_bytes(0, link) for link in links.interfaces}
        results = run_local_workers(two_links, 2, (4 * MB,), timeout_s=120, **links.launch_kwargs(2))
        sent = {link: links.sent_bytes(0, link) - sent_before[link] for link in links.interfaces}
    value = results[0].value
    assert value["functional_link2"] == [3.0] * 4 and value["big_ok"]
    # link1 carried the default group's timing runs, link2 the second group's: each >= 4 x 4 MB.
    assert sent["link1"] >= 16 * MB and sent["link2"] >= 16 * MB, sent
    # 4 MB each way at 200 Mbit/s is ~170 ms, at 1 Gbit/s ~35 ms.
    assert value["link2_ms"] >= 2 * value["link1_ms"], value
    # The veths were created inside the two namespaces, so deleting those removed them.
    assert not any(_exists(h) for h in hosts)


def test_fit_alpha_beta_recovers_parameters():
    alpha, beta = 0.35, 8e-6
    samples = [(s, alpha + beta * s + (0.01 if i % 2 else -0.01)) for i, s in enumerate([1e3, 1e4, 1e5, 1e6, 4e6, 16e6])]
    fitted_alpha, fitted_beta = fit_alpha_beta(samples)
    assert fitted_alpha == pytest.approx(alpha, abs=0.02)
    assert fitted_beta == pytest.approx(beta, rel=1e-3)
    # A negative intercept would be unphysical: refit through the origin instead.
    a, b = fit_alpha_beta([(1e6, 1.0), (2e6, 3.0), (3e6, 5.0)])
    assert a == 0.0 and b > 0
    with pytest.raises(ValueError, match="distinct sizes"):
        fit_alpha_beta([(1e6, 1.0), (1e6, 1.1)])


def test_fit_alpha_beta_takes_the_latency_from_small_messages():
    """The profiler's sizes (4 KiB .. 4 MiB) on a slow link: 3 % noise on the largest time is 9 ms, more than
    the whole latency. Fitted on relative errors, alpha still comes from the small sizes."""
    from deft_compile.step.profiler import LINK_PROBE_BYTES

    alpha, beta = 1.0, 7e-5
    for noise in (1.03, 0.97):
        samples = [(x, (alpha + beta * x) * (noise if x == max(LINK_PROBE_BYTES) else 1.0)) for x in LINK_PROBE_BYTES]
        fitted_alpha, fitted_beta = fit_alpha_beta(samples)
        assert fitted_alpha == pytest.approx(alpha, rel=0.05), samples
        assert fitted_beta == pytest.approx(beta, rel=0.05)
