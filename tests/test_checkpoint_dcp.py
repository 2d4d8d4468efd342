"""``deft_compile.checkpoint``: a deft step (delaying plan, the Preserver on; SGD with Nesterov momentum and Dropout),
saved with torch.distributed.checkpoint on 2 ranks and resumed on a fresh process pair, bit-identical to
the run that never stopped: parameters, gradients, optimizer state, pending gradients, the Preserver's state and
an LR scheduler saved beside them."""

from __future__ import annotations

import pytest

from deft_compile.tools.launcher import run_local_workers
from integration_workers import assert_resumed_as_straight, dcp_checkpoint_run

CASE = "mlp_dropout_sgd"
STOP = 6


@pytest.fixture(scope="module")
def straight() -> list:
    return [r.value for r in run_local_workers(dcp_checkpoint_run, 2, (CASE, 0, STOP, None, None), timeout_s=240)]


@pytest.mark.parametrize("save_at", [1])
def test_dcp_checkpoint_resumes_bit_identically(tmp_path, straight, save_at):
    """Saved after step 1: pending gradients, and the delayed buckets' parameters have no optimizer state yet."""
    path = str(tmp_path / "ckpt")
    first = run_local_workers(dcp_checkpoint_run, 2, (CASE, 0, save_at, None, path), timeout_s=240)
    resumed = run_local_workers(dcp_checkpoint_run, 2, (CASE, save_at, STOP, path, None), timeout_s=240)
    for rank in range(2):
        saved, expected, actual = first[rank].value, straight[rank], resumed[rank].value
        assert saved["delayed"] > 0 and saved["pending_before_save"] > 0, "the checkpoint must carry pending gradients"
        if save_at == 1:
            assert saved["stateless_params"] > 0, "some parameters must have no optimizer state at the save"
        assert actual["step_count"] == expected["step_count"] == STOP
        assert actual["lr"] == expected["lr"]
        assert_resumed_as_straight(rank, expected, actual)
        assert expected["preserver"] is not None
        # its attribution budget holds wall-clock seconds (never equal across runs): the steps it counted carry on
        assert actual["preserver"]["attribution_budget"]["steps"] == expected["preserver"]["attribution_budget"]["steps"]
        assert ({k: v for k, v in actual["preserver"].items() if k != "attribution_budget"}
                == {k: v for k, v in expected["preserver"].items() if k != "attribution_budget"})
