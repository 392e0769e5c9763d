"""`lmloss.integrations.verl` against verl 0.9.1's own code.

The fused head: tiny models built from configs go through verl's own ``apply_monkey_patch(...,
use_fused_kernels=True, fused_kernels_backend="lmloss")`` and are compared with verl's ``torch`` backend
(``dense_common.forward_with_torch_backend`` called on an unpatched copy: no class is patched for the
reference), values 1e-5 and every parameter's gradient 1e-4 in fp32, in verl's three layouts: packed
(``use_remove_padding``: ``[1, total_nnz]``, ``position_ids`` restarting per sequence, the engine's rolled
labels as ``shift_labels``), an Ulysses shard of it (the global roll sliced: the shard's last label is the
next shard's first token) and padded rows (the forward rolls ``input_ids``). Families: verl's dense forward
(Llama, Qwen2, Qwen3, Qwen3-MoE; Gemma 2's softcap against verl's unfused path, which applies it). verl
0.9.1's Qwen2/2.5-VL, Qwen3-VL and GLM-4V forwards do not import with this venv's transformers 5.24 (they
import output classes transformers removed; verl pins transformers < 5.11), so they are not run here.

The policy losses: every registered mode x ``loss_agg_mode`` x with / without ``global_batch_info`` against
``POLICY_LOSS_REGISTRY``'s function, float64, 1e-9 (value and d/dlog_prob), metrics included.

verl is imported by tests/verl_support.py (without its dependencies; ray stubbed). verl's
``apply_monkey_patch`` imports TRL's ``AutoModelForCausalLMWithValueHead`` when TRL is installed, which TRL
1.16 no longer has: importing `lmloss.integrations.verl` makes verl skip that step when TRL lacks the class,
so these tests run verl's patch with TRL 1.16 installed, as a worker with both extras would (`verl_env`
restores what verl's patch sets process-wide: the flash-attention hook, a class forward).
"""

from __future__ import annotations

import copy
import gc
import math
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

import lmloss  # noqa: E402
import verl_support  # noqa: E402
from lmloss.sampling import KeptSetWarning  # noqa: E402
from tracking_support import LargestAllocation  # noqa: E402

verl = verl_support.load()
patching = verl_support.load_model_patch()
LV = patching.integration
CA = verl.core_algos

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # verl 0.9.1's dense forward passes past_key_values= (the name before transformers 5.x, which verl pins)
    pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
]

VOCAB = 384
VALUES = dict(atol=1e-5, rtol=1e-5)
GRADS = dict(atol=1e-4, rtol=1e-4)
FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe"]


def tiny_model(arch: str, *, vocab: int = VOCAB, seed: int = 0, head_std: float = 0.2):
    common = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    config = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "qwen3": lambda: transformers.Qwen3Config(head_dim=8, **common),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **common
        ),
        "gemma2": lambda: transformers.Gemma2Config(
            head_dim=8, query_pre_attn_scalar=8, sliding_window=64, final_logit_softcapping=3.0, **common
        ),
    }[arch]()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # a head unlike the embedding (Gemma's larger, so that its softcap bites)
        model.lm_head.weight.normal_(0, head_std)
    return model


def packed(lengths=(5, 7, 4), *, vocab: int = VOCAB, seed: int = 1):
    """verl's rmpad layout: ``[1, total_nnz]`` ids, position ids restarting per sequence, rolled labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, pos, torch.roll(ids, -1, dims=1)


def model_inputs(layout: str, temperature: float):
    """The keyword arguments verl's FSDP engine passes to the fused forward, for each layout."""
    kw = dict(use_cache=False, temperature=temperature, return_dict=True)
    if layout == "padded":  # no rmpad: rows, an attention mask, no shift_labels (the forward rolls input_ids)
        g = torch.Generator().manual_seed(2)
        ids = torch.randint(0, VOCAB, (2, 10), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 7:] = 0
        return dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), **kw)
    ids, pos, rolled = packed()
    if layout == "ulysses":  # SP rank 0 of 2: its half of the packed tokens, the *global* roll's half
        half = ids.shape[1] // 2
        ids, pos, rolled = ids[:, :half], pos[:, :half], rolled[:, :half]
    return dict(input_ids=ids, attention_mask=None, position_ids=pos, shift_labels=rolled, **kw)


@pytest.fixture
def verl_env(monkeypatch):
    """verl's ``apply_monkey_patch`` as a worker runs it (TRL 1.16 installed beside it, see the module doc);
    whatever it sets process-wide (the flash-attention hook) is restored after the test."""
    from transformers.integrations import flash_attention

    monkeypatch.setattr(flash_attention, "_flash_attention_forward", flash_attention._flash_attention_forward)
    return patching.monkey_patch.apply_monkey_patch


def lmloss_model(reference, apply_monkey_patch, backend: str = "lmloss", *, use_remove_padding=True):
    model = copy.deepcopy(reference)
    apply_monkey_patch(model, use_remove_padding=use_remove_padding, use_fused_kernels=True,
                       fused_kernels_backend=backend)  # fmt: skip
    return model


def forward_and_backward(forward, model, kw, seed=3):
    """(log_probs, entropy, every parameter's gradient) of ``sum(a * log_probs + b * entropy)``."""
    out = forward(**kw)
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(out.log_probs.shape, generator=g), torch.randn(out.log_probs.shape, generator=g)
    model.zero_grad()
    (a * out.log_probs + b * out.entropy).sum().backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(got: dict, want: dict):
    assert got.keys() == want.keys() and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], **GRADS, msg=name)


# ------------------------------------------------------------------------------------------ the fused head


