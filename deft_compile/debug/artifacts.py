"""Debugging artifacts: plan/profile files, simulated and measured timelines, a Gantt chart, TORCH_TRACE.

Everything here is opt-in and side-effect free for training:

* ``write_plan_artifacts(directory, profile, plan)`` writes ``plan.txt``,
  ``plan.json``, ``profile.json``, ``timeline_simulated.json`` (Chrome trace,
  open in https://ui.perfetto.dev) and ``timeline_simulated.png`` (Gantt of the
  compute stream and every link's stream).
* ``measured_timeline(run_step, path)`` runs one real step under
  ``torch.profiler`` and exports its Chrome trace (the gloo collectives show up
  as ``gloo:all_reduce`` spans on their own thread).
* ``log_structured(name, payload)`` emits a ``torch._logging`` structured
  "artifact" record, so ``TORCH_TRACE=dir`` (read with ``tlparse``) captures
  deft_compile's plan, profile and per-pass graphs next to torch's own.
* ``record_plan`` / ``log_graph_pass`` are the two calls the runtime makes.

matplotlib is optional (extra ``plot``): without it the PNG is skipped with a
warning. See docs/DEBUGGING.md.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from deft_compile.planner.plan import Plan, Profile

if TYPE_CHECKING:  # pragma: no cover
    from deft_compile.planner.simulator import Timeline

log = logging.getLogger("deft_compile")

#: Prefix of every structured-trace artifact name deft_compile emits.
TRACE_PREFIX = "deft_"

# Gantt colours by compute kind and by communication window.
COMPUTE_COLOURS = {"forward": "#4c72b0", "loss": "#8172b2", "backward": "#dd8452", "update": "#55a868",
                   "wait": "#c0c0c0"}
WINDOW_COLOURS = {"backward": "#937860", "exposed": "#c44e52", "forward-next": "#da8bc3",
                  "backward-next": "#8c613c", None: "#7f7f7f"}


# --- plan, profile, simulated timeline -------------------------------------------------


def write_plan_artifacts(directory: str | os.PathLike, profile: Profile, plan: Plan, *,
                         timeline: "Timeline | None" = None) -> list[Path]:
    """Write the plan, the profile and the simulated timeline into ``directory``; return the paths.

    Files: ``plan.txt`` (``plan.table(profile)`` plus the simulated summary),
    ``plan.json`` (``Plan.from_json`` gives back the same ``hash()``),
    ``profile.json`` (``Profile.from_json``), ``timeline_simulated.json``
    (Chrome trace of ``simulate(profile, plan)``) and ``timeline_simulated.png``
    (Gantt; skipped with a warning when matplotlib is missing). ``timeline``
    may be passed to reuse an already simulated one (recorded spans needed).
    """
    from deft_compile.planner.simulator import coverage_rate, simulate

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if timeline is None or not timeline.compute_events():
        timeline = simulate(profile, plan)
    written: list[Path] = []

    def write(name: str, text: str) -> None:
        path = directory / name
        path.write_text(text)
        written.append(path)

    write("plan.txt", plan.table(profile) + "\n\n" + describe_timeline(profile, plan, timeline,
                                                                         coverage_rate(profile, plan)) + "\n")
    write("plan.json", plan.to_json(indent=2) + "\n")
    write("profile.json", json.dumps(profile.to_dict(), indent=2, sort_keys=True) + "\n")
    write("timeline_simulated.json", json.dumps(timeline.to_chrome_trace()))
    png = directory / "timeline_simulated.png"
    if gantt_png(timeline, png, gantt_title(profile, plan, timeline), plan=plan) is not None:
        written.append(png)
    log.info("wrote plan artifacts (%s, hash %s) to %s", plan.policy, plan.hash()[:12], directory)
    return written


def describe_timeline(profile: Profile, plan: Plan, timeline: "Timeline", coverage: float | None = None) -> str:
    """A few lines: predicted iteration, compute, exposed communication, link busy time, CR."""
    lines = [f"simulated ({plan.policy}): iteration {timeline.iteration_ms:.3f} ms, compute "
             f"{timeline.compute_ms:.3f} ms (floor {timeline.floor_ms:.3f}), exposed communication "
             f"{timeline.exposed_comm_ms:.3f} ms"]
    for index, (link, busy) in enumerate(zip(profile.links, timeline.link_busy_ms)):
        lines.append(f"link {index} ({link.name}: alpha {link.alpha_ms:.4f} ms, "
                     f"{_gbps(link):.2f} Gbit/s effective): busy {busy:.3f} ms per step")
    if coverage is not None:
        lines.append(f"coverage rate (busiest link's comm / (T_F + T_B)): {coverage:.3f}")
    return "\n".join(lines)


def _gbps(link: Any) -> float:
    return 8.0 / link.beta_ms_per_byte / 1e6 if link.beta_ms_per_byte > 0 else float("inf")


def gantt_title(profile: Profile, plan: Plan, timeline: "Timeline") -> str:
    name = f"{profile.name}: " if profile.name else ""
    return f"{name}{plan.policy}, predicted {timeline.iteration_ms:.2f} ms/iteration"


# --- Gantt ------------------------------------------------------------------------------


@dataclass
class Gantt:
    """What ``gantt_png`` drew: row labels (top to bottom), bars per row, the programs shown."""

    path: Path
    rows: list[str]
    bars: dict[str, int] = field(default_factory=dict)
    programs: tuple[int, int] = (0, 0)


def _pyplot() -> Any | None:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


@dataclass
class _Bar:
    row: str
    start: float
    end: float
    kind: str
    colour: str
    label: str = ""


def _draw_gantt(path: Path, rows: list[str], bars: list[_Bar], *, origin: float, horizon: float,
                title: str | None, xlabel: str, marks: list[float] = (), legend_order: list[str] = ()
                ) -> dict[str, int] | None:
    """Draw ``bars`` clipped to ``[origin, horizon)`` on ``rows`` (top to bottom); bars drawn per row."""
    plt = _pyplot()
    if plt is None:
        log.warning("matplotlib is not installed (pip install 'deft-compile[plot]'): skipping %s", path)
        return None
    from matplotlib.patches import Patch

    counts = {row: 0 for row in rows}
    y_of = {row: len(rows) - 1 - i for i, row in enumerate(rows)}
    span = max(horizon - origin, 1e-9)
    fig_height = 1.2 + 0.7 * len(rows)
    fig, ax = plt.subplots(figsize=(14, fig_height))
    try:
        seen: dict[str, str] = {}
        for bar in bars:
            start, end = max(bar.start, origin), min(bar.end, horizon)
            if end <= start or bar.row not in y_of:
                continue
            y = y_of[bar.row]
            ax.broken_barh([(start - origin, end - start)], (y - 0.4, 0.8), facecolors=bar.colour,
                           edgecolors="black" if bar.label else "white", linewidth=0.4 if bar.label else 0.3)
            if bar.label and (end - start) / span > 0.012:
                ax.text((start + end) / 2 - origin, y, bar.label, ha="center", va="center", fontsize=7,
                        color="white", clip_on=True)
            seen.setdefault(bar.kind, bar.colour)
            counts[bar.row] += 1
        for mark in marks:
            ax.axvline(mark - origin, color="black", linestyle="--", linewidth=0.6)
        ax.set_yticks([y_of[row] for row in rows], rows)
        ax.set_ylim(-0.7, len(rows) - 0.3)
        ax.set_xlim(0, span)
        ax.set_xlabel(xlabel)
        if title:
            ax.set_title(title)
        order = list(legend_order)
        legend = sorted(seen.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
        if legend:
            ax.legend(handles=[Patch(color=c, label=k) for k, c in legend], loc="upper center",
                      bbox_to_anchor=(0.5, -0.55 / (0.75 * fig_height)), ncol=min(6, len(legend)),
                      fontsize=8, frameon=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return counts


def gantt_png(timeline: "Timeline", path: str | os.PathLike, title: str | None = None, *,
              plan: Plan | None = None, steps: int = 3) -> Gantt | None:
    """Draw a Gantt chart of ``timeline``: one row for compute, one per link; return what was drawn.

    Shows ``steps`` steady-state step programs (from the first measured one).
    Compute spans are coloured by kind (forward, loss, backward, update);
    collectives are labelled with their plan item id and, when ``plan`` is
    given, coloured by window (delayed ``*-next`` items stand out). Dashed
    lines mark the forward starts, so the distance between two is the
    iteration time. Returns None (and logs a warning) when matplotlib is
    missing or the timeline was simulated with ``record=False``.
    """
    path = Path(path)
    compute = timeline.compute_events()
    comm = timeline.comm_events()
    if not compute:
        log.warning("timeline has no recorded spans (simulate(..., record=True)); skipping %s", path)
        return None
    first, end = timeline.measured
    if end <= first:
        first, end = 0, len(timeline.forward_starts) - 1
    last = min(end, first + max(1, steps))
    windows = {item.id: item.window for item in plan.items} if plan is not None else {}
    n_links = max(len(timeline.link_names), max((ev.link + 1 for ev in comm), default=1))
    rows = ["compute"] + [f"link {i}: {timeline.link_names[i]}" if i < len(timeline.link_names) else f"link {i}"
                          for i in range(n_links)]
    bars = [_Bar("compute", ev.start_ms, ev.end_ms, ev.kind, COMPUTE_COLOURS.get(ev.kind, "#999999"))
            for ev in compute]
    for ev in comm:
        window = windows.get(ev.item_id)
        bars.append(_Bar(rows[1 + ev.link], ev.start_ms, ev.end_ms, f"comm: {window}" if window else "comm",
                         WINDOW_COLOURS.get(window, WINDOW_COLOURS[None]), str(ev.item_id)))
    counts = _draw_gantt(
        path, rows, bars, origin=timeline.forward_starts[first], horizon=timeline.forward_starts[last],
        title=title, xlabel=f"ms (steps {first}..{last - 1} of the simulation; dashed = forward starts)",
        marks=timeline.forward_starts[first:last + 1],
        legend_order=list(COMPUTE_COLOURS) + [f"comm: {w}" for w in WINDOW_COLOURS if w] + ["comm"])
    if counts is None:
        return None
    return Gantt(path=path, rows=rows, bars=counts, programs=(first, last))


def measured_gantt_png(trace_path: str | os.PathLike, path: str | os.PathLike, title: str | None = None
                       ) -> Gantt | None:
    """Gantt of a ``measured_timeline`` trace: the step's thread and one row per gloo worker thread.

    Row ``compute`` holds the top-level ops of the thread that ran the step
    (blue), with collective launches (purple) and ``wait_tensor`` (red: the
    step waited for communication, i.e. exposed communication) marked; each
    thread that ran ``gloo:*`` collectives is a link row. Dashed lines mark
    the starts of the ``deft_compile.step`` ranges. Times in ms from the
    first step start.
    """
    path = Path(path)
    data = json.loads(Path(trace_path).read_text())
    spans = [ev for ev in (data["traceEvents"] if isinstance(data, dict) else data) if ev.get("ph") == "X"]
    steps = sorted((ev for ev in spans if str(ev.get("name", "")).startswith("deft_compile.step")),
                   key=lambda ev: ev["ts"])
    if not steps:
        log.warning("%s has no deft_compile.step range (not written by measured_timeline?); skipping %s",
                    trace_path, path)
        return None
    pid, tid = steps[0]["pid"], steps[0]["tid"]
    origin = steps[0]["ts"] / 1000.0
    horizon = max(ev["ts"] + ev["dur"] for ev in steps) / 1000.0
    ops = sorted((ev for ev in spans if ev["pid"] == pid and ev["tid"] == tid and ev.get("cat") == "cpu_op"),
                 key=lambda ev: (ev["ts"], -ev["dur"]))
    bars: list[_Bar] = []
    covered_until = -float("inf")
    for ev in ops:  # top level only: skip ops nested in the previous top-level op
        start, end = ev["ts"] / 1000.0, (ev["ts"] + ev["dur"]) / 1000.0
        if start < covered_until:
            continue
        covered_until = end
        name = str(ev["name"])
        if "wait_tensor" in name:
            kind, colour = "wait for communication", "#c44e52"
        elif "c10d" in name:
            kind, colour = "collective launch", "#8172b2"
        else:
            kind, colour = "compute", "#4c72b0"
        bars.append(_Bar("compute", start, end, kind, colour))
    gloo_threads: dict[Any, float] = {}
    for ev in spans:
        if ev["pid"] == pid and str(ev.get("name", "")).startswith("gloo:"):
            gloo_threads[ev["tid"]] = min(gloo_threads.get(ev["tid"], float("inf")), ev["ts"])
    rows = ["compute"] + [f"gloo thread {i}" for i in range(len(gloo_threads))]
    row_of = {t: rows[1 + i] for i, t in enumerate(sorted(gloo_threads, key=gloo_threads.get))}
    for ev in spans:
        if ev["pid"] == pid and ev["tid"] in row_of and str(ev.get("name", "")).startswith("gloo:"):
            bars.append(_Bar(row_of[ev["tid"]], ev["ts"] / 1000.0, (ev["ts"] + ev["dur"]) / 1000.0,
                             "gloo collective", "#937860", str(ev["name"])[len("gloo:"):]))
    counts = _draw_gantt(path, rows, bars, origin=origin, horizon=horizon, title=title,
                         xlabel="ms (measured with torch.profiler; dashed = step starts)",
                         marks=[ev["ts"] / 1000.0 for ev in steps],
                         legend_order=["compute", "collective launch", "wait for communication", "gloo collective"])
    if counts is None:
        return None
    return Gantt(path=path, rows=rows, bars=counts, programs=(0, len(steps)))


# --- measured timeline --------------------------------------------------------------------


def measured_timeline(run_step: Callable[[], Any], path: str | os.PathLike, *, steps: int = 1,
                      warmup: int = 0, gantt: bool = True) -> Path:
    """Run ``run_step()`` ``warmup`` times, then ``steps`` times under ``torch.profiler``; export a Chrome trace.

    CPU activity only, ``record_shapes`` off (cheap enough for a real step).
    Each profiled call is wrapped in a ``deft_compile.step`` range. The trace
    shows every aten op the graph ran on the main thread and, with a gloo
    group, the collectives as ``gloo:all_reduce`` spans (the time gloo's
    worker thread spends on each all-reduce, i.e. the link stream) plus the
    ``c10d::allreduce_`` / ``_c10d_functional::wait_tensor`` launch and wait
    ops on the main thread. Open the file in https://ui.perfetto.dev.
    Every rank that calls it must call it the same number of times (the step
    runs collectives). With ``gantt`` (default) a PNG of the same trace is
    written next to it (``measured_gantt_png``; skipped without matplotlib).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(warmup):
        run_step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for index in range(steps):
            with record_function(f"deft_compile.step {index}"):
                run_step()
    prof.export_chrome_trace(str(path))
    if gantt:
        try:
            measured_gantt_png(path, path.with_suffix(".png"), f"measured: {steps} step(s)")
        except Exception:  # noqa: BLE001 - a plotting problem must not break training
            log.warning("could not draw %s", path.with_suffix(".png"), exc_info=True)
    log.info("wrote the measured timeline of %d step(s) to %s", steps, path)
    return path


