"""TP ranks that disagree raise the same ValueError on every rank; uneven shards compute the right answer.

ONE run of 2 gloo ranks hosts every case (`dist_utils.run_ranks`). The run has a deadline and the process
group a short collective timeout, so a regression that makes the ranks hang fails this test within seconds
instead of blocking for gloo's default 30 minutes.

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

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks

import lmloss

WORLD = 2
RUN_DEADLINE_S = 120  # the whole run; it takes ~15 s when nothing hangs
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=20)
N, H, V = 6, 8, 32  # tokens, hidden width, global vocabulary columns
SPLIT = (20, 12)  # uneven shards: rank 0 holds columns [0, 20), rank 1 [20, 32)
TOL = dict(atol=1e-5, rtol=1e-5)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_all_cases, WORLD, deadline_s=RUN_DEADLINE_S, timeout_s=COLLECTIVE_TIMEOUT.total_seconds())


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
    d["topk_logprobs"] = torch.full((n, 4), -2.0)
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
    "LMLOSS_CHUNK_BUDGET_MIB_on_one_rank": (
        FUSED,
        lambda r: (
            _data(0, N, 16),
            dict(chunk_size="auto", _env={"LMLOSS_CHUNK_BUDGET_MIB": _per_rank(r, None, "1")}),
        ),
        ["LMLOSS_CHUNK_BUDGET_MIB", "[64.0, 1.0]"],
    ),
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

#: cases whose agreed error is also a TypeError (a rank's argument had the wrong type)
TYPE_ERRORS = {
    "float_labels_on_one_rank",
    "non_group_mean_group_on_one_rank",
    "not_a_tensor_on_one_rank",
    "vocab_start_not_an_int_on_one_rank",
}


def _in_step(rank: int, tag: int) -> bool:
    """A plain collective after a case: the ranks must still pair up (nobody left inside the op)."""
    mine = torch.tensor([rank, tag], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(WORLD)]
    dist.all_gather(everyone, mine)
    return [t.tolist() for t in everyone] == [[r, tag] for r in range(WORLD)]


def _disagreements(rank: int, group) -> dict:
    out = {}
    tag = 0
    for case, (ops, make, _) in DISAGREEMENTS.items():
        for op in ops:
            tag += 1
            data, kw = make(rank)
            if kw.get("mean_group") == "<group>":
                kw = dict(kw, mean_group=group)
            try:
                _call(op, data, dict(kw, tp_group=group))
                error = None
            except Exception as e:  # noqa: BLE001 - every rank reports what it raised, whatever it is
                error = dict(
                    kind=type(e).__name__,
                    message=str(e),
                    value_error=isinstance(e, ValueError),
                    type_error=isinstance(e, TypeError),
                )
            out[case, op] = dict(error=error, in_step=_in_step(rank, tag))
    return out


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


def _positive(rank: int, group) -> dict:
    out = {}
    for i, (name, (split, kw)) in enumerate(POSITIVE.items()):
        g = _global(100 + i, vocab_size=kw.get("vocab_size"))
        s, e = _shard_span(rank, split)
        kw = dict(kw, tp_group=group)
        if split[0] != split[1]:
            kw["vocab_start"] = s
        # a chunk budget so small that each rank's own shard would give it another "auto" chunk (1 row
        # for 20 columns, 2 for 12): the ranks must size it from a width they agree on
        before = os.environ.get("LMLOSS_CHUNK_BUDGET_MIB")
        os.environ["LMLOSS_CHUNK_BUDGET_MIB"] = str(200 / 2**20)
        try:
            out[name, "fused"] = _fused_outputs(g, s, e, kw)
        finally:
            if before is None:
                del os.environ["LMLOSS_CHUNK_BUDGET_MIB"]
            else:
                os.environ["LMLOSS_CHUNK_BUDGET_MIB"] = before
        out[name, "logits"] = _logits_outputs(g, s, e, kw)
        out[name, "in_step"] = _in_step(rank, 1000 + i)
    return out


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


def _all_cases(rank: int, world: int) -> dict:
    group = dist.new_group(list(range(WORLD)))
    return dict(
        disagree=_disagreements(rank, group), positive=_positive(rank, group), checks_off=_checks_off(rank)
    )


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
    ent = -(logp_all.exp() * logp_all).sum(-1)
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
        got = ranks[rank]["positive"][name, path]
        s, e = _shard_span(rank, split)
        assert ranks[rank]["positive"][name, "in_step"]
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
