"""The memory budget, complete (issue #41): every op x option holds at most its budget beyond its inputs, their
gradients and O(tokens) vectors (live-tensor tracking, `lmloss.profiling.peak_memory`); a budget below the
smallest one a call can honour is refused naming ``memory_budget_mib`` and that smallest budget, which the call
then runs within; and the schedule's accounting (`lmloss.chunks.fused_schedule`) is pinned term by term.

Peaks are measured per pass: the forward alone (a per-token op makes no gradient there; a summed one makes its
gradients there, which are subtracted), then the backward less the gradients. A dropped term of the accounting
(the kept-set search's bins, a replayed support's accumulator, a softcap's slope, a reference head's chunk, ...)
sizes chunks for less than they hold, and the peak passes the budget by far more than the per-token slack.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import lmloss
from lmloss import rl
from lmloss.chunks import (
    MIN_CHUNK_ROWS,
    MIN_FLOOR_COLUMNS,
    FusedSchedule,
    MemoryBudgetError,
    fused_schedule,
)
from lmloss.profiling import peak_memory
from lmloss.sampling import KeptSetWarning

MiB = 2**20
N, H, V, K = 128, 32, 512, 12
#: O(N) vectors per token beyond the budget: outputs, log-sum-exps, coefficients, an RL objective's inputs
PER_TOKEN = 192
BUDGET = 0.15  # MiB: several chunks of every op here, below a bf16 head's fp32 accumulator (64 KiB) + chunks

pytestmark = pytest.mark.usefixtures("one_thread")


def _data(dtype):
    g = torch.Generator().manual_seed(41)
    d = dict(
        hidden=torch.randn(N, H, generator=g).to(dtype),
        weight=(torch.randn(V, H, generator=g) * H**-0.5).to(dtype),
        logits=(torch.randn(N, V, generator=g) * 2).to(dtype),
        teacher=torch.randn(N, V, generator=g).to(dtype),
        t_hidden=torch.randn(N, 32, generator=g).to(dtype),
        t_weight=(torch.randn(V, 32, generator=g) * 0.3).to(dtype),
        old=-torch.rand(N, generator=g) - 2.0,
        adv=torch.randn(N, generator=g),
        up=torch.randn(N, generator=g),
    )
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::7] = -100
    # the engine's kept ids: the label first, then K - 1 other distinct ids
    others = torch.stack([torch.randperm(V - 1, generator=g)[: K - 1] for _ in range(N)])
    lab = labels.clamp(min=0)[:, None]
    d.update(labels=labels, support=torch.cat([lab, (lab + 1 + others) % V], dim=1))
    return d


def _per_token(out, up):
    outs = out if isinstance(out, tuple) else (out,)
    return sum((o * up).sum() for o in outs if o.requires_grad)


#: op -> (the leaves differentiated, whether its gradient is made in the forward, options to test)
OPS = {
    "token_logprobs": (("logits",), False, ["plain", "temperature", "softcap", "entropy", "top_k", "top_p", "min_p",
                                            "top_p_kept_mass", "support", "invariant", "invariant_top_p"]),
    "token_entropy": (("logits",), False, ["plain", "softcap", "top_k", "top_p", "support", "invariant"]),
    "cross_entropy": (("logits",), True, ["plain", "softcap", "smoothing", "invariant"]),
    "linear_token_logprobs": (("hidden", "weight"), False, ["plain", "temperature", "softcap", "entropy", "top_k",
                                                            "top_p", "min_p", "support", "invariant"]),
    "linear_cross_entropy": (("hidden", "weight"), True, ["plain", "softcap", "smoothing", "none", "invariant"]),
    "linear_policy_loss": (("hidden", "weight"), True, ["plain", "softcap", "top_p", "full_kl", "full_kl_softcap",
                                                        "invariant"]),
    "distillation_loss": (("logits",), True, ["plain", "temperature"]),
    "linear_distillation_loss": (("hidden", "weight"), True, ["plain", "temperature", "softcap"]),
}  # fmt: skip
OPTIONS = {
    "plain": {}, "temperature": dict(temperature=0.7), "softcap": dict(softcap=5.0), "entropy": dict(return_entropy=True),
    "top_k": dict(top_k=20), "top_p": dict(top_p=0.8), "min_p": dict(min_p=0.05),
    "top_p_kept_mass": dict(top_p=0.8, top_k=50, return_log_kept_mass=True), "invariant": dict(invariant=True),
    "invariant_top_p": dict(invariant=True, top_p=0.8), "smoothing": dict(label_smoothing=0.1, z_loss=1e-3),
    "none": dict(reduction="none"),
}  # fmt: skip


def _call(op, option, d, leaves, budget):
    kw = dict(OPTIONS.get(option, {}), memory_budget_mib=budget)
    y, up = d["labels"], d["up"]
    if option == "support":
        kw["support"] = d["support"]
    if op == "token_logprobs":
        return _per_token(lmloss.token_logprobs(leaves["logits"], y, **kw), up)
    if op == "token_entropy":
        return _per_token(lmloss.token_entropy(leaves["logits"], **kw), up)
    if op == "cross_entropy":
        return lmloss.cross_entropy(leaves["logits"], y, **kw)
    if op == "linear_token_logprobs":
        return _per_token(lmloss.linear_token_logprobs(leaves["hidden"], leaves["weight"], y, **kw), up)
    if op == "linear_cross_entropy":
        loss = lmloss.linear_cross_entropy(leaves["hidden"], leaves["weight"], y, **kw)
        return loss if loss.dim() == 0 else (loss * up).sum()
    if op == "linear_policy_loss":
        if option.startswith("full_kl"):
            kw.update(kl_loss_type="full", kl_loss_coef=0.1, ref_hidden=d["t_hidden"], ref_weight=d["t_weight"])
            kw.update(softcap=5.0) if option.endswith("softcap") else None
        return rl.linear_policy_loss(leaves["hidden"], leaves["weight"], y, d["old"], d["adv"], entropy_coeff=0.01,
                                     **kw)[0]  # fmt: skip
    if op == "distillation_loss":
        return lmloss.distillation_loss(leaves["logits"], d["teacher"], y, **kw)
    return lmloss.linear_distillation_loss(leaves["hidden"], leaves["weight"], d["t_hidden"], d["t_weight"], y,
                                           beta=0.5, **kw)  # fmt: skip


def _floor(op, option, d, names) -> float:
    """The smallest budget the call honours, as its refusal names it."""
    leaves = {k: d[k].clone().requires_grad_() for k in names}
    with pytest.raises(MemoryBudgetError) as err:
        _call(op, option, d, leaves, 1e-6)
    return err.value.floor_mib


def _held(op, option, d, names, summed, budget):
    """(MiB held beyond inputs and gradients, the gradients) of the forward, then the backward, at `budget`."""
    leaves = {k: d[k].clone().requires_grad_() for k in names}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KeptSetWarning)
        if option == "invariant":  # the process's first invariant call probes the math library (its test
            # tensors once per dtype / shape / thread count, cached: docs/invariant.md), outside the op's budget
            _call(op, option, d, {k: d[k].clone().requires_grad_() for k in names}, budget).backward()
        with peak_memory() as fwd:
            loss = _call(op, option, d, leaves, budget)
        with peak_memory() as bwd:
            loss.backward()
    grads = sum(t.grad.numel() * t.grad.element_size() for t in leaves.values())
    held = max(fwd.peak_bytes - (grads if summed else 0), bwd.peak_bytes - grads)
    return held / MiB, [leaves[k].grad for k in names]


#: fp32 everywhere; bf16 where it changes what a chunk holds (a fused head's matmul output and fp32
#: accumulator, a low-precision chunk's softcap slope)
BF16 = {"linear_token_logprobs": ["plain", "softcap", "top_p", "support"], "linear_cross_entropy": ["plain", "none"],
        "linear_policy_loss": ["plain", "softcap", "full_kl"], "linear_distillation_loss": ["plain"],
        "token_entropy": ["softcap"]}  # fmt: skip
CASES = [(op, option, torch.float32) for op, (_, _, options) in OPS.items() for option in options]
CASES += [(op, option, torch.bfloat16) for op, options in BF16.items() for option in options]


@pytest.mark.parametrize(("op", "option", "dtype"), CASES, ids=[f"{o}-{p}-{str(t)[6:]}" for o, p, t in CASES])
def test_every_op_and_option_holds_at_most_its_budget(op, option, dtype):
    d = _data(dtype)
    names, summed, _ = OPS[op]
    floor = _floor(op, option, d, names)
    budget = max(BUDGET, floor)  # invariant mode's GEMM tile (about 2 MiB here) is its own floor
    held, grads = _held(op, option, d, names, summed, budget)
    assert held <= budget + PER_TOKEN * N / MiB, f"{held:.3f} MiB held, budget {budget:g} MiB"
    assert all(torch.isfinite(g.float()).all() for g in grads)


# ----------------------------------------------------------------------------------------------------------
# a budget the call cannot honour


def _issue_head(budget):
    """The issue's 256 x 64 x 2048 head: `linear_cross_entropy` and its backward."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(256, 64, generator=g).requires_grad_()
    w = (torch.randn(2048, 64, generator=g) / 8).requires_grad_()
    y = torch.randint(0, 2048, (256,), generator=g)
    lmloss.linear_cross_entropy(h, w, y, memory_budget_mib=budget).backward()


