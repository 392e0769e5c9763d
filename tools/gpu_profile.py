"""Where a lent GPU's time goes, for the bench rows of issue #26: the card's two ceilings, then a
``torch.profiler`` table of device kernels per lmloss row, written as JSON (argv[1]) and printed short.

Run by ``tools/gpu_tune.py`` after the bench (it needs a CUDA device); lmloss's Triton rows only. The ceilings: a device-to-device
copy of 4 GiB (bytes read + written over the time) and a bf16 ``[8192, 4096] x [4096, 128256]`` matmul
(the fused workload's forward matmul), each the median of 10 event-timed runs after 3 warm-ups.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from lmloss.bench.impls import Case, build_impls, make_inputs


def _event_median_ms(fn, warmup: int = 3, repeats: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def ceilings() -> dict[str, float]:
    src = torch.randn(2**30, device="cuda")  # 4 GiB fp32
    dst = torch.empty_like(src)
    copy_ms = _event_median_ms(lambda: dst.copy_(src))
    src = dst = None  # free the 8 GiB before the matmul's operands
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 128256, device="cuda", dtype=torch.bfloat16)
    mm_ms = _event_median_ms(lambda: a @ b)
    return {
        "copy_ms": copy_ms,
        "copy_tb_s": 2 * 4 * 2**30 / (copy_ms * 1e-3) / 1e12,
        "matmul_ms": mm_ms,
        "matmul_tflop_s": 2 * 8192 * 4096 * 128256 / (mm_ms * 1e-3) / 1e12,
    }


def _device_time_us(event) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def kernel_table(case: Case, names: list[str], kernels: list[str], chunks: list, iters: int = 3) -> list[dict]:
    """Per row: total device ms per step, and the kernels that take it (ms and launches per step)."""
    inputs = make_inputs(case)
    rows = []
    for impl in build_impls(case.workload, case.device, names, chunks, kernels):
        if impl.step is None:
            continue
        for _ in range(2):
            impl.step(impl.inputs_for_run(inputs))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                impl.step(impl.inputs_for_run(inputs))
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if _device_time_us(e) > 0]
        events.sort(key=_device_time_us, reverse=True)
        kernels_ = [
            {"name": e.key[:90], "ms": _device_time_us(e) / 1e3 / iters, "calls": e.count / iters} for e in events
        ]
        rows.append(
            {"row": impl.label, "tokens": case.tokens, "device_ms": sum(k["ms"] for k in kernels_), "kernels": kernels_}
        )
        for t in inputs.leaves.values():
            t.grad = None
    del inputs
    torch.cuda.empty_cache()
    return rows


def main(out_path: str) -> None:
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    result["ceilings"] = ceilings()
    print(json.dumps(result["ceilings"]), flush=True)
    logits = Case("logits", 32768, 128256, "bfloat16", "cuda")
    fused = Case("fused", 8192, 128256, "bfloat16", "cuda", 4096)
    result["rows"] = []
    for case, names, kernels, chunks in (
        (logits, ["chunked", "inplace", "entropy"], ["triton"], [1024]),
        (fused, ["fused", "fused-ppo", "fused-distill", "matmul-floor", "distill-floor"], ["triton"], ["auto"]),
    ):
        try:
            result["rows"] += kernel_table(case, names, kernels, chunks)
        except Exception as err:  # keep what was measured; say what failed
            result.setdefault("errors", []).append(f"{case}: {type(err).__name__}: {err}")
            print(f"profile of {names} failed: {type(err).__name__}: {err}", flush=True)
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    for row in result["rows"]:
        top = ", ".join(f"{k['name'][:40]} {k['ms']:.2f}ms x{k['calls']:g}" for k in row["kernels"][:4])
        print(f"{row['row']:<26} {row['device_ms']:8.2f} ms | {top}")


if __name__ == "__main__":
    main(sys.argv[1])