@pytest.mark.parametrize("layout", ["packed", "ulysses", "padded"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_the_lmloss_backend_equals_verls_torch_backend(arch, layout, verl_env):
    reference = tiny_model(arch)
    model = lmloss_model(reference, verl_env, use_remove_padding=layout != "padded")
    kw = model_inputs(layout, temperature=0.7)
    got, got_grads = forward_and_backward(model, model, kw)
    torch_forward = patching.dense_common.forward_with_torch_backend
    want, want_grads = forward_and_backward(lambda **k: torch_forward(reference, **k), reference, kw)
    assert type(got) is type(want)  # verl's CausalLMOutputForPPO
    assert got.log_probs.shape == got.entropy.shape == kw["input_ids"].shape
    assert got.log_probs.dtype == got.entropy.dtype == torch.float32
    torch.testing.assert_close(got.log_probs, want.log_probs, **VALUES)
    torch.testing.assert_close(got.entropy, want.entropy, **VALUES)
    assert_same_grads(got_grads, want_grads)
    if (
        layout == "ulysses"
    ):  # the shard's last position scores the next shard's first token, not its own first
        local = model(**{**kw, "shift_labels": None})
        assert not torch.allclose(local.log_probs[0, -1], got.log_probs[0, -1])
        torch.testing.assert_close(local.log_probs[0, :-1], got.log_probs[0, :-1])


def test_a_logit_softcap_is_applied_as_in_verls_unfused_path(verl_env):
    # verl's torch backend computes hidden @ W.T and leaves Gemma 2's final softcap out; lmloss applies the
    # model's own head transform: the log-probs and entropy of verl's unfused path (the model's logits)
    reference = tiny_model("gemma2", head_std=0.5)
    model = lmloss_model(reference, verl_env)
    kw = model_inputs("packed", temperature=0.7)
    got, got_grads = forward_and_backward(model, model, kw)

    def unfused(**k):
        logits = reference(input_ids=k["input_ids"], position_ids=k["position_ids"], use_cache=False).logits
        logits = logits[0] / k["temperature"]
        log_probs = patching.torch_functional.logprobs_from_logits(
            logits, k["shift_labels"][0], inplace_backward=False
        )
        entropy = patching.torch_functional.entropy_from_logits(logits)
        return type(got)(log_probs=log_probs[None], entropy=entropy[None])

    want, want_grads = forward_and_backward(unfused, reference, kw)
    torch.testing.assert_close(got.log_probs, want.log_probs, **VALUES)
    torch.testing.assert_close(got.entropy, want.entropy, **VALUES)
    assert_same_grads(got_grads, want_grads)
    verl_torch = patching.dense_common.forward_with_torch_backend(reference, **kw)
    assert not torch.allclose(verl_torch.log_probs, want.log_probs, atol=1e-3)  # the cap bites


def test_no_tokens_by_vocab_tensor_is_allocated(verl_env):
    vocab, hidden = 4096, 32
    reference = tiny_model("qwen2", vocab=vocab)
    model = lmloss_model(reference, verl_env, backend="lmloss:chunk_size=8")
    ids, pos, rolled = packed((50, 40, 30), vocab=vocab)
    kw = dict(
        input_ids=ids,
        position_ids=pos,
        shift_labels=rolled,
        temperature=1.0,
        return_dict=True,
        use_cache=False,
    )
    logits_bytes = ids.numel() * vocab * 4  # one fp32 [tokens, vocab] tensor
    torch_forward = patching.dense_common.forward_with_torch_backend
    largest = {}
    for name, forward in (("torch", lambda: torch_forward(reference, **kw)), ("lmloss", lambda: model(**kw))):
        tracker = LargestAllocation()
        with tracker:
            out = forward()
            (out.log_probs.sum() + out.entropy.sum()).backward()
        largest[name] = tracker.largest
    assert largest["torch"] >= logits_bytes  # the tracker sees verl's [tokens, vocab] logits
    # lmloss's largest: the [vocab, hidden] fp32 weight (and embedding) gradients; an [8, vocab] chunk is less
    assert largest["lmloss"] <= vocab * hidden * 4 < logits_bytes / 3


def _greedy_tokens(model, n: int, prompt: int = 3) -> torch.Tensor:
    """A sequence whose every token after the prompt is the model's argmax: inside any kept set."""
    ids = torch.randint(0, VOCAB, (1, prompt), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for _ in range(n - prompt):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize(
    "backend,warpers",
    [
        (
            "lmloss:top_k=${rollout.top_k},top_p=0.8",
            lambda: [transformers.TopKLogitsWarper(20), transformers.TopPLogitsWarper(0.8)],
        ),
        ("lmloss: min_p = 0.1 , top_k = -1", lambda: [transformers.MinPLogitsWarper(0.1)]),
    ],
    ids=["top_k+top_p", "min_p"],
)
def test_the_rollouts_truncation_reaches_the_actors_log_probs(backend, warpers, verl_env):
    # the reference: transformers' own sampling warpers (what generate() samples from) on the model's
    # logits / T, then log_softmax over what they keep
    backend = backend.replace("${rollout.top_k}", "20")  # what the interpolation in a verl YAML gives
    reference = tiny_model("llama")
    model = lmloss_model(reference, verl_env, backend=backend)
    ids = _greedy_tokens(reference, 14)
    pos = torch.arange(ids.shape[1])[None]
    kw = dict(input_ids=ids, position_ids=pos, shift_labels=torch.roll(ids, -1, 1), temperature=0.7,
              return_dict=True, use_cache=False)  # fmt: skip
    with pytest.warns(KeptSetWarning):  # the last position wraps around to the first token: outside the set
        out = model(**kw)
    scored = slice(2, -1)  # the greedy tokens' positions
    logits = reference(ids, use_cache=False).logits[0] / 0.7
    for warper in warpers():
        logits = warper(ids, logits)
    logp = logits.log_softmax(-1)
    want_lp = logp.gather(-1, kw["shift_labels"][0, :, None])[:, 0]
    want_ent = -(logp.exp() * logp.masked_fill(logits == float("-inf"), 0.0)).sum(-1)
    torch.testing.assert_close(out.log_probs[0, scored], want_lp[scored], **VALUES)
    torch.testing.assert_close(out.entropy[0, scored], want_ent[scored], **VALUES)
    full = patching.dense_common.forward_with_torch_backend(reference, **kw)
    assert (out.log_probs[0, scored] > full.log_probs[0, scored] + 1e-4).any()  # the truncation changed them
    g = torch.randn(ids.shape[1] - 3, generator=torch.Generator().manual_seed(5))
    model.zero_grad()
    reference.zero_grad()
    ((out.log_probs[0, scored] + out.entropy[0, scored]) * g).sum().backward()
    ((want_lp[scored] + want_ent[scored]) * g).sum().backward()
    assert_same_grads(
        {n: p.grad for n, p in model.named_parameters()}, {n: p.grad for n, p in reference.named_parameters()}
    )


def test_invariant_head_gives_the_same_bits_whatever_the_chunking(verl_env):
    reference = tiny_model("qwen3")
    ids, pos, rolled = packed((120, 90, 100))  # 310 tokens: several 128-row chunks
    kw = dict(
        input_ids=ids,
        position_ids=pos,
        shift_labels=rolled,
        temperature=0.7,
        return_dict=True,
        use_cache=False,
    )
    outs = []
    for backend in ("lmloss:invariant=true,chunk_size=128", "lmloss:invariant=true,chunk_size=none"):
        with torch.no_grad():
            outs.append(lmloss_model(reference, verl_env, backend=backend)(**kw))
    assert torch.equal(outs[0].log_probs, outs[1].log_probs) and torch.equal(outs[0].entropy, outs[1].entropy)
    with torch.no_grad():  # the model's hidden states through the op with the same options: the same bits
        hidden = reference.model(input_ids=ids, position_ids=pos, use_cache=False)[0]
        lp, ent = lmloss.linear_token_logprobs(hidden, reference.lm_head.weight, rolled, temperature=0.7,
                                               return_entropy=True, invariant=True)  # fmt: skip
    assert torch.equal(outs[0].log_probs, lp) and torch.equal(outs[0].entropy, ent)


def test_only_the_instance_is_patched_and_it_leaves_nothing_behind(verl_env, monkeypatch):
    reference = tiny_model("llama")
    cls = type(reference)
    transformers_forward = cls.__dict__["forward"]
    monkeypatch.setattr(cls, "forward", transformers_forward)  # restored after verl's class-wide patch below
    kw = model_inputs("packed", temperature=1.0)
    logits = reference(input_ids=kw["input_ids"], position_ids=kw["position_ids"], use_cache=False).logits[0]
    top5 = transformers.TopKLogitsWarper(5)(kw["input_ids"], logits).log_softmax(-1)
    want_a = top5.gather(-1, kw["shift_labels"][0, :, None])[:, 0]
    a = lmloss_model(reference, verl_env, backend="lmloss:top_k=5")
    assert LV.is_patched(a) and cls.__dict__["forward"] is transformers_forward
    assert a._verl_fused_kernels_backend == "lmloss"
    # a second model of the same class with verl's torch backend: verl sets the class's forward (every
    # LlamaForCausalLM's, the reference's too)
    b = lmloss_model(reference, verl_env, backend="torch")
    assert cls.__dict__["forward"] is patching.dense_common.forward_with_torch_backend
    with pytest.warns(KeptSetWarning):
        got_a = a(**kw)
    got_b = b(**kw)
    torch.testing.assert_close(got_a.log_probs[0], want_a, **VALUES)  # A: lmloss with its top-k
    torch.testing.assert_close(
        got_b.log_probs, patching.dense_common.forward_with_torch_backend(reference, **kw).log_probs
    )
    # unpatch: A's forward is its class's again (now verl's torch backend, set by B's patch)
    LV.unpatch(a)
    assert not LV.is_patched(a) and "forward" not in a.__dict__
    torch.testing.assert_close(a(**kw).log_probs, got_b.log_probs)
    # a patched model is freed with its last reference: nothing global holds it
    c = lmloss_model(reference, verl_env)
    c(**kw)
    gone = weakref.ref(c)
    del c
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize(
    "model_type",
    ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "qwen3_5", "qwen3_5_moe", "llama", "mistral"],
)
def test_each_family_gets_the_forward_verl_gives_it(model_type, monkeypatch):
    # verl's own dispatch (patch_forward_with_backends with the torch backend) on a stand-in model of a fresh
    # class; verl's VL modules do not import with this venv's transformers, so stand-ins take their place
    import sys
    import types

    for family in ("qwen2_vl", "qwen3_vl", "glm4v", "qwen3_5"):
        stub = types.ModuleType(f"verl.models.transformers.{family}")
        stub.forward_with_torch_backend = lambda self, **kw: None
        stub.forward_with_triton_backend = lambda self, **kw: None
        monkeypatch.setitem(sys.modules, stub.__name__, stub)
    model = type("StandIn", (), {"forward": None, "config": types.SimpleNamespace(model_type=model_type)})()
    patching.monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
    assert type(model).__dict__["forward"] is LV._verl_torch_forward(model)


def test_verls_own_backends_are_unchanged_by_the_import():
    # the head class verl's forwards build per call is lmloss's subclass now; its torch backend is verl's own
    from verl.utils.experimental import torch_functional as experimental

    assert experimental.FusedLinearForPPO is LV.FusedLinearForPPO
    assert issubclass(LV.FusedLinearForPPO, LV.FusedLinearForPPO.verl_class)
    g = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(2, 5, 16, generator=g), torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (2, 5), generator=g)
    ours = LV.FusedLinearForPPO(impl_backend="torch")(hidden, weight, labels, 0.9)
    verls = LV.FusedLinearForPPO.verl_class(impl_backend="torch")(hidden, weight, labels, 0.9)
    for a, b in zip(ours, verls):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="Unsupported FusedLinearForPPO backend"):
        LV.FusedLinearForPPO(impl_backend="cuda-magic")


