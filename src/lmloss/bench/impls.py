"""What the bench compares: workloads, their inputs, and each implementation behind one calling shape.

Every implementation is an `Impl` whose ``step(inputs)`` runs one forward *and* backward on leaf tensors
with no gradient yet and returns the scalar loss (or None for the matmul floor, which computes no loss). The runner reads
the gradients off the leaves. Peers (Megatron-core, Cut Cross-Entropy, Liger, torch's own fused op) are
adapters here; when one cannot run, `Impl.unavailable` says why and the runner lists it as skipped.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

import lmloss
from lmloss.distributed import free_port

WORKLOADS = ("logits", "fused")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem shape. `hidden` is None for the logits workload."""

    workload: str
    tokens: int
    vocab: int
    dtype: str
    device: str
    hidden: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclasses.dataclass
class Inputs:
    """Leaf tensors of one run. Logits workload: ``logits [T, V]``; fused: ``hidden [T, H]``, ``weight [V, H]``.

    ``labels [T]`` int64, all valid (Megatron's op has no ignore_index, so the comparison stays fair).
    """

    labels: torch.Tensor
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None

    @property
    def leaves(self) -> dict[str, torch.Tensor]:
        """The tensors that receive gradients, by name."""
        named = {"logits": self.logits, "hidden": self.hidden, "weight": self.weight}
        return {k: v for k, v in named.items() if v is not None}

    @property
    def nbytes(self) -> int:
        return self.labels.nbytes + sum(t.nbytes for t in self.leaves.values())

    def fresh(self) -> Inputs:
        """New leaves with the same values, for impls that overwrite their input (Megatron, fp32)."""
        return Inputs(
            labels=self.labels,
            **{k: v.detach().clone().requires_grad_(True) for k, v in self.leaves.items()},
        )

    def reuse(self) -> Inputs:
        """These leaves with their gradients cleared: no copy, so no page faults for a [T, V] clone."""
        for t in self.leaves.values():
            t.grad = None
        return self


#: Row stride into the random pool of `_normal_rows`; prime, so no row lines up with another's columns.
_POOL_STRIDE = 1009


