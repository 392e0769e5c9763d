"""Chunk sources, gradient sinks and heads: what the one chunk loop (`lmloss.plan`) reads and writes.

A *chunk source* ``source(s, e) -> x [c, V_local]`` yields the logits of tokens ``[s, e)``: a slice of the
logits (`LogitRows`) or the LM head's matmul of hidden rows (`HiddenRows`); `lmloss.replay` adds the
replayed support's slots. ``source.owns_chunks`` says whether the chunk is the caller's scratch (the
kernels may overwrite it).

A *gradient sink* receives each chunk's gradient: ``sink.buffer(s, e, x)`` says where the kernel writes it
and ``sink.consume(s, e, g)`` takes it from there: a ``[N, V_local]`` buffer (`BufferSink`), the logits
themselves (`InPlaceSink`), or the fp32 accumulators of the hidden / weight / bias gradients
(`Accumulators`, which chain the chunk's d-logits through the matmuls).

A *head* is what an op differentiates: `LogitsHead` (the logits) or `LinearHead` (hidden states, weight,
bias). It gives a pass its source and sink (sharing one scratch) and turns the sink into the leaves'
gradients. The loss Functions (`lmloss.functions`) run any head through the loop.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from lmloss.kernels import ChunkScratch, scale_, scaled_cast
from lmloss.vocab_parallel import ProcessGroup, all_reduce_sum_, gather_rows, reduce_scatter_rows, world_size

#: Working-set budget for ``chunk_size="auto"`` (MiB); override with ``LMLOSS_CHUNK_BUDGET_MIB``.
DEFAULT_CHUNK_BUDGET_MIB = {"cpu": 64, "cuda": 2048}


def chunk_budget_mib(device: torch.device | str = "cpu") -> float:
    """``LMLOSS_CHUNK_BUDGET_MIB`` if set (a positive number), else `DEFAULT_CHUNK_BUDGET_MIB` for the device
    type. Read before the TP ranks' agreement gather, which carries it: ranks with different budgets would
    cut different chunks and issue different collectives."""
    text = os.environ.get("LMLOSS_CHUNK_BUDGET_MIB")
    if text is None:
        return float(DEFAULT_CHUNK_BUDGET_MIB.get(torch.device(device).type, 96))
    try:
        budget = float(text)
    except ValueError:
        budget = math.nan
    if not 0 < budget < math.inf:
        raise ValueError(f"LMLOSS_CHUNK_BUDGET_MIB must be a positive number of MiB, got {text!r}")
    return budget


def auto_chunk_size(
    n_tokens: int,
    local_vocab: int,
    device: torch.device | str = "cpu",
    bytes_per_logit: float = 8,
    *,
    budget_mib: float | None = None,
) -> int:
    """Tokens per chunk for ``chunk_size="auto"``: as many as fit the op's per-chunk working set
    (``bytes_per_logit`` per logit; 0: nothing chunk-sized, one chunk) in the budget (`chunk_budget_mib`
    by default: 64 MiB on CPU, 2 GiB on CUDA). Rounded down to a multiple of 64 (matmul-friendly) when
    >= 64; at least 1, at most `n_tokens`."""
    if bytes_per_logit <= 0:
        return max(n_tokens, 1)
    budget_mib = chunk_budget_mib(device) if budget_mib is None else budget_mib
    rows = int(budget_mib * 2**20 // (bytes_per_logit * max(local_vocab, 1)))
    if rows >= 64:
        rows -= rows % 64
    return max(1, min(rows, max(n_tokens, 1)))


#: The invariant mode's GEMM tile per device type, ``(rows, weight rows)``: every logit of a fused op is made by
#: a GEMM of exactly ``[rows, H] @ [H, weight rows]`` (`tiled_linear`), whatever the chunk, the batch or the
#: shard, so that the matmul library picks the same kernel for it every time. On this CPU library (oneDNN /
#: MKL) a GEMM of fewer than 64 rows takes another kernel and rounds differently; tiles of 128 rows cost
#: what one GEMM over the chunk costs (measured at 256 x 256 x 32000 fp32), 4096 columns keep the calls few.
#: The CUDA tile is a first guess, not measured (docs/invariant.md).
INVARIANT_GEMM_TILE = {"cpu": (128, 4096), "cuda": (256, 8192)}


def invariant_gemm_tile(device: torch.device | str) -> tuple[int, int]:
    """`INVARIANT_GEMM_TILE` for the device's type (the CPU's for any other)."""
    return INVARIANT_GEMM_TILE.get(torch.device(device).type, INVARIANT_GEMM_TILE["cpu"])


def _tile_starts(n: int, size: int) -> list[int]:
    """Starts of `size`-wide tiles covering ``[0, n)`` (``n >= size``), the last one ending at n (overlapping
    the one before it when size does not divide n)."""
    starts = list(range(0, n - size + 1, size))
    return starts if n % size == 0 else [*starts, n - size]


#: The CPU's invariant fp32 GEMMs sum the hidden dimension in chunks of this many columns (the last one shorter),
#: one GEMM each, added in order: with MKL here a longer fp32 reduction rounds differently for other row counts
#: and thread counts (H = 4096: the 128-row tile itself changed between 1 and 2 threads; bf16 / fp16 did not).
_CPU_GEMM_K = 256


def tiled_linear(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, tile: tuple[int, int]
) -> torch.Tensor:
    """``out[:c, :N] = hidden @ weight.T (+ bias)`` for ``hidden [c, H]`` and ``weight [N, H]`` by GEMMs of fixed
    shapes, so that a logit's bits depend on its own row of `hidden` and column of `weight` (and the library's
    kernels for those shapes), not on c, N or its place. `tile` = (R, Nb): tiles of Nb weight rows, the last
    overlapping the one before it (zero-padded where N < Nb); writing overlapping tiles twice writes the same
    values.

    CUDA: each tile is one ``[R, H] @ [H, Nb]`` GEMM, the rows in tiles of R too (zero-padded where c < R).
    CPU: fp32 sums the hidden dimension in chunks of `_CPU_GEMM_K` (one GEMM each, added in order); the whole R-row tiles
    as ``[R, H] @ [H, Nb]``, and the rows after them (c < R included) as ``weight_tile @ hidden_rows.T`` for any
    count of at least 2 rows (one row gets a zero row beside it): with this CPU's MKL both give a row the same
    bits as an R-row tile, for fp32, bf16 and fp16, 1 or 2 threads (checked over H up to 4096, 2 to 127 rows and
    tiles of 384 to 4096 weight rows), so a row alone costs about one pass over the weight instead of an
    R-row GEMM. float64 (where the transposed form rounds differently) pads the rows to whole tiles."""
    rows, cols = tile
    c, n = hidden.shape[0], weight.shape[0]
    if c == 0 or n == 0:
        return out
    h, w, b = hidden, weight, bias
    cpu = hidden.device.type == "cpu" and hidden.shape[1] > 0
    lone_rows = c % rows if cpu and hidden.dtype != torch.float64 else 0  # rows after the whole tiles
    if c < rows and not lone_rows:
        h = hidden.new_zeros((rows, hidden.shape[1]))
        h[:c] = hidden
    if n < cols:
        w = weight.new_zeros((cols, weight.shape[1]))
        w[:n] = weight
        if bias is not None:
            b = bias.new_zeros(cols)
            b[:n] = bias
    split_k = cpu and hidden.dtype == torch.float32  # (bf16 / fp16 partials would round to the output dtype)
    k_parts = [(k, k + _CPU_GEMM_K) for k in range(0, hidden.shape[1], _CPU_GEMM_K)] if split_k else [(0, None)]

    def gemm(a, bt, bias_, dst, tmp):  # dst = a @ bt (+ bias_) over the hidden chunks, added in order
        for i, (k0, k1) in enumerate(k_parts):
            target = dst if i == 0 else tmp
            if i == 0 and bias_ is not None:
                torch.addmm(bias_, a[:, k0:k1], bt[k0:k1], out=target)
            else:
                torch.mm(a[:, k0:k1], bt[k0:k1], out=target)
            if i:
                dst.add_(tmp)
        return dst

    n_tiled = c - lone_rows if lone_rows else max(c, rows)  # rows made in R-row tiles (padded where c < R)
    direct = c >= rows and n >= cols
    scratch = None if direct else torch.empty((rows, cols), dtype=out.dtype, device=out.device)
    tmp = torch.empty((rows, cols), dtype=out.dtype, device=out.device) if len(k_parts) > 1 else None
    if n_tiled:
        for i in _tile_starts(n_tiled, rows):
            for j in _tile_starts(max(n, cols), cols):
                dst = out[i : i + rows, j : j + cols] if direct else scratch
                gemm(h[i : i + rows], w[j : j + cols].t(), None if b is None else b[j : j + cols], dst, tmp)
                if not direct:
                    r_n, c_n = min(rows, c - i), min(cols, n - j)
                    out[i : i + r_n, j : j + c_n] = dst[:r_n, :c_n]
    if lone_rows:  # transposed: weight_tile [Nb, H] @ hidden_rows.T [H, r], r >= 2
        lone = hidden[n_tiled:]
        if lone_rows == 1:
            lone = torch.cat([lone, lone.new_zeros((1, lone.shape[1]))])
        lone_t = lone.t()
        starts = _tile_starts(max(n, cols), cols)
        acc = torch.empty((len(starts), cols, lone.shape[0]), dtype=out.dtype, device=out.device)
        tmp_t = torch.empty_like(acc[0]) if len(k_parts) > 1 else None
        for t, j in enumerate(starts):
            gemm(w[j : j + cols], lone_t, None if b is None else b[j : j + cols, None], acc[t], tmp_t)
        # into `out` in two copies: the tiles end to end, then the last one (which may overlap the one before it)
        whole = (len(starts) - 1) * cols
        if whole:
            out[n_tiled:c, :whole] = acc[:-1].reshape(whole, -1)[:, :lone_rows].t()
        c_n = min(cols, n - starts[-1])
        out[n_tiled:c, starts[-1] : starts[-1] + c_n] = acc[-1, :c_n, :lone_rows].t()
    return out


@functools.lru_cache(maxsize=8)
def gemm_accumulates_into_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(fp32, lowp, lowp, out_dtype=float32)`` runs here (CUDA, PyTorch >= 2.11)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        a = torch.ones((2, 2), dtype=dtype, device=device)
        acc = torch.ones((2, 2), dtype=torch.float32, device=device)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return bool((acc == 3.0).all())  # accumulated into the buffer it read (1 + 1*1 + 1*1)


def chunk_dtype_for(weight: torch.Tensor, weight_grad_dtype: torch.dtype) -> torch.dtype:
    """The dtype each fused chunk's logits (then d-logits, in place) live in.

    The input dtype when the weight-gradient GEMM can take low-precision d-logits as they are: fp32
    inputs, a low-precision accumulator by request, or a GEMM that accumulates into the fp32 buffer
    itself (CUDA). Otherwise (bf16 / fp16 on CPU) fp32, so that the fp32 accumulator gets unrounded
    d-logits.
    """
    if weight.dtype in (torch.float32, torch.float64) or weight_grad_dtype == weight.dtype:
        return weight.dtype
    return weight.dtype if gemm_accumulates_into_fp32(weight.device, weight.dtype) else torch.float32


# ----------------------------------------------------------------------------------------------------------
# sources


class LogitRows:
    """Chunk source over ``[N, V_local]`` logits: a row slice, made contiguous along the vocabulary if needed."""

    owns_chunks = False

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def __call__(self, s: int, e: int) -> torch.Tensor:
        x = self.logits[s:e]
        return x if x.stride(-1) == 1 else x.contiguous()


class HiddenRows:
    """Chunk source: ``hidden[s:e] @ weight.T (+ bias)`` into one reused ``[chunk, V_local]`` buffer.

    The chunk is made in the weight's dtype (a bf16 / fp16 GEMM accumulates in fp32 and rounds its output
    once) and, when `chunk_dtype` is fp32 (low-precision inputs whose d-logits must be fp32, see
    `chunk_dtype_for`), upcast into an fp32 buffer. The chunk is scratch the kernels may overwrite.
    `name` keeps two heads' buffers apart in one scratch (a teacher beside the student).
    """

    owns_chunks = True

    def __init__(
        self, hidden, weight, bias, scratch: ChunkScratch, chunk_dtype: torch.dtype, name: str = "",
        gemm_tile: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        self.hidden, self.weight, self.bias, self.scratch = hidden, weight, bias, scratch
        self.chunk_dtype, self.name, self.gemm_tile = chunk_dtype, name, gemm_tile

    def __call__(self, s: int, e: int) -> torch.Tensor:
        v_local = self.weight.shape[0]
        z = self.scratch.get(self.name + "logits_lowp", e - s, v_local, self.weight.dtype)
        if self.gemm_tile is not None:  # the invariant mode: GEMMs of one fixed shape
            tiled_linear(self.hidden[s:e], self.weight, self.bias, z, self.gemm_tile)
        elif self.bias is None:
            torch.mm(self.hidden[s:e], self.weight.t(), out=z)
        else:
            torch.addmm(self.bias, self.hidden[s:e], self.weight.t(), out=z)
        if self.chunk_dtype == z.dtype:
            return z
        return self.scratch.get(self.name + "logits", e - s, v_local, self.chunk_dtype).copy_(z)


# ----------------------------------------------------------------------------------------------------------
# sinks


class BufferSink:
    """Gradient sink that is a preallocated ``[N, V]`` buffer: the kernel writes each chunk's rows."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad

    def buffer(self, s, e, x):
        return self.grad[s:e]

    def consume(self, s, e, grad):
        pass


