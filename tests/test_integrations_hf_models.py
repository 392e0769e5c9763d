"""`lmloss.integrations.hf.patch` over the causal LM classes of the installed transformers.

For each ``*ForCausalLM`` class whose config builds tiny, the patch either raises ``ValueError`` at patch
time or gives the loss of the unpatched model within 1e-5. The head's weight is drawn large (std 1, logits
of size ~6) and every head transform a config announces is set away from its neutral value (softcap 5,
multipliers 0.25 / 4 / 3), so that a transform the patch missed changes the loss.

docs/use_in_your_stack.md keeps the list of classes patched and refused; these tests hold the classes to it.
`make test` runs a representative subset (one class per kind of head); ``LMLOSS_HF_ALL_MODELS=1`` runs
every class (18 s to 80 s on a shared 2-core VM) and also fails on a class the page does not list.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmloss.integrations import hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

DOC = Path(__file__).resolve().parents[1] / "docs" / "use_in_your_stack.md"
# Sizes for every config class (a field a config does not know is ignored by its model).
TINY = dict(
    vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False, use_cache=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    n_shared_experts=1,
    d_model=32, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
    encoder_attention_heads=4, decoder_attention_heads=4,
    n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4,
    mamba_n_heads=4, mamba_d_head=8, mamba_d_ssm=32, mamba_d_state=16, mamba_chunk_size=8, mamba_expand=1,
    num_heads=8, state_size=16, chunk_size=8, n_groups=1,
)  # fmt: skip
# Head transforms away from neutral, set only where the class's default config has the field.
TRANSFORMS = dict(
    final_logit_softcapping=5.0, logits_soft_cap=5.0, output_logit_soft_cap=5.0, logit_scale=0.25,
    logits_scaling=4.0, lm_head_multiplier=0.25, output_multiplier=0.5, logits_mup_width_multiplier=3.0,
)  # fmt: skip
MAX_PARAMETERS = 2_000_000  # a config that stays larger than this at TINY sizes is not built
# One class per kind of head: plain (Llama), softcaps (Gemma 2, RecurrentGemma's logits_soft_cap),
# multipliers (Cohere, Granite, HyperCLOVAX, FalconH1), hidden scaling (Inkling), a body without attention
# mask (Mamba), a body called differently (OPT), and refusals: a seq2seq decoder with unshifted labels
# (Bart), a multi-layer head (Roberta, Electra).
SUBSET = [
    "LlamaForCausalLM", "Gemma2ForCausalLM", "RecurrentGemmaForCausalLM", "CohereForCausalLM",
    "GraniteForCausalLM", "HyperCLOVAXForCausalLM", "FalconH1ForCausalLM", "InklingForCausalLM",
    "MambaForCausalLM", "OPTForCausalLM", "BartForCausalLM", "RobertaForCausalLM", "ElectraForCausalLM",
]  # fmt: skip
ALL = sorted(n for n in dir(transformers) if n.endswith("ForCausalLM") and n != "AutoModelForCausalLM")
RUN_ALL = os.environ.get("LMLOSS_HF_ALL_MODELS") == "1"


def documented() -> dict[str, set[str]]:
    """The page's lists: ``<!-- hf-models: KIND -->`` followed by a paragraph of class names."""
    lists = {}
    for kind, body in re.findall(r"<!-- hf-models: (\w+) -->\n(.*?)(?:\n\n|$)", DOC.read_text(), re.S):
        lists[kind] = set(re.findall(r"\b(\w+ForCausalLM)\b", body))
    return lists


def build_tiny(name: str):
    """A builder for a tiny, deterministic `name` model in eval mode, or the reason it cannot be built."""
    cls = getattr(transformers, name)
    try:
        defaults = cls.config_class()
        computed = {k for k in TRANSFORMS if isinstance(getattr(type(defaults), k, None), property)}
        settable = [k for k in TRANSFORMS if hasattr(defaults, k) and k not in computed]
        config = cls.config_class(**TINY, **{k: TRANSFORMS[k] for k in settable})
        config._attn_implementation = "eager"
        with torch.device("meta"):
            size = sum(p.numel() for p in cls(config).parameters())
    except Exception as err:  # noqa: BLE001 - a config that does not build tiny is recorded, not a failure
        return f"tiny config does not build: {type(err).__name__}: {str(err)[:150]}"
    if size > MAX_PARAMETERS:
        return f"{size} parameters at tiny sizes (more than {MAX_PARAMETERS})"

    def build():
        torch.manual_seed(0)
        model = cls(config).float().eval()
        weight = getattr(model.get_output_embeddings(), "weight", None)
        if isinstance(weight, torch.Tensor):
            with torch.no_grad():
                weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(5))
        return model

    return build


