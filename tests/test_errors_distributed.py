"""Bad distributed input fails with a clear error naming the cause, never a hang."""

from __future__ import annotations

import time

from deft_compile.tools.launcher import run_local_workers
from workers import dead_peer, mismatched_models


def test_models_that_differ_across_ranks_are_refused_before_training():
    results = run_local_workers(mismatched_models, 2, timeout_s=120)
    for result in results:
        message = result.value
        assert message.startswith("ModelMismatchError"), message
        assert "rank 1 differs from rank 0 in parameters" in message
        assert "(8, 4)" in message and "(9, 4)" in message


def test_dead_peer_is_named():
    started = time.monotonic()
    results = run_local_workers(dead_peer, 2, ("dies",), timeout_s=120, raise_on_failure=False)
    assert results[1].exitcode == 3
    message = results[0].value
    assert message is not None and message.startswith("PeerFailureError"), results[0].error
    assert "rank 1 did not respond" in message
    assert time.monotonic() - started < 60


def test_hung_peer_times_out_and_is_named(tmp_path):
    """Rank 1 stops answering after its first step (until rank 0 has given up on it: ``dead_peer``)."""
    results = run_local_workers(dead_peer, 2, ("hangs", str(tmp_path / "released")), timeout_s=120,
                                collective_timeout_s=3, raise_on_failure=False)
    assert results[1].value == "slept", results[1].error
    message = results[0].value
    assert message is not None and message.startswith("PeerFailureError"), results[0].error
    assert "rank 1 did not respond" in message
