"""Bench results as data first (JSON, CSV), then as a terminal table."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

from lmloss.bench.runner import NOISY_SPREAD, Result, is_noisy, spread_percent

#: Columns of results.csv, in order (every `Result` field; ``times_ms`` joined with ``;``).
CSV_COLUMNS = [f.name for f in dataclasses.fields(Result)]


def write_json(path: Path, rows: list[Result], meta: dict) -> None:
    """``{"meta": {...}, "results": [row, ...]}`` with one object per `Result`."""
    payload = {"meta": meta, "columns": CSV_COLUMNS, "results": [dataclasses.asdict(r) for r in rows]}
    path.write_text(json.dumps(payload, indent=2) + "\n")


def write_csv(path: Path, rows: list[Result]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for r in rows:
            d = dataclasses.asdict(r)
            d["times_ms"] = ";".join(f"{t:.3f}" for t in r.times_ms)
            writer.writerow({k: "" if v is None else v for k, v in d.items()})


def load_json(path: Path) -> tuple[dict, list[Result]]:
    """Read a results.json back into `Result` rows (for re-plotting or comparing runs)."""
    payload = json.loads(Path(path).read_text())
    return payload["meta"], [Result(**r) for r in payload["results"]]


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _mib(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _spread(r: Result) -> str:
    """Half the min-max range as a percentage of the median: how far to trust the time column."""
    return "-" if r.spread is None else f"±{spread_percent(r.spread)}%"


TABLE_HEADER = (
    "workload", "dtype", "tokens", "vocab", "hidden", "impl", "kernel", "status", "time ms", "spread",
    "peak MiB", "GB/s", "time/naive", "mem/naive", "time/floor", "wgrad err", "check", "note",
)  # fmt: skip
NUMERIC_COLUMNS = {"tokens", "vocab", "hidden", "time ms", "spread", "peak MiB", "GB/s", "time/naive", "mem/naive",
                   "time/floor", "wgrad err"}  # fmt: skip
#: Left out of the table when no row has a value in them (the CPU default sweep has no Triton rows, etc.).
OPTIONAL_COLUMNS = {"kernel", "GB/s", "time/floor", "wgrad err"}


NOISY_LEGEND = (
    f"noisy: the spread passes ±{spread_percent(NOISY_SPREAD)}%: times closer than the spread were not told apart "
    "by this run (rerun on a quieter machine, or with more --repeats)"
)


def format_table(rows: list[Result], *, note_width: int = 60) -> str:
    """A fixed-width table, one line per row; a blank line between cases. Columns: docs/bench_and_profiling.md.

    A note longer than `note_width` is printed in full below the table, as ``[n] <row>: <note>``, with
    ``see [n]`` in its place: nothing is cut.
    """
    lines: list[list[str]] = []
    case_of = []
    footnotes: list[str] = []
    for r in rows:
        note = r.note
        if r.check == "FAIL" and r.loss_err is not None:
            failed = f"loss err {r.loss_err:.1e}, grad err {_num(r.grad_err, '.1e')} > {r.tolerance:.0e}"
            note = f"{failed}; {note}" if note else failed
        if len(note) > note_width:
            footnotes.append(f"[{len(footnotes) + 1}] {r.workload} {r.dtype} T={r.tokens} {r.label}: {note}")
            note = f"see [{len(footnotes)}]"
        lines.append([
            r.workload, r.dtype, str(r.tokens), str(r.vocab), "-" if r.hidden is None else str(r.hidden),
            r.label, r.kernel, r.status, _num(r.time_ms, ".1f"), _spread(r), _mib(r.peak_mib),
            _num(r.bandwidth_gbs, ".3g"), _num(r.time_vs_naive, ".2f"), _num(r.mem_vs_naive, ".2f"),
            _num(r.time_vs_floor, ".2f"), _num(r.wgrad_err, ".1e"), r.check if r.status == "ok" else "-", note,
        ])  # fmt: skip
        case_of.append((r.workload, r.dtype, r.tokens, r.vocab, r.hidden))
    keep = [
        i for i, h in enumerate(TABLE_HEADER)
        if h not in OPTIONAL_COLUMNS or any(line[i] != "-" for line in lines)
    ]  # fmt: skip
    header = [TABLE_HEADER[i] for i in keep]
    lines = [[line[i] for i in keep] for line in lines]
    widths = [
        max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)
    ]
    numeric = {i for i, h in enumerate(header) if h in NUMERIC_COLUMNS}

    def fmt(cells: list[str]) -> str:
        out = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    text = [fmt(header), fmt(["-" * w for w in widths])]
    for i, line in enumerate(lines):
        if i and case_of[i] != case_of[i - 1]:
            text.append("")
        text.append(fmt(line))
    if footnotes:
        text += ["", "notes:", *footnotes]
    if any(is_noisy(r.spread) for r in rows):
        text += ["", NOISY_LEGEND]
    return "\n".join(text)
