"""TP ranks that disagree raise the same ValueError on every rank; uneven shards compute the right answer.

ONE run of 2 gloo ranks hosts every case (`dist_utils.run_ranks`), each case on a process group of its own
with a short collective timeout, and its result saved as soon as it is known: a case that leaves a rank
waiting times out and fails its own test; a case that kills a rank (gloo aborts a process whose collectives
do not match in size) or hangs fails its own test, and a new run takes the cases after it (`_run_isolated`).
So a broken argument fails the test named after it, never a shared set-up.

disagree  - per op (token_logprobs, token_entropy, cross_entropy and the fused ops, as each case applies)
            and per case: the ranks call with different token counts, chunk sizes, uneven shards without
            vocab_start, vocab_size, temperature, dtypes, ops, reductions, mean_group, gradients needed
            (requires_grad / no_grad), LMLOSS_CHECK_RANKS or LMLOSS_CHUNK_BUDGET_MIB on one rank, different
            labels or ignore masks, ...; or one rank's argument fails a local check (a negative temperature,
            a labels shape, float labels, a reduction typo, a non-group mean_group, ignore_index past int64,
            not a tensor, in place on a leaf). Every rank catches the exception and returns it; all must be
            the same ValueError naming the argument (and the rank), and afterwards a plain all_gather must
            still pair up (ranks in step).
uneven    - shards of 20 and 12 columns with vocab_start and chunk_size="auto" (a chunk budget small
            enough that each rank's own shard would give a different chunk): fused and logits ops.
triton    - impl="triton" (the Triton interpreter, TRITON_INTERPRET=1) at TP=2, even and uneven shards,
            with softcap, temperature and vocab_size padding: values and gradients.
checks_off - LMLOSS_CHECK_RANKS=0 on both ranks: right values without the gather, the label-range check
            still raising on each rank, uneven shards raising where the width shows them (the other rank
            times out on a group with a 2 s timeout).
The references are float64 plain PyTorch over the unsharded tensors, computed in the test process.
"""

from __future__ import annotations

import os

# the Triton kernels must run on the CPU interpreter in the ranks too: triton reads this variable
# when it is first imported, and spawned ranks (where they must be spawned) import this module first
os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib
import datetime
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks

import lmloss

WORLD = 2
RUN_DEADLINE_S = 300  # a run; it takes ~15 s when nothing hangs, a case that leaves a rank waiting ~20 s more
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=20)
N, H, V = 6, 8, 32  # tokens, hidden width, global vocabulary columns
SPLIT = (20, 12)  # uneven shards: rank 0 holds columns [0, 20), rank 1 [20, 32)
TOL = dict(atol=1e-5, rtol=1e-5)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------------------
# disagreements: per-rank arguments


def _data(seed: int, n: int, v_local: int, h: int = H):
    g = _gen(seed)
    d = dict(
        logits=torch.randn(n, v_local, generator=g),
        hidden=torch.randn(n, h, generator=g),
        weight=torch.randn(v_local, h, generator=g),
        labels=torch.randint(0, 16, (n,), generator=g),  # valid for every global vocabulary below
        teacher=torch.randn(n, v_local, generator=g),
        t_hidden=torch.randn(n, 4, generator=g),
        t_weight=torch.randn(v_local, 4, generator=g),
    )
    g = _gen(100)  # the per-token tensors of the RL / sampling / replay cases: the same on every rank
    d.update(adv=torch.randn(n, generator=g), old=-torch.rand(n, generator=g) - 2.0)
    order = torch.stack([torch.randperm(16, generator=g) for _ in range(n)])
    others = order[order != d["labels"].clamp(min=0)[:, None]].view(n, 15)
    d["support"] = torch.cat([d["labels"].clamp(min=0)[:, None], others[:, :3]], dim=1)  # distinct ids
    d["topk_ids"] = d["support"].clone()
    d["topk_ids"][0] = torch.tensor([2, 5, 9, 12])  # distinct after the patterned change of _patterned_ids
    d["topk_logprobs"] = torch.full((n, 4), -2.0)
    g = _gen(101)  # the RL reference head: the same on every rank
    d.update(ref_hidden=torch.randn(n, 4, generator=g), ref_weight=torch.randn(v_local, 4, generator=g))
    return d


def _call(op: str, d: dict, kw: dict):
    """Call `op` on the data with `kw`; the keys starting with "_" say how: ``_op`` another op on this
    rank, ``_env`` environment variables set for the call (None: unset), ``_no_grad`` under no_grad."""
    kw = dict(kw)
    op = kw.pop("_op", op)
    env = kw.pop("_env", {})
    saved = {k: os.environ.get(k) for k in env}
    grad_mode = torch.no_grad() if kw.pop("_no_grad", False) else contextlib.nullcontext()
    try:
        for k, v in env.items():
            _set_env(k, v)
        with grad_mode:
            return _call_op(op, d, kw)
    finally:
        for k, v in saved.items():
            _set_env(k, v)


def _set_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _call_op(op: str, d: dict, kw: dict):
    if op == "token_logprobs":
        return lmloss.token_logprobs(d["logits"], d["labels"], **kw)
    if op == "token_entropy":
        return lmloss.token_entropy(d["logits"], **kw)
    if op == "cross_entropy":
        return lmloss.cross_entropy(d["logits"], d["labels"], **kw)
    if op == "linear_token_logprobs":
        return lmloss.linear_token_logprobs(d["hidden"], d["weight"], d["labels"], **kw)
    if op == "linear_policy_loss":
        return lmloss.rl.linear_policy_loss(d["hidden"], d["weight"], d["labels"], d["old"], d["adv"], **kw)
    if op == "distillation_loss":
        return lmloss.distillation_loss(d["logits"], None if "teacher_topk" in kw else d["teacher"], d["labels"], **kw)
    if op == "linear_distillation_loss":
        return lmloss.linear_distillation_loss(d["hidden"], d["weight"], d["t_hidden"], d["t_weight"], d["labels"], **kw)
    return lmloss.linear_cross_entropy(d["hidden"], d["weight"], d["labels"], **kw)


LABELLED = ("token_logprobs", "cross_entropy", "linear_cross_entropy")
ALL = ("token_logprobs", "token_entropy", "cross_entropy", "linear_token_logprobs", "linear_cross_entropy")


def _per_rank(rank, a, b):
    return a if rank == 0 else b


def _with_label(d, pos, value):
    d["labels"] = d["labels"].clone()
    d["labels"][pos] = value
    return d


def _with(d, **changes):
    """`d` with some entries replaced by ``fn(old value)``."""
    return dict(d, **{k: fn(d[k]) for k, fn in changes.items()})


def _as_dtype(d, dtype):
    """`d` with the logits and the head (hidden, weight) in `dtype`."""
    return _with(d, **{k: (lambda t: t.to(dtype)) for k in ("logits", "hidden", "weight")})


def _empty(d):
    """`d` with no token (every per-token tensor cut to 0 rows; the weights kept)."""
    return {k: v if k in ("weight", "t_weight") else v[:0] for k, v in d.items()}


def _requiring_grad(d):
    """Logits that an op made (so in-place is allowed), hidden and weight leaves that require grad."""
    leaf = d["logits"].clone().requires_grad_()
    return dict(
        d, logits=leaf * 1.0, hidden=d["hidden"].requires_grad_(), weight=d["weight"].requires_grad_()
    )


FUSED = ("linear_token_logprobs", "linear_cross_entropy")
CE = ("cross_entropy", "linear_cross_entropy")
TENSOR_OPS = ("token_logprobs", "cross_entropy", "linear_cross_entropy")