def test_backend_strings_and_options_are_checked():
    assert LV.backend_options("lmloss") == LV.HeadOptions()
    opts = LV.backend_options(
        " lmloss: top_k=-1, top_p=1, min_p=0.0, invariant=true, chunk_size=auto, impl=torch "
    )
    assert opts == LV.HeadOptions(invariant=True, impl="torch")  # verl's "off" values are off
    assert LV.backend_options("lmloss:top_k=50,top_p=0.95,chunk_size=none").op_kwargs() == dict(
        top_k=50, top_p=0.95, min_p=None, invariant=False, chunk_size=None, impl="auto", memory_budget_mib=None
    )
    assert LV.backend_options("lmloss:memory_budget_mib=512").memory_budget_mib == 512.0
    for spec, match in [
        ("lmloss:top_q=0.9", "top_q"),
        ("lmloss:top_p", "top_p"),
        ("lmloss:top_k=many", "top_k='many'"),
        ("lmloss:top_p=1.5", r"top_p must be in \(0, 1\]"),
        ("lmloss:invariant=maybe", "invariant='maybe'"),
        ("lmloss:impl=cuda", "impl must be one of"),
        ("lmloss:chunk_size=0", "chunk_size must be"),
        ("lmloss:memory_budget_mib=0", "memory_budget_mib must be"),
        ("lmloss:top_p=0.9,top_p=0.95", "top_p is given twice"),
        ("lmloss:memory_budget_mib=lots", "memory_budget_mib='lots'"),
        ("liger", "not lmloss's"),
    ]:
        with pytest.raises(ValueError, match=match):
            LV.backend_options(spec)
    with pytest.raises(TypeError, match="top_k"):
        LV.HeadOptions(top_k=0.5)


