"""`lmloss.integrations.hf`: a patched transformers model against the same model unpatched (the reference).

Tiny Llama, Qwen2, Qwen3 and Gemma2 models are built from configs (no downloads). Every case compares the
loss and the gradient of every parameter with those of unpatched transformers, which computes the logits
and ``F.cross_entropy`` (ForCausalLMLoss). The FSDP2 case lives in tests/distributed/test_integrations_parallel.py.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import lmloss  # noqa: E402
from lmloss.integrations import hf  # noqa: E402
from tracking_support import LargestAllocation  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = dict(atol=1e-5, rtol=1e-5)
VOCAB = 384
B, S = 2, 12


def tiny_config(arch: str, *, tied: bool, vocab: int = VOCAB, softcap: float | None = None):
    common = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied,
    )  # fmt: skip
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=8, **common)
    if arch == "gemma2":
        return transformers.Gemma2Config(
            head_dim=8, query_pre_attn_scalar=8, sliding_window=8, final_logit_softcapping=softcap, **common
        )
    raise ValueError(arch)


def tiny_model(arch: str, *, tied: bool = False, seed: int = 0, **kw):
    config = tiny_config(arch, tied=tied, **kw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    if not tied:  # a head unlike the embedding, so that a mixed-up weight cannot pass
        with torch.no_grad():
            model.lm_head.weight.normal_(0, 0.2)
    return model


def batch(seed: int = 1, vocab: int = VOCAB, seq: int = S):
    """input_ids, attention_mask (row 1 right-padded), labels with padding and a prompt at -100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, seq), generator=g)
    mask = torch.ones(B, seq, dtype=torch.long)
    mask[1, seq - 4 :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :3] = -100
    return ids, mask, labels


def loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(got: dict, want: dict, **tol):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **(tol or TOL), msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2"])
def test_patched_loss_and_every_gradient_match_transformers(arch, tied):
    reference = tiny_model(arch, tied=tied)
    patched = hf.patch(copy.deepcopy(reference))
    ids, mask, labels = batch()
    for extra in ({}, {"num_items_in_batch": torch.tensor(29)}):  # mean, then Trainer's sum / count
        want, want_grads = loss_and_grads(
            reference, input_ids=ids, attention_mask=mask, labels=labels, **extra
        )
        got, got_grads = loss_and_grads(patched, input_ids=ids, attention_mask=mask, labels=labels, **extra)
        assert got.logits is None
        torch.testing.assert_close(got.loss, want.loss, **TOL)
        assert_same_grads(got_grads, want_grads)
    if tied:
        assert patched.lm_head.weight is patched.get_input_embeddings().weight


def test_gemma2_softcap_matches_transformers():
    reference = tiny_model("gemma2", softcap=3.0)  # a small cap, so that tanh bends the logits
    patched = hf.patch(copy.deepcopy(reference))
    ids, mask, labels = batch()
    want, want_grads = loss_and_grads(reference, input_ids=ids, attention_mask=mask, labels=labels)
    got, got_grads = loss_and_grads(patched, input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    assert_same_grads(got_grads, want_grads)
    lp = hf.token_logprobs(patched, ids, attention_mask=mask)
    logits = reference(ids, attention_mask=mask).logits.double()  # softcapped by transformers
    want_lp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(lp[:, 1:][mask[:, 1:] == 1].double(), want_lp[mask[:, 1:] == 1], **TOL)


@pytest.mark.parametrize("after", [30.0, None], ids=["cap30", "no_cap"])
def test_a_softcap_changed_after_patch_is_read_by_the_patched_forward(after):
    reference = tiny_model("gemma2", softcap=5.0)
    with torch.no_grad():  # logits of size ~6, so that a cap of 5 and one of 30 give far apart losses
        reference.lm_head.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(3))
    patched = hf.patch(copy.deepcopy(reference))
    ids, mask, labels = batch()
    capped_at_5 = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
    for model in (reference, patched):
        model.config.final_logit_softcapping = after
    want, want_grads = loss_and_grads(reference, input_ids=ids, attention_mask=mask, labels=labels)
    got, got_grads = loss_and_grads(patched, input_ids=ids, attention_mask=mask, labels=labels)
    assert abs(want.loss.item() - capped_at_5.item()) > 1.0  # the change matters to transformers' loss
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    assert_same_grads(got_grads, want_grads)
    lp = hf.token_logprobs(patched, ids, attention_mask=mask)
    logits = reference(ids, attention_mask=mask).logits.double()
    want_lp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(lp[:, 1:][mask[:, 1:] == 1].double(), want_lp[mask[:, 1:] == 1], **TOL)


