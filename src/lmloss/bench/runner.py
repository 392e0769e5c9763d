"""The sweep: for each shape, every implementation's tracked run (peak memory + correctness check), then the
timed runs without the tracker, interleaved: warm-up rounds, then timed rounds, each running every row of
the case once (round k starts k rows further on), so that a cold start, a slow spell of a shared machine or
the position after another row falls on every row alike. Out-of-memory, real or simulated, is a result
like any other and the sweep goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterable, Iterator

import torch

import lmloss
from lmloss.bench.impls import (
    FLOORS,
    INVARIANT_SUFFIX,
    WORKLOADS,
    Case,
    Impl,
    Inputs,
    build_impls,
    ce_weight_grad_float64,
    make_inputs,
    row_label,
    wgrad_sample_rows,
)
from lmloss.profiling.memory import LiveTensorTracker, MiB, peak_memory

#: Agreement with naive is judged as a relative error (see `relative_error`) under these bounds. fp32 leaves
#: room for a different summation order; bf16/fp16 gradients are stored in the input dtype (8 / 11 bits).
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}

#: A row whose spread (half the min-max range of its timed runs over their median) passes this is marked
#: ``noisy`` in its note: time differences smaller than that are not measured by this run. Compared as
#: printed (`spread_percent`): a spread of 10.4% prints as ±10% and is not noisy, one of 10.6% prints as
#: ±11% and is, so the note never reads "±10% > ±10%".
NOISY_SPREAD = 0.10


def spread_percent(spread: float) -> int:
    """`spread` (a fraction) as the whole percentage the table and the note print (``round``: half to even)."""
    return round(100 * spread)


def is_noisy(spread: float | None) -> bool:
    """Whether the printed spread passes the printed `NOISY_SPREAD`."""
    return spread is not None and spread_percent(spread) > spread_percent(NOISY_SPREAD)


#: The clock of the timed runs (a module attribute so that tests can drive the rounds with a fake one).
_clock = time.perf_counter


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
    kernels: list[str] = dataclasses.field(default_factory=lambda: ["torch"])
    repeats: int = 5
    warmup: int = 1
    max_memory_mib: float | None = None
    seed: int = 0
    invariant: bool = False
    budgets: list[float | None] = dataclasses.field(default_factory=lambda: [None])

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

    kernel: lmloss's implementation of the per-chunk math (``torch`` / ``triton``), ``-`` for other rows.
    objective: what the loss is (`lmloss.bench.impls`). status: ``ok`` | ``oom`` | ``skipped`` | ``error``.
    Times are of forward+backward in milliseconds (median, min, max over `repeats`); spread: half the
    min-max range over the median (a fraction; above `NOISY_SPREAD` the note says ``noisy``). peak_mib = input_mib +
    delta_mib, where delta is the peak above the inputs while the step ran. Ratios are against the naive row
    of the same objective (and, for the fused workload, the matmul floor) of the same case. check: ``ref``
    (a naive row itself), ``ok``, ``FAIL`` (loss or a gradient disagrees with the naive row beyond
    `tolerance`), ``n/a`` (no loss to check) or ``no-ref`` (the naive row did not run). bytes_moved /
    bandwidth_gbs: logits workload, the least bytes the step must move (reads and writes of the ``[T, V]``
    logits, see the docs) and that over the median time, in GB/s. wgrad_err: fused workload, ``ce`` rows,
    ``||dW - dW64|| / ||dW64||`` over sampled vocabulary rows, dW64 computed in float64.
    """

    workload: str
    tokens: int
    vocab: int
    hidden: int | None
    dtype: str
    device: str
    impl: str
    chunk: str
    kernel: str = "-"
    objective: str = "logprobs"
    status: str = "ok"
    time_ms: float | None = None
    time_min_ms: float | None = None
    time_max_ms: float | None = None
    times_ms: list[float] = dataclasses.field(default_factory=list)
    spread: float | None = None
    input_mib: float | None = None
    delta_mib: float | None = None
    peak_mib: float | None = None
    time_vs_naive: float | None = None
    mem_vs_naive: float | None = None
    time_vs_floor: float | None = None
    bytes_moved: int | None = None
    bandwidth_gbs: float | None = None
    wgrad_err: float | None = None
    check: str = "n/a"
    loss: float | None = None
    loss_err: float | None = None
    grad_err: float | None = None
    tolerance: float | None = None
    note: str = ""
    budget_mib: float | None = None

    @property
    def label(self) -> str:
        return row_label(self.impl, self.chunk, self.kernel, self.budget_mib)


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
    gc.collect()  # a cycle through an autograd ctx can hold a run's tensors (CUDA: gigabytes) until collected
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _allocated(device: str) -> int | None:
    """Bytes the CUDA caching allocator holds for live tensors; None off CUDA."""
    return torch.cuda.memory_allocated(device) if device.startswith("cuda") else None