class MeasuredTimelineRecorder:
    """Records ``steps`` consecutive training-step calls with ``torch.profiler`` (one call at a time).

    The runtime calls ``around(run)`` once per step; the profiler starts on the
    first and stops after the last, then the Chrome trace (and a Gantt PNG of
    it) is written like ``measured_timeline`` does. Consecutive calls are
    needed because a periodic plan's steps differ (some communicate nothing).
    """

    def __init__(self, path: str | os.PathLike, steps: int) -> None:
        self.path = Path(path)
        self.steps = max(1, steps)
        self._profiler: Any = None
        self._done = 0

    @property
    def finished(self) -> bool:
        return self._done >= self.steps

    def around(self, run: Callable[[], Any]) -> Any:
        from torch.profiler import ProfilerActivity, profile, record_function

        if self._profiler is None:
            self._profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=False)
            self._profiler.start()
        with record_function(f"deft_compile.step {self._done}"):
            result = run()
        self._done += 1
        if self.finished:
            self._profiler.stop()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._profiler.export_chrome_trace(str(self.path))
            try:
                measured_gantt_png(self.path, self.path.with_suffix(".png"), f"measured: {self.steps} step(s)")
            except Exception:  # noqa: BLE001 - a plotting problem must not break training
                log.warning("could not draw %s", self.path.with_suffix(".png"), exc_info=True)
            log.info("wrote the measured timeline of %d step(s) to %s", self.steps, self.path)
        return result