def test_a_scale_the_model_kept_from_construction_is_followed_when_its_config_changes_after_patch():
    # Cohere copies config.logit_scale into the module when it is built: changing the config afterwards
    # changes nothing in transformers' forward, and must change nothing in the patched one either; changing
    # the module's own copy changes both, and the unpatched scoring path too
    config = transformers.CohereConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, logit_scale=0.25, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.CohereForCausalLM(config)
    patched = hf.patch(copy.deepcopy(reference))
    ids, mask, labels = batch()
    for model in (reference, patched):
        model.config.logit_scale = 4.0
    want, want_grads = loss_and_grads(reference, input_ids=ids, attention_mask=mask, labels=labels)
    got, got_grads = loss_and_grads(patched, input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    assert_same_grads(got_grads, want_grads)
    unpatched = copy.deepcopy(reference)
    before = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
    for model in (reference, patched, unpatched):
        model.logit_scale = 40.0  # the copy the forward reads (the tiny model's logits are ~0.05)
    want, want_grads = loss_and_grads(reference, input_ids=ids, attention_mask=mask, labels=labels)
    got, got_grads = loss_and_grads(patched, input_ids=ids, attention_mask=mask, labels=labels)
    assert abs(want.loss.item() - before.item()) > 0.01  # the change matters to transformers' loss
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    assert_same_grads(got_grads, want_grads)
    logits = reference(ids, attention_mask=mask).logits.double()
    want_lp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    for model in (patched, unpatched):
        lp = hf.token_logprobs(model, ids, attention_mask=mask)
        torch.testing.assert_close(lp[:, 1:][mask[:, 1:] == 1].double(), want_lp[mask[:, 1:] == 1], **TOL)


def test_a_config_changed_after_patch_to_what_lmloss_cannot_check_or_compute_is_refused_at_the_forward():
    ids, mask, labels = batch()
    patched = hf.patch(tiny_model("gemma2", softcap=5.0), verify=False)
    patched.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM's loss: its config changed after patch\(verify=Fals"
                       r"e\) \(final_logit_softcapping=5.0 -> final_logit_softcapping=30.0\)"):  # fmt: skip
        patched(input_ids=ids, attention_mask=mask, labels=labels)
    patched = hf.patch(tiny_model("gemma2", softcap=5.0))
    patched.config.logits_scaling = -1.0  # a Granite field on a Gemma config: still read, and refused
    with pytest.raises(ValueError, match="Gemma2ForCausalLM's loss: config.logits_scaling=-1.0 is not a positive"):
        patched(input_ids=ids, attention_mask=mask, labels=labels)


def test_without_labels_logits_come_back_unchanged_and_kwargs_pass_through():
    reference = tiny_model("llama")
    patched = hf.patch(copy.deepcopy(reference))
    ids, mask, labels = batch()
    for kw in ({}, {"logits_to_keep": 1}):
        want = reference(ids, attention_mask=mask, **kw).logits
        torch.testing.assert_close(patched(ids, attention_mask=mask, **kw).logits, want, atol=0, rtol=0)


