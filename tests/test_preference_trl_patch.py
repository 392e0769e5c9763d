"""`lmloss.integrations.trl.patch` on TRL's preference trainers against the same trainers unpatched.

Each case trains two SGD steps twice from the same fp32 tiny Llama (tests/preference_support.py): once with
TRL's own loss code and head, once patched (lmloss's fused head and `lmloss.preference`). The logged losses,
every metric both log, and every parameter after the two steps agree to fp32 rounding (1e-5 relative).
DPO's 15 loss types run together in one MPO combination (each with its own weight), so that one pair of runs
covers them all; the f-divergences with LD-DPO and the precomputed reference in a second.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

import preference_support as S  # noqa: E402
from lmloss.integrations import trl as lmloss_trl  # noqa: E402
from lmloss.integrations import trl_preference  # noqa: E402
from lmloss.preference.spec import LOSS_TYPES  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def build(kind: str, tmp_path, options: dict):
    ctx = S.quiet()
    try:
        model = S.tiny_llama(torch.float32)
        common = S.common_args(tmp_path, per_device_train_batch_size=4 if kind != "kto" else 6, max_steps=2)
        if kind == "dpo":
            trainer = trl.DPOTrainer(
                model=model, ref_model=S.reference_of(model), args=trl.DPOConfig(**common, **options),
                processing_class=S.tokenizer(), train_dataset=S.paired_dataset(8),
            )  # fmt: skip
        elif kind == "kto":
            args = trl.KTOConfig(**common, train_sampling_strategy="sequential", **options)
            trainer = trl.KTOTrainer(
                model=model, ref_model=S.reference_of(model), args=args, processing_class=S.tokenizer(),
                train_dataset=S.unpaired_dataset(12),
            )  # fmt: skip
        else:
            from trl.experimental.cpo import CPOConfig, CPOTrainer
            from trl.experimental.orpo import ORPOConfig, ORPOTrainer

            config, cls = {"orpo": (ORPOConfig, ORPOTrainer), "cpo": (CPOConfig, CPOTrainer)}[kind]
            args = config(**common, max_length=32, remove_unused_columns=False, **options)
            trainer = cls(model=model, args=args, processing_class=S.tokenizer(), train_dataset=S.paired_dataset(8))
    finally:
        ctx.__exit__(None, None, None)
    return trainer


def train(kind: str, options: dict, *, patched: bool, tmp_path, monkeypatch):
    trainer = build(kind, tmp_path / f"{kind}-{patched}", options)
    calls = []
    if patched:
        assert lmloss_trl.patch(trainer) is trainer and lmloss_trl.is_patched(trainer)
        loss_of = trl_preference.preference_loss
        monkeypatch.setattr(trl_preference, "preference_loss", lambda *a, **k: calls.append(1) or loss_of(*a, **k))
        # the TRL head (its model(..., fused_lm_head=True)) must not run: every log-prob through lmloss's
        monkeypatch.setattr(trainer.model, "forward", lambda *a, **k: pytest.fail("TRL's head ran"), raising=False)
    ctx = S.quiet()
    try:
        trainer.train()
    finally:
        ctx.__exit__(None, None, None)
    assert len(calls) == (2 if patched else 0)
    if patched:
        lmloss_trl.unpatch(trainer)
        assert not lmloss_trl.is_patched(trainer)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return logs, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


ALL_DPO = LOSS_TYPES["dpo"]
CASES = [
    ("dpo", dict(loss_type=list(ALL_DPO), loss_weights=[0.05 * (i + 1) for i in range(len(ALL_DPO))],
                 label_smoothing=0.1, beta=0.5)),
    ("dpo", dict(loss_type=["sigmoid", "ipo"], f_divergence_type="js_divergence", ld_alpha=0.5,
                 precompute_ref_log_probs=True, use_weighting=True)),
    ("kto", dict(loss_type="kto", beta=0.5, desirable_weight=1.3, precompute_ref_log_probs=True)),
    ("kto", dict(loss_type="apo_zero_unpaired")),
    ("orpo", dict(beta=0.5)),
    ("cpo", dict(loss_type="simpo", alpha=0.2, cpo_alpha=0.5, label_smoothing=0.1)),
]  # fmt: skip


@pytest.mark.parametrize("kind,options", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_patched_preference_trainer_matches_trl(kind, options, tmp_path, monkeypatch):
    want_logs, want_params = train(kind, options, patched=False, tmp_path=tmp_path, monkeypatch=monkeypatch)
    got_logs, got_params = train(kind, options, patched=True, tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert len(want_logs) == len(got_logs) == 2
    for got, want in zip(got_logs, want_logs):
        shared = (got.keys() & want.keys()) - {"epoch", "step", "grad_norm", "learning_rate"}
        assert {"loss", "rewards/chosen", "logps/rejected"} <= shared
        # every metric TRL logs, the head's by-products included
        assert {"logits/chosen", "logits/rejected"} <= shared and got.keys() == want.keys()
        assert kind != "dpo" or "mean_token_accuracy" in shared
        for name in sorted(shared):
            assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), name
    for name, want in want_params.items():
        torch.testing.assert_close(got_params[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    initial = dict(S.tiny_llama(torch.float32).named_parameters())
    assert any(not torch.equal(initial[n], p) for n, p in want_params.items())  # the two steps trained something


def test_patch_refuses_what_it_does_not_reproduce(tmp_path):
    trainer = build("dpo", tmp_path, {})
    trainer.aux_loss_enabled = True  # a MoE model's router loss
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        lmloss_trl.patch(trainer)
    assert not lmloss_trl.is_patched(trainer)
    trainer.aux_loss_enabled = False
    with pytest.raises(ValueError, match="sampler_truncation"):
        lmloss_trl.patch(trainer, sampler_truncation=True)
    lmloss_trl.patch(trainer)
    with pytest.raises(ValueError, match="already patched"):
        lmloss_trl.patch(trainer)
    assert trl_preference.preference_spec(trainer).loss_type == ("sigmoid",)
    # TRL's deprecated return_outputs=True: the loss and the model's outputs with logits, as TRL returns them
    batch = next(iter(trainer.get_train_dataloader()))
    loss, outputs = trainer.compute_loss(trainer.model, batch, return_outputs=True)
    assert loss.requires_grad and outputs.logits.shape == (*batch["input_ids"].shape, S.VOCAB)
