"""Static sm_90 report of the Triton kernels: ``python -m lmloss.kernels.report [--json] [--vocab V ...]``.

No GPU is needed: each kernel configuration the ops launch for a vocabulary width is compiled ahead of time
for an H100 (``triton.compile(..., target=GPUTarget("cuda", 90, 32))``, with the specialisations Triton's JIT
makes for contiguous bf16 logits of that width: 16-byte aligned pointers, and widths / row strides flagged
as multiples of 16 only when they are), and its SASS is read with the ``nvdisasm`` / ``cuobjdump`` that ship
inside the triton wheel. Per kernel and role it prints:

- ``registers``, ``spills`` (local-memory stores, ``STL``), ``shared_memory`` (bytes, Triton's allocation);
- ``vectorized_main_loop``: every global load and store of the main loop is 16 bytes wide (``.128``);
- ``instructions_per_element``: SASS instructions of the innermost loop that streams the row (the loop's
  body, branch included; for the candidates' pass, whose steps rarely take their branch, the common path)
  divided by the elements each thread handles per iteration (bytes its ``LDG``s load / the element size, so an
  unrolled loop counts right; the full KL's kernels load two chunks per element);
- ``bytes_per_element`` (from memory, per element of the row) and ``budget``: the instructions per element an
  H100 issues in the time its memory moves those bytes (`ISSUE_PER_BYTE`); a loop within it is memory-bound.

These are static figures: they bound the hot loop's issue cost against the memory floor (about 4.4
instructions per thread per ns per SM on an H100 against ~3 TB/s), and say nothing of latency or occupancy
that only a GPU's clock can show.

The compiles run in this process with Triton's interpreter off; under ``TRITON_INTERPRET=1`` (the test suite)
`main` re-runs itself in a child process without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

#: (label, local width, valid columns): GPT-2, Llama 2, Llama 3, Qwen 2's real vocabulary, and the last shard
#: of Qwen 2's padded 151936 over TP=8 (18992 columns of which 18699 are vocabulary).
WIDTHS: tuple[tuple[str, int, int], ...] = (
    ("32000", 32000, 32000),
    ("50257", 50257, 50257),
    ("128256", 128256, 128256),
    ("151643", 151643, 151643),
    ("151936/tp8-last", 18992, 18699),
)

#: (kernel, role, stores, bytes per element): each role is measured on the first of its kernel's main loops
#: (`main_loops`) that stores to global memory (a gradient pass) or not (a statistics pass), as `stores` says;
#: its bytes from memory per bf16 element (a gradient pass reads and writes; the one-kernel loss's second pass
#: re-reads its row from L2; the invariant pass writes 16 bytes per 128 columns).
ROLES: tuple[tuple[str, str, bool, float], ...] = (
    ("softmax_partials", "forward", False, 2),
    ("softmax_grad", "backward", True, 4),
    ("cross_entropy_loss_and_grad", "cross_entropy_pass1", False, 2),
    ("cross_entropy_loss_and_grad", "cross_entropy_pass2", True, 2),
    ("softmax_grad", "backward_full_kl", True, 6),
    ("difference_sums", "full_kl_sums", False, 4),
    ("search_histogram", "top_k_histogram", False, 2),
    ("search_histogram", "top_p_histogram", False, 2),
    ("search_candidates", "top_p_candidates", False, 2),
    ("block_partials", "invariant_forward", False, 2.125),
)
#: The roles of the default report (`--role` picks others): the plain ops' kernels, and since issue #33 the full
#: KL's, the kept set's search and the invariant mode's.
DEFAULT_ROLES = tuple(role for _, role, _, _ in ROLES)
#: H100 SXM: 132 SMs x 4 schedulers x 32 lanes at ~1.7 GHz issue 2.87e13 thread-instructions per second; ~3.0 TB/s
#: of HBM3 bandwidth is achievable: instructions per element a pass may issue per byte it moves.
ISSUE_PER_BYTE = 132 * 4 * 32 * 1.7e9 / 3.0e12

_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+`?\(?(\.L_x_\d+)")


@dataclasses.dataclass
class Row:
    kernel: str
    role: str
    vocab: str
    block_v: int
    num_warps: int
    registers: int
    spills: int
    shared_memory: int
    vectorized_main_loop: bool
    instructions_per_element: float
    loop_instructions: int
    elements_per_thread: float
    bytes_per_element: float = 0.0
    budget: float = 0.0

    @property
    def within_budget(self) -> bool:
        return self.instructions_per_element <= self.budget


def _bin(tool: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool)


def _sass_and_registers(cubin: bytes) -> tuple[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_bin("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run(
            [_bin("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    return sass, registers


def _opcode(instruction: str) -> str:
    """``LDG.E.128`` of ``@!P0 LDG.E.128 R4, desc[UR4][R2.64]`` (the predicate dropped)."""
    words = instruction.split()
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def _access_bytes(instruction: str) -> int | None:
    """Bytes one thread moves with a global load / store instruction (None if it is neither): the width
    modifier of ``LDG`` / ``STG`` (``.128``, ``.64``, ``.U16``, ...; none means 32 bits)."""
    parts = _opcode(instruction).split(".")
    if parts[0] not in ("LDG", "STG"):
        return None
    sizes = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}
    return next((sizes[p] for p in parts[1:] if p in sizes), 4)


def _inner_spans(sass: str) -> list[tuple[int, int]]:
    """Line spans (label, backward branch) of the innermost loops, in program order."""
    lines = sass.splitlines()
    labels: dict[str, int] = {}
    loops: list[tuple[int, int]] = []
    for i, line in enumerate(lines):
        if m := _LABEL.match(line):
            labels[m.group(1)] = i
        elif (m := _BRANCH.search(line)) and m.group(1) in labels:
            loops.append((labels[m.group(1)], i))
    return [(a, b) for a, b in loops if not any(a <= c < d <= b and (c, d) != (a, b) for c, d in loops)]


def _body(lines: list[str], a: int, b: int) -> list[str]:
    return [m.group(1) for line in lines[a : b + 1] if (m := _INSTRUCTION.match(line))]


def innermost_loops(sass: str) -> list[list[str]]:
    """The bodies (instruction texts, label to backward branch) of the innermost loops, in program order."""
    lines = sass.splitlines()
    return [_body(lines, a, b) for a, b in _inner_spans(sass)]


def _streams(body: list[str]) -> bool:
    loads = [i for i in body if _opcode(i).startswith("LDG")]
    return bool(loads) and not any(i.startswith("@") for i in loads)


def main_loops(sass: str) -> list[list[str]]:
    """Innermost loops that stream the row: they load from global memory and no load is predicated."""
    return [body for body in innermost_loops(sass) if _streams(body)]


def common_path(sass: str) -> list[str]:
    """The first streaming loop's body without the instructions its longest forward branch skips (a step
    that is rarely taken: the search's candidates)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    a, b = next((a, b) for a, b in _inner_spans(sass) if _streams(_body(lines, a, b)))
    skipped = 0
    for i in range(a, b):
        m = _BRANCH.search(lines[i])
        if m and a < labels.get(m.group(1), -1) <= b and labels[m.group(1)] > i:
            skipped = max(skipped, len(_body(lines, i + 1, labels[m.group(1)])))
    body = _body(lines, a, b)
    return body[: len(body) - skipped]