@pytest.mark.parametrize("name", ALL if RUN_ALL else SUBSET)
def test_patch_refuses_the_class_or_gives_transformers_loss(name):
    if name not in ALL:
        pytest.skip(f"{name} is not in the installed transformers {transformers.__version__}")
    lists = documented()
    build = build_tiny(name)
    if isinstance(build, str):
        assert not RUN_ALL or name in lists["untested"], f"{name}: {build}; list it as untested in {DOC.name}"
        pytest.skip(build)
    reference = build()
    ids = torch.randint(3, 200, (2, 8), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            want = reference(input_ids=ids, labels=ids).loss
    except Exception as err:  # noqa: BLE001
        assert not RUN_ALL or name in lists["untested"], f"{name}'s own forward fails: {err}"
        pytest.skip(f"the tiny model's own forward fails: {type(err).__name__}: {str(err)[:150]}")
    try:
        patched = hf.patch(build(), logits_in_eval=False)  # eval mode (no dropout), fused loss
    except ValueError as err:
        assert name in str(err)
        assert name in lists["refused"], f"{name} was refused ({err}) but the page lists it as patched"
        return
    with torch.no_grad():
        got = patched(input_ids=ids, labels=ids)
    assert got.logits is None
    torch.testing.assert_close(got.loss, want, atol=1e-5, rtol=1e-5)
    assert name in lists["patched"], f"{name} is patched: add it to the page's list"


def test_the_pages_lists_are_disjoint_and_name_the_subset():
    lists = documented()
    assert set(lists) == {"patched", "refused", "untested"}
    patched, refused, untested = lists["patched"], lists["refused"], lists["untested"]
    assert not (patched & refused) and not (patched & untested) and not (refused & untested)
    assert set(SUBSET) <= patched | refused


def test_a_vlm_whose_softcap_lives_in_its_text_config_is_patched_with_it():
    """PaliGemma: ``config.text_config.final_logit_softcapping``, nothing at the top level."""
    text = transformers.Gemma2Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, final_logit_softcapping=5.0, pad_token_id=0,
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
        patch_size=8,
    )  # fmt: skip
    config = transformers.PaliGemmaConfig(text_config=text, vision_config=vision, image_token_id=255)
    config._attn_implementation = "eager"

    def build():
        torch.manual_seed(0)
        model = transformers.PaliGemmaForConditionalGeneration(config).float().eval()
        with torch.no_grad():
            model.lm_head.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(5))
        return model

    assert getattr(config, "final_logit_softcapping", None) is None
    ids = torch.randint(3, 200, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = build()(input_ids=ids, labels=ids).loss
        got = hf.patch(build(), logits_in_eval=False)(input_ids=ids, labels=ids)
    assert got.logits is None
    torch.testing.assert_close(got.loss, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["CohereForCausalLM", "RecurrentGemmaForCausalLM", "GraniteForCausalLM"])
def test_token_logprobs_apply_the_models_head_transform_then_the_temperature(name):
    build = build_tiny(name)
    reference = build()
    ids = torch.randint(3, 200, (2, 8), generator=torch.Generator().manual_seed(1))
    T = 0.7
    with torch.no_grad():
        logits = reference(input_ids=ids).logits.double()  # transformers' softcapped / scaled logits
        want = (logits[:, :-1] / T).log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        for model in (build(), hf.patch(build())):  # unpatched and patched models alike
            got = hf.token_logprobs(model, ids, temperature=T)
            torch.testing.assert_close(got[:, 1:].double(), want, atol=1e-5, rtol=1e-5)
