"""The model: a Hugging Face causal LM whose body makes hidden states and whose LM head only lends its weight.

The body (``model.model``) runs with the lmloss CP attention (`lmloss.sft.attention`). The LM head is
never called as a module: its weight goes to `lmloss.linear_cross_entropy`. Under tensor parallelism the
head weight is replaced by this rank's vocabulary shard (rows ``[t * V/tp, (t+1) * V/tp)``), so the head's
weight, gradient and optimizer state are sharded; the body stays replicated.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from lmloss.sft import attention


def default_model_config_path() -> Path:
    return Path(str(resources.files("lmloss.sft") / "data" / "tiny_llama.json"))


def is_pretrained_dir(path: str | Path | None) -> bool:
    return path is not None and Path(path).is_dir() and (Path(path) / "config.json").is_file()


def read_model_config(path: str | Path | None) -> dict[str, Any]:
    """A JSON or YAML mapping with ``model_type`` (e.g. ``llama``, ``qwen2``) and the architecture fields."""
    path = default_model_config_path() if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"model config {path} does not exist (give a JSON/YAML file or a model directory)"
        )
    if path.suffix in (".yaml", ".yml"):
        import yaml

        values = yaml.safe_load(path.read_text())
    else:
        values = json.loads(path.read_text())
    if not isinstance(values, dict) or "model_type" not in values:
        raise ValueError(f"model config {path} must be a mapping with a 'model_type' (e.g. 'llama', 'qwen2')")
    return values


def padded_vocab(true_vocab: int, requested: int | None, tp: int) -> int:
    """Embedding rows: `requested`, or the true vocabulary rounded up to a multiple of ``64 * tp``."""
    if requested is not None:
        if requested < true_vocab:
            raise ValueError(f"--vocab-size {requested} is smaller than the tokenizer's {true_vocab} tokens")
        return requested
    multiple = 64 * tp
    return -(-true_vocab // multiple) * multiple


def build_model(
    model_config: str | None, *, vocab_rows: int, seed: int, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """A causal LM with the CP attention, `vocab_rows` embedding rows, randomly initialised from `seed`
    (or loaded from a local ``from_pretrained`` directory). Deterministic: every rank builds the same one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    attn = attention.register()
    if is_pretrained_dir(model_config):
        model = AutoModelForCausalLM.from_pretrained(model_config, attn_implementation=attn)
        if vocab_rows > model.get_input_embeddings().weight.shape[0]:
            model.resize_token_embeddings(vocab_rows, mean_resizing=False)
    else:
        values = read_model_config(model_config)
        values = {k: v for k, v in values.items() if k not in ("vocab_size", "architectures", "torch_dtype")}
        config = AutoConfig.for_model(values.pop("model_type"), vocab_size=vocab_rows, **values)
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported: set use_sliding_window: false")
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    model.config.use_cache = False
    return model.to(dtype)


def head_weight(model: torch.nn.Module) -> torch.nn.Parameter:
    return model.get_output_embeddings().weight


def shard_head(model: torch.nn.Module, tp_rank: int, tp_size: int) -> None:
    """Keep only this rank's rows of the LM head weight (a new, smaller Parameter)."""
    if tp_size == 1:
        return
    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:
        raise ValueError(
            "tp > 1 needs an untied LM head (tie_word_embeddings: false): the embedding is replicated"
        )
    if getattr(head, "bias", None) is not None:
        raise ValueError("an LM head with a bias is not supported under tp > 1")
    rows = head.weight.shape[0]
    if rows % tp_size:
        raise ValueError(f"the LM head's {rows} rows do not split evenly over tp={tp_size}; use --vocab-size")
    n = rows // tp_size
    head.weight = torch.nn.Parameter(head.weight.detach()[tp_rank * n : (tp_rank + 1) * n].clone())
    head.out_features = n
