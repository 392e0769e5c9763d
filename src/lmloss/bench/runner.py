"""The sweep: for each shape and implementation, one tracked run (peak memory + correctness check), then timed
runs without the tracker. Out-of-memory, real or simulated, is a result like any other and the sweep goes on.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterable

import torch

import lmloss
from lmloss.bench.impls import WORKLOADS, Case, Impl, Inputs, build_impls, make_inputs
from lmloss.profiling.memory import LiveTensorTracker, MiB, peak_memory

#: Agreement with naive is judged as a relative error (see `relative_error`) under these bounds. fp32 leaves
#: room for a different summation order; bf16/fp16 gradients are stored in the input dtype (8 / 11 bits).
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}


@dataclasses.dataclass
class SweepConfig:
    """What to run. Lists per workload where the default sweep differs between them."""

    workloads: list[str]
    tokens: dict[str, list[int]]
    vocab: list[int]
    hidden: list[int]
    dtypes: dict[str, list[str]]
    chunks: dict[str, list[int | str | None]]
    impls: dict[str, list[str]]
    device: str = "cpu"
    repeats: int = 3
    warmup: int = 0
    max_memory_mib: float | None = None
    seed: int = 0

    def cases(self) -> list[Case]:
        out = []
        for w in self.workloads:
            hiddens: Iterable[int | None] = self.hidden if w == "fused" else [None]
            for dtype, vocab, hidden, tokens in itertools.product(
                self.dtypes[w], self.vocab, hiddens, self.tokens[w]
            ):
                out.append(Case(w, tokens, vocab, dtype, self.device, hidden))
        return out


@dataclasses.dataclass
class Result:
    """One row of the results: a case, an impl, and what was measured.

    status: ``ok`` | ``oom`` | ``skipped`` | ``error``. Times are of forward+backward in milliseconds
    (median, min, max over `repeats`). peak_mib = input_mib + delta_mib, where delta is the peak above
    the inputs while the step ran. Ratios are against naive (and, for the fused workload, the matmul floor)
    of the same case. check: ``ref`` (naive itself), ``ok``, ``FAIL`` (loss or a gradient disagrees with naive beyond `tolerance`),
    ``n/a`` (no loss to check) or ``no-ref`` (naive did not run).
    """

    workload: str
    tokens: int
    vocab: int
    hidden: int | None
    dtype: str
    device: str
    impl: str
    chunk: str
    status: str = "ok"
    time_ms: float | None = None
    time_min_ms: float | None = None
    time_max_ms: float | None = None
    times_ms: list[float] = dataclasses.field(default_factory=list)
    input_mib: float | None = None
    delta_mib: float | None = None
    peak_mib: float | None = None
    time_vs_naive: float | None = None
    mem_vs_naive: float | None = None
    time_vs_floor: float | None = None
    check: str = "n/a"
    loss: float | None = None
    loss_err: float | None = None
    grad_err: float | None = None
    tolerance: float | None = None
    note: str = ""

    @property
    def label(self) -> str:
        return self.impl if self.chunk == "-" else f"{self.impl}[{self.chunk}]"


class SimulatedOOM(MemoryError):
    """Raised inside a tracked run when live bytes pass the ``--max-memory-mib`` cap."""


class _CappedTracker(LiveTensorTracker):
    """`LiveTensorTracker` that raises `SimulatedOOM` at the first allocation that passes `cap_bytes`.

    Raising at the allocation, like a real allocator, stops a doomed configuration early instead of
    running it to the end and judging afterwards.
    """

    def __init__(self, cap_bytes: int | None) -> None:
        super().__init__()
        self.cap_bytes = cap_bytes
        self.exceeded = False

    def on_live_change(self, delta: int, op: str | None) -> None:
        if delta > 0 and self.cap_bytes is not None and self.live > self.cap_bytes and not self.exceeded:
            self.exceeded = True
            raise SimulatedOOM(f"{self.live / MiB:.0f} MiB above the inputs passes the cap at {op}")


def _is_oom(err: BaseException) -> bool:
    if isinstance(err, MemoryError | torch.cuda.OutOfMemoryError):
        return True
    # The CPU allocator reports a failed malloc as a RuntimeError.
    return isinstance(err, RuntimeError) and (
        "out of memory" in str(err) or "can't allocate memory" in str(err)
    )


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |got - ref| / max |ref|``: one number per tensor, insensitive to its scale.

    Computed in the tensors' own dtype over blocks of rows: fp32 copies of a [8192, 32000] bf16 gradient
    would cost seconds and gigabytes per check, and rounding the difference to bf16 changes it by 2^-8 of
    itself, far below any tolerance used here.
    """
    got, ref = got.detach().reshape(-1, got.shape[-1]), ref.detach().reshape(-1, ref.shape[-1])
    if got.dtype != ref.dtype:
        got = got.to(ref.dtype)
    err = scale = 0.0
    for s in range(0, ref.shape[0], 1024):
        r = ref[s : s + 1024]
        scale = max(scale, float(r.abs().max()))
        err = max(err, float(torch.sub(got[s : s + 1024], r).abs_().max()))
    return err / max(scale, 1e-30)