#: A row (other than a naive reference, whose outcome is kept on purpose for the checks) whose tracked run
#: leaves more than this fraction of the case's input bytes allocated (CUDA) is noted: it would shrink every
#: later row's memory, and a sweep of rows that each leave a [T, V] tensor behind runs out of memory (as
#: the in-place rows' stand-in for an LM head once did on an H200). Smaller remnants are the bench's own
#: per-case caches (the sampled labels and kept sets, the distillation teacher).
LEFT_ALLOCATED_NOTE_FRACTION = 0.125


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
    x = impl.inputs_for_run(inputs)
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
    grads = impl.gradients(x)
    for t in x.leaves.values():
        t.grad = None  # the outcome holds them now; the next run starts without
    return delta, _Outcome(loss, grads)


def _timed_run(impl: Impl, inputs: Inputs, case: Case) -> float:
    """One forward+backward without the tracker, in milliseconds (CUDA synchronized on both sides)."""
    x = impl.inputs_for_run(inputs)
    _sync(case.device)
    start = _clock()
    impl.step(x)
    _sync(case.device)
    elapsed = _clock() - start
    x.reuse()
    return elapsed * 1e3


@dataclasses.dataclass
class _ToTime:
    """A row that passed its tracked run. own_inputs: it wrote into the shared inputs undeclared, so each of
    its runs gets a copy."""

    row: Result
    impl: Impl
    own_inputs: bool = False


def _append_note(row: Result, text: str) -> None:
    row.note = f"{row.note}; {text}" if row.note else text


def _wrote_into(inputs: Inputs, versions: dict[str, int]) -> bool:
    return any(t._version != versions[k] for k, t in inputs.leaves.items())


def _timed_rounds(
    entries: list[_ToTime], inputs: Inputs, case: Case, config: SweepConfig, progress=None
) -> int:
    """`config.warmup` untimed rounds, then `config.repeats` timed ones; each runs every row once, round k
    starting at row k (mod the rows). A row that raises drops out with its status and note. Returns how
    many runs were made."""
    if not entries:
        return 0
    rounds = config.warmup + config.repeats
    total = 0
    versions = {k: t._version for k, t in inputs.leaves.items()}
    for k in range(rounds):
        order = entries[k % len(entries) :] + entries[: k % len(entries)]
        ran = 0
        for entry in order:
            if entry.row.status != "ok":
                continue
            try:
                elapsed = _timed_run(entry.impl, inputs.fresh() if entry.own_inputs else inputs, case)
            except Exception as err:
                entry.row.status = "oom" if _is_oom(err) else "error"
                _append_note(entry.row, f"in a timed run: {type(err).__name__}: {err}")
                entry.row.times_ms = []
                _free(case.device)
                continue
            ran += 1
            if k >= config.warmup:
                entry.row.times_ms.append(elapsed)
            if _wrote_into(inputs, versions):  # an undeclared in-place write, seen only now
                _append_note(entry.row, "wrote into its inputs (undeclared)")
                entry.own_inputs = True
                inputs = make_inputs(case, config.seed)
                versions = {name: t._version for name, t in inputs.leaves.items()}
        if progress is not None:
            what = "warm-up" if k < config.warmup else "timed"
            n, of = (k + 1, config.warmup) if k < config.warmup else (k + 1 - config.warmup, config.repeats)
            progress.set_postfix_str(f"{case.workload} {case.dtype} T={case.tokens} {what} round {n}/{of}")
            progress.update(ran)
        total += ran
    for entry in entries:
        row = entry.row
        if row.status != "ok" or not row.times_ms:
            continue
        row.time_ms = statistics.median(row.times_ms)
        row.time_min_ms, row.time_max_ms = min(row.times_ms), max(row.times_ms)
        row.spread = (row.time_max_ms - row.time_min_ms) / 2 / row.time_ms if row.time_ms > 0 else None
        if is_noisy(row.spread):
            _append_note(row, f"noisy: ±{spread_percent(row.spread)}% > ±{spread_percent(NOISY_SPREAD)}%")
    return total


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