def plan_cycle(plan: Plan) -> int:
    """Steps after which the plan's communication pattern repeats (lcm of the update periods K).

    Measure at least this many steps so every phase of a periodic plan (some
    steps communicate nothing with K > 1) is in the measured timeline.
    """
    cycle = 1
    for item in plan.items:
        cycle = math.lcm(cycle, item.period)
    return cycle


def measured_step_index(default: int = 2) -> int | None:
    """Which step (0-based call count) the runtime profiles into ``timeline_measured`` when dumping.

    ``DEFT_DUMP_MEASURE_STEP`` overrides ``default`` (2: the first call that
    reuses the steady-state graph, so no capture or first-step state creation
    is in the trace); a negative value turns the measured timeline off.
    """
    text = os.environ.get("DEFT_DUMP_MEASURE_STEP", "").strip()
    try:
        value = int(text) if text else default
    except ValueError:
        log.warning("DEFT_DUMP_MEASURE_STEP=%r is not an integer; using %d", text, default)
        value = default
    return value if value >= 0 else None


def trace_event_names(path: str | os.PathLike) -> set[str]:
    """Names of the complete ("X") events in a Chrome trace file (for checks and tests)."""
    return set(trace_event_counts(path))


def trace_event_counts(path: str | os.PathLike) -> dict[str, int]:
    """How many complete ("X") events of each name a Chrome trace file holds."""
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    counts: dict[str, int] = {}
    for ev in events:
        if ev.get("ph") == "X":
            counts[ev.get("name", "")] = counts.get(ev.get("name", ""), 0) + 1
    return counts