def test_the_pages_config_lines_resolve_to_the_backend_and_its_options():
    # docs/use_in_your_stack.md: the three command-line lines and the YAML block interpolating the rollout's
    # values, resolved by OmegaConf as verl's config is
    import re
    from pathlib import Path

    from omegaconf import OmegaConf

    page = (Path(__file__).resolve().parents[1] / "docs" / "use_in_your_stack.md").read_text()
    lines = re.search(r"```bash\n(actor_rollout_ref.model.external_lib=.*?)```", page, flags=re.S)[1].split()
    assert dict(line.split("=", 1) for line in lines) == {
        "actor_rollout_ref.model.external_lib": LV.__name__,
        "actor_rollout_ref.model.use_fused_kernels": "True",
        "actor_rollout_ref.model.fused_kernel_options.impl_backend": LV.BACKEND,
    }
    config = OmegaConf.merge(
        OmegaConf.create(re.search(r"```yaml\n(.*?)```", page, flags=re.S)[1]),
        {"actor_rollout_ref": {"rollout": {"top_k": -1, "top_p": 0.95}}},  # verl's rollout config
    )
    model = config.actor_rollout_ref.model
    assert model.external_lib == LV.__name__ and model.use_fused_kernels is True
    assert LV.backend_options(model.fused_kernel_options.impl_backend) == LV.HeadOptions(
        top_p=0.95, invariant=True
    )


def test_patch_refuses_a_head_with_a_bias_and_keeps_other_backends_to_verl(verl_env, capsys):
    model = tiny_model("llama")
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(VOCAB))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*bias"):
        LV.patch(model)
    plain = tiny_model("llama")
    verl_env(plain, use_fused_kernels=False, fused_kernels_backend="lmloss")  # fused kernels off: verl skips
    assert not LV.is_patched(plain) and "Skipping monkey patch" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ policy losses

B, T = 4, 7
#: verl's options for each registered mode (clips asymmetric, each option off its default where read)
ACTOR = {
    "vanilla": dict(clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=2.5),
    "dppo_tv": dict(clip_ratio_low=0.08, clip_ratio_high=0.15, clip_ratio_c=2.5),
    "dppo_kl": dict(clip_ratio_low=0.02, clip_ratio_high=0.06, clip_ratio_c=2.5),
    "gspo": dict(clip_ratio_low=0.05, clip_ratio_high=0.3),
    "sapo": dict(tau_pos=0.9, tau_neg=1.3),
    "gpg": {},
    "clip_cov": dict(clip_ratio_low=0.1, clip_ratio_high=0.28),
    "kl_cov": {},
    "geo_mean": dict(clip_ratio_low=0.1, clip_ratio_high=0.28),
    "dro": {},
    "cispo": dict(clip_ratio_low=0.2, clip_ratio_high=0.3),
}
POLICY = {
    "clip_cov": dict(clip_cov_ratio=0.15, clip_cov_lb=0.2, clip_cov_ub=4.0),
    "kl_cov": dict(kl_cov_ratio=0.2, ppo_kl_coef=0.3),
    "dro": dict(dro_beta=0.3),
}
AGG_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]
#: what verl's actor sets per step on a DP rank (ppo_loss in verl/workers/utils/losses.py)
GLOBAL_BATCH = dict(dp_size=2, batch_num_tokens=37, global_batch_size=9, loss_scale_factor=11)
EXACT = dict(rtol=1e-9, atol=1e-12)


