"""What the bench compares: workloads, their inputs, and each implementation behind one calling shape.

Every implementation is an `Impl` whose ``step(inputs)`` runs one forward *and* backward on leaf tensors
with no gradient yet and returns the scalar loss (or None for the matmul floor, which computes no loss). The
runner reads the gradients off the leaves (or, for the in-place rows, where `Impl.grads_of` says). Peers
(Megatron-core, Cut Cross-Entropy, Liger, torch's own fused op, ``torch.compile``) are adapters here; when one
cannot run, `Impl.unavailable` says why and the runner lists it as skipped.

Each impl computes one *objective*, and is checked against the naive row of the same objective:

* ``logprobs``: ``sum_t log p(y_t)`` (logits workload; lmloss's ``cross_entropy(reduction="sum")`` rows
  return its negative);
* ``logprobs+entropy``: ``sum_t log p(y_t) + ENTROPY_COEF * sum_t H_t`` (logits workload);
* ``ce``: ``mean_t -log p(y_t)`` (fused workload);
* ``rl``: ``sum_t u_t log p_T(y_t) + ENTROPY_COEF * sum_t H_T,t`` at temperature ``TEMPERATURE`` with a
  per-token upstream ``u`` (fused workload: what an RL policy loss hands the LM head).
* ``distill``: ``mean_t KL(p_teacher,t || p_student,t)`` (forward KL, fused workload; the teacher head is
  derived from the case's tensors, `_teacher_of`); its speed floor is the ``distill-floor`` row (four matmuls).
* ``ppo``: `lmloss.rl.policy_loss` (PPO clip + dual clip + k3 KL + entropy bonus, token-mean) of the
  log-probs at temperature ``TEMPERATURE`` (fused workload; old / reference log-probs and advantages made
  from ``u``, `_ppo_inputs`).
* ``dpo``: DPO's sigmoid loss (``beta = DPO_BETA``, mean over pairs) of the tokens as ``DPO_PAIRS`` pairs of
  equal-length sequences (chosen half, then rejected half; every token a completion token), against a
  reference head derived from the case's tensors (`_teacher_of`); its speed floor is the ``dpo-floor`` row
  (four matmuls: the policy's three and the reference's one). ``orpo``: Liger's ORPO loss (no naive row).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import os
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

import lmloss
from lmloss.distributed import free_port

WORKLOADS = ("logits", "fused")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: lmloss's two implementations of the per-chunk math (``impl=`` of every op), as ``--kernel`` names them.
KERNELS = ("torch", "triton")

ENTROPY_COEF = 0.1  # weight of the entropy term in the ``logprobs+entropy`` and ``rl`` objectives
TEMPERATURE = 0.7  # temperature of the ``rl`` objective


def _triton_device_reason(kernel: str, device: str) -> str | None:
    """Triton kernels run on CUDA tensors, or on CPU ones only under Triton's interpreter."""
    if kernel != "triton" or device.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "lmloss's Triton kernels run on CUDA (on CPU only under TRITON_INTERPRET=1, set before start)"


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
    ``upstream [T]`` fp32 (fused workload): the per-token gradient of the ``rl`` objective.
    """

    labels: torch.Tensor
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    upstream: torch.Tensor | None = None

    @property
    def leaves(self) -> dict[str, torch.Tensor]:
        """The tensors that receive gradients, by name."""
        named = {"logits": self.logits, "hidden": self.hidden, "weight": self.weight}
        return {k: v for k, v in named.items() if v is not None}

    @property
    def nbytes(self) -> int:
        extra = self.upstream.nbytes if self.upstream is not None else 0
        return self.labels.nbytes + extra + sum(t.nbytes for t in self.leaves.values())

    def fresh(self) -> Inputs:
        """New leaves with the same values, for impls that overwrite their input (Megatron, Liger, fp32)."""
        return Inputs(
            labels=self.labels,
            upstream=self.upstream,
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
    upstream = torch.randn(case.tokens, generator=gen).to(dev)
    return Inputs(labels=labels, hidden=hidden, weight=weight.requires_grad_(True), upstream=upstream)


Step = Callable[[Inputs], "torch.Tensor | None"]


@dataclasses.dataclass
class Impl:
    """One implementation at one chunk setting (and, for lmloss's rows, one kernel implementation).

    name: as given to ``--impl``. chunk: the chunk label shown in the table (``"1024"``, ``"none"``,
    ``"auto"``) or ``"-"`` for impls without one. kernel: ``torch`` / ``triton`` for lmloss's rows (its
    ``impl=``), ``"-"`` otherwise. step: forward + backward on the given leaves (gradients cleared), returns
    the loss. unavailable: why it cannot run here, or None. objective: what the loss is (module docstring);
    rows are checked against the reference of their objective. is_reference / is_floor: the naive row of an
    objective and the matmul floor, the bases of the check and the ratio columns. mutates_inputs: the step
    writes into its inputs, so each run gets fresh copies. traffic: logits workload, how many times the
    ``[T, V]`` logits' bytes must move at the least (3: the forward reads them, the backward reads them and
    writes the gradient; 2: in-place, one read and one write); the bandwidth column is that over the time.
    prepare: builds a run's inputs from the case's (default: `Inputs.reuse`, or `Inputs.fresh` when
    mutates_inputs). grads_of: reads the gradients after the step (default: ``.grad`` of the leaves).
    """

    name: str
    chunk: str
    step: Step | None
    unavailable: str | None = None
    is_reference: bool = False
    is_floor: bool = False
    mutates_inputs: bool = False
    kernel: str = "-"
    objective: str = "logprobs"
    traffic: int | None = None
    prepare: Callable[[Inputs], Inputs] | None = None
    grads_of: Callable[[Inputs], dict[str, torch.Tensor]] | None = None
    budget_mib: float | None = None

    @property
    def label(self) -> str:
        return row_label(self.name, self.chunk, self.kernel, self.budget_mib)

    def inputs_for_run(self, inputs: Inputs) -> Inputs:
        if self.prepare is not None:
            return self.prepare(inputs)
        return inputs.fresh() if self.mutates_inputs else inputs.reuse()

    def gradients(self, x: Inputs) -> dict[str, torch.Tensor]:
        if self.grads_of is not None:
            return self.grads_of(x)
        return {k: v.grad for k, v in x.leaves.items() if v.grad is not None}


def row_label(name: str, chunk: str, kernel: str, budget_mib: float | None = None) -> str:
    """``name[chunk]``, with ``/triton`` for lmloss's Triton rows (its PyTorch rows keep the plain label) and
    ``@<budget>MiB`` for a row run with ``memory_budget_mib=``."""
    label = name if chunk == "-" else f"{name}[{chunk}]"
    label = label + "/triton" if kernel == "triton" else label
    return label if budget_mib is None else f"{label}@{budget_mib:g}MiB"


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


def _naive_logits_entropy(x: Inputs) -> torch.Tensor:
    logp = F.log_softmax(x.logits.float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    loss = logp.gather(1, x.labels[:, None]).sum() + ENTROPY_COEF * entropy.sum()
    loss.backward()
    return loss.detach()


def _chunked_logits(chunk: int | None, kernel: dict) -> Step:
    def step(x: Inputs) -> torch.Tensor:
        loss = lmloss.token_logprobs(x.logits, x.labels, chunk_size=chunk, **kernel).sum()
        loss.backward()
        return loss.detach()

    return step


def _entropy_logits(chunk: int | None, kernel: dict) -> Step:
    def step(x: Inputs) -> torch.Tensor:
        logp, entropy = lmloss.token_logprobs(
            x.logits, x.labels, chunk_size=chunk, return_entropy=True, **kernel
        )
        loss = logp.sum() + ENTROPY_COEF * entropy.sum()
        loss.backward()
        return loss.detach()

    return step


class _ModelOutput(torch.autograd.Function):
    """Stands in for the layer that produced the logits (an ``lm_head``), for the in-place rows.

    lmloss's in-place gradient overwrites its input, which PyTorch allows on a non-leaf only. The forward
    copies the values (outside the timed region) into a non-leaf; the backward keeps the gradient that
    arrives in ``sink["logits"]`` (for the check) and sends nothing further.
    """

    @staticmethod
    def forward(ctx, values: torch.Tensor, anchor: torch.Tensor, sink: dict) -> torch.Tensor:
        ctx.sink = sink
        return values.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # detached: the in-place gradient is the forward's output itself, whose grad_fn is this node, and
        # holding it through ctx would make a cycle through the autograd graph that gc cannot free (every
        # tracked run of an in-place row then kept a [T, V] tensor alive for the rest of the case)
        ctx.sink["logits"] = grad.detach()
        return None, None, None


def _as_model_output(inputs: Inputs) -> Inputs:
    anchor = torch.zeros((), device=inputs.logits.device, requires_grad=True)
    sink: dict[str, torch.Tensor] = {}
    x = Inputs(labels=inputs.labels, logits=_ModelOutput.apply(inputs.logits.detach(), anchor, sink))
    x.sink = sink  # type: ignore[attr-defined]
    return x


def _inplace_logits(chunk: int | None, kernel: dict) -> Step:
    def step(x: Inputs) -> torch.Tensor:
        # loss.backward() as a training step calls it (an upstream of 1.0: the backward moves no bytes);
        # the objective is the summed log-probs, like naive's, so the loss returned and the gradient read
        # (`_inplace_gradient`, outside the timed region) are negated
        loss = lmloss.cross_entropy(
            x.logits, x.labels, chunk_size=chunk, reduction="sum", inplace_backward=True, **kernel
        )
        loss.backward()
        return -loss.detach()

    return step


def _inplace_gradient(x: Inputs) -> dict[str, torch.Tensor]:
    return {"logits": -x.sink["logits"]}


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


def _compile_reason(device: str) -> str | None:
    """Why ``torch.compile`` cannot run here, or None."""
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    if device.startswith("cuda") and importlib.util.find_spec("triton") is None:
        return "torch.compile on CUDA needs triton, which is not installed"
    return None


def _compiled_step(
    expression: Callable, args_of: Callable[[Inputs], tuple], device: str
) -> tuple[Step | None, str | None]:
    """``torch.compile(expression)`` (static shapes: one compile per case, in the untimed memory run)."""
    reason = _compile_reason(device)
    if reason:
        return None, reason
    compiled = torch.compile(expression, dynamic=False)

    def step(x: Inputs) -> torch.Tensor:
        loss = compiled(*args_of(x))
        loss.backward()
        return loss.detach()

    return step, None


def _naive_logprobs_expression(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(logits.float(), dim=-1).gather(1, labels[:, None]).sum()


def _needs_cuda(device: str, what: str) -> str | None:
    if not device.startswith("cuda"):
        return f"{what} runs Triton kernels on CUDA only"
    if importlib.util.find_spec("triton") is None:
        return f"{what} needs triton, which is not installed"
    return None


def _liger_ce_step(device: str) -> tuple[Step | None, str | None]:
    reason = _needs_cuda(device, "Liger")
    if reason:
        return None, reason
    try:
        loss_cls = importlib.import_module("liger_kernel.transformers").LigerCrossEntropyLoss
    except Exception as err:
        return None, f"liger-kernel not importable ({type(err).__name__}: {err})"

    def step(x: Inputs) -> torch.Tensor:
        # Liger writes the gradient into its input during the forward (hence fresh inputs per run)
        loss = -loss_cls(reduction="sum")(x.logits, x.labels)
        loss.backward()
        return loss.detach()

    return step, None


# ------------------------------------------------------------------------------------------ fused workload

#: Teacher heads of the ``distill`` objective, one per case: ``(hidden, weight)`` derived from the case's
#: leaves (the student's hidden states, the weight's rows in reverse order), made once outside the timed runs.
_TEACHERS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _teacher_of(x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    key = (x.weight.data_ptr(), tuple(x.weight.shape), x.weight.dtype, x.hidden.data_ptr())
    if key not in _TEACHERS:
        _TEACHERS.clear()  # one case at a time
        _TEACHERS[key] = (x.hidden.detach().clone(), x.weight.detach().flip(0).contiguous())
    return _TEACHERS[key]


def _naive_fused(x: Inputs) -> torch.Tensor:
    # The logits are materialized in the input dtype (as a model's LM head does); the loss is taken in fp32.
    loss = F.cross_entropy((x.hidden @ x.weight.T).float(), x.labels)
    loss.backward()
    return loss.detach()


def _naive_ce_expression(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((hidden @ weight.T).float(), labels)


def _naive_fused_rl(x: Inputs) -> torch.Tensor:
    logp = F.log_softmax((x.hidden @ x.weight.T).float() / TEMPERATURE, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    loss = (logp.gather(1, x.labels[:, None])[:, 0] * x.upstream).sum() + ENTROPY_COEF * entropy.sum()
    loss.backward()
    return loss.detach()


def _lmloss_fused(chunk: int | str | None, kwargs: dict) -> Step:
    def step(x: Inputs) -> torch.Tensor:
        loss = lmloss.linear_cross_entropy(x.hidden, x.weight, x.labels, chunk_size=chunk, **kwargs)
        loss.backward()
        return loss.detach()

    return step


def _lmloss_fused_rl(chunk: int | str | None, kwargs: dict) -> Step:
    def step(x: Inputs) -> torch.Tensor:
        logp, entropy = lmloss.linear_token_logprobs(
            x.hidden, x.weight, x.labels, chunk_size=chunk, temperature=TEMPERATURE, return_entropy=True,
            **kwargs,
        )  # fmt: skip
        loss = (logp * x.upstream).sum() + ENTROPY_COEF * entropy.sum()
        loss.backward()
        return loss.detach()

    return step


#: The ``ppo`` objective's options (`lmloss.rl.policy_loss` names).
PPO_OPTIONS = dict(clip_ratio=0.2, clip_ratio_c=3.0, kl_loss_type="k3", kl_loss_coef=0.01, entropy_coeff=ENTROPY_COEF)


def _ppo_inputs(x: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Old log-probs, advantages, reference log-probs ``[T]`` from the upstream ``u``: around the log-prob of a
    uniform guess (random logits put every token near it), so some ratios clip and some do not."""
    base = -torch.log(torch.tensor(float(x.weight.shape[0]))) - 0.5
    old = base + 0.3 * x.upstream
    return old, x.upstream, old - 0.1 * x.upstream.sign()


