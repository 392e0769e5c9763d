"""Integer options past their range are refused with an error naming the argument (issue #40 item 4).

Every int option travels in the TP ranks' int64 agreement vector or lands in an int64 tensor: past int64 it
used to overflow inside the op (``OverflowError: int too big to convert``, naming nothing). The TP side (one
rank passing such a value, every rank raising) is in tests/distributed/test_rank_agreement.py.
"""

from __future__ import annotations

import pytest
import torch

import lmloss

N, H, V = 5, 4, 11
PAST_INT64 = (2**63, 10**23)


def _data():
    g = torch.Generator().manual_seed(0)
    return dict(
        logits=torch.randn(N, V, generator=g),
        hidden=torch.randn(N, H, generator=g),
        weight=torch.randn(V, H, generator=g),
        labels=torch.randint(0, V, (N,), generator=g),
    )


OPS = {
    "token_logprobs": lambda d, **kw: lmloss.token_logprobs(d["logits"], d["labels"], **kw),
    "cross_entropy": lambda d, **kw: lmloss.cross_entropy(d["logits"], d["labels"], **kw),
    "linear_token_logprobs": lambda d, **kw: lmloss.linear_token_logprobs(d["hidden"], d["weight"], d["labels"], **kw),
    "linear_policy_loss": lambda d, **kw: lmloss.rl.linear_policy_loss(
        d["hidden"], d["weight"], d["labels"], torch.full((N,), -2.0), torch.ones(N), **kw
    ),
    "distillation_loss": lambda d, **kw: lmloss.distillation_loss(d["logits"], d["logits"].flip(1), d["labels"], **kw),
    "linear_distillation_loss": lambda d, **kw: lmloss.linear_distillation_loss(
        d["hidden"], d["weight"], d["hidden"].flip(1), d["weight"], d["labels"], **kw
    ),
}
OPTIONS = {  # option -> the words its error must hold
    "top_k": "top_k must be in [1, 2**63 - 1]",
    "chunk_size": "chunk_size must fit in int64",
    "vocab_size": "vocab_size must fit in int64",
    "vocab_start": "vocab_start must fit in int64",
    "ignore_index": "ignore_index must fit in int64",
}
CASES = [(op, opt) for op in OPS for opt in OPTIONS if not (opt == "top_k" and ("cross" in op or "distill" in op))]


@pytest.mark.parametrize(("op", "option"), CASES, ids=[f"{o}-{k}" for o, k in CASES])
def test_an_int_option_past_int64_is_refused_naming_it(op, option):
    d = _data()
    for value in PAST_INT64:
        with pytest.raises(ValueError) as err:
            OPS[op](d, **{option: value})
        assert OPTIONS[option] in str(err.value)
    # the largest int64 is accepted where it means something: top_k and chunk_size keep / take everything
    if option in ("top_k", "chunk_size") and op != "linear_policy_loss":
        full = OPS[op](d)
        torch.testing.assert_close(OPS[op](d, **{option: 2**63 - 1}), full, rtol=0, atol=0)


def test_pack_refuses_ids_past_int64_naming_them():
    seqs = [[1, 2, 3], [4, 5]]
    for kw, words in [
        (dict(pad_id=2**63, pad_to_multiple_of=4), "pad_id must fit in int64"),
        (dict(ignore_index=10**23), "ignore_index must fit in int64"),
        (dict(pad_to_multiple_of=10**23), "pad_to_multiple_of must fit in int64"),
    ]:
        with pytest.raises(ValueError, match=words):
            lmloss.pack(seqs, **kw)
    with pytest.raises(ValueError, match="ignore_index must fit in int64"):
        lmloss.shift_labels(torch.tensor([[1, 2, 3]]), ignore_index=-(2**63) - 1)
    batch = lmloss.pack(seqs, pad_to_multiple_of=4, pad_id=2**63 - 1, ignore_index=-(2**63))
    assert batch.input_ids.tolist() == [1, 2, 3, 2**63 - 1, 4, 5, 2**63 - 1, 2**63 - 1]
    assert batch.labels.tolist()[:3] == [2, 3, -(2**63)]


def test_verl_backend_options_refuse_ints_past_int64_when_read():
    verl_support = pytest.importorskip("verl_support")
    LV = verl_support.load_model_patch().integration
    for spec, words in [
        ("lmloss:top_k=99999999999999999999999", "top_k must fit in int64"),
        ("lmloss:top_k=9223372036854775808", "top_k must fit in int64"),
        ("lmloss:chunk_size=99999999999999999999999", "chunk_size must fit in int64"),
    ]:
        with pytest.raises(ValueError) as err:
            LV.backend_options(spec)
        assert spec in str(err.value) and words in str(err.value)
    assert LV.backend_options("lmloss:top_k=9223372036854775807").top_k == 2**63 - 1
    with pytest.raises(ValueError, match="top_k must fit in int64"):
        LV.HeadOptions(top_k=10**23)
