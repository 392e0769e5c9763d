"""`lmloss.integrations.trl`: a patched ``trl.GRPOTrainer`` against the same trainer unpatched (the reference).

A tiny random Llama built from a config and a word-level tokenizer made here (no downloads); a reward in
Python. Each run trains two optimizer steps on one generation batch (``num_iterations=2``: the second step
has a ratio away from 1, so the clipping and the old policy's log-probs are exercised), with SGD so that
float rounding stays rounding (Adam's first step turns a 1e-9 gradient into a full learning-rate step).
The reference is TRL's own log-prob path (its ``add_fused_lm_head`` head), and every loss type's
normalisation is TRL's code in both runs.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import lmloss  # noqa: E402
from lmloss.integrations import trl as lmloss_trl  # noqa: E402
from lmloss.profiling import peak_memory  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 4096  # large next to the 24 completion tokens per step, so the head's [tokens, vocab] buffers show
PAD, EOS, BOS = 1, 2, 3


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=f"t{PAD}", eos_token=f"t{EOS}", unk_token="t0"
    )
    fast.padding_side = "left"
    return fast


def tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    # a large EOS row: some completions end early, so the loss types' denominators differ
    with torch.no_grad():
        model.lm_head.weight[EOS].normal_(0, 1.0)
    return model


def reward(completions, **kwargs):
    return [float(sum(map(ord, c)) % 5) for c in completions]


def train(model: str, loss_type: str, *, patched: bool, tmp_path, method=None, **config):
    """Two GRPO steps of the model saved at `model` (TRL loads the policy and, for the KL, the reference
    from there); returns (logged losses and entropies, per-step gradients, peak bytes of the second training_step)."""
    prompts = [" ".join(f"t{(7 * i + j) % (VOCAB - 8) + 8}" for j in range(2 + i % 3)) for i in range(2)]
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / f"{loss_type}-{patched}"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, max_steps=2, num_iterations=2, learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", report_to="none", use_cpu=True, logging_steps=1, save_strategy="no",
        loss_type=loss_type, seed=0, disable_tqdm=True, bf16=False, **{"beta": 0.04, **config},
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=reward, args=args, processing_class=tokenizer(),
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
    )  # fmt: skip
    if method is not None:  # a hand-written reference of the method
        trainer._get_per_token_logps_and_entropies = method.__get__(trainer)
    elif patched is True:
        assert lmloss_trl.patch(trainer) is trainer and lmloss_trl.is_patched(trainer)
        with pytest.raises(ValueError, match="already patched"):
            lmloss_trl.patch(trainer)
    elif patched:  # patch's options
        lmloss_trl.patch(trainer, **patched)
    grads, peaks = [], []

    class Grads(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    trainer.add_callback(Grads())
    step = trainer.training_step

    def measured(*a, **k):
        with peak_memory() as mem:
            out = step(*a, **k)
        peaks.append(mem.peak_bytes)
        return out

    trainer.training_step = measured
    trainer.train()
    if patched is True:  # unpatch: TRL's own method again
        lmloss_trl.unpatch(trainer)
        assert (
            trainer._get_per_token_logps_and_entropies.__func__
            is type(trainer)._get_per_token_logps_and_entropies
        )
    # the loss, and the entropy TRL logs (the mean over completion tokens of the method's entropies)
    logged = [(h["loss"], h["entropy"]) + ((h["kl"],) if "kl" in h else ()) for h in trainer.state.log_history if "loss" in h]
    if config:
        return logged, grads, trainer.model
    return logged, grads, peaks[-1]  # step 1 also generates; step 2 is the loss step alone


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
def test_patched_grpo_trainer_matches_trl_losses_and_gradients_with_lower_peak(loss_type, tmp_path):
    tiny_llama().save_pretrained(tmp_path / "model")
    ref_losses, ref_grads, ref_peak = train(
        str(tmp_path / "model"), loss_type, patched=False, tmp_path=tmp_path
    )
    losses, grads, peak = train(str(tmp_path / "model"), loss_type, patched=True, tmp_path=tmp_path)
    assert len(ref_grads) == len(grads) == 2 and len(losses) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-4)
    for got, want in zip(grads, ref_grads):
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
    assert any(g.abs().sum() > 0 for g in grads[1].values())  # the step trained something
    assert peak < ref_peak, (peak, ref_peak)


def test_patch_refuses_what_is_not_a_grpo_trainer():
    with pytest.raises(TypeError, match="trainer"):
        lmloss_trl.patch(object())
    with pytest.raises(ValueError, match="not patched"):
        lmloss_trl.unpatch(object())


def test_patch_checks_its_options_when_called_not_at_the_first_training_step():
    """A truthy string once turned invariant on (``bool("false")``); a bad chunk_size surfaced in training."""
    trainer = type("Trainer", (), {"_get_per_token_logps_and_entropies": lambda self: None})()
    for kw, error, words in [
        (dict(invariant="false"), TypeError, "invariant must be a bool"),
        (dict(invariant=1), TypeError, "invariant must be a bool"),
        (dict(sampler_truncation="yes"), TypeError, "sampler_truncation must be a bool"),
        (dict(chunk_size=0), ValueError, "chunk_size must be positive"),
        (dict(chunk_size=2.5), TypeError, "chunk_size must be a positive int"),
        (dict(chunk_size=10**23), ValueError, "chunk_size must fit in int64"),
    ]:
        with pytest.raises(error, match=words):
            lmloss_trl.patch(trainer, **kw)
        assert not lmloss_trl.is_patched(trainer)


def test_sampler_truncation_scores_under_the_generations_top_k_top_p_and_invariant_reaches_the_head(tmp_path):
    # the reference: transformers' sampling warpers (what generate() samples from) on the model's logits / T
    model = tiny_llama()
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_completion_length=6,
        report_to="none", use_cpu=True, bf16=False, temperature=0.7, top_k=30, top_p=0.9, min_p=None,
        generation_kwargs={"top_p": 0.8},  # overrides args.top_p, as TRL passes it to generate / vLLM
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=reward, args=args, processing_class=tokenizer(),
        train_dataset=datasets.Dataset.from_dict({"prompt": ["t9 t10"]}),
    )  # fmt: skip
    assert lmloss_trl.generation_truncation(trainer) == dict(top_k=30, top_p=0.8, min_p=None)
    with pytest.raises(ValueError, match="memory_budget_mib"):
        lmloss_trl.patch(trainer, memory_budget_mib=-1)
    # small chunks (invariant mode's GEMM tile, 4.5 MiB here, is its floor: less is refused, issue #41)
    lmloss_trl.patch(trainer, sampler_truncation=True, invariant=True, memory_budget_mib=6)
    ids = torch.randint(8, VOCAB, (1, 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # greedy completion tokens: inside any kept set
        for _ in range(5):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    mask = torch.ones_like(ids)
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, 5, compute_entropy=True)
    logits = model(ids).logits[0, -6:-1] / 0.7
    for warper in (transformers.TopKLogitsWarper(30), transformers.TopPLogitsWarper(0.8)):
        logits = warper(ids, logits)
    logp = logits.log_softmax(-1)
    want = logp.gather(-1, ids[0, -5:, None])[:, 0]
    want_ent = -(logp.exp() * logp.masked_fill(logits == float("-inf"), 0.0)).sum(-1)
    torch.testing.assert_close(logps[0], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropies[0], want_ent, atol=1e-5, rtol=1e-5)
    assert trainer._lmloss_trl_patch["options"]["invariant"] is True
    assert trainer._lmloss_trl_patch["options"]["memory_budget_mib"] == 6
    with torch.no_grad():  # the invariant head: the op's own bits on the model's hidden states
        hidden = model.model(ids)[0][:, -6:-1]
        op = lmloss.linear_token_logprobs(hidden, model.lm_head.weight, ids[:, -5:], temperature=0.7, top_k=30,
                                          top_p=0.8, invariant=True)  # fmt: skip
    assert torch.equal(logps, op)


def reference_scoring(top_p: float):
    """TRL's method as the semantics of ``patch(trainer, sampler_truncation=True)`` say, in plain PyTorch on the
    model's logits: the policy under transformers' top-p warper (what generate() samples from) at the
    temperature, a token outside its kept set on the full distribution; the reference on its full distribution."""

    def method(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
               compute_aux_loss=False, **extra):  # fmt: skip
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        logits = logits[:, -logits_to_keep - 1 : -1].float() / self.temperature
        tokens = input_ids[:, -logits_to_keep:, None]
        full = logits.log_softmax(-1)
        if model is self.ref_model:
            kept = full
        else:
            warped = transformers.TopPLogitsWarper(top_p)(None, logits.reshape(-1, VOCAB)).view_as(logits)
            kept = warped.log_softmax(-1)
        lp = kept.gather(-1, tokens)[..., 0]
        lp = torch.where(torch.isneginf(lp), full.gather(-1, tokens)[..., 0], lp)
        entropy = -(kept.exp() * kept.masked_fill(torch.isneginf(kept), 0.0)).sum(-1)
        scored = attention_mask[:, -logits_to_keep:] == 1
        return lp.masked_fill(~scored, 0.0), entropy.masked_fill(~scored, 0.0) if compute_entropy else None, None

    return method


def test_sampler_truncation_with_a_kl_trains_finite_with_the_reference_on_its_full_distribution(tmp_path):
    # two GRPO steps with beta > 0 under the generation's top-p: the reference is scored on its full
    # distribution (a truncated one gave -inf on sampled tokens it would not keep: kl inf, NaN parameters)
    tiny_llama().save_pretrained(tmp_path / "model")
    config = dict(top_p=0.6, temperature=1.3, beta=0.2)
    losses, grads, model = train(str(tmp_path / "model"), "grpo", patched=dict(sampler_truncation=True),
                                 tmp_path=tmp_path, **config)  # fmt: skip
    ref_losses, ref_grads, ref_model = train(str(tmp_path / "model"), "grpo", patched=False, tmp_path=tmp_path,
                                             method=reference_scoring(0.6), **config)  # fmt: skip
    assert all(p.isfinite().all() for p in model.parameters())
    # (TRL logs a NaN loss as None: without the full-distribution fallback, step 2's policy drops a token)
    assert len(losses) == 2 and all(v is not None and math.isfinite(v) for row in losses for v in row), losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-4)
    for got, want in zip(grads, ref_grads):
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
    assert all(k > 0 for *_, k in losses)  # a KL was computed (and is finite)


def test_sampler_truncation_with_a_kl_needs_a_separate_reference(tmp_path):
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                          report_to="none", use_cpu=True, bf16=False, top_p=0.9, beta=0.1)  # fmt: skip
    tiny_llama().save_pretrained(tmp_path / "model")
    trainer = trl.GRPOTrainer(model=str(tmp_path / "model"), reward_funcs=reward, args=args,
                              processing_class=tokenizer(),
                              train_dataset=datasets.Dataset.from_dict({"prompt": ["t9 t10"]}))  # fmt: skip
    trainer.ref_model = None  # as TRL leaves it for a PEFT policy (the reference: the adapter disabled)
    with pytest.raises(ValueError, match="separate ref_model"):
        lmloss_trl.patch(trainer, sampler_truncation=True)
    lmloss_trl.patch(trainer)  # no truncation: nothing to tell apart