# name -> (ops, rank -> (data, kwargs), words every rank's message must contain)
DISAGREEMENTS = {
    "token_count": (
        ALL,
        lambda r: (_data(r, _per_rank(r, 6, 5), 16), {}),
        ["n_tokens", "[6, 5]"],
    ),
    "chunk_size": (
        ALL,
        lambda r: (_data(r, N, 16), dict(chunk_size=_per_rank(r, 2, 3))),
        ["chunk_size", "[2, 3]"],
    ),
    "chunk_size_auto_on_one_rank": (
        LABELLED,
        lambda r: (_data(r, N, 16), dict(chunk_size=_per_rank(r, "auto", 4))),
        ["chunk_size", "[-2, 4]"],
    ),
    "uneven_shards_without_vocab_start": (
        ALL,
        lambda r: (_data(r, N, SPLIT[r]), {}),
        ["uneven", "vocab_start", "[20, 12]"],
    ),
    "vocab_start_on_one_rank_only": (
        ALL,
        lambda r: (_data(r, N, 16), dict(vocab_start=_per_rank(r, 0, None))),
        ["vocab_start", "[1, 0]"],
    ),
    "vocab_size": (
        ALL,
        lambda r: (_data(r, N, 16), dict(vocab_size=_per_rank(r, 32, 30))),
        ["vocab_size", "[32, 30]"],
    ),
    "zero_column_shard": (
        ALL,
        lambda r: (_data(r, N, _per_rank(r, 16, 0)), {}),
        ["0 vocabulary columns", "V_local", "[16, 0]"],
    ),
    "zero_column_shard_with_vocab_start": (
        LABELLED,
        lambda r: (_data(r, N, _per_rank(r, 16, 0)), dict(vocab_start=_per_rank(r, 0, 16))),
        ["0 vocabulary columns", "[16, 0]"],
    ),
    "label_out_of_range_on_one_rank": (
        LABELLED,
        lambda r: (_with_label(_data(r, N, 16), 2, _per_rank(r, 3, 32)), {}),
        ["labels", "[0, 32)", "1: (", ", 32)"],
    ),
    "negative_label_on_one_rank": (
        LABELLED,
        lambda r: (_with_label(_data(r, N, 16), 4, _per_rank(r, -5, 3)), {}),
        ["labels", "0: (-5,"],
    ),
    "temperature": (
        ALL,
        lambda r: (_data(r, N, 16), dict(temperature=_per_rank(r, 1.0, 0.5))),
        ["temperature", "[1.0, 0.5]"],
    ),
    "softcap": (
        ALL,
        lambda r: (_data(r, N, 16), dict(softcap=_per_rank(r, None, 30.0))),
        ["softcap", "[0.0, 30.0]"],
    ),
    "ignore_index": (
        LABELLED,
        lambda r: (_data(r, N, 16), dict(ignore_index=_per_rank(r, -100, -1))),
        ["ignore_index", "[-100, -1]"],
    ),
    "impl": (
        LABELLED,
        lambda r: (_data(r, N, 16), dict(impl=_per_rank(r, "torch", "triton"))),
        ["impl", "[0, 1]"],
    ),
    "return_entropy": (
        ("token_logprobs", "linear_token_logprobs"),
        lambda r: (_data(r, N, 16), dict(return_entropy=_per_rank(r, True, False))),
        ["outputs", "[3, 1]"],
    ),
    "label_smoothing": (
        ("cross_entropy", "linear_cross_entropy"),
        lambda r: (_data(r, N, 16), dict(label_smoothing=_per_rank(r, 0.0, 0.25))),
        ["label_smoothing", "[0.0, 0.25]"],
    ),
    "hidden_width": (
        ("linear_token_logprobs", "linear_cross_entropy"),
        lambda r: (_data(r, N, 16, h=_per_rank(r, 8, 6)), {}),
        ["hidden_width", "[8, 6]"],
    ),
    # what changes the collectives' sizes or the math, beyond the shapes. float32 beside float64 would all-reduce
    # partials of different sizes (a crash, not an error, were the dtype not agreed): on an empty batch the
    # loop makes no collective after the agreement, so a dtype left out of it shows as a computed result;
    # float16 beside bfloat16 computes in float32 on both ranks (the same collectives) with another rounding
    "dtype": (
        ALL,
        lambda r: (_as_dtype(_empty(_data(0, N, 16)), _per_rank(r, torch.float32, torch.float64)), {}),
        ["dtype", "[2, 3]"],
    ),
    "dtype_float16_beside_bfloat16": (
        ALL,
        lambda r: (_as_dtype(_data(0, N, 16), _per_rank(r, torch.float16, torch.bfloat16)), {}),
        ["dtype", "[0, 1]"],
    ),
    "op": (
        ("cross_entropy",),
        lambda r: (_data(0, N, 16), dict(_op=_per_rank(r, "cross_entropy", "linear_cross_entropy"))),
        ["the op", "[0, 1]"],
    ),
    "op_with_objective_options_on_one_rank": (  # one rank's options text is empty: both still show them
        ("linear_policy_loss",),
        lambda r: (_data(0, N, 16), dict(_op=_per_rank(r, "linear_policy_loss", "linear_token_logprobs"))),
        ["objective's options", "rank 0: clip_cov_lb=1.0", "loss_mode='vanilla'", "rank 1: (none)"],
    ),
    "reduction": (
        CE,
        lambda r: (_data(0, N, 16), dict(reduction=_per_rank(r, "sum", "mean"))),
        ["reduction", "[1, 0]"],
    ),
    "mean_group_on_one_rank": (
        CE,
        lambda r: (_data(0, N, 16), dict(mean_group=_per_rank(r, "<group>", None))),
        ["mean_group", "[2, -1]"],
    ),
    "requires_grad_on_one_rank": (
        ALL,
        lambda r: (_per_rank(r, _requiring_grad, lambda d: d)(_data(0, N, 16)), {}),
        ["gradients will be needed"],
    ),
    "no_grad_on_one_rank": (
        ALL,
        lambda r: (_requiring_grad(_data(0, N, 16)), dict(_no_grad=_per_rank(r, False, True))),
        ["gradients will be needed"],
    ),
    "LMLOSS_CHECK_RANKS_on_one_rank": (
        ALL,
        lambda r: (_data(0, N, 16), dict(_env={"LMLOSS_CHECK_RANKS": _per_rank(r, None, "0")})),
        ["LMLOSS_CHECK_RANKS", "[1, 0]"],
    ),
    # every op's budget is agreed (its chunks, and a fused head's schedule, come from it): a logits op whose
    # ranks cut different chunks once aborted in a collective of another size
    "LMLOSS_CHUNK_BUDGET_MIB_on_one_rank": (
        ALL + ("linear_policy_loss", "distillation_loss", "linear_distillation_loss"),
        lambda r: (
            _data(0, N, 16),
            dict(chunk_size="auto", _env={"LMLOSS_CHUNK_BUDGET_MIB": _per_rank(r, None, "1")}),
        ),
        ["LMLOSS_CHUNK_BUDGET_MIB", "[64.0, 1.0]"],
    ),
    "memory_budget_mib": (
        ALL + ("linear_policy_loss", "distillation_loss", "linear_distillation_loss"),
        lambda r: (_data(0, N, 16), dict(memory_budget_mib=_per_rank(r, 2.0, 0.001))),
        ["memory_budget_mib", "[2.0, 0.001]"],
    ),
    "bad_memory_budget_mib_on_one_rank": (
        ALL,
        lambda r: (_data(0, N, 16), dict(memory_budget_mib=_per_rank(r, None, -1))),
        ["TP rank 1 of 2", "memory_budget_mib must be None or a positive number"],
    ),
    "weight_grad_dtype": (
        FUSED,
        lambda r: (_as_dtype(_data(0, N, 16), torch.bfloat16),
                   dict(weight_grad_dtype=_per_rank(r, torch.float32, torch.bfloat16))),
        ["weight_grad_dtype"],
    ),  # fmt: skip
    "different_labels": (
        LABELLED + ("linear_token_logprobs",),
        lambda r: (_data(r, N, 16), {}),
        ["different labels", "per rank"],
    ),
    "ignore_mask_on_one_rank": (
        LABELLED,
        lambda r: (_with_label(_data(0, N, 16), 3, _per_rank(r, 5, -100)), {}),
        ["different labels"],
    ),
    # a check that fails on one rank only: every rank raises it, naming that rank
    "negative_temperature_on_one_rank": (
        ALL,
        lambda r: (_data(0, N, 16), dict(temperature=_per_rank(r, 1.0, -1.0))),
        ["TP rank 1 of 2", "temperature must be finite"],
    ),
    "labels_shape_on_one_rank": (
        TENSOR_OPS,
        lambda r: (_with(_data(0, N, 16), labels=lambda y, r=r: _per_rank(r, y, y[:-1])), {}),
        ["TP rank 1 of 2", "labels shape"],
    ),
    "float_labels_on_one_rank": (
        TENSOR_OPS,
        lambda r: (_with(_data(0, N, 16), labels=lambda y, r=r: _per_rank(r, y.float(), y)), {}),
        ["TP rank 0 of 2", "labels must be an integer tensor"],
    ),
    # a TypeError on one rank and a ValueError on the other: every rank raises one RankAgreementTypeError (a
    # TypeError and a ValueError) with both messages (lmloss.agreement: a TypeError on any rank makes it one)
    "type_error_on_one_rank_value_error_on_the_other": (
        TENSOR_OPS,
        lambda r: (_with(_data(0, N, 16), labels=lambda y, r=r: _per_rank(r, y.float(), y)),
                   dict(temperature=_per_rank(r, 1.0, -1.0))),  # fmt: skip
        ["TP ranks rejected their arguments", "rank 0: labels must be an integer tensor",
         "rank 1: temperature must be finite"],  # fmt: skip
    ),
    "reduction_typo_on_one_rank": (
        CE,
        lambda r: (_data(0, N, 16), dict(reduction=_per_rank(r, "mean", "meen"))),
        ["TP rank 1", "reduction must"],
    ),
    "non_group_mean_group_on_one_rank": (
        CE,
        lambda r: (_data(0, N, 16), dict(mean_group=_per_rank(r, None, "dp"))),
        ["TP rank 1", "mean_group must be a torch.distributed.ProcessGroup"],
    ),
    "ignore_index_past_int64_on_one_rank": (
        TENSOR_OPS,
        lambda r: (_data(0, N, 16), dict(ignore_index=_per_rank(r, -100, 2**64))),
        ["TP rank 1", "ignore_index must fit in int64"],
    ),
    # an int option past int64 (it travels in the int64 agreement vector): refused on that rank, before the gather
    "top_k_past_int64_on_one_rank": (
        ("token_logprobs", "linear_token_logprobs"),
        lambda r: (_data(0, N, 16), dict(top_k=_per_rank(r, 3, 10**23))),
        ["TP rank 1", "top_k must be in [1, 2**63 - 1]"],
    ),
    "chunk_size_past_int64_on_one_rank": (
        LABELLED,
        lambda r: (_data(0, N, 16), dict(chunk_size=_per_rank(r, 4, 2**63))),
        ["TP rank 1", "chunk_size must fit in int64"],
    ),
    "vocab_size_past_int64_on_one_rank": (
        ("token_logprobs",),
        lambda r: (_data(0, N, 16), dict(vocab_size=_per_rank(r, 32, 10**23))),
        ["TP rank 1", "vocab_size must fit in int64"],
    ),
    "garbage_LMLOSS_CHUNK_BUDGET_MIB_on_one_rank": (
        FUSED,
        lambda r: (
            _data(0, N, 16),
            dict(chunk_size="auto", _env={"LMLOSS_CHUNK_BUDGET_MIB": _per_rank(r, None, "lots")}),
        ),
        ["TP rank 1", "LMLOSS_CHUNK_BUDGET_MIB must be a positive number"],
    ),
    "not_a_tensor_on_one_rank": (
        TENSOR_OPS,
        lambda r: (
            _with(
                _data(0, N, 16),
                **{k: (lambda t, r=r: _per_rank(r, t, t.tolist())) for k in ("logits", "hidden")},
            ),
            {},
        ),
        ["TP rank 1", "must be a torch.Tensor"],
    ),
    "vocab_start_not_an_int_on_one_rank": (
        ALL,
        lambda r: (_data(0, N, 16), dict(vocab_start=_per_rank(r, 0, "16"))),
        ["TP rank 1", "vocab_start must be an int"],
    ),
    "inplace_on_a_leaf_on_one_rank": (
        ("cross_entropy",),
        lambda r: (
            _with(
                _requiring_grad(_data(0, N, 16)),
                logits=lambda x, r=r: _per_rank(r, x, x.detach().requires_grad_()),
            ),
            dict(inplace_backward=True),
        ),
        ["TP rank 1", "leaf"],
    ),
    "each_rank_fails_another_check": (
        TENSOR_OPS,
        lambda r: (
            _with(_data(0, N, 16), labels=lambda y, r=r: _per_rank(r, y, y[:-1])),
            dict(temperature=_per_rank(r, -1.0, 1.0)),
        ),
        ["rank 0: temperature must be finite", "rank 1: labels shape"],
    ),
}