def test_return_dict_false_keeps_transformers_tuple_layout_with_none_for_the_logits():
    reference = tiny_model("llama")
    patched = hf.patch(copy.deepcopy(reference))
    ids, mask, labels = batch()
    for kw in ({"use_cache": True}, {"use_cache": True, "output_hidden_states": True}):
        with torch.no_grad():
            want = reference(ids, attention_mask=mask, labels=labels, return_dict=False, **kw)
            got = patched(ids, attention_mask=mask, labels=labels, return_dict=False, **kw)
        assert isinstance(got, tuple) and len(got) == len(want) >= 3
        torch.testing.assert_close(got[0], want[0], **TOL)
        assert got[1] is None and want[1].shape == (B, S, VOCAB)  # the logits slot, kept
        assert type(got[2]) is type(want[2])  # past_key_values stays third
        if "output_hidden_states" in kw:  # and the hidden states fourth, equal
            for g, w in zip(got[3], want[3]):
                torch.testing.assert_close(g, w, atol=0, rtol=0)


def test_eval_mode_returns_logits_and_transformers_loss_training_mode_the_fused_loss():
    reference = tiny_model("qwen2")
    patched = hf.patch(copy.deepcopy(reference))
    ids, mask, labels = batch()
    reference.eval()
    patched.eval()  # what Trainer.evaluate / predict do
    with torch.no_grad():
        want = reference(ids, attention_mask=mask, labels=labels)
        got = patched(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.logits, want.logits, atol=0, rtol=0)
    torch.testing.assert_close(got.loss, want.loss, atol=0, rtol=0)
    patched.train()
    assert patched(ids, attention_mask=mask, labels=labels).logits is None
    # logits_in_eval=False: the fused loss in eval mode too
    fused_eval = hf.patch(copy.deepcopy(reference), logits_in_eval=False).eval()
    with torch.no_grad():
        out = fused_eval(ids, attention_mask=mask, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, want.loss, **TOL)


def test_trainer_predict_and_evaluate_with_compute_metrics_see_the_logits_of_the_unpatched_model(tmp_path):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    reference = tiny_model("llama")
    patched = hf.patch(copy.deepcopy(reference))
    data = []
    for i in range(3):
        ids, mask, labels = batch(seed=20 + i)
        data += [dict(input_ids=ids[r], attention_mask=mask[r], labels=labels[r]) for r in range(B)]

    def accuracy(pred: transformers.EvalPrediction) -> dict:
        logits, labels = torch.as_tensor(pred.predictions), torch.as_tensor(pred.label_ids)
        guess, target = logits[:, :-1].argmax(-1), labels[:, 1:]
        valid = target != -100
        return {"accuracy": (guess[valid] == target[valid]).double().mean().item()}

    results = {}
    for name, model in (("reference", reference), ("patched", patched)):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), report_to=[], use_cpu=True, per_device_eval_batch_size=2,
            disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip
        trainer = transformers.Trainer(model=model, args=args, compute_metrics=accuracy)
        results[name] = (trainer.predict(data), trainer.evaluate(data))
    (want_pred, want_eval), (got_pred, got_eval) = results["reference"], results["patched"]
    assert got_pred.predictions.shape == (len(data), S, VOCAB)
    torch.testing.assert_close(torch.as_tensor(got_pred.predictions), torch.as_tensor(want_pred.predictions))
    assert got_eval["eval_accuracy"] == want_eval["eval_accuracy"]
    assert abs(got_eval["eval_loss"] - want_eval["eval_loss"]) < 1e-6
    patched.train()  # Trainer.train switches back: the fused loss again
    ids, mask, labels = batch()
    assert patched(ids, attention_mask=mask, labels=labels).logits is None


