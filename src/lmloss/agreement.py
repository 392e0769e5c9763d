"""The rank agreement: ranks that compute one result together check locally, agree globally, then raise.

Every op under a TP group makes ONE all-gather of a fixed-size int64 vector before any other collective
(`gather_plan`, called by `lmloss.vocab_parallel.resolve_shard` for the plan): its options, shapes and
dtypes, and fingerprints of every per-token tensor that changes the result. A function that is not a plan's
op (`lmloss.rl.token_weights`, `policy_loss` over `cp_group`, ...) agrees over its group the same way
(`agree_over_group`). An argument check that fails on one rank travels in that gather as an error code
(`errors_raised_on_every_rank`) and every rank raises the same `RankAgreementError`; a disagreement raises
on every rank alike, naming the argument and each rank's value.

What the agreement covers and what it does not is written down in docs/reliability.md.

Fingerprints (`tensor_fingerprint`) are a sum over the elements of a non-linear 64-bit mix of each
element's bits and its position, plus a mix of the dtype and the shape: a patterned change (+d, -d, -d, +d
at four positions) moves them as surely as a random one (a collision has odds of about 2**-64).
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Sequence

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


class RankAgreementError(ValueError):
    """Raised on every rank of a TP group when the ranks' arguments disagree, or when one rank's arguments
    fail a check: every rank raises the same message, naming the rank(s) and the argument.

    `fields`: the names the ranks disagree on (an agreement field, option or tensor argument), empty where a
    rank's own check failed."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = tuple(fields)


class RankAgreementTypeError(RankAgreementError, TypeError):
    """`RankAgreementError` for an argument of the wrong type on some rank (also a `TypeError`)."""


