"""``deft-compile demo``: DDP and the compiled step side by side on 2 local gloo workers."""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from deft_compile.api import deft_compile
from deft_compile.launcher import run_local_workers


def demo_model() -> nn.Module:
    """A small MLP classifier: big enough that communication is visible, small enough for 2 cores."""
    return nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(512, 512), nn.ReLU(),
        nn.Linear(512, 512), nn.ReLU(),
        nn.Linear(512, 10),
    )


def _batches(rank: int, steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    teacher = torch.randn(256, 10, generator=g.manual_seed(0))
    g.manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, 256, generator=g)
        out.append((x, (x @ teacher).argmax(dim=1)))
    return out


def _train(step_fn, batches, progress, label: str) -> tuple[list[float], list[float]]:
    losses, times = [], []
    for x, y in batches:
        started = time.perf_counter()
        loss = step_fn(x, y)
        times.append(time.perf_counter() - started)
        losses.append(float(loss))
        if progress is not None:
            progress.set_postfix_str(f"{label} loss {losses[-1]:.3f}")
            progress.update(1)
    return losses, times


def demo_worker(rank: int, world_size: int, steps: int, batch: int) -> dict:
    from tqdm import tqdm

    torch.manual_seed(0)
    base = demo_model()
    batches = _batches(rank, steps, batch)
    progress = tqdm(total=2 * steps, desc="demo (rank 0)", unit="step") if rank == 0 else None

    ddp_model = copy.deepcopy(base)
    ddp = DistributedDataParallel(ddp_model)
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)

    def ddp_step(x, y):
        ddp_opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        ddp_opt.step()
        return loss.detach()

    deft_model = copy.deepcopy(base)
    deft_step = deft_compile(
        deft_model, torch.optim.SGD(deft_model.parameters(), lr=0.05, momentum=0.9), F.cross_entropy, policy="wfbp"
    )
    results = {}
    for label, fn in (("torch DDP", ddp_step), ("deft_compile wfbp", deft_step)):
        torch.manual_seed(rank)
        results[label] = _train(fn, batches, progress, label)
    if progress is not None:
        progress.close()
    same = all(torch.equal(a, b) for a, b in zip(ddp_model.parameters(), deft_model.parameters()))
    return {"results": results, "identical_parameters": same}


@dataclass
class DemoRow:
    name: str
    median_ms: float
    ratio: float
    final_loss: float


def run_demo(steps: int = 60, batch: int = 64, warmup: int = 5) -> int:
    """Run the demo and print a table; returns a process exit code."""
    print(f"deft_compile demo: 2 local gloo workers, {steps} steps each for torch DDP and the compiled step")
    results = run_local_workers(demo_worker, 2, (steps, batch), timeout_s=600)
    rank0 = results[0].value
    ddp_losses, ddp_times = rank0["results"]["torch DDP"]
    ddp_median = statistics.median(ddp_times[warmup:])
    rows = []
    for name, (losses, times) in rank0["results"].items():
        median = statistics.median(times[warmup:])
        rows.append(DemoRow(name, median * 1e3, median / ddp_median, losses[-1]))
    print(f"\n{'run':<22}{'median step (ms)':>18}{'vs DDP':>9}{'final loss':>12}")
    for row in rows:
        print(f"{row.name:<22}{row.median_ms:>18.2f}{row.ratio:>8.2f}x{row.final_loss:>12.4f}")
    identical = all(r.value["identical_parameters"] for r in results)
    print(f"\nparameters after training identical to torch DDP on every rank: {identical}")
    print(f"(median over steps {warmup}..{steps - 1}; step 0 and 1 of the compiled run include tracing)")
    return 0 if identical else 1