def test_logits_to_keep_shift_labels_and_ignore_index_match_transformers():
    reference = tiny_model("qwen2")
    patched = hf.patch(copy.deepcopy(reference))
    ids, mask, labels = batch()
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    cases = [
        dict(labels=labels[:, -5:].contiguous(), logits_to_keep=5),  # scores the last 5 positions only
        dict(labels=ids, shift_labels=shifted),  # already shifted targets win over labels
        dict(labels=labels.masked_fill(labels == -100, 7), ignore_index=7),
    ]
    for case in cases:
        want, want_grads = loss_and_grads(reference, input_ids=ids, attention_mask=mask, **case)
        got, got_grads = loss_and_grads(patched, input_ids=ids, attention_mask=mask, **case)
        torch.testing.assert_close(got.loss, want.loss, **TOL)
        assert_same_grads(got_grads, want_grads)
    with pytest.raises(ValueError, match="logits_to_keep"):
        patched(ids, labels=labels, logits_to_keep=5)


def test_bf16_matches_transformers_within_bf16_rounding():
    reference = tiny_model("llama").to(torch.bfloat16)
    patched = hf.patch(copy.deepcopy(reference))
    ids, mask, labels = batch()
    want, want_grads = loss_and_grads(reference, input_ids=ids, attention_mask=mask, labels=labels)
    got, got_grads = loss_and_grads(patched, input_ids=ids, attention_mask=mask, labels=labels)
    assert got.loss.dtype == torch.float32 and want.loss.dtype == torch.float32
    torch.testing.assert_close(got.loss, want.loss, atol=1e-3, rtol=1e-3)
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"):
        assert got_grads[name].dtype == torch.bfloat16
        # the head's gradient accumulates in fp32 here and in bf16 GEMM outputs there
        torch.testing.assert_close(got_grads[name].float(), want_grads[name].float(), atol=2e-3, rtol=2e-2)


def test_under_cpu_autocast_the_head_runs_in_the_autocast_dtype_like_nn_linear():
    reference = tiny_model("qwen2")  # fp32 parameters, bf16 compute
    patched = hf.patch(copy.deepcopy(reference))
    ids, mask, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads = loss_and_grads(reference, input_ids=ids, attention_mask=mask, labels=labels)
        got, got_grads = loss_and_grads(patched, input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-3, rtol=1e-3)
    assert got_grads["lm_head.weight"].dtype == torch.float32
    torch.testing.assert_close(
        got_grads["lm_head.weight"], want_grads["lm_head.weight"], atol=2e-3, rtol=2e-2
    )


def test_patch_is_idempotent_and_unpatch_restores_the_original_forward():
    model = tiny_model("llama")
    model.train()
    model.model.layers[1].eval()  # mixed modes survive the check forward (run in eval mode)
    modes = [m.training for m in model.modules()]
    assert hf.patch(model) is model and hf.is_patched(model)
    assert [m.training for m in model.modules()] == modes
    first = model.forward
    hf.patch(model)
    assert model.forward == first
    ids, mask, labels = batch()
    assert model(ids, attention_mask=mask, labels=labels).logits is None
    assert hf.unpatch(model) is model and not hf.is_patched(model)
    assert "forward" not in model.__dict__
    out = model(ids, attention_mask=mask, labels=labels)
    assert out.logits.shape == (B, S, VOCAB)
    hf.unpatch(model)  # a no-op on an unpatched model


def test_models_whose_loss_the_patch_would_not_reproduce_are_refused_naming_class_and_reason():
    with pytest.raises(ValueError, match="LlamaModel.*ForCausalLM"):
        hf.patch(tiny_model("llama").model)  # the body alone has no head
    # a config field the Granite family divides by, which Llama's forward ignores: the check forward sees
    # that the logits are not logits / 4 and refuses
    ignored = tiny_model("llama")
    ignored.config.logits_scaling = 4.0
    with pytest.raises(ValueError, match="LlamaForCausalLM.*logits_scaling=4.0"):
        hf.patch(ignored)
    assert not hf.is_patched(ignored)
    hf.patch(ignored, verify=False)  # the escape hatch: config checks only

    class DoubledLlama(transformers.LlamaForCausalLM):  # a transform no config field announces
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    doubled = DoubledLlama(tiny_config("llama", tied=False))
    with pytest.raises(ValueError, match="DoubledLlama.*logits are not the identity"):
        hf.patch(doubled)
    bart = transformers.BartForConditionalGeneration(
        transformers.BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                encoder_ffn_dim=32, decoder_ffn_dim=32, encoder_attention_heads=2,
                                decoder_attention_heads=2, max_position_embeddings=32)
    )  # fmt: skip
    with pytest.raises(ValueError, match="BartForConditionalGeneration.*encoder-decoder"):
        hf.patch(bart)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hf.patch("llama")
    router = tiny_model("llama")
    router.config.output_router_logits = True
    with pytest.raises(ValueError, match="router auxiliary loss"):
        hf.patch(router)


