"""A training step of a Hugging Face Llama-shaped model on one GPU (issue #34; `tools/gpu_check.sh` calls it).

    python tools/gpu_step.py --device cuda --out OUT            # on a lent GPU: vocab 128256, hidden 2048
    python tools/gpu_step.py --device cpu --tiny                # a dry run of the script here

Model: ``LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, 2 layers, 32 heads, 8 KV
heads)``, untied head, bf16 weights, SDPA attention, a batch of 4 x 4096 tokens whose labels are the inputs
(every token counts). One step is forward, backward and ``AdamW.step()``, CUDA-event timed; peak is
``max_memory_allocated`` over the timed steps (the model, its gradients and AdamW's state included). Variants,
each on a fresh model with the same seed (one at a time, so each peak is its own), in two passes
(A B C ... A B C ...; the median over both passes' timed steps; the passes' spread is reported):

* ``unpatched``: transformers' own loss over ``[tokens, vocab]`` logits;
* ``lmloss``: `lmloss.integrations.hf.patch(model)` at the default memory budget, and at smaller budgets
  (``memory_budget_mib=``, below the ``[V, H]`` fp32 weight-gradient accumulator's 1002 MiB: the weight pass);
* ``lmloss bf16 dW``: ``patch(model, weight_grad_dtype=torch.bfloat16)`` (and at the smaller budgets): the
  weight gradient accumulated in bf16 over the chunks (Liger's precision), no fp32 accumulator;
* ``liger``: Liger-Kernel's fused linear cross-entropy on this instance (``apply_liger_kernel_to_llama(
  fused_linear_cross_entropy=True, model=...)``, its other kernels off: only the head differs).

Then verl's PPO forward (log-probs and entropy of the same batch, padded layout, temperature 1, forward and
backward of ``sum(log_probs) + 0.01 sum(entropy)``, no optimizer) through verl 0.9.1's ``apply_monkey_patch``
with ``fused_kernels_backend="torch"`` (verl's own) against ``"lmloss"``. Writes ``OUT/step.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import lmloss
import lmloss.integrations.hf


def _config(tiny: bool):
    import transformers

    shape = (
        dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
        if tiny
        else dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                  num_key_value_heads=8)
    )  # fmt: skip
    config = transformers.LlamaConfig(num_hidden_layers=2, tie_word_embeddings=False, max_position_embeddings=8192,
                                      **shape)  # fmt: skip
    config._attn_implementation = "sdpa"
    return config


def _model(config, device, dtype):
    import transformers

    torch.manual_seed(0)
    with device:  # initialised on the device: a CPU init of the 2 x 128256 x 2048 embeddings takes seconds
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype=dtype).train()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def _time_steps(step, device, warm: int, timed: int) -> tuple[list[float], float | None, float]:
    for _ in range(warm):
        loss = step()
    _sync(device)
    _reset_peak(device)
    times = []
    for _ in range(timed):
        _sync(device)
        start = time.perf_counter()
        loss = step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times, _peak_mib(device), float(loss)


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def hf_variants(budgets):
    """name -> (prepare(model) -> model, environment)."""

    def liger(model):
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=False,
                                    swiglu=False, model=model)  # fmt: skip
        return model

    variants = {"unpatched": lambda m: m}
    for budget in budgets:
        name = "lmloss" if budget is None else f"lmloss @{budget:g} MiB"
        variants[name] = lambda m, b=budget: lmloss.integrations.hf.patch(m, memory_budget_mib=b)
    # Liger's precision and memory: the weight gradient accumulated in bf16 (no fp32 [V, H] accumulator)
    for budget in [None, *budgets]:
        name = "lmloss bf16 dW" if budget is None else f"lmloss bf16 dW @{budget:g} MiB"
        variants[name] = lambda m, b=budget: lmloss.integrations.hf.patch(
            m, weight_grad_dtype=torch.bfloat16, memory_budget_mib=b
        )
    variants["liger"] = liger
    return variants


def _batch(config, args, device) -> torch.Tensor:
    b, t = (4, 4096) if not args.tiny else (2, 128)
    return torch.randint(0, config.vocab_size, (b, t), generator=torch.Generator().manual_seed(1)).to(device)


def _measure(variants: dict, args, device, value: str) -> dict:
    """Each variant's ``make() -> step`` (a fresh model each time), `args.passes` passes over the variants in
    turn: every timed step's ms, each pass's median, peak and the step's returned `value`. A variant that fails
    (a peer's import) is recorded with its error; the others are measured."""
    rows: dict[str, dict] = {}
    for p in range(args.passes):
        for name, make in variants.items():
            row = rows.setdefault(name, {"ms": [], "pass_median_ms": [], "peak_mib": [], value: []})
            step = None
            try:
                step = make()
                times, peak, result = _time_steps(step, device, args.warm, args.steps)
                row["ms"] += times
                row["pass_median_ms"].append(statistics.median(times))
                row["peak_mib"].append(peak)
                row[value].append(result)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            finally:
                step = None  # the model and its optimizer go with it
                _free(device)
            print(f"pass {p} {name}: {row['pass_median_ms'][-1:]} ms peak {row['peak_mib'][-1:]} "
                  f"{row.get('error', '')}", flush=True)  # fmt: skip
    return rows


def hf_step(args, device, dtype) -> dict:
    config = _config(args.tiny)
    ids = _batch(config, args, device)

    def make(prepare):
        model = prepare(_model(config, device, dtype))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    variants = hf_variants([None, *args.budgets])
    return _measure({name: lambda p=prepare: make(p) for name, prepare in variants.items()}, args, device, "loss")


def verl_step(args, device, dtype) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import verl_support

    patching = verl_support.load_model_patch()
    patching.monkey_patch.is_trl_available = lambda: False  # verl's TRL import needs a class TRL 1.16 dropped
    config = _config(args.tiny)
    ids = _batch(config, args, device)
    mask = torch.ones_like(ids)
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1), use_cache=False,
              temperature=1.0, return_dict=True)  # fmt: skip

    def make(backend):
        model = _model(config, device, dtype)
        patching.monkey_patch.apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True,
                                                 fused_kernels_backend=backend)  # fmt: skip

        def step():
            out = model(**kw)
            (out.log_probs.sum() + 0.01 * out.entropy.sum()).backward()
            model.zero_grad(set_to_none=True)
            return out.log_probs.detach().double().sum()

        return step

    backends = ("torch", "lmloss", *(f"lmloss:memory_budget_mib={b:g}" for b in args.budgets))
    return _measure({b: lambda b=b: make(b) for b in backends}, args, device, "log_prob_sum")


