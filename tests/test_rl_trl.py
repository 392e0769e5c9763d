"""lmloss.rl against TRL 1.16's ``GRPOTrainer`` loss, its own code on the same tensors, float64.

One small real ``GRPOTrainer`` (a 1-layer Llama of width 8; no training, no download) is built per module.
Its ``_compute_loss`` (TRL 1.16 keeps the whole loss there: every ``loss_type``, ``delta``,
``top_entropy_quantile``, ``off_policy_mask_threshold``, the vLLM importance-sampling ratio, the KL and the
entropy bonus) runs with its ``_get_per_token_logps_and_entropies`` replaced by one returning the test's
float64 log-probs (requiring grad) and entropies, so TRL's loss and its gradient w.r.t. those log-probs are
compared with lmloss's. The vLLM importance-sampling ratio is TRL's too: ``_generate_and_score_completions``
runs with ``_generate`` replaced by fixed completions and vLLM's sampling log-probs. One process, one
gradient-accumulation step: TRL's per-micro-batch normalisers are then the global ones.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import lmloss  # noqa: E402
from lmloss.rl import policy_loss  # noqa: E402

REL = dict(rtol=1e-7, atol=1e-12)
B, T, MAX_COMPLETION = 4, 6, 8
LENGTHS = [6, 4, 2, 5]  # every completion has a token (TRL's grpo / luspo / dr_grpo then divide by B = S)
VOCAB = 64
#: TRL's options and what this file resets them to before each loss (the trainer is shared).
TRAINER_ATTRS = dict(
    loss_type="grpo", beta=0.0, epsilon_low=0.2, epsilon_high=0.28, importance_sampling_level="token",
    top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False, vllm_importance_sampling_correction=False,
    _entropy_bonus_enabled=False, entropy_coef=0.0, use_adaptive_entropy=False, max_completion_length=MAX_COMPLETION,
    current_gradient_accumulation_steps=1,
)  # fmt: skip
TRAINER_ARGS = dict(
    delta=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.25, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
    vespo_k_neg=3.0, vespo_lambda_neg=2.0, use_bias_correction_kl=False,
)  # fmt: skip


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t1", eos_token="t2", unk_token="t0"
    )


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, pad_token_id=1, eos_token_id=2, bos_token_id=3,
    )  # fmt: skip
    torch.manual_seed(0)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("grpo")), per_device_train_batch_size=B, num_generations=2,
        max_completion_length=MAX_COMPLETION, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
        disable_tqdm=True,
    )  # fmt: skip
    return trl.GRPOTrainer(
        model=transformers.AutoModelForCausalLM.from_config(config), reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args, processing_class=_tokenizer(), train_dataset=datasets.Dataset.from_dict({"prompt": ["t5 t6"]}),
    )  # fmt: skip


def _configure(trainer, **over):
    for k, v in TRAINER_ATTRS.items():
        setattr(trainer, k, over.pop(k, v))
    for k, v in TRAINER_ARGS.items():
        setattr(trainer.args, k, over.pop(k, v))
    assert not over, over


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.2
    t = dict(
        lp=lp,
        old=lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
        ref=lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
        sampling=lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
        # float32 values: TRL takes the entropy quantile in float32 (then the same threshold in float64)
        ent=(torch.rand(B, T, generator=g) * 2).double(),
        adv=torch.tensor([1.1, -0.7, 0.4, -1.3], dtype=torch.float64),
        mask=torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None],
    )
    t["sampling"] = (
        t["sampling"].float().double()
    )  # vLLM's log-probs reach TRL as python floats: float32 tensors
    t["old"][:, 2] = lp[:, 2] - 0.6  # ratios e^0.6 beyond every clip used below
    t["old"][:, 3] = lp[:, 3] + 0.6
    return t


def _inputs(t, **extra):
    mask = t["mask"].long()
    return dict(
        prompt_ids=torch.full((B, 2), 5), prompt_mask=torch.ones(B, 2, dtype=torch.long),
        completion_ids=torch.full((B, T), 7), completion_mask=mask, advantages=t["adv"], num_items_in_batch=mask.sum(),
        old_per_token_logps=t["old"], ref_per_token_logps=t["ref"], sampling_per_token_logps=t["sampling"], **extra,
    )  # fmt: skip


def trl_loss(trainer, t, lp, inputs=None, **config):
    """TRL's ``_compute_loss`` on `lp` (requires grad) and the entropies of `t`."""
    _configure(trainer, **config)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (lp, t["ent"], None)
    try:
        return trainer._compute_loss(trainer.model, _inputs(t) if inputs is None else inputs)
    finally:
        del trainer._get_per_token_logps_and_entropies