def _policy(**per_rank):
    """A `linear_policy_loss` case: each option's ``(rank 0's, rank 1's)`` value."""
    return lambda r: (_data(0, N, 16), {k: _per_rank(r, *v) for k, v in per_rank.items()})


def _with_tensor(key, change, **kw):
    """Rank 1 holds the data's `key` changed by `change`; a kwarg ``"@name"`` passes the data's tensor (``"@topk"``:
    the teacher's ids and log-probs)."""

    def arg(d, v):
        if v == "@topk":
            return d["topk_ids"], d["topk_logprobs"]
        return d[v[1:]] if isinstance(v, str) and v.startswith("@") else v

    def make(r):
        d = _data(0, N, 16)
        if r == 1:
            d = _with(d, **{key: change})
        return d, {k: arg(d, v) for k, v in kw.items()}

    return make


def _sparse_tail_on_an_empty_batch(r):
    d = _empty(_data(0, N, 16))
    return d, dict(teacher_topk=(d["topk_ids"], d["topk_logprobs"]), tail=_per_rank(r, True, False))


def _permuted(t):
    return t.flip(-1)


F32_0_9 = float(torch.tensor(0.9, dtype=torch.float32))  # 0.8999999761581421


def _tokenwise(value, dtype=None):
    return torch.full((N,), value, dtype=dtype)