#: The agreement vector: one int64 per field, in this order, the same length for every op, dtype and
#: option (a collective whose size depended on them would abort the job instead of raising). The
#: `PER_RANK_FIELDS` may differ between ranks; every other field must be equal on every rank. Floats
#: travel as their float64 bits. The label statistics (`lmloss._validate.label_stats`) come last, from
#: the device, so that they need no host sync before the collective.
PER_RANK_FIELDS = ("error", "V_local", "vocab_start", "label_min", "label_max")
HOST_FIELDS = (
    "error", "V_local", "vocab_start", "vocab_start_given", "vocab_size", "check_ranks", "op", "outputs",
    "reduction", "dtype", "grad", "mean_group", "n_tokens", "hidden_width", "sequence_parallel", "chunk_size",
    "chunk_budget", "weight_grad_dtype", "impl", "ignore_index", "temperature", "softcap", "label_smoothing", "z_loss",
    # lmloss.distill: the divergence and the teacher
    "beta", "sparse_teacher", "tail", "teacher_topk", "teacher_width", "teacher_softcap",
    # lmloss.sampling.Sampling.agree_fields: the rollout engine's truncation; a replayed support's width
    "top_k_max", "top_p", "min_p", "log_kept_mass", "slots",
    # an objective's options beyond these (RL policy options, distillation softcaps...): a hash of them, and
    # on a mismatch every rank's text of them in a second gather
    "objective",
    # invariant=True (docs/invariant.md): the block sums and their fixed-point combine
    "invariant",
    # the dtype and shape of every tensor argument (`describe_arguments`): a hash, and on a mismatch every
    # rank's text of them in a second gather
    "arguments",
)  # fmt: skip
#: The labels: their range (checked against the agreed vocabulary), how many count, and their fingerprint.
LABEL_FIELDS = ("label_min", "label_max", "labels_count", "labels_hash")
#: Per-token tensors that change what a rank computes, each agreed by a fingerprint (`tensor_fingerprint`):
#: a rank that holds other values raises on every rank instead of computing its own answer.
TENSOR_FIELDS = (
    "mask",  # ops whose labels only say which tokens count (distillation): labels != ignore_index
    "advantages", "old_logprobs", "ref_logprobs", "rollout_is_weights", "token_weights", "sequence_ids",
    "cu_seqlens", "pg_mask", "cov_selection",
    "top_k", "top_p", "min_p", "support", "teacher_ids", "teacher_logprobs",
    # the state of the generator a random selection draws from (clip_cov without cov_selection)
    "generator",
)  # fmt: skip
#: HOST fields that carry a hash of a text: on a mismatch every rank's text is gathered and shown.
TEXT_FIELDS = {"objective": "the objective's options", "arguments": "the tensor arguments' dtypes and shapes"}
FLOAT_FIELDS = frozenset(
    {"temperature", "softcap", "label_smoothing", "z_loss", "chunk_budget", "beta", "top_p", "min_p", "teacher_softcap"}
)
#: Arguments whose size along one dimension is this rank's share of the vocabulary (agreed as V_local, and
#: allowed to differ between ranks): that dimension is written ``V_local`` by `describe_arguments`.
VOCAB_DIMS = {"logits": -1, "teacher_logits": -1, "weight": 0, "bias": 0, "ref_weight": 0, "teacher_weight": 0}
#: Bytes of each rank's message in the second gather (made only when some rank failed a check).
MESSAGE_BYTES = 512
#: Bytes of each rank's text of `TEXT_FIELDS` in the second gather (made only when a text differs).
TEXT_BYTES = 4096
#: How a field is shown in a disagreement message (its codes).
_SHOWN = {
    "vocab_start_given": "vocab_start passed (1) or not (0)",
    "vocab_size": "vocab_size (-1: None)",
    "check_ranks": "LMLOSS_CHECK_RANKS (0: set to 0, 1: anything else)",
    "op": "the op (0: from logits, 1: fused linear_*, 2: distillation from logits, 3: fused distillation, 4: fused policy loss, 5: fused preference loss)",
    "outputs": "outputs (bits: 1 logprobs, 2 entropy, 4 loss)",
    "reduction": "reduction (0: mean, 1: sum, 2: none, -1: a per-token op)",
    "dtype": "dtype (0: float16, 1: bfloat16, 2: float32, 3: float64)",
    "grad": "whether gradients will be needed (bits: 1 logits / hidden, 2 weight, 4 bias; grad mode and requires_grad)",
    "mean_group": "mean_group (its size; -1: None)",
    "chunk_size": "chunk_size (-1: None, -2: 'auto')",
    "chunk_budget": "the memory budget in MiB (memory_budget_mib, LMLOSS_CHUNK_BUDGET_MIB or the default)",
    "weight_grad_dtype": "weight_grad_dtype (0: float16, 1: bfloat16, 2: float32, 3: float64)",
    "softcap": "softcap (0.0: None)",
    "impl": "impl (0: torch, 1: triton)",
    "top_k_max": "top_k (its largest value; 0: None)",
    "top_p": "top_p (2.0: None, -3.0: a per-token tensor)",
    "min_p": "min_p (-1.0: None, -3.0: a per-token tensor)",
    "slots": "support width K (0: no support)",
    "invariant": "invariant (0: False, 1: True)",
}  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# fingerprints


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


_MIX_1, _MIX_2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)  # splitmix64's finalizer
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_DTYPE_KEYS = {
    dtype: i + 1
    for i, dtype in enumerate(
        (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
         torch.float32, torch.float64)  # fmt: skip
    )
}


def _shift_right(z: torch.Tensor, k: int) -> torch.Tensor:
    """A logical right shift of int64 `z` (torch's ``>>`` is arithmetic: it copies the sign bit)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (wrapping arithmetic): a bijection of 64-bit words in which every input
    bit flips each output bit with probability about 1/2. Elementwise; no host sync."""
    z = (z ^ _shift_right(z, 30)) * _MIX_1
    z = (z ^ _shift_right(z, 27)) * _MIX_2
    return z ^ _shift_right(z, 31)


def _bits(flat: torch.Tensor) -> torch.Tensor:
    """Each element's bits as an int64 (a float's bit pattern, sign-extended from its width)."""
    if flat.dtype == torch.bool:
        return flat.to(torch.int64)
    if flat.is_complex():
        return _bits(torch.view_as_real(flat).reshape(-1))
    if flat.element_size() == 8:
        return flat.contiguous().view(torch.int64)
    return flat.contiguous().view({4: torch.int32, 2: torch.int16, 1: torch.int8}[flat.element_size()]).to(torch.int64)