def lmloss_loss(t, lp, **kw):
    adv = t["adv"][:, None].expand(B, T)
    return policy_loss(lp, t["old"], adv, t["mask"], **kw)[0]


def _check(got, want, lp):
    torch.testing.assert_close(got, want, **REL)
    g, w = torch.autograd.grad(got, lp, retain_graph=True)[0], torch.autograd.grad(want, lp)[0]
    torch.testing.assert_close(g, w, **REL)


#: TRL's loss_type -> lmloss (one process): the objective and the weights.
LOSS_TYPES = {
    "grpo": dict(loss_agg_mode="seq-mean-token-mean"),
    "bnpo": dict(loss_agg_mode="token-mean"),
    "dr_grpo": dict(loss_agg_mode="seq-mean-token-sum-norm", horizon=MAX_COMPLETION),
    "dapo": dict(loss_agg_mode="token-mean"),
    "luspo": dict(loss_agg_mode="seq-mean-token-sum"),
    "cispo": dict(
        loss_mode="cispo", clip_ratio_low=1.0, clip_ratio_high=0.3
    ),  # TRL's epsilon_high caps r itself
    "sapo": dict(loss_mode="sapo", loss_agg_mode="seq-mean-token-mean", tau_pos=1.0, tau_neg=1.25),
    "vespo": dict(loss_mode="vespo"),
}


@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
def test_every_loss_type_equals_trl_with_its_kl(loss_type, trainer):
    t = _tensors()
    lp = t["lp"].clone().requires_grad_(True)
    config = dict(loss_type=loss_type, beta=0.04)
    kw = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, **LOSS_TYPES[loss_type]}
    if loss_type == "cispo":
        config["epsilon_high"] = 1.3
    want = trl_loss(trainer, t, lp, **config)
    got = lmloss_loss(t, lp, ref_logprobs=t["ref"], kl_loss_type="k3", kl_loss_coef=0.04, **kw)
    _check(got, want, lp)


def test_the_kl_weighted_by_the_ratio_is_trl_default_bias_correction(trainer):
    t = _tensors(1)
    lp = t["lp"].clone().requires_grad_(True)
    want = trl_loss(trainer, t, lp, loss_type="dapo", beta=0.1, use_bias_correction_kl=True)
    got = lmloss_loss(t, lp, clip_ratio_high=0.28, ref_logprobs=t["ref"], kl_loss_type="k3", kl_loss_coef=0.1,
                      kl_importance_weighted=True)  # fmt: skip
    _check(got, want, lp)


@pytest.mark.parametrize("loss_type", ["grpo", "luspo", "dapo"])
def test_sequence_level_importance_sampling_is_gspo(loss_type, trainer):
    # TRL differentiates exp(mean log-ratio) through every token, GSPO's s_t = sg[s] exp(lp_t - sg[lp_t])
    # only through its own: the same gradient when each sequence's tokens share their weight (these modes)
    t = _tensors(2)
    lp = t["lp"].clone().requires_grad_(True)
    want = trl_loss(trainer, t, lp, loss_type=loss_type, importance_sampling_level="sequence")
    got = lmloss_loss(t, lp, loss_mode="gspo", clip_ratio_low=0.2, clip_ratio_high=0.28,
                      **{k: v for k, v in LOSS_TYPES[loss_type].items() if k != "loss_mode"})  # fmt: skip
    _check(got, want, lp)


