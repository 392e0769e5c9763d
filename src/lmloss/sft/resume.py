"""What a run is, so that a resumed run is the same run: its identity, and the checks before resuming.

A run's identity is its `RUN_FIELDS` as resolved: the data and the tokenizer by content (sha256), the
model config by content, the global micro-batch count and the schedule's length as numbers. It is stored
in every checkpoint's manifest. Resuming fills what the command line left open from the checkpoint (the
target ``steps``, the schedule's length, so the cosine keeps its course when ``--steps`` grows) and refuses
any other difference unless ``--override NAME`` names it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from lmloss.sft.checkpoint import CheckpointError, ResumePoint
from lmloss.sft.config import RUN_FIELDS, SFTConfig
from lmloss.sft.model import default_model_config_path, is_pretrained_dir


def _sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def model_config_sha256(model_config: str | None) -> str:
    """sha256 of the model's config file (a ``from_pretrained`` directory: its ``config.json``)."""
    if model_config is None:
        return _sha256_of(default_model_config_path())
    path = Path(model_config)
    return _sha256_of(path / "config.json" if is_pretrained_dir(path) else path)


def run_identity(cfg: SFTConfig, *, data_sha256: str, tokenizer_sha256: str) -> dict[str, Any]:
    """`RUN_FIELDS` -> this run's values, comparable across machines and paths (JSON-serialisable)."""
    identity = {name: getattr(cfg, name) for name in RUN_FIELDS}
    identity.update(data=data_sha256, tokenizer=tokenizer_sha256, model_config=model_config_sha256(cfg.model_config),
                    micro_batches=cfg.global_micro_batches, schedule_steps=cfg.total_schedule_steps)  # fmt: skip
    return identity


def _show(value: Any) -> str:
    if isinstance(value, str) and len(value) == 64:  # a sha256
        return f"sha256 {value[:12]}"
    return repr(value)


def resolve(cfg: SFTConfig, point: ResumePoint, *, data_sha256: str, tokenizer_sha256: str) -> SFTConfig:
    """`cfg` for continuing from `point`: open fields filled from the checkpoint, differences refused.

    ``steps`` not given: the resumed run's target; ``schedule_steps`` not given: the resumed run's schedule
    (so a larger ``--steps`` trains on at the schedule's final learning rate instead of re-stretching the
    cosine). Raises ValueError (one line) when there is nothing left to train, when tp differs, or when a
    `RUN_FIELDS` value differs and ``--override`` does not name it.
    """
    manifest = point.manifest
    if manifest["tp"] != cfg.tp:
        raise CheckpointError(f"checkpoint {point.path} was written with tp={manifest['tp']}; resume with "
                              f"--tp {manifest['tp']} (the LM-head shards are not re-split)")  # fmt: skip
    saved = manifest["run"]
    filled = {}
    if cfg.steps is None:
        filled["steps"] = manifest["steps"]
    if cfg.schedule_steps is None:
        filled["schedule_steps"] = saved["schedule_steps"]
    cfg = dataclasses.replace(cfg, **filled)
    if cfg.steps <= point.step:
        raise ValueError(
            f"nothing to train: checkpoint {point.path} is at step {point.step} and --steps is {cfg.steps}; "
            f"pass --steps greater than {point.step} to train further"
        )
    now = run_identity(cfg, data_sha256=data_sha256, tokenizer_sha256=tokenizer_sha256)
    changed = [name for name in RUN_FIELDS if now[name] != saved.get(name) and name not in cfg.override]
    if changed:
        what = ", ".join(f"{name} ({_show(saved.get(name))} -> {_show(now[name])})" for name in changed)
        raise ValueError(
            f"resuming {point.path} would change the run: {what}; keep the original settings, or pass "
            f"--override {','.join(changed)} to accept"
        )
    return cfg