@dataclasses.dataclass
class _Outcome:
    loss: torch.Tensor | None
    grads: dict[str, torch.Tensor]


def _tracked_run(impl: Impl, inputs: Inputs, case: Case, cap_mib: float | None) -> tuple[int, _Outcome]:
    """Run once under the memory tracker; return (bytes above the inputs at the peak, loss and grads)."""
    x = inputs.fresh() if impl.mutates_inputs else inputs.reuse()
    if case.device.startswith("cuda"):
        with peak_memory(case.device) as mem:
            loss = impl.step(x)
        delta = mem.peak_bytes
        if cap_mib is not None and (delta + inputs.nbytes) / MiB > cap_mib:
            raise SimulatedOOM(f"peak {(delta + inputs.nbytes) / MiB:.0f} MiB passes the cap")
    else:
        cap = None if cap_mib is None else max(int(cap_mib * MiB) - inputs.nbytes, 0)
        tracker = _CappedTracker(cap)
        with tracker:
            loss = impl.step(x)
        delta = tracker.peak
    grads = {k: v.grad for k, v in x.leaves.items() if v.grad is not None}
    for t in x.leaves.values():
        t.grad = None  # the outcome holds them now; the next run starts without
    return delta, _Outcome(loss, grads)


def _timed_runs(impl: Impl, inputs: Inputs, case: Case, repeats: int, warmup: int) -> list[float]:
    times = []
    for i in range(warmup + repeats):
        x = inputs.fresh() if impl.mutates_inputs else inputs.reuse()
        _sync(case.device)
        start = time.perf_counter()
        impl.step(x)
        _sync(case.device)
        elapsed = time.perf_counter() - start
        x.reuse()
        del x
        if i >= warmup:
            times.append(elapsed * 1e3)
    return times


def _check(row: Result, outcome: _Outcome, ref: _Outcome | None, tol: float) -> None:
    if outcome.loss is None:
        row.check = "n/a"
        return
    row.loss = float(outcome.loss)
    if ref is outcome:
        row.check = "ref"
        return
    if ref is None or ref.loss is None:
        row.check = "no-ref"
        return
    row.tolerance = tol
    row.loss_err = abs(float(outcome.loss) - float(ref.loss)) / max(abs(float(ref.loss)), 1e-12)
    missing = [k for k in ref.grads if k not in outcome.grads]
    errs = [relative_error(outcome.grads[k], ref.grads[k]) for k in ref.grads if k in outcome.grads]
    row.grad_err = max(errs) if errs else None
    ok = row.loss_err <= tol and not missing and all(e <= tol for e in errs)
    row.check = "ok" if ok else "FAIL"
    if missing:
        row.note = f"no gradient for {', '.join(missing)}"


