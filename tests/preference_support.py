"""Tiny offline models, tokenizer, datasets and trainers for the preference tests (no downloads).

A 1-layer Llama (hidden 16, vocab 64) built from a config; a word-level tokenizer made here; paired and
unpaired datasets of a few prompts with completions of different lengths (so that LD-DPO's tail, the IPO
averages and padding are exercised); and TRL 1.16's own trainers built on them.
"""

from __future__ import annotations

import copy
import warnings

import torch

VOCAB = 64
PAD, EOS, BOS = 1, 2, 3


def tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    # special tokens are not words' prefixes ("t1" would split "t13"): added tokens match inside words
    words = {"<unk>": 0, "<pad>": PAD, "</s>": EOS, "<s>": BOS, **{f"w{i}": i for i in range(4, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def tiny_llama(dtype: torch.dtype = torch.float64, seed: int = 0):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
        tie_word_embeddings=False,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # a sharper head: log-probs far from uniform, losses away from their flat regions
        model.lm_head.weight.mul_(8.0)
    return model


def reference_of(model, seed: int = 1):
    """A copy of `model` with perturbed weights: the log-ratios to it are not zero."""
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    return ref


def _words(i: int, n: int) -> str:
    # a leading space: TRL joins prompt and completion texts as they are
    return " " + " ".join(f"w{8 + (5 * i + 3 * j) % (VOCAB - 8)}" for j in range(n))


def paired_dataset(n: int = 4):
    import datasets

    return datasets.Dataset.from_dict({
        "prompt": [_words(i, 2 + i % 2) for i in range(n)],
        "chosen": [_words(10 + i, 2 + (i * 3) % 4) for i in range(n)],
        "rejected": [_words(20 + i, 1 + (i * 2) % 5) for i in range(n)],
    })  # fmt: skip


def unpaired_dataset(n: int = 6):
    import datasets

    return datasets.Dataset.from_dict({
        "prompt": [_words(i, 2 + i % 2) for i in range(n)],
        "completion": [_words(30 + i, 1 + (i * 3) % 4) for i in range(n)],
        "label": [i % 3 != 1 for i in range(n)],
    })  # fmt: skip


def common_args(tmp_path, **kw) -> dict:
    return dict(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, logging_steps=1, save_strategy="no", seed=0,
        disable_tqdm=True, bf16=False, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant",
        dataloader_drop_last=False, **kw,
    )  # fmt: skip


def quiet():
    """TRL's and transformers' construction warnings (deprecated options, experimental modules) are noise here."""
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("ignore")
    return ctx
