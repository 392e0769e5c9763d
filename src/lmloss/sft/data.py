"""Reading JSONL examples, turning them into token ids with a loss mask, and the deterministic batch order.

Each line of a dataset file is a JSON object, either ``{"prompt": str, "response": str}`` (the loss is on
the response tokens and the end-of-text token only) or ``{"text": str}`` (every token is a target).
Blank lines are skipped. A malformed line stops the run before any training: the error names the file and
every bad line number (up to ten), and nothing of the file is used.

The batch order is a pure function of (examples, tokens_per_batch, seed): every rank can compute which
examples form global micro-batch ``i`` without talking to anyone, and a resumed run continues exactly.
"""

from __future__ import annotations

import dataclasses
import json
import random
from importlib import resources
from pathlib import Path

MAX_REPORTED_ERRORS = 10


def default_dataset_path() -> Path:
    """The embedded dataset shipped with the package (see `lmloss.sft.tasks`)."""
    return Path(str(resources.files("lmloss.sft") / "data" / "tasks.jsonl"))


class DataError(ValueError):
    """A dataset problem the user must fix; the message says where."""


@dataclasses.dataclass(frozen=True)
class Example:
    """One record: ``prompt`` is None for a plain ``{"text": ...}`` record (then all of `text` is trained on)."""

    line: int
    text: str
    prompt: str | None = None


@dataclasses.dataclass(frozen=True)
class TokenizedExample:
    """Token ids (end-of-text appended) and which of them are targets, aligned with the ids."""

    line: int
    ids: list[int]
    targets: list[bool]


def load_jsonl(path: str | Path | None) -> list[Example]:
    """Read a dataset file (None: the embedded default). Raises DataError naming bad lines."""
    path = default_dataset_path() if path is None else Path(path)
    if not path.is_file():
        raise DataError(f"dataset file {path} does not exist")
    examples, errors = [], []
    with open(path, encoding="utf-8") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                examples.append(_parse_record(json.loads(raw), line_no))
            except json.JSONDecodeError as err:
                errors.append(f"  line {line_no}: not valid JSON ({err.msg} at column {err.colno})")
            except DataError as err:
                errors.append(f"  line {line_no}: {err}")
    if errors:
        shown = errors[:MAX_REPORTED_ERRORS]
        more = f"\n  ... and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""
        raise DataError(
            f"{path}: {len(errors)} malformed line(s); fix them (nothing was loaded):\n"
            + "\n".join(shown)
            + more
        )
    if not examples:
        raise DataError(f"dataset file {path} holds no examples (it is empty or only blank lines)")
    return examples


def _parse_record(record: object, line_no: int) -> Example:
    if not isinstance(record, dict):
        raise DataError(f"expected a JSON object, got {type(record).__name__}")
    if "prompt" in record or "response" in record:
        prompt, response = record.get("prompt"), record.get("response")
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise DataError('a prompt/response record needs string fields "prompt" and "response"')
        if not response:
            raise DataError('"response" is empty: the example would have nothing to learn')
        return Example(line=line_no, text=response, prompt=prompt)
    if "text" in record:
        if not isinstance(record["text"], str) or not record["text"]:
            raise DataError('"text" must be a non-empty string')
        return Example(line=line_no, text=record["text"])
    raise DataError(f'expected keys "prompt" and "response", or "text"; got {sorted(record)}')


def tokenize(
    examples: list[Example],
    encode,
    eos_id: int,
    *,
    max_tokens: int,
    truncate: bool,
    path: str | Path | None = None,
) -> tuple[list[TokenizedExample], int]:
    """Encode every example; return them and how many were truncated.

    `encode(str) -> list[int]`. An example longer than `max_tokens` (end-of-text included) is cut to
    `max_tokens` when `truncate`, else the run stops with a DataError listing such lines. No example is
    ever dropped.
    """
    out, too_long = [], []
    for ex in examples:
        prompt_ids = encode(ex.prompt) if ex.prompt is not None else []
        body_ids = encode(ex.text) + [eos_id]
        ids = prompt_ids + body_ids
        targets = [ex.prompt is None] * len(prompt_ids) + [True] * len(body_ids)
        if len(ids) > max_tokens:
            too_long.append((ex.line, len(ids)))
            ids, targets = ids[:max_tokens], targets[:max_tokens]
        out.append(TokenizedExample(line=ex.line, ids=ids, targets=targets))
    if too_long and not truncate:
        where = "the default dataset" if path is None else str(path)
        shown = ", ".join(f"line {n} ({k} tokens)" for n, k in too_long[:MAX_REPORTED_ERRORS])
        raise DataError(
            f"{where}: {len(too_long)} example(s) are longer than tokens_per_batch={max_tokens}: {shown}. "
            "Raise --tokens-per-batch, or pass --truncate to cut them to that length."
        )
    return out, len(too_long)


class BatchOrder:
    """Which examples form each global micro-batch, epoch after epoch.

    Per epoch the examples are shuffled (seeded by ``seed + epoch``; or kept in file order) and packed
    greedily: an example joins the current micro-batch while the real tokens stay within
    `tokens_per_batch`, else it starts the next one. Padding added later for the CP layout is not
    counted, so the grouping is the same for every cp.
    """

    def __init__(self, lengths: list[int], tokens_per_batch: int, *, seed: int, shuffle: bool = True) -> None:
        if not lengths:
            raise DataError("no examples to batch")
        if max(lengths) > tokens_per_batch:
            raise DataError(
                f"an example has {max(lengths)} tokens, more than tokens_per_batch={tokens_per_batch}"
            )
        self.lengths = lengths
        self.tokens_per_batch = tokens_per_batch
        self.seed = seed
        self.shuffle = shuffle
        self._epochs: list[list[list[int]]] = []

    def epoch(self, e: int) -> list[list[int]]:
        """The micro-batches of epoch `e`, each a list of example indices."""
        while len(self._epochs) <= e:
            order = list(range(len(self.lengths)))
            if self.shuffle:
                random.Random(self.seed + len(self._epochs)).shuffle(order)
            batches, current, used = [], [], 0
            for i in order:
                if current and used + self.lengths[i] > self.tokens_per_batch:
                    batches.append(current)
                    current, used = [], 0
                current.append(i)
                used += self.lengths[i]
            batches.append(current)
            self._epochs.append(batches)
        return self._epochs[e]

    def micro_batch(self, index: int) -> list[int]:
        """Global micro-batch `index` of the endless stream (epochs back to back)."""
        e = 0
        while index >= len(self.epoch(e)):
            index -= len(self.epoch(e))
            e += 1
        return self.epoch(e)[index]

    def epoch_of(self, index: int) -> float:
        """Fractional epoch reached after `index` micro-batches."""
        e = 0
        while index >= len(self.epoch(e)):
            index -= len(self.epoch(e))
            e += 1
        return e + index / len(self.epoch(e))
