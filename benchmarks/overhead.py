"""Overhead of the compiled step against plain eager training, one process, no communication.

    python benchmarks/overhead.py [--steps 60] [--json out.json]
    python benchmarks/overhead.py --presets resnet50 bert-base-hf [--compiler aten|inductor]
    python benchmarks/overhead.py --presets resnet50 --fake-world 2


For each model the compiled step and eager training (``zero_grad``, forward,
``backward``, ``optimizer.step``) run in alternating blocks, in the same process,
on the same data; the ratio of their median step times is reported, with the time the
first compiled steps spent tracing. One intra-op thread, as in the distributed
runs. Target: compiled / eager <= 1.05.

``--presets`` measures bench models instead (``deft-compile bench --model`` names: the suite's
VGG-16-BN, ResNet-50, GPT-2 and BERT among them) with their own optimizer, loss and batch: it
tells whether a gap between compiled ``wfbp`` and torch DDP in the suite is in the step's
execution or in its communication.

``--fake-world N`` (with ``--presets``) runs both sides as rank 0 of an N-rank fake process group
(``torch.testing._internal.distributed.fake_pg``: every collective returns at once): the compiled
``wfbp`` step with its buckets, launches, waits and buffer broadcast, against torch DDP whose comm
hook returns the bucket at once. No byte moves, so the ratio is the compute thread's cost of
communicating, bookkeeping included: the part of a suite gap that no link explains.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from deft_compile import DeftConfig, deft_compile
from deft_compile.tools.bench import eager_step
from deft_compile.tools.bench_models import resolve_model
from lm_models import lm_loss


def mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(10):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(1024, 10))


class SmallTransformer(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 4, context: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(context, dim))
        block = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")), 1), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


MODELS = {
    "mlp-10x1024": (mlp, lambda g: (torch.randn(64, 1024, generator=g), torch.randint(0, 10, (64,), generator=g)), F.cross_entropy),
    "transformer-4x128": (
        SmallTransformer,
        lambda g: (torch.randint(0, 512, (8, 64), generator=g), torch.randint(0, 512, (8, 64), generator=g)),
        lm_loss,
    ),
}


def measure(name: str, steps: int, optimizer: str) -> dict:
    make_model, make_batch, loss_fn = MODELS[name]
    torch.manual_seed(0)
    eager_model = make_model()
    compiled_model = copy.deepcopy(eager_model)

    def make_opt(model: nn.Module) -> torch.optim.Optimizer:
        if optimizer == "adamw":
            return torch.optim.AdamW(model.parameters(), lr=1e-4)
        return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    step = deft_compile(compiled_model, make_opt(compiled_model), loss_fn)
    batch = (make_batch(torch.Generator().manual_seed(0)), {})
    return _compare(name, optimizer, eager_step(eager_model, make_opt(eager_model), loss_fn), step, batch, steps)


def measure_preset(name: str, steps: int, compiler: str, fake_world: bool = False) -> dict:
    """Compiled (``policy="wfbp"``) against eager for one bench model, its own optimizer. With ``fake_world``
    (a fake process group is initialised) the eager side is torch DDP with a comm hook that returns at once."""
    preset = resolve_model(name)
    eager_model, eager_opt, loss_fn, args, kwargs = preset.make(seed=0)
    compiled_model, compiled_opt, _, _, _ = preset.make(seed=0)
    step = deft_compile(compiled_model, compiled_opt, loss_fn, policy="wfbp", config=DeftConfig(compiler=compiler))
    if fake_world:
        ddp = torch.nn.parallel.DistributedDataParallel(eager_model)
        ddp.register_comm_hook(None, _returns_at_once)
        eager_model = ddp
    return _compare(name, type(eager_opt).__name__.lower(), eager_step(eager_model, eager_opt, loss_fn),
                    step, (args, kwargs), steps)


def _returns_at_once(state, bucket):  # noqa: ANN001 - DDP checks the annotations, which are strings in this module
    """A DDP comm hook that averages nothing over the wire: the bucket scaled as DDP's default hook scales it
    (torch's ``debugging_hooks.noop_hook`` leaves out that scaling, which the compiled step does)."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer().div_(dist.get_world_size()))
    return future


def _compare(name: str, optimizer: str, eager: Callable[..., torch.Tensor], step: Any,
             batch: tuple[tuple[Any, ...], dict[str, Any]], steps: int) -> dict:
    args, kwargs = batch
    trace_started = time.perf_counter()
    step(*args, **kwargs)  # first-step graph (creates optimizer state)
    step(*args, **kwargs)  # steady graph
    trace_seconds = time.perf_counter() - trace_started
    eager(*args, **kwargs)
    eager(*args, **kwargs)
    eager_times: list[float] = []
    compiled_times: list[float] = []
    # Alternating blocks (ABAB...) so drifts in machine load hit both equally. Not
    # step-by-step interleaving: glibc hands memory freed by one loop to the next
    # one, which then skips the page faults of its large gradient buffers and
    # looks ~30 % faster than it is.
    block = max(1, steps // 6)
    for _ in range(0, steps, block):
        for fn, times in ((eager, eager_times), (step, compiled_times)):
            fn(*args, **kwargs)  # settle the allocator for this loop
            for _ in range(block):
                started = time.perf_counter()
                fn(*args, **kwargs)
                times.append(time.perf_counter() - started)
    eager_median, compiled_median = statistics.median(eager_times), statistics.median(compiled_times)
    return {
        "model": name,
        "optimizer": optimizer,
        "eager_ms": eager_median * 1e3,
        "compiled_ms": compiled_median * 1e3,
        "ratio": compiled_median / eager_median,
        "trace_s": trace_seconds,
        "graph_nodes": len(step.graph.graph_module.graph.nodes),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", default=None)
    parser.add_argument("--presets", nargs="+", default=None, metavar="MODEL",
                        help="bench models to measure instead of the built-in pair (e.g. resnet50 bert-base-hf)")
    parser.add_argument("--compiler", choices=("aten", "inductor"), default="aten",
                        help="DeftConfig.compiler for --presets (the suite's default is aten)")
    parser.add_argument("--fake-world", type=int, default=None, metavar="N",
                        help="with --presets: rank 0 of an N-rank fake process group, compiled wfbp against DDP "
                             "whose collectives return at once (the compute thread's cost of communicating)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.fake_world and not args.presets:
        parser.error("--fake-world needs --presets")
    if args.fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world)
    try:
        if args.presets:
            rows = [measure_preset(name, args.steps, args.compiler, bool(args.fake_world)) for name in args.presets]
        else:
            rows = [measure(name, args.steps, opt) for name in MODELS for opt in ("sgd", "adamw")]
    finally:
        if args.fake_world:
            dist.destroy_process_group()
    print(f"{'model':<20}{'optimizer':<10}{'eager ms':>10}{'compiled ms':>13}{'ratio':>8}{'trace s':>9}{'nodes':>7}")
    for r in rows:
        print(
            f"{r['model']:<20}{r['optimizer']:<10}{r['eager_ms']:>10.2f}{r['compiled_ms']:>13.2f}"
            f"{r['ratio']:>7.3f}x{r['trace_s']:>9.2f}{r['graph_nodes']:>7}"
        )
    if args.json:
        from deft_compile.tools.provenance import provenance

        with open(args.json, "w") as f:
            json.dump({"provenance": provenance(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
