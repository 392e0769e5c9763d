"""Rows that do not count (``labels == ignore_index``, or ``mask == 0``) take no chunk: `lmloss.rows`.

Pinned here: the chunks the plan walks (only counting rows; slices of logits, gathers of hidden rows), that
no matmul and no softmax kernel ever sees an ignored row (so NaN there cannot reach anything), that every
output and gradient row of an ignored token is exactly 0 in every op, that the values of the counting
tokens do not change when others are ignored (their bits, in invariant mode), and `linear_policy_loss`'s
``mask=``. References are plain PyTorch written out here.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import lmloss
from lmloss import rl
from lmloss.kernels import torch_ref
from lmloss.rows import MIN_GAP, Rows, RowSelection, min_gap

pytestmark = pytest.mark.usefixtures("one_thread")


def _selection(mask) -> RowSelection:
    return RowSelection.of(torch.tensor(mask, dtype=torch.bool))


def _spans(chunks: list[Rows]) -> list:
    return [(r.start, r.end) if r.contiguous else r.index.tolist() for r in chunks]


# ----------------------------------------------------------------------------------------------------------
# the chunks


def test_every_row_counting_needs_no_selection():
    assert RowSelection.of(torch.ones(5, dtype=torch.bool)) is None


def test_gathering_sources_take_the_counting_rows_in_order_as_slices_where_they_follow_each_other():
    sel = _selection([0, 1, 1, 1, 0, 1, 1, 0, 0, 1])
    assert sel.count == 6
    assert _spans(sel.chunks(3, gather=True)) == [(1, 4), [5, 6, 9]]
    assert _spans(sel.chunks(10, gather=True)) == [[1, 2, 3, 5, 6, 9]]


def test_slicing_sources_skip_long_gaps_and_join_runs_across_short_ones():
    n = 3 * MIN_GAP + 20
    mask = torch.zeros(n, dtype=torch.bool)
    mask[0:5] = mask[8:12] = True  # a gap of 3 rows: one chunk, the 3 rows computed and masked
    mask[12 + MIN_GAP : 20 + MIN_GAP] = True  # a gap of MIN_GAP rows: skipped
    sel = RowSelection.of(mask)
    assert _spans(sel.chunks(100, gather=False)) == [(0, 12), (12 + MIN_GAP, 20 + MIN_GAP)]
    assert _spans(sel.chunks(5, gather=False)) == [(0, 5), (5, 10), (10, 12), (12 + MIN_GAP, 17 + MIN_GAP),
                                                   (17 + MIN_GAP, 20 + MIN_GAP)]  # fmt: skip


def test_over_a_narrow_vocabulary_only_gaps_of_enough_logits_are_skipped():
    """A chunk boundary costs what ~`GAP_LOGITS` logits cost: over a narrow vocabulary a gap must be longer to be
    worth skipping (half of every 512 rows ignored took 3.9x the time of none at 8 columns when every gap
    was skipped). The sink zeroes exactly the gaps the chunks skip."""
    from lmloss.rows import GAP_LOGITS

    assert min_gap(torch.device("cpu"), 1024, row_width=32000) == MIN_GAP
    assert min_gap(torch.device("cpu"), 1024, row_width=256) == GAP_LOGITS // 256 > MIN_GAP
    assert min_gap(torch.device("cuda"), 1024, row_width=8) == GAP_LOGITS // 8
    mask = torch.ones(4096, dtype=torch.bool)
    mask.view(-1, 512)[:, :256] = False
    wide, narrow = RowSelection.of(mask, row_width=32000), RowSelection.of(mask, row_width=256)
    assert len(wide.chunks(4096, gather=False)) == 8  # every prompt skipped
    assert _spans(narrow.chunks(4096, gather=False)) == [(256, 4096)]  # computed and masked
    for sel, zeroed in ((wide, ~mask), (narrow, torch.arange(4096) < 256)):
        t = torch.ones(4096, 3)
        sel.zero_skipped_(t, 4096)
        assert torch.equal(t[:, 0] == 0, zeroed)


def test_on_a_gpu_slicing_sources_skip_only_gaps_of_a_chunk_or_more():
    # a GPU chunk of a few hundred rows leaves SMs idle: half of every 512 rows ignored, skipped run by run,
    # took 2.75x the time of none ignored on an H200; there only gaps of at least a chunk are skipped
    assert min_gap(torch.device("cpu"), 1024) == MIN_GAP
    assert min_gap(torch.device("cuda"), 1024) == 1024 and min_gap(torch.device("cuda"), 8) == MIN_GAP
    mask = torch.ones(4096, dtype=torch.bool)
    mask.view(-1, 512)[:, :256] = False  # prompts: the first half of every sequence
    mask[2048 : 2048 + 1024 + 256] = False  # and one gap of 1280 rows
    cpu = RowSelection.of(mask)
    gpu = dataclasses.replace(cpu, index=cpu.index.to("meta"))  # a device that is not the CPU
    assert _spans(cpu.chunks(1024, gather=False)) == [(256, 512), (768, 1024), (1280, 1536), (1792, 2048),
                                                      (3328, 3584), (3840, 4096)]  # fmt: skip
    assert _spans(gpu.chunks(1024, gather=False)) == [(256, 1280), (1280, 2048), (3328, 4096)]
    assert _spans(gpu.chunks(4096, gather=False)) == [(256, 4096)]  # one chunk: the 1280 rows computed too


def test_a_slicing_sources_sink_zeroes_only_the_rows_no_chunk_holds():
    # the rows of a short gap are computed (the kernels give them 0); zeroing them too would be a second pass
    mask = torch.zeros(3 * MIN_GAP + 30, dtype=torch.bool)
    mask[5:10] = mask[13:20] = mask[20 + MIN_GAP : 25 + MIN_GAP] = True
    sel = RowSelection.of(mask)
    covered = torch.zeros_like(mask)
    for rows in sel.chunks(8, gather=False):
        covered[rows.start : rows.end] = True
    t = sel.zero_skipped_(torch.ones(mask.shape[0], 2), chunk_rows=8)
    assert torch.equal(t[:, 0] == 0, ~covered) and covered[10:13].all()  # the 3-row gap kept for the kernels
    assert torch.equal(sel.zero_skipped_(torch.ones(mask.shape[0], 2))[:, 0] == 0, ~mask)  # gathering: all


def test_no_counting_row_makes_no_chunk_and_every_row_is_zeroed():
    sel = _selection([0, 0, 0])
    assert sel.chunks(2, gather=True) == [] and sel.chunks(2, gather=False) == []
    t = torch.ones(3, 2)
    assert torch.equal(sel.zero_skipped_(t), torch.zeros(3, 2))


@pytest.mark.parametrize("pattern", ["few_gaps", "many_gaps"])
def test_zero_skipped_writes_zeros_exactly_in_the_rows_that_do_not_count(pattern):
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(500, generator=g) < (0.9 if pattern == "few_gaps" else 0.5)
    t = torch.randn(500, 3, generator=g)
    expected = torch.where(mask[:, None], t, 0.0)
    assert torch.equal(RowSelection.of(mask).zero_skipped_(t), expected)


# ----------------------------------------------------------------------------------------------------------
# no work on ignored rows


def _sequences_with_prompts(n_seq=4, length=96, prompt=48, v=300, seed=0):
    """Packed sequences whose first `prompt` tokens are ignored (SFT / RL prompts), every 7th response token
    ignored too (tool output)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, v, (n_seq, length), generator=g)
    labels[:, :prompt] = -100
    labels[:, prompt::7] = -100
    return labels.reshape(-1)


