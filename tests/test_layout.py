"""The package's shape (docs/ARCHITECTURE.md, "Layering"): no import cycles, what each layer may not import,
where the profiler lives, that the step names no policy, that the package holds only the library and what the
CLI runs, one version number, how big a class or function may be, and the policies' run-time hooks."""

from __future__ import annotations

import ast
import collections
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 120


def _modules() -> dict[str, pathlib.Path]:
    modules: dict[str, pathlib.Path] = {}
    for path in list((ROOT / "deft_compile").rglob("*.py")) + list((ROOT / "passes").glob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "passes":
            parts = ["deft_compile", "passes"] + parts[1:]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imports(path: pathlib.Path) -> set[str]:
    """Every module name an import in ``path`` names (function-level imports too; ``from a import b`` names ``a``
    and ``a.b``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def _module_graph() -> dict[str, set[str]]:
    """Every import (function-level ones too) between modules of the package."""
    modules = _modules()
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in modules.items():
        edges[name].update(t for t in _imports(path) if t in modules and t != name)
    return edges


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


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


#: (what, which modules, what they may not import); None: nothing of the package but the passes and ``ir``
RULES = [
    ("the passes depend only on the graph vocabulary", ("deft_compile.passes",), None),
    ("the planner is pure: no torch, no step, no Preserver, no CLI", ("deft_compile.planner",),
     ("torch", "deft_compile.step", "deft_compile.preserver", "deft_compile.backend", "deft_compile.tools",
      "deft_compile.debug", "deft_compile.config", "deft_compile.api")),
    ("the Preserver watches the step through WatchedStep, never imports it", ("deft_compile.preserver",),
     ("deft_compile.step", "deft_compile.backend", "deft_compile.tools", "deft_compile.api")),
    ("the configuration imports nothing from the step", ("deft_compile.config",),
     ("deft_compile.step", "deft_compile.backend", "deft_compile.tools", "deft_compile.api")),
    ("the step imports no benchmark or CLI code", ("deft_compile.step",), ("deft_compile.tools", "deft_compile.api")),
    ("only the CLI imports the CLI", ("deft_compile",), ("deft_compile.tools",)),
    ("the step's parts never import the step users call", ("deft_compile.step",), ("deft_compile.step.runtime",)),
]
#: modules a rule's layer leaves out: the CLI imports itself, the step's façade is itself
EXCEPT = {"only the CLI imports the CLI": ("deft_compile.tools",),
          "the step's parts never import the step users call": ("deft_compile.step.runtime",)}


@pytest.mark.parametrize("rule", RULES, ids=[rule[0] for rule in RULES])
def test_layers(rule) -> None:
    what, layer, forbidden = rule
    modules = _modules()
    broken = []
    for name, path in modules.items():
        if not _in(name, *layer) or _in(name, *EXCEPT.get(what, ())):
            continue
        for target in _imports(path):
            if forbidden is None:  # the passes: only passes and ir of the package, anything else outside it
                bad = _in(target, "deft_compile") and not _in(target, "deft_compile.passes", "deft_compile.ir")
            else:
                bad = any(_in(target, f) for f in forbidden)
            if bad:
                broken.append((name, target))
    assert not broken, broken


def test_the_profiler_is_in_the_step() -> None:
    """The profiler runs captured graphs and times collectives: it lives in step/ and the planner gets its numbers
    as a ``Profile``; the link fit it uses is the planner's (pure)."""
    modules = _modules()
    assert "deft_compile.step.profiler" in modules and "deft_compile.planner.profiler" not in modules
    assert "deft_compile.planner.link_fit" in _module_graph()["deft_compile.step.profiler"]


def test_the_step_knows_no_policy_by_name() -> None:
    """No module of step/ names a policy in its code; ``policy_runtime`` is the one place that maps policy names
    to run-time hooks, and the planner's closed-loop rules name the policies they treat apart."""
    from deft_compile.planner.solvers import POLICIES

    named = []
    for path in (ROOT / "deft_compile" / "step").glob("*.py"):
        if path.name == "policy_runtime.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in POLICIES:
                named.append((path.name, node.value, node.lineno))
    assert not named, named


def test_the_package_is_the_library() -> None:
    """Everything in ``deft_compile.tools`` is something the ``deft-compile`` CLI runs (reachable from
    ``tools.cli``); benchmark harnesses live in ``benchmarks/``. No alias modules."""
    edges = _module_graph()
    reached, todo = set(), ["deft_compile.tools.cli"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(edges[module])
    tools = {name for name in _modules() if _in(name, "deft_compile.tools") and name != "deft_compile.tools"}
    assert tools <= reached, sorted(tools - reached)
    for alias in ("plan", "simulator", "solvers"):
        assert not (ROOT / "deft_compile" / f"{alias}.py").exists(), alias


def test_one_version_number() -> None:
    """``deft_compile.__version__`` is the version; the package metadata reads it."""
    import deft_compile

    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'version = { attr = "deft_compile.__version__" }' in pyproject
    assert "\nversion =" not in pyproject.split("[project]")[1].split("\n[")[0]
    assert deft_compile.__version__.count(".") == 2


def test_no_class_or_function_is_too_big() -> None:
    """No class over ``MAX_CLASS_LINES`` lines and no function over ``MAX_FUNCTION_LINES`` in ``deft_compile/``."""
    too_big = []
    for path in (ROOT / "deft_compile").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            limit = (MAX_CLASS_LINES if isinstance(node, ast.ClassDef)
                     else MAX_FUNCTION_LINES if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
            if limit is not None and node.end_lineno - node.lineno + 1 > limit:
                too_big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                               f"({node.end_lineno - node.lineno + 1} lines)")
    assert not too_big, too_big


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


def test_no_part_of_the_step_holds_the_step_users_call() -> None:
    """The runner, its graph cache, the planning owner and the controllers' handle hold the step's parts, never the
    ``CompiledStep`` itself: a controller changes the step only through the handle's ``switch_plan``."""
    import torch

    from deft_compile import DeftConfig, deft_compile
    from deft_compile.step.handle import StepHandle

    model = torch.nn.Linear(4, 2)
    step = deft_compile(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                        config=DeftConfig(compiler="aten"))
    step(torch.randn(3, 4), torch.randn(3, 2))
    parts = [step.runner, step.runner.cache, step.planning, step.planning.handle]
    assert isinstance(step.planning.handle, StepHandle)
    held = [(type(part).__name__, name) for part in parts for name, value in vars(part).items() if value is step]
    assert not held, f"parts hold the step users call: {held}"
    assert step.planning.handle.step_count == step.step_count == 1 and step.planning.handle.graph is step.graph
    # what the Preserver's trader reads through the handle
    assert step.planning.handle.closed_loop is step.closed_loop
    assert step.planning.handle.last_trace_seconds == step.last_trace_seconds > 0
    # everything the Preserver's protocol names, the handle answers (the trader reads it without defaults)
    from deft_compile.preserver.monitor import WatchedStep

    named = set(WatchedStep.__annotations__) | {n for n in vars(WatchedStep) if not n.startswith("_")}
    missing = sorted(n for n in named if not hasattr(step.planning.handle, n))
    assert not missing, f"WatchedStep names what the handle lacks: {missing}"