def run_case(case: Case, impls: list[Impl], config: SweepConfig, progress=None) -> list[Result]:
    """All impls on one case. Inputs are built once and reused (gradients cleared) by every run, except
    that an impl which writes into its inputs gets fresh copies."""
    rows: list[Result] = []
    inputs = make_inputs(case, config.seed)
    ref: _Outcome | None = None
    tol = TOLERANCE[case.dtype]
    for impl in impls:
        row = Result(
            case.workload, case.tokens, case.vocab, case.hidden, case.dtype, case.device, impl.name, impl.chunk,
            input_mib=inputs.nbytes / MiB,
        )  # fmt: skip
        rows.append(row)
        if progress is not None:
            progress.set_postfix_str(
                f"{case.workload} {case.dtype} T={case.tokens} {impl.label}", refresh=False
            )
        versions = {k: t._version for k, t in inputs.leaves.items()}
        if impl.step is None:
            row.status, row.note = "skipped", impl.unavailable or "unavailable"
        else:
            try:
                delta, outcome = _tracked_run(impl, inputs, case, config.max_memory_mib)
                row.delta_mib = delta / MiB
                row.peak_mib = row.input_mib + row.delta_mib
                if impl.is_reference:
                    ref = outcome
                _check(row, outcome, ref, tol)
                del outcome
                _free(case.device)
                row.times_ms = _timed_runs(impl, inputs, case, config.repeats, config.warmup)
                row.time_ms = statistics.median(row.times_ms)
                row.time_min_ms, row.time_max_ms = min(row.times_ms), max(row.times_ms)
            except Exception as err:
                if _is_oom(err):
                    row.status, row.note = "oom", f"{type(err).__name__}: {err}"
                else:
                    row.status, row.note = "error", f"{type(err).__name__}: {err}"
            _free(case.device)
        if any(t._version != versions[k] for k, t in inputs.leaves.items()):
            # An in-place write the impl did not declare: the timed runs after the first saw other values,
            # and later impls must not, so say so and start again from clean inputs.
            row.note = (row.note + "; " if row.note else "") + "wrote into its inputs (undeclared)"
            inputs = make_inputs(case, config.seed)
        if progress is not None:
            progress.update(1)
    del ref, inputs
    _add_ratios(rows)
    return rows


def _add_ratios(rows: list[Result]) -> None:
    naive = next((r for r in rows if r.impl == "naive" and r.status == "ok"), None)
    floor = next((r for r in rows if r.impl == "matmul-floor" and r.status == "ok"), None)
    for r in rows:
        if r.status != "ok":
            continue
        if naive is not None:
            r.time_vs_naive = r.time_ms / naive.time_ms if naive.time_ms else None
            r.mem_vs_naive = r.peak_mib / naive.peak_mib if naive.peak_mib else None
        if floor is not None and floor.time_ms:
            r.time_vs_floor = r.time_ms / floor.time_ms


def run_sweep(config: SweepConfig, *, show_progress: bool = True) -> list[Result]:
    """Every case of `config` against every selected impl. tqdm shows progress on stderr."""
    plan = []
    for case in config.cases():
        impls = build_impls(
            case.workload, case.device, config.impls[case.workload], config.chunks[case.workload]
        )
        plan.append((case, impls))
    total = sum(len(impls) for _, impls in plan)
    progress = None
    if show_progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=total, desc="lmloss bench", unit="run", file=sys.stderr, dynamic_ncols=True)
    rows: list[Result] = []
    try:
        for case, impls in plan:
            rows += run_case(case, impls, config, progress)
    finally:
        if progress is not None:
            progress.close()
    return rows


def environment(device: str) -> dict[str, object]:
    """Where the numbers were taken: versions, device, threads."""
    env: dict[str, object] = {
        "lmloss": getattr(lmloss, "__version__", "?"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name()
    return env


__all__ = ["Result", "SimulatedOOM", "SweepConfig", "TOLERANCE", "WORKLOADS", "environment", "run_sweep"]
