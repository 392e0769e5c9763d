"""CP-local loss, metrics and batch broadcast on 4 gloo ranks, against single-process references.

One run builds every layout from the same 4 ranks (CP=4, CP=2, TP2 x CP2, DP2 x CP2, and a
PP2 x TP2 broadcast) and returns what each rank computed; the tests below compare that with plain PyTorch
on the full batch. References never call lmloss's loss code.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks

from lmloss import cp
from lmloss.distributed import broadcast_batch, pipeline_stage_keys
from lmloss.logits import cross_entropy, token_logprobs
from lmloss.metrics import StatsTracker
from lmloss.packing import PackedBatch, pack

V = 12  # vocabulary; TP=2 gives 6 columns per rank
PAD = 8  # 2 * the largest CP size, so every layout below can split the same batch
WORLD = 4
STEPS = ("A", "B", "C")  # broadcast calls: the number of sequences changes, then only the values


def make_batch(which: str, pad: int = PAD) -> tuple[PackedBatch, torch.Tensor]:
    """Packed batch "A", "B" or "C" (B's shapes, other values) and fp32 logits [T, V].

    The logits of real positions do not depend on `pad`.
    """
    g = torch.Generator().manual_seed("ABC".index(which))
    lengths = [13, 8, 1, 22, 5] if which == "A" else [6, 17, 3, 9]
    seqs, masks, seq_logits = [], [], []
    for n in lengths:
        seqs.append(torch.randint(0, V, (n,), generator=g))
        m = torch.rand(n, generator=g) < 0.7
        m[0] = True  # a first token marked as target must not pull a label across the boundary
        masks.append(m)
        seq_logits.append(3 * torch.randn(n, V, generator=g))
    masks[1][:] = False  # a sequence with no target at all: ppl must skip it, not divide by zero
    batch = pack(seqs, masks, pad_to_multiple_of=pad)
    logits = torch.randn(batch.input_ids.numel(), V, generator=g)  # padding rows: arbitrary values
    for b, lg in enumerate(seq_logits):
        s = int(batch.cu_seqlens_padded[b])
        logits[s : s + lg.shape[0]] = lg
    return batch, logits


def record(tracker: StatsTracker, local: dict, logits: torch.Tensor, *, cp_group, num_sequences: int) -> None:
    """The metrics recipe a training loop runs on its CP-local tokens."""
    logprobs = token_logprobs(logits, local["labels"])
    tracker.denominator("n_tokens", local["token_mask"])
    tracker.denominator("n_valid_tokens", local["loss_mask"])
    tracker.stat("loss", -logprobs, denominator="n_valid_tokens")
    tracker.perplexity(
        "ppl",
        logprobs,
        mask=local["loss_mask"],
        sequence_ids=local["sequence_ids"],
        num_sequences=num_sequences,
        cp_group=cp_group,
        count_key="n_sequences",
    )


def cp_loss(batch: PackedBatch, logits: torch.Tensor, cp_group, *, mean_group, tp_group=None) -> dict:
    """CP-local (and optionally vocab-parallel) loss and its gradient on this rank's slice."""
    cp_size, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    local = cp.split_batch(batch, cp_size, cp_rank)
    x = cp.split(logits, batch.cu_seqlens_padded, cp_size, cp_rank)
    if tp_group is not None:
        tp_rank, tp_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
        cols = V // tp_size
        x = x[:, tp_rank * cols : (tp_rank + 1) * cols]
    x = x.clone().requires_grad_()
    loss = cross_entropy(x, local["labels"], chunk_size=7, tp_group=tp_group, mean_group=mean_group)
    loss.backward()
    logprobs, entropy = token_logprobs(x.detach(), local["labels"], tp_group=tp_group, return_entropy=True)
    return {
        "index": cp.partition_index(batch.cu_seqlens_padded, cp_size, cp_rank),
        "loss": loss.item(),
        "grad": x.grad,
        "gathered_grad": cp.gather(x.grad, batch.cu_seqlens_padded, cp_group),
        "logprobs": logprobs,
        "entropy": entropy,
    }


def cp_metrics(batch: PackedBatch, logits: torch.Tensor, cp_group, group, *, extra_group=None) -> dict:
    cp_size, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    local = cp.split_batch(batch, cp_size, cp_rank)
    x = cp.split(logits, batch.cu_seqlens_padded, cp_size, cp_rank)
    tracker = StatsTracker(group=group)
    record(tracker, local, x, cp_group=cp_group, num_sequences=batch.num_sequences)
    if extra_group is not None:  # the same perplexity averaged over another group that spans the sequences
        logprobs = token_logprobs(x, local["labels"])
        tracker.perplexity(
            "ppl_over_dp",
            logprobs,
            mask=local["loss_mask"],
            sequence_ids=local["sequence_ids"],
            num_sequences=batch.num_sequences,
            cp_group=cp_group,
            group=extra_group,
            count_key="n_sequences_over_dp",
        )
    tracker.scalar("max_seqlen", batch.max_seqlen, reduce="max")
    tracker.scalar("rank_min", float(dist.get_rank()), reduce="min")
    return tracker.export()


def broadcast_checks(rank: int) -> dict:
    """PP=2 x TP=2: stage 0 = ranks {0, 1}, stage 1 = ranks {2, 3}; each TP group's first rank reads data."""
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    stage_idx = rank // 2
    tp, src = tp_groups[stage_idx], 2 * stage_idx
    out = {}
    filled = None
    for step, which in enumerate(STEPS):  # cu_seqlens changes length from call to call
        batch = make_batch(which)[0].to_dict()
        for stage in ("first", "middle", "last", "only"):
            got = broadcast_batch(
                batch if rank == src else filled if stage == "only" else None,
                group=tp,
                src=src,
                keys=pipeline_stage_keys(stage),
            )
            if stage == "only" and rank != src:
                tensors = [k for k, v in got.items() if isinstance(v, torch.Tensor)]
                out[(step, "reused")] = sorted(
                    k for k in tensors if filled is not None and got[k] is filled.get(k)
                )
                filled = got
            out[(step, stage)] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in got.items()}
    mixed = {
        "h": torch.arange(12, dtype=torch.bfloat16).view(3, 4),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 5, dtype=torch.int64),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "temperature": 0.7,
        "use_cp": True,
    }
    out["mixed"] = broadcast_batch(mixed if rank == src else None, group=tp, src=src)
    try:
        broadcast_batch(
            {"labels": torch.zeros(3)} if rank == src else None, group=tp, src=src, keys=["cu_seqlens"]
        )
        out["missing_key_error"] = None
    except ValueError as e:
        out["missing_key_error"] = str(e)
    return out