def actor_config(mode: str, global_batch: dict | None = None):
    config = verl_support.actor_config(verl, loss_mode=mode, policy_loss=POLICY.get(mode), **ACTOR[mode])
    config.global_batch_info.update(global_batch or {})
    return config


def rollout_batch(seed=0, *, mask_dtype=torch.bool):
    """Padded [B, T] tensors as verl's actor passes them: a row without a valid token, ratios beyond the
    clips and the dual clip, one sequence far off-policy as a whole."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.1
    old = lp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    old[:, 1::3] = lp[:, 1::3] - 1.5
    adv[:, 1] = -adv[:, 1].abs()
    old[2] = lp[2] - 0.25
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 1] = True
    mask[0, :] = False
    return lp.requires_grad_(True), old, adv, mask.to(mask_dtype)


def both(mode, agg, config, lp, old, adv, mask, is_weights=None, *, seed=11):
    """(verl's (loss, metrics, d/dlp), lmloss's) for the same call; clip_cov draws from torch's generator."""
    out = []
    for fn in (CA.POLICY_LOSS_REGISTRY[mode], LV.policy_loss_fn(mode)):
        torch.manual_seed(seed)
        loss, metrics = fn(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode=agg,
                           config=config, rollout_is_weights=is_weights)  # fmt: skip
        out.append((loss, metrics, torch.autograd.grad(loss, lp)[0]))
    return out


def assert_equal_losses(got, want, *, same_metric_keys=True):
    """Value and gradient at 1e-9; the metrics (verl computes them in float32) at 1e-6."""
    torch.testing.assert_close(got[0], want[0], **EXACT)
    torch.testing.assert_close(got[2], want[2], **EXACT)
    assert got[1].keys() == want[1].keys() if same_metric_keys else got[1].keys() <= want[1].keys()
    for key in got[1]:
        assert got[1][key] == pytest.approx(want[1][key], rel=1e-6, abs=1e-7), key


@pytest.mark.parametrize("global_batch", [None, GLOBAL_BATCH], ids=["one-process", "dp2-global-counts"])
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mode", [m for m in ACTOR if m != "geo_mean"])
def test_policy_loss_fn_equals_verls_function(mode, agg, global_batch):
    want, got = both(mode, agg, actor_config(mode, global_batch), *rollout_batch())
    assert_equal_losses(got, want)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_geo_mean_equals_verl_whatever_the_agg_mode(agg):
    # verl's GMPO ignores loss_agg_mode and the global counts: the mean over every row (empty ones too).
    # A float mask: where verl keeps its 1e-8 in the lengths (bool: the next test)
    want, got = both(
        "geo_mean", agg, actor_config("geo_mean", GLOBAL_BATCH), *rollout_batch(mask_dtype=torch.float64)
    )
    assert_equal_losses(got, want)


def test_geo_mean_with_verls_bool_mask():
    # verl adds its 1e-8 to the integer count of a bool mask in float32, where it rounds away
    want, got = both("geo_mean", "token-mean", actor_config("geo_mean"), *rollout_batch())
    assert_equal_losses(got, want)


def test_a_call_without_a_valid_token_gives_verls_nan_or_zero_and_its_gradient():
    # verl's one-process agg_loss divides by the call's count: 0 / 0 = NaN (token-sum: 0), the gradient 0;
    # with the global counts, its global denominators
    lp, old, adv, mask = rollout_batch()
    mask = torch.zeros_like(mask)
    for mode in ACTOR:
        for agg in AGG_MODES:
            for global_batch in (None, GLOBAL_BATCH):
                want, got = both(mode, agg, actor_config(mode, global_batch), lp, old, adv, mask)
                torch.testing.assert_close(got[0], want[0], equal_nan=True, **EXACT, msg=f"{mode} {agg}")
                torch.testing.assert_close(got[2], want[2], **EXACT)
                assert got[1] == want[1]
                if global_batch is None and mode != "geo_mean" and (agg != "token-sum" or mode == "sapo"):
                    assert want[0].isnan()  # the case is verl's NaN


@pytest.mark.parametrize("mode", list(ACTOR))
def test_rollout_is_weights_enter_as_in_verl(mode):
    lp, old, adv, mask = rollout_batch(1, mask_dtype=torch.float64 if mode == "geo_mean" else torch.bool)
    is_weights = (
        torch.rand(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 1.5 + 0.25
    )
    want, got = both(
        mode, "seq-mean-token-sum", actor_config(mode, GLOBAL_BATCH), lp, old, adv, mask, is_weights
    )
    assert_equal_losses(got, want)


BYPASS = {
    "ppo_clip": dict(loss_type="ppo_clip", rollout_is="token", rollout_is_threshold=1.2),
    "reinforce-tis": dict(loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.2),
    "reinforce-seq-icepop": dict(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold="0.5_1.5"),
    "reinforce-normalized": dict(loss_type="reinforce", rollout_is="token", rollout_is_threshold="0.5_1.5",
                                 rollout_is_batch_normalize=True),
    "reinforce-rejection": dict(loss_type="reinforce", rollout_is="token", rollout_is_threshold=2.0,
                                rollout_rs="token_k1", rollout_rs_threshold="0.7_1.4"),
}  # fmt: skip


def bypass(correction: dict, agg: str, mask_dtype=torch.bool):
    lp, _, adv, mask = rollout_batch(2, mask_dtype=mask_dtype)
    rollout = lp.detach() + 0.3 * torch.randn(
        B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(7)
    )
    config = verl_support.actor_config(
        verl, loss_mode="bypass_mode", clip_ratio_low=0.1, clip_ratio_high=0.28,
        policy_loss=dict(rollout_correction=verl.RolloutCorrectionConfig(bypass_mode=True, **correction)),
    )  # fmt: skip
    config.global_batch_info.update(GLOBAL_BATCH)
    return both("bypass_mode", agg, config, lp, rollout, adv, mask)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("case", list(BYPASS))
def test_bypass_mode_equals_verl(case, agg):
    want, got = bypass(BYPASS[case], agg)
    # the policy term's metrics (verl adds its rollout_corr/ diagnostics beside them)
    assert_equal_losses(got, want, same_metric_keys=False)
    assert "actor/ppo_kl" in got[1]


def test_bypass_mode_with_sequence_weights_normalized_over_the_batch():
    correction = dict(BYPASS["reinforce-seq-icepop"], rollout_is_batch_normalize=True)
    want, got = bypass(correction, "token-mean", mask_dtype=torch.float64)  # verl keeps its 1e-8 here
    assert_equal_losses(got, want, same_metric_keys=False)


def test_bypass_mode_with_sequence_weights_normalized_and_verls_bool_mask():
    want, got = bypass(dict(BYPASS["reinforce-seq-icepop"], rollout_is_batch_normalize=True), "token-mean")
    assert_equal_losses(got, want, same_metric_keys=False)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mode", list(ACTOR))
def test_policy_loss_fn_equals_verls_function_with_a_float64_mask(mode, agg):
    # verl keeps its 1e-8 in a float64 mask's counts (seq-mean-token-mean, geo_mean, clip_cov's means)
    want, got = both(mode, agg, actor_config(mode), *rollout_batch(4, mask_dtype=torch.float64))
    assert_equal_losses(got, want)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64], ids=["bool", "float64"])