# The arguments the RL, sampling, replay and distillation ops add (issue #23's adversarial cases): every one
# is agreed in the op's one rank-agreement gather.
DISAGREEMENTS.update({
    "loss_mode": (("linear_policy_loss",), _policy(loss_mode=("vanilla", "cispo")), ["objective's options", "loss_mode"]),
    "clip_ratio_low": (("linear_policy_loss",), _policy(clip_ratio_low=(0.2, 0.1)), ["objective's options"]),
    "clip_ratio_c": (("linear_policy_loss",), _policy(clip_ratio_c=(3.0, 4.0)), ["objective's options"]),
    "entropy_coeff": (("linear_policy_loss",), _policy(entropy_coeff=(0.01, 0.02)), ["entropy_coeff"]),
    "kl_loss_type": (("linear_policy_loss",), _policy(kl_loss_type=("k1", "k3"), kl_loss_coef=(0.1, 0.1),
                                                      ref_logprobs=(torch.zeros(N), torch.zeros(N))),
                     ["objective's options"]),  # fmt: skip
    "kl_loss_coef": (("linear_policy_loss",), _policy(kl_loss_coef=(0.1, 0.2), ref_logprobs=(torch.zeros(N), torch.zeros(N))),
                     ["objective's options"]),  # fmt: skip
    "loss_agg_mode": (("linear_policy_loss",), _policy(loss_agg_mode=("token-mean", "seq-mean-token-mean"),
                                                       cu_seqlens=(torch.tensor([0, N]), torch.tensor([0, N]))),
                      ["objective's options"]),  # fmt: skip
    "advantages": (("linear_policy_loss",), _with_tensor("adv", lambda a: a + 1.0), ["advantages"]),
    "old_logprobs": (("linear_policy_loss",), _with_tensor("old", lambda a: a - 1.0), ["old_logprobs"]),
    "invalid_clip_ratio_on_one_rank": (("linear_policy_loss",), _policy(clip_ratio=(0.2, -1.0)), ["clip_ratio"]),
    "unknown_loss_mode_on_one_rank": (("linear_policy_loss",), _policy(loss_mode=("vanilla", "ppo")), ["loss_mode"]),
    "unknown_kl_type_on_one_rank": (("linear_policy_loss",), _policy(kl_loss_type=("k3", "k9")), ["kl_loss_type"]),
    "per_token_top_k": (("token_logprobs", "linear_policy_loss"),
                        lambda r: (_data(0, N, 16), dict(top_k=_tokenwise(_per_rank(r, 3, 4)))), ["top_k"]),
    # per token, differing in the last bits: the ranks would compute (the same crossing bins) instead of raising
    "per_token_top_p": (("token_logprobs",), lambda r: (_data(0, N, 16), dict(top_p=_tokenwise(_per_rank(r, 0.9, F32_0_9), torch.float64))),
                        ["top_p"]),  # fmt: skip
    "per_token_min_p": (("token_logprobs",), lambda r: (_data(0, N, 16), dict(min_p=_tokenwise(_per_rank(r, 0.1, 0.2)))),
                        ["min_p"]),  # fmt: skip
    # one number for every token, differing in the last bits (a config value read as float32 on one rank): ranks
    # that computed with their own value would find the same crossing bins and compute without an error
    "top_p": (("token_logprobs", "linear_policy_loss"), lambda r: (_data(0, N, 16), dict(top_p=_per_rank(r, 0.9, F32_0_9))),
              ["top_p", f"[0.9, {F32_0_9}]"]),  # fmt: skip
    "min_p": (("token_logprobs",), lambda r: (_data(0, N, 16), dict(min_p=_per_rank(r, 0.1, 0.2))), ["min_p", "[0.1, 0.2]"]),
    "support": (("token_logprobs", "linear_token_logprobs", "linear_policy_loss"),
                _with_tensor("support", _permuted, support="@support"), ["support"]),  # fmt: skip
    "support_id_past_the_vocabulary": (("token_logprobs", "linear_token_logprobs"), lambda r: (
        _data(0, N, 16), dict(support=torch.arange(40, 44).repeat(N, 1))), ["support ids must be in [0, 32)"]),
    "support_with_a_duplicate_id_on_one_rank": (("token_logprobs",), lambda r: (_data(0, N, 16), dict(
        support=_per_rank(r, _data(0, N, 16)["support"], torch.zeros(N, 4, dtype=torch.long)))), ["twice"]),
    "support_on_one_rank_top_k_on_the_other": (("token_logprobs",), lambda r: (_data(0, N, 16), _per_rank(
        r, dict(support=_data(0, N, 16)["support"]), dict(top_k=3))), ["TP ranks disagree"]),
    "beta_out_of_range_on_one_rank": (("distillation_loss", "linear_distillation_loss"),
                                      lambda r: (_data(0, N, 16), dict(beta=_per_rank(r, 0.5, 1.5))), ["beta"]),
    "wider_teacher_shard_on_one_rank": (("distillation_loss",), lambda r: (
        _with(_data(0, N, 16), teacher=lambda t: t if r == 0 else torch.randn(N, 17)), {}), ["teacher_logits shape"]),
    "teacher_topk_ids": (("distillation_loss",), _with_tensor("topk_ids", _permuted, teacher_topk="@topk"),
                         ["teacher_ids"]),  # fmt: skip
    "teacher_topk_mass_above_one_on_one_rank": (("distillation_loss",), _with_tensor(
        "topk_logprobs", lambda t: t + 3.0, teacher_topk="@topk"), ["teacher_logprobs"]),
    # with tokens, ranks that disagree on tail= would issue different collectives (the tail's statistics): on
    # an empty batch a tail left out of the agreement shows as a computed result instead of a hang
    "sparse_teacher_tail_on_an_empty_batch": (("distillation_loss",), _sparse_tail_on_an_empty_batch, ["tail", "[1, 0]"]),
    "ignore_mask_of_a_distillation_on_one_rank": (("distillation_loss",), lambda r: (
        _with_label(_data(0, N, 16), 3, _per_rank(r, 5, -100)), {}), ["different mask"]),
    "teacher_softcap": (("distillation_loss", "linear_distillation_loss"),
                        lambda r: (_data(0, N, 16), dict(teacher_softcap=_per_rank(r, 2.0, 3.0))), ["teacher_softcap"]),
    "student_softcap": (("distillation_loss", "linear_distillation_loss"),
                        lambda r: (_data(0, N, 16), dict(softcap=_per_rank(r, 2.0, None))), ["softcap"]),
})

# The agreement's fingerprints are non-linear (issue #35): a change of +d, -d, -d, +d at four places (which a
# position-weighted sum of the values cannot see) raises on every rank like any other difference. And every
# per-token tensor, the sequence boundaries, the reference head's dtype and width, clip_cov's random draw and
# the invariant flag are agreed.
PATTERN = torch.tensor([1, -1, -1, 1, 0, 0])


def _patterned_bits(t: torch.Tensor, d: int = 1) -> torch.Tensor:
    """`t` (float32 / float64) with its elements' bits changed by +d, -d, -d, +d at its first four places."""
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}[t.dtype]
    return (t.view(ints) + (PATTERN * d).to(ints)).view(t.dtype)


def _labelled(r, labels):
    return _with(_data(0, N, 16), labels=lambda _: labels), {}


def _mask(*bits):
    return torch.tensor(bits, dtype=torch.bool)


BASE_LABELS = torch.tensor([5, 9, 9, 5, 9, 2])  # the same min and max after the pattern
PG_MASK = (_mask(0, 1, 1, 0, 1, 1), _mask(1, 0, 0, 1, 1, 1))  # the bits: -1, +1, +1, -1 on rank 1
TOP_K = (torch.tensor([3, 3, 3, 3, 5, 5]), torch.tensor([3, 3, 3, 3, 5, 5]) + PATTERN)  # the same largest top_k
TOP_P = torch.linspace(0.5, 0.9, N, dtype=torch.float64)
SEQUENCE_IDS = torch.tensor([0, 1, 1, 0, 2, 2])


def _patterned_ids(t):
    t = t.clone()
    t[0] += PATTERN[:4]  # [2, 5, 9, 12] -> [3, 4, 8, 13]
    return t


def _reference_head(width: int, dtype: torch.dtype):
    def make(r):
        d = _data(0, N, 16)
        g = _gen(102)
        ref_hidden, ref_weight = torch.randn(N, width, generator=g), torch.randn(16, width, generator=g)
        return d, dict(kl_loss_type="full", kl_loss_coef=0.1, ref_hidden=ref_hidden.to(dtype), ref_weight=ref_weight.to(dtype))

    return make


def _per_rank_kw(**per_rank):
    """Each keyword's ``(rank 0's, rank 1's)`` value, for any op."""
    return lambda r: (_data(0, N, 16), {k: _per_rank(r, *v) for k, v in per_rank.items()})


POLICY = ("linear_policy_loss",)
DISAGREEMENTS.update({
    # 1. the sequence boundaries of the sequence objectives
    "cu_seqlens_on_one_rank": (POLICY, _policy(loss_mode=("gspo", "gspo"), cu_seqlens=(torch.tensor([0, 3, N]), None)),
                               ["TP rank 1 of 2", "needs cu_seqlens"]),  # fmt: skip
    "cu_seqlens": (POLICY, _policy(loss_mode=("geo_mean", "geo_mean"),
                                   cu_seqlens=(torch.tensor([0, 3, N]), torch.tensor([0, 2, N]))),
                   ["different cu_seqlens"]),  # fmt: skip
    "sequence_ids_patterned": (POLICY, _policy(loss_mode=("gspo", "gspo"),
                                               sequence_ids=(SEQUENCE_IDS, SEQUENCE_IDS + PATTERN)),
                               ["different sequence_ids"]),  # fmt: skip
    "cp_group_on_one_rank": (POLICY, _policy(cp_group=("<group>", None)), ["objective's options", "cp_group=2"]),
    # which tokens count: the rows every rank skips (a patterned change keeps the count)
    "mask_patterned": (POLICY, _policy(mask=(PG_MASK[0], PG_MASK[1])), ["different mask"]),
    "mask_on_one_rank": (POLICY, _policy(mask=(PG_MASK[0], None)), ["mask"]),
    # 3. the full KL's reference head
    "reference_head_dtype": (POLICY, lambda r: _reference_head(4, _per_rank(r, torch.float32, torch.bfloat16))(r),
                             ["dtypes and shapes", "ref_hidden: bfloat16 [6, 4]", "ref_weight: float32 [V_local, 4]"]),
    "reference_head_width": (POLICY, lambda r: _reference_head(_per_rank(r, 4, 5), torch.float32)(r),
                             ["dtypes and shapes", "ref_weight: float32 [V_local, 5]"]),
    # 4. patterned differences
    "labels_patterned": (LABELLED + ("linear_token_logprobs",),
                         lambda r: _labelled(r, _per_rank(r, BASE_LABELS, BASE_LABELS + PATTERN)), ["different labels"]),
    "pg_mask_patterned": (POLICY, _policy(pg_mask=PG_MASK), ["different pg_mask"]),
    "advantages_patterned": (POLICY, _with_tensor("adv", _patterned_bits), ["different advantages"]),
    "old_logprobs_patterned": (POLICY, _with_tensor("old", lambda t: _patterned_bits(t, 3)), ["different old_logprobs"]),
    "per_token_top_k_patterned": (("token_logprobs", "linear_policy_loss"), _per_rank_kw(top_k=TOP_K),
                                  ["different top_k"]),
    "per_token_top_p_patterned": (("token_logprobs",), _per_rank_kw(top_p=(TOP_P, _patterned_bits(TOP_P, 1 << 30))),
                                  ["different top_p"]),
    "teacher_ids_patterned": (("distillation_loss",), _with_tensor("topk_ids", _patterned_ids, teacher_topk="@topk"),
                              ["different teacher_ids"]),  # fmt: skip
    # 5. clip_cov's random draw without a cov_selection
    "clip_cov_generators": (POLICY, _policy(loss_mode=("clip_cov", "clip_cov"),
                                            generator=(torch.Generator().manual_seed(1), torch.Generator().manual_seed(2))),
                            ["different generator"]),  # fmt: skip
    # every per-token tensor, a tensor on one rank only, the off-policy inputs' dtype, the invariant flag
    "cov_selection": (POLICY, _policy(loss_mode=("kl_cov", "kl_cov"), cov_selection=(_mask(1, 0, 0, 0, 0, 0),
                                                                                      _mask(0, 1, 0, 0, 0, 0))),
                      ["different cov_selection"]),  # fmt: skip
    "ref_logprobs": (POLICY, _policy(kl_loss_coef=(0.1, 0.1), ref_logprobs=(torch.zeros(N), torch.full((N,), -0.5))),
                     ["different ref_logprobs"]),  # fmt: skip
    "rollout_is_weights": (POLICY, _policy(rollout_is_weights=(torch.ones(N), torch.full((N,), 1.5))),
                           ["different rollout_is_weights"]),
    "token_weights": (POLICY, _policy(token_weights=(torch.full((N,), 1 / 6), torch.full((N,), 1 / 5))),
                      ["different token_weights"]),
    "rollout_is_weights_on_one_rank": (POLICY, _policy(rollout_is_weights=(torch.ones(N), None)),
                                       ["dtypes and shapes", "rank 0: rollout_is_weights: float32 [6]",
                                        "rank 1: rollout_is_weights: None"]),  # fmt: skip
    "old_logprobs_dtype": (POLICY, _with_tensor("old", lambda t: t.double()),
                           ["dtypes and shapes", "old_logprobs: float64 [6]"]),
    "invariant": (ALL, _per_rank_kw(invariant=(False, True)), ["invariant", "[0, 1]"]),
})