@pytest.mark.parametrize("budget", [1e-300, 1e-3, 0.05])
def test_a_budget_below_the_smallest_is_refused_at_once_naming_it_and_the_smallest_is_honoured(budget):
    # these ran for minutes (1e-300), 88 s (1e-3) or silently (0.05) in 1-row chunks
    with pytest.raises(MemoryBudgetError, match=r"^memory_budget_mib: a budget of .* below the smallest") as err:
        _issue_head(budget)
    floor = err.value.floor_mib
    assert floor > budget and f"memory_budget_mib={floor:g} or more" in str(err.value)
    # 8 rows of 2048 fp32 columns: a summed cross-entropy's chunk holds 4 bytes a logit
    assert floor == pytest.approx(MIN_CHUNK_ROWS * 2048 * 4 / MiB, abs=1e-3)
    _issue_head(floor)  # the named budget is enough


def test_every_op_refuses_a_budget_below_its_floor_and_runs_within_it():
    d = _data(torch.float32)
    for op, (names, summed, _) in OPS.items():
        floor = _floor(op, "plain", d, names)
        held, _ = _held(op, "plain", d, names, summed, floor)
        assert held <= floor + PER_TOKEN * N / MiB, (op, held, floor)


def test_the_refusal_reaches_verls_backend_option():
    import verl_support

    verl_support.load()  # (skips without verl)
    LV = verl_support.load_model_patch().integration
    opts = LV.backend_options("lmloss:memory_budget_mib=1e-300")
    g = torch.Generator().manual_seed(6)
    h, w = torch.randn(64, 16, generator=g), torch.randn(512, 16, generator=g)
    y = torch.randint(0, 512, (64,), generator=g)
    with pytest.raises(MemoryBudgetError, match="memory_budget_mib"):
        lmloss.linear_token_logprobs(h, w, y, **opts.op_kwargs())