def test_patched_forward_and_backward_allocate_no_tokens_by_vocab_tensor():
    vocab = 4096
    reference = tiny_model("llama", vocab=vocab)
    patched = hf.patch(copy.deepcopy(reference), chunk_size=8)
    seq = 96  # tokens >> hidden, so that a [tokens, vocab] tensor is larger than any [vocab, hidden] one
    ids, mask, labels = batch(vocab=vocab, seq=seq)
    logits_bytes = B * seq * vocab * 4  # one fp32 [tokens, vocab] tensor
    measured = {}
    for name, model in (("reference", reference), ("patched", patched)):
        with LargestAllocation() as tracker:
            model(ids, attention_mask=mask, labels=labels).loss.backward()
        measured[name] = tracker
    assert measured["reference"].largest >= logits_bytes  # the check can see a logits tensor
    # the largest allocations left are the [vocab, hidden] fp32 weight gradient and one [8, vocab] chunk
    head_bytes = vocab * 32 * 4
    assert measured["patched"].largest <= head_bytes < logits_bytes / 3
    assert measured["patched"].peak < measured["reference"].peak - 2 * logits_bytes


def test_a_memory_budget_below_the_heads_fp32_accumulator_holds_none_and_gives_the_same_gradients():
    # a bf16 head accumulates its weight gradient in fp32 ([V, H]); memory_budget_mib below that takes the
    # weight pass: no [V, H] fp32 tensor, the same loss and gradients (fp32 sums in both)
    vocab = 4096
    reference = tiny_model("llama", vocab=vocab).to(torch.bfloat16)
    ids, mask, labels = batch(vocab=vocab, seq=96)
    accumulator = vocab * 32 * 4
    results = {}
    for name, budget in (("default", None), ("budget", 0.25)):
        model = hf.patch(copy.deepcopy(reference), memory_budget_mib=budget)
        with LargestAllocation() as tracker:
            out, grads = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
        results[name] = out.loss, grads, tracker.largest
    assert results["default"][2] >= accumulator  # the tracker sees the default's fp32 accumulator
    assert results["budget"][2] < accumulator
    torch.testing.assert_close(results["budget"][0], results["default"][0], rtol=0, atol=1e-6)
    assert_same_grads(results["budget"][1], results["default"][1], rtol=1e-2, atol=1e-5)
    with pytest.raises(ValueError, match="memory_budget_mib"):
        hf.patch(copy.deepcopy(reference), memory_budget_mib=0)


