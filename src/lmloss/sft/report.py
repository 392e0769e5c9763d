"""What a run shows: the per-step line, metrics.jsonl, the loss-curve PNG and the closing summary table."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def step_line(m: dict[str, Any]) -> str:
    parts = [
        f"step {m['step']:>4}",
        f"loss {m['loss']:.4f}",
        f"ppl {m['ppl']:8.2f}",
        f"tokens {int(m['n_tokens']):>5} (valid {int(m['n_valid_tokens']):>4})",
        f"grad norm {m['grad_norm']:.3f}",
        f"lr {m['lr']:.2e}",
    ]
    if "peak_mem_mib" in m:
        parts.append(f"peak {m['peak_mem_mib']:.1f} MiB")
    parts.append(f"{m['tokens_per_s']:.0f} tok/s")
    return " | ".join(parts)


class MetricsLog:
    """Appends one JSON object per step to ``metrics.jsonl``; holds only this run's steps.

    A fresh run starts it empty. A resumed run keeps the lines up to the resume step, and only if they are
    the ones the checkpoint recorded (`expected`: their sha256 and count, from `checksum` at save time);
    otherwise (another run's log, an edited or missing file) the log restarts at the resume step + 1, so the
    summary never mixes runs. A torn last line (a crash mid-write) is dropped. Each such decision is a line
    in `notes`.
    """

    def __init__(self, path: str | Path, *, resume_step: int, expected: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.notes: list[str] = []
        keep: list[str] = []
        if resume_step:
            keep = self._kept_lines(resume_step, expected)
        self.path.write_text("".join(ln + "\n" for ln in keep))

    def _kept_lines(self, resume_step: int, expected: dict[str, Any] | None) -> list[str]:
        lines = self.path.read_text(errors="replace").split("\n") if self.path.is_file() else []
        if lines and lines[-1] == "":
            lines.pop()  # the file ends with a newline: no torn line
        elif lines:
            self.notes.append(
                f"{self.path}: dropped a torn last line (a crash mid-write): {lines[-1][:60]!r}"
            )
            lines.pop()
        keep = []
        for ln in lines:
            try:
                row = json.loads(ln)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                keep = None  # damaged inside: not the recorded log
                break
            if row["step"] <= resume_step:
                keep.append(ln)
        if keep is not None and expected is not None:
            text = "".join(ln + "\n" for ln in keep)
            if (hashlib.sha256(text.encode()).hexdigest() == expected["sha256"]
                    and len(keep) == expected["lines"]):  # fmt: skip
                return keep
        elif keep is not None:
            return keep
        self.notes.append(
            f"{self.path} does not hold this run's {expected['lines'] if expected else resume_step} "
            f"line(s) up to step {resume_step} (another run's, edited, or missing): it restarts at step "
            f"{resume_step + 1}, and the summary covers the steps from there"
        )
        return []

    def write(self, metrics: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")

    def read(self) -> list[dict[str, Any]]:
        return [json.loads(ln) for ln in self.path.read_text().splitlines() if ln]

    def checksum(self) -> dict[str, Any]:
        """sha256 and line count of the log as it is now (recorded in a checkpoint's manifest)."""
        text = self.path.read_text()
        return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "lines": text.count("\n")}


def plot_loss(rows: list[dict[str, Any]], path: str | Path, title: str) -> Path | None:
    """Loss per step to a PNG (None when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over target tokens)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def _tail(n: int) -> str:
    return "the last step" if n == 1 else f"mean of the last {n}"


def summary_table(summary: dict[str, Any]) -> str:
    """A short two-column table of the run's headline numbers."""
    rows = [
        ("layout", summary["layout"]),
        ("steps", f"{summary['first_step']} -> {summary['last_step']}"),
        (
            "loss",
            f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f} ({_tail(summary['tail_steps'])}: "
            f"{summary['tail_mean_loss']:.4f}, min {summary['min_loss']:.4f})",
        ),
        ("tokens/s", f"{summary['tokens_per_s']:.0f}"),
        (
            "peak memory of a step (max over ranks)",
            "not tracked" if summary["peak_mem_mib"] is None else f"{summary['peak_mem_mib']:.1f} MiB",
        ),
        ("vocab (true / padded)", f"{summary['true_vocab']} / {summary['vocab_rows']}"),
    ]
    head = summary.get("head_memory")
    if head:
        rows.append((
            f"loss head peak, {head['tokens']} tokens x {head['vocab_local']} vocab",
            f"fused {head['fused_mib']:.1f} MiB | naive {head['naive_mib']:.1f} MiB "
            f"({head['naive_mib'] / max(head['fused_mib'], 1e-9):.1f}x)",
        ))  # fmt: skip
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