#: cases whose agreed error is also a TypeError (a rank's argument had the wrong type)
TYPE_ERRORS = {
    "float_labels_on_one_rank",
    "type_error_on_one_rank_value_error_on_the_other",
    "non_group_mean_group_on_one_rank",
    "not_a_tensor_on_one_rank",
    "vocab_start_not_an_int_on_one_rank",
}


def _in_step(rank: int, tag: int, group=None) -> bool:
    """A plain collective after a case: the ranks must still pair up (nobody left inside the op)."""
    mine = torch.tensor([rank, tag], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(WORLD)]
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone] == [[r, tag] for r in range(WORLD)]


def _raised(fn) -> dict | None:
    """What `fn` raised (every rank reports it, whatever it is), or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts which
        return dict(kind=type(e).__name__, message=str(e), value_error=isinstance(e, ValueError),
                    type_error=isinstance(e, TypeError))  # fmt: skip
    return None


def _disagreement(rank: int, group, case: str, op: str) -> dict:
    data, kw = DISAGREEMENTS[case][1](rank)
    kw = {k: group if isinstance(v, str) and v == "<group>" else v for k, v in kw.items()}
    return dict(error=_raised(lambda: _call(op, data, dict(kw, tp_group=group))))


# ----------------------------------------------------------------------------------------------------------
# positive cases: shards of the same global tensors


def _global(seed: int, *, vocab_size: int | None = None):
    """Global logits [N, V], hidden [N, H], weight [V, H], labels [N] (two ignored), upstream weights."""
    g = _gen(seed)
    real = V if vocab_size is None else vocab_size
    labels = torch.randint(0, real, (N,), generator=g)
    labels[1] = labels[4] = -100
    return dict(
        logits=torch.randn(N, V, generator=g) * 3,
        hidden=torch.randn(N, H, generator=g),
        weight=torch.randn(V, H, generator=g) * 0.7,
        labels=labels,
        w_logprobs=torch.randn(N, generator=g),
        w_entropy=torch.randn(N, generator=g),
    )


def _shard_span(rank: int, split: tuple[int, int]) -> tuple[int, int]:
    start = sum(split[:rank])
    return start, start + split[rank]


def _fused_outputs(g: dict, s: int, e: int, kw: dict) -> dict:
    """linear_cross_entropy (mean) and linear_token_logprobs (+ entropy) on this rank's weight rows."""
    out = {}
    h = g["hidden"].clone().requires_grad_()
    w = g["weight"][s:e].clone().requires_grad_()
    loss = lmloss.linear_cross_entropy(h, w, g["labels"], **kw)
    loss.backward()
    out["ce"], out["ce_grad_hidden"], out["ce_grad_weight"] = loss.detach(), h.grad, w.grad
    h = g["hidden"].clone().requires_grad_()
    w = g["weight"][s:e].clone().requires_grad_()
    logp, ent = lmloss.linear_token_logprobs(h, w, g["labels"], return_entropy=True, **kw)
    ((logp * g["w_logprobs"]).sum() + (ent * g["w_entropy"]).sum()).backward()
    out["logprobs"], out["entropy"] = logp.detach(), ent.detach()
    out["lp_grad_hidden"], out["lp_grad_weight"] = h.grad, w.grad
    return out


def _logits_outputs(g: dict, s: int, e: int, kw: dict) -> dict:
    """cross_entropy (mean) and token_logprobs (+ entropy) on this rank's logit columns."""
    out = {}
    x = g["logits"][:, s:e].clone().requires_grad_()
    loss = lmloss.cross_entropy(x, g["labels"], **kw)
    loss.backward()
    out["ce"], out["ce_grad"] = loss.detach(), x.grad
    x = g["logits"][:, s:e].clone().requires_grad_()
    logp, ent = lmloss.token_logprobs(x, g["labels"], return_entropy=True, **kw)
    ((logp * g["w_logprobs"]).sum() + (ent * g["w_entropy"]).sum()).backward()
    out["logprobs"], out["entropy"], out["lp_grad"] = logp.detach(), ent.detach(), x.grad
    return out


#: name -> (split, kwargs of every call); the same global tensors (seeded by name's index)
POSITIVE = {
    "uneven_auto": (SPLIT, dict(chunk_size="auto")),
    "triton_even": ((16, 16), dict(impl="triton", chunk_size=4, temperature=0.7, softcap=5.0)),
    "triton_uneven_padded": (
        SPLIT,
        dict(impl="triton", chunk_size="auto", temperature=1.3, softcap=4.0, vocab_size=29),
    ),
}


def _positive(rank: int, group, name: str) -> dict:
    split, kw = POSITIVE[name]
    g = _global(100 + list(POSITIVE).index(name), vocab_size=kw.get("vocab_size"))
    s, e = _shard_span(rank, split)
    kw = dict(kw, tp_group=group)
    if split[0] != split[1]:
        kw["vocab_start"] = s
    # a chunk budget just above the floor of the agreed width (issue #41 refuses less), where each rank's own
    # shard would give it another "auto" chunk: the ranks must size it (and its floor) from a width they agree on
    before = os.environ.get("LMLOSS_CHUNK_BUDGET_MIB")
    os.environ["LMLOSS_CHUNK_BUDGET_MIB"] = str(800 / 2**20)
    try:
        return dict(fused=_fused_outputs(g, s, e, kw), logits=_logits_outputs(g, s, e, kw))
    finally:
        if before is None:
            del os.environ["LMLOSS_CHUNK_BUDGET_MIB"]
        else:
            os.environ["LMLOSS_CHUNK_BUDGET_MIB"] = before


# ----------------------------------------------------------------------------------------------------------
# LMLOSS_CHECK_RANKS=0 on every rank: what is still checked without a collective

UNCHECKED_TIMEOUT = datetime.timedelta(seconds=2)  # the one case below that must wait for it