def test_token_logprobs_and_entropy_match_log_softmax_of_transformers_logits():
    reference = tiny_model("qwen3")
    patched = hf.patch(copy.deepcopy(reference))
    ids, mask, _ = batch()
    T = 0.7
    weights = torch.randn(B, S, generator=torch.Generator().manual_seed(3))
    lp, ent = hf.token_logprobs(patched, ids, attention_mask=mask, temperature=T, return_entropy=True)
    patched.zero_grad()
    ((lp * weights).sum() + ent.sum()).backward()

    logits = reference(ids, attention_mask=mask).logits.float() / T
    logp = logits[:, :-1].log_softmax(-1)
    want_lp = logp.gather(-1, ids[:, 1:, None])[..., 0] * mask[:, 1:]  # padding is not scored
    want_ent = -(logp.exp() * logp).sum(-1) * mask[:, 1:]  # nor is its entropy (0, no gradient)
    want_lp = F.pad(want_lp, (1, 0))
    want_ent = F.pad(want_ent, (1, 0))
    reference.zero_grad()
    ((want_lp * weights).sum() + want_ent.sum()).backward()

    assert lp.shape == ent.shape == (B, S) and lp.dtype == torch.float32
    torch.testing.assert_close(lp, want_lp, **TOL)
    torch.testing.assert_close(ent, want_ent, **TOL)
    assert_same_grads(
        {n: p.grad for n, p in patched.named_parameters()},
        {n: p.grad for n, p in reference.named_parameters()},
    )
    # explicit labels: -100 is not scored
    labels = ids.clone()
    labels[:, 5] = -100
    assert (hf.token_logprobs(patched, ids, labels)[:, 5] == 0).all()
    # a memory budget reaches the op: chunks of a few tokens, the same log-probs; below the op's floor it is
    # refused naming the smallest budget (issue #41)
    small = hf.token_logprobs(patched, ids, attention_mask=mask, temperature=T, memory_budget_mib=0.03)
    torch.testing.assert_close(small, lp.detach(), **TOL)
    with pytest.raises(ValueError, match="memory_budget_mib"):
        hf.token_logprobs(patched, ids, memory_budget_mib=0)
    with pytest.raises(ValueError, match=r"memory_budget_mib: a budget of 0.01 MiB is below the smallest .* honour, 0.02\d MiB"):
        hf.token_logprobs(patched, ids, memory_budget_mib=0.01)


def _greedy(model, prompt: int, total: int, seed: int = 4):
    """``[1, total]``: a random prompt, then the model's argmax at each step (inside any kept set)."""
    ids = torch.randint(0, VOCAB, (1, prompt), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for _ in range(total - prompt):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize(
    "sampling,warpers",
    [
        (dict(top_k=20, top_p=0.8), lambda: [transformers.TopKLogitsWarper(20), transformers.TopPLogitsWarper(0.8)]),
        (dict(min_p=0.1), lambda: [transformers.MinPLogitsWarper(0.1)]),
    ],
    ids=["top_k+top_p", "min_p"],
)
def test_token_logprobs_under_the_rollouts_truncation_match_transformers_warpers(sampling, warpers):
    # the reference: transformers' own sampling warpers (what generate() samples from) on the logits / T
    reference = tiny_model("qwen3")
    patched = hf.patch(copy.deepcopy(reference))
    ids = _greedy(reference, prompt=3, total=14)
    labels = ids.clone()
    labels[:, :3] = -100  # the prompt: not sampled, not scored
    lp, ent = hf.token_logprobs(patched, ids, labels, temperature=0.7, return_entropy=True, **sampling)
    logits = reference(ids).logits[0, :-1] / 0.7
    for warper in warpers():
        logits = warper(ids, logits)
    logp = logits.log_softmax(-1)
    want_lp = logp.gather(-1, ids[0, 1:, None])[:, 0]
    want_ent = -(logp.exp() * logp.masked_fill(logits == float("-inf"), 0.0)).sum(-1)
    scored = slice(2, None)  # positions 3.. (the completion), shifted by one
    torch.testing.assert_close(lp[0, 3:], want_lp[scored], **TOL)
    torch.testing.assert_close(ent[0, 3:], want_ent[scored], **TOL)
    assert (lp[0, 3:] > hf.token_logprobs(reference, ids, labels, temperature=0.7)[0, 3:] + 1e-4).any()
    g = torch.randn(11, generator=torch.Generator().manual_seed(5))
    ((lp[0, 3:] + ent[0, 3:]) * g).sum().backward()
    ((want_lp[scored] + want_ent[scored]) * g).sum().backward()
    assert_same_grads(
        {n: p.grad for n, p in patched.named_parameters()}, {n: p.grad for n, p in reference.named_parameters()}
    )


def test_token_logprobs_invariant_head_gives_the_same_bits_whatever_the_chunking():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (2, 151), generator=torch.Generator().manual_seed(6))  # 300 scored rows
    with torch.no_grad():
        a = hf.token_logprobs(model, ids, invariant=True, chunk_size=128, return_entropy=True)
        b = hf.token_logprobs(model, ids, invariant=True, chunk_size=None, return_entropy=True)
        hidden = model.model(ids)[0][:, :-1]
        want = lmloss.linear_token_logprobs(hidden, model.lm_head.weight, ids[:, 1:], invariant=True,
                                            return_entropy=True)  # fmt: skip
    for x, y, w in zip(a, b, want):
        assert torch.equal(x, y) and torch.equal(x[:, 1:], w)


