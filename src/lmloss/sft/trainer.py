"""The training loop: packed micro-batches -> CP-sliced body -> vocab-parallel fused loss head -> AdamW.

One optimizer step, on every rank:

1. the TP source rank of each (dp, cp) builds this DP rank's micro-batches of the global batch (pack,
   zigzag CP split) and `broadcast_batch` hands them to the other TP ranks;
2. the target tokens of the whole global batch are counted (one SUM over DP x CP), so that every
   micro-batch's loss is ``sum over its tokens / global count``: the step's loss is the token mean over
   the global batch, whatever dp, cp, tp and the number of micro-batches per rank;
3. per micro-batch: ``model.model`` (CP attention) gives hidden states, `lmloss.linear_cross_entropy`
   on the (vocab-sharded) LM-head weight gives the summed loss, backward;
4. gradients are SUMmed over DP x CP (the loss already carries the global denominator; the hidden
   gradient was already summed over TP inside the fused op, so the replicated body agrees across TP);
5. global grad norm (head shards summed over TP), clipping, AdamW, and statistics via `StatsTracker`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lmloss
from lmloss import cp as lmloss_cp
from lmloss.distributed import broadcast_batch
from lmloss.metrics import StatsTracker
from lmloss.packing import pack
from lmloss.profiling import MemoryProfiler, MemoryProfilerConfig, peak_memory
from lmloss.sft import checkpoint, data, report, resume
from lmloss.sft.attention import PackedAttention
from lmloss.sft.config import SFTConfig
from lmloss.sft.model import build_model, head_weight, padded_vocab, shard_head
from lmloss.sft.parallel import Mesh, all_reduce_grads_, copy_to_tp, grad_norm
from lmloss.sft.tokenizer import TextTokenizer, load_tokenizer, prepare_tokenizer
from lmloss.vocab_parallel import all_reduce_sum_

BATCH_KEYS = ("input_ids", "labels", "position_ids", "cu_seqlens_padded", "loss_mask", "token_mask")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class PreparedData:
    tokenizer: TextTokenizer
    examples: list[data.TokenizedExample]
    truncated: int
    data_sha256: str  # of the dataset file's bytes: the data's identity on resume


def prepare_data(cfg: SFTConfig) -> PreparedData:
    """Read and tokenize the dataset; the tokenizer is ``cfg.tokenizer`` or a BPE cached in the out dir."""
    examples = data.load_jsonl(cfg.data)
    data_file = data.default_dataset_path() if cfg.data is None else Path(cfg.data)
    data_sha256 = hashlib.sha256(data_file.read_bytes()).hexdigest()
    if cfg.tokenizer is not None:
        tok = load_tokenizer(cfg.tokenizer)
    else:
        texts = [(ex.prompt or "") + ex.text for ex in examples]
        tok = prepare_tokenizer(texts, cfg.tokenizer_vocab, Path(cfg.out) / "tokenizer.json")
    tokenized, truncated = data.tokenize(
        examples,
        tok.encode,
        tok.eos_id,
        max_tokens=cfg.tokens_per_batch,
        truncate=cfg.truncate,
        path=cfg.data,
    )
    return PreparedData(tok, tokenized, truncated, data_sha256)


def prepare_resume(cfg: SFTConfig, prepared: PreparedData) -> tuple[SFTConfig, checkpoint.ResumePoint | None]:
    """The checkpoint ``cfg.resume`` names (verified, newest intact for ``latest``) and `cfg` resolved
    against it (`lmloss.sft.resume.resolve`); ``(cfg, None)`` for a fresh run."""
    if cfg.resume is None:
        return cfg, None
    point = checkpoint.find(cfg.out, cfg.resume)
    cfg = resume.resolve(cfg, point, data_sha256=prepared.data_sha256,
                         tokenizer_sha256=prepared.tokenizer.fingerprint())  # fmt: skip
    return cfg, point


def lr_at(step: int, cfg: SFTConfig) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at step `total_schedule_steps`
    (and that learning rate after it: a resumed run trained further keeps the original schedule)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.total_schedule_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def head_loss_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, impl: str, vocab_size: int,
    tp_group, chunk_size,
) -> torch.Tensor:  # fmt: skip
    """Summed cross-entropy of the labels under ``hidden @ weight.T`` (weight: this rank's vocab shard).

    ``fused``: `lmloss.linear_cross_entropy`, the logits never exist. ``naive``: the plain logits path,
    ``[T, V_local]`` logits and their gradient materialized (what a model's ``lm_head`` does).
    """
    if impl == "fused":
        return lmloss.linear_cross_entropy(
            hidden,
            weight,
            labels,
            reduction="sum",
            vocab_size=vocab_size,
            tp_group=tp_group,
            chunk_size=chunk_size,
        )
    logits = F.linear(copy_to_tp(hidden, tp_group), weight)
    return lmloss.cross_entropy(
        logits, labels, chunk_size=None, reduction="sum", vocab_size=vocab_size, tp_group=tp_group
    )


def measure_head_memory(
    hidden_size: int, n_tokens: int, vocab_rows: int, mesh: Mesh, *, device: torch.device, dtype: torch.dtype,
    chunk_size,
) -> dict[str, float]:  # fmt: skip
    """Peak memory of the loss head alone, forward + backward, fused vs naive, on this rank.

    Random hidden states ``[n_tokens, H]`` and a random weight shard ``[vocab_rows / tp, H]`` (every TP
    rank takes part); the figure is what the head allocates above its inputs, gradients included.
    """
    gen = torch.Generator().manual_seed(0)
    local_rows = vocab_rows // mesh.tp
    hidden = torch.randn(n_tokens, hidden_size, generator=gen).to(device, dtype)
    weight = (0.02 * torch.randn(local_rows, hidden_size, generator=gen)).to(device, dtype)
    labels = torch.randint(0, vocab_rows, (n_tokens,), generator=gen).to(device)
    out = {"tokens": n_tokens, "vocab": vocab_rows, "vocab_local": local_rows}
    for impl in ("fused", "naive"):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with peak_memory(device) as mem:
            loss = head_loss_sum(h, w, labels, impl=impl, vocab_size=vocab_rows, tp_group=mesh.tp_group,
                                 chunk_size=chunk_size)  # fmt: skip
            loss.backward()
            del loss
        out[f"{impl}_mib"] = mem.peak_mib
        del h, w
    return out


def _memory_profiler(cfg: SFTConfig, mesh: Mesh, device: torch.device):
    """`lmloss.profiling.MemoryProfiler` for the configured steps (0-based step index), or None."""
    if not cfg.memory_profile:
        return None
    return MemoryProfiler(
        MemoryProfilerConfig.from_dict(cfg.memory_profile), Path(cfg.out) / "memory", coords=mesh.coords,
        device=device,
    )  # fmt: skip


class Trainer:
    """One process's share of the run. ``fit()`` trains to ``cfg.steps`` and returns the summary (main rank).

    `resume_point`: the verified checkpoint to continue from, with `cfg` already resolved against it
    (`prepare_resume`); found here when ``cfg.resume`` is set and it is not given.
    """

    def __init__(
        self, cfg: SFTConfig, mesh: Mesh, device: torch.device, prepared: PreparedData | None = None,
        resume_point: checkpoint.ResumePoint | None = None,
    ):  # fmt: skip
        prepared = prepared or prepare_data(cfg)
        if cfg.resume is not None and resume_point is None:
            cfg, resume_point = prepare_resume(cfg, prepared)
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.resume_point = resume_point
        self.tok, self.examples = prepared.tokenizer, prepared.examples
        self.truncated = prepared.truncated
        self.order = data.BatchOrder([len(e.ids) for e in self.examples], cfg.tokens_per_batch, seed=cfg.seed,
                                     shuffle=cfg.shuffle)  # fmt: skip
        self.true_vocab = self.tok.vocab_size
        self.vocab_rows = padded_vocab(self.true_vocab, cfg.vocab_size, cfg.tp)
        self.model = build_model(
            cfg.model_config, vocab_rows=self.vocab_rows, seed=cfg.seed, dtype=DTYPES[cfg.dtype]
        )
        shard_head(self.model, mesh.tp_rank, mesh.tp)
        self.model.to(device).train()
        self.head = head_weight(self.model)
        self.body_params = [p for p in self.model.parameters() if p is not self.head]
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                                           weight_decay=cfg.weight_decay)  # fmt: skip
        self.identity = resume.run_identity(cfg, data_sha256=prepared.data_sha256,
                                            tokenizer_sha256=self.tok.fingerprint())  # fmt: skip
        self.step = 0
        # global micro-batch index of step s: s * global_micro_batches + data_offset (nonzero only after a
        # resume that overrode micro_batches: the data continues where the checkpoint left it)
        self.data_offset = 0
        if self.resume_point is not None:
            saved_rows = self.resume_point.manifest["vocab_rows"]
            if saved_rows != self.vocab_rows:
                raise checkpoint.CheckpointError(
                    f"checkpoint {self.resume_point.path} has {saved_rows} vocabulary rows, this run's model "
                    f"{self.vocab_rows} (another tokenizer or --vocab-size): it cannot be resumed into it"
                )
            state = checkpoint.load(self.resume_point, model=self.model, optimizer=self.optimizer, mesh=mesh,
                                    device=device)  # fmt: skip
            self.step = state["step"]
            self.data_offset = state["micro_batches_consumed"] - self.step * cfg.global_micro_batches
        self.tracker = StatsTracker(group=mesh.dp_cp_group)
        self.profiler = _memory_profiler(cfg, mesh, device)

    # -- data -----------------------------------------------------------------------------------------
    def _local_batch(self, index: int) -> dict[str, Any]:
        """Pack global micro-batch `index` and keep this CP rank's zigzag slice (TP source rank only)."""
        exs = [self.examples[i] for i in self.order.micro_batch(index)]
        multiple = 2 * self.mesh.cp if self.mesh.cp > 1 else 1
        packed = pack([e.ids for e in exs], [e.targets for e in exs], pad_to_multiple_of=multiple,
                      pad_id=self.tok.pad_id)  # fmt: skip
        local = lmloss_cp.split_batch(packed, self.mesh.cp, self.mesh.cp_rank)
        return {k: local[k] for k in BATCH_KEYS}

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of global step `step`: DP rank d takes the d-th equal share."""
        per_rank = self.cfg.global_micro_batches // self.mesh.dp
        first = step * self.cfg.global_micro_batches + self.data_offset + self.mesh.dp_rank * per_rank
        batches = []
        for index in range(first, first + per_rank):
            mine = self._local_batch(index) if self.mesh.tp_rank == 0 else None
            batch = broadcast_batch(mine, group=self.mesh.tp_group, src=self.mesh.tp_src, keys=BATCH_KEYS)
            batches.append({k: v.to(self.device) for k, v in batch.items()})
        return batches

    # -- one step -------------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        cfg, mesh = self.cfg, self.mesh
        lr = lr_at(step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        batches = self.micro_batches(step)
        # the global batch's target count: every micro-batch's summed loss is divided by it
        n_valid = torch.stack([b["loss_mask"].sum() for b in batches]).sum().double()
        n_valid = all_reduce_sum_(n_valid, mesh.dp_cp_group).clamp(min=1.0)
        for b in batches:
            packed = PackedAttention.build(b["cu_seqlens_padded"], mesh.cp_group, device=self.device)
            hidden = self.model.model(input_ids=b["input_ids"][None], position_ids=b["position_ids"][None],
                                      packed=packed).last_hidden_state[0]  # fmt: skip
            loss_sum = head_loss_sum(hidden, self.head, b["labels"], impl=cfg.loss_impl,
                                     vocab_size=self.true_vocab, tp_group=mesh.tp_group, chunk_size=cfg.chunk_size)  # fmt: skip
            loss = loss_sum / n_valid.to(loss_sum.dtype)
            loss.backward()
            self.tracker.denominator("n_tokens", b["token_mask"])
            self.tracker.denominator("n_valid_tokens", b["loss_mask"])
            self.tracker.scalar("loss", loss.detach().float(), reduce="sum")  # this rank's share of the mean
        all_reduce_grads_(self.model.parameters(), mesh.dp_cp_group)
        norm = grad_norm(self.body_params, [self.head], mesh.tp_group)
        if cfg.grad_clip > 0 and norm > cfg.grad_clip:
            scale = cfg.grad_clip / (norm + 1e-6)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        self.optimizer.step()
        stats = self.tracker.export()
        stats.update(grad_norm=norm, lr=lr)
        return stats

    def run_step(self) -> dict[str, Any]:
        """Train step ``self.step`` (memory-profiled if configured) and return its metrics; advance by one."""
        cfg, mesh, step = self.cfg, self.mesh, self.step
        t0 = time.perf_counter()
        profile = self.profiler.step(step) if self.profiler is not None else contextlib.nullcontext()
        track = peak_memory(self.device) if cfg.track_memory else contextlib.nullcontext()
        with profile, track as mem:
            stats = self.train_step(step)
        self.step += 1
        metrics = {"step": self.step, **stats, "ppl": math.exp(min(stats["loss"], 50.0))}
        if mem is not None:
            peak = torch.tensor(mem.peak_mib, dtype=torch.float64, device=self.device)
            if mesh.world is not None:  # the largest over all ranks
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=mesh.world)
            metrics["peak_mem_mib"] = float(peak)
        metrics["tokens_per_s"] = stats["n_tokens"] / (time.perf_counter() - t0)
        metrics["epoch"] = self.order.epoch_of(self.step * cfg.global_micro_batches + self.data_offset)
        return metrics

    # -- the run --------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any] | None:
        cfg, mesh = self.cfg, self.mesh
        out = Path(cfg.out)
        main = mesh.is_main
        log = None
        if main:
            kept = self.resume_point.manifest.get("metrics") if self.resume_point is not None else None
            log = report.MetricsLog(out / "metrics.jsonl", resume_step=self.step, expected=kept)
            for note in log.notes:
                print(f"lmloss sft: {note}", flush=True)
        head_mem = None
        if cfg.head_memory:
            head_mem = measure_head_memory(
                self.head.shape[1], cfg.tokens_per_batch // mesh.cp, cfg.head_memory_vocab or self.vocab_rows,
                mesh, device=self.device, dtype=self.head.dtype, chunk_size=cfg.chunk_size,
            )  # fmt: skip
            head_mem.update(model_vocab=self.vocab_rows, cp=mesh.cp)
        bar = None
        if main:
            self._announce(head_mem)
            if cfg.progress and sys.stderr.isatty():  # in a log file the per-step lines say it all
                from tqdm import tqdm

                bar = tqdm(total=cfg.steps, initial=self.step, desc="sft", unit="step", dynamic_ncols=True)
        while self.step < cfg.steps:
            metrics = self.run_step()
            if main:
                log.write(metrics)
                if bar is not None:
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
                    bar.update(1)
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    (bar.write if bar is not None else print)(report.step_line(metrics))
            if cfg.save_every and (self.step % cfg.save_every == 0 or self.step == cfg.steps):
                self.save(log)
        if bar is not None:
            bar.close()
        return self._finish(log, head_mem) if main else None

    def save(self, log: report.MetricsLog | None) -> None:
        """A checkpoint after ``self.step`` steps (every rank calls it; `log` is the main rank's)."""
        cfg = self.cfg
        manifest = None
        if log is not None:
            manifest = {"steps": cfg.steps, "vocab_rows": self.vocab_rows, "run": self.identity,
                        "metrics": log.checksum(), "config": cfg.to_dict()}  # fmt: skip
        state = {"micro_batches_consumed": self.step * cfg.global_micro_batches + self.data_offset,
                 "config": cfg.to_dict()}  # fmt: skip
        checkpoint.save(cfg.out, step=self.step, model=self.model, optimizer=self.optimizer, mesh=self.mesh,
                        state=state, manifest=manifest)  # fmt: skip

    def _announce(self, head_mem: dict[str, float] | None) -> None:
        cfg, m = self.cfg, self.mesh
        n_params = sum(p.numel() for p in self.model.parameters())
        print(f"lmloss sft: {type(self.model).__name__}, {n_params / 1e6:.2f}M parameters on rank 0 "
              f"(LM head shard {tuple(self.head.shape)}), vocab {self.true_vocab} padded to {self.vocab_rows}; "
              f"dp={m.dp} cp={m.cp} tp={m.tp}; {len(self.examples)} examples, "
              f"{cfg.global_micro_batches} x {cfg.tokens_per_batch} tokens per step; loss head: {cfg.loss_impl}")  # fmt: skip
        if self.resume_point is not None and self.resume_point.note:
            print(f"lmloss sft: {self.resume_point.note}")
        if self.resume_point is not None:
            print(f"resumed from {self.resume_point.path} after step {self.step}; training to step {cfg.steps} "
                  f"(schedule of {cfg.total_schedule_steps} steps)")  # fmt: skip
        if self.truncated:
            print(
                f"note: {self.truncated} example(s) were truncated to {cfg.tokens_per_batch} tokens (--truncate)"
            )
        if head_mem:
            print(report.head_memory_line(head_mem))

    def n_parameters(self) -> int:
        """The model's parameter count: this rank's, plus the LM-head rows of the other TP ranks."""
        return sum(p.numel() for p in self.model.parameters()) + self.head.numel() * (self.mesh.tp - 1)

    def _finish(self, log: report.MetricsLog, head_mem: dict[str, float] | None) -> dict[str, Any]:
        rows = log.read()
        m = self.mesh
        summary = {
            "model": type(self.model).__name__,
            "parameters": self.n_parameters(),
            "layout": f"dp={m.dp} cp={m.cp} tp={m.tp}, loss head {self.cfg.loss_impl}",
            "loss_impl": self.cfg.loss_impl,
            "dp": m.dp,
            "cp": m.cp,
            "tp": m.tp,
            "resumed_after": None if self.resume_point is None else self.resume_point.step,
            "first_step": rows[0]["step"] if rows else 0,
            "last_step": rows[-1]["step"] if rows else 0,
            "first_loss": rows[0]["loss"] if rows else math.nan,
            "last_loss": rows[-1]["loss"] if rows else math.nan,
            "min_loss": min((r["loss"] for r in rows), default=math.nan),
            "tail_steps": len(rows[-10:]),  # the last 10 steps, or all of them in a shorter run
            "tail_mean_loss": sum(r["loss"] for r in rows[-10:]) / max(len(rows[-10:]), 1),
            "losses": [r["loss"] for r in rows],
            "grad_norms": [r["grad_norm"] for r in rows],
            "tokens_per_s": sum(r["tokens_per_s"] for r in rows) / max(len(rows), 1),
            "peak_mem_mib": max((r["peak_mem_mib"] for r in rows if "peak_mem_mib" in r), default=None),
            "true_vocab": self.true_vocab,
            "vocab_rows": self.vocab_rows,
            "head_memory": head_mem,
        }
        out = Path(self.cfg.out)
        plot = report.plot_loss(rows, out / "loss.png", summary["layout"])
        summary["plot"] = None if plot is None else str(plot)
        summary["checkpoints"] = [p.name for p in checkpoint.step_dirs(out / "checkpoints")
                                  if (p / checkpoint.MANIFEST).is_file()]  # fmt: skip
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print("summary\n" + report.summary_table(summary))
        print(report.closing_lines(summary, out, summary["checkpoints"]))
        return summary