def _checks_off(rank: int) -> dict:
    """With LMLOSS_CHECK_RANKS=0 on both ranks, on groups of their own: the state is per group, and the
    last case leaves its group broken (that one has a short timeout, so the waiting rank gives up soon)."""
    os.environ["LMLOSS_CHECK_RANKS"] = "0"
    group = dist.new_group(list(range(WORLD)), timeout=COLLECTIVE_TIMEOUT)
    short = dist.new_group(list(range(WORLD)), timeout=UNCHECKED_TIMEOUT)
    g = _global(200)
    s, e = _shard_span(rank, (16, 16))
    logits, labels = g["logits"][:, s:e], g["labels"]
    out = {}
    # the first call under the group still gathers (and agrees to stop); the second makes no gather
    out["first"] = lmloss.token_logprobs(logits, labels, tp_group=group)
    out["second"] = lmloss.token_logprobs(logits, labels, tp_group=group)
    bad = labels.clone()
    bad[0] = V + 3  # the same out-of-range label on both ranks: each raises, with no collective
    out["range"] = _error_of(lambda: lmloss.cross_entropy(logits, bad, tp_group=group))
    out["range_in_step"] = _in_step(rank, 5000)
    # uneven shards without vocab_start: only the rank whose width cannot cover vocab_size can tell; the
    # other enters the first collective and waits for the group's timeout
    lmloss.token_logprobs(logits, labels, tp_group=short)  # right after the barrier above: agrees to stop
    s, e = _shard_span(rank, SPLIT)
    out["uneven"] = _error_of(
        lambda: lmloss.token_logprobs(g["logits"][:, s:e], labels, tp_group=short, vocab_size=V)
    )
    out["uneven_in_step"] = _in_step(rank, 5001)
    del os.environ["LMLOSS_CHECK_RANKS"]
    return out


def _error_of(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts which
        return type(e).__name__, str(e)
    return None


# ----------------------------------------------------------------------------------------------------------
# the group as a CP group: policy_loss's agreement over cp_group, and the rollout functions under CP / DP

CP_LENGTHS = (4, 3, 3)  # three packed sequences; rank 1 holds no token of the last one
CP_POSITIONS = (torch.tensor([0, 1, 4, 5, 7, 8, 9]), torch.tensor([2, 3, 6]))
DP_LENGTHS = ((3, 2, 4), (2, 5))  # whole sequences per DP rank: 3 on rank 0, 2 on rank 1
CP_ERRORS = {  # name -> (rank 0's, rank 1's) policy_loss options, words every rank's message must contain
    "gspo_vs_vanilla": ((dict(loss_mode="gspo"), dict(loss_mode="vanilla")), ["policy_loss over cp_group", "loss_mode="]),
    "gspo_vs_geo_mean": ((dict(loss_mode="gspo"), dict(loss_mode="geo_mean")), ["policy_loss over cp_group", "geo_mean"]),
    "clip_ratio": ((dict(clip_ratio=0.2), dict(clip_ratio=0.02)), ["policy_loss over cp_group", "clip_ratio_low=0.02"]),
    "bad_clip_ratio_on_one_rank": ((dict(clip_ratio=0.2), dict(clip_ratio=-1.0)), ["rank 1 of 2 rejected", "clip_ratio"]),
    "type_error_on_one_rank_value_error_on_the_other": (
        (dict(rollout_is_weights="a list"), dict(clip_ratio=-1.0)),
        ["policy_loss over cp_group: ranks rejected", "rank 0: rollout_is_weights must be a torch.Tensor",
         "rank 1: clip_ratio"]),  # fmt: skip
    "is_weights_on_one_rank": ((dict(loss_mode="geo_mean", rollout_is_weights="ones"), dict(loss_mode="geo_mean")),
                               ["policy_loss over cp_group", "given"]),
}  # fmt: skip


def cp_batch() -> dict:
    """The global packed batch (float64) of the CP cases, and the boundaries of its sequences."""
    g = _gen(300)
    n = sum(CP_LENGTHS)
    d = dict(lp=-torch.rand(n, generator=g, dtype=torch.float64) * 2 - 0.2,
             adv=torch.randn(n, generator=g, dtype=torch.float64), mask=torch.ones(n, dtype=torch.bool))  # fmt: skip
    d["old"] = d["lp"] + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)
    d["old"][4:7] = d["lp"][4:7] - 0.5  # sequence 1 far off-policy: its ratio is clipped
    d["mask"][5] = False
    d["seq"] = torch.repeat_interleave(torch.arange(len(CP_LENGTHS)), torch.tensor(CP_LENGTHS))
    d["weights"] = d["mask"] / d["mask"].sum()  # token-mean over the global batch
    d["rollout"] = d["old"] - 0.05  # rollout_rs: k2 = 0.00125 per token ...
    d["rollout"][1] = d["old"][1] - 1.0  # ... but k2 = 0.5 at a token of sequence 0 on rank 0
    d["rollout"][6] = d["old"][6] + 1.0  # ... and of sequence 1 on rank 1
    return d


def _cp_error(rank: int, group, name: str) -> dict:
    d, pos = cp_batch(), CP_POSITIONS[rank]
    kw = dict(CP_ERRORS[name][0][rank])
    if kw.get("rollout_is_weights") == "ones":
        kw["rollout_is_weights"] = torch.ones(len(pos), dtype=torch.float64)
    if kw.get("rollout_is_weights") == "a list":
        kw["rollout_is_weights"] = [1.0] * len(pos)
    return dict(error=_error_of(lambda: lmloss.rl.policy_loss(
        d["lp"][pos], d["old"][pos], d["adv"][pos], d["mask"][pos], sequence_ids=d["seq"][pos], cp_group=group,
        token_weights=d["weights"][pos], **kw,
    )))  # fmt: skip


def _policy_cp(rank: int, group) -> dict:
    """gspo over a CP split in which rank 1 holds no token of the last sequence (sequence_ids only: each rank
    counts its own sequences); the rollout functions' agreement and reductions."""
    d, pos = cp_batch(), CP_POSITIONS[rank]
    out = {}
    lp = d["lp"][pos].clone().requires_grad_()
    loss, _ = lmloss.rl.policy_loss(lp, d["old"][pos], d["adv"][pos], d["mask"][pos], loss_mode="gspo",
                                    sequence_ids=d["seq"][pos], cp_group=group, token_weights=d["weights"][pos])  # fmt: skip
    loss.backward()
    out["gspo"] = (loss.detach(), lp.grad)
    out["seq_max"] = lmloss.rl.rejection_mask(d["old"][pos], d["rollout"][pos], d["mask"][pos], rollout_rs="seq_max_k2",
                                              rollout_rs_threshold=0.1, sequence_ids=d["seq"][pos], cp_group=group)  # fmt: skip
    seq = d["seq"][pos]
    out["off_policy"] = lmloss.rl.off_policy_sequence_mask(d["lp"][pos], d["rollout"][pos], d["adv"][pos], d["mask"][pos],
                                                          threshold=0.0, sequence_ids=seq, cp_group=group)  # fmt: skip
    out["sequence_is_weights"] = lmloss.rl.masked_is_weights(d["old"][pos], d["rollout"][pos], d["mask"][pos],
                                                             level="sequence", sequence_ids=seq, cp_group=group,
                                                             lower=0.5, upper=3.0)  # fmt: skip
    out["normalize_under_cp_without_group"] = _error_of(lambda: lmloss.rl.truncated_is_weights(
        d["old"][pos], d["rollout"][pos], d["mask"][pos], level="sequence", sequence_ids=d["seq"][pos], cp_group=group,
        batch_normalize=True,
    ))  # fmt: skip
    out["normalize_under_cp_without_group", "in_step"] = _in_step(rank, 6100)
    # DP: each rank its whole sequences, 3 and 2 of them, normalized over the group
    b = dp_batch()
    start = sum(DP_LENGTHS[0]) if rank else 0
    span = slice(start, start + sum(DP_LENGTHS[rank]))
    cu = torch.tensor([0, *torch.tensor(DP_LENGTHS[rank]).cumsum(0).tolist()])
    out["dp_normalized"] = lmloss.rl.truncated_is_weights(b["old"][span], b["rollout"][span], b["mask"][span],
                                                          level="sequence", cu_seqlens=cu, batch_normalize=True,
                                                          group=group, cap=1.5)  # fmt: skip
    return out


def dp_batch() -> dict:
    g = _gen(301)
    n = sum(map(sum, DP_LENGTHS))
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 2
    mask = torch.rand(n, generator=g) > 0.2
    return dict(old=old, rollout=old + 0.3 * torch.randn(n, generator=g, dtype=torch.float64), mask=mask)