def _warnings_during(fn) -> set[str]:
    """Every Python warning and every transformers log record at WARNING or above while `fn` runs (the
    ``warning_once`` cache cleared first, so each message shows whatever ran before)."""
    import logging
    import warnings

    from transformers.utils import logging as transformers_logging

    transformers_logging.warning_once.cache_clear()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        logger.removeHandler(handler)
    return {f"{w.category.__name__}: {w.message}" for w in caught} | {r.getMessage() for r in records}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_a_patched_model_warns_only_where_the_unpatched_model_does(arch):
    reference = tiny_model(arch)
    patched = hf.patch(copy.deepcopy(reference))
    ids, mask, labels = batch()

    def use(model, extra=()):
        model.train()
        model(ids, attention_mask=mask, labels=labels).loss.backward()  # the fused loss when patched
        model(ids, attention_mask=mask, labels=labels, return_dict=False)
        model(ids, attention_mask=mask)  # no labels: the original forward
        with torch.no_grad():
            out = model(ids[:, :5], use_cache=True)
            cache = out[_cache_field(out)]
            model(ids[:, 5:6], None, None, cache)  # the cache as the fourth positional argument
            model.eval()
            model(ids, attention_mask=mask, labels=labels)
            model.generate(ids[:1, :4], max_new_tokens=2, do_sample=False)
        for call in extra:
            call()
        model.train()

    want = _warnings_during(lambda: use(reference))
    got = _warnings_during(lambda: use(patched, [lambda: hf.token_logprobs(patched, ids, attention_mask=mask)]))
    assert got <= want, got - want


def _cache_field(out) -> str:
    return "cache" if "cache" in out else "past_key_values"


def _trainer_run(model, tmp_path, data):
    # plain SGD: parameters move by lr * gradient, so equal gradients give equal parameters (Adam would
    # magnify rounding-level differences of near-zero gradients)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=3, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, optim="sgd", learning_rate=0.1, logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_trains_the_patched_model_as_it_trains_transformers_own(tmp_path):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    reference = tiny_model("llama")
    patched = hf.patch(copy.deepcopy(reference))
    data = []
    for i in range(12):  # uneven label counts per micro-batch: num_items_in_batch matters
        ids, mask, labels = batch(seed=10 + i)
        labels[:, : i % 5] = -100
        data += [dict(input_ids=ids[r], attention_mask=mask[r], labels=labels[r]) for r in range(B)]
    want_losses = _trainer_run(reference, tmp_path / "reference", data)
    got_losses = _trainer_run(patched, tmp_path / "patched", data)
    assert len(got_losses) == 3
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), **TOL)
    for (name, p), q in zip(reference.named_parameters(), patched.parameters()):
        torch.testing.assert_close(q, p, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.equal(reference.lm_head.weight, tiny_model("llama").lm_head.weight)  # it did train


def test_import_lmloss_imports_neither_transformers_nor_megatron():
    code = (
        "import sys, lmloss, lmloss.integrations.hf, lmloss.integrations.megatron\n"
        "bad = [m for m in ('transformers', 'megatron') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
