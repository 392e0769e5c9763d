"""``lmloss memory-report``: summarize a CUDA memory snapshot or a CPU memory report, offline.

Reads either a pickle written by ``torch.cuda.memory._dump_snapshot`` (as `MemoryProfiler` writes on CUDA)
or the JSON report `MemoryProfiler` writes on CPU, and prints the peak, the largest allocations alive at the
peak and the same bytes grouped by call site. ``--plot out.png`` draws the timeline of live bytes next to
the top call sites. A snapshot pickle is unpickled: read only files you or your jobs wrote.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmloss.profiling.profiler import CPU_REPORT_FORMAT

MiB = 1024**2


@dataclasses.dataclass
class AllocationSummary:
    """One allocation alive at the peak. `shape` and `dtype` are known for CPU reports only."""

    nbytes: int
    site: str
    shape: list[int] | None = None
    dtype: str | None = None


@dataclasses.dataclass
class MemorySummary:
    """What a report says, whatever its source.

    kind: ``"cuda-snapshot"`` or ``"cpu-report"``. peak_bytes: the most bytes live at once in the recorded
    window (CUDA: allocated memory, including what was allocated before recording began; CPU: above what
    was live when the step began). baseline_bytes: CUDA only, what was already allocated when recording
    began. timeline: ``(event index, live bytes)``. min_bytes: CPU reports only, the size under which a
    tensor alive at the peak is counted but not listed (`MemoryProfilerConfig.min_bytes`).
    """

    source: str
    kind: str
    peak_bytes: int
    allocations: list[AllocationSummary]
    timeline: list[tuple[int, int]]
    baseline_bytes: int = 0
    device: str = ""
    events: int = 0
    min_bytes: int | None = None

    def by_site(self) -> list[tuple[str, int, int]]:
        """``(site, bytes, count)`` of the allocations alive at the peak, most bytes first."""
        totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for a in self.allocations:
            totals[a.site][0] += a.nbytes
            totals[a.site][1] += 1
        return sorted(((s, b, n) for s, (b, n) in totals.items()), key=lambda t: -t[1])


def _is_internal(filename: str) -> bool:
    # Frames in torch itself, in C/C++ sources or unresolved: not where a user would look.
    return (
        "/torch/" in filename
        or filename.endswith((".cpp", ".h", ".c", ".cc", ".cu", ".cuh"))
        or filename in ("??", "")
        or filename.startswith("<")
    )


def frame_site(frames: Sequence[dict[str, Any]]) -> str:
    """The allocation site of a snapshot entry: its innermost frame outside torch and native code."""
    for f in frames or ():
        filename = str(f.get("filename", ""))
        if not _is_internal(filename):
            return f"{filename}:{f.get('line', '?')} in {f.get('name', '?')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename', '?')}:{f.get('line', '?')} in {f.get('name', '?')}"
    return "<no stack recorded>"


def summarize_snapshot(
    snapshot: dict[str, Any], source: str = "", device: int | None = None
) -> MemorySummary:
    """Replay a CUDA snapshot's allocation history into a timeline, its peak and what was alive at it.

    The history starts when recording did, so memory allocated earlier appears as a baseline: what the
    segments hold at the end, less the net of the recorded allocations and frees.
    """
    traces = snapshot.get("device_traces") or []
    if device is None:
        device = max(range(len(traces)), key=lambda d: len(traces[d]), default=0)
    trace = traces[device] if device < len(traces) else []
    allocated_end = sum(
        b.get("size", 0)
        for seg in snapshot.get("segments", [])
        if seg.get("device", device) == device
        for b in seg.get("blocks", [])
        if b.get("state") == "active_allocated"
    )
    net = 0
    for e in trace:
        if e.get("action") == "alloc":
            net += e["size"]
        elif e.get("action") == "free_completed":
            net -= e["size"]
    baseline = max(allocated_end - net, 0)

    live, peak, peak_at = baseline, baseline, -1
    timeline = [(0, baseline)]
    for i, e in enumerate(trace):
        action = e.get("action")
        if action == "alloc":
            live += e["size"]
        elif action == "free_completed":
            live -= e["size"]
        else:
            continue
        timeline.append((i + 1, live))
        if live > peak:
            peak, peak_at = live, i

    alive: dict[int, dict[str, Any]] = {}
    for e in trace[: peak_at + 1]:
        if e.get("action") == "alloc":
            alive[e["addr"]] = e
        elif e.get("action") == "free_completed":
            alive.pop(e["addr"], None)
    allocations = sorted(
        (AllocationSummary(e["size"], frame_site(e.get("frames", []))) for e in alive.values()),
        key=lambda a: -a.nbytes,
    )
    return MemorySummary(
        source=source, kind="cuda-snapshot", peak_bytes=peak, allocations=allocations, timeline=timeline,
        baseline_bytes=baseline, device=f"cuda:{device}", events=len(trace),
    )  # fmt: skip


def summarize_cpu_report(report: dict[str, Any], source: str = "") -> MemorySummary:
    """The JSON `MemoryProfiler` writes on CPU, as a `MemorySummary`."""
    if report.get("format") != CPU_REPORT_FORMAT:
        raise ValueError(
            f"{source or 'report'}: not an lmloss CPU memory report (format={report.get('format')!r})"
        )
    allocations = [
        AllocationSummary(a["nbytes"], a.get("site") or "<unknown>", a.get("shape"), a.get("dtype"))
        for a in report.get("top_allocations", [])
    ]
    timeline = [(int(i), int(b)) for i, b in report.get("timeline", [])]
    return MemorySummary(
        source=source, kind="cpu-report", peak_bytes=int(report["peak_bytes"]), allocations=allocations,
        timeline=timeline, device=report.get("device", "cpu"), events=len(timeline) + report.get("timeline_dropped", 0),
        min_bytes=report.get("min_bytes"),
    )  # fmt: skip


def load_summary(path: str | Path) -> MemorySummary:
    """Read a ``.json`` CPU report or a snapshot pickle (any other suffix) into a `MemorySummary`.

    Raises `ValueError` naming `path` (once) for a file that is neither.
    """
    path = Path(path)
    if path.suffix == ".json":
        try:
            report = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not an lmloss CPU memory report (not JSON: {err})") from err
        if not isinstance(report, dict):
            raise ValueError(f"{path}: not an lmloss CPU memory report (a JSON {type(report).__name__})")
        try:
            return summarize_cpu_report(report, str(path))
        except (KeyError, TypeError) as err:
            raise ValueError(
                f"{path}: a broken lmloss CPU memory report ({type(err).__name__}: {err})"
            ) from err
    try:
        with path.open("rb") as f:
            snapshot = pickle.load(f)
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError) as err:
        raise ValueError(
            f"{path}: not a torch.cuda.memory snapshot pickle ({type(err).__name__}: {err}); "
            "CPU reports end in .json"
        ) from err
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        raise ValueError(f"{path}: not a torch.cuda.memory snapshot (no 'segments')")
    return summarize_snapshot(snapshot, str(path))


def _size(nbytes: int) -> str:
    """``64 KiB``, ``1 MiB``, ``512 B``: exact binary units where they divide, else one decimal."""
    for unit, scale in (("GiB", 1024**3), ("MiB", MiB), ("KiB", 1024)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if nbytes % scale == 0 else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def format_summary(summary: MemorySummary, top: int = 10) -> str:
    """Peak, the `top` largest allocations alive at it, and the same grouped by call site."""
    lines = [f"{summary.source}  ({summary.kind}, {summary.device}, {summary.events} events)"]
    lines.append(f"  peak: {summary.peak_bytes / MiB:,.1f} MiB")
    if summary.kind == "cuda-snapshot":
        lines.append(f"  allocated before recording began: {summary.baseline_bytes / MiB:,.1f} MiB")
    else:
        lines.append("  (above what was live when the step began)")
    listed = sum(a.nbytes for a in summary.allocations)
    at_least = "" if not summary.min_bytes else f" of at least {_size(summary.min_bytes)}"
    lines.append(
        f"  top allocations{at_least} alive at the peak ({len(summary.allocations)} listed, "
        f"{listed / MiB:,.1f} MiB):"
    )
    for a in summary.allocations[:top]:
        what = "" if a.shape is None else f"{a.dtype} {list(a.shape)}  "
        lines.append(f"    {a.nbytes / MiB:10,.1f} MiB  {what}{a.site}")
    unlisted = summary.peak_bytes - listed
    if summary.kind == "cpu-report" and summary.min_bytes and unlisted > 0:
        # Say why the list falls short of the peak (it can be empty), and how to list everything.
        lines.append(
            f"    {unlisted / MiB:10,.1f} MiB  in tensors under {_size(summary.min_bytes)}, not listed "
            "(MemoryProfilerConfig(min_bytes=0), or memory_profile: {min_bytes: 0}, lists them)"
        )
    lines.append("  by call site:")
    for site, nbytes, count in summary.by_site()[:top]:
        lines.append(f"    {nbytes / MiB:10,.1f} MiB  x{count:<4d} {site}")
    return "\n".join(lines)


def plot_summary(summary: MemorySummary, out: str | Path, top: int = 10) -> Path:
    """PNG: live bytes over the recorded events (peak marked) and the top call sites at the peak."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    if summary.timeline:
        xs, ys = zip(*summary.timeline)
        ax_t.plot(xs, [y / MiB for y in ys], lw=1)
        k = max(range(len(ys)), key=ys.__getitem__)
        ax_t.plot([xs[k]], [ys[k] / MiB], "o", color="red", label=f"peak {ys[k] / MiB:,.0f} MiB")
        ax_t.legend()
    else:
        ax_t.text(0.5, 0.5, "no timeline recorded", ha="center", va="center", transform=ax_t.transAxes)
    ax_t.set_xlabel("allocation event")
    ax_t.set_ylabel("live MiB")
    ax_t.set_title(f"{Path(summary.source).name}: memory timeline")
    ax_t.grid(True, alpha=0.3)
    sites = summary.by_site()[:top][::-1]
    if sites:
        ax_s.barh(range(len(sites)), [b / MiB for _, b, _ in sites])
        ax_s.set_yticks(range(len(sites)), [_short(s) for s, _, _ in sites], fontsize=7)
    ax_s.set_xlabel("MiB alive at the peak")
    ax_s.set_title("top call sites")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _short(site: str, width: int = 48) -> str:
    name = site.rsplit("/", 1)[-1]
    return name if len(name) <= width else "…" + name[-(width - 1) :]


def _report_paths(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.suffix in (".json", ".pickle", ".pkl"))
    return [path]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "memory-report",
        help="summarize a CUDA memory snapshot or a CPU memory report (peak, top allocations, call sites)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", type=Path, help="a .pickle snapshot, a .json CPU report, or a folder of them")
    p.add_argument(
        "--top", type=int, default=10, help="how many allocations and call sites to list (default 10)"
    )
    p.add_argument(
        "--plot", type=Path, default=None, help="write the timeline and top call sites to this PNG"
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    paths = _report_paths(args.path)
    if not paths or not all(p.exists() for p in paths):
        print(f"lmloss memory-report: nothing to read at {args.path}", file=sys.stderr)
        return 2
    if args.plot is not None and len(paths) != 1:
        print("lmloss memory-report: --plot takes a single report file", file=sys.stderr)
        return 2
    for i, path in enumerate(paths):
        try:
            summary = load_summary(path)
        except ValueError as err:  # its message names the file
            print(f"lmloss memory-report: {err}", file=sys.stderr)
            return 1
        if i:
            print()
        print(format_summary(summary, args.top))
        if args.plot is not None:
            print(f"wrote {plot_summary(summary, args.plot, args.top)}")
    return 0