class InPlaceSink:
    """Gradient sink that is the logits themselves: each chunk's gradient overwrites its logits."""

    def buffer(self, s, e, x):
        return x

    def consume(self, s, e, grad):
        pass


class Accumulators:
    """Gradient sink of a fused head: chains each chunk's d-logits into hidden / weight / bias gradients.

    hidden: ``[N, H]``, each row written once (hidden dtype; fp32 when TP ranks' partials are summed).
    weight, bias: accumulated over chunks in `weight_grad_dtype`.
    None where that input needs no gradient.
    """

    def __init__(self, hidden, weight, bias, needs, *, weight_grad_dtype, tp_summed, sequence_parallel, scratch):
        self.hidden_in, self.weight_in, self.scratch = hidden, weight, scratch
        self.sequence_parallel = sequence_parallel
        h_dtype = torch.promote_types(hidden.dtype, torch.float32) if tp_summed else hidden.dtype
        self.hidden = torch.empty(hidden.shape, dtype=h_dtype, device=hidden.device) if needs[0] else None
        # not zero-filled: the first chunk's GEMM writes it with beta=0 (one plain GEMM for a single chunk)
        self.weight = (
            torch.empty(weight.shape, dtype=weight_grad_dtype, device=weight.device) if needs[1] else None
        )
        self.weight_written = False
        self.bias = None
        if bias is not None and needs[2]:
            bias_dtype = torch.promote_types(bias.dtype, torch.float32)
            self.bias = torch.zeros(bias.shape, dtype=bias_dtype, device=bias.device)

    def buffer(self, s, e, x):
        return x  # the chunk is scratch (`chunk_dtype_for`): its d-logits overwrite it

    def consume(self, s, e, dz):
        rows, w = self.hidden_in[s:e], self.weight_in
        if self.hidden is not None:
            # the source's low-precision chunk buffer is free again once the chunk was upcast
            dz_w = dz if dz.dtype == w.dtype else self.scratch.get("logits_lowp", *dz.shape, w.dtype).copy_(dz)
            if self.hidden.dtype == w.dtype:
                torch.mm(dz_w, w, out=self.hidden[s:e])
            else:  # the GEMM accumulates in fp32 internally; each hidden row comes from one GEMM
                self.hidden[s:e] = torch.mm(dz_w, w)
        if self.weight is not None:
            beta = 1.0 if self.weight_written else 0.0  # beta=0: the buffer's unset contents are not read
            if dz.dtype == self.weight.dtype:
                self.weight.addmm_(dz.t(), rows if rows.dtype == dz.dtype else rows.to(dz.dtype), beta=beta)
            else:  # low-precision d-logits into the fp32 accumulator, on the tensor cores
                torch.addmm(self.weight, dz.t(), rows, out_dtype=torch.float32, beta=beta, out=self.weight)
            self.weight_written = True
        if self.bias is not None:
            self.bias.add_(dz.sum(dim=0, dtype=self.bias.dtype))

    def finish(self, hidden, weight, bias, tp_group, scale=None):
        """The gradients in their inputs' dtypes; scaled by the upstream scalar `scale` if given, in the same
        pass as the cast (`scaled_cast`: no pass at all over a same-dtype buffer when `scale` is 1.0)."""
        gh = gw = gb = None
        if self.hidden is not None:
            if not self.sequence_parallel:  # with it, the sum is `GatherRows`' backward (a reduce-scatter)
                all_reduce_sum_(self.hidden, tp_group)
            gh = scaled_cast(self.hidden, scale, hidden.dtype)
        if self.weight is not None:
            if not self.weight_written:  # no chunk (no tokens): a zero gradient
                self.weight.zero_()
            gw = scaled_cast(self.weight, scale, weight.dtype)
        if self.bias is not None:
            gb = scaled_cast(self.bias, scale, bias.dtype)
        return gh, gw, gb