def tensor_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """0-d int64 on `t`'s device: ``sum_i mix64(mix64(i + key) ^ bits_i)`` over the elements, plus a mix of
    the dtype and the shape. Each term is a pseudo-random function of an element's bits and its place, so
    that no change of values, places, dtype or shape leaves the sum as it was but by a 2**-64 chance (a
    position-weighted sum, linear in the values, is left unchanged by +d, -d, -d, +d at four places). No
    host sync; the sum wraps around int64 the same way on every rank."""
    flat = t.detach().reshape(-1)
    header = [_DTYPE_KEYS.get(flat.dtype, 99), t.dim(), *t.shape]
    h = 0
    for v in header:  # the dtype and shape: host integers, mixed on the host
        h = _signed((_unsigned_mix((h ^ v) & 0xFFFFFFFFFFFFFFFF) + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF)
    position = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device) * _GOLDEN + h
    return mix64(mix64(position) ^ _bits(flat)).sum() + h


def _unsigned_mix(z: int) -> int:
    """`mix64` of one host integer in [0, 2**64)."""
    m = (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def tensor_stats(tensors: dict[str, torch.Tensor | None] | None, device: torch.device) -> torch.Tensor:
    """``[len(TENSOR_FIELDS)]`` int64: each named tensor's fingerprint (0 where absent)."""
    tensors = tensors or {}
    unknown = set(tensors) - set(TENSOR_FIELDS)
    assert not unknown, f"not in the agreement vector: {unknown}"
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return torch.stack(
        [tensor_fingerprint(tensors[k]).to(device) if tensors.get(k) is not None else zero for k in TENSOR_FIELDS]
    )


def generator_state(generator: torch.Generator | None) -> torch.Tensor:
    """The state a random draw on `generator` starts from (torch's default CPU generator for None): a uint8
    tensor to fingerprint (`TENSOR_FIELDS`' ``"generator"``), so that ranks which must draw alike agree."""
    return (generator if generator is not None else torch.default_generator).get_state()


def describe_arguments(arguments: dict[str, torch.Tensor | None]) -> str:
    """``"name: dtype [d0, d1]; ..."`` of every tensor argument (``None`` where not given), its dimension along
    this rank's vocabulary shard (`VOCAB_DIMS`) written ``V_local`` (agreed apart, and per rank)."""
    parts = []
    for name, t in sorted(arguments.items()):
        if not isinstance(t, torch.Tensor):
            parts.append(f"{name}: None" if t is None else f"{name}: {type(t).__name__}")
            continue
        dims = [str(d) for d in t.shape]
        if name in VOCAB_DIMS and t.dim():
            dims[VOCAB_DIMS[name]] = "V_local"
        parts.append(f"{name}: {str(t.dtype).removeprefix('torch.')} [{', '.join(dims)}]")
    return "; ".join(parts)


def text_hash(text: str) -> int:
    """A signed 64-bit FNV-1a hash of `text`, the same in every process (Python's ``hash`` is salted per
    process)."""
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return _signed(h)


# ----------------------------------------------------------------------------------------------------------
# whether a call gathers

#: TP groups on which every rank agreed to LMLOSS_CHECK_RANKS=0 (see `rank_checks_enabled`).
_UNCHECKED_GROUPS: set = set()


def rank_checks_enabled(group: ProcessGroup | None = None) -> bool:
    """Whether calls under `group` make the agreement gather even for even shards.

    Without `group`: this process's ``LMLOSS_CHECK_RANKS`` (anything but ``"0"`` is on). Under a group the
    variable is itself agreed: every gather carries each rank's value, and only once every rank of the
    group has sent 0 do later calls under that group skip the gather. So a rank that sets it alone makes
    the next call raise on every rank instead of skipping a collective the others make; and once off, a
    group stays off for the life of the process (turning it back on would need the very gather it skips).
    """
    if group is not None:
        return group not in _UNCHECKED_GROUPS
    return os.environ.get("LMLOSS_CHECK_RANKS", "1") != "0"


def will_gather(tp_group: ProcessGroup | None, vocab_start: object) -> bool:
    """Whether a call under `tp_group` makes the agreement gather (`gather_plan`): with more than one
    rank, unless the group agreed to turn the checks off and no `vocab_start` needs tiling."""
    if tp_group is None or dist.get_world_size(tp_group) <= 1:
        return False
    return vocab_start is not None or rank_checks_enabled(tp_group)


@contextlib.contextmanager
def errors_raised_on_every_rank(tp_group: ProcessGroup | None, vocab_start: object, like: object):
    """Check locally, agree globally, then raise.

    Wrap the argument checks an op makes before its agreement gather: a `ValueError` / `TypeError` raised
    inside is carried into that gather as an error code (`tp_group` must already be checked), its message
    follows in a second fixed-size gather, and every rank raises the same `RankAgreementError`. Without a
    gather for this call (one process, or checks agreed off) the error is raised here, as it is.
    `like`: the op's main tensor (for the collectives' device), or whatever was passed in its place.
    """
    try:
        yield
    except (TypeError, ValueError) as error:
        if isinstance(error, RankAgreementError) or not will_gather(tp_group, vocab_start):
            raise
        device = collective_device(tp_group, like)
        ranks = _gather(tp_group, {"error": 2 if isinstance(error, TypeError) else 1}, None, device)
        _raise_rank_errors(tp_group, ranks, error, device)
        raise AssertionError("unreachable: _raise_rank_errors raises") from error


# ----------------------------------------------------------------------------------------------------------
# the plan's agreement


def gather_plan(
    tp_group: ProcessGroup,
    fields: dict[str, int | float],
    *,
    device: torch.device,
    label_stats: torch.Tensor | None = None,
    tensors: dict[str, torch.Tensor | None] | None = None,
    texts: dict[str, str] | None = None,
) -> list[dict]:
    """The plan's ONE all-gather over `tp_group`, and every check of its agreed values that does not need the
    vocabulary shard: returns every rank's fields (a dict per rank, in rank order).

    `fields`: `HOST_FIELDS` (missing ones travel as 0); `label_stats`: ``[len(LABEL_FIELDS)]`` int64 on the
    device (`lmloss._validate.label_stats`); `tensors`: the per-token tensors to fingerprint
    (`TENSOR_FIELDS`); `texts`: the `TEXT_FIELDS` as texts (their hashes travel; on a mismatch every rank's
    text is gathered and shown). On every rank alike: a rank's failed check, a text or a field that differs
    raise `RankAgreementError`. The labels and the tensors are checked by `check_plan_tensors` once the
    caller has checked the labels' range against the agreed vocabulary.
    """
    texts = {k: v for k, v in (texts or {}).items() if v}
    fields = dict(fields, **{k: text_hash(v) for k, v in texts.items()}, check_ranks=int(rank_checks_enabled()))
    ranks = _gather(tp_group, fields, label_stats, device, tensor_stats(tensors, device))
    _raise_rank_errors(tp_group, ranks, None, device)
    # the objective's options first (they decide some fields: the outputs), then the fields, then the
    # tensors' dtypes and shapes (a dtype or a width that a field names is shown by that field)
    _raise_text_disagreement(tp_group, ranks, "objective", texts, device)
    disagreement = _first_disagreement(ranks, HOST_FIELDS, (*PER_RANK_FIELDS, *TEXT_FIELDS))
    if disagreement is not None:
        name, values = disagreement
        raise RankAgreementError(
            f"TP ranks disagree on {_SHOWN.get(name, name)}: per rank {values}. Every rank of tp_group must "
            f"call the op with the same value, or they would issue different collectives or compute "
            f"different results",
            (name,),
        )
    _raise_text_disagreement(tp_group, ranks, "arguments", texts, device)
    if all(r["check_ranks"] == 0 for r in ranks):
        _UNCHECKED_GROUPS.add(tp_group)
    return ranks


def _raise_text_disagreement(group, ranks: list[dict], name: str, texts: dict[str, str], device) -> None:
    if len({r[name] for r in ranks}) > 1:  # agreed hashes: every rank makes the second gather, or none
        shown = _gather_text(group, texts.get(name, ""), device, TEXT_BYTES)
        # only the items that differ ("name: dtype [shape]" of the arguments, "name=value" of the options)
        separator = "; " if name == "arguments" else ", "
        parts = [t.split(separator) for t in shown]
        common = set.intersection(*(set(p) for p in parts))
        differing = sorted({item.split(":" if name == "arguments" else "=")[0] for p in parts for item in p} -
                           {item.split(":" if name == "arguments" else "=")[0] for item in common})  # fmt: skip
        raise RankAgreementError(
            f"TP ranks disagree on {TEXT_FIELDS[name]} (every rank of tp_group must pass the same): "
            + " | ".join(f"rank {i}: {separator.join(a for a in p if a not in common) or '(none)'}"
                         for i, p in enumerate(parts)),  # fmt: skip
            tuple(differing),
        )


def check_plan_tensors(ranks: list[dict]) -> None:
    """The labels' and the per-token tensors' fingerprints of `gather_plan` must be equal on every rank."""
    fingerprints = [tuple(r[k] for k in LABEL_FIELDS[2:]) for r in ranks]
    if len(set(fingerprints)) > 1:
        raise RankAgreementError(
            "TP ranks hold different labels (or a different ignore mask): every rank of tp_group must pass "
            "the same labels. (count, fingerprint) of the non-ignored labels per rank: "
            f"{fingerprints}"
        )
    for name in TENSOR_FIELDS:
        values = [r["tensor_" + name] for r in ranks]
        if len(set(values)) > 1:
            present = ["absent" if v == 0 else "given" for v in values]
            raise RankAgreementError(
                f"TP ranks hold different {name} (per rank: {present}; fingerprints {values}): every rank of "
                f"tp_group must pass the same {name}, or each would compute a different result"
            )


def collective_device(group: ProcessGroup, like: object) -> torch.device:
    """Where the agreement vectors live: the op's tensor's device, or (when the argument was not a tensor)
    CUDA for an NCCL group and the CPU otherwise."""
    if isinstance(like, torch.Tensor):
        return like.device
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather(
    group, fields: dict, label_stats: torch.Tensor | None, device: torch.device, tensors: torch.Tensor | None = None
) -> list[dict]:
    """Every rank's agreement vector (`HOST_FIELDS`, `LABEL_FIELDS`, ``tensor_`` + `TENSOR_FIELDS`), one dict
    per rank; fields missing from `fields` are 0. Floats travel as their float64 bits and come back as
    floats."""
    unknown = set(fields) - set(HOST_FIELDS)
    assert not unknown, f"not in the agreement vector: {unknown}"
    host = [
        _float_bits(fields.get(k, 0.0)) if k in FLOAT_FIELDS else int(fields.get(k, 0)) for k in HOST_FIELDS
    ]
    if label_stats is None:
        label_stats = torch.zeros(len(LABEL_FIELDS), dtype=torch.int64, device=device)
    if tensors is None:
        tensors = torch.zeros(len(TENSOR_FIELDS), dtype=torch.int64, device=device)
    mine = torch.cat(
        [torch.tensor(host, dtype=torch.int64, device=device), label_stats.to(device, torch.int64),
         tensors.to(device, torch.int64)]
    )  # fmt: skip
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    names = (*HOST_FIELDS, *LABEL_FIELDS, *("tensor_" + k for k in TENSOR_FIELDS))
    ranks = [dict(zip(names, t.tolist())) for t in everyone]
    for r in ranks:
        r.update({k: struct.unpack("<d", struct.pack("<q", r[k]))[0] for k in FLOAT_FIELDS})
    return ranks


def _gather_text(group, text: str, device: torch.device, size: int = MESSAGE_BYTES) -> list[str]:
    """Every rank's `text` (its first `size` bytes), in rank order: one fixed-size all-gather."""
    data = text.encode()[:size]
    buf = torch.zeros(size, dtype=torch.uint8)
    buf[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    buf = buf.to(device)
    everyone = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, buf, group=group)
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="ignore") for t in everyone]


