"""lmloss.rl under data, context and tensor parallelism: 4 gloo ranks, one run, float64.

One global batch of 8 packed sequences (64 tokens; lengths divisible by 4 for the zigzag CP=2 layout;
prompt groups that span DP ranks). Each configuration splits it and every rank returns its loss *share*,
the gradient of that share at its tokens (with their global positions) and its exported metrics; the
test process sums the shares and assembles the gradients, and compares them with the one-process loss of
the whole batch (pinned to verl's formulas in tests/test_rl.py) to 1e-12:

  dp2_mb2   DP=2 (groups {0,1} and {2,3}, the same work twice) x 2 micro-batches per rank: `token_weights`
            on each rank's whole sequences with ``group=dp``, then sliced into micro-batches;
  dp2_cp2   DP=2 ({0,2}, {1,3}) x CP=2 ({0,1}, {2,3}, zigzag): weights before `lmloss.cp.split`; gspo's
            per-sequence log-ratio sums all-reduced over CP;
  ddp       DP=2 with `DistributedDataParallel` (which *averages* gradients): each rank's share times
            ``dp_size`` gives the one-process gradient of a small model's weight;
  fused_tp2 `linear_policy_loss` with the vocabulary sharded over TP=2 ({0,1}, {2,3}), with and without
            sequence parallelism, against the one-process float64 loss on the materialized logits;
  is_cp2    sequence-level rollout IS weights (TIS, MIS; batch-normalized over the 4 ranks) and the rejection
            mask of sequence criteria on DP=2 x CP=2 pieces (`sequence_ids`, the CP group), against the
            one-process weights and mask;
  agree     `token_weights`, the IS weights and `rejection_mask` over 2-rank groups ({0,1}, {2,3}) whose
            ranks pass different modes / criteria / thresholds, a bad argument on one rank, different
            resolved horizons...: every rank raises the same error, and the group still works after it
            (the groups have a 60 s timeout: a rank left waiting fails).

The sequence objectives (gspo, geo_mean, vespo) all-reduce their per-sequence sums over CP; clip_cov /
kl_cov take `covariance_selection` made over the DP group on each rank's whole sequences, split like the
weights, and equal to the one-process selection.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

import lmloss
from lmloss.rl import policy_loss, token_weights

WORLD = 4
LENGTHS = [8, 4, 12, 8, 4, 8, 12, 8]  # rank 0 of a DP pair holds sequences 0-3 (32 tokens), rank 1 4-7
PROMPTS = torch.tensor([0, 1, 0, 2, 1, 3, 2, 3])  # groups 0, 1, 2 span both DP halves
HORIZON = 12
TOL = dict(rtol=1e-12, atol=1e-13)
AGG_MODES = lmloss.rl.LOSS_AGG_MODES
CASES = [("vanilla", agg) for agg in AGG_MODES] + [("gspo", "seq-mean-token-mean"), ("gspo", "token-mean")]
CASES += [("geo_mean", "seq-mean-token-mean"), ("vespo", "token-mean"), ("sapo", "seq-mean-token-sum-norm"),
          ("clip_cov", "seq-mean-token-mean"), ("kl_cov", "token-mean")]  # fmt: skip
CASES_AGG = {"clip_cov": "seq-mean-token-mean", "kl_cov": "token-mean"}
SELECTION = dict(
    clip_ratio_high=0.28, clip_cov_ratio=0.1, clip_cov_lb=0.05, clip_cov_ub=5.0, kl_cov_ratio=0.1
)
METRIC_KEYS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "ratio_mean", "ratio_max", "ratio_min", "entropy",
               "pg_loss", "kl_loss", "entropy_loss", "policy_tokens")  # fmt: skip
V, H = 10, 3  # the DDP model and the fused head


def _batch():
    g = torch.Generator().manual_seed(0)
    n = sum(LENGTHS)
    d = dict(
        lp=-torch.rand(n, generator=g, dtype=torch.float64) * 3,
        adv=torch.randn(n, generator=g, dtype=torch.float64),
        ent=torch.rand(n, generator=g, dtype=torch.float64),
        mask=torch.rand(n, generator=g) > 0.25,
        feats=torch.randn(n, H, generator=g, dtype=torch.float64),
        labels=torch.randint(0, V, (n,), generator=g),
        weight=torch.randn(V, H, generator=g, dtype=torch.float64),
    )
    d["old"] = d["lp"] + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
    d["ref"] = d["lp"] + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    d["rollout"] = d["old"] + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
    d["shift"] = torch.arange(n).div(8, rounding_mode="floor").remainder(3).double() * 0.1  # per 8 tokens
    d["mask"][8:12] = False  # sequence 1 has no valid token
    d["cu"] = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return d


def _options(mode, agg):
    return dict(loss_mode=mode, clip_ratio_c=3.0 if mode == "vanilla" else None, ref_logprobs=None,
                kl_loss_type="k3", kl_loss_coef=0.1, entropy_coeff=0.01, **SELECTION)  # fmt: skip


def _selection(d, pos, mode, group):
    """`covariance_selection` of the tokens at `pos` (a DP rank's whole sequences) over `group`, or None."""
    if mode not in ("clip_cov", "kl_cov"):
        return None
    return lmloss.rl.covariance_selection(
        d["lp"][pos], d["old"][pos], d["adv"][pos], d["mask"][pos], loss_mode=mode, group=group,
        generator=torch.Generator().manual_seed(0), **SELECTION,
    )  # fmt: skip


def _sequences(d, seqs):
    """Positions, boundaries and prompt ids of sequences `seqs` (a contiguous range) of the batch."""
    cu = d["cu"]
    pos = torch.arange(int(cu[seqs[0]]), int(cu[seqs[-1] + 1]))
    local_cu = cu[seqs[0] : seqs[-1] + 2] - cu[seqs[0]]
    return pos, local_cu, PROMPTS[seqs[0] : seqs[-1] + 1]


def _share(d, pos, w, mode, agg, *, cu=None, sequence_ids=None, cp_group=None, tracker=None, sel=None):
    """Loss share of the tokens at `pos` with weights `w`, and its gradients w.r.t. lp and entropy there."""
    lp = d["lp"][pos].clone().requires_grad_(True)
    ent = d["ent"][pos].clone().requires_grad_(True)
    opts = _options(mode, agg)
    opts["ref_logprobs"] = d["ref"][pos]
    loss, _ = policy_loss(
        lp, d["old"][pos], d["adv"][pos], d["mask"][pos], token_weights=w, cu_seqlens=cu, sequence_ids=sequence_ids,
        cp_group=cp_group, entropy=ent, tracker=tracker, cov_selection=sel, **opts,
    )  # fmt: skip
    g_lp, g_ent = torch.autograd.grad(loss, [lp, ent])
    return loss.detach(), pos, g_lp, g_ent


def _dp_microbatches(d, dp_rank, dp, world_group, mode, agg):
    seqs = list(range(4 * dp_rank, 4 * dp_rank + 4))
    pos, cu, prompts = _sequences(d, seqs)
    extra = dict(prompt_ids=prompts) if agg == "prompt-mean-token-mean" else {}
    w = token_weights(
        d["mask"][pos], agg, cu_seqlens=cu, group=dp, horizon=HORIZON, dtype=torch.float64, **extra
    )
    sel = _selection(d, pos, mode, dp)
    tracker = lmloss.StatsTracker(group=world_group)
    parts = []
    for mb in (seqs[:2], seqs[2:]):
        mb_pos, mb_cu, _ = _sequences(d, mb)
        sl = slice(int(mb_pos[0] - pos[0]), int(mb_pos[-1] - pos[0]) + 1)
        mb_sel = None if sel is None else sel[sl]
        parts.append(_share(d, mb_pos, w[sl], mode, agg, cu=mb_cu, tracker=tracker, sel=mb_sel))
    return parts, tracker.export(), (pos, sel)


def _uneven_selection(d, dp_rank, dp):
    """kl_cov's selection over a DP pair whose ranks hold sequences 0-5 and 6-7: rank 0 has more valid tokens
    than rank 1 (the global indices of the merged top-k must still be told apart)."""
    pos, _, _ = _sequences(d, list(range(6)) if dp_rank == 0 else [6, 7])
    return pos, _selection(d, pos, "kl_cov", dp)


def _dp_cp(d, dp_rank, cp_rank, dp, cp, world_group, mode, agg):
    seqs = list(range(4 * dp_rank, 4 * dp_rank + 4))
    pos, cu, prompts = _sequences(d, seqs)
    extra = dict(prompt_ids=prompts) if agg == "prompt-mean-token-mean" else {}
    w = token_weights(
        d["mask"][pos], agg, cu_seqlens=cu, group=dp, horizon=HORIZON, dtype=torch.float64, **extra
    )
    sel = _selection(d, pos, mode, dp)
    local_pos = lmloss.cp.split(pos, cu, 2, cp_rank)
    local_w = lmloss.cp.split(w, cu, 2, cp_rank)
    local_sel = None if sel is None else lmloss.cp.split(sel, cu, 2, cp_rank)
    seq_ids = lmloss.cp.split(lmloss.packing.sequence_ids(cu), cu, 2, cp_rank)
    tracker = lmloss.StatsTracker(group=world_group)
    part = _share(d, local_pos, local_w, mode, agg, cu=cu, sequence_ids=seq_ids, cp_group=cp, tracker=tracker,
                  sel=local_sel)  # fmt: skip
    return [part], tracker.export(), (pos, sel)


RS = dict(rollout_rs="seq_mean_k2,seq_max_k3,seq_sum_k1", rollout_rs_threshold="0.0008,0.004,0.9_1.1")


def _is_weights_cp(d, dp_rank, cp_rank, cp, world):
    """Sequence-level TIS / MIS weights of this DP x CP piece (old vs a rollout near it), batch-normalized
    weights over the world (the DP x CP ranks), and the rejection mask of sequence criteria over CP."""
    pos, cu, _ = _sequences(d, list(range(4 * dp_rank, 4 * dp_rank + 4)))
    local = lmloss.cp.split(pos, cu, 2, cp_rank)
    seq_ids = lmloss.cp.split(lmloss.packing.sequence_ids(cu), cu, 2, cp_rank)
    args = (d["old"][local], d["rollout"][local], d["mask"][local])
    kw = dict(level="sequence", sequence_ids=seq_ids, cu_seqlens=cu, cp_group=cp)
    return (
        local,
        lmloss.rl.truncated_is_weights(*args, cap=1.05, **kw),
        lmloss.rl.masked_is_weights(*args, lower=0.9, upper=1.05, **kw),
        lmloss.rl.truncated_is_weights(*args, cap=1.05, batch_normalize=True, group=world, **kw),
        lmloss.rl.masked_is_weights(*args, lower=0.95, upper=1.05, batch_normalize=True, group=world),
        lmloss.rl.rejection_mask(*args, sequence_ids=seq_ids, cu_seqlens=cu, cp_group=cp, **RS),
    )


def _trl_masks(d, dp_rank, cp_rank, dp, cp):
    """TRL's masks: the high-entropy mask over the DP group (each rank's whole sequences), and the
    off-policy sequence mask on this DP x CP piece (its sequences' sums all-reduced over CP)."""
    pos, cu, _ = _sequences(d, list(range(4 * dp_rank, 4 * dp_rank + 4)))
    entropy = lmloss.rl.high_entropy_mask(d["ent"][pos], d["mask"][pos], 0.3, group=dp)
    local = lmloss.cp.split(pos, cu, 2, cp_rank)
    seq_ids = lmloss.cp.split(lmloss.packing.sequence_ids(cu), cu, 2, cp_rank)
    off = lmloss.rl.off_policy_sequence_mask(d["lp"][local], d["rollout"][local] + d["shift"][local], d["adv"][local],
                                             d["mask"][local], threshold=0.05, sequence_ids=seq_ids, cu_seqlens=cu,
                                             cp_group=cp)  # fmt: skip
    return pos, entropy, local, off


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 - the type and message are what the test compares
        return type(e).__name__, str(e), isinstance(e, ValueError), isinstance(e, TypeError)


def _agreement(r, group):
    """`token_weights`, the rollout IS weights and `rejection_mask` over a 2-rank group; r is this rank's index
    in it. 9 valid tokens per rank."""
    rows = torch.ones(1, 9, dtype=torch.bool)
    flat, cu = torch.ones(9, dtype=torch.bool), torch.tensor([0, 4, 9])
    z = torch.zeros(1, 9, dtype=torch.float64)

    def tw(*a, **k):
        return token_weights(*a, group=group, dtype=torch.float64, **k)

    scenarios = {
        "agree": lambda: tw(rows, "token-mean"),
        "modes": lambda: tw(rows, ["token-mean", "seq-mean-token-mean"][r]),
        "token_sum_on_one_rank": lambda: tw(rows, ["token-sum", "token-mean"][r]),
        "horizon_inf": lambda: tw(rows, "seq-mean-token-sum-norm", horizon=[12, float("inf")][r]),
        "horizon_nan": lambda: tw(rows, "seq-mean-token-sum-norm", horizon=[float("nan"), 12][r]),
        "float_prompt_ids": lambda: tw(
            flat,
            "prompt-mean-token-mean",
            cu_seqlens=cu,
            prompt_ids=[torch.tensor([0.0, 1.0]), torch.tensor([0, 1])][r],
        ),  # fmt: skip
        "resolved_horizon": lambda: tw(torch.ones(1, [9, 7][r], dtype=torch.bool), "seq-mean-token-sum-norm"),
        "unused_cu_seqlens": lambda: tw(flat, "token-mean", cu_seqlens=[cu, torch.tensor([0, 4, 8])][r]),
        "is_level": lambda: lmloss.rl.truncated_is_weights(z, z, rows, level=["token", "sequence"][r], cp_group=group),
        "is_bad_cap_on_one_rank": lambda: lmloss.rl.truncated_is_weights(z, z, rows, cap=[2.0, -1.0][r],
                                                                         level="sequence", cp_group=group),
        "is_normalize_on_one_rank": lambda: lmloss.rl.masked_is_weights(z, z, rows, batch_normalize=[True, False][r],
                                                                        group=group),
        "rs_criteria": lambda: lmloss.rl.rejection_mask(z, z, rows, rollout_rs=["seq_max_k2", "token_k2"][r],
                                                        rollout_rs_threshold=0.1, cp_group=group),
        "rs_threshold": lambda: lmloss.rl.rejection_mask(z, z, rows, rollout_rs="seq_sum_k1",
                                                         rollout_rs_threshold=["0.5_2", 3][r], cp_group=group),
        "rs_bad_on_one_rank": lambda: lmloss.rl.rejection_mask(z, z, rows, rollout_rs=["seq_max_k2", "seq_max_k1"][r],
                                                               rollout_rs_threshold=0.1, cp_group=group),
        "off_policy_threshold": lambda: lmloss.rl.off_policy_sequence_mask(z, z, z, rows, threshold=[0.1, 0.2][r],
                                                                           cp_group=group),
        "after_the_errors": lambda: tw(rows, "seq-mean-token-sum-norm", horizon=3),
    }
    return {name: _outcome(fn) for name, fn in scenarios.items()}


def _ddp(d, dp_rank, dp):
    """Each DP rank's share times dp_size through DDP (gradient averaging) = the one-process gradient."""
    model = torch.nn.Linear(H, V, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(d["weight"])
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=dp)
    seqs = list(range(4 * dp_rank, 4 * dp_rank + 4))
    pos, cu, _ = _sequences(d, seqs)
    w = token_weights(d["mask"][pos], "seq-mean-token-mean", cu_seqlens=cu, group=dp, dtype=torch.float64)
    for i, mb in enumerate((seqs[:2], seqs[2:])):
        mb_pos, mb_cu, _ = _sequences(d, mb)
        sl = slice(int(mb_pos[0] - pos[0]), int(mb_pos[-1] - pos[0]) + 1)
        lp = torch.log_softmax(ddp(d["feats"][mb_pos]), -1).gather(1, d["labels"][mb_pos, None])[:, 0]
        loss, _ = policy_loss(lp, d["old"][mb_pos], d["adv"][mb_pos], d["mask"][mb_pos], token_weights=w[sl])
        loss = loss * dist.get_world_size(dp)  # DDP averages over dp_size ranks: undo it
        if i == 0:
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()
    return model.weight.grad


def _fused_tp(d, tp_rank, tp, sp):
    """linear_policy_loss with the head's vocabulary (10 columns) split 5 + 5 over `tp`."""
    n = 32
    hidden = d["feats"][:n].clone()
    labels = d["labels"][:n].clone()
    labels[~d["mask"][:n]] = -100
    h = (hidden[tp_rank * n // 2 : (tp_rank + 1) * n // 2] if sp else hidden).clone().requires_grad_(True)
    w = d["weight"][tp_rank * 5 : tp_rank * 5 + 5].clone().requires_grad_(True)
    out = {}
    for mode in ("vanilla", "gspo"):
        loss, _ = lmloss.rl.linear_policy_loss(
            h, w, labels, d["old"][:n], d["adv"][:n], loss_mode=mode, clip_ratio_c=3.0 if mode == "vanilla" else None,
            ref_logprobs=d["ref"][:n], kl_loss_type="k3", kl_loss_coef=0.1, entropy_coeff=0.01, temperature=0.7,
            cu_seqlens=d["cu"][:5], tp_group=tp, sequence_parallel=sp, chunk_size=8,
        )  # fmt: skip
        gh, gw = torch.autograd.grad(loss, [h, w])
        out[mode] = (loss.detach(), gh, gw)
    return out


def worker(rank: int, world_size: int) -> dict:
    world = dist.new_group(list(range(world_size)))
    pairs = [
        dist.new_group([0, 1]),
        dist.new_group([2, 3]),
    ]  # dp2_mb2 DP groups; dp2_cp2 CP groups; TP groups
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # dp2_cp2 DP groups
    timeout = datetime.timedelta(seconds=60)  # a rank left waiting in a collective fails instead of hanging
    agree_pairs = [dist.new_group([0, 1], timeout=timeout), dist.new_group([2, 3], timeout=timeout)]
    pair = pairs[rank // 2]
    d = _batch()
    out = {"dp2_mb2": {}, "dp2_cp2": {}}
    for mode, agg in CASES:
        out["dp2_mb2"][mode, agg] = _dp_microbatches(d, rank % 2, pair, pair, mode, agg)
        out["dp2_cp2"][mode, agg] = _dp_cp(d, rank // 2, rank % 2, strided[rank % 2], pair, world, mode, agg)
    out["kl_cov_uneven"] = _uneven_selection(d, rank % 2, pair)
    out["ddp"] = _ddp(d, rank % 2, pair)
    out["fused_tp2"] = {sp: _fused_tp(d, rank % 2, pair, sp) for sp in (False, True)}
    out["is_cp2"] = _is_weights_cp(d, rank // 2, rank % 2, pair, world)
    out["trl_masks"] = _trl_masks(d, rank // 2, rank % 2, strided[rank % 2], pair)
    out["agree"] = _agreement(rank % 2, agree_pairs[rank // 2])
    dist.barrier(group=world)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(worker, WORLD)


def _one_process(d, mode, agg, *, tracker=None):
    lp, ent = d["lp"].clone().requires_grad_(True), d["ent"].clone().requires_grad_(True)
    opts = _options(mode, agg)
    opts["ref_logprobs"] = d["ref"]
    w = token_weights(d["mask"], agg, cu_seqlens=d["cu"], horizon=HORIZON, dtype=torch.float64,
                      **({"prompt_ids": PROMPTS} if agg == "prompt-mean-token-mean" else {}))  # fmt: skip
    sel = _selection(d, torch.arange(d["lp"].numel()), mode, None)
    loss, _ = policy_loss(lp, d["old"], d["adv"], d["mask"], token_weights=w, cu_seqlens=d["cu"], entropy=ent,
                          tracker=tracker, cov_selection=sel, **opts)  # fmt: skip
    g_lp, g_ent = torch.autograd.grad(loss, [lp, ent])
    return loss.detach(), g_lp, g_ent


def _check_split(parts_by_rank, d, mode, agg):
    total = torch.zeros((), dtype=torch.float64)
    g_lp, g_ent = torch.zeros_like(d["lp"]), torch.zeros_like(d["ent"])
    for parts in parts_by_rank:
        for loss, pos, gl, ge in parts:
            total += loss
            g_lp[pos] += gl
            g_ent[pos] += ge
    want, want_lp, want_ent = _one_process(d, mode, agg)
    torch.testing.assert_close(total, want, **TOL)
    torch.testing.assert_close(g_lp, want_lp, **TOL)
    torch.testing.assert_close(g_ent, want_ent, **TOL)


@pytest.mark.parametrize("mode,agg", CASES)
def test_dp2_times_two_microbatches_sum_to_the_one_process_loss_and_gradients(results, mode, agg):
    d = _batch()
    _check_split([results[r]["dp2_mb2"][mode, agg][0] for r in (0, 1)], d, mode, agg)


@pytest.mark.parametrize("mode,agg", CASES)
def test_dp2_times_cp2_zigzag_sum_to_the_one_process_loss_and_gradients(results, mode, agg):
    d = _batch()
    _check_split([results[r]["dp2_cp2"][mode, agg][0] for r in range(WORLD)], d, mode, agg)


@pytest.mark.parametrize("config", ["dp2_mb2", "dp2_cp2"])
def test_metrics_exported_from_any_split_equal_the_one_process_metrics(results, config):
    d = _batch()
    for mode, agg in CASES:
        tracker = lmloss.StatsTracker()
        _one_process(d, mode, agg, tracker=tracker)
        want = tracker.export()
        for r in range(WORLD if config == "dp2_cp2" else 2):
            got = results[r][config][mode, agg][1]
            for k in METRIC_KEYS:
                assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-14), (config, mode, agg, k)


def test_ddp_averaging_times_dp_size_gives_the_one_process_gradient(results):
    d = _batch()
    w = d["weight"].clone().requires_grad_(True)
    lp = torch.log_softmax(d["feats"] @ w.T, -1).gather(1, d["labels"][:, None])[:, 0]
    tw = token_weights(d["mask"], "seq-mean-token-mean", cu_seqlens=d["cu"], dtype=torch.float64)
    loss, _ = policy_loss(lp, d["old"], d["adv"], d["mask"], token_weights=tw)
    (want,) = torch.autograd.grad(loss, [w])
    for r in range(WORLD):
        torch.testing.assert_close(results[r]["ddp"], want, **TOL)


@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sequence_parallel"])
@pytest.mark.parametrize("mode", ["vanilla", "gspo"])
def test_fused_policy_loss_over_tp2_equals_the_float64_reference(results, sp, mode):
    d = _batch()
    n = 32
    hidden = d["feats"][:n].clone().requires_grad_(True)
    weight = d["weight"].clone().requires_grad_(True)
    mask = d["mask"][:n]
    logp = torch.log_softmax((hidden @ weight.T) / 0.7, -1)
    lp = logp.gather(1, d["labels"][:n, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    want, _ = policy_loss(
        lp, d["old"][:n], d["adv"][:n], mask, loss_mode=mode, clip_ratio_c=3.0 if mode == "vanilla" else None,
        ref_logprobs=d["ref"][:n], kl_loss_type="k3", kl_loss_coef=0.1, entropy=ent, entropy_coeff=0.01,
        cu_seqlens=d["cu"][:5],
    )  # fmt: skip
    want_h, want_w = torch.autograd.grad(want, [hidden, weight])
    for r in range(WORLD):
        loss, gh, gw = results[r]["fused_tp2"][sp][mode]
        tp_rank = r % 2
        torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
        rows = slice(tp_rank * n // 2, (tp_rank + 1) * n // 2) if sp else slice(None)
        torch.testing.assert_close(gh, want_h[rows], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(gw, want_w[tp_rank * 5 : tp_rank * 5 + 5], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("config", ["dp2_mb2", "dp2_cp2"])
@pytest.mark.parametrize("mode", ["clip_cov", "kl_cov"])
def test_covariance_selection_over_the_dp_group_is_the_one_process_selection(results, config, mode):
    d = _batch()
    want = _selection(d, torch.arange(d["lp"].numel()), mode, None)
    got = torch.zeros_like(want)
    for r in range(WORLD):
        pos, sel = results[r][config][mode, CASES_AGG[mode]][2]
        got[pos] = sel
    assert torch.equal(got, want)
    assert 1 < want.sum() < d["mask"].sum()  # several tokens from both DP halves, not all
    assert want[:32].any() and want[32:].any()


def test_covariance_selection_over_dp_ranks_holding_different_token_counts_is_the_one_process_selection(results):
    d = _batch()
    want = _selection(d, torch.arange(d["lp"].numel()), "kl_cov", None)
    got = torch.zeros_like(want)
    counts = []
    for r in range(WORLD):
        pos, sel = results[r]["kl_cov_uneven"]
        got[pos] = sel
        counts.append(int(d["mask"][pos].sum()))
    assert torch.equal(got, want)
    assert counts[0] > counts[1]  # rank 0 of each pair holds more valid tokens


def test_sequence_level_is_weights_under_cp_equal_the_one_process_weights(results):
    d = _batch()
    kw = dict(level="sequence", cu_seqlens=d["cu"])
    args = (d["old"], d["rollout"], d["mask"])
    want = [
        lmloss.rl.truncated_is_weights(*args, cap=1.05, **kw),
        lmloss.rl.masked_is_weights(*args, lower=0.9, upper=1.05, **kw),
        lmloss.rl.truncated_is_weights(*args, cap=1.05, batch_normalize=True, **kw),
        lmloss.rl.masked_is_weights(*args, lower=0.95, upper=1.05, batch_normalize=True),
        lmloss.rl.rejection_mask(*args, cu_seqlens=d["cu"], **RS),
    ]
    got = [torch.zeros_like(w) for w in want]
    for r in range(WORLD):
        pos, *parts = results[r]["is_cp2"]
        for g, p in zip(got, parts):
            g[pos] = p
    for g, w in zip(got[:4], want[:4]):
        torch.testing.assert_close(g, w, **TOL)
    assert torch.equal(got[4], want[4])
    tis, mis, tis_normalized, mis_normalized, kept = want
    valid = d["mask"]
    assert (tis[valid] == 1.05).any() and (tis[valid] < 1.05).any()
    assert (mis[valid] == 0).any() and (mis[valid] > 0).any()
    for normalized in (tis_normalized, mis_normalized):  # mean 1 over sequences / over valid tokens
        assert not torch.allclose(normalized[valid], (tis if normalized is tis_normalized else mis)[valid])
    seq = lmloss.packing.sequence_ids(d["cu"])
    seq_means = [tis_normalized[valid & (seq == s)].mean() for s in range(len(LENGTHS)) if (valid & (seq == s)).any()]
    one = torch.ones((), dtype=torch.float64)  # up to verl's 1e-8 in each sequence's token count
    torch.testing.assert_close(torch.stack(seq_means).mean(), one, rtol=1e-8, atol=0.0)
    torch.testing.assert_close(mis_normalized[valid].mean(), torch.ones((), dtype=torch.float64), **TOL)
    assert kept[valid].any() and not kept[valid].all()  # the criteria reject some sequences, not all


AGREE_ERRORS = {
    "modes": "disagree on mode",
    "token_sum_on_one_rank": "disagree on mode",
    "horizon_inf": "horizon must be a finite number > 0, got inf",
    "horizon_nan": "horizon must be a finite number > 0, got nan",
    "float_prompt_ids": "prompt_ids must be an integer tensor",
    "resolved_horizon": "disagree on horizon",
    "unused_cu_seqlens": "cu_seqlens covers 8 tokens but there are 9",
    "is_level": "disagree on level",
    "is_bad_cap_on_one_rank": "cap must be a positive number, got -1.0",
    "is_normalize_on_one_rank": "disagree on batch_normalize",
    "rs_criteria": "disagree on rollout_rs",
    "rs_threshold": "disagree on rollout_rs_threshold",
    "rs_bad_on_one_rank": "unknown criterion 'seq_max_k1'",
    "off_policy_threshold": "disagree on threshold",
}


@pytest.mark.parametrize("scenario", list(AGREE_ERRORS))
def test_ranks_raise_the_same_error_when_they_disagree(results, scenario):
    for pair in ((0, 1), (2, 3)):
        outcomes = [results[r]["agree"][scenario] for r in pair]
        assert outcomes[0] == outcomes[1], outcomes  # the same error on both ranks (none waits)
        kind, message, is_value_error, is_type_error = outcomes[0]
        assert kind.startswith("RankAgreement") and is_value_error, outcomes[0]
        assert AGREE_ERRORS[scenario] in message, message
        assert is_type_error == (scenario == "float_prompt_ids")


def test_token_weights_over_a_group_that_agrees(results):
    for r in range(WORLD):
        outcomes = results[r]["agree"]
        status, w = outcomes["agree"]
        assert status == "ok"
        torch.testing.assert_close(
            w, torch.full((1, 9), 1 / 18, dtype=torch.float64), **TOL
        )  # 18 global tokens
        status, w = outcomes["after_the_errors"]  # the group is still in step after the errors
        assert status == "ok"
        torch.testing.assert_close(w, torch.full((1, 9), 1 / (2 * 3), dtype=torch.float64), **TOL)  # S = 2


def test_trl_masks_over_dp_and_cp_equal_the_one_process_masks(results):
    d = _batch()
    entropy = lmloss.rl.high_entropy_mask(d["ent"], d["mask"], 0.3)
    off = lmloss.rl.off_policy_sequence_mask(d["lp"], d["rollout"] + d["shift"], d["adv"], d["mask"], threshold=0.05,
                                             cu_seqlens=d["cu"])  # fmt: skip
    got_entropy, got_off = torch.zeros_like(entropy), torch.zeros_like(off)
    for r in range(WORLD):
        pos, e, local, o = results[r]["trl_masks"]
        got_entropy[pos], got_off[local] = e, o
    assert torch.equal(got_entropy, entropy) and torch.equal(got_off, off)
    for m in (entropy, off):  # each keeps some valid tokens and drops others
        assert m[d["mask"]].any() and not m[d["mask"]].all()
