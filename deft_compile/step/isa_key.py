"""Key Inductor's compile caches by the CPU vector instruction set its kernels are written for.

Rule: a cached compile is reused only under the vector ISA it was generated for.

Why: Inductor's C++ backend writes its loops for the ISA that ``torch._inductor.cpu_vec_isa.pick_vec_isa()``
returns (from the CPU, ``ATEN_CPU_CAPABILITY`` and ``inductor.config.cpp.simdlen``): a float loop steps by 16
elements under AVX-512 and by 8 under AVX2, and calls ``at::vec`` only where there is a vector ISA. The cached
source is compiled again with the ISA picked when it is loaded. Inductor's FX graph cache and AOTAutograd's
cache (torch 2.13) do not hash that pick, so a compile cached under one ISA is replayed under another:

* written for AVX-512, replayed under ``ATEN_CPU_CAPABILITY=avx2`` on the same host, every vector loop steps 16
  elements while its vectors hold 8, so half of each output is never written: garbage, with no error;
* written for a vector ISA, replayed with none (``ATEN_CPU_CAPABILITY=default``), it fails to compile and the
  region falls back to aten.

:func:`isa_cache_tag` names the pick, and :func:`keyed_by_isa` adds it to ``torch.compiler.config.cache_key_tag``
(a string every torch compile cache hashes) for the duration of one compile, keeping any tag the user set.
``tests/test_isa_cache_key.py`` holds the reproduction.

Rule: the ISAs' check starts in the background when a step that compiles with Inductor is made
(:func:`start_isa_check`), and a compile waits for it before it reads the pick.

Why: the first pick in a process checks every ISA the CPU lists by compiling a probe for it (cached on disk) and
loading it in a child interpreter (``cpu_vec_isa.valid_vec_isa_list``): on a warm cache, most of the first call's
compile time (docs/BENCHMARKS.md, "Inductor's ISA check in the background"). Started when the step is made, it
overlaps the first call's eager pass and capture; node timing (``profiler.time_graph_nodes``) waits for it
(:func:`wait_for_isa_check`), so its probe processes never share the cores with a timed run. The thread keeps the
process's CPU priority: at nice 19 its probes barely ran until the profile waited for them, and the first call
measured slower than with no background check.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Iterator

log = logging.getLogger(__name__)

_check_lock = threading.Lock()
_check: threading.Thread | None = None  # the background check (one per process), once started
FORK_WAIT_S = 60.0  # the longest a fork waits for the check (Inductor's probe timeout)


def start_isa_check() -> None:
    """Start Inductor's check of the CPU's vector ISAs in a daemon thread, unless one was started in this process
    already (or Inductor does not import: the first compile then reports it). The check reads Inductor's
    configuration and cache folder as they are now. Its result is Inductor's own cache; a check that fails there is
    made again, and reported, by the first compile."""
    global _check
    with _check_lock:
        if _check is not None:
            return
        try:
            from torch._inductor import cpu_vec_isa  # imported on the caller's thread
        except Exception as exc:  # noqa: BLE001 - the first compile imports Inductor and reports what is wrong
            log.debug("no background vector ISA check (%s: %s)", type(exc).__name__, exc)
            return
        check = threading.Thread(target=_check_quietly, args=(cpu_vec_isa.valid_vec_isa_list,),
                                 name="deft-vec-isa-check", daemon=True)
        check.start()
        _check = check  # only a started thread: the waits join it


def _check_quietly(valid_vec_isa_list) -> None:
    try:
        valid_vec_isa_list()
    except Exception as exc:  # noqa: BLE001 - not cached on failure: the compile that needs it checks again
        log.debug("the background vector ISA check failed (%s: %s)", type(exc).__name__, exc)


def _forget_check() -> None:
    """In a forked child: no check started in this process yet (the parent's thread is not the child's)."""
    global _check, _check_lock
    _check, _check_lock = None, threading.Lock()


def wait_for_isa_check(timeout_s: float | None = None) -> None:
    """Wait for :func:`start_isa_check`'s thread, where one runs (at most ``timeout_s``): before a pick (which would
    otherwise check the ISAs twice), before anything is timed, and before ``os.fork`` (``FORK_WAIT_S``: the child
    has no thread, so it would inherit neither the check's result nor its end, and could inherit a lock the thread
    held)."""
    check = _check
    if check is not None and check is not threading.current_thread():
        check.join(timeout_s)


# ``subprocess`` runs no fork hooks: the check's own probe processes do not wait for it
os.register_at_fork(before=lambda: wait_for_isa_check(FORK_WAIT_S), after_in_child=_forget_check)


def isa_cache_tag() -> str:
    """``"deft-vec-isa=<isa>"`` for the vector ISA Inductor generates CPU kernels for now (``INVALID_VEC_ISA``:
    scalar code)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    wait_for_isa_check()
    isa = pick_vec_isa()
    return f"deft-vec-isa={isa}/{isa.bit_width()}"


@contextlib.contextmanager
def keyed_by_isa() -> Iterator[str]:
    """Within the block, torch's compile caches key every entry by :func:`isa_cache_tag` as well as by the
    user's own ``cache_key_tag``; yields the tag in force."""
    import torch.compiler.config as compiler_config

    own = compiler_config.cache_key_tag
    tag = f"{own}|{isa_cache_tag()}" if own else isa_cache_tag()
    with compiler_config.patch(cache_key_tag=tag):
        yield tag