def worker(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    world = dist.new_group(list(range(world_size)))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # CP=2 groups; also the DP2 x CP2 CP groups
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # TP2 x CP2 CP groups; DP2 x CP2 DP groups
    a, logits_a = make_batch("A")
    b, logits_b = make_batch("B")
    out: dict = {}

    out["cp4"] = cp_loss(a, logits_a, world, mean_group=world)
    out["cp4_metrics"] = cp_metrics(a, logits_a, world, world)

    pair = pairs[rank // 2]
    out["cp2"] = cp_loss(a, logits_a, pair, mean_group=pair)
    out["cp2_metrics"] = cp_metrics(a, logits_a, pair, pair)

    # TP2 x CP2: rank = 2 * cp_rank + tp_rank
    out["tp2cp2"] = cp_loss(a, logits_a, strided[rank % 2], mean_group=strided[rank % 2], tp_group=pair)

    # DP2 x CP2: DP replica rank // 2 holds batch A or B; CP group = its pair; the loss mean spans all 4
    mine = (a, logits_a) if rank // 2 == 0 else (b, logits_b)
    out["dp2cp2"] = cp_loss(*mine, pair, mean_group=world)
    out["dp2cp2_metrics"] = cp_metrics(*mine, pair, world, extra_group=strided[rank % 2])

    # gather's backward hands each rank its own slice of the gradient, not cp_size times it
    x = cp.split(logits_a, a.cu_seqlens_padded, 4, rank).clone().requires_grad_()
    w = torch.arange(logits_a.numel(), dtype=torch.float32).view_as(logits_a)
    (cp.gather(x, a.cu_seqlens_padded, world) * w).sum().backward()
    out["gather_grad"] = x.grad
    # with sum_grads each rank uses the gathered tensor with its own weights (as attention's queries read
    # every rank's keys): a position's gradient is the sum of every rank's
    x = cp.split(logits_a, a.cu_seqlens_padded, 4, rank).clone().requires_grad_()
    (cp.gather(x, a.cu_seqlens_padded, world, sum_grads=True) * (w * (rank + 1))).sum().backward()
    out["gather_sum_grad"] = x.grad
    out["gather_dim1"] = cp.gather(
        cp.split(logits_a.T.contiguous(), a.cu_seqlens_padded, 4, rank, dim=1, layout="contiguous"),
        a.cu_seqlens_padded,
        world,
        dim=1,
        layout="contiguous",
    )

    out["broadcast"] = broadcast_checks(rank)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(worker, WORLD)


# -- single-process references, plain PyTorch -----------------------------------------------------------
def reference_grad(
    logits: list[torch.Tensor], labels: list[torch.Tensor]
) -> tuple[float, list[torch.Tensor]]:
    """Mean cross-entropy over the valid tokens of all the batches together, and d loss / d logits."""
    leaves = [lg.clone().requires_grad_() for lg in logits]
    loss = F.cross_entropy(torch.cat(leaves), torch.cat(labels), ignore_index=-100)
    loss.backward()
    return loss.item(), [leaf.grad for leaf in leaves]


def reference_metrics(batches: list[tuple[PackedBatch, torch.Tensor]]) -> dict[str, float]:
    total_lp, n_valid, n_tokens, ppls = 0.0, 0, 0, []
    for batch, logits in batches:
        logp = torch.log_softmax(logits.double(), dim=-1)
        valid = batch.labels != -100
        lp = torch.where(valid, logp.gather(1, batch.labels.clamp(min=0)[:, None]).squeeze(1), 0.0)
        total_lp += lp.sum().item()
        n_valid += int(valid.sum())
        n_tokens += int(batch.cu_seqlens[-1])
        for s, e in zip(batch.cu_seqlens_padded[:-1].tolist(), batch.cu_seqlens_padded[1:].tolist()):
            if valid[s:e].any():
                ppls.append(math.exp(-lp[s:e].sum().item() / valid[s:e].sum().item()))
    return {
        "loss": -total_lp / n_valid,
        "n_tokens": n_tokens,
        "n_valid_tokens": n_valid,
        "ppl": sum(ppls) / len(ppls),
        "n_sequences": len(ppls),
    }


def assemble(rank_outs: list[dict], total: int, cols: slice | None = None, tp_of=None) -> torch.Tensor:
    """Put each rank's gradient rows (and TP columns) back into a full [T, V] tensor."""
    full = torch.full((total, V), float("nan"))
    for r, o in enumerate(rank_outs):
        c = slice(None) if tp_of is None else slice(tp_of(r) * (V // 2), (tp_of(r) + 1) * (V // 2))
        full[o["index"], c] = o["grad"]
    return full


@pytest.mark.parametrize("layout_key", ["cp4", "cp2"])
def test_cp_local_loss_and_gradient_equal_the_single_process_ones(results, layout_key):
    batch, logits = make_batch("A")
    ref_loss, (ref_grad,) = reference_grad([logits], [batch.labels])
    ranks = [r[layout_key] for r in results]
    groups = [ranks] if layout_key == "cp4" else [ranks[:2], ranks[2:]]
    for group in groups:  # loss shares sum to the global mean; the rows assemble the full gradient
        assert sum(o["loss"] for o in group) == pytest.approx(ref_loss, rel=1e-6)
        torch.testing.assert_close(assemble(group, logits.shape[0]), ref_grad, rtol=1e-5, atol=1e-7)
        for o in group:  # gather(grad) on every rank is the full gradient too
            torch.testing.assert_close(o["gathered_grad"], ref_grad, rtol=1e-5, atol=1e-7)


def test_tp2_cp2_loss_gradient_and_logprobs_equal_the_single_process_ones(results):
    batch, logits = make_batch("A")
    ref_loss, (ref_grad,) = reference_grad([logits], [batch.labels])
    outs = [r["tp2cp2"] for r in results]
    for tp_rank in (0, 1):  # ranks 2 * cp_rank + tp_rank form one CP group
        group = [outs[tp_rank], outs[2 + tp_rank]]
        assert sum(o["loss"] for o in group) == pytest.approx(ref_loss, rel=1e-6)
    torch.testing.assert_close(
        assemble(outs, logits.shape[0], tp_of=lambda r: r % 2), ref_grad, rtol=1e-5, atol=1e-7
    )
    logp = torch.log_softmax(logits, dim=-1)
    ref_lp = torch.where(
        batch.labels != -100, logp.gather(1, batch.labels.clamp(min=0)[:, None]).squeeze(1), 0.0
    )
    ref_ent = torch.where(batch.labels != -100, -(logp.exp() * logp).sum(-1), 0.0)  # ignored: 0
    for o in outs:
        torch.testing.assert_close(o["logprobs"], ref_lp[o["index"]], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o["entropy"], ref_ent[o["index"]], rtol=1e-5, atol=1e-6)


def test_dp2_cp2_loss_is_the_mean_over_both_replicas_and_gradients_match(results):
    (a, logits_a), (b, logits_b) = make_batch("A"), make_batch("B")
    ref_loss, (grad_a, grad_b) = reference_grad([logits_a, logits_b], [a.labels, b.labels])
    outs = [r["dp2cp2"] for r in results]
    assert sum(o["loss"] for o in outs) == pytest.approx(ref_loss, rel=1e-6)
    torch.testing.assert_close(assemble(outs[:2], logits_a.shape[0]), grad_a, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(assemble(outs[2:], logits_b.shape[0]), grad_b, rtol=1e-5, atol=1e-7)


def test_metrics_are_identical_for_cp_1_2_4_and_equal_the_reference(results):
    batch, logits = make_batch("A")
    ref = reference_metrics([(batch, logits)])
    # CP=1 in this process, from the same global batch packed without any padding
    unpadded, unpadded_logits = make_batch("A", pad=1)
    tracker = StatsTracker()
    record(tracker, cp.split_batch(unpadded, 1, 0), unpadded_logits, cp_group=None, num_sequences=5)
    cp1 = tracker.export()
    for key in ("loss", "ppl"):
        assert cp1[key] == pytest.approx(ref[key], rel=1e-6)
    counts = ("n_tokens", "n_valid_tokens", "n_sequences")
    assert [cp1[k] for k in counts] == [ref[k] for k in counts]
    for r in results:
        for layout in ("cp2_metrics", "cp4_metrics"):
            m = r[layout]
            assert [m[k] for k in counts] == [cp1[k] for k in counts]
            assert m["loss"] == pytest.approx(cp1["loss"], rel=1e-9)
            assert m["ppl"] == pytest.approx(cp1["ppl"], rel=1e-9)
            assert m["max_seqlen"] == 24.0


def test_dp2_cp2_metrics_span_both_replicas_and_count_each_sequence_once(results):
    ref = reference_metrics([make_batch("A"), make_batch("B")])
    exported = [r["dp2cp2_metrics"] for r in results]
    for m in exported:
        assert m == exported[0]  # every rank exports the same floats
        counts = ("n_tokens", "n_valid_tokens", "n_sequences")
        assert [m[k] for k in counts] == [ref[k] for k in counts]
        assert m["n_sequences_over_dp"] == ref["n_sequences"]
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert m["ppl"] == pytest.approx(ref["ppl"], rel=1e-6)
        # averaging over the DP group only (ranks with the same CP rank) gives the same perplexity
        assert m["ppl_over_dp"] == pytest.approx(m["ppl"], rel=1e-12)
        assert m["rank_min"] == 0.0


def test_gather_with_sum_grads_gives_each_rank_the_sum_over_ranks_of_its_positions(results):
    batch, logits = make_batch("A")
    w = torch.arange(logits.numel(), dtype=torch.float32).view_as(logits)
    every_rank = sum(w * (r + 1) for r in range(4))  # rank r weighted the gathered tensor by w * (r + 1)
    for rank, r in enumerate(results):
        torch.testing.assert_close(
            r["gather_sum_grad"], every_rank[cp.partition_index(batch.cu_seqlens_padded, 4, rank)]
        )


def test_gather_backward_returns_each_ranks_own_gradient_slice_unscaled(results):
    batch, logits = make_batch("A")
    w = torch.arange(logits.numel(), dtype=torch.float32).view_as(logits)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["gather_grad"], w[cp.partition_index(batch.cu_seqlens_padded, 4, rank)])
        torch.testing.assert_close(r["gather_dim1"], logits.T)


def test_every_stage_gets_both_boundaries_under_transformer_engines_names():
    boundaries = ["cu_seqlens", "cu_seqlens_padded", "max_seqlen"]  # real, padded (the layout), longest slot
    assert list(pipeline_stage_keys("middle")) == boundaries
    assert list(pipeline_stage_keys("first")) == ["input_ids", "position_ids", *boundaries]
    assert list(pipeline_stage_keys("last")) == ["labels", "loss_mask", *boundaries]
    assert set(pipeline_stage_keys("only")) == {
        "input_ids",
        "position_ids",
        "labels",
        "loss_mask",
        *boundaries,
    }


@pytest.mark.parametrize("stage", ["first", "middle", "last", "only"])
def test_broadcast_gives_every_tp_rank_of_every_stage_what_its_stage_needs(results, stage):
    for step, which in enumerate(STEPS):
        expected = make_batch(which)[0].to_dict()
        for rank, r in enumerate(results):
            got = r["broadcast"][(step, stage)]
            assert list(got) == list(pipeline_stage_keys(stage)), (rank, step)
            for k, v in got.items():
                if isinstance(expected[k], torch.Tensor):
                    assert v.dtype == expected[k].dtype, (rank, k)
                    assert torch.equal(v, expected[k]), (rank, k)
                else:
                    assert type(v) is int and v == expected[k], (rank, k)


def test_broadcast_fills_the_receivers_buffers_when_shapes_match(results):
    tensors = sorted(k for k in pipeline_stage_keys("only") if k != "max_seqlen")
    for rank in (1, 3):  # the receivers; step 1 changes every shape, step 2 (C after B) none
        assert results[rank]["broadcast"][(1, "reused")] == []
        assert results[rank]["broadcast"][(2, "reused")] == tensors


def test_broadcast_sends_any_dtype_shape_and_python_values_and_reports_missing_keys_everywhere(results):
    for r in results:
        m = r["broadcast"]["mixed"]
        assert m["h"].dtype == torch.bfloat16 and torch.equal(
            m["h"], torch.arange(12, dtype=torch.bfloat16).view(3, 4)
        )
        assert torch.equal(m["flags"], torch.tensor([True, False, True]))
        assert m["empty"].shape == (0, 5) and m["empty"].dtype == torch.int64
        assert m["scalar"].shape == () and m["scalar"].item() == 2.5
        assert m["temperature"] == 0.7 and m["use_cp"] is True
        assert "cu_seqlens" in r["broadcast"]["missing_key_error"]
