"""A byte-level BPE tokenizer trained offline on the run's own data, or a local tokenizer.json.

Training is deterministic for the same texts and size, and the result is cached as
``<out>/tokenizer.json`` with ``<out>/tokenizer.meta.json`` beside it: the sha256 of the texts and size it
was trained on, and of the file itself. The cache is reused only when both match (every rank of a
distributed run, a resumed run); a tokenizer trained on other data, or a damaged file, is retrained.
"""

from __future__ import annotations

import dataclasses
import hashlib
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

    def fingerprint(self) -> str:
        """sha256 of the tokenizer's canonical serialization: equal for the same vocabulary and rules."""
        return hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()


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


def texts_fingerprint(texts: list[str], vocab_size: int) -> str:
    """sha256 of what a BPE is trained on: the size and every text (length-prefixed, so no two lists collide)."""
    h = hashlib.sha256(f"bpe vocab {vocab_size}\n".encode())
    for text in texts:
        raw = text.encode()
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def prepare_tokenizer(texts: list[str], vocab_size: int, cache_file: str | Path) -> TextTokenizer:
    """The BPE of `texts` at `vocab_size`: `cache_file` if it was trained on exactly them, else trained now
    and written there (atomically, the fingerprint file ``<stem>.meta.json`` after it)."""
    cache_file = Path(cache_file)
    meta_file = cache_file.with_name(cache_file.stem + ".meta.json")
    wanted = texts_fingerprint(texts, vocab_size)
    if cache_file.is_file() and meta_file.is_file():
        try:
            meta = json.loads(meta_file.read_text())
        except json.JSONDecodeError:
            meta = {}
        raw = cache_file.read_bytes()
        if meta.get("trained_on_sha256") == wanted and meta.get("sha256") == hashlib.sha256(raw).hexdigest():
            return _wrap(Tokenizer.from_str(raw.decode()), str(cache_file))
    tok = train_bpe(texts, vocab_size)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(json.loads(tok.to_str()), indent=None)
    _atomic_write(cache_file, text)
    meta = {"trained_on_sha256": wanted, "tokenizer_vocab": vocab_size,
            "sha256": hashlib.sha256(text.encode()).hexdigest()}  # fmt: skip
    _atomic_write(meta_file, json.dumps(meta, indent=1))
    return _wrap(tok, str(cache_file))