# --- TORCH_TRACE / tlparse -------------------------------------------------------------------


def structured_trace_enabled() -> bool:
    """True when torch's structured trace log has a handler (``TORCH_TRACE=dir`` was set)."""
    try:
        from torch._logging._internal import trace_log
    except ImportError:  # pragma: no cover - very old torch
        return False
    # Only torch's own trace handler with a directory (TORCH_TRACE=dir) writes structured records;
    # torch also adds it without a directory when its logging initialises, and test runners attach
    # capture handlers to every logger, neither of which means tracing is on.
    return any(
        type(handler).__name__ == "LazyTraceHandler" and getattr(handler, "root_dir", None) is not None
        for handler in trace_log.handlers
    )


def log_structured(name: str, payload: Any | Callable[[], Any], *, encoding: str | None = None) -> bool:
    """Emit ``payload`` as a structured "artifact" for ``TORCH_TRACE`` / tlparse; return whether it was written.

    ``name`` is prefixed with ``deft_`` (unless it already is); ``encoding``
    defaults to ``"string"`` for text and ``"json"`` otherwise (dicts, lists,
    or objects with ``to_dict()``). ``payload`` may be a zero-argument callable,
    evaluated only when tracing is on, so callers pay nothing without
    ``TORCH_TRACE``. Uses ``torch._logging.trace_structured("artifact", ...)``,
    the record tlparse lists as ``<name>.json`` / ``<name>.txt`` artifacts.
    """
    if not structured_trace_enabled():
        return False
    from torch._logging import trace_structured

    value = payload() if callable(payload) else payload
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if encoding is None:
        encoding = "string" if isinstance(value, str) else "json"
    if encoding == "json" and not isinstance(value, str):
        text = json.dumps(value, indent=1, sort_keys=True, default=str)
    else:
        text = str(value)
    full_name = name if name.startswith(TRACE_PREFIX) else TRACE_PREFIX + name
    metadata = {"name": full_name, "encoding": encoding}
    try:
        trace_structured("artifact", metadata_fn=lambda: metadata, payload_fn=lambda: text,
                         expect_trace_id=False)
    except TypeError:  # torch without expect_trace_id
        trace_structured("artifact", metadata_fn=lambda: metadata, payload_fn=lambda: text)
    return True