def measure(body: list[str], element_size: int, streamed_stores: bool = True) -> tuple[bool, int, float]:
    """(every global access 16 bytes, instructions, elements per thread per iteration) of a loop body.
    `streamed_stores` False: the stores are per-block results, not the row (only the loads must be 16 bytes)."""
    accesses = [(i, _access_bytes(i)) for i in body]
    accesses = [(i, b) for i, b in accesses if b is not None and (streamed_stores or "LDG" in i)]
    loaded = sum(b for i, b in accesses if "LDG" in i)
    return all(b == 16 for _, b in accesses), len(body), loaded / element_size


def _compile(kernel, signature: dict, constexprs: dict, aligned: set[str], num_warps: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name in aligned}
    src = ASTSource(kernel, {**signature, **{k: "constexpr" for k in constexprs}}, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def kernel_rows(
    label: str, width: int, valid: int, roles: tuple[str, ...] | None = None, all_options: bool = False
) -> list[Row]:
    """Compile the kernels the ops launch for bf16 logits ``[N, width]`` (contiguous, `valid` vocabulary
    columns), at their default blocks, and measure each role's loop. Default options: log-probs / plain
    cross-entropy at temperature 1; `all_options`: temperature, softcap, entropy, label smoothing and
    z-loss all on (the roles that take them)."""
    from lmloss.kernels import INVARIANT_BLOCK
    from lmloss.kernels import triton_kernels as tk
    from lmloss.kernels import triton_sampling as ts

    roles = DEFAULT_ROLES if roles is None else roles
    f32, i32 = "fp32", "i32"
    pointers = {"x_ptr", "out_ptr", "labels_ptr", "lse_ptr", "entropy_ptr", "coef_ptr", "res_ptr", "z_ptr", "zc_ptr",
                "grad_scale_ptr", "keep_ptr", "target_ptr", "lo_ptr", "shift_ptr", "counts_ptr", "mass_ptr",
                "bits_ptr", "values_ptr", "count_ptr", "above_ptr", "live_ptr"}  # fmt: skip
    sixteen = {name for name, n in (("valid", valid), ("n_cols", width)) if n % 16 == 0}
    if width % 16 == 0:
        sixteen |= {"x_row_stride", "out_row_stride", "z_row_stride"}
    math = {"scale": f32, "inv_cap": f32, "cap_scale": f32}
    on = all_options
    flags = dict(SCALE=on, SOFTCAP=on, ALIGN=8, FAST=True)
    grad_sig = {"x_ptr": "*bf16", "x_row_stride": i32, "out_ptr": "*bf16", "out_row_stride": i32,
                "labels_ptr": "*i64", "lse_ptr": "*fp32", "entropy_ptr": "*fp32", "coef_ptr": "*fp32", "n_cols": i32,
                "valid": i32, "vocab_start": i32, **math, "keep_ptr": "*fp32", "z_ptr": "*bf16", "z_row_stride": i32,
                "zc_ptr": "*fp32"}  # fmt: skip
    search_sig = {"x_ptr": "*bf16", "x_row_stride": i32, "lo_ptr": "*fp32", "shift_ptr": "*fp32"}
    # role -> (kernel, block table, n for the table, signature, constexprs, rare branch, streamed stores)
    specs = {
        "forward": (
            tk._softmax_partials_kernel, tk.FORWARD_BLOCKS, valid,
            {"x_ptr": "*bf16", "x_row_stride": i32, "labels_ptr": "*i64", "out_ptr": "*fp32", "valid": i32,
             "vocab_start": i32, **math, "keep_ptr": "*fp32", "live_ptr": "*i1"},
            dict(flags, ENTROPY=on, TARGET=True, SUM_LOGITS=on, KEEP=False, LIVE=False, SUM_SQ=False, ARGMAX=False,
                 WIDTH=5), False, True,
        ),
        "backward": (tk._softmax_grad_kernel, tk.BACKWARD_BLOCKS, width, grad_sig,
                     dict(flags, ENTROPY=on, LABELS=True, KEEP=False, DIFF=False), False, True),
        # the folded full KL: no softcap (the fold needs dy/dx = scale)
        "backward_full_kl": (tk._softmax_grad_kernel, tk.BACKWARD_BLOCKS, width, grad_sig,
                             dict(flags, SOFTCAP=False, ENTROPY=on, LABELS=True, KEEP=False, DIFF=True), False, True),
        "full_kl_sums": (
            tk._difference_sums_kernel, tk.FORWARD_BLOCKS, valid,
            {"x_ptr": "*bf16", "x_row_stride": i32, "z_ptr": "*bf16", "z_row_stride": i32, "lse_ptr": "*fp32",
             "out_ptr": "*fp32", "valid": i32, "scale": f32},
            dict(SCALE=on, ALIGN=8, FAST=True), False, True,
        ),
        "cross_entropy": (
            tk._cross_entropy_loss_grad_kernel, tk.FORWARD_BLOCKS if on else tk.CROSS_ENTROPY_BLOCKS, width,
            {"x_ptr": "*bf16", "x_row_stride": i32, "out_ptr": "*bf16", "out_row_stride": i32,
             "labels_ptr": "*i64", "res_ptr": "*fp32", "grad_scale_ptr": "*fp32", "n_rows": i32, "n_cols": i32,
             "valid": i32, "ignore_index": i32, **math, "eps": f32, "z_loss": f32, "inv_vocab": f32},
            dict(flags, SMOOTHING=on, Z_LOSS=on), False, True,
        ),
        "top_k_histogram": (
            ts._histogram_kernel, tk.FORWARD_BLOCKS, valid,
            {**search_sig, "counts_ptr": "*i32", "mass_ptr": "*fp32", "valid": i32, "scale": f32},
            dict(SCALE=on, MODE=ts.MODE_KEY, NB=ts.NBINS, ALIGN=8, FAST=True, SHARED=ts.HISTOGRAM_IN_SHARED), False, True,
        ),
        "top_p_histogram": (
            ts._histogram_kernel, tk.FORWARD_BLOCKS, valid,
            {**search_sig, "counts_ptr": "*i32", "mass_ptr": "*fp32", "valid": i32, "scale": f32},
            dict(SCALE=on, MODE=ts.MODE_MASS, NB=ts.NBINS, ALIGN=8, FAST=True, SHARED=ts.HISTOGRAM_IN_SHARED), False, True,
        ),
        "top_p_candidates": (
            ts._candidates_kernel, tk.FORWARD_BLOCKS, valid,
            {**search_sig, "bits_ptr": "*i32", "values_ptr": "*fp32", "count_ptr": "*i32", "above_ptr": "*fp32",
             "valid": i32, "width": i32, "scale": f32},
            dict(SCALE=on, MODE=ts.MODE_MASS, ALIGN=8, FAST=True), True, False,
        ),
        "invariant_forward": (
            tk._block_partials_kernel, None, valid,
            {"x_ptr": "*bf16", "x_row_stride": i32, "labels_ptr": "*i64", "out_ptr": "*fp32", "target_ptr": "*fp32",
             "valid": i32, "n_blocks": i32, "vocab_start": i32, **math, "keep_ptr": "*fp32"},
            dict(flags, ENTROPY=on, TARGET=True, SUM_LOGITS=on, KEEP=False, BLOCK=INVARIANT_BLOCK,
                 GROUP=tk.BLOCK_GROUP, ARGMAX=False), False, False,
        ),
    }  # fmt: skip
    rows = []
    compiled_for: dict[tuple, tuple] = {}
    for kernel_name, role, stores, nbytes in ROLES:
        if role not in roles:
            continue
        key = "cross_entropy" if kernel_name == "cross_entropy_loss_and_grad" else role
        kernel, table, n, signature, constexprs, rare_branch, streamed_stores = specs[key]
        if table is None:  # the invariant kernel's fixed tile
            block, warps = tk.INVARIANT_BLOCK * tk.BLOCK_GROUP, tk.BLOCK_WARPS
            extra = {}
        else:
            block, warps = tk.block_config(n, table)
            extra = {"BLOCK_V": block}
        if key not in compiled_for:
            aligned = {a for a in pointers | sixteen if a in signature}
            compiled = _compile(kernel, signature, dict(constexprs, **extra), aligned, warps)
            compiled_for[key] = (compiled, *_sass_and_registers(compiled.asm["cubin"]))
        compiled, sass, registers = compiled_for[key]
        loops = main_loops(sass)
        spills = sum(1 for line in sass.splitlines() if re.search(r"\bSTL\b", line))
        if rare_branch or not streamed_stores:  # its stores (if any) are a few per step, not the row: its loop
            body = loops[0] if loops else None
        else:
            body = next((b for b in loops if any(_opcode(i).startswith("STG") for i in b) == stores), None)
        if body is None:
            raise RuntimeError(f"{kernel_name}: no main loop {'with' if stores else 'without'} stores in the SASS")
        vectorized, count, elements = measure(body, element_size=2, streamed_stores=streamed_stores)
        elements /= 2 if role.startswith("full_kl") or role.endswith("full_kl") else 1  # x and z: two loads each
        if rare_branch:
            count = len(common_path(sass))
        rows.append(Row(
            kernel=kernel_name, role=role, vocab=label, block_v=block, num_warps=warps, registers=registers,
            spills=spills, shared_memory=int(compiled.metadata.shared), vectorized_main_loop=vectorized,
            instructions_per_element=round(count / elements, 2), loop_instructions=count, elements_per_thread=elements,
            bytes_per_element=nbytes, budget=round(nbytes * ISSUE_PER_BYTE, 1),
        ))  # fmt: skip
    return rows


def report(widths=WIDTHS, roles: tuple[str, ...] | None = None, all_options: bool = False) -> list[Row]:
    """`kernel_rows` for each of `widths` (``(label, width, valid)``)."""
    return [row for label, w, valid in widths for row in kernel_rows(label, w, valid, roles, all_options)]


def format_table(rows: list[Row]) -> str:
    head = ("kernel", "role", "vocab", "BLOCK_V/warps", "regs", "spills", "smem", "16B main loop", "instr/elem",
            "budget")  # fmt: skip
    body = [
        (r.kernel, r.role, r.vocab, f"{r.block_v}/{r.num_warps}", str(r.registers), str(r.spills),
         str(r.shared_memory), "yes" if r.vectorized_main_loop else "NO", f"{r.instructions_per_element:.2f}",
         f"{r.budget:.1f} ({r.bytes_per_element:g} B)" + ("" if r.within_budget else " OVER"))
        for r in rows
    ]  # fmt: skip
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmloss.kernels.report", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON list of rows instead of a table")
    parser.add_argument("--vocab", nargs="+", help="only these widths (labels of WIDTHS, or plain integers)")
    parser.add_argument("--role", nargs="+", choices=sorted({r for _, r, _, _ in ROLES}), help="only these roles")
    parser.add_argument("--all-options", action="store_true",
                        help="temperature, softcap, entropy, label smoothing and z-loss on (default: all off)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":  # the compiler is off under the interpreter: run in a child
        env = dict(os.environ, TRITON_INTERPRET="0")
        cmd = [sys.executable, "-m", "lmloss.kernels.report", *(argv if argv is not None else sys.argv[1:])]
        return subprocess.run(cmd, env=env).returncode
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    widths = WIDTHS
    if args.vocab:
        known = {label: (label, w, v) for label, w, v in WIDTHS}
        widths = tuple(known.get(v) or (v, int(v), int(v)) for v in args.vocab)
    rows = report(widths, tuple(args.role) if args.role else None, args.all_options)
    if args.json:
        json.dump([dict(dataclasses.asdict(r), within_budget=r.within_budget) for r in rows], sys.stdout, indent=1)
        print()
    else:
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
