"""Workers of tests/test_delayed.py's default-semantics tests: ``workers.compare_deft_with_delayed_reference`` on
``models.CASES`` and on cases whose optimizer the compensation does not cover (``UNCOVERED``, added to ``CASES``
in the worker process)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models import CASES, DropoutMLP
from workers import compare_deft_with_delayed_reference


def _mlp_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


#: ``models.CASES`` entries with an optimizer ``delayed_update="auto"`` resolves to plain averaged delays for
UNCOVERED = {
    "mlp_dropout_rmsprop": (DropoutMLP, lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.5),
                            _mlp_batch, F.cross_entropy, {}, False),
    "mlp_dropout_plain_sgd": (DropoutMLP, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, weight_decay=1e-3),
                              _mlp_batch, F.cross_entropy, {}, True),
}


def default_semantics_run(rank: int, world_size: int, case: str, steps: int, delayed_update: str,
                          compiler: str | None = None) -> dict:
    """``compare_deft_with_delayed_reference`` with ``DeftConfig(delayed_update=...)`` on ``case`` (a ``CASES`` or an
    ``UNCOVERED`` one): the reference follows the semantics the step resolved (``step.config.delayed_update``)."""
    CASES.update(UNCOVERED)
    report = compare_deft_with_delayed_reference(rank, world_size, case, steps, "deft", 0.9, (), compiler,
                                                 delayed_update)
    return {**{key: report[key] for key in ("steps", "final", "delayed", "final_params", "pending_after_flush",
                                            "lowering_history")},
            "fills_uninitialized": torch.are_deterministic_algorithms_enabled()
            and torch.utils.deterministic.fill_uninitialized_memory}


def default_semantics_beside_compile(rank: int, world_size: int, case: str, steps: int) -> dict:
    """``default_route_workers.delayed_beside_compile`` with ``DeftConfig()``'s semantics on ``case`` (a ``CASES`` or an
    ``UNCOVERED`` one), on the default compiler: deft and the compiled yardstick against the eager reference of the
    semantics the step resolved, in one launch; also this process's vector ISA and kernel set."""
    from default_route_workers import delayed_beside_compile, on_default_route
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    CASES.update(UNCOVERED)
    result = on_default_route(rank, world_size, delayed_beside_compile, case, steps, "auto")
    result.update(isa=str(pick_vec_isa()), kernels=torch.backends.cpu.get_cpu_capability(),
                  fills_uninitialized=torch.are_deterministic_algorithms_enabled()
                  and torch.utils.deterministic.fill_uninitialized_memory)
    return result