def read_torch_trace(path: str | os.PathLike) -> list[tuple[dict[str, Any], str | None]]:
    """Parse a ``TORCH_TRACE`` log file into ``(metadata, payload)`` records (payload None when absent).

    The format (what tlparse reads): one glog-style line per record ending in
    ``] {json metadata}``, followed by the payload's lines, each prefixed by a
    tab.
    """
    records: list[tuple[dict[str, Any], list[str] | None]] = []
    for line in Path(path).read_text().splitlines():
        if line.startswith("\t"):
            if records:
                payload = records[-1][1]
                if payload is None:
                    payload = []
                    records[-1] = (records[-1][0], payload)
                payload.append(line[1:])
            continue
        head, sep, body = line.partition("] ")
        if sep and body.startswith("{"):
            records.append((json.loads(body), None))
    return [(meta, "\n".join(lines) if lines is not None else None) for meta, lines in records]


def trace_artifacts(path: str | os.PathLike) -> dict[str, list[Any]]:
    """The "artifact" records of a ``TORCH_TRACE`` file by name; json payloads decoded."""
    found: dict[str, list[Any]] = {}
    for meta, payload in read_torch_trace(path):
        info = meta.get("artifact")
        if not isinstance(info, dict):
            continue
        value: Any = payload
        if info.get("encoding") == "json" and payload is not None:
            value = json.loads(payload)
        found.setdefault(info.get("name", ""), []).append(value)
    return found


