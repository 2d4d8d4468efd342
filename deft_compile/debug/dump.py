"""Graph dumps: the readable graph after every pass, with a node-count diff per pass."""

from __future__ import annotations

import collections
import json
import os
import re
from pathlib import Path

import torch.fx as fx

from deft_compile.debug.artifacts import log_graph_pass


def node_kinds(gm: fx.GraphModule) -> collections.Counter:
    """Count nodes by op (placeholders, outputs, and each call target)."""
    counts: collections.Counter = collections.Counter()
    for node in gm.graph.nodes:
        counts[node.op if node.op != "call_function" else _target_name(node.target)] += 1
    return counts


def _target_name(target: object) -> str:
    return str(getattr(target, "__name__", target)) if not hasattr(target, "_schema") else str(target)


class GraphDumper:
    """Writes ``NN_<pass>.py`` (readable code) per pass and ``passes.json`` (the diffs) into a folder.

    Created with ``directory=None`` it does nothing, so callers need no branches.
    """

    def __init__(self, directory: str | os.PathLike | None, graph_index: int = 0) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.graph_index = graph_index
        self._pass_count = 0
        self._previous: collections.Counter | None = None
        self._records: list[dict] = []
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def record(self, name: str, gm: fx.GraphModule) -> None:
        log_graph_pass(self.graph_index, self._pass_count, name, gm)  # TORCH_TRACE; free when it is off
        self._pass_count += 1
        if self.directory is None:
            return
        counts = node_kinds(gm)
        diff = {}
        if self._previous is not None:
            for kind in sorted(set(counts) | set(self._previous)):
                delta = counts[kind] - self._previous[kind]
                if delta:
                    diff[kind] = delta
        self._previous = counts
        index = len(self._records)
        filename = f"{index:02d}_{_slug(name)}.py"
        header = [
            f"# deft_compile graph after pass {index}: {name}",
            f"# nodes: {sum(counts.values())}",
            "# node-count change vs previous pass: "
            + (", ".join(f"{k} {v:+d}" for k, v in diff.items()) if diff else "none"),
            "",
        ]
        code = gm.print_readable(print_output=False, include_stride=False, include_device=False)
        # print_readable names the class after the traced lambda, which is not valid Python.
        code = code.replace("class <lambda>(", "class StepGraph(", 1)
        (self.directory / filename).write_text("\n".join(header) + code)
        self._records.append({"index": index, "pass": name, "file": filename, "nodes": sum(counts.values()), "diff": diff})
        (self.directory / "passes.json").write_text(json.dumps(self._records, indent=2))


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "_", name).strip("_") or "pass"