def test_bypass_mode_keeps_the_masks_dtype_through_rejection_and_normalization(mask_dtype):
    # verl's rejected mask keeps response_mask's dtype, and with it where its 1e-8 is added to each count:
    # the sequence IS weights' means, the seq_mean criterion, the seq-mean-token-mean lengths
    correction = dict(BYPASS["reinforce-seq-icepop"], rollout_is_batch_normalize=True, rollout_rs="seq_mean_k1",
                      rollout_rs_threshold="0.95_1.05")  # fmt: skip
    want, got = bypass(correction, "seq-mean-token-mean", mask_dtype=mask_dtype)
    assert_equal_losses(got, want, same_metric_keys=False)
    assert want[1]["rollout_corr/rollout_rs_masked_fraction"] > 0  # the criterion rejects some tokens


def test_the_losses_are_registered_in_verls_registry(monkeypatch):
    registry = CA.POLICY_LOSS_REGISTRY
    names = [LV.POLICY_LOSS_PREFIX + mode for mode in LV.VERL_LOSS_MODES]
    assert set(registry) >= set(names) | set(LV.VERL_LOSS_MODES)  # verl's own entries stay
    assert all(registry[mode].__module__.startswith("verl.") for mode in LV.VERL_LOSS_MODES)
    fn = CA.get_policy_loss_fn("lmloss_gspo")  # what verl's actor calls for loss_mode=lmloss_gspo
    lp, old, adv, mask = rollout_batch(3)
    want, _ = CA.get_policy_loss_fn("gspo")(old, lp, adv, mask, "seq-mean-token-mean", actor_config("gspo"))
    torch.testing.assert_close(fn(old, lp, adv, mask, config=actor_config("gspo"))[0], want, **EXACT)
    assert LV.register_policy_losses() == names  # again: the same names, no error
    with pytest.raises(ValueError, match="non-empty"):
        LV.register_policy_losses("")
    monkeypatch.setitem(registry, "mine_cispo", lambda *a, **k: None)  # a name someone else registered
    with pytest.raises(ValueError, match="already has 'mine_cispo'"):
        LV.register_policy_losses("mine_")
    assert "mine_vanilla" not in registry  # nothing registered when one name is taken


# ------------------------------------------------------------- verl's clamps, masked values, defaults, options

PPO_KL_CLAMPED = ["vanilla", "cispo", "dppo_tv", "dppo_kl", "sapo"]


@pytest.mark.parametrize("log_ratio", [30.0, -30.0])
@pytest.mark.parametrize("mode", PPO_KL_CLAMPED)
def test_ppo_kl_clamps_the_log_ratio_to_twenty_as_verl(mode, log_ratio):
    lp, old, adv, mask = rollout_batch(5)
    old = old.clone()
    old[1, 1] = lp[1, 1].detach() - log_ratio  # a counted token (column 1 always counts) far off-policy
    want, got = both(mode, "token-mean", actor_config(mode), lp, old, adv, mask)
    assert_equal_losses(got, want)
    unclamped = (-(lp - old).detach()[mask]).mean().item()
    # the clamp bites: that token's -log-ratio counts as -+20, not -+30
    assert want[1]["actor/ppo_kl"] == pytest.approx(unclamped + math.copysign(10.0, log_ratio) / mask.sum().item())


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "dro", "sapo"])
def test_a_masked_nan_or_neg_inf_is_never_read_where_verl_reads_it(mode):
    # verl multiplies by the mask (NaN * 0 = NaN) where lmloss selects: with a NaN or -inf in a masked token's
    # old log-prob, advantage or log-prob, lmloss's loss, gradient and metrics are verl's on the same batch with
    # the finite value there, while verl's own call reads it (a NaN loss or gradient entry, for some of them)
    lp, old, adv, mask = rollout_batch(6)
    masked = tuple((~mask).nonzero()[-1].tolist())  # a masked token of a row with valid tokens
    assert mask[masked[0]].any()
    config = actor_config(mode)
    verl_clean, _ = both(mode, "token-mean", config, lp, old, adv, mask)
    verl_nan = []
    for field in ("old_log_prob", "advantages", "log_prob"):
        for poison in (float("nan"), float("-inf")):
            poisoned = {"old_log_prob": old.clone(), "advantages": adv.clone(), "log_prob": lp.detach().clone()}
            poisoned[field][masked] = poison
            p_lp = poisoned["log_prob"].requires_grad_(True)
            verl_poisoned, got = both(mode, "token-mean", config, p_lp, poisoned["old_log_prob"],
                                      poisoned["advantages"], mask)  # fmt: skip
            verl_nan.append(bool(verl_poisoned[0].isnan() or verl_poisoned[2].isnan().any()))
            assert_equal_losses(got, verl_clean)
    assert any(verl_nan)  # the departure is real: verl gives NaN on some of these batches


