"""A byte-level BPE tokenizer trained offline on the run's own data, or a local tokenizer.json.

Training is deterministic for the same texts and size, and the result is cached as
``<out>/tokenizer.json``: a resumed run (and every rank of a distributed one) reads that file, so all
processes and restarts share one vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
PAD = "<|pad|>"
_EOS_CANDIDATES = (EOS, "<|im_end|>", "</s>", "<eos>", "<|end_of_text|>")


@dataclasses.dataclass
class TextTokenizer:
    """The tokenizer with the two ids the trainer needs. `vocab_size` is the true (unpadded) vocabulary."""

    tokenizer: Tokenizer
    eos_id: int
    pad_id: int

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with `vocab_size` entries (at least the 256 bytes and two special tokens)."""
    if vocab_size < 258:
        raise ValueError(f"tokenizer_vocab={vocab_size} is too small: a byte-level BPE needs at least 258")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def _wrap(tok: Tokenizer, source: str) -> TextTokenizer:
    vocab = tok.get_vocab(with_added_tokens=True)
    eos = next((vocab[t] for t in _EOS_CANDIDATES if t in vocab), None)
    if eos is None:
        raise ValueError(f"tokenizer {source} has none of the end-of-text tokens {_EOS_CANDIDATES}")
    return TextTokenizer(tok, eos_id=eos, pad_id=vocab.get(PAD, eos))


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """A tokenizer.json file, or a directory holding one (e.g. a Hugging Face model directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer at {path}")
    return _wrap(Tokenizer.from_file(str(path)), str(path))


def prepare_tokenizer(texts: list[str], vocab_size: int, cache_file: str | Path) -> TextTokenizer:
    """Load `cache_file` if it exists, else train on `texts` and write it there (atomically)."""
    cache_file = Path(cache_file)
    if cache_file.is_file():
        return load_tokenizer(cache_file)
    tok = train_bpe(texts, vocab_size)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(json.loads(tok.to_str()), indent=None))
    os.replace(tmp, cache_file)
    return _wrap(tok, str(cache_file))
