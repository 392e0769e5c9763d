"""`lmloss.preference` against TRL 1.16's own loss code, float64: value, gradient and logged metrics.

TRL's trainers are built once per module on a tiny float64 Llama (tests/preference_support.py) and their
own loss methods are called on one prepared batch: ``DPOTrainer._compute_loss``, ``KTOTrainer._compute_loss``,
``trl.experimental``'s ``ORPOTrainer.get_batch_loss_metrics`` and ``CPOTrainer.get_batch_loss_metrics``.
lmloss gets the same model's per-token log-probs (plain ``log_softmax`` in float64, written here) and
computes `sequence_stats` -> `preference_loss`; the two losses and the gradients of every parameter of the
model must agree to float64 rounding.

DPO and KTO read their per-token log-probs from TRL's fused head (``model(..., fused_lm_head=True)``), which
computes in float32: for these tests the head is swapped for the float64 one written here (`exact_head`),
so what is compared is TRL's loss code, not its head's rounding. ORPO and CPO use the model's logits.
"""

from __future__ import annotations

import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

import preference_support as S  # noqa: E402
from lmloss.preference import PreferenceSpec, preference_loss, sequence_stats  # noqa: E402
from lmloss.preference.spec import LOSS_TYPES  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def per_token(model, input_ids, attention_mask, labels):
    """Plain float64 per-token tensors of the next-token distributions, ``[B, T - 1]``: the log-prob of
    ``labels[:, 1:]``, the entropy, ``log Σ p²``, the mean logit, whether the label is the argmax; 0 where the
    label is -100."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    target = labels[:, 1:]
    mask = target != -100
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, target.clamp(min=0)[..., None])[..., 0]
    zero = lambda t: t.masked_fill(~mask, 0)  # noqa: E731
    return types.SimpleNamespace(
        log_probs=zero(logp),
        entropy=zero(-(logp_all.exp() * logp_all).sum(-1)),
        log_sum_sq_probs=zero(torch.logsumexp(2 * logp_all, -1)),
        mean_logits=zero(logits.mean(-1)),
        is_top1=(logits.argmax(-1) == target) & mask,
        label_mask=mask,
        loss=None,
        aux_loss=None,
    )


def exact_head(model, *, dtype=None):
    """Make ``model(..., labels=..., fused_lm_head=True)`` return `per_token`'s float64 tensors (cast to
    `dtype` if given) instead of TRL's float32 fused head."""
    original = model.forward

    def forward(*args, fused_lm_head=False, labels=None, **kwargs):
        if not fused_lm_head:
            return original(*args, labels=labels, **kwargs)
        kwargs.pop("use_cache", None)
        out = per_token(lambda **kw: original(**kw), kwargs.pop("input_ids", args[0] if args else None),
                        kwargs.pop("attention_mask", None), labels)  # fmt: skip
        if dtype is not None:
            for k in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
                setattr(out, k, getattr(out, k).to(dtype))
        return out

    model.forward = forward


