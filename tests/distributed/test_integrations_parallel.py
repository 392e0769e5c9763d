"""The integrations on 2 gloo ranks, all in one run (one process-group start):

  megatron - Megatron-core's parallel state at TP=2: the drop-in `vocab_parallel_cross_entropy` against
             Megatron's own op (no smoothing) and float64 ``F.cross_entropy`` (with smoothing), and the
             fused `output_layer_loss` with and without sequence parallelism against float64 math.
             Skipped (with the reason) when megatron-core is not importable.
  fsdp2    - a patched tiny Llama under ``fully_shard`` (layers, the untied lm_head as its own unit, the
             root; and a tied model), each rank one row of the batch: loss, every gradient and
             `token_logprobs` against the unpatched single-process model.
The references are computed in the test process from the same inputs.

The ranks are forked (`dist_utils.run_ranks`): importing megatron-core (it pulls in torch.compile's machinery)
and transformers costs seconds per process, and forked ranks inherit the test process's imports.
"""

from __future__ import annotations

import copy
import importlib.util
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks

WORLD = 2
TOL = dict(atol=1e-5, rtol=1e-5)
S, B, V, H = 6, 2, 24, 8  # Megatron case: 12 tokens, 12 vocabulary columns per rank
SMOOTHING = 0.1


def _import_megatron() -> str | None:
    """Import megatron-core here, before the ranks fork; the reason if that fails."""
    if importlib.util.find_spec("megatron") is None:
        return "megatron-core is not installed (optional test dependency: pip install megatron-core==0.16.1)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state  # noqa: F401
            from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # noqa: F401
    except Exception as err:  # a broken install fails while importing
        return f"megatron-core not importable ({type(err).__name__}: {err})"
    return None


MEGATRON_MISSING = _import_megatron()
TRANSFORMERS_MISSING = None if importlib.util.find_spec("transformers") else "transformers is not installed"