def _naive_fused_ppo(x: Inputs) -> torch.Tensor:
    logp = F.log_softmax((x.hidden @ x.weight.T).float() / TEMPERATURE, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    old, adv, ref = _ppo_inputs(x)
    mask = torch.ones_like(x.labels, dtype=torch.bool)
    loss, _ = lmloss.rl.policy_loss(logp.gather(1, x.labels[:, None])[:, 0], old, adv, mask, ref_logprobs=ref,
                                    entropy=entropy, **PPO_OPTIONS)  # fmt: skip
    loss.backward()
    return loss.detach()


def _lmloss_fused_ppo(chunk: int | str | None, kwargs: dict) -> Step:
    def step(x: Inputs) -> torch.Tensor:
        old, adv, ref = _ppo_inputs(x)
        loss, _ = lmloss.rl.linear_policy_loss(
            x.hidden, x.weight, x.labels, old, adv, ref_logprobs=ref, temperature=TEMPERATURE, chunk_size=chunk,
            **PPO_OPTIONS, **kwargs,
        )  # fmt: skip
        loss.backward()
        return loss.detach()

    return step


def _lmloss_two_pass_ppo(chunk: int | str | None, kwargs: dict) -> Step:
    def step(x: Inputs) -> torch.Tensor:
        old, adv, ref = _ppo_inputs(x)
        logp, entropy = lmloss.linear_token_logprobs(
            x.hidden, x.weight, x.labels, chunk_size=chunk, temperature=TEMPERATURE, return_entropy=True, **kwargs
        )
        mask = torch.ones_like(x.labels, dtype=torch.bool)
        loss, _ = lmloss.rl.policy_loss(logp, old, adv, mask, ref_logprobs=ref, entropy=entropy, **PPO_OPTIONS)
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


def _naive_distill(x: Inputs) -> torch.Tensor:
    """Forward KL(teacher || student) from both heads' materialized logits, fp32, mean over tokens."""
    t_hidden, t_weight = _teacher_of(x)
    log_s = F.log_softmax((x.hidden @ x.weight.T).float(), dim=-1)
    with torch.no_grad():
        log_t = F.log_softmax((t_hidden @ t_weight.T).float(), dim=-1)
    loss = (log_t.exp() * (log_t - log_s)).sum(-1).mean()
    loss.backward()
    return loss.detach()


def _lmloss_distill(chunk: int | str | None, kwargs: dict) -> Step:
    def step(x: Inputs) -> torch.Tensor:
        t_hidden, t_weight = _teacher_of(x)
        loss = lmloss.linear_distillation_loss(
            x.hidden, x.weight, t_hidden, t_weight, x.labels, beta=0.0, chunk_size=chunk, **kwargs
        )
        loss.backward()
        return loss.detach()

    return step


def _distill_floor(x: Inputs) -> None:
    """The four matmuls a fused distillation forward+backward must do: both heads' logits, ``G W`` and
    ``G^T h`` (the student logits stand in for their gradient G): the ``distill`` objective's speed floor."""
    t_hidden, t_weight = _teacher_of(x)
    with torch.no_grad():
        logits = x.hidden @ x.weight.T
        teacher = t_hidden @ t_weight.T
        x.hidden.grad = logits @ x.weight
        x.weight.grad = logits.T @ x.hidden
        del teacher
    return None


#: The ``dpo`` objective: pairs per batch (the tokens split into 2 * DPO_PAIRS equal sequences) and beta.
DPO_PAIRS = 4
DPO_BETA = 0.1


def _dpo_sequences(t: torch.Tensor) -> torch.Tensor:
    """``[T, ...]`` tokens -> ``[2 * DPO_PAIRS, T / (2 * DPO_PAIRS), ...]`` sequences (chosen half, rejected half)."""
    return t.view(2 * DPO_PAIRS, -1, *t.shape[1:])


def _dpo_of_sums(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """DPO's sigmoid loss of per-sequence sums ``[2 * DPO_PAIRS]`` (TRL's ``loss_type="sigmoid"``, no smoothing)."""
    b = DPO_PAIRS
    margin = (logps[:b] - ref_logps[:b]) - (logps[b:] - ref_logps[b:])
    return -F.logsigmoid(DPO_BETA * margin).mean()


def _dpo_of_stats(stats) -> torch.Tensor:
    return _dpo_of_sums(stats.logps, stats.ref_logps)


def _naive_dpo(x: Inputs) -> torch.Tensor:
    """Both heads' logits materialized (fp32 log-softmax), the labels' log-probs summed per sequence."""
    t_hidden, t_weight = _teacher_of(x)
    lp = F.log_softmax((x.hidden @ x.weight.T).float(), dim=-1).gather(1, x.labels[:, None])[:, 0]
    with torch.no_grad():
        ref = F.log_softmax((t_hidden @ t_weight.T).float(), dim=-1).gather(1, x.labels[:, None])[:, 0]
    loss = _dpo_of_sums(_dpo_sequences(lp).sum(-1), _dpo_sequences(ref).sum(-1))
    loss.backward()
    return loss.detach()


#: The vocabulary tile TRL 1.16's fused LM head passes (``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE``; read
#: here, not imported: ``trl.trainer`` takes ~5x longer to import than ``trl.kernels``).
TRL_VOCAB_TILE = 32768


def _trl_dpo_step() -> tuple[Step | None, str | None]:
    """TRL 1.16's own DPO path: its fused LM head's ``ChunkedLogProbFunction`` (what ``add_fused_lm_head`` runs,
    with the vocabulary tile ``DPOTrainer`` passes) for the policy and, without gradient, the reference; the
    per-sequence sums and the sigmoid loss as its ``_compute_loss`` takes them."""
    try:
        from trl.kernels import ChunkedLogProbFunction
    except Exception as err:
        return None, f"trl's fused LM head not importable ({type(err).__name__}: {err})"

    def logprobs(hidden, weight, labels):
        return ChunkedLogProbFunction.apply(hidden, weight, None, labels, 1.0, TRL_VOCAB_TILE, None, 1.0, ())[0]

    def step(x: Inputs) -> torch.Tensor:
        t_hidden, t_weight = _teacher_of(x)
        lp = logprobs(x.hidden, x.weight, x.labels)
        with torch.no_grad():
            ref = logprobs(t_hidden, t_weight, x.labels)
        loss = _dpo_of_sums(_dpo_sequences(lp).sum(-1), _dpo_sequences(ref).sum(-1))
        loss.backward()
        return loss.detach()

    return step, None


def _lmloss_fused_dpo(chunk: int | str | None, kwargs: dict) -> Step:
    def step(x: Inputs) -> torch.Tensor:
        from lmloss.preference import linear_preference_loss

        t_hidden, t_weight = _teacher_of(x)
        loss = linear_preference_loss(
            _dpo_sequences(x.hidden), x.weight, _dpo_sequences(x.labels), loss=_dpo_of_stats,
            ref_hidden=_dpo_sequences(t_hidden), ref_weight=t_weight, chunk_size=chunk, **kwargs,
        )  # fmt: skip
        loss.backward()
        return loss.detach()

    return step


def _liger_preference_step(kind: str) -> tuple[Step | None, str | None]:
    """Liger's fused preference losses (``LigerFusedLinearDPOLoss`` / ``LigerFusedLinearORPOLoss``: chunked by
    pair, not by token), with the reference head for DPO."""
    name = {"dpo": "LigerFusedLinearDPOLoss", "orpo": "LigerFusedLinearORPOLoss"}[kind]
    try:
        loss_cls = getattr(importlib.import_module("liger_kernel.chunked_loss"), name)
    except Exception as err:
        return None, f"liger-kernel not importable ({type(err).__name__}: {err})"

    def step(x: Inputs) -> torch.Tensor:
        t_hidden, t_weight = _teacher_of(x)
        h, y = _dpo_sequences(x.hidden), _dpo_sequences(x.labels)
        if kind == "dpo":
            out = loss_cls(beta=DPO_BETA)(x.weight, h, y, ref_input=_dpo_sequences(t_hidden), ref_weight=t_weight)
        else:
            out = loss_cls(beta=DPO_BETA)(x.weight, h, y)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        return loss.detach()

    return step, None


def _matmul_floor(x: Inputs) -> None:
    """The three matmuls any forward+backward of this shape must do: ``h W^T``, ``G W`` and ``G^T h``.

    In the inputs' dtype, as bare ``@``; the logits stand in for their own gradient G, so there is no softmax
    at all: a speed floor, not a loss.
    """
    with torch.no_grad():
        logits = x.hidden @ x.weight.T
        x.hidden.grad = logits @ x.weight
        x.weight.grad = logits.T @ x.hidden
    return None


#: At most this many rows of the weight gradient are compared with float64 (evenly spaced over the vocab).
WGRAD_SAMPLE_ROWS = 8192


def wgrad_sample_rows(vocab: int, device: str) -> torch.Tensor:
    """The vocabulary rows whose weight gradient the ``wgrad err`` column compares: all, or 8192 spaced."""
    if vocab <= WGRAD_SAMPLE_ROWS:
        return torch.arange(vocab, device=device)
    return torch.linspace(0, vocab - 1, WGRAD_SAMPLE_ROWS, device=device).round().long()


def ce_weight_grad_float64(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    rows: torch.Tensor,
    *,
    block: int = 16384,
) -> torch.Tensor:
    """d/dW of ``mean_t -log softmax(h_t W^T)[y_t]`` at vocabulary `rows`, in float64: ``[len(rows), H]``.

    Written out on its own (not lmloss's code): pass 1 walks the vocabulary in blocks for each token block
    to get every token's float64 log-sum-exp; pass 2 needs only the sampled rows' logits:
    ``dW[r] = sum_t (softmax_tr - [y_t = r]) h_t / T``. Memory: one ``[1024, block]`` float64 tile.
    """
    h64 = hidden.detach().double()
    n, vocab = h64.shape[0], weight.shape[0]
    lse = torch.empty(n, dtype=torch.float64, device=h64.device)
    for s in range(0, n, 1024):
        hs = h64[s : s + 1024]
        running = torch.full((hs.shape[0],), -torch.inf, dtype=torch.float64, device=h64.device)
        for v in range(0, vocab, block):
            tile = hs @ weight.detach()[v : v + block].double().T
            running = torch.logaddexp(running, torch.logsumexp(tile, dim=-1))
        lse[s : s + 1024] = running
    w_rows = weight.detach()[rows].double()
    probs = torch.exp(h64 @ w_rows.T - lse[:, None])  # [T, R]
    probs -= (labels[:, None] == rows[None, :]).double()
    return (probs.T @ h64) / n


# ------------------------------------------------------------- logits workload: the rollout engine's truncation

#: The sampling rows' settings: vLLM's top-k and top-p, and the replayed kept set's width.
SAMPLING_TOP_K, SAMPLING_TOP_P, REPLAY_K = 50, 0.9, 512
#: id(logits) -> (a weak reference to them, labels every truncation keeps (each row's argmax), the top
#: REPLAY_K ids [T, K]); tensors compare elementwise, so they are not dictionary keys themselves.
_SAMPLED: dict[int, tuple] = {}


def _sampled(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    entry = _SAMPLED.get(id(logits))
    if entry is None or entry[0]() is not logits:
        with torch.no_grad():
            top = logits.topk(REPLAY_K, dim=1).indices
        _SAMPLED.clear()  # one case at a time: keep no earlier case's tensors alive
        entry = _SAMPLED[id(logits)] = (weakref.ref(logits), top[:, 0].contiguous(), top)
    return entry[1], entry[2]


def _sampled_inputs(x: Inputs) -> Inputs:
    """The case's logits with labels a sampler could have drawn under any truncation (each row's argmax:
    random labels would mostly fall outside a top-50 set, -inf), and the replayed set beside them. Made
    once per case, outside the timed region."""
    x = x.reuse()
    return Inputs(labels=_sampled(x.logits)[0], logits=x.logits)


def _naive_truncated(top_k: int | None, top_p: float | None) -> Step:
    """vLLM's PyTorch sampler path written plainly: sort, mask, scatter back, full log-softmax."""

    def step(x: Inputs) -> torch.Tensor:
        logits = x.logits.float()
        srt, idx = logits.sort(dim=-1)
        mask = torch.zeros_like(srt, dtype=torch.bool)
        if top_k is not None:
            mask |= srt < srt[:, -top_k : -top_k + 1]
        if top_p is not None:
            cum = srt.masked_fill(mask, -math.inf).softmax(-1).cumsum(-1)
            mask |= cum <= 1 - top_p
            mask[:, -1] = False
        keep = torch.empty_like(mask).scatter_(1, idx, ~mask)
        loss = F.log_softmax(logits.masked_fill(~keep, -math.inf), dim=-1).gather(1, x.labels[:, None]).sum()
        loss.backward()
        return loss.detach()

    return step


def _naive_replay(x: Inputs) -> torch.Tensor:
    support = _sampled(x.logits)[1]
    keep = torch.zeros(x.logits.shape, dtype=torch.bool, device=x.logits.device).scatter_(1, support, True)
    logp = F.log_softmax(x.logits.float().masked_fill(~keep, -math.inf), dim=-1)
    loss = logp.gather(1, x.labels[:, None]).sum()
    loss.backward()
    return loss.detach()


def _sampled_logits(**truncation) -> Callable:
    def make(chunk: int | None, kernel: dict) -> Step:
        def step(x: Inputs) -> torch.Tensor:
            kw = dict(truncation)
            if kw.pop("replay", False):
                kw["support"] = _sampled(x.logits)[1]
            loss = lmloss.token_logprobs(x.logits, x.labels, chunk_size=chunk, **kw, **kernel).sum()
            loss.backward()
            return loss.detach()

        return step

    return make


SAMPLING_ROWS = {
    # name: (objective, naive row's step or None for lmloss's row, lmloss step maker)
    "naive-topk": (f"top-k={SAMPLING_TOP_K}", _naive_truncated(SAMPLING_TOP_K, None), None),
    "topk": (f"top-k={SAMPLING_TOP_K}", None, _sampled_logits(top_k=SAMPLING_TOP_K)),
    "naive-topp": (f"top-p={SAMPLING_TOP_P}", _naive_truncated(None, SAMPLING_TOP_P), None),
    "topp": (f"top-p={SAMPLING_TOP_P}", None, _sampled_logits(top_p=SAMPLING_TOP_P)),
    "naive-replay": (f"replay K={REPLAY_K}", _naive_replay, None),
    "replay": (f"replay K={REPLAY_K}", None, _sampled_logits(replay=True)),
}


# -------------------------------------------------------------------------------------------- the registry

LOGITS_IMPLS = (
    "naive", "chunked", "inplace", "naive-entropy", "entropy", "compile", "liger", "megatron", *SAMPLING_ROWS,
)  # fmt: skip
FUSED_IMPLS = (
    "naive", "fused", "fused-lowacc", "naive-rl", "fused-rl", "naive-ppo", "fused-ppo", "two-pass-ppo", "compile",
    "torch-fused", "cce", "liger", "matmul-floor", "naive-distill", "fused-distill", "distill-floor",
    "naive-dpo", "trl-dpo", "fused-dpo", "liger-dpo", "liger-orpo", "dpo-floor",
)  # fmt: skip
#: Speed floors other than ``matmul-floor``: the objective whose rows' ``time/floor`` is against that row.
FLOORS = {"dpo": "dpo-floor"}
IMPLS_BY_WORKLOAD = {"logits": LOGITS_IMPLS, "fused": FUSED_IMPLS}
#: What runs when ``--impl`` is not given: on CPU the sweep of the README's table; on CUDA every row.
DEFAULT_IMPLS = {
    "cpu": {"logits": ["naive", "chunked", "megatron"],
            "fused": ["naive", "fused", "torch-fused", "cce", "liger", "matmul-floor"]},
    "cuda": {"logits": list(LOGITS_IMPLS), "fused": list(FUSED_IMPLS)},
}  # fmt: skip


#: The lmloss ops that take ``invariant=`` (docs/invariant.md): ``--invariant`` adds a ``+inv`` row beside each
#: of their rows.
INVARIANT_OPS = frozenset(
    {"token_logprobs", "cross_entropy", "linear_token_logprobs", "linear_cross_entropy", "rl.linear_policy_loss"}
)
INVARIANT_SUFFIX = "+inv"


def build_impls(
    workload: str,
    device: str,
    names: list[str],
    chunks: list[int | str | None],
    kernels: list[str] = ("torch",),  # type: ignore[assignment]
    invariant: bool = False,
    budgets: list[float | None] = (None,),  # type: ignore[assignment]
) -> list[Impl]:
    """The impls of `workload` named in `names`, lmloss's own expanded over `chunks` x `kernels` x `budgets`
    (``memory_budget_mib=`` of the op; None: its default).

    A naive row comes before the rows checked against it. ``"auto"`` is passed on as ``chunk_size="auto"``
    (every op's default: its own choice of chunk size). `invariant`: after each row of an op in
    `INVARIANT_OPS`, the same row with ``invariant=True``, named with `INVARIANT_SUFFIX` (timed interleaved
    with it, as every row of a case is).
    """
    out: list[Impl] = []

    def lmloss_rows(name: str, op: str, make: Callable, objective: str, *, extra_kwargs: dict | None = None,
                    **impl_kw) -> None:  # fmt: skip
        variants = [("", {})] + ([(INVARIANT_SUFFIX, {"invariant": True})] if invariant and op in INVARIANT_OPS else [])
        for kernel in kernels:
            reason = _triton_device_reason(kernel, device)
            for c in chunks:
                for budget in budgets:
                    for suffix, extra in variants:
                        kw = {"impl": kernel, **(extra_kwargs or {}), **extra}
                        if budget is not None:
                            kw["memory_budget_mib"] = budget
                        step = None if reason else make(c, kw)
                        out.append(Impl(name + suffix, chunk_label(c), step, reason, kernel=kernel, objective=objective,
                                        budget_mib=budget, **impl_kw))  # fmt: skip

    for name in IMPLS_BY_WORKLOAD[workload]:
        if name not in names:
            continue
        if workload == "logits":
            if name == "naive":
                out.append(Impl("naive", "-", _naive_logits, is_reference=True, traffic=3))
            elif name == "chunked":
                lmloss_rows(name, "token_logprobs", _chunked_logits, "logprobs", traffic=3)
            elif name == "inplace":
                lmloss_rows(name, "cross_entropy", _inplace_logits, "logprobs",
                            traffic=2, prepare=_as_model_output, grads_of=_inplace_gradient)  # fmt: skip
            elif name == "naive-entropy":
                out.append(Impl(name, "-", _naive_logits_entropy, is_reference=True, objective="logprobs+entropy",
                                traffic=3))  # fmt: skip
            elif name == "entropy":
                lmloss_rows(name, "token_logprobs", _entropy_logits, "logprobs+entropy", traffic=3)
            elif name == "compile":
                step, reason = _compiled_step(
                    _naive_logprobs_expression, lambda x: (x.logits, x.labels), device
                )
                out.append(Impl(name, "-", step, reason, traffic=3))
            elif name == "liger":
                out.append(Impl(name, "-", *_liger_ce_step(device), mutates_inputs=True, traffic=2))
            elif name == "megatron":
                step, reason = _megatron_step(device)
                # fp32 logits are shifted in place by Megatron's forward (its .float() is then a no-op)
                out.append(Impl("megatron", "-", step, reason, mutates_inputs=True, traffic=3))
            elif name in SAMPLING_ROWS:
                objective, naive_step, make = SAMPLING_ROWS[name]
                if make is None:
                    out.append(Impl(name, "-", naive_step, is_reference=True, objective=objective, traffic=3,
                                    prepare=_sampled_inputs))  # fmt: skip
                elif "torch" in kernels:  # the kept-set threshold is in the PyTorch kernels only
                    for c in chunks:
                        if c != "auto":
                            out.append(Impl(name, chunk_label(c), make(c, {"impl": "torch"}), kernel="torch",
                                            objective=objective, traffic=3, prepare=_sampled_inputs))  # fmt: skip
        else:
            if name == "naive":
                out.append(Impl("naive", "-", _naive_fused, is_reference=True, objective="ce"))
            elif name == "fused":
                lmloss_rows(name, "linear_cross_entropy", _lmloss_fused, "ce")
            elif name == "fused-lowacc":
                # the weight/bias gradient accumulated in the weight's dtype (made per case in the runner)
                lmloss_rows(name, "linear_cross_entropy", _lowacc(_lmloss_fused), "ce")
            elif name == "naive-rl":
                out.append(Impl(name, "-", _naive_fused_rl, is_reference=True, objective="rl"))
            elif name == "fused-rl":
                lmloss_rows(name, "linear_token_logprobs", _lmloss_fused_rl, "rl")
            elif name == "naive-ppo":
                out.append(Impl(name, "-", _naive_fused_ppo, is_reference=True, objective="ppo"))
            elif name == "fused-ppo":
                lmloss_rows(name, "rl.linear_policy_loss", _lmloss_fused_ppo, "ppo")
            elif name == "two-pass-ppo":
                lmloss_rows(name, "linear_token_logprobs", _lmloss_two_pass_ppo, "ppo")
            elif name == "compile":
                step, reason = _compiled_step(
                    _naive_ce_expression, lambda x: (x.hidden, x.weight, x.labels), device
                )
                out.append(Impl(name, "-", step, reason, objective="ce"))
            elif name == "torch-fused":
                out.append(Impl("torch-fused", "-", *_torch_fused(), objective="ce"))
            elif name == "cce":
                out.append(Impl("cce", "-", *_cce_step(device), objective="ce"))
            elif name == "liger":
                out.append(Impl("liger", "-", *_liger_step(device), objective="ce"))
            elif name == "matmul-floor":
                out.append(Impl("matmul-floor", "-", _matmul_floor, is_floor=True, objective="-"))
            elif name == "naive-distill":
                out.append(Impl(name, "-", _naive_distill, is_reference=True, objective="distill"))
            elif name == "fused-distill":
                lmloss_rows(name, "linear_distillation_loss", _lmloss_distill, "distill")
            elif name == "distill-floor":
                out.append(Impl(name, "-", _distill_floor, objective="-"))
            elif name == "naive-dpo":
                out.append(Impl(name, "-", _naive_dpo, is_reference=True, objective="dpo"))
            elif name == "trl-dpo":
                out.append(Impl(name, "-", *_trl_dpo_step(), objective="dpo"))
            elif name == "fused-dpo":
                lmloss_rows(name, "preference.linear_preference_loss", _lmloss_fused_dpo, "dpo")
            elif name in ("liger-dpo", "liger-orpo"):
                kind = name.removeprefix("liger-")
                out.append(Impl(name, "-", *_liger_preference_step(kind), objective=kind))
            elif name == "dpo-floor":  # the policy's three matmuls and the reference's one: `_distill_floor`'s
                out.append(Impl(name, "-", _distill_floor, objective="-"))
    return out


def _lowacc(make: Callable) -> Callable:
    """A step maker whose step passes ``weight_grad_dtype=<the weight's dtype>``."""

    def make_lowacc(chunk, kwargs: dict) -> Step:
        def step(x: Inputs) -> torch.Tensor:
            return make(chunk, {**kwargs, "weight_grad_dtype": x.weight.dtype})(x)

        return step

    return make_lowacc