def _float_bits(v: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(v)))[0]


def _raise_rank_errors(group, ranks: list[dict], mine: BaseException | None, device: torch.device) -> None:
    """If any rank failed a local check, every rank gathers the messages (one more fixed-size all-gather)
    and raises the same `RankAgreementError` naming the ranks; otherwise nothing."""
    _raise_rejected(group, [r["error"] for r in ranks], mine, device, ranks_are="TP ranks", group_is="tp_group")


def _raise_rejected(group, codes: list[int], mine, device, *, ranks_are: str, group_is: str) -> None:
    """The ranks whose error code is nonzero failed a local check: every rank gathers their messages and raises
    the same error (a `RankAgreementTypeError` where one was a `TypeError`), naming them."""
    failed = [i for i, c in enumerate(codes) if c]
    if not failed:
        return
    texts = _gather_text(group, "" if mine is None else str(mine), device)
    messages = [texts[i] for i in failed]
    one = ranks_are.removesuffix("ranks") + "rank"
    if len(set(messages)) == 1:
        who = f"{one} {failed[0]} of {len(codes)} rejected its" if len(failed) == 1 else f"{ranks_are} {failed} rejected their"
        detail = f"{who} arguments: {messages[0]}"
    else:
        detail = f"{ranks_are} rejected their arguments: " + "; ".join(f"rank {i}: {m}" for i, m in zip(failed, messages))
    kind = RankAgreementTypeError if any(codes[i] == 2 for i in failed) else RankAgreementError
    raise kind(f"{detail} (raised on every rank of {group_is}, so that none waits in a collective)")


