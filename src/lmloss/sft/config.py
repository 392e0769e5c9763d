"""The run's configuration: one dataclass, loadable from YAML, overridable from the command line."""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any

LOSS_IMPLS = ("fused", "naive")
DEFAULT_STEPS = 100
#: The fields that define what a run computes (its data, model, optimizer and schedule). Resuming with a
#: different value is refused unless ``--override NAME`` names it; the layout (dp, cp, nproc, device),
#: chunking, logging and ``steps`` (train further) may change freely. ``data`` and ``tokenizer`` are
#: compared by content (sha256), not by path.
RUN_FIELDS = (
    "data", "tokenizer", "tokenizer_vocab", "model_config", "vocab_size", "truncate", "tokens_per_batch",
    "micro_batches", "lr", "min_lr_ratio", "warmup_steps", "schedule_steps", "weight_decay", "grad_clip",
    "seed", "shuffle", "dtype", "loss_impl",
)  # fmt: skip
_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


class ConfigError(ValueError):
    """A config value of the wrong type or out of range; the message names the field."""


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
    steps: int | None = None  # default DEFAULT_STEPS; on resume, the resumed run's
    schedule_steps: int | None = None  # length of the warmup + cosine schedule; default steps (resume: kept)
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
    resume: str | None = None  # a checkpoint directory, or "latest" (the newest intact under out/checkpoints)
    overwrite: bool = False  # clear a non-empty `out` (an earlier run's) before starting
    override: tuple[str, ...] = ()  # RUN_FIELDS a resumed run may change
    log_every: int = 1
    progress: bool = True
    track_memory: bool = True  # measure every step's peak memory (exact live-tensor tracking on CPU: slower)
    head_memory: bool = True  # measure the loss head's peak memory, fused vs naive, before training
    head_memory_vocab: int | None = None  # vocabulary of that measurement; default: the model's padded one
    memory_profile: dict[str, Any] | None = None  # lmloss.profiling.MemoryProfilerConfig fields

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            setattr(self, field.name, coerce(field.name, getattr(self, field.name), hints[field.name]))
        if self.steps is None and self.resume is None:
            self.steps = DEFAULT_STEPS
        self.validate()

    def validate(self) -> None:
        """Check values that do not need the world size (that check happens at launch)."""
        for name in ("dp", "cp", "tp", "tokens_per_batch", "steps", "schedule_steps", "tokenizer_vocab",
                     "log_every"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("lr", "min_lr_ratio", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        unknown = sorted(set(self.override) - set(RUN_FIELDS))
        if unknown:
            raise ConfigError(
                f"override names {unknown} are not run settings; known: {', '.join(RUN_FIELDS)}"
            )
        if self.override and self.resume is None:
            raise ConfigError(f"override {list(self.override)} applies to a resumed run only (--resume)")
        if self.overwrite and self.resume is not None:
            raise ConfigError("--overwrite clears --out, --resume continues from it: pass one of them")
        if self.micro_batches is not None and (self.micro_batches < 1 or self.micro_batches % self.dp):
            raise ConfigError(
                f"micro_batches={self.micro_batches} must be a positive multiple of dp={self.dp}: "
                "every DP rank takes the same number of micro-batches per step"
            )
        if self.nproc is not None and self.nproc != self.dp * self.cp * self.tp:
            raise ConfigError(
                f"--nproc {self.nproc} processes cannot be laid out as dp*cp*tp = "
                f"{self.dp}*{self.cp}*{self.tp} = {self.dp * self.cp * self.tp}"
            )
        if self.loss_impl not in LOSS_IMPLS:
            raise ConfigError(f"loss_impl must be one of {LOSS_IMPLS}, got {self.loss_impl!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.save_every < 0:
            raise ConfigError(f"save_every must be >= 0, got {self.save_every}")
        if self.head_memory_vocab is not None and (
            self.head_memory_vocab < 1 or self.head_memory_vocab % self.tp
        ):
            raise ConfigError(
                f"head_memory_vocab={self.head_memory_vocab} must be a positive multiple of tp={self.tp}"
            )
        if self.memory_profile is not None:
            from lmloss.profiling import MemoryProfilerConfig

            MemoryProfilerConfig.from_dict(self.memory_profile)  # fail now, not at the profiled step
        if self.vocab_size is not None and self.vocab_size % self.tp:
            raise ConfigError(
                f"vocab_size={self.vocab_size} must be divisible by tp={self.tp} (even vocab shards)"
            )

    @property
    def total_schedule_steps(self) -> int:
        """Steps of the warmup + cosine schedule: `schedule_steps`, else `steps`."""
        return self.schedule_steps if self.schedule_steps is not None else self.steps

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
            raise ConfigError(f"unknown config keys {unknown}; known: {sorted(known)}")
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


def coerce(name: str, value: Any, hint: Any) -> Any:
    """`value` as the field's type where that is unambiguous, else a ConfigError naming the field.

    YAML 1.1 reads ``1e-3`` as a string (it needs a dot: ``1.0e-3``) and ``"false"`` stays a string: such
    strings become the number or bool they spell. Bools accept true/false, yes/no, on/off, 1/0 (any case);
    anything else (``"maybe"``, 2) is an error rather than a truthy guess.
    """
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kinds = [a for a in args if a is not type(None)]
    if value is None:
        if len(kinds) < len(args):
            return None
        raise ConfigError(f"{name} must not be null")
    if name == "chunk_size":  # int | "auto" | None
        if value == "auto":
            return value
        if isinstance(value, str) and value.lower() in ("none", "null"):
            return None
        return _to_int(name, value, "an integer, 'auto' or null")
    kind = kinds[0]
    origin = typing.get_origin(kind)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if kind is int:
        return _to_int(name, value, "an integer")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, Path):
            return str(value)
        raise ConfigError(f"{name} must be a string, got {value!r} ({type(value).__name__})")
    if origin is dict:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ConfigError(
                    f"{name} must be a mapping (JSON or YAML), got {value!r}: {err.msg}"
                ) from None
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a mapping, got {value!r}")
        return value
    if origin is tuple:  # a list of names: a YAML list, repeated flags, or "a,b"
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
            raise ConfigError(f"{name} must be a list of names, got {value!r}")
        return tuple(v.strip().replace("-", "_") for part in items for v in part.split(",") if v.strip())
    raise TypeError(f"no coercion for field {name} of type {hint}")  # a new field needs a rule here


def _to_int(name: str, value: Any, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    number = value
    if isinstance(value, str):
        try:
            number = float(value)  # "1e3" (YAML 1.1 string), "512"
        except ValueError:
            number = None
    if isinstance(number, float) and number.is_integer():
        return int(number)
    raise ConfigError(f"{name} must be {what}, got {value!r}")