# ----------------------------------------------------------------------------------------------------------
# the schedule's accounting, term by term

KW = dict(local_vocab=32000, hidden_width=256, device="cpu", gather_bytes_per_row=512, fixed_bytes=0,
          chunk_size="auto")  # fmt: skip


def _tile(s, n, bytes_per_logit, weight_tile=0, gather=512, h=256):
    """A weight-pass tile's bytes, written out: its logits and gathered rows, and its fp32 block accumulator
    (when the block takes its rows in chunks; else the fp32 tile of one GEMM)."""
    acc = s.weight_block * h * 4 if s.weight_block_rows < n else min(weight_tile, s.weight_block * h * 4)
    return s.weight_block_rows * (s.weight_block * bytes_per_logit + gather) + acc


@pytest.mark.parametrize("budget", [2.5, 3.3, 6.1, 12.7, 20.2, 28.9])
def test_every_weight_pass_tile_and_token_chunk_fits_the_budget(budget):
    """Blocks rounded down (not up) to 128 columns; under ~1 MiB the block accumulator takes half the budget,
    not all of it; the accumulated columns and the token pass's chunks beside them fit too."""
    acc = 32000 * 256 * 4
    for n, tile in ((4096, 0), (512, 1024 * 256 * 4), (100, 0)):
        s = fused_schedule(n_rows=n, budget_mib=budget, bytes_per_logit=10, accumulator_bytes=acc,
                           weight_tile_bytes=tile, **KW)  # fmt: skip
        row = 32000 * 10 + 512
        if s.weight_block:
            assert _tile(s, n, 10, tile) <= budget * MiB, (n, s)
            assert s.weight_block >= MIN_FLOOR_COLUMNS and s.weight_block_rows >= min(n, MIN_CHUNK_ROWS)
            assert s.weight_start % 128 == 0 and s.weight_start < 32000
        token = s.chunk_rows * row + (s.weight_start * 256 * 4 if s.weight_block else acc)
        if s.chunk_rows < n:
            assert token <= budget * MiB, (n, s)
        else:  # one chunk: no accumulator, the fp32 tile of the one GEMM beside it
            assert s.chunk_rows * row + tile <= budget * MiB, (n, s)


def test_under_a_mib_the_block_accumulator_takes_half_the_budget_and_the_tokens_the_rest():
    """A tight budget splits between the weight pass's fp32 block accumulator (its columns) and the tokens of a
    tile: half each, not the whole budget for the block (which left 1-token tiles)."""
    kw = dict(KW, local_vocab=4000)
    for budget in (0.35, 0.6, 0.9):
        s = fused_schedule(n_rows=4096, budget_mib=budget, bytes_per_logit=10, accumulator_bytes=4000 * 256 * 4, **kw)
        assert s.weight_block and s.weight_block_rows < 4096
        assert s.weight_block * 256 * 4 <= budget * MiB / 2 < (s.weight_block + 128) * 256 * 4 + 1, s
        assert _tile(s, 4096, 10) <= budget * MiB and s.weight_block_rows >= 64