class GatherRows(torch.autograd.Function):
    """Sequence parallelism: gather token rows over TP in rank order; the backward sums each rank's
    partial gradient (it covers one vocabulary shard) and hands every rank its own rows."""

    @staticmethod
    def forward(ctx, rows, group):
        ctx.group = group
        return gather_rows(rows, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_rows(grad.contiguous(), ctx.group), None


# ----------------------------------------------------------------------------------------------------------
# heads


class LogitsHead:
    """The logits ``[N, V_local]`` as what is differentiated: chunks are row slices; a per-token backward
    writes the gradient into one ``[N, V_local]`` buffer of the logits' dtype."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits
        self.n, self.device, self.dtype = logits.shape[0], logits.device, logits.dtype

    @property
    def leaves(self) -> tuple[torch.Tensor, ...]:
        return (self.logits,)

    def source(self, rows: int, cols: int) -> LogitRows:
        return LogitRows(self.logits)

    def pass_with_sink(self, rows: int, cols: int, needs) -> tuple[LogitRows, BufferSink | None]:
        if not needs[0]:
            return LogitRows(self.logits), None
        grad = torch.empty(self.logits.shape, dtype=self.logits.dtype, device=self.logits.device)
        return LogitRows(self.logits), BufferSink(grad)

    def gradients(self, sink: BufferSink | None, scale: torch.Tensor | None = None, tp_group=None):
        if sink is None:
            return (None,)
        return (sink.grad if scale is None else scale_(sink.grad, scale),)


class LinearHead:
    """``hidden [N, H] @ weight.T [H, V_local] + bias``: chunks are matmuls of hidden rows; gradients go
    through `Accumulators` (hidden all-reduced over `tp_group` unless sequence-parallel, where
    `GatherRows`' backward sums them). `opts`: ``weight_grad_dtype``, ``tp_summed``,
    ``sequence_parallel``, ``chunk_dtype`` (see `chunk_dtype_for`), ``gemm_tile`` (the invariant mode's
    `tiled_linear` tile, or None)."""

    def __init__(self, hidden, weight, bias, opts: dict) -> None:
        self.hidden, self.weight, self.bias, self.opts = hidden, weight, bias, opts
        self.n, self.device, self.dtype = hidden.shape[0], hidden.device, hidden.dtype

    @property
    def leaves(self) -> tuple[torch.Tensor | None, ...]:
        return (self.hidden, self.weight, self.bias)

    def source(self, rows: int, cols: int, scratch: ChunkScratch | None = None) -> HiddenRows:
        scratch = ChunkScratch(rows, cols, self.device) if scratch is None else scratch
        return HiddenRows(self.hidden, self.weight, self.bias, scratch, self.opts["chunk_dtype"],
                          gemm_tile=self.opts.get("gemm_tile"))  # fmt: skip

    def pass_with_sink(self, rows: int, cols: int, needs) -> tuple[HiddenRows, Accumulators | None]:
        scratch = ChunkScratch(rows, cols, self.device)
        source = self.source(rows, cols, scratch)
        needs = (needs[0], needs[1], bool(needs[2]) and self.bias is not None)
        if not any(needs):
            return source, None
        sink = Accumulators(
            self.hidden, self.weight, self.bias, needs, scratch=scratch, weight_grad_dtype=self.opts["weight_grad_dtype"],
            tp_summed=self.opts["tp_summed"], sequence_parallel=self.opts["sequence_parallel"],
        )  # fmt: skip
        return source, sink

    def gradients(self, sink: Accumulators | None, scale: torch.Tensor | None = None, tp_group=None):
        if sink is None:
            return (None, None, None)
        return sink.finish(self.hidden, self.weight, self.bias, tp_group, scale)


def linear_head_options(
    weight: torch.Tensor, *, weight_grad_dtype: torch.dtype, sequence_parallel: bool, tp_group: ProcessGroup | None,
    invariant: bool = False,
) -> dict:  # fmt: skip
    """`LinearHead`'s options from the fused ops' arguments."""
    return dict(
        # float64 weights accumulate in float64 (the fp32 default is "at least fp32")
        weight_grad_dtype=torch.float64 if weight.dtype == torch.float64 else weight_grad_dtype,
        tp_summed=world_size(tp_group) > 1,
        sequence_parallel=sequence_parallel,
        chunk_dtype=chunk_dtype_for(weight, weight_grad_dtype),
        gemm_tile=invariant_gemm_tile(weight.device) if invariant else None,
    )