def relative_norm_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``||got - ref|| / ||ref||`` (Frobenius), in float64."""
    ref = ref.double()
    return float(
        torch.linalg.vector_norm(got.double() - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-300)
    )


@dataclasses.dataclass
class _WeightGradReference:
    """The float64 weight gradient of the ``ce`` objective at sampled vocabulary rows (fused workload)."""

    rows: torch.Tensor
    grad64: torch.Tensor

    @classmethod
    def build(cls, case: Case, inputs: Inputs) -> _WeightGradReference:
        rows = wgrad_sample_rows(case.vocab, case.device)
        return cls(rows, ce_weight_grad_float64(inputs.hidden, inputs.weight, inputs.labels, rows))

    def error(self, weight_grad: torch.Tensor) -> float:
        return relative_norm_error(weight_grad.detach()[self.rows], self.grad64)


@contextlib.contextmanager
def _older_objects_frozen(device: str) -> Iterator[None]:
    """The objects alive before a case (modules, a caller's own data: hundreds of thousands in a test session
    or a notebook) moved out of the garbage collector's sight until it ends (`gc.freeze`), so that the
    collection after each run (`_free`) looks only at what the case made: 0.2 s per collection becomes
    milliseconds. On CUDA, garbage from before is collected first (it may hold device memory the case
    needs). Left alone where the caller froze objects itself (its `gc.unfreeze` is not ours to make)."""
    if gc.get_freeze_count():
        yield
        return
    if device.startswith("cuda"):
        gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_case(case: Case, impls: list[Impl], config: SweepConfig, progress=None) -> list[Result]:
    """All impls on one case: each one's tracked run in turn, then the interleaved timed rounds
    (`_timed_rounds`). Inputs are built once and reused (gradients cleared) by every run, except that an
    impl which writes into its inputs gets fresh copies."""
    with _older_objects_frozen(case.device):
        return _run_case(case, impls, config, progress)


def _run_case(case: Case, impls: list[Impl], config: SweepConfig, progress) -> list[Result]:
    rows: list[Result] = []
    to_time: list[_ToTime] = []
    inputs = make_inputs(case, config.seed)
    refs: dict[str, _Outcome] = {}  # objective -> the outcome of its naive row
    tol = TOLERANCE[case.dtype]
    wgrad_ref = None
    if case.workload == "fused" and any(i.step is not None and i.objective == "ce" for i in impls):
        wgrad_ref = _WeightGradReference.build(case, inputs)
    for impl in impls:
        row = Result(
            case.workload, case.tokens, case.vocab, case.hidden, case.dtype, case.device, impl.name, impl.chunk,
            kernel=impl.kernel, objective=impl.objective, input_mib=inputs.nbytes / MiB, budget_mib=impl.budget_mib,
        )  # fmt: skip
        if impl.traffic is not None and inputs.logits is not None:
            row.bytes_moved = impl.traffic * inputs.logits.nbytes
        rows.append(row)
        if progress is not None:
            progress.set_postfix_str(f"{case.workload} {case.dtype} T={case.tokens} {impl.label}")
        versions = {k: t._version for k, t in inputs.leaves.items()}
        if impl.step is None:
            row.status, row.note = "skipped", impl.unavailable or "unavailable"
        else:
            allocated_before = _allocated(case.device)
            try:
                delta, outcome = _tracked_run(impl, inputs, case, config.max_memory_mib)
                row.delta_mib = delta / MiB
                row.peak_mib = row.input_mib + row.delta_mib
                if impl.budget_mib is not None:  # what the op held beyond its inputs and their gradients
                    held = row.delta_mib - _grads_mib(inputs)
                    _append_note(row, f"{held:.1f} MiB beyond inputs and gradients, budget {impl.budget_mib:g} MiB")
                if impl.is_reference:
                    refs[impl.objective] = outcome
                _check(row, outcome, refs.get(impl.objective), tol)
                if wgrad_ref is not None and impl.objective == "ce" and "weight" in outcome.grads:
                    row.wgrad_err = wgrad_ref.error(outcome.grads["weight"])
                    if impl.is_reference:
                        rounded = relative_norm_error(wgrad_ref.grad64.to(case.torch_dtype), wgrad_ref.grad64)
                        row.note = f"dW64 rounded once to {case.dtype}: wgrad err {rounded:.2e}"
                del outcome
                to_time.append(_ToTime(row, impl))
            except Exception as err:
                if _is_oom(err):
                    row.status, row.note = "oom", f"{type(err).__name__}: {err}"
                else:
                    row.status, row.note = "error", f"{type(err).__name__}: {err}"
            _free(case.device)
            left = _allocated(case.device)
            if left is not None and allocated_before is not None and not impl.is_reference:
                left -= allocated_before
                if left > LEFT_ALLOCATED_NOTE_FRACTION * inputs.nbytes:
                    _append_note(row, f"left {left / MiB:.0f} MiB allocated after its run")
        if _wrote_into(inputs, versions):
            # An in-place write the impl did not declare: later impls must not see it, and its own timed runs
            # get copies, so say so and start again from clean inputs.
            _append_note(row, "wrote into its inputs (undeclared)")
            if to_time and to_time[-1].row is row:
                to_time[-1].own_inputs = True
            inputs = make_inputs(case, config.seed)
        if progress is not None:
            progress.update(1)
    del refs, wgrad_ref
    _free(case.device)
    ran = _timed_rounds(to_time, inputs, case, config, progress)
    if progress is not None:  # the runs of rows that failed before or during their rounds: count them done
        missed = sum(config.warmup + config.repeats for i in impls if i.step is not None) - ran
        if missed > 0:
            progress.update(missed)
    del inputs
    _add_ratios(rows)
    return rows


def _grads_mib(inputs: Inputs) -> float:
    """The gradients' MiB: one of each leaf's size (they are born inside the tracked run)."""
    return sum(t.numel() * t.element_size() for t in inputs.leaves.values()) / MiB


def _add_ratios(rows: list[Result]) -> None:
    """time/naive and mem/naive against the naive row of each row's objective; time/floor; bandwidth."""
    naive = {r.objective: r for r in rows if r.check == "ref" and r.status == "ok"}
    floors = {r.impl: r for r in rows if (r.impl == "matmul-floor" or r.impl in FLOORS.values()) and r.status == "ok"}
    for r in rows:
        if r.status != "ok":
            continue
        floor = floors.get(FLOORS.get(r.objective, "matmul-floor"))
        ref = naive.get(r.objective, naive.get("logprobs" if r.workload == "logits" else "ce"))
        if ref is not None:
            r.time_vs_naive = r.time_ms / ref.time_ms if ref.time_ms else None
            r.mem_vs_naive = r.peak_mib / ref.peak_mib if ref.peak_mib else None
        if floor is not None and floor.time_ms:
            r.time_vs_floor = r.time_ms / floor.time_ms
        if r.bytes_moved is not None and r.time_ms:
            r.bandwidth_gbs = r.bytes_moved / (r.time_ms * 1e-3) / 1e9
    # ``--invariant``: each invariant row's time against its default row's (same chunk and kernel)
    plain = {(r.impl, r.chunk, r.kernel): r for r in rows if r.status == "ok"}
    for r in rows:
        base = plain.get((r.impl.removesuffix(INVARIANT_SUFFIX), r.chunk, r.kernel))
        if r.impl.endswith(INVARIANT_SUFFIX) and r.status == "ok" and base is not None and base.time_ms:
            _append_note(r, f"invariant: {r.time_ms / base.time_ms:.2f}x {base.label}'s time")
    # ``--budget``: the price of each budget, its row's time against the same row at the op's default budget
    default = {(r.impl, r.chunk, r.kernel): r for r in rows if r.status == "ok" and r.budget_mib is None}
    for r in rows:
        base = default.get((r.impl, r.chunk, r.kernel))
        if r.budget_mib is not None and r.status == "ok" and base is not None and base.time_ms:
            _append_note(r, f"{r.time_ms / base.time_ms:.2f}x the default budget's time")