# ----------------------------------------------------------------------------------------------------------
# the run: every case isolated, so that a broken case fails its own test and no other

#: Each case's collectives time out after this (a rank left waiting by a broken case gives up and the run goes
#: on); the default group, which only separates the cases, waits longer.
CASE_TIMEOUT = datetime.timedelta(seconds=10)
SECTIONS = {"checks_off": lambda rank, group: _checks_off(rank), "cp": lambda rank, group: _policy_cp(rank, group)}
CASES = (
    [("disagree", case, op) for case, (ops, _, _) in DISAGREEMENTS.items() for op in ops]
    + [("cp_errors", name) for name in CP_ERRORS]
    + [("positive", name) for name in POSITIVE]
    + [("section", name) for name in SECTIONS]
)


def _run_case(rank: int, group, key: tuple):
    if key[0] == "disagree":
        return _disagreement(rank, group, *key[1:])
    if key[0] == "cp_errors":
        return _cp_error(rank, group, key[1])
    if key[0] == "positive":
        return _positive(rank, group, key[1])
    return SECTIONS[key[1]](rank, group)


def _cases_from(rank: int, world: int, keys: list, out_dir: str) -> None:
    """Run `keys` in order on a process group with a short timeout, each result saved as soon as it is known.
    After a case, a tag on that group checks that no rank was left inside a collective (it times out if one
    was), then the default group lines the ranks up; a group a case left behind is replaced by a fresh one. A case that
    kills a rank (gloo aborts the process on collectives of different sizes) ends the run: `_run_isolated`
    reports it against that case and starts a new run after it."""
    group = None
    for i, key in enumerate(keys):
        if group is None:  # the first case, or the one after a case that left a rank behind: a fresh group
            group = dist.new_group(list(range(WORLD)), timeout=CASE_TIMEOUT)
        result = _run_case(rank, group, key)
        in_step = False
        with contextlib.suppress(RuntimeError):  # a collective timed out: a rank was left behind
            in_step = _in_step(rank, i, group)
        if key[0] != "section":  # a section checks its own steps
            result["in_step"] = in_step
        flags = [torch.zeros(1, dtype=torch.int64) for _ in range(WORLD)]
        dist.all_gather(flags, torch.tensor([int(in_step)]))  # the default group: every rank lines up here
        if not all(int(f) for f in flags):
            group = None
        torch.save(result, os.path.join(out_dir, f"rank{rank}_{i}.pt"))


class _Broken:
    """In place of a case's result on every rank when the case killed a rank or hung: using it fails the test."""

    def __init__(self, key: tuple, why: str) -> None:
        self.why = f"case {key} broke the ranks: {why}"

    def __getitem__(self, item):
        pytest.fail(self.why, pytrace=False)