def log_graph_pass(graph_index: int, pass_index: int, pass_name: str, gm: Any) -> bool:
    """Structured-trace artifact ``deft_graph_NN_PP_<pass>`` with the readable graph after a pass."""
    if not structured_trace_enabled():
        return False
    slug = "".join(c if c.isalnum() or c == "_" else "_" for c in pass_name).strip("_") or "pass"
    return log_structured(
        f"graph_{graph_index:02d}_{pass_index:02d}_{slug}",
        lambda: gm.print_readable(print_output=False, include_stride=False, include_device=False),
        encoding="string")


def record_plan(profile: Profile, plan: Plan, dump_dir: str | os.PathLike | None = None) -> list[Path]:
    """After planning: structured-trace artifacts (plan JSON, plan table, profile) and, with ``dump_dir``, files.

    The files go to ``dump_dir/plan/`` (see ``write_plan_artifacts``). Never
    raises for an artifact problem: a failing dump is logged, training goes on.
    """
    log_structured("plan", plan.to_dict)
    log_structured("plan_table", lambda: plan.table(profile), encoding="string")
    log_structured("profile", profile.to_dict)
    if dump_dir is None:
        return []
    try:
        return write_plan_artifacts(Path(dump_dir) / "plan", profile, plan)
    except Exception:  # noqa: BLE001 - debugging output must not break training
        log.warning("could not write the plan artifacts to %s", dump_dir, exc_info=True)
        return []


# --- text timeline -----------------------------------------------------------------------------

_KIND_CHARS = {"forward": "F", "loss": "L", "backward": "B", "update": "U"}
_ID_CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def ascii_timeline(timeline: "Timeline", width: int = 72, *, program: int | None = None) -> str:
    """One steady-state iteration as text: a compute row (F/L/B/U, ``.`` = waiting) and one row per link.

    Link cells show the plan item id of the collective that fills most of the
    cell (``0-9a-zA-Z``, cycling for larger ids), ``.`` = idle. The window is
    one iteration, from a forward start to the next one (``program``: which
    simulated step; default the first measured one).
    """
    first = timeline.measured[0] if program is None else program
    if first + 1 >= len(timeline.forward_starts):
        return "(no recorded iteration)"
    start, end = timeline.forward_starts[first], timeline.forward_starts[first + 1]
    span = end - start
    if span <= 0:
        return "(empty iteration)"
    cell = span / width

    def paint(spans: list[tuple[float, float, str]]) -> str:
        best = [(0.0, ".")] * width
        for s, e, char in spans:
            s, e = max(s, start), min(e, end)
            if e <= s:
                continue
            for c in range(int((s - start) / cell), min(width - 1, int((e - start) / cell)) + 1):
                overlap = min(e, start + (c + 1) * cell) - max(s, start + c * cell)
                if overlap > best[c][0]:
                    best[c] = (overlap, char)
        return "".join(char for _, char in best)

    rows = [("compute", paint([(ev.start_ms, ev.end_ms, _KIND_CHARS.get(ev.kind, "?"))
                               for ev in timeline.compute_events()]))]
    comm = timeline.comm_events()
    for index, name in enumerate(timeline.link_names or ["link 0"]):
        rows.append((f"link {index}", paint([(ev.start_ms, ev.end_ms, _ID_CHARS[ev.item_id % len(_ID_CHARS)])
                                             for ev in comm if ev.link == index])))
    label = max(len(r[0]) for r in rows)
    lines = [f"{'':<{label}} |0 ms{'':<{max(0, width - 4 - len(f'{span:.2f} ms'))}}{span:.2f} ms|"]
    lines += [f"{name:<{label}} |{row}|" for name, row in rows]
    return "\n".join(lines)
