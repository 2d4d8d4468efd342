"""``deft_compile.checkpoint``: a deft step (delaying plan, the Preserver on; SGD with Nesterov momentum and Dropout),
saved with torch.distributed.checkpoint on 2 ranks and resumed on a fresh process pair, bit-identical to
the run that never stopped: parameters, gradients, optimizer state, pending gradients, the Preserver's state and
an LR scheduler saved beside them. The three runs (straight, saved, resumed) go in one process pair, in turn
(tests/batched.py)."""

from __future__ import annotations

import pytest

from batched import Case, launch_cases
from integration_workers import assert_resumed_as_straight, dcp_checkpoint_run

CASE = "mlp_dropout_sgd"
STOP = 6
SAVE_AT = [1]


@pytest.fixture(scope="module")
def outcome(request, tmp_path_factory):
    """The per-rank values of each run by key: straight to ``STOP``; to each ``SAVE_AT``, saved; resumed from there."""
    folder = tmp_path_factory.mktemp("dcp")
    cases = [Case("straight", dcp_checkpoint_run, (CASE, 0, STOP, None, None),
                  tests=tuple(f"test_dcp_checkpoint_resumes_bit_identically[{save_at}]" for save_at in SAVE_AT))]
    for save_at in SAVE_AT:
        path, test = str(folder / f"ckpt-{save_at}"), (f"test_dcp_checkpoint_resumes_bit_identically[{save_at}]",)
        cases += [Case(("first", save_at), dcp_checkpoint_run, (CASE, 0, save_at, None, path), tests=test),
                  Case(("resumed", save_at), dcp_checkpoint_run, (CASE, save_at, STOP, path, None), tests=test)]
    return launch_cases(request, cases)


@pytest.mark.parametrize("save_at", SAVE_AT)
def test_dcp_checkpoint_resumes_bit_identically(outcome, save_at):
    """Saved after step 1: pending gradients, and the delayed buckets' parameters have no optimizer state yet."""
    first, straight, resumed = outcome(("first", save_at)), outcome("straight"), outcome(("resumed", save_at))
    for rank in range(2):
        saved, expected, actual = first[rank], straight[rank], resumed[rank]
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
