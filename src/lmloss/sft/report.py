"""What a run shows: the per-step line, metrics.jsonl, the loss-curve PNG and the closing summary table."""

from __future__ import annotations

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
    """Appends one JSON object per step to ``metrics.jsonl``; on resume, drops lines past the resume step."""

    def __init__(self, path: str | Path, *, resume_step: int | None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        keep = []
        if resume_step is not None and self.path.is_file():
            keep = [
                ln
                for ln in self.path.read_text().splitlines()
                if ln and json.loads(ln)["step"] <= resume_step
            ]
        self.path.write_text("".join(ln + "\n" for ln in keep))

    def write(self, metrics: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")

    def read(self) -> list[dict[str, Any]]:
        return [json.loads(ln) for ln in self.path.read_text().splitlines() if ln]


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


def summary_table(summary: dict[str, Any]) -> str:
    """A short two-column table of the run's headline numbers."""
    rows = [
        ("layout", summary["layout"]),
        ("steps", f"{summary['first_step']} -> {summary['last_step']}"),
        (
            "loss",
            f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f} (mean of the last 10: "
            f"{summary['last10_loss']:.4f}, min {summary['min_loss']:.4f})",
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