class _MatmulRows(TorchDispatchMode):
    """Token rows of every matmul of an ``[N, H] x [V, H]`` head: the logits (``h @ w.T``), the hidden
    gradient (``dz @ w``) and the weight gradient (``dz.T @ h``)."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.width, self.vocab, self.rows = width, vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_"):
            a, b = args[:2] if name == "mm" else args[1:3]
            if a.shape[1] == self.width or tuple(b.shape) == (self.vocab, self.width):  # logits
                self.rows += a.shape[0]
            elif a.shape[0] == self.vocab and b.shape[1] == self.width:  # weight gradient
                self.rows += b.shape[0]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op", ["ce_sum", "logprobs_backward"])
def test_fused_ops_multiply_only_the_rows_that_count(op):
    labels = _sequences_with_prompts()
    n, h, v = labels.shape[0], 24, 300
    counting = int((labels != -100).sum())
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    with _MatmulRows(h, v) as seen:
        if op == "ce_sum":
            lmloss.linear_cross_entropy(hidden, weight, labels, reduction="sum", chunk_size=40).backward()
            matmuls = 3  # the logits, the hidden gradient, the weight gradient
        else:
            lmloss.linear_token_logprobs(hidden, weight, labels, chunk_size=40).sum().backward()
            matmuls = 4  # the logits twice (forward, backward), the two gradients
    assert seen.rows == matmuls * counting, (seen.rows, counting)


def test_logits_kernels_see_only_the_rows_that_count(monkeypatch):
    monkeypatch.setattr(lmloss.rows, "GAP_LOGITS", 1)  # every gap of MIN_GAP rows skipped, at 50 columns too
    labels = torch.full((4 * MIN_GAP,), -100)
    labels[MIN_GAP : MIN_GAP + 10] = 3  # one run, long gaps on both sides
    labels[3 * MIN_GAP + 5 : 3 * MIN_GAP + 9] = 1
    seen = []
    for name in ("softmax_partials", "partials_then_grad_", "softmax_grad_"):
        original = getattr(torch_ref.TorchKernels, name)

        def spy(self, x, *args, _original=original, **kwargs):
            seen.append(x.shape[0])
            return _original(self, x, *args, **kwargs)

        monkeypatch.setattr(torch_ref.TorchKernels, name, spy)
    logits = torch.randn(labels.shape[0], 50, requires_grad=True)
    lmloss.token_logprobs(logits, labels, impl="torch", chunk_size=8).sum().backward()
    assert sum(seen) == 2 * 14  # forward and backward, 14 counting rows, none of the ignored ones


# ----------------------------------------------------------------------------------------------------------
# every output and gradient row of an ignored token is exactly 0, whatever its inputs


def _poisoned(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    t[rows] = math.nan
    return t.requires_grad_()


LOGITS_OPS = {
    "token_logprobs+entropy": lambda x, y: sum(o.sum() for o in lmloss.token_logprobs(x, y, return_entropy=True)),
    "top_p+kept_mass": lambda x, y: lmloss.token_logprobs(x, y, top_p=0.9, return_log_kept_mass=True)[0].sum(),
    "cross_entropy_mean": lambda x, y: lmloss.cross_entropy(x, y, label_smoothing=0.1, z_loss=1e-3),
    "cross_entropy_inplace": lambda x, y: lmloss.cross_entropy(x * 1.0, y, inplace_backward=True),
    "distillation_jsd": lambda x, y: lmloss.distillation_loss(x, x.detach().flip(-1), y, beta=0.5),
}


@pytest.mark.parametrize("op", list(LOGITS_OPS))
def test_logits_ops_read_nothing_of_an_ignored_prompt_and_give_every_ignored_row_zero_gradient(op, monkeypatch):
    """Logits are sliced, not gathered: a gap of at least `MIN_GAP` ignored rows (a prompt; with `GAP_LOGITS`
    set so that 40 columns do not make it longer) is skipped, a shorter one (the response's ignored tokens) is
    computed with its neighbours and masked."""
    monkeypatch.setattr(lmloss.rows, "GAP_LOGITS", 1)
    labels = _sequences_with_prompts(length=MIN_GAP + 60, prompt=MIN_GAP + 4, v=40)
    ignored = labels == -100
    prompts = ignored.view(4, -1).clone()
    prompts[:, MIN_GAP + 4 :] = False
    g = torch.Generator().manual_seed(2)
    clean = torch.randn(labels.shape[0], 40, generator=g)
    labels = torch.where(ignored, labels, clean.argmax(-1))  # inside any kept set
    x = _poisoned(clean, prompts.reshape(-1))  # NaN in every prompt row: nothing of them may be read
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = LOGITS_OPS[op](x, labels)
    out.backward()
    assert torch.isfinite(out)
    assert torch.equal(x.grad[ignored], torch.zeros_like(x.grad[ignored]))
    assert torch.isfinite(x.grad).all()
    x_clean = clean.clone().requires_grad_()
    LOGITS_OPS[op](x_clean, labels).backward()  # the same call without the poison: the same numbers
    torch.testing.assert_close(x.grad, x_clean.grad, rtol=0, atol=0)


def _fused_problem(seed=3, h=16, v=60):
    labels = _sequences_with_prompts(v=v, seed=seed)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(labels.shape[0], h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.3
    return hidden, weight, labels


FUSED_OPS = {
    "linear_token_logprobs+entropy": lambda h, w, y: sum(
        o.sum() for o in lmloss.linear_token_logprobs(h, w, y, return_entropy=True, chunk_size=32)
    ),
    "linear_cross_entropy_mean": lambda h, w, y: lmloss.linear_cross_entropy(h, w, y, chunk_size=32, z_loss=1e-3),
    "linear_policy_loss_full_kl": lambda h, w, y: rl.linear_policy_loss(
        h, w, y, torch.full(y.shape, -3.0), torch.ones(y.shape), kl_loss_type="full", kl_loss_coef=0.1,
        ref_hidden=torch.ones_like(h), ref_weight=w.detach(), entropy_coeff=0.01, chunk_size=32,
    )[0],  # fmt: skip
    "linear_distillation_loss": lambda h, w, y: lmloss.linear_distillation_loss(
        h, w, torch.ones_like(h), w.detach().flip(0), y, beta=0.3, chunk_size=32
    ),
}


@pytest.mark.parametrize("budget", [None, 0.01], ids=["accumulator", "weight_pass"])
@pytest.mark.parametrize("op", list(FUSED_OPS))
def test_fused_ops_read_nothing_of_an_ignored_row_and_give_it_zero_gradient(op, budget):
    """A hidden row that does not count is never multiplied: NaN there leaves every gradient finite (a
    matmul over it would put NaN into the whole weight gradient), and its own gradient row is 0."""
    hidden, weight, labels = _fused_problem()
    ignored = labels == -100
    h, w = _poisoned(hidden, ignored), weight.clone().requires_grad_()
    loss = FUSED_OPS[op](h, w, labels) if budget is None else _with_budget(FUSED_OPS[op], budget)(h, w, labels)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(w.grad).all() and torch.isfinite(h.grad).all()
    assert torch.equal(h.grad[ignored], torch.zeros_like(h.grad[ignored]))
    h_clean, w_clean = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    FUSED_OPS[op](h_clean, w_clean, labels).backward()
    torch.testing.assert_close(w.grad, w_clean.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(h.grad, h_clean.grad, rtol=1e-5, atol=1e-7)


def _with_budget(fn, budget):
    def call(h, w, y):
        before = lmloss.chunks.DEFAULT_CHUNK_BUDGET_MIB["cpu"]
        lmloss.chunks.DEFAULT_CHUNK_BUDGET_MIB["cpu"] = budget
        try:
            return fn(h, w, y)
        finally:
            lmloss.chunks.DEFAULT_CHUNK_BUDGET_MIB["cpu"] = before

    return call


# ----------------------------------------------------------------------------------------------------------
# the counting tokens do not notice


def test_a_tokens_outputs_do_not_change_when_other_tokens_are_ignored():
    hidden, weight, labels = _fused_problem(seed=4)
    counting = labels != -100
    every = torch.where(counting, labels, 0)  # the same tokens with none ignored
    lp_all, ent_all = lmloss.linear_token_logprobs(hidden, weight, every, return_entropy=True)
    lp, ent = lmloss.linear_token_logprobs(hidden, weight, labels, return_entropy=True)
    torch.testing.assert_close(lp[counting], lp_all[counting], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent[counting], ent_all[counting], rtol=1e-6, atol=1e-6)
    assert torch.equal(lp[~counting], torch.zeros_like(lp[~counting]))
    assert torch.equal(ent[~counting], torch.zeros_like(ent[~counting]))


@pytest.mark.parametrize("kw", [{}, dict(top_p=0.8), dict(chunk_size=4)], ids=["plain", "top_p", "chunks"])
def test_an_ignored_row_in_a_gap_too_short_to_skip_reports_zero_logprob_entropy_and_gradient(kw):
    """Over logits the rows of a short gap are computed with their neighbours (a slice) and must be masked:
    their log-prob, entropy and gradient rows are exactly 0; the counting rows are the plain softmax's."""
    g = torch.Generator().manual_seed(7)
    n, v = 24, 9
    logits = (torch.randn(n, v, generator=g) * 2).requires_grad_()
    labels = logits.detach().argmax(-1)  # the top token: inside any kept set
    ignored = torch.zeros(n, dtype=torch.bool)
    ignored[[2, 3, 9, 15, 16, 17]] = True  # gaps of 1 to 3 rows between counting runs: far below MIN_GAP
    labels[ignored] = -100
    assert _spans(RowSelection.of(~ignored, row_width=v).chunks(n, gather=False)) == [(0, n)]
    lp, ent = lmloss.token_logprobs(logits, labels, return_entropy=True, **kw)
    w_lp, w_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    assert torch.equal(lp[ignored], torch.zeros(6)) and torch.equal(ent[ignored], torch.zeros(6))
    assert torch.equal(logits.grad[ignored], torch.zeros(6, v))
    # the counting rows: plain PyTorch over the (truncated) distribution
    x = logits.detach().double()[~ignored].requires_grad_()
    if "top_p" in kw:  # the smallest set of top tokens whose mass reaches top_p
        p_sorted, order = x.detach().softmax(-1).sort(-1, descending=True)
        drop_sorted = p_sorted.cumsum(-1) - p_sorted >= kw["top_p"]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x_eff = x.masked_fill(drop, -math.inf)
    else:
        x_eff = x
    ref_logp = x_eff.log_softmax(-1)
    ref_lp = ref_logp.gather(1, labels[~ignored, None])[:, 0]
    ref_ent = -(ref_logp.exp() * ref_logp.nan_to_num(neginf=0.0)).sum(-1)
    torch.testing.assert_close(lp[~ignored].double(), ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[~ignored].double(), ref_ent.detach(), rtol=1e-5, atol=1e-5)
    ((ref_lp * w_lp[~ignored].double()).sum() + (ref_ent * w_ent[~ignored].double()).sum()).backward()
    torch.testing.assert_close(logits.grad[~ignored].double(), x.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_invariant_bits_of_a_token_do_not_depend_on_which_others_are_ignored(fused):
    hidden, weight, labels = _fused_problem(seed=5, v=300)
    every = torch.where(labels != -100, labels, 0)
    g = torch.Generator().manual_seed(6)
    others = every.clone()
    others[torch.rand(labels.shape[0], generator=g) < 0.4] = -100  # another set of ignored tokens
    both = (labels != -100) & (others != -100)

    def run(y):
        kw = dict(return_entropy=True, invariant=True, chunk_size=64)
        if fused:
            return lmloss.linear_token_logprobs(hidden, weight, y, **kw)
        return lmloss.token_logprobs(hidden @ weight.T, y, **kw)

    for a, b, c in zip(run(labels), run(others), run(every)):
        assert torch.equal(a[both], b[both]) and torch.equal(a[both], c[both])


# ----------------------------------------------------------------------------------------------------------
# linear_policy_loss(mask=)


def test_linear_policy_loss_mask_skips_the_tokens_it_excludes_like_their_labels_would():
    """verl / TRL hold full labels beside a ``response_mask``: ``mask=`` combines with ``ignore_index`` (a
    token counts where both say so), and what it excludes takes no work and no gradient. The reference is
    the float64 objective written out: PPO's clipped term, token-mean over the counting tokens."""
    hidden, weight, labels = _fused_problem(seed=7)
    g = torch.Generator().manual_seed(8)
    full = torch.where(labels != -100, labels, torch.randint(0, 60, labels.shape, generator=g))
    mask = torch.rand(labels.shape[0], generator=g) < 0.7
    mask[labels == -100] = False  # the prompts
    old = -torch.rand(labels.shape[0], generator=g, dtype=torch.float64) - 3.0
    adv = torch.randn(labels.shape[0], generator=g, dtype=torch.float64)

    h, w = _poisoned(hidden.double(), ~mask), weight.double().requires_grad_()
    loss, _ = rl.linear_policy_loss(h, w, full, old, adv, mask=mask, clip_ratio=0.2, chunk_size=16)
    loss.backward()

    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp = F.log_softmax(hr @ wr.T, -1).gather(1, full[:, None])[:, 0]
    ratio = (lp - old).exp()
    term = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    ref = torch.where(mask, term, 0.0).sum() / mask.sum()
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h.grad[mask], hr.grad[mask], rtol=1e-10, atol=1e-12)
    assert torch.equal(h.grad[~mask], torch.zeros_like(h.grad[~mask]))

    # the same tokens excluded through the labels give the same loss
    as_labels, _ = rl.linear_policy_loss(hr.detach(), wr.detach(), torch.where(mask, full, -100), old, adv)
    torch.testing.assert_close(as_labels, loss.detach(), rtol=1e-12, atol=1e-14)


def test_linear_policy_loss_mask_of_another_shape_is_refused_naming_it():
    hidden, weight, labels = _fused_problem(seed=9)
    n = labels.shape[0]
    with pytest.raises(ValueError, match="mask"):
        rl.linear_policy_loss(hidden, weight, labels, torch.zeros(n), torch.zeros(n), mask=torch.ones(n - 1))


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_token_logprobs", "linear_policy_loss"])
def test_a_non_finite_hidden_row_that_does_not_count_reaches_no_gradient_when_compiled(op):
    # torch.compile walks every row and masks those that do not count; their hidden rows still reached the
    # weight gradient (d-logits 0 times an inf / NaN hidden row: NaN in every column), which eager never computes
    g = torch.Generator().manual_seed(7)
    hidden, weight = torch.randn(96, 16, generator=g), torch.randn(64, 16, generator=g) * 0.3
    labels = torch.randint(0, 64, (96,), generator=g)
    labels[10:30] = -100
    hidden[10:20], hidden[25] = float("nan"), float("inf")
    calls = {
        "linear_cross_entropy": lambda h, w: lmloss.linear_cross_entropy(h, w, labels, reduction="none"),
        "linear_token_logprobs": lambda h, w: lmloss.linear_token_logprobs(h, w, labels),
        "linear_policy_loss": lambda h, w: rl.linear_policy_loss(
            h, w, labels, -torch.ones(96), torch.linspace(-1, 1, 96)
        )[0],
    }
    results = []
    for fn in (calls[op], torch.compile(calls[op], backend="eager")):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fn(h, w)
        results.append((out, *torch.autograd.grad(out.sum(), [h, w])))
    for eager, compiled in zip(*results):
        assert torch.isfinite(compiled).all()
        torch.testing.assert_close(compiled, eager)
    assert not results[1][1][10:30].any()  # the hidden gradient's rows that do not count: exactly 0