def _megatron_inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(S, B, V, generator=g) * 2
    target = torch.randint(0, V, (S, B), generator=g)
    upstream = torch.randn(S, B, generator=g)
    hidden = torch.randn(S, B, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    labels = torch.randint(0, V, (B, S), generator=g)
    loss_mask = torch.rand(B, S, generator=g) > 0.3
    return logits, target, upstream, hidden, weight, labels, loss_mask


def _megatron_rank(rank: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as megatron_op

    from lmloss.integrations import megatron

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD)
    logits, target, upstream, hidden, weight, labels, loss_mask = _megatron_inputs()
    cols = slice(rank * V // WORLD, (rank + 1) * V // WORLD)
    out = {}

    def run(fn, smoothing):
        shard = logits[..., cols].clone().requires_grad_()
        loss = fn(shard, target, smoothing)
        (loss * upstream).sum().backward()
        return loss.detach(), shard.grad

    out["ours"] = run(megatron.vocab_parallel_cross_entropy, 0.0)
    out["megatron"] = run(megatron_op, 0.0)
    out["ours_smooth"] = run(megatron.vocab_parallel_cross_entropy, SMOOTHING)
    out["megatron_smooth"] = run(megatron_op, SMOOTHING)[0]
    # an explicit tp_group=None is one process, whatever parallel_state says: the full logits here
    full = megatron.vocab_parallel_cross_entropy(logits, target, SMOOTHING, tp_group=None)
    out["one_process"] = full

    for sp in (False, True):
        rows = slice(rank * S // WORLD, (rank + 1) * S // WORLD) if sp else slice(None)
        h = hidden[rows].clone().requires_grad_()
        w = weight[cols].clone().requires_grad_()
        losses = megatron.output_layer_loss(
            h, w, labels, loss_mask, sequence_parallel=sp, label_smoothing=SMOOTHING
        )
        (losses * upstream.t()).sum().backward()
        out[f"fused_sp{int(sp)}"] = (losses.detach(), h.grad, w.grad)
    parallel_state.destroy_model_parallel()
    return out


def _fsdp_rank(rank: int, models: dict, ids, mask, labels, count):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lmloss.integrations import hf

    mesh = init_device_mesh("cpu", (WORLD,))
    row = slice(rank, rank + 1)
    out = {}
    for name, model in models.items():
        hf.patch(model)
        if name == "untied":  # the head as its own FSDP unit: the loss must run through its hooks
            fully_shard(model.lm_head, mesh=mesh)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        result = model(ids[row], attention_mask=mask[row], labels=labels[row], num_items_in_batch=count)
        assert result.logits is None
        result.loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        logprobs = hf.token_logprobs(model, ids[row], attention_mask=mask[row], temperature=0.5)
        out[name] = (result.loss.detach(), grads, logprobs.detach())
    return out


def _all_cases(rank: int, world: int, models, ids, mask, labels, count):
    torch.manual_seed(rank)
    out = {}
    if MEGATRON_MISSING is None:
        out["megatron"] = _megatron_rank(rank)
    dist.barrier()
    if models is not None:
        out["fsdp2"] = _fsdp_rank(rank, models, ids, mask, labels, count)
    return out


def _tiny_llama(tied: bool):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float()
    if not tied:
        with torch.no_grad():
            model.lm_head.weight.normal_(0, 0.2)
    return model


def _fsdp_inputs():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 200, (WORLD, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :2] = -100
    count = (labels[:, 1:] != -100).sum()  # what Trainer passes: the global number of targets
    return ids, mask, labels, count


@pytest.fixture(scope="module")
def results():
    if MEGATRON_MISSING and TRANSFORMERS_MISSING:
        pytest.skip(f"{MEGATRON_MISSING}; {TRANSFORMERS_MISSING}")
    models = None
    if TRANSFORMERS_MISSING is None:
        models = {"untied": _tiny_llama(False), "tied": _tiny_llama(True)}
    per_rank = run_ranks(_all_cases, WORLD, models, *_fsdp_inputs())
    return models, per_rank


def _smoothed_ce64(logits, target):
    return F.cross_entropy(
        logits.double().flatten(0, -2), target.flatten(), reduction="none", label_smoothing=SMOOTHING
    ).view(target.shape)


@pytest.mark.skipif(MEGATRON_MISSING is not None, reason=str(MEGATRON_MISSING))
def test_megatron_drop_in_equals_megatrons_op_and_float64_smoothing_at_tp2(results):
    _, per_rank = results
    logits, target, upstream, *_ = _megatron_inputs()
    # reference for the smoothed case: float64 F.cross_entropy over the unsharded logits
    full = logits.double().requires_grad_()
    want_smooth = _smoothed_ce64(full, target)
    (want_smooth * upstream.double()).sum().backward()
    for rank, out in enumerate(r["megatron"] for r in per_rank):
        cols = slice(rank * V // WORLD, (rank + 1) * V // WORLD)
        loss, grad = out["ours"]
        want_loss, want_grad = out["megatron"]
        torch.testing.assert_close(loss, want_loss, **TOL)
        torch.testing.assert_close(grad, want_grad, **TOL)
        assert loss.dtype == torch.float32 and loss.shape == (S, B)

        loss, grad = out["ours_smooth"]
        torch.testing.assert_close(loss.double(), want_smooth.detach(), **TOL)
        torch.testing.assert_close(grad.double(), full.grad[..., cols], **TOL)
        torch.testing.assert_close(out["one_process"].double(), want_smooth.detach(), **TOL)
        # what the docstring says of Megatron's smoothing at TP > 1: each rank's value is off
        assert not torch.allclose(out["megatron_smooth"].double(), want_smooth.detach(), atol=1e-3)


@pytest.mark.skipif(MEGATRON_MISSING is not None, reason=str(MEGATRON_MISSING))
def test_megatron_output_layer_loss_with_and_without_sequence_parallelism(results):
    _, per_rank = results
    logits, target, upstream, hidden, weight, labels, loss_mask = _megatron_inputs()
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    ce = _smoothed_ce64(h @ w.T, labels.t()).t()  # [B, S]
    want = ce * loss_mask
    (want * upstream.t().double()).sum().backward()
    for sp in (0, 1):
        for rank, out in enumerate(r["megatron"][f"fused_sp{sp}"] for r in per_rank):
            losses, grad_h, grad_w = out
            rows = slice(rank * S // WORLD, (rank + 1) * S // WORLD) if sp else slice(None)
            cols = slice(rank * V // WORLD, (rank + 1) * V // WORLD)
            assert losses.shape == (B, S) and losses.dtype == torch.float32
            torch.testing.assert_close(losses.double(), want.detach(), **TOL)
            torch.testing.assert_close(grad_h.double(), h.grad[rows], **TOL)
            torch.testing.assert_close(grad_w.double(), w.grad[cols], **TOL)


@pytest.mark.skipif(TRANSFORMERS_MISSING is not None, reason=str(TRANSFORMERS_MISSING))
def test_patched_model_under_fsdp2_gives_the_single_process_loss_gradients_and_logprobs(results):
    models, per_rank = results
    ids, mask, labels, count = _fsdp_inputs()
    for name, model in models.items():
        reference = copy.deepcopy(model)  # unpatched, never sharded (the ranks got pickled copies)
        out = reference(ids, attention_mask=mask, labels=labels, num_items_in_batch=count)
        out.loss.backward()
        logits = reference(ids, attention_mask=mask).logits.detach()
        logp = (logits[:, :-1] / 0.5).log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0] * mask[:, 1:]
        losses = [r["fsdp2"][name][0] for r in per_rank]
        # each rank's loss is its rows' sum over the global count: together the global loss
        torch.testing.assert_close(sum(losses), out.loss.detach(), **TOL)
        for rank, r in enumerate(per_rank):
            _, grads, logprobs = r["fsdp2"][name]
            torch.testing.assert_close(logprobs[0, 1:], logp[rank], **TOL)
            for pname, p in reference.named_parameters():
                # FSDP2 averages the ranks' gradients; their sum is the global gradient
                torch.testing.assert_close(
                    grads[pname] * WORLD, p.grad, **TOL, msg=lambda m, n=f"{name} {pname}": f"{n}: {m}"
                )
