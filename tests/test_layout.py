"""The package's shape: old import paths still work, no import cycles, policies' run-time hooks."""

from __future__ import annotations

import ast
import collections
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "old, new",
    [
        ("deft_compile.plan", "deft_compile.planner.plan"),
        ("deft_compile.simulator", "deft_compile.planner.simulator"),
        ("deft_compile.solvers", "deft_compile.planner.solvers"),
    ],
)
def test_old_import_paths_are_the_same_modules(old: str, new: str) -> None:
    assert importlib.import_module(old) is importlib.import_module(new)


def test_old_style_from_imports_work() -> None:
    from deft_compile.plan import Plan, Profile  # noqa: F401
    from deft_compile.simulator import simulate  # noqa: F401
    from deft_compile.solvers import POLICIES, solve  # noqa: F401

    assert "deft" in POLICIES


def _module_graph() -> dict[str, set[str]]:
    """Every import (function-level ones too) between modules of the package."""
    modules: dict[str, pathlib.Path] = {}
    for path in list((ROOT / "deft_compile").rglob("*.py")) + list((ROOT / "passes").glob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "passes":
            parts = ["deft_compile", "passes"] + parts[1:]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            edges[name].update(t for t in targets if t in modules and t != name)
    return edges


def test_no_import_cycles() -> None:
    edges = _module_graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_layering() -> None:
    """passes depend only on the graph vocabulary; the Preserver never imports the step; the pure planner
    (everything in planner/ but the profiler) imports neither torch nor the step."""
    edges = _module_graph()
    for module, targets in edges.items():
        if module.startswith("deft_compile.passes"):
            assert all(t.startswith(("deft_compile.passes", "deft_compile.ir")) for t in targets), (module, targets)
        if module.startswith("deft_compile.preserver"):
            assert not any(t.startswith("deft_compile.step") for t in targets), (module, targets)
    for path in (ROOT / "deft_compile" / "planner").rglob("*.py"):
        if path.name == "profiler.py":
            continue
        tree = ast.parse(path.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(m == "torch" or m.startswith(("torch.", "deft_compile.step")) for m in imported), path


def test_runtime_knows_no_policy_by_name() -> None:
    source = (ROOT / "deft_compile" / "step" / "runtime.py").read_text()
    from deft_compile.planner.solvers import POLICIES

    for policy in POLICIES:
        assert f'"{policy}"' not in source and f"'{policy}'" not in source, policy


def test_policy_runtime_hooks() -> None:
    from deft_compile.planner.solvers import POLICIES
    from deft_compile.step.policy_runtime import DSSyncRuntime, PolicyRuntime, register_runtime, runtime_for

    runtimes = {policy: runtime_for(policy) for policy in POLICIES}
    assert not runtimes["wfbp"].needs_profile and runtimes["wfbp"].uses_buckets
    assert runtimes["deft"].watched_by_preserver and runtimes["deft"].needs_profile
    assert isinstance(runtimes["dssync"], DSSyncRuntime)
    assert type(runtimes["usbyte"]) is PolicyRuntime  # plan-only policies get the base class
    assert runtime_for("deft") is not runtime_for("deft")  # one per compiled step: no shared state

    from deft_compile import DeftConfig

    assert runtimes["deft"].solver_defaults(DeftConfig(accumulation_steps=2)) == {"allow_period": False}
    assert runtimes["deft"].solver_defaults(DeftConfig()) == {} and runtimes["wfbp"].solver_defaults(DeftConfig()) == {}

    class Custom(PolicyRuntime):
        needs_profile = False

    register_runtime("custom-test-policy", Custom)
    assert isinstance(runtime_for("custom-test-policy"), Custom)