class PlainProgress:
    """What `run_sweep` shows on stderr when tqdm is not installed: one line per finished run."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.done, self.current = total, desc, 0, ""

    def set_postfix_str(self, text: str) -> None:
        self.current = text

    def update(self, n: int = 1) -> None:
        self.done += n
        print(f"{self.desc}: {self.done}/{self.total} {self.current}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _progress(total: int):
    """A tqdm bar on stderr, or `PlainProgress` lines where tqdm is missing (it comes with the bench extra)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return PlainProgress(total, "lmloss bench")
    bar = tqdm(total=total, desc="lmloss bench", unit="run", file=sys.stderr, dynamic_ncols=True)
    bar.set_postfix_str = lambda text, _set=bar.set_postfix_str: _set(text, refresh=False)  # type: ignore[method-assign]
    return bar


def run_sweep(config: SweepConfig, *, show_progress: bool = True) -> list[Result]:
    """Every case of `config` against every selected impl; progress on stderr (a tqdm bar, or plain lines)."""
    plan = []
    for case in config.cases():
        impls = build_impls(
            case.workload, case.device, config.impls[case.workload], config.chunks[case.workload],
            config.kernels, config.invariant, config.budgets,
        )  # fmt: skip
        plan.append((case, impls))
    runs = 1 + config.warmup + config.repeats  # per row: its tracked run, then one in each round
    total = sum(runs if impl.step is not None else 1 for _, impls in plan for impl in impls)
    progress = _progress(total) if show_progress else None
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


__all__ = [
    "NOISY_SPREAD", "Result", "SimulatedOOM", "SweepConfig", "TOLERANCE", "WORKLOADS", "environment", "is_noisy",
    "run_sweep", "spread_percent",
]  # fmt: skip