def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got_loss, got_grads, want_loss, want_grads, *, rtol=1e-10, atol=1e-12):
    torch.testing.assert_close(got_loss.detach(), want_loss.detach().to(got_loss.dtype), rtol=rtol, atol=atol)
    assert got_grads.keys() == want_grads.keys() and got_grads
    for name, want in want_grads.items():
        torch.testing.assert_close(got_grads[name], want.to(got_grads[name].dtype), rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
    assert any(g.abs().max() > 0 for g in want_grads.values())


def assert_metrics(got: dict, want: dict, names, *, rtol=1e-9):
    for name in names:
        assert name in got, name
        assert got[name].item() == pytest.approx(want[name], rel=rtol, abs=1e-12), name


# ----------------------------------------------------------------------------------------------- DPO


@pytest.fixture(scope="module")
def dpo(tmp_path_factory):
    model = S.tiny_llama()
    ctx = S.quiet()
    try:
        args = trl.DPOConfig(**S.common_args(tmp_path_factory.mktemp("dpo"), per_device_train_batch_size=4))
        trainer = trl.DPOTrainer(
            model=model, ref_model=S.reference_of(model), args=args, processing_class=S.tokenizer(),
            train_dataset=S.paired_dataset(),
        )  # fmt: skip
    finally:
        ctx.__exit__(None, None, None)
    batch = next(iter(trainer.get_train_dataloader()))
    return trainer, batch


def configure_dpo(trainer, spec: PreferenceSpec) -> None:
    """TRL's attributes that `_compute_loss` reads, set from the spec (the trainer is built once)."""
    trainer.loss_types, trainer.loss_weights = list(spec.loss_type), list(spec.weights)
    trainer.beta, trainer.label_smoothing, trainer.ld_alpha = spec.beta, spec.label_smoothing, spec.ld_alpha
    trainer.f_divergence_type, trainer.f_alpha_divergence_coef = spec.f_divergence, spec.f_alpha
    trainer.use_weighting, trainer.args.discopop_tau = spec.use_weighting, spec.discopop_tau


DPO_TYPES = LOSS_TYPES["dpo"]
DPO_CASES = [dict(loss_type=t, label_smoothing=0.1 if t in ("robust", "aot", "aot_unpaired") else 0.0) for t in DPO_TYPES]
DPO_CASES[DPO_TYPES.index("exo_pair")]["label_smoothing"] = 1e-3
DPO_CASES += [
    dict(loss_type=("sigmoid", "bco_pair", "sft"), loss_weights=(0.8, 0.2, 1.0)),  # MPO
    dict(loss_type="sigmoid", f_divergence="forward_kl", beta=0.5),
    dict(loss_type="sigmoid_norm", f_divergence="js_divergence", beta=2.0),
    dict(loss_type="ipo", f_divergence="alpha_divergence", f_alpha=1.0),  # α = 1: reverse KL, as TRL
    dict(loss_type="sigmoid", ld_alpha=0.3),
    dict(loss_type=("ipo", "hinge"), ld_alpha=0.0, beta=0.3),
    dict(loss_type="sigmoid", use_weighting=True),
    dict(loss_type=("ipo", "discopop"), use_weighting=True, discopop_tau=0.5),
    dict(loss_type="robust", label_smoothing=0.2, ld_alpha=0.5, use_weighting=True),
]


def lmloss_dpo(trainer, batch, spec, *, dtype=torch.float64):
    ids, attn, comp = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    labels = ids.masked_fill(comp == 0, -100)
    cast = lambda t: t.to(dtype)  # noqa: E731
    policy = per_token(trainer.model, ids, attn, labels)
    with torch.no_grad():
        ref = per_token(trainer.ref_model, ids, attn, labels)
    stats = sequence_stats(
        cast(policy.log_probs), comp[:, 1:].bool(), spec, ref_token_logps=cast(ref.log_probs),
        log_sum_sq_probs=cast(policy.log_sum_sq_probs), entropy=cast(policy.entropy),
        mean_logits=cast(policy.mean_logits), is_top1=policy.is_top1,
    )  # fmt: skip
    return preference_loss(stats, spec)


DPO_METRICS = (
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
    "entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy",
)  # fmt: skip


@pytest.mark.parametrize("case", DPO_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_dpo_matches_trl_value_gradient_and_metrics(dpo, case):
    trainer, batch = dpo
    spec = PreferenceSpec(**case)
    configure_dpo(trainer, spec)
    exact_head(trainer.model)
    exact_head(trainer.ref_model)
    trainer._metrics["train"].clear()
    want = trainer._compute_loss(trainer.model, batch, False)
    want_grads = grads_of(trainer.model, want)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    out = lmloss_dpo(trainer, batch, spec)
    # exo_pair: TRL takes log ε of a float32 tensor (torch.tensor(label_smoothing)); lmloss in the input's dtype
    tol = dict(rtol=1e-6, atol=1e-7) if "exo_pair" in spec.loss_type else {}
    assert_same(out.loss, grads_of(trainer.model, out.loss), want, want_grads, **tol)
    assert_metrics(out.metrics, logged, DPO_METRICS)


def test_dpo_alpha_divergence_matches_trl_in_float32(dpo):
    """TRL's α-divergence raises in float64 (its clamp table has no float64); both sides get float32 per-token
    log-probs for the comparison."""
    trainer, batch = dpo
    spec = PreferenceSpec(loss_type=("sigmoid", "hinge"), f_divergence="alpha_divergence", f_alpha=0.3, beta=1.0)
    configure_dpo(trainer, spec)
    exact_head(trainer.model)
    exact_head(trainer.ref_model)
    with pytest.raises(KeyError):  # TRL's clamp table {float16, bfloat16, float32}[dtype]: no float64
        trainer._compute_loss(trainer.model, batch, False)
    assert torch.isfinite(lmloss_dpo(trainer, batch, spec).loss)  # lmloss: in the input's dtype
    exact_head(trainer.model, dtype=torch.float32)
    exact_head(trainer.ref_model, dtype=torch.float32)
    want = trainer._compute_loss(trainer.model, batch, False)
    want_grads = grads_of(trainer.model, want)
    out = lmloss_dpo(trainer, batch, spec, dtype=torch.float32)
    assert out.loss.dtype == torch.float32
    # float32 on both sides, lmloss's per-sequence sums accumulated in float64 (`lmloss.sequences`) and TRL's in
    # float32: the gradients agree to float32's rounding of a ~1e-2 sum (5e-7 seen), not to 1e-7
    assert_same(out.loss, grads_of(trainer.model, out.loss), want, want_grads, rtol=1e-5, atol=2e-6)


# ----------------------------------------------------------------------------------------------- KTO


@pytest.fixture(scope="module")
def kto(tmp_path_factory):
    model = S.tiny_llama()
    ctx = S.quiet()
    try:
        args = trl.KTOConfig(
            **S.common_args(tmp_path_factory.mktemp("kto"), per_device_train_batch_size=6),
            train_sampling_strategy="sequential",
        )  # fmt: skip
        trainer = trl.KTOTrainer(
            model=model, ref_model=S.reference_of(model), args=args, processing_class=S.tokenizer(),
            train_dataset=S.unpaired_dataset(),
        )  # fmt: skip
    finally:
        ctx.__exit__(None, None, None)
    exact_head(trainer.model)
    exact_head(trainer.ref_model)
    batch = next(iter(trainer.get_train_dataloader()))
    return trainer, batch


@pytest.mark.parametrize(
    "case",
    [dict(loss_type="kto"), dict(loss_type="kto", desirable_weight=1.5, undesirable_weight=0.7, beta=2.0),
     dict(loss_type="apo_zero_unpaired", beta=0.5)],
    ids=str,
)  # fmt: skip
def test_kto_matches_trl_value_gradient_and_metrics(kto, case):
    trainer, batch = kto
    spec = PreferenceSpec(family="kto", **case)
    trainer.loss_type, trainer.beta = spec.loss_type[0], spec.beta
    trainer.desirable_weight, trainer.undesirable_weight = spec.desirable_weight, spec.undesirable_weight
    trainer.calculate_KL = spec.loss_type == ("kto",)
    trainer._metrics["train"].clear()
    want = trainer._compute_loss(trainer.model, batch, False)
    want_grads = grads_of(trainer.model, want)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    def labels_of(ids, comp):
        return ids.masked_fill(comp == 0, -100)

    ids, attn, comp = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    policy = per_token(trainer.model, ids, attn, labels_of(ids, comp))
    with torch.no_grad():
        ref = per_token(trainer.ref_model, ids, attn, labels_of(ids, comp))
        kl_ids, kl_attn, kl_comp = batch["KL_input_ids"], batch["KL_attention_mask"], batch["KL_completion_mask"]
        kl_policy = per_token(trainer.model, kl_ids, kl_attn, labels_of(kl_ids, kl_comp))
        kl_ref = per_token(trainer.ref_model, kl_ids, kl_attn, labels_of(kl_ids, kl_comp))
    stats = sequence_stats(
        policy.log_probs, comp[:, 1:].bool(), spec, ref_token_logps=ref.log_probs, entropy=policy.entropy,
        mean_logits=policy.mean_logits, desirable=torch.as_tensor(batch["label"]).bool(),
    )  # fmt: skip
    if spec.loss_type == ("kto",):
        kl = sequence_stats(kl_policy.log_probs, kl_comp[:, 1:].bool(), spec, ref_token_logps=kl_ref.log_probs)
        stats.kl_logps, stats.ref_kl_logps = kl.logps, kl.ref_logps
    out = preference_loss(stats, spec)
    assert_same(out.loss, grads_of(trainer.model, out.loss), want, want_grads)
    names = ["rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "entropy",
             "logits/chosen", "logits/rejected"]  # fmt: skip
    assert_metrics(out.metrics, logged, names + ["kl"] if spec.loss_type == ("kto",) else names)
    if spec.loss_type == ("kto",):
        assert logged["kl"] > 0  # the KL term is exercised


# ----------------------------------------------------------------------------------------------- ORPO / CPO


def paired_experimental(kind: str, tmp_path_factory):
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    config, cls = {"orpo": (ORPOConfig, ORPOTrainer), "cpo": (CPOConfig, CPOTrainer)}[kind]
    ctx = S.quiet()
    try:
        args = config(**S.common_args(tmp_path_factory.mktemp(kind), per_device_train_batch_size=4),
                      max_length=32, remove_unused_columns=False)  # fmt: skip
        trainer = cls(model=S.tiny_llama(), args=args, processing_class=S.tokenizer(), train_dataset=S.paired_dataset())
    finally:
        ctx.__exit__(None, None, None)
    batch = next(iter(trainer.get_train_dataloader()))
    return trainer, batch


def lmloss_paired(trainer, batch, spec, *, padding_value):
    """ORPO / CPO from per-token log-probs: the preference sums over the completion labels, the NLL's over
    the completion (CPO) or the whole attended chosen sequence (ORPO, as TRL's)."""
    cat = trainer.concatenated_inputs(batch, padding_value=padding_value)
    ids, attn, labels = cat["concatenated_input_ids"], cat["concatenated_attention_mask"], cat["concatenated_labels"]
    every = ids.masked_fill(attn == 0, -100)
    assert torch.equal(every.masked_fill(labels == -100, -100), labels)  # labels: the completion's input ids
    tok = per_token(trainer.model, ids, attn, every)
    sft_mask = every[:, 1:] != -100 if spec.family == "orpo" else None
    stats = sequence_stats(tok.log_probs, labels[:, 1:] != -100, spec, sft_mask=sft_mask)
    return preference_loss(stats, spec)


@pytest.fixture(scope="module")
def orpo(tmp_path_factory):
    return paired_experimental("orpo", tmp_path_factory)


@pytest.fixture(scope="module")
def cpo(tmp_path_factory):
    return paired_experimental("cpo", tmp_path_factory)


REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                  "logps/rejected", "nll_loss")  # fmt: skip


@pytest.mark.parametrize("beta", [0.1, 2.0])
def test_orpo_matches_trl_value_gradient_and_metrics(orpo, beta):
    """TRL rounds the odds-ratio term to float32 (``.float()``); lmloss keeps float64: they agree to float32's
    rounding of that term (the NLL term, float64 in both, dominates the value)."""
    trainer, batch = orpo
    spec = PreferenceSpec(family="orpo", beta=beta)
    trainer.beta = beta
    want, logged = trainer.get_batch_loss_metrics(trainer.model, batch)
    want_grads = grads_of(trainer.model, want)
    out = lmloss_paired(trainer, batch, spec, padding_value=trainer.padding_value)
    assert_same(out.loss, grads_of(trainer.model, out.loss), want, want_grads, rtol=1e-5, atol=1e-6)
    assert_metrics(out.metrics, logged, (*REWARD_METRICS, "log_odds_ratio", "log_odds_chosen"), rtol=1e-6)


CPO_CASES = [
    dict(loss_type="sigmoid"), dict(loss_type="sigmoid", label_smoothing=0.1, cpo_alpha=0.5),
    dict(loss_type="hinge", beta=2.0), dict(loss_type="ipo"), dict(loss_type="simpo", simpo_gamma=0.7, beta=2.0),
    dict(loss_type="alphapo", alpha=0.3, beta=2.0), dict(loss_type="sigmoid", alpha=-0.2, cpo_alpha=0.0),
]  # fmt: skip


@pytest.mark.parametrize("case", CPO_CASES, ids=str)
def test_cpo_matches_trl_value_gradient_and_metrics(cpo, case):
    trainer, batch = cpo
    spec = PreferenceSpec(family="cpo", **case)
    trainer.loss_type, trainer.beta, trainer.label_smoothing = spec.loss_type[0], spec.beta, spec.label_smoothing
    trainer.cpo_alpha, trainer.simpo_gamma, trainer.alpha = spec.cpo_alpha, spec.simpo_gamma, spec.alpha
    want, logged = trainer.get_batch_loss_metrics(trainer.model, batch)
    want_grads = grads_of(trainer.model, want)
    out = lmloss_paired(trainer, batch, spec, padding_value=trainer.pad_token_id)
    assert_same(out.loss, grads_of(trainer.model, out.loss), want, want_grads)
    assert_metrics(out.metrics, logged, REWARD_METRICS)


def test_dpo_sft_with_wpo_weighting_raises_in_trl_and_is_defined_here(dpo):
    """A stated difference (docs/preference.md): TRL scales the expanded sft loss in place and raises; lmloss's
    value is mean(w_c w_r) · nll (checked against the formula in tests/test_preference.py)."""
    trainer, batch = dpo
    spec = PreferenceSpec(loss_type=("sigmoid", "sft"), use_weighting=True)
    configure_dpo(trainer, spec)
    exact_head(trainer.model)
    exact_head(trainer.ref_model)
    with pytest.raises(RuntimeError, match="memory location"):
        trainer._compute_loss(trainer.model, batch, False)
    assert torch.isfinite(lmloss_dpo(trainer, batch, spec).loss)


def test_stated_differences_empty_completion_and_alphapo_in_trl(cpo):
    """The other stated differences, on TRL's own functions: an empty completion's average log-prob is 0 / 0
    in ORPO's / CPO's ``get_batch_logps``, and AlphaPO's ``p.pow(-α)`` is inf where ``exp(logp)`` underflows
    (lmloss's values there: tests/test_preference.py)."""
    from trl.experimental.orpo import ORPOTrainer

    logits = torch.randn(1, 3, 5, dtype=torch.float64)
    assert torch.isnan(ORPOTrainer.get_batch_logps(logits, torch.full((1, 3), -100), average_log_prob=True)).all()
    trainer, _ = cpo
    trainer.loss_type, trainer.alpha, trainer.beta, trainer.label_smoothing = "sigmoid", 0.1, 0.1, 0.0
    losses, _, _ = trainer.cpo_loss(torch.tensor([-800.0], dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64))
    assert not torch.isfinite(losses).all()
