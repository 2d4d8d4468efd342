"""Input shapes that change: compiles and wall-clock when every call brings its own sequence length.

    python benchmarks/shapes.py                                 # both parts, cold caches, 1 launch per variant
    python benchmarks/shapes.py --part sequence --launches 3 --out /tmp/shapes

Part ``sequence``, one process: a 4-layer character transformer (GPT-2 layout, width 128, 4 heads), AdamW, batches
of 8 with lengths 33, 41, 29, 57, 48, 36, three times (18 calls). Variants, each in a fresh process with a fresh
Inductor cache (cold), in rotating order across launches:

* ``deft``: ``deft_compile`` with every default (Inductor in regions);
* ``deft-graph``: ``DeftConfig(compiler="inductor-graph")``;
* ``deft-aten``: ``DeftConfig(compiler="aten")``;
* ``torch.compile``: ``torch.compile(model)`` (automatic dynamic shapes) with an eager AdamW;
* ``deft-marked``, ``torch.compile-marked``: ``deft`` and ``torch.compile``, each call's length marked with
  ``torch._dynamo.mark_dynamic``, so both capture it symbolic from the first call.

Per variant: wall-clock from the first call (construction, captures, compiles and planning included), Inductor
compiles (regions or graphs; Dynamo's graphs for ``torch.compile``), captures, and the losses (the ``deft``
variants' against ``deft-aten``'s).

Part ``trainer``, 2 gloo processes: a tiny ``transformers`` GPT-2 (from a config, random weights) fine-tuned for 50
steps with dynamic padding (each batch padded to its own longest sample, so every rank has its own length every
step), batch 4 per rank. Variants: the plain ``Trainer`` (DDP), ``Trainer`` with ``torch_compile=True``,
``DeftTrainer`` with its defaults, with ``dynamic_lengths=True`` (``deft-dynamic``: the length symbolic from the
first call) and with ``policy="wfbp"`` (DDP's numbers). Per variant: wall-clock of
``train()``, compiles and captures, the step's ``overheads`` (capture, compile, planning seconds), and the per-step
losses against the plain ``Trainer``'s. ``--warm``: each measured run reuses the Inductor cache that an unmeasured
run of the same variant filled just before it.

Results: ``<out>/shapes.json`` with provenance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LENGTHS = [33, 41, 29, 57, 48, 36] * 3
SEQUENCE_VARIANTS = ("deft", "deft-graph", "deft-aten", "torch.compile", "deft-marked", "torch.compile-marked")
TRAINER_VARIANTS = ("trainer", "trainer-compile", "deft", "deft-dynamic", "deft-wfbp")
VOCAB = 96


# -- part: sequence ---------------------------------------------------------------------------------------------


def sequence_worker(variant: str) -> dict[str, Any]:
    """One variant of the 18-call sequence in this process (see the module docstring)."""
    import torch

    from deft_compile import DeftConfig, deft_compile
    from deft_compile.tools.presets import GPT2Style

    started = time.perf_counter()
    torch.manual_seed(0)
    model = GPT2Style(vocab=VOCAB, dim=128, heads=4, layers=4, context=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (8, length + 1), generator=data) for length in LENGTHS]
    marked = variant.endswith("-marked")
    base = variant.removesuffix("-marked")
    if base == "torch.compile":
        compiled = torch.compile(model)

        def step(inputs, targets):
            optimizer.zero_grad(set_to_none=True)
            loss = compiled(inputs, targets)
            loss.backward()
            optimizer.step()
            return loss
    else:
        compiler = {"deft": "inductor", "deft-graph": "inductor-graph", "deft-aten": "aten"}[base]
        step = deft_compile(model, optimizer, config=DeftConfig(compiler=compiler))
    times, losses = [], []
    for tokens in batches:
        begun = time.perf_counter()
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if marked:  # the length is symbolic from the first call
            torch._dynamo.mark_dynamic(inputs, 1)
            torch._dynamo.mark_dynamic(targets, 1)
        losses.append(float(step(inputs, targets).detach()))
        times.append(time.perf_counter() - begun)
    result = {"variant": variant, "wall_s": time.perf_counter() - started, "step_s": times, "losses": losses}
    if base == "torch.compile":
        from torch._dynamo.utils import counters

        result["compiles"] = int(counters["stats"]["unique_graphs"])
    else:
        history = step.lowering.history
        per_region: dict[str, int] = {}
        for entry in history:
            per_region[entry.get("region", entry["graph"])] = per_region.get(entry.get("region", entry["graph"]), 0) + 1
        result.update(compiles=len(history), max_compiles_per_region=max(per_region.values(), default=0),
                      captures=step.capture_count, compile_s=step.overheads.get("compile_seconds"),
                      fallbacks=[e["fallback_reason"] for e in history if e.get("fallback_reason")])
    return result


def run_sequence(launches: int, variants: tuple[str, ...] = SEQUENCE_VARIANTS) -> list[dict[str, Any]]:
    runs = []
    for launch in range(launches):
        order = variants[launch % len(variants):] + variants[:launch % len(variants)]
        for variant in order:
            with tempfile.TemporaryDirectory(prefix="deft-shapes-cache-") as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
                done = subprocess.run([sys.executable, __file__, "--worker", variant], env=env, capture_output=True,
                                      text=True, timeout=3600)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                raise RuntimeError(f"{variant} failed ({done.returncode}):\n{done.stderr[-4000:]}")
            result = json.loads(lines[-1][len("RESULT "):]) | {"launch": launch}
            runs.append(result)
            print(f"sequence #{launch} {variant}: {result['wall_s']:.1f} s, {result['compiles']} compiles"
                  + (f", {result['captures']} captures, at most {result['max_compiles_per_region']} per region"
                     if "captures" in result else ""), flush=True)
    return runs


def summarise_sequence(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary = {}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        rows = [r for r in runs if r["variant"] == variant]
        walls = [r["wall_s"] for r in rows]
        summary[variant] = {"wall_s_median": statistics.median(walls), "wall_s_range": [min(walls), max(walls)],
                            "compiles": [r["compiles"] for r in rows]}
        if rows and "captures" in rows[0]:
            summary[variant].update(captures=[r["captures"] for r in rows],
                                    max_compiles_per_region=[r["max_compiles_per_region"] for r in rows])
    references = {r["launch"]: r["losses"] for r in runs if r["variant"] == "deft-aten"}
    for variant in [v for v in ("deft", "deft-graph", "deft-marked") if v in summary]:
        worst = [max(abs(a - b) / abs(b) for a, b in zip(r["losses"], references[r["launch"]]))
                 for r in runs if r["variant"] == variant and r["launch"] in references]
        summary[variant]["worst_loss_rel_vs_aten"] = max(worst, default=None)
    return summary


# -- part: trainer ----------------------------------------------------------------------------------------------


def _padded(samples: list[dict]) -> dict:
    """Dynamic padding: the batch padded to its own longest sample (labels -100 and attention mask 0 there)."""
    import torch

    length = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros(len(samples), length, dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, : len(sample["input_ids"])] = torch.tensor(sample["input_ids"])
        mask[row, : len(sample["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def trainer_worker(rank: int, world_size: int, variant: str, steps: int, output_dir: str,
                   return_params: bool = False) -> dict[str, Any]:
    """One rank of a dynamic-padding fine-tune (see the module docstring); ``return_params``: with the final
    parameters."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import transformers

    from deft_compile.integrations.transformers import DeftTrainer

    started = time.perf_counter()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    data = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 97, (steps * world_size * 4,), generator=data)
    dataset = [{"input_ids": torch.randint(1, 256, (int(n),), generator=data).tolist()} for n in lengths]
    args = transformers.TrainingArguments(
        output_dir=output_dir, use_cpu=True, per_device_train_batch_size=4, max_steps=steps, logging_steps=1,
        report_to=[], save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0, learning_rate=3e-4,
        torch_compile=variant == "trainer-compile")
    kwargs: dict[str, Any] = {}
    trainer_cls = transformers.Trainer
    if variant.startswith("deft"):
        trainer_cls = DeftTrainer
        kwargs["policy"] = "wfbp" if variant.startswith("deft-wfbp") else "deft"
        if variant.endswith("-dynamic"):  # this collator pads to the longest sample: say so
            kwargs["dynamic_lengths"] = True
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, data_collator=_padded, **kwargs)
    begun = time.perf_counter()
    trainer.train()
    result = {"variant": variant, "train_s": time.perf_counter() - begun, "wall_s": time.perf_counter() - started,
              "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}
    if return_params:
        result["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    step = getattr(trainer, "deft_step", None)
    if step is not None:
        result.update(compiles=len(step.lowering.history), captures=step.capture_count,
                      fallbacks=[e["fallback_reason"] for e in step.lowering.history if e.get("fallback_reason")],
                      overheads=dict(step.overheads))
    else:
        from torch._dynamo.utils import counters

        result["compiles"] = int(counters["stats"]["unique_graphs"])
    return result


def run_trainer(launches: int, steps: int, variants: tuple[str, ...] = TRAINER_VARIANTS,
                warm: bool = False) -> list[dict[str, Any]]:
    """``launches`` rounds of every variant (rotating order), each in fresh processes with a fresh Inductor cache;
    ``warm``: each measured run reuses the cache an unmeasured run of the same variant filled just before it."""
    from deft_compile.tools.launcher import run_local_workers

    def launch_once(variant: str, cache: str) -> list[dict[str, Any]]:
        with tempfile.TemporaryDirectory(prefix="deft-shapes-trainer-") as output:
            return [r.value for r in run_local_workers(
                trainer_worker, 2, (variant, steps, output), timeout_s=3600, collective_timeout_s=600,
                env={"TORCHINDUCTOR_CACHE_DIR": cache}, start_method="spawn")]

    runs = []
    for launch in range(launches):
        order = variants[launch % len(variants):] + variants[:launch % len(variants)]
        for variant in order:
            with tempfile.TemporaryDirectory(prefix="deft-shapes-cache-") as cache:
                if warm:
                    launch_once(variant, cache)  # fills the cache; not measured
                values = launch_once(variant, cache)
            result = values[0] | {"launch": launch, "cache": "warm" if warm else "cold", "rank1": values[1]}
            runs.append(result)
            print(f"trainer #{launch} {variant} ({result['cache']}): train {result['train_s']:.1f} s, "
                  f"{result.get('compiles')} compiles, {result.get('captures', '-')} captures", flush=True)
    return runs


def summarise_trainer(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary = {}
    references = {r["launch"]: r["losses"] for r in runs if r["variant"] == "trainer"}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        rows = [r for r in runs if r["variant"] == variant]
        trains = [r["train_s"] for r in rows]
        worst = [max(abs(a - b) / abs(b) for a, b in zip(r["losses"], references[r["launch"]])) for r in rows
                 if r["launch"] in references]
        summary[variant] = {"train_s_median": statistics.median(trains), "train_s_range": [min(trains), max(trains)],
                            "compiles": [r.get("compiles") for r in rows],
                            "captures": [r.get("captures") for r in rows],
                            "worst_loss_rel_vs_trainer": max(worst, default=None)}
    return summary


def _chosen(names: str | None, variants: tuple[str, ...]) -> tuple[str, ...]:
    """The part's variants that ``--variants`` names, in the part's order (all of them without ``--variants``)."""
    return variants if not names else tuple(v for v in variants if v in names.split(","))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "sequence", "trainer"), default="all")
    parser.add_argument("--launches", type=int, default=1, help="launches of each variant (rotating order)")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps of the trainer part")
    parser.add_argument("--out", default="shapes_out")
    parser.add_argument("--variants", help="a comma-separated subset of the part's variants (default: all of them; "
                        "the losses compare with deft-aten's and the plain trainer's where those run)")
    parser.add_argument("--warm", action="store_true", help="trainer part: measure each variant on the Inductor cache "
                        "an unmeasured run of it filled (default: a fresh, cold cache)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(sequence_worker(args.worker)), flush=True)
        return 0
    from deft_compile.tools.provenance import provenance

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"provenance": provenance(), "lengths": LENGTHS}
    if args.part in ("all", "sequence"):
        runs = run_sequence(args.launches, _chosen(args.variants, SEQUENCE_VARIANTS))
        report["sequence"] = {"runs": runs, "summary": summarise_sequence(runs)}
        (out / "shapes.json").write_text(json.dumps(report, indent=1))
    if args.part in ("all", "trainer"):
        runs = run_trainer(args.launches, args.steps, _chosen(args.variants, TRAINER_VARIANTS), warm=args.warm)
        report["trainer"] = {"runs": runs, "summary": summarise_trainer(runs)}
    (out / "shapes.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({part: report[part]["summary"] for part in ("sequence", "trainer") if part in report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