def _summary(rows: dict, base: str) -> None:
    ref = rows.get(base, {}).get("ms")
    ref_ms = statistics.median(ref) if ref else None
    for name, row in rows.items():
        if not row.get("ms"):
            print(f"  {name:24s} {row.get('error', 'no samples')}")
            continue
        ms = statistics.median(row["ms"])
        spread = (max(row["pass_median_ms"]) - min(row["pass_median_ms"])) / ms
        peak = max(p for p in row["peak_mib"]) if row["peak_mib"][0] is not None else float("nan")
        row.update(median_ms=ms, pass_spread=spread, max_peak_mib=peak)
        ratio = f"{ms / ref_ms:5.2f}x {base}" if ref_ms else ""
        print(f"  {name:24s} {ms:8.1f} ms (passes ±{spread:.1%}) peak {peak:9.0f} MiB  {ratio}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    p.add_argument("--tiny", action="store_true", help="small shapes (a dry run of the script)")
    p.add_argument("--budgets", default="512,256", help="lmloss's smaller memory budgets, MiB (comma list)")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--skip", default="", help="hf and/or verl")
    args = p.parse_args()
    args.budgets = [float(b) for b in args.budgets.split(",") if b]
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "tiny": args.tiny}  # fmt: skip
    out = Path(args.out) if args.out else None
    for part, fn, base in (("hf", hf_step, "liger"), ("verl", verl_step, "torch")):
        if part in args.skip:
            continue
        try:
            result[part] = fn(args, device, dtype)
        except Exception as e:
            result[part] = {"error": f"{type(e).__name__}: {e}"[:400]}
            print(part, result[part]["error"], flush=True)
            continue
        print(f"{part} (median of {args.passes} x {args.steps} steps):")
        _summary(result[part], base)
        if out:
            out.mkdir(parents=True, exist_ok=True)
            (out / "step.json").write_text(json.dumps(result, indent=1))
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "step.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