def _normal_rows(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """``[rows, cols]`` fp32 with N(0, 1) rows: row t is the window ``pool[t * 1009 : t * 1009 + cols]``.

    Drawing ``rows * cols`` independent normals takes seconds at [8192, 32000] on one CPU thread, longer
    than the step it feeds; overlapping windows of one pool are ~20x faster to make and serve timing,
    memory and the check equally well (every row is a different N(0, 1) vector).
    """
    pool_size = rows * _POOL_STRIDE + cols
    if pool_size >= rows * cols:
        return torch.randn(rows, cols, generator=gen)
    pool = torch.randn(pool_size, generator=gen)
    return pool.as_strided((rows, cols), (_POOL_STRIDE, 1)).clone()


def make_inputs(case: Case, seed: int = 0) -> Inputs:
    """Deterministic inputs for `case`; values scaled so that the logits are roughly N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    dev, dt = torch.device(case.device), case.torch_dtype
    labels = torch.randint(0, case.vocab, (case.tokens,), generator=gen).to(dev)
    if case.workload == "logits":
        logits = _normal_rows(case.tokens, case.vocab, gen).to(dev, dt).requires_grad_(True)
        return Inputs(labels=labels, logits=logits)
    assert case.hidden is not None
    hidden = torch.randn(case.tokens, case.hidden, generator=gen).to(dev, dt).requires_grad_(True)
    weight = (torch.randn(case.vocab, case.hidden, generator=gen) / case.hidden**0.5).to(dev, dt)
    return Inputs(labels=labels, hidden=hidden, weight=weight.requires_grad_(True))


Step = Callable[[Inputs], "torch.Tensor | None"]


@dataclasses.dataclass
class Impl:
    """One implementation at one chunk setting.

    name: as given to ``--impl``. chunk: the chunk label shown in the table (``"1024"``, ``"none"``,
    ``"auto"``) or ``"-"`` for impls without one. step: forward + backward on the given leaves (gradients
    cleared), returns the loss. unavailable: why it cannot run here, or None. is_reference / is_floor: naive
    and matmul-floor, the bases of the ratio columns. mutates_inputs: the step writes into its inputs, so
    each run gets fresh copies.
    """

    name: str
    chunk: str
    step: Step | None
    unavailable: str | None = None
    is_reference: bool = False
    is_floor: bool = False
    mutates_inputs: bool = False

    @property
    def label(self) -> str:
        return self.name if self.chunk == "-" else f"{self.name}[{self.chunk}]"


def parse_chunk(text: str) -> int | str | None:
    """``"none"`` -> None, ``"auto"`` -> ``"auto"``, digits -> int (> 0)."""
    low = text.strip().lower()
    if low == "none":
        return None
    if low == "auto":
        return "auto"
    value = int(low)
    if value <= 0:
        raise ValueError(f"chunk sizes must be positive, got {value}")
    return value


def chunk_label(chunk: int | str | None) -> str:
    return "none" if chunk is None else str(chunk)


# ----------------------------------------------------------------------------------------- logits workload


def _naive_logits(x: Inputs) -> torch.Tensor:
    # What a training loop writes without thinking about memory: full fp32 log-softmax, then gather.
    loss = F.log_softmax(x.logits.float(), dim=-1).gather(1, x.labels[:, None]).sum()
    loss.backward()
    return loss.detach()


def _chunked_logits(chunk: int | None) -> Step:
    def step(x: Inputs) -> torch.Tensor:
        loss = lmloss.token_logprobs(x.logits, x.labels, chunk_size=chunk).sum()
        loss.backward()
        return loss.detach()

    return step


_MEGATRON_STATE: dict[str, object] = {}


def _megatron_step(device: str) -> tuple[Step | None, str | None]:
    """Megatron-core's `vocab_parallel_cross_entropy` on a one-rank tensor-parallel group.

    It reads its group from Megatron's global parallel state, so a one-process group is started here
    when none exists (gloo on CPU, nccl on CUDA). It returns per-token ``-log p``: the step negates the
    sum so the loss matches the other logits impls.
    """
    if "reason" in _MEGATRON_STATE:
        return None, _MEGATRON_STATE["reason"]  # type: ignore[return-value]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" at import
            from megatron.core import parallel_state
            from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    except Exception as err:  # ImportError, or a broken install that fails while importing
        _MEGATRON_STATE["reason"] = f"megatron-core not importable ({type(err).__name__}: {err})"
        return None, _MEGATRON_STATE["reason"]  # type: ignore[return-value]
    try:
        if not torch.distributed.is_initialized():
            port = free_port()
            backend = "nccl" if device.startswith("cuda") else "gloo"
            torch.distributed.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
            )
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
    except Exception as err:
        _MEGATRON_STATE["reason"] = (
            f"megatron parallel state could not be set up ({type(err).__name__}: {err})"
        )
        return None, _MEGATRON_STATE["reason"]  # type: ignore[return-value]

    def step(x: Inputs) -> torch.Tensor:
        loss = -vocab_parallel_cross_entropy(x.logits, x.labels).sum()
        loss.backward()
        return loss.detach()

    return step, None


# ------------------------------------------------------------------------------------------ fused workload


def _naive_fused(x: Inputs) -> torch.Tensor:
    # The logits are materialized in the input dtype (as a model's LM head does); the loss is taken in fp32.
    loss = F.cross_entropy((x.hidden @ x.weight.T).float(), x.labels)
    loss.backward()
    return loss.detach()


def _lmloss_fused(chunk: int | str | None) -> Step | None:
    fn = getattr(lmloss, "linear_cross_entropy", None)
    if fn is None:
        return None

    def step(x: Inputs) -> torch.Tensor:
        loss = fn(x.hidden, x.weight, x.labels, chunk_size=chunk)
        loss.backward()
        return loss.detach()

    return step


def _torch_fused() -> tuple[Step | None, str | None]:
    fn = getattr(F, "linear_cross_entropy", None)
    options_cls = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if fn is None or options_cls is None:
        return None, f"torch {torch.__version__} has no F.linear_cross_entropy with LinearCrossEntropyOptions"

    def step(x: Inputs) -> torch.Tensor:
        loss = fn(x.hidden, x.weight, x.labels, options=options_cls())
        loss.backward()
        return loss.detach()

    return step, None


def _needs_cuda(device: str, what: str) -> str | None:
    if not device.startswith("cuda"):
        return f"{what} runs Triton kernels on CUDA only"
    if importlib.util.find_spec("triton") is None:
        return f"{what} needs triton, which is not installed"
    return None


def _cce_step(device: str) -> tuple[Step | None, str | None]:
    try:
        module = importlib.import_module("cut_cross_entropy")
    except Exception as err:
        return None, f"cut-cross-entropy not importable ({type(err).__name__}: {err})"
    reason = _needs_cuda(device, "Cut Cross-Entropy")
    if reason:
        return None, reason

    def step(x: Inputs) -> torch.Tensor:
        loss = module.linear_cross_entropy(x.hidden, x.weight, x.labels)
        loss.backward()
        return loss.detach()

    return step, None


def _liger_step(device: str) -> tuple[Step | None, str | None]:
    reason = _needs_cuda(device, "Liger")
    if reason:
        return None, reason
    try:
        module = importlib.import_module("liger_kernel.transformers")
        loss_cls = module.LigerFusedLinearCrossEntropyLoss
    except Exception as err:
        return None, f"liger-kernel not importable ({type(err).__name__}: {err})"

    def step(x: Inputs) -> torch.Tensor:
        loss = loss_cls()(x.weight, x.hidden, x.labels)  # Liger takes the weight first
        loss.backward()
        return loss.detach()

    return step, None


def _matmul_floor(x: Inputs) -> None:
    """The three matmuls any forward+backward of this shape must do: ``h W^T``, ``G W`` and ``G^T h``.

    The logits stand in for their own gradient G, so there is no softmax at all: a speed floor, not a loss.
    """
    with torch.no_grad():
        logits = x.hidden @ x.weight.T
        x.hidden.grad = logits @ x.weight
        x.weight.grad = logits.T @ x.hidden
    return None


# -------------------------------------------------------------------------------------------- the registry

LOGITS_IMPLS = ("naive", "chunked", "megatron")
FUSED_IMPLS = ("naive", "fused", "torch-fused", "cce", "liger", "matmul-floor")
IMPLS_BY_WORKLOAD = {"logits": LOGITS_IMPLS, "fused": FUSED_IMPLS}
CHUNKED_IMPLS = {"logits": "chunked", "fused": "fused"}


def build_impls(workload: str, device: str, names: list[str], chunks: list[int | str | None]) -> list[Impl]:
    """The impls of `workload` named in `names`, expanded over `chunks` for lmloss's own chunked impl.

    Naive comes first so that its result is the reference when the others are checked. ``"auto"`` chunking
    belongs to the fused op only; for the logits workload it is left out.
    """
    out: list[Impl] = []
    for name in IMPLS_BY_WORKLOAD[workload]:
        if name not in names:
            continue
        if workload == "logits":
            if name == "naive":
                out.append(Impl("naive", "-", _naive_logits, is_reference=True))
            elif name == "chunked":
                out += [Impl("chunked", chunk_label(c), _chunked_logits(c)) for c in chunks if c != "auto"]
            elif name == "megatron":
                step, reason = _megatron_step(device)
                # fp32 logits are shifted in place by Megatron's forward (its .float() is then a no-op)
                out.append(Impl("megatron", "-", step, reason, mutates_inputs=True))
        else:
            if name == "naive":
                out.append(Impl("naive", "-", _naive_fused, is_reference=True))
            elif name == "fused":
                for c in chunks:
                    step = _lmloss_fused(c)
                    reason = None if step else "lmloss.linear_cross_entropy is not in this build"
                    out.append(Impl("fused", chunk_label(c), step, reason))
            elif name == "torch-fused":
                out.append(Impl("torch-fused", "-", *_torch_fused()))
            elif name == "cce":
                out.append(Impl("cce", "-", *_cce_step(device)))
            elif name == "liger":
                out.append(Impl("liger", "-", *_liger_step(device)))
            elif name == "matmul-floor":
                out.append(Impl("matmul-floor", "-", _matmul_floor, is_floor=True))
    return out
