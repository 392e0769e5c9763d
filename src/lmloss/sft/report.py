"""What a run shows: the per-step line, metrics.jsonl, the loss-curve PNG, the closing summary table and the
three lines that end a run (what it showed, where its outputs are, what to try next)."""

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
            f"loss head alone at vocab {head['vocab']}",
            f"fused {head['fused_mib']:.1f} MiB | naive {head['naive_mib']:.1f} MiB ({_ratio(head):.1f}x), "
            f"{head['tokens']} tokens x {head['vocab_local']} vocab rows per rank",
        ))  # fmt: skip
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _ratio(head: dict[str, Any]) -> float:
    return head["naive_mib"] / max(head["fused_mib"], 1e-9)


def head_memory_line(head: dict[str, Any]) -> str:
    """The loss-head measurement, saying at which vocabulary and why (``--head-memory-vocab`` is usually a
    large model's, far from the tiny model's own) and what the token count is (one rank's CP share).

    `head`: `lmloss.sft.trainer.measure_head_memory`'s dict plus ``model_vocab`` (the model's padded
    vocabulary) and ``cp``."""
    if head["vocab"] != head["model_vocab"]:
        at = f"at --head-memory-vocab {head['vocab']}, not this model's {head['model_vocab']}"
    else:
        at = f"at this model's vocabulary ({head['vocab']} rows)"
    tokens = f"{head['tokens']} tokens"
    if head["cp"] > 1:
        tokens += f" (a micro-batch's {head['tokens'] * head['cp']} over cp={head['cp']})"
    return (f"loss head alone, forward + backward, {at}: {tokens} x {head['vocab_local']} vocab rows per rank: "
            f"fused {head['fused_mib']:.1f} MiB vs naive {head['naive_mib']:.1f} MiB")  # fmt: skip


def closing_lines(summary: dict[str, Any], out: str | Path, checkpoints: list[str]) -> str:
    """The three lines that end a run: what it showed, where its outputs are, what to try next.

    `summary`: `Trainer`'s summary (``model``, ``parameters``, ``loss_impl``, ``dp`` / ``cp`` / ``tp``,
    ``resumed_after``, the loss figures, ``head_memory``);
    `checkpoints`: the names of the step directories under ``<out>/checkpoints``, newest first. The files
    named are those of ``<out>`` that exist (no loss.png without matplotlib, no tokenizer.json with
    ``--tokenizer``)."""
    out = Path(out)
    tail = _tail(summary["tail_steps"])
    first, last = summary["first_step"], summary["last_step"]
    steps = f"{last} steps" if first == 1 else f"step {last}" if first == last else f"steps {first}-{last}"
    if summary.get("resumed_after") is not None:
        steps += f" (resumed after step {summary['resumed_after']})"
    shown = (f"shown: a {summary['parameters'] / 1e6:.2f}M-parameter {summary['model']} trained {steps} on "
             f"dp={summary['dp']} cp={summary['cp']} tp={summary['tp']}, loss {summary['first_loss']:.2f} -> "
             f"{summary['tail_mean_loss']:.2f} ({tail}) ")  # fmt: skip
    shown += ("through lmloss's fused head (no [tokens, vocab] logits)" if summary["loss_impl"] == "fused"
              else "from materialized [tokens, vocab] logits (--loss-impl naive)")  # fmt: skip
    head = summary.get("head_memory")
    if head:
        shown += (f"; at vocab {head['vocab']} the loss head alone peaks at {head['fused_mib']:.1f} MiB fused vs "
                  f"{head['naive_mib']:.1f} MiB naive ({_ratio(head):.1f}x)")  # fmt: skip
    written = ("metrics.jsonl", "loss.png", "summary.json", "tokenizer.json")
    files = [f for f in written if (out / f).is_file()]
    where = f"outputs: {out}/ ({', '.join(files)}); "
    if checkpoints:
        names = checkpoints[0] if len(checkpoints) == 1 else f"{checkpoints[-1]} .. {checkpoints[0]}"
        where += f"checkpoints: {out / 'checkpoints'}/ ({names})"
        nxt = (f"next: the same command with --resume latest --steps {2 * summary['last_step']} (not --overwrite) "
               f"trains on from {checkpoints[0]}")  # fmt: skip
    else:
        where += "no checkpoints (--save-every N writes them)"
        nxt = "next: --save-every N keeps checkpoints that --resume latest continues from"
    if summary["tp"] == 1:
        nxt += f"; --tp 2 --nproc {2 * summary['dp'] * summary['cp']} shards the LM head over 2 ranks"
    nxt += "; lmloss sft --help and docs/sft.md list the rest"
    return "\n".join([shown, where, nxt])