def test_sapo_takes_verls_tau_neg_when_the_config_leaves_it_unset():
    import types

    lp, old, adv, mask = rollout_batch(7)
    default = verl_support.actor_config(verl, loss_mode="sapo")  # tau_pos / tau_neg: verl's defaults
    want, got = both("sapo", "seq-mean-token-mean", default, lp, old, adv, mask)
    assert_equal_losses(got, want)
    # a config without the fields at all (a plain namespace, or a YAML without them): verl's defaults still
    unset = types.SimpleNamespace(**{k: v for k, v in vars(default).items() if k not in ("tau_pos", "tau_neg")})
    loss, _ = LV.policy_loss_fn("sapo")(old, lp, adv, mask, config=unset)
    torch.testing.assert_close(loss, want[0], **EXACT)
    other = verl_support.actor_config(verl, loss_mode="sapo", tau_neg=1.0)
    moved, _ = CA.POLICY_LOSS_REGISTRY["sapo"](old, lp, adv, mask, "seq-mean-token-mean", other)
    assert abs(moved.item() - want[0].item()) > 1e-3  # tau_neg matters on this batch


def test_backend_option_spellings():
    assert LV.backend_options("lmloss:top_k=0").top_k is None  # 0 (TRL's off) and verl's -1 are off
    assert LV.HeadOptions(top_k=0) == LV.HeadOptions(top_k=-1) == LV.HeadOptions()
    assert LV.backend_options("lmloss:top_k=1").top_k == 1
    for raw in ("1", "true", "True", "TRUE", "yes", "on"):
        assert LV.backend_options(f"lmloss:invariant={raw}").invariant is True, raw
    for raw in ("0", "false", "False", "no", "off"):
        assert LV.backend_options(f"lmloss:invariant={raw}").invariant is False, raw
    for raw in ("2", "maybe", "", "truee", "-1"):
        with pytest.raises(ValueError, match=f"invariant={raw!r}"):
            LV.backend_options(f"lmloss:invariant={raw}")


def tiny_scaled_model(arch: str):
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    config = {
        "cohere": lambda: transformers.CohereConfig(logit_scale=0.3, **common),
        "granite": lambda: transformers.GraniteConfig(logits_scaling=4.0, **common),
    }[arch]()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("arch", ["cohere", "granite"])
def test_a_models_own_logit_scale_is_applied_in_the_verl_head(arch, verl_env):
    reference = tiny_scaled_model(arch)
    model = lmloss_model(reference, verl_env)
    kw = model_inputs("packed", temperature=0.7)
    with torch.no_grad():
        got = model(**kw)
        logits = reference(input_ids=kw["input_ids"], position_ids=kw["position_ids"], use_cache=False).logits[0]
        logp = (logits / 0.7).log_softmax(-1)  # the model's own logits: its scale applied
        torch.testing.assert_close(got.log_probs[0], logp.gather(-1, kw["shift_labels"][0, :, None])[:, 0], **VALUES)
        torch.testing.assert_close(got.entropy[0], -(logp.exp() * logp).sum(-1), **VALUES)
        verl_torch = patching.dense_common.forward_with_torch_backend(reference, **kw)
    assert not torch.allclose(verl_torch.log_probs, got.log_probs, atol=1e-2)  # the scale bites


# ------------------------------------------------------- verl's engine step: the reference, the kept-set warning

TOP_P = 0.8