def test_the_weight_pass_takes_only_the_columns_the_accumulator_cannot_hold():
    """A price in proportion: between the accumulator's budget and the weight pass's, the first columns keep
    their fp32 accumulator beside chunks of 64 tokens, as many as fit, and only the others take the weight pass."""
    acc = 32000 * 256 * 4  # 31.25 MiB
    row = 32000 * 6 + 512
    starts = []
    for budget in (48, 40, 28, 20, 16, 13):
        s = fused_schedule(n_rows=4096, budget_mib=budget, bytes_per_logit=6, accumulator_bytes=acc, **KW)
        if budget == 48:
            assert s.weight_block == 0  # the accumulator whole, beside chunks of 64 tokens or more
            continue
        assert s.chunk_rows == 64 and s.weight_block > 0
        want = int((budget * MiB - 64 * row) // (256 * 4))
        assert s.weight_start == want - want % 128  # rounded down: the accumulator and its chunks fit
        starts.append(s.weight_start)
    assert starts == sorted(starts, reverse=True) and starts[0] > 16000 and starts[-1] < 2048


def test_one_chunk_of_every_token_counts_its_weight_gradients_fp32_tile():
    # every token fits one chunk only without the fp32 tile of its one weight-gradient GEMM (0.5 MiB)
    n, row, tile = 60, 32000 * 10 + 512, 512 * 256 * 4
    budget = (n * row + tile / 2) / MiB
    acc = 32000 * 256 * 4
    s = fused_schedule(n_rows=n, budget_mib=budget, bytes_per_logit=10, accumulator_bytes=acc, weight_tile_bytes=tile,
                       **KW)  # fmt: skip
    assert s.weight_block > 0  # not one GEMM of every token (its tile would not fit): part of it the weight pass's
    s = fused_schedule(n_rows=n, budget_mib=budget + tile / MiB, bytes_per_logit=10, accumulator_bytes=acc,
                       weight_tile_bytes=tile, **KW)  # fmt: skip
    assert s == FusedSchedule(n)


def _replay_call(budget):
    g = torch.Generator().manual_seed(7)
    n, h, v, k = 512, 64, 2048, 16
    hidden = torch.randn(n, h, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, generator=g) / 8).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    support = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    support[:, 0] = y
    support = torch.where((support == y[:, None]) & (torch.arange(k) > 0), (y[:, None] + 1) % v, support)
    up = torch.randn(n, generator=g)
    with peak_memory() as fwd:
        lp = lmloss.linear_token_logprobs(hidden, weight, y, support=support, memory_budget_mib=budget)
    with peak_memory() as bwd:
        (lp * up).sum().backward()
    grads = hidden.grad.numel() * 2 + weight.grad.numel() * 2
    return max(fwd.peak_bytes, bwd.peak_bytes - grads) / MiB, hidden.grad, weight.grad


def test_a_replayed_support_counts_its_accumulators_and_never_takes_the_weight_pass():
    """A replayed support's weight gradient is a scatter into an fp32 [V, H] accumulator (0.5 MiB here) beside
    an fp32 [N, H] hidden-gradient sum: both counted (dropped, the chunks take their room and the op holds
    more); within a budget that the weight pass would take for other ops it keeps them (the weight pass's
    blocks are not slots: its backward raised AttributeError) and gives the default's gradients."""
    with pytest.raises(MemoryBudgetError) as err:
        _replay_call(0.1)
    floor = err.value.floor_mib
    assert floor >= (2048 * 64 * 4 + 512 * 64 * 4) / MiB  # the accumulators are the floor's
    for budget in (floor, floor + 0.3):
        held, gh, gw = _replay_call(budget)
        assert held <= budget + PER_TOKEN * 512 / MiB, (budget, held)
    _, want_h, want_w = _replay_call(None)
    torch.testing.assert_close(gh.float(), want_h.float(), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(gw.float(), want_w.float(), rtol=1e-2, atol=1e-3)


def test_a_fused_head_whose_every_token_counts_makes_no_copy_of_the_hidden_states():
    """Where every label counts, the hidden states go to the head as they are: a masked copy of them (made for
    torch.compile, which walks every row) would be ``[N, H]`` outside the budget (4 MiB at 4096 x 256)."""
    g = torch.Generator().manual_seed(3)
    n, h, v, budget = 512, 256, 2048, 0.5
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / 16).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)  # every token counts
    with peak_memory() as fwd:
        loss = lmloss.linear_cross_entropy(hidden, weight, labels, memory_budget_mib=budget)
    grads = (hidden.numel() + weight.numel()) * 4  # the summed loss's gradients, made in the forward
    assert (fwd.peak_bytes - grads) / MiB <= budget + PER_TOKEN * n / MiB, f"{(fwd.peak_bytes - grads) / MiB:.3f} MiB"
    loss.backward()
    want = torch.nn.functional.cross_entropy(hidden.detach() @ weight.detach().T, labels)
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-6)
