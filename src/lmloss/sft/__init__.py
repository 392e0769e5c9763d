"""``lmloss sft``: end-to-end packed SFT of a Hugging Face causal LM on lmloss's fused, vocab-parallel loss head.

`SFTConfig` describes a run and `run(config)` trains it (spawning local processes when dp*cp*tp > 1).
Modules, one concern each: `config`, `data` (JSONL, tokenization, batch order), `tasks` (the embedded
dataset), `tokenizer`, `model`, `attention` (CP attention for transformers), `parallel` (process groups,
gradient sums, launching), `trainer` (the loop), `checkpoint` (checksummed shards, finding an intact
one), `resume` (a run's identity and what a resumed run may change), `report`, `launch` (--out, spawning),
`cli`.
Needs the ``sft`` extra: ``pip install -e ".[sft]"`` in a checkout of lmloss (it is not on PyPI).
"""

from lmloss.sft.config import SFTConfig


def run(config: SFTConfig) -> dict:
    """Train as configured; return the summary (also written to ``<out>/summary.json``)."""
    from lmloss.sft.launch import run as _run

    return _run(config)


__all__ = ["SFTConfig", "run"]