@pytest.fixture
def engine(verl_env, monkeypatch):
    loaded = verl_support.load_engine()
    monkeypatch.setattr(loaded.transformer_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(loaded.transformer_impl, "get_device_name", lambda: "cpu")
    return loaded


def rl_micro_batch(engine, actor, *, prompt_lens=(4, 3), response_lens=(6, 4), P=4, R=6):
    """verl's actor micro-batch for greedy responses of `actor` (inside any kept set): prompts left-padded,
    responses right-padded, through verl's own ``left_right_2_no_padding``."""
    g = torch.Generator().manual_seed(8)
    B = len(prompt_lens)
    prompts = torch.zeros(B, P, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    for b, (n_p, n_r) in enumerate(zip(prompt_lens, response_lens)):
        ids = torch.randint(0, VOCAB, (1, n_p), generator=g)
        with torch.no_grad():
            for _ in range(n_r):
                ids = torch.cat([ids, actor(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        prompts[b, P - n_p :], responses[b, :n_r] = ids[0, :n_p], ids[0, n_p:]
    return verl_layout(engine, prompts, responses, torch.tensor(prompt_lens), torch.tensor(response_lens))


def verl_layout(engine, prompts, responses, prompt_lens, response_lens):
    """[B, P] left-padded prompts and [B, R] right-padded responses -> verl's no-padding micro-batch."""
    P, R = prompts.shape[1], responses.shape[1]
    prompt_mask = torch.arange(P)[None] >= P - prompt_lens[:, None]
    response_mask = torch.arange(R)[None] < response_lens[:, None]
    attention_mask = torch.cat([prompt_mask, response_mask], 1).long()
    td = engine.tu.get_tensordict(
        {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
         "attention_mask": attention_mask, "response_mask": response_mask.long(),
         "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0)},
        non_tensor_dict={"temperature": 0.7, "use_remove_padding": True, "use_fused_kernels": True,
                         "calculate_entropy": True},
    )  # fmt: skip
    return engine.padding.left_right_2_no_padding(td)


def engine_log_probs(engine, model, micro_batch, *, forward_only: bool) -> torch.Tensor:
    """verl's FSDP engine step (``forward_step`` as ``infer_batch`` runs it) -> the response log-probs [B, R]."""
    step = verl_support.cpu_engine(engine.transformer_impl, model, forward_only=forward_only)
    _, output = step.forward_step(micro_batch, loss_function=None, forward_only=True)
    return engine.padding.no_padding_2_padding(output["model_output"]["log_probs"], micro_batch)


def warped_log_probs(model, micro_batch, warpers=()):
    """The reference: the model's logits / T over each row's tokens, transformers' warpers, log_softmax."""
    out = []
    for ids, n_r in zip(micro_batch["input_ids"].unbind(), micro_batch["response_mask"].sum(-1).tolist()):
        logits = model(ids[None], use_cache=False).logits[0] / 0.7
        for warper in warpers:
            logits = warper(ids[None], logits)
        lp = logits.log_softmax(-1)[:-1].gather(-1, ids[1:, None])[:, 0]
        out.append(torch.nn.functional.pad(lp[-n_r:], (0, micro_batch["responses"].shape[1] - n_r)))
    return torch.stack(out)


def test_the_reference_is_scored_on_its_full_distribution_and_the_kl_stays_finite(engine, verl_env):
    actor_model, ref_model = tiny_model("llama"), tiny_model("llama", seed=1)  # the actor has moved away
    backend = f"lmloss:top_p={TOP_P}"
    actor, ref = lmloss_model(actor_model, verl_env, backend), lmloss_model(ref_model, verl_env, backend)
    batch = rl_micro_batch(engine, actor_model)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        want_actor = warped_log_probs(actor_model, batch, [transformers.TopPLogitsWarper(TOP_P)])
        want_ref = warped_log_probs(ref_model, batch)
        ref_truncated = warped_log_probs(ref_model, batch, [transformers.TopPLogitsWarper(TOP_P)])
    assert torch.isneginf(ref_truncated[mask]).any()  # a truncated reference would score some token -inf
    got_ref = engine_log_probs(engine, ref, batch, forward_only=True)
    torch.testing.assert_close(got_ref[mask], want_ref[mask], **VALUES)
    got_actor = engine_log_probs(engine, actor, batch, forward_only=False)  # the actor's engine: truncated
    torch.testing.assert_close(got_actor[mask], want_actor[mask], **VALUES)
    for kl_type in ("kl", "abs", "mse", "low_var_kl"):  # verl's KL penalty on the two: finite everywhere
        kl = CA.kl_penalty(got_actor, got_ref, kl_type)
        assert torch.isfinite(kl[mask]).all(), kl_type
        want = CA.kl_penalty(want_actor, want_ref, kl_type)
        torch.testing.assert_close(kl[mask], want[mask], **VALUES)


def test_the_kept_set_warning_counts_response_tokens_only(engine, verl_env):
    import warnings

    plain = tiny_model("llama")
    model = lmloss_model(plain, verl_env, f"lmloss:top_p={TOP_P}")
    batch = rl_micro_batch(engine, plain)
    step = verl_support.cpu_engine(engine.transformer_impl, model, forward_only=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KeptSetWarning)  # every response token is inside: silent
        _, output = step.forward_step(batch, loss_function=None, forward_only=True)
    assert torch.isneginf(output["model_output"]["log_probs"].values()).any()  # prompt positions are -inf
    # a response's last token outside the kept set (the least likely after its context): counted, once
    responses = batch["responses"].clone()
    with torch.no_grad():
        context = batch["input_ids"].unbind()[0]
        n_p = context.numel() - int(batch["response_mask"][0].sum())
        responses[0, 5] = plain(context[None], use_cache=False).logits[0, n_p + 4].argmin()
    response_lens = batch["response_mask"].sum(-1)
    prompt_lens = batch["input_ids"].offsets().diff() - response_lens
    moved = verl_layout(engine, batch["prompts"], responses, prompt_lens, response_lens)
    with pytest.warns(KeptSetWarning, match=r"1 label\(s\) of the 10 counted \(verl's response_mask\)"):
        got = engine_log_probs(engine, model, moved, forward_only=False)
    assert torch.isneginf(got).sum() == 1 and torch.isneginf(got[0, 5])


def test_verl_and_trl_share_one_environment(verl_env, monkeypatch):
    # TRL 1.16 has no AutoModelForCausalLMWithValueHead: verl's apply_monkey_patch (run by verl_env in every
    # test here) skips its state_dict patch instead of failing its import; a TRL that has the class gets it
    trl = pytest.importorskip("trl")
    assert not hasattr(trl, "AutoModelForCausalLMWithValueHead")
    assert patching.monkey_patch.is_trl_available() is False
    with pytest.raises(ImportError, match="AutoModelForCausalLMWithValueHead"):  # what verl's patch did
        from trl import AutoModelForCausalLMWithValueHead  # noqa: F401
    model = lmloss_model(tiny_model("llama"), verl_env)
    assert LV.is_patched(model)

    class ValueHead(torch.nn.Module):  # an older TRL's class
        pass

    monkeypatch.setattr(trl, "AutoModelForCausalLMWithValueHead", ValueHead, raising=False)
    assert patching.monkey_patch.is_trl_available() is True
    lmloss_model(tiny_model("llama"), verl_env)
    assert "state_dict" in ValueHead.__dict__  # verl's patch of that class ran