def _run_isolated(keys: list) -> list[dict]:
    """Every rank's result of each case, ``out[rank][key]`` (`_Broken` for a case that killed a rank or hung)."""
    out = [{} for _ in range(WORLD)]
    while keys:
        with tempfile.TemporaryDirectory() as out_dir:
            why = "no rank finished it"
            try:
                run_ranks(_cases_from, WORLD, keys, out_dir, deadline_s=RUN_DEADLINE_S,
                          timeout_s=3 * CASE_TIMEOUT.total_seconds())  # fmt: skip
            except AssertionError as e:  # a rank died or the run hung: the cases after the last done are rerun
                why = str(e)[-2000:]
            done = 0
            while done < len(keys) and all(os.path.exists(os.path.join(out_dir, f"rank{r}_{done}.pt")) for r in range(WORLD)):
                for r in range(WORLD):
                    out[r][keys[done]] = torch.load(os.path.join(out_dir, f"rank{r}_{done}.pt"), weights_only=False)
                done += 1
        if done < len(keys):
            for r in range(WORLD):
                out[r][keys[done]] = _Broken(keys[done], why)
        keys = keys[done + 1 :]
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Per rank: ``"disagree"[case, op]``, ``"cp_errors"[name]``, ``"positive"[name]`` and each of `SECTIONS`."""
    flat = _run_isolated(list(CASES))
    return [
        {"disagree": {k[1:]: v for k, v in mine.items() if k[0] == "disagree"},
         "cp_errors": {k[1]: v for k, v in mine.items() if k[0] == "cp_errors"},
         "positive": {k[1]: v for k, v in mine.items() if k[0] == "positive"},
         **{k[1]: v for k, v in mine.items() if k[0] == "section"}}
        for mine in flat
    ]  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# the assertions


CASE_OPS = [(case, op) for case, (ops, _, _) in DISAGREEMENTS.items() for op in ops]


@pytest.mark.parametrize(("case", "op"), CASE_OPS, ids=[f"{c}-{o}" for c, o in CASE_OPS])
def test_disagreeing_ranks_all_raise_the_same_value_error_naming_the_argument(ranks, case, op):
    words = DISAGREEMENTS[case][2]
    errors = [ranks[r]["disagree"][case, op]["error"] for r in range(WORLD)]
    for rank, error in enumerate(errors):
        assert error is not None, f"rank {rank} computed instead of raising"
        assert error["value_error"], f"rank {rank}: {error['kind']}: {error['message']}"
        assert error["type_error"] == (case in TYPE_ERRORS), f"rank {rank}: {error['kind']}"
        for word in words:
            assert word in error["message"], f"rank {rank}: {word!r} not in {error['message']!r}"
    assert errors[0] == errors[1], "the ranks raised different errors"
    assert all(ranks[r]["disagree"][case, op]["in_step"] for r in range(WORLD)), "ranks out of step"


def _ref_logits(g: dict, kw: dict, *, fused: bool):
    """float64 leaves and the scaled logits over the real vocabulary, as the op defines them."""
    if fused:
        leaves = [g["hidden"].double().requires_grad_(), g["weight"].double().requires_grad_()]
        z = leaves[0] @ leaves[1].T
    else:
        leaves = [g["logits"].double().requires_grad_()]
        z = leaves[0]
    if kw.get("softcap") is not None:
        z = kw["softcap"] * torch.tanh(z / kw["softcap"])
    z = z[:, : kw.get("vocab_size", V)] / kw.get("temperature", 1.0)
    return leaves, z


def _references(g: dict, kw: dict, *, fused: bool) -> dict:
    labels, valid = g["labels"], g["labels"] != -100
    ref = {}
    leaves, z = _ref_logits(g, kw, fused=fused)
    loss = F.cross_entropy(z, labels, ignore_index=-100)
    loss.backward()
    ref["ce"] = loss.detach()
    ref["ce_grads"] = [t.grad for t in leaves]
    leaves, z = _ref_logits(g, kw, fused=fused)
    logp_all = torch.log_softmax(z, dim=-1)
    picked = logp_all.gather(1, torch.where(valid, labels, 0)[:, None])[:, 0]
    logp = torch.where(valid, picked, 0.0)
    ent = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)  # an ignored token: 0, no gradient
    ((logp * g["w_logprobs"].double()).sum() + (ent * g["w_entropy"].double()).sum()).backward()
    ref["logprobs"], ref["entropy"] = logp.detach(), ent.detach()
    ref["lp_grads"] = [t.grad for t in leaves]
    return ref


@pytest.mark.parametrize("name", list(POSITIVE))
@pytest.mark.parametrize("path", ["fused", "logits"])
def test_tp2_shards_match_the_single_process_float64_result(ranks, name, path):
    split, kw = POSITIVE[name]
    g = _global(100 + list(POSITIVE).index(name), vocab_size=kw.get("vocab_size"))
    ref = _references(g, kw, fused=path == "fused")
    for rank in range(WORLD):
        got = ranks[rank]["positive"][name][path]
        s, e = _shard_span(rank, split)
        assert ranks[rank]["positive"][name]["in_step"]
        for key in ("ce", "logprobs", "entropy"):
            torch.testing.assert_close(got[key].double(), ref[key], **TOL, msg=f"rank {rank} {key}")
        if path == "fused":
            # every TP rank receives the full (summed) hidden gradient and its own weight rows' gradient
            torch.testing.assert_close(got["ce_grad_hidden"].double(), ref["ce_grads"][0], **TOL)
            torch.testing.assert_close(got["ce_grad_weight"].double(), ref["ce_grads"][1][s:e], **TOL)
            torch.testing.assert_close(got["lp_grad_hidden"].double(), ref["lp_grads"][0], **TOL)
            torch.testing.assert_close(got["lp_grad_weight"].double(), ref["lp_grads"][1][s:e], **TOL)
        else:
            torch.testing.assert_close(got["ce_grad"].double(), ref["ce_grads"][0][:, s:e], **TOL)
            torch.testing.assert_close(got["lp_grad"].double(), ref["lp_grads"][0][:, s:e], **TOL)


def test_checks_off_on_every_rank_skip_the_gather_after_the_first_call_and_compute_the_same(ranks):
    g = _global(200)
    valid = g["labels"] != -100
    logp_all = torch.log_softmax(g["logits"].double(), dim=-1)
    ref = torch.where(valid, logp_all.gather(1, torch.where(valid, g["labels"], 0)[:, None])[:, 0], 0.0)
    for rank in range(WORLD):
        for call in ("first", "second"):
            torch.testing.assert_close(ranks[rank]["checks_off"][call].double(), ref, **TOL)


def test_checks_off_still_check_the_label_range_on_each_rank_without_a_collective(ranks):
    for rank in range(WORLD):
        kind, message = ranks[rank]["checks_off"]["range"]
        # the local check's message (the gathered one lists each rank's (min, max))
        assert kind == "ValueError" and f"found {V + 3}" in message, message
        assert ranks[rank]["checks_off"]["range_in_step"]


def test_checks_off_uneven_shards_raise_where_the_width_cannot_cover_vocab_size_and_time_out_elsewhere(ranks):
    kind, message = ranks[1]["checks_off"]["uneven"]  # 2 x 12 columns < vocab_size = 32
    assert kind == "ValueError" and "vocab_start" in message and "LMLOSS_CHECK_RANKS=0" in message, message
    kind, message = ranks[0]["checks_off"]["uneven"]  # 2 x 20 >= 32: rank 0 cannot tell, and waits
    assert "timed out" in message.lower(), (kind, message)
    assert all(ranks[r]["checks_off"]["uneven_in_step"] for r in range(WORLD))


# ----------------------------------------------------------------------------------------------------------
# the CP cases: the same error on every rank, or the one-process result (plain float64 math written out)


@pytest.mark.parametrize("name", list(CP_ERRORS))
def test_policy_loss_ranks_of_a_cp_group_that_disagree_all_raise_the_same_error(ranks, name):
    errors = [ranks[r]["cp_errors"][name]["error"] for r in range(WORLD)]
    for rank, error in enumerate(errors):
        assert error is not None, f"rank {rank} computed instead of raising"
        kind, message = error
        # a TypeError on any rank makes the agreed error a RankAgreementTypeError (also a ValueError)
        assert kind == ("RankAgreementTypeError" if "type_error" in name else "RankAgreementError"), (rank, kind, message)
        for word in CP_ERRORS[name][1]:
            assert word in message, f"rank {rank}: {word!r} not in {message!r}"
    assert errors[0] == errors[1]
    assert all(ranks[r]["cp_errors"][name]["in_step"] for r in range(WORLD))


def test_gspo_over_a_cp_split_whose_ranks_hold_different_sequence_counts_is_the_one_process_loss(ranks):
    d = cp_batch()
    lp = d["lp"].clone().requires_grad_()
    m = d["mask"].double()
    lengths = torch.zeros(len(CP_LENGTHS), dtype=torch.float64).index_add(0, d["seq"], m)
    seq_kl = torch.zeros(len(CP_LENGTHS), dtype=torch.float64).index_add(0, d["seq"], (lp - d["old"]).detach() * m)
    seq_kl = seq_kl / lengths.clamp(min=1)
    r = torch.exp((lp - lp.detach() + seq_kl[d["seq"]]).clamp(max=10.0))
    pg = torch.maximum(-d["adv"] * r, -d["adv"] * r.clamp(0.8, 1.2))
    want = (d["weights"] * pg * m).sum()
    want.backward()
    assert ranks[0]["cp"]["gspo"] is not None and CP_POSITIONS[1].max() < 7  # rank 1: none of sequence 2
    total = sum(ranks[r]["cp"]["gspo"][0] for r in range(WORLD))
    torch.testing.assert_close(total, want.detach(), rtol=1e-12, atol=1e-14)
    grad = torch.zeros_like(lp)
    for r in range(WORLD):
        grad[CP_POSITIONS[r]] = ranks[r]["cp"]["gspo"][1]
    torch.testing.assert_close(grad, lp.grad, rtol=1e-12, atol=1e-14)


def test_rejection_seq_max_under_cp_is_the_max_over_the_ranks_pieces(ranks):
    d = cp_batch()
    k2 = 0.5 * (d["old"] - d["rollout"]) ** 2
    seq_max = torch.full((len(CP_LENGTHS),), 0.0, dtype=torch.float64)
    seq_max = seq_max.scatter_reduce(0, d["seq"], torch.where(d["mask"], k2, 0.0), "amax")
    want = d["mask"] & (seq_max <= 0.1)[d["seq"]]
    assert want.tolist() == [False] * 7 + [True] * 3  # sequences 0 and 1 rejected: their large k2 on rank 0, rank 1
    for r in range(WORLD):
        assert ranks[r]["cp"]["seq_max"].tolist() == want[CP_POSITIONS[r]].tolist()


def test_sequence_statistics_under_cp_sum_over_the_groups_sequences_when_a_rank_holds_fewer(ranks):
    """TRL's off-policy mask and sequence-level MIS weights on the split whose rank 1 holds no token of the last
    sequence: each sequence's sums over both ranks' pieces, plain math."""
    d = cp_batch()
    m = d["mask"].double()
    n_seq = len(CP_LENGTHS)

    def per_sequence(values):
        return torch.zeros(n_seq, dtype=torch.float64).index_add(0, d["seq"], values * m)

    mean_kl = per_sequence(d["rollout"] - d["lp"]) / per_sequence(torch.ones_like(m)).clamp(min=1)
    keep = d["mask"] & ((d["adv"] >= 0) | (mean_kl <= 0.0)[d["seq"]])
    ratio = per_sequence(d["old"] - d["rollout"]).clamp(-20, 20).exp()[d["seq"]]
    weights = torch.where(d["mask"] & (ratio >= 0.5) & (ratio <= 3.0), ratio, 0.0)
    assert 0 < keep.sum() < d["mask"].sum() and 0 < (weights > 0).sum() < d["mask"].sum()
    for r in range(WORLD):
        assert ranks[r]["cp"]["off_policy"].tolist() == keep[CP_POSITIONS[r]].tolist()
        torch.testing.assert_close(ranks[r]["cp"]["sequence_is_weights"], weights[CP_POSITIONS[r]], rtol=1e-12, atol=0)


def test_batch_normalize_under_cp_needs_group_on_every_rank(ranks):
    errors = [ranks[r]["cp"]["normalize_under_cp_without_group"] for r in range(WORLD)]
    assert errors[0] is not None and errors[0] == errors[1]
    assert "batch_normalize=True under cp_group needs group=" in errors[0][1]
    assert all(ranks[r]["cp"]["normalize_under_cp_without_group", "in_step"] for r in range(WORLD))


def test_batch_normalized_sequence_weights_over_dp_ranks_holding_different_sequence_counts(ranks):
    b = dp_batch()
    lengths = [n for rank in DP_LENGTHS for n in rank]
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    m = b["mask"].double()
    log_ratio = torch.zeros(len(lengths), dtype=torch.float64).index_add(0, seq, (b["old"] - b["rollout"]) * m)
    w_seq = log_ratio.clamp(-20, 20).exp().clamp(max=1.5)
    valid = torch.zeros(len(lengths), dtype=torch.float64).index_add(0, seq, m)
    count = torch.zeros(len(lengths), dtype=torch.int64).index_add(0, seq, b["mask"].long())
    # verl's batch mean: over the sequences with a valid token, each its weight's mean over its valid tokens, its
    # 1e-8 added to the bool mask's integer count (in torch's default float dtype, where it rounds away)
    per_seq = w_seq * valid / (count + 1e-8)
    mean = per_seq[valid > 0].sum() / (valid > 0).sum()
    want = torch.where(b["mask"], w_seq[seq] / mean, 0.0)
    got = torch.cat([ranks[r]["cp"]["dp_normalized"] for r in range(WORLD)])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
