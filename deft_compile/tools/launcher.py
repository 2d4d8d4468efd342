"""Start local data-parallel workers (gloo on 127.0.0.1) and collect what they return.

Used by the demo, the benchmarks and the tests. Every worker runs with one
intra-op thread, a free port is picked per launch, every collective has a
timeout, and the parent kills workers that outlive the launch deadline, so a bug
fails instead of hanging.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


#: How workers start. ``spawn`` (the default) gives each worker a fresh interpreter that imports
#: torch and the worker's module itself: 3-4 s per launch on a small CPU host. ``forkserver`` forks
#: each worker from a server process that imported them once (``use_forkserver``).
START_METHODS = ("spawn", "forkserver")
_start_method = "spawn"
_preload: tuple[str, ...] = ()


def use_forkserver(preload: Sequence[str] = ()) -> None:
    """Start later launches' workers from a fork server that has imported torch, deft_compile and
    ``preload`` (module names) once: a launch then costs a fork instead of an interpreter start and
    those imports (a test suite with a hundred small launches saves minutes).

    The server starts on the next launch and keeps the modules as they were imported then: an
    environment variable that a module reads *at import* takes its value from that moment. Each worker
    still gets the launching process's current environment (plus ``env``) before ``fn`` runs, as a
    spawned one does. Call before the first launch of the process; ``use_spawn()`` goes back.
    """
    global _start_method, _preload
    _start_method = "forkserver"
    _preload = ("torch", "torch.distributed", "deft_compile", "deft_compile.tools.launcher", *preload)


def _start_forkserver(context: Any) -> None:
    """Make sure the fork server runs (it starts once; later calls find it alive) with this process's
    ``sys.path``: the server is a new interpreter, and Python 3.11's server drops the path it is sent,
    so a preloaded module found through a path added at run time (a test folder) would fail to import
    there, silently."""
    from multiprocessing import forkserver

    context.set_forkserver_preload(list(_preload))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def use_spawn() -> None:
    """Start each worker in a fresh interpreter (the default)."""
    global _start_method
    _start_method = "spawn"


@dataclass
class WorkerResult:
    rank: int
    ok: bool
    value: Any = None
    error: str | None = None
    exitcode: int | None = None


class WorkerFailure(RuntimeError):
    """At least one worker raised, died or timed out; the message carries every worker's traceback."""

    def __init__(self, results: list[WorkerResult]) -> None:
        self.results = results
        lines = []
        for r in results:
            if not r.ok:
                lines.append(f"--- rank {r.rank} (exit code {r.exitcode}) ---\n{r.error}")
        super().__init__("local workers failed:\n" + "\n".join(lines))


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_local_workers(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple = (),
    *,
    timeout_s: float = 300.0,
    collective_timeout_s: float = 60.0,
    backend: str = "gloo",
    raise_on_failure: bool = True,
    env: dict[str, str] | None = None,
    netns: Sequence[str] | None = None,
    master_addr: str = "127.0.0.1",
    rank_env: Sequence[dict[str, str]] | None = None,
    start_method: str | None = None,
) -> list[WorkerResult]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes (spawned, or forked from a
    preloaded server after ``use_forkserver``).

    Each process joins a fresh process group (``backend``, ``tcp://127.0.0.1``
    on a free port, collectives time out after ``collective_timeout_s``).
    ``fn`` must be importable (a module-level function) and return picklable
    plain data. Returns one ``WorkerResult`` per rank; raises ``WorkerFailure``
    if any rank failed and ``raise_on_failure`` is set.

    For shaped links (``deft_compile.tools.netns``): ``netns`` names one network
    namespace per rank, entered with setns(2) before the process group exists;
    ``master_addr`` is the rendezvous address (reachable from rank 0's
    namespace); ``rank_env`` adds per-rank variables such as
    ``GLOO_SOCKET_IFNAME`` on top of ``env``.

    ``start_method`` (``"spawn"`` or ``"forkserver"``) overrides, for this launch, the process-wide
    choice of ``use_spawn`` / ``use_forkserver``.
    """
    method = start_method or _start_method
    if method not in START_METHODS:
        raise ValueError(f"unknown start method {method!r}; use one of {START_METHODS}")
    if netns is not None and len(netns) != world_size:
        raise ValueError(f"netns names {len(netns)} namespaces for world_size={world_size}; give one per rank")
    if rank_env is not None and len(rank_env) != world_size:
        raise ValueError(f"rank_env has {len(rank_env)} entries for world_size={world_size}; give one per rank")
    context = mp.get_context(method)
    if method == "forkserver":
        _start_forkserver(context)
        # A forked worker inherits the server's environment, not this process's: send it along.
        env = {**os.environ, **(env or {})}
    results_queue = context.Queue()
    port = free_port()
    processes = []
    for rank in range(world_size):
        process = context.Process(
            target=_worker_main,
            args=(
                fn, rank, world_size, port, backend, collective_timeout_s, args,
                {**(env or {}), **(rank_env[rank] if rank_env is not None else {})},
                results_queue,
                netns[rank] if netns is not None else None,
                master_addr,
                method == "forkserver",
            ),
            daemon=True,
        )
        process.start()
        processes.append(process)
    results: dict[int, WorkerResult] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < world_size and time.monotonic() < deadline:
        try:
            result = _unpack(results_queue.get(timeout=0.2))
            results[result.rank] = result
        except queue.Empty:
            if all(not p.is_alive() for p in processes):
                # Drain what the last processes managed to put before exiting.
                time.sleep(0.2)
                while True:
                    try:
                        result = _unpack(results_queue.get_nowait())
                        results[result.rank] = result
                    except queue.Empty:
                        break
                break
    for process in processes:
        process.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        if process.is_alive():
            process.kill()
            process.join()
    ordered = []
    for rank, process in enumerate(processes):
        result = results.get(rank)
        if result is None:
            reason = "timed out" if time.monotonic() >= deadline else "exited without reporting a result"
            result = WorkerResult(rank=rank, ok=False, error=f"worker {reason}", exitcode=process.exitcode)
        else:
            result.exitcode = process.exitcode
        ordered.append(result)
    if raise_on_failure and not all(r.ok for r in ordered):
        raise WorkerFailure(ordered)
    return ordered


def _unpack(result: WorkerResult) -> WorkerResult:
    """Values travel as plain pickles: torch's queue would share tensors through file
    descriptors that vanish when the worker exits. Unpickled as they are: they come over the results
    queue from the workers this launcher started, running the caller's own function, never from a file
    or another user (checkpoints are read without running code: ``deft_compile.safe_load``)."""
    if result.ok:
        result.value = pickle.loads(result.value)
    return result


#: Environment switch: workers fill every tensor ATen allocates uninitialized with NaN (integers with their
#: largest value), so a step that reads memory before writing it gives NaN instead of whatever was there.
ENV_FILL_UNINITIALIZED = "DEFT_FILL_UNINITIALIZED"


def fill_uninitialized_if_asked() -> None:
    """With ``$DEFT_FILL_UNINITIALIZED`` set (not ``0``): ``torch.use_deterministic_algorithms(True,
    warn_only=True)`` and ``torch.utils.deterministic.fill_uninitialized_memory``, which fills ``torch.empty`` and
    its kin under deterministic algorithms only. Kernels that have no deterministic form warn and run as usual."""
    if os.environ.get(ENV_FILL_UNINITIALIZED, "0") in ("", "0"):
        return
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True


def _worker_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    collective_timeout_s: float,
    args: tuple,
    env: dict[str, str],
    results_queue: Any,
    netns_name: str | None = None,
    master_addr: str = "127.0.0.1",
    replace_env: bool = False,
) -> None:
    if replace_env:  # forked from the server: its environment is stale, ``env`` is the launcher's
        os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    fill_uninitialized_if_asked()
    try:
        if netns_name is not None:
            # Before any thread or socket exists: setns moves only this thread.
            from deft_compile.tools.netns import enter_netns

            enter_netns(netns_name)
        from deft_compile.tools import emulation

        emulation.before_init()  # DEFT_EMULATE_ACCELERATOR: gloo's threads on core 1
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        emulation.after_init()  # ... and this compute thread on core 0
        value = fn(rank, world_size, *args)
        results_queue.put(WorkerResult(rank=rank, ok=True, value=pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        results_queue.put(WorkerResult(rank=rank, ok=False, error=traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - the group may be broken after a peer failure
                pass


@dataclass(frozen=True)
class TorchrunWorker:
    """This process's place in a ``torchrun`` job (or a lone process): what a training script needs first."""

    distributed: bool
    device: torch.device
    rank: int
    world_size: int

    def log(self, message: str) -> None:
        """Print on rank 0 only."""
        if self.rank == 0:
            print(message, flush=True)

    def save_checkpoint(self, path: str | os.PathLike, state: dict[str, Any]) -> None:
        """``torch.save`` on rank 0 (every rank holds the same model after ``step.flush()``)."""
        if self.rank == 0:
            from pathlib import Path

            Path(path).parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
            self.log(f"checkpoint: {path}")

    def finish(self) -> None:
        """Wait for every rank, then tear the process group down."""
        if self.distributed:
            dist.barrier()
            dist.destroy_process_group()


def init_from_torchrun() -> TorchrunWorker:
    """Read torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) and set up.

    With ``WORLD_SIZE > 1`` it initialises the default process group: NCCL with one GPU per local rank
    when CUDA is available, else gloo with ``cpu_count // LOCAL_WORLD_SIZE`` intra-op threads per
    process. Without torchrun the process trains alone (no process group).
    """
    distributed = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    return TorchrunWorker(distributed=distributed, device=device,
                          rank=dist.get_rank() if distributed else 0,
                          world_size=dist.get_world_size() if distributed else 1)