# ----------------------------------------------------------------------------------------------------------
# the agreement of a function that is not a plan's op


def agree_over_group(
    group: ProcessGroup,
    what: str,
    fields: Sequence[str],
    values: dict[str, int | float],
    *,
    per_rank: Sequence[str] = (),
    floats: Sequence[str] = (),
    error: BaseException | None = None,
    like: object = None,
    text: str | None = None,
) -> list[dict[str, int | float]]:
    """Every rank's `values` after ONE all-gather of a fixed-size int64 vector over `group` (the agreement of
    a function that is not a plan's op: `lmloss.rl.token_weights`, `covariance_selection`, `policy_loss`
    over `cp_group`...).

    The vector is ``[error code, *fields, hash of text]`` on every rank whatever its arguments (a field
    missing from `values` travels as 0; `floats` travel as their float64 bits). `error`: this rank's failed
    check (raised here after the gather, on every rank). Then, on every rank alike: if some rank failed, a
    second fixed-size all-gather carries the messages and every rank raises the same
    `RankAgreementError` (`RankAgreementTypeError` for a `TypeError`); if `text` (options written out) differs,
    a second gather shows every rank's; otherwise every field not in `per_rank` must be equal on every rank,
    or every rank raises naming the field and each rank's value. `what` names the function for the
    messages; `like`: a tensor on the collectives' device.
    """
    device = collective_device(group, like)
    code = 0 if error is None else 2 if isinstance(error, TypeError) else 1
    row = [code] + [_float_bits(values.get(k, 0.0)) if k in floats else int(values.get(k, 0)) for k in fields]
    row.append(text_hash(text or ""))
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    rows = [t.tolist() for t in everyone]
    _raise_rejected(group, [r[0] for r in rows], error, device, ranks_are=f"{what}: ranks", group_is="the group")
    if len({r[-1] for r in rows}) > 1:
        shown = _gather_text(group, text or "", device, TEXT_BYTES)
        raise RankAgreementError(
            f"{what}: the ranks of the group disagree on the options (every rank must pass the same): "
            + "; ".join(f"rank {i}: {t or '(none)'}" for i, t in enumerate(shown))
        )
    unbits = {k for k in fields if k in floats}
    ranks = [
        {k: struct.unpack("<d", struct.pack("<q", v))[0] if k in unbits else v for k, v in zip(fields, r[1:-1])}
        for r in rows
    ]
    disagreement = _first_disagreement(ranks, fields, per_rank)
    if disagreement is not None:
        k, seen = disagreement
        raise RankAgreementError(
            f"{what}: the ranks of the group disagree on {k}: per rank {seen}. Every rank must pass the "
            f"same value, or they would compute inconsistent results or issue different collectives"
        )
    return ranks


def _first_disagreement(ranks: list[dict], fields, per_rank) -> tuple[str, list] | None:
    """The first of `fields` (not in `per_rank`) whose value differs between ranks, with every rank's value."""
    for name in fields:
        if name not in per_rank and len(set(values := [r[name] for r in ranks])) > 1:
            return name, values
    return None