def test_delta_is_the_dual_clip(trainer):
    t = _tensors(3)
    t["old"][:, 4] = t["lp"][:, 4] - 0.8  # r = e^0.8 > delta where the advantage is negative
    lp = t["lp"].clone().requires_grad_(True)
    want = trl_loss(trainer, t, lp, loss_type="grpo", delta=1.6)
    got = lmloss_loss(t, lp, loss_agg_mode="seq-mean-token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28,
                      clip_ratio_c=1.6)  # fmt: skip
    _check(got, want, lp)
    without = lmloss_loss(
        t, lp, loss_agg_mode="seq-mean-token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    assert not torch.isclose(without, got, rtol=1e-4)  # delta bites here


@pytest.mark.parametrize("quantile", [0.4, 0.5], ids=["between_two_entropies", "at_an_entropy"])
def test_top_entropy_quantile_is_a_pg_mask(trainer, quantile):
    # 17 valid tokens: at 0.5 the threshold is the 9th smallest entropy itself (position 8 of 0..16), a token
    # TRL keeps (entropy >= threshold)
    t = _tensors(4)
    lp = t["lp"].clone().requires_grad_(True)
    want = trl_loss(trainer, t, lp, loss_type="grpo", top_entropy_quantile=quantile, beta=0.04)
    keep = lmloss.rl.high_entropy_mask(t["ent"], t["mask"], quantile)
    assert 0 < keep.sum() < t["mask"].sum()
    at_threshold = t["ent"][t["mask"]] == t["ent"][t["mask"]].float().quantile(1 - quantile).double()
    assert int(at_threshold.sum()) == (1 if quantile == 0.5 else 0)
    got = lmloss_loss(t, lp, loss_agg_mode="seq-mean-token-mean", clip_ratio_high=0.28, pg_mask=keep,
                      ref_logprobs=t["ref"], kl_loss_type="k3", kl_loss_coef=0.04)  # fmt: skip
    _check(got, want, lp)


def test_off_policy_mask_threshold_is_a_pg_mask(trainer):
    t = _tensors(5)
    t["sampling"][1] = t["lp"][1] + 0.5  # a negative-advantage sequence far off-policy: dropped
    lp = t["lp"].clone().requires_grad_(True)
    want = trl_loss(trainer, t, lp, loss_type="dapo", off_policy_mask_threshold=0.2)
    keep = lmloss.rl.off_policy_sequence_mask(lp, t["sampling"], t["adv"][:, None].expand(B, T), t["mask"],
                                              threshold=0.2)  # fmt: skip
    assert keep[t["mask"]].any() and not keep[1].any()
    got = lmloss_loss(t, lp, clip_ratio_high=0.28, pg_mask=keep)
    _check(got, want, lp)


def _trl_off_policy_keep(t, threshold):
    """TRL's own ``GRPOTrainer.get_off_policy_mask`` (per sequence), as a per-token bool mask of the valid tokens."""
    keep = trl.GRPOTrainer.get_off_policy_mask(t["adv"][:, None], t["lp"], t["sampling"], t["mask"].double(), threshold)
    return keep.bool().expand(B, T) & t["mask"]


def test_off_policy_mask_keeps_a_zero_advantage_sequence_however_far_off_policy_as_trl():
    t = _tensors(6)
    t["adv"] = torch.tensor([1.1, 0.0, -0.4, -1.3], dtype=torch.float64)
    t["sampling"][1] = t["lp"][1] + 2.0  # its mean KL is 2.0, ten times the threshold; its advantage is 0
    t["sampling"][3] = t["lp"][3] + 2.0  # the same, with a negative advantage: dropped
    keep = lmloss.rl.off_policy_sequence_mask(t["lp"], t["sampling"], t["adv"][:, None].expand(B, T), t["mask"],
                                              threshold=0.2)  # fmt: skip
    want = _trl_off_policy_keep(t, 0.2)
    assert want[1][t["mask"][1]].all() and not want[3].any()
    assert torch.equal(keep, want)


def test_off_policy_mask_of_a_padded_sequence_is_the_mean_over_its_valid_tokens_as_trl():
    t = _tensors(7)
    t["adv"] = torch.tensor([1.1, -0.7, -0.4, -1.3], dtype=torch.float64)
    # sequence 2 has 2 valid tokens of 6: their mean KL 0.3 is above the threshold 0.2, while the mean over all 6
    # positions (the padding's KL 0) would be 0.1, below it
    t["sampling"][2] = t["lp"][2]
    t["sampling"][2, :2] = t["lp"][2, :2] + 0.3
    keep = lmloss.rl.off_policy_sequence_mask(t["lp"], t["sampling"], t["adv"][:, None].expand(B, T), t["mask"],
                                              threshold=0.2)  # fmt: skip
    want = _trl_off_policy_keep(t, 0.2)
    assert LENGTHS[2] == 2 and not want[2].any()
    assert torch.equal(keep, want)


def test_the_entropy_bonus_of_a_token_mean_loss_type(trainer):
    # TRL's bonus is a token mean whatever the loss type; lmloss weighs it like the policy term: the same
    # for the token-mean types
    t = _tensors(6)
    lp = t["lp"].clone().requires_grad_(True)
    want = trl_loss(trainer, t, lp, loss_type="dapo", _entropy_bonus_enabled=True, entropy_coef=0.03)
    got = lmloss_loss(t, lp, clip_ratio_high=0.28, entropy=t["ent"], entropy_coeff=0.03)
    _check(got, want, lp)


VLLM_MODES = [("token_truncate", None, 1.3), ("token_mask", 0.8, 1.3), ("sequence_truncate", None, 1.5),
              ("sequence_mask", 0.5, 1.5)]  # fmt: skip


def _lmloss_is(t, mode, clip_min, clip_max):
    level = mode.split("_")[0]
    cu = None if level == "token" else torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    m = t["mask"]
    args = (t["old"][m], t["sampling"][m], m[m])
    if mode.endswith("truncate"):
        w = lmloss.rl.truncated_is_weights(*args, cap=clip_max, level=level, cu_seqlens=cu)
    else:
        w = lmloss.rl.masked_is_weights(*args, lower=clip_min, upper=clip_max, level=level, cu_seqlens=cu)
    out = torch.zeros(B, T, dtype=torch.float64)
    out[m] = w
    return out


# vespo folds the ratio into its sequence weight (TRL refuses it a sequence-level ratio)
VLLM_CASES = [("grpo", *m) for m in VLLM_MODES] + [("vespo", *m) for m in VLLM_MODES[:2]]


@pytest.mark.parametrize(
    "loss_type,mode,clip_min,clip_max", VLLM_CASES, ids=[f"{c[0]}-{c[1]}" for c in VLLM_CASES]
)
def test_vllm_importance_sampling_modes(loss_type, mode, clip_min, clip_max, trainer):
    t = _tensors(7)
    # TRL's own ratio: _generate_and_score_completions with vLLM's sampling log-probs (and old log-probs)
    _configure(trainer, use_vllm=True, vllm_importance_sampling_correction=True, loss_type=loss_type)
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = clip_min, clip_max
    ids = [list(range(10, 10 + n)) for n in LENGTHS]
    trainer._generate = lambda prompts: ([[5, 6]] * B, ids, None, ["c"] * B, [t["sampling"][i, :n].tolist() for i, n in enumerate(LENGTHS)], {}, None, None)  # fmt: skip  # noqa: E501
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (t["old"], None, None)
    try:
        scored = trainer._generate_and_score_completions([{"prompt": "t5 t6"}] * B)
    finally:
        del trainer._generate, trainer._get_per_token_logps_and_entropies
    ratio = scored["importance_sampling_ratio"].expand(B, T)
    w = _lmloss_is(t, mode, clip_min, clip_max)
    torch.testing.assert_close(w[t["mask"]], ratio[t["mask"]], **REL)
    assert (w[t["mask"]] != torch.exp(t["old"] - t["sampling"])[t["mask"]]).any()  # the clip bites
    lp = t["lp"].clone().requires_grad_(True)
    inputs = _inputs(t, importance_sampling_ratio=scored["importance_sampling_ratio"])
    want = trl_loss(
        trainer, t, lp, inputs, loss_type=loss_type, use_vllm=True, vllm_importance_sampling_correction=True
    )
    kw = {"clip_ratio_high": 0.28, **LOSS_TYPES[loss_type]}
    got = lmloss_loss(t, lp, rollout_is_weights=w, **kw)
    _check(got, want, lp)
    assert not math.isclose(got.item(), lmloss_loss(t, lp, **kw).item())
