"""PNG plots of a sweep: time and peak memory against tokens, one line per impl/chunk (matplotlib, Agg)."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from lmloss.bench.impls import DTYPES, WORKLOADS
from lmloss.bench.runner import Result

#: The names `plot_results` gives its files (`plot_name`), as a pattern: what `lmloss bench --out` clears of
#: an earlier run.
PLOT_NAME_PATTERN = re.compile(rf"({'|'.join(WORKLOADS)})_({'|'.join(DTYPES)})_V\d+(_H\d+)?\.png")


def plot_name(workload: str, dtype: str, vocab: int, hidden: int | None) -> str:
    """``<workload>_<dtype>_V<vocab>[_H<hidden>].png``."""
    return f"{workload}_{dtype}_V{vocab}" + ("" if hidden is None else f"_H{hidden}") + ".png"


def plot_results(rows: list[Result], out_dir: Path) -> list[Path]:
    """One figure per (workload, dtype, vocab, hidden): time (left) and peak MiB (right) vs tokens.

    Only ``ok`` rows are drawn; out-of-memory points are marked with an ``x`` on the memory axis's top
    edge so that they are not mistaken for missing data. Returns the paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, list[Result]] = defaultdict(list)
    for r in rows:
        groups[(r.workload, r.dtype, r.vocab, r.hidden)].append(r)
    written = []
    for (workload, dtype, vocab, hidden), group in sorted(groups.items(), key=lambda kv: str(kv[0])):
        lines: dict[str, list[Result]] = defaultdict(list)
        for r in group:
            lines[r.label].append(r)
        if not any(r.status == "ok" for r in group):
            continue
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
        for label, pts in lines.items():
            ok = sorted((r for r in pts if r.status == "ok"), key=lambda r: r.tokens)
            if ok:
                ax_t.plot([r.tokens for r in ok], [r.time_ms for r in ok], marker="o", label=label)
                ax_m.plot([r.tokens for r in ok], [r.peak_mib for r in ok], marker="o", label=label)
            ooms = [r.tokens for r in pts if r.status == "oom"]
            if ooms:
                ax_m.plot(ooms, [1] * len(ooms), "x", color="red", transform=ax_m.get_xaxis_transform(),
                          clip_on=False, label=f"{label} OOM")  # fmt: skip
        shape = f"V={vocab}" + ("" if hidden is None else f", H={hidden}")
        for ax, ylabel in (
            (ax_t, "forward+backward time (ms)"),
            (ax_m, "peak memory (MiB, inputs included)"),
        ):
            ax.set_xlabel("tokens")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
        ax_m.set_ylim(bottom=0)
        times = [r.time_ms for r in group if r.status == "ok" and r.time_ms]
        if times and max(times) / min(times) > 20:
            ax_t.set_yscale("log")  # one slow peer would flatten every other line
        else:
            ax_t.set_ylim(bottom=0)
        ax_t.set_title(f"{workload} {dtype} {shape}: time")
        ax_m.set_title(f"{workload} {dtype} {shape}: peak memory")
        ax_m.legend(fontsize=8)
        fig.tight_layout()
        path = Path(out_dir) / plot_name(workload, dtype, vocab, hidden)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
