"""The run's configuration: one dataclass, loadable from YAML, overridable from the command line."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

LOSS_IMPLS = ("fused", "naive")


@dataclasses.dataclass
class SFTConfig:
    """Everything a run needs. Field names are the YAML keys; ``--flag-name`` on the command line.

    The global batch of one optimizer step is `micro_batches` packed micro-batches of at most
    `tokens_per_batch` real tokens each, split evenly across the DP ranks (each DP rank accumulates
    ``micro_batches / dp`` of them). It does not depend on dp, cp or tp, so runs with different layouts
    see the same data and compute the same loss.
    """

    # data and model
    data: str | None = None  # JSONL path; None: the embedded default dataset
    model_config: str | None = (
        None  # JSON/YAML config or a from_pretrained directory; None: embedded tiny Llama
    )
    tokenizer: str | None = None  # tokenizer.json or a directory holding one; None: train a BPE on the data
    tokenizer_vocab: int = 512  # target size of the BPE trained on the data
    vocab_size: int | None = None  # pad the embedding / LM head to this many rows (e.g. 151936)
    truncate: bool = False  # cut examples longer than tokens_per_batch instead of stopping with an error
    # batch and schedule
    tokens_per_batch: int = 512
    micro_batches: int | None = None  # per optimizer step, over all DP ranks; default dp
    steps: int = 100
    lr: float = 1e-2
    min_lr_ratio: float = 0.1
    warmup_steps: int = 5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    shuffle: bool = True
    # parallelism and numerics
    dp: int = 1
    cp: int = 1
    tp: int = 1
    nproc: int | None = None  # spawn this many local processes (instead of torchrun)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"  # float32 | bfloat16
    loss_impl: str = "fused"  # fused: lmloss.linear_cross_entropy; naive: lm_head logits + cross_entropy
    chunk_size: int | str | None = "auto"
    # output
    out: str = "runs/sft"
    save_every: int = 0  # 0: never
    resume: str | None = None  # a checkpoint directory, or "latest" (the newest under out/checkpoints)
    log_every: int = 1
    progress: bool = True
    track_memory: bool = True  # measure every step's peak memory (exact live-tensor tracking on CPU: slower)
    head_memory: bool = True  # measure the loss head's peak memory, fused vs naive, before training
    head_memory_vocab: int | None = None  # vocabulary of that measurement; default: the model's padded one
    memory_profile: dict[str, Any] | None = None  # lmloss.profiling.MemoryProfilerConfig fields

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check values that do not need the world size (that check happens at launch)."""
        for name in ("dp", "cp", "tp", "tokens_per_batch", "steps", "tokenizer_vocab", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.micro_batches is not None and (self.micro_batches < 1 or self.micro_batches % self.dp):
            raise ValueError(
                f"micro_batches={self.micro_batches} must be a positive multiple of dp={self.dp}: "
                "every DP rank takes the same number of micro-batches per step"
            )
        if self.nproc is not None and self.nproc != self.dp * self.cp * self.tp:
            raise ValueError(
                f"--nproc {self.nproc} processes cannot be laid out as dp*cp*tp = "
                f"{self.dp}*{self.cp}*{self.tp} = {self.dp * self.cp * self.tp}"
            )
        if self.loss_impl not in LOSS_IMPLS:
            raise ValueError(f"loss_impl must be one of {LOSS_IMPLS}, got {self.loss_impl!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.save_every < 0:
            raise ValueError(f"save_every must be >= 0, got {self.save_every}")
        if self.head_memory_vocab is not None and (
            self.head_memory_vocab < 1 or self.head_memory_vocab % self.tp
        ):
            raise ValueError(
                f"head_memory_vocab={self.head_memory_vocab} must be a positive multiple of tp={self.tp}"
            )
        if self.memory_profile is not None:
            from lmloss.profiling import MemoryProfilerConfig

            MemoryProfilerConfig.from_dict(self.memory_profile)  # fail now, not at the profiled step
        if self.vocab_size is not None and self.vocab_size % self.tp:
            raise ValueError(
                f"vocab_size={self.vocab_size} must be divisible by tp={self.tp} (even vocab shards)"
            )

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp

    @property
    def global_micro_batches(self) -> int:
        return self.micro_batches if self.micro_batches is not None else self.dp

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SFTConfig:
        """Build from a mapping; keys may use dashes or underscores. Unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        clean = {k.replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(clean) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known: {sorted(known)}")
        return cls(**clean)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> SFTConfig:
        """Load `path` (YAML mapping), then apply `overrides` (e.g. flags given on the command line)."""
        import yaml

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise ValueError(f"config file {path} must hold a mapping of keys to values")
        return cls.from_dict({**values, **(overrides or {})})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
