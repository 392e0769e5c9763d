"""Every public op x option on one GPU against float64: how far the CUDA results are from the exact math.

    python tools/gpu_parity.py --device cuda --out OUT                      # on a lent GPU
    TRITON_INTERPRET=1 python tools/gpu_parity.py --device cpu --tiny       # a dry run of the script here

Each case builds small random inputs in float64 on the CPU (logits ``[256, 5000]``, or a fused head of
``[256, 64]`` hidden states and a ``[5000, 64]`` weight: a vocabulary that no kernel block divides; a few
labels ignored; ``[8, 32]`` sequences for the RL ops), rounds them to the row's dtype and runs the op on the
device with ``impl="triton"`` and with ``impl="torch"``. The reference is the same op on the same rounded
inputs, on the CPU in float64 with ``impl="torch"``: the path the CPU suite checks against plain math
(gradcheck included). Each row backpropagates ``sum(out * u)`` with a random upstream ``u`` (rounded to fp32
for both) and compares the value and each gradient: the max abs error, the reference's max abs (its scale)
and their ratio, which must be within the tolerance: 1e-5 for fp32 inputs, 2e-2 for bf16 ones (5e-2 into a
fused head, whose GEMM rounds the logits to bf16: `HEAD_BF16_TOL`). An RL loss's value is measured against
a scale of at least 1 (`Case.value_floor`). An option that the op does not take (read with `inspect`) gives
a skipped row, an exception a failed row with its message; the run goes on either way and exits 0.

The rows run in priority order (Triton fp32, PyTorch fp32, then bf16) within ``--budget-s`` seconds (45 by
default; the first call of each Triton specialization compiles it, the rest take milliseconds): rows past it
are written as skipped. ``OUT/parity.json`` is rewritten after every row: a run cut short keeps what it
measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
#: bf16 into a fused head: its GEMM writes bf16 logits, each off by up to 2^-9 of itself (~0.015 at the
#: largest, about 8 here), and the softmax passes that on to the gradients: bf16's error, not a kernel's
HEAD_BF16_TOL = 5e-2


@dataclasses.dataclass
class Case:
    op: str  # the public name under lmloss, e.g. "rl.linear_policy_loss"
    option: str
    make: Callable[[torch.Generator], dict]  # the float64 CPU inputs
    call: Callable[[dict, str], Any]  # (inputs, impl) -> a tensor or a tuple of them
    grads: tuple[str, ...]  # the inputs whose gradients are compared
    low: tuple[str, ...] = ()  # inputs given in the row's dtype (every other float input is fp32)
    uses: tuple[str, ...] = ()  # keyword arguments of the op that the case needs
    bf16: bool = False  # also a bf16 row
    bf16_tol: float = TOL[torch.bfloat16]
    # the value's scale is at least this: an RL loss is a mean of terms of about |advantage| ~ 1 that cancel,
    # so its own size says nothing of the rounding in it
    value_floor: float = 0.0

    def tolerance(self, dtype) -> float:
        return self.bf16_tol if dtype == torch.bfloat16 else TOL[dtype]


def _op(name: str):
    import lmloss

    fn = lmloss
    for part in name.split("."):
        fn = getattr(fn, part)
    return fn


def _cases(tiny: bool) -> list[Case]:
    import lmloss

    n, v, h = (32, 300, 16) if tiny else (256, 5000, 64)
    b, t = (4, 8) if tiny else (8, 32)  # the RL ops' sequences: b * t == n
    tight = 0.01 if tiny else 0.05  # MiB: below the bf16 head's fp32 accumulator, so the weight pass

    def labels(g, shape, logits=None, half=False):
        if logits is None:
            y = torch.randint(0, v, shape, generator=g)
        else:  # one of each row's top 3: kept by every truncation below, whatever the rounding
            pick = torch.randint(0, 3, (*shape, 1), generator=g)
            y = logits.topk(3, -1).indices.gather(-1, pick)[..., 0]
        flat = y.view(-1)
        flat[3::11] = -100  # a few ignored tokens
        if half:  # the first half of every 32-token sequence ignored, as prompts are
            flat.view(-1, min(32, n))[:, : min(16, n // 2)] = -100
        return y

    def logits_inputs(shape=(n,), top=False, **more):
        def make(g):
            x = torch.randn(*shape, v, generator=g, dtype=torch.float64) * 2
            out = dict(logits=x, labels=labels(g, shape, x if top else None))
            for k, f in more.items():
                out[k] = f(g, out)
            return out

        return make

    def head_inputs(shape=(n,), top=False, half=False, **more):
        def make(g):
            x = torch.randn(*shape, h, generator=g, dtype=torch.float64)
            w = torch.randn(v, h, generator=g, dtype=torch.float64) * (2 / h**0.5)
            out = dict(hidden=x, weight=w, labels=labels(g, shape, x @ w.T if top else None, half))
            for k, f in more.items():
                out[k] = f(g, out)
            return out

        return make

    # RL's per-token inputs. The old policy's log-probs are the current ones off by -0.5, -0.05, 0, 0.05 or
    # 0.5 (and a little noise): ratios well inside the clip range or well outside it, never near its edges,
    # where the rounding of bf16 logits (~0.01 in a log-prob) would move a token across, changing its gradient
    def rl_extra(fused: bool):
        def old(g, d):
            z = d["hidden"] @ d["weight"].T if fused else d["logits"]
            lp = torch.log_softmax(z, -1).gather(-1, d["labels"].clamp(min=0)[..., None])[..., 0]
            offset = torch.tensor([-0.5, -0.05, 0.0, 0.05, 0.5], dtype=torch.float64)
            pick = torch.randint(0, 5, lp.shape, generator=g)
            return lp + offset[pick] + 0.01 * torch.randn(lp.shape, generator=g, dtype=torch.float64)

        def adv(g, d):
            return torch.randn(d["labels"].shape, generator=g, dtype=torch.float64)

        def ref_lp(g, d):
            return d["old"] + 0.2 * torch.randn(d["labels"].shape, generator=g, dtype=torch.float64)

        def mask(g, d):  # the ignored tokens and a random fifth of the others
            return (d["labels"] != -100) & (torch.rand(d["labels"].shape, generator=g) > 0.2)

        return dict(old=old, adv=adv, ref_lp=ref_lp, mask=mask)

    def ref_logits(g, d):
        return d["logits"] + 0.3 * torch.randn(d["logits"].shape, generator=g, dtype=torch.float64)

    def ref_head(g, d):
        noise = torch.randn(d["weight"].shape, generator=g, dtype=torch.float64)
        d["ref_weight"] = d["weight"] + 0.05 * noise
        return d["hidden"] + 0.05 * torch.randn(d["hidden"].shape, generator=g, dtype=torch.float64)

    def teacher_logits(g, d):
        return torch.randn(d["logits"].shape, generator=g, dtype=torch.float64) * 2

    def teacher_head(g, d):
        d["t_weight"] = torch.randn(v, h, generator=g, dtype=torch.float64) * (2 / h**0.5)
        return torch.randn(d["hidden"].shape, generator=g, dtype=torch.float64)

    cases: list[Case] = []
    logit, head = ("logits",), ("hidden", "weight")  # the differentiable inputs of each kind
    rl_floor = dict(value_floor=1.0)

    def tlp(option, bf16=False, top=False, **kw):
        def call(d, impl):
            return lmloss.token_logprobs(d["logits"], d["labels"], impl=impl, **kw)

        make = logits_inputs(top=top)
        cases.append(Case("token_logprobs", option, make, call, logit, logit, tuple(kw), bf16))

    tlp("plain", bf16=True)
    tlp("return_entropy", bf16=True, return_entropy=True)
    tlp("temperature=0.7", temperature=0.7)
    tlp("softcap=5", softcap=5.0)
    tlp("top_k=50", top=True, top_k=50)
    tlp("top_p=0.9", top=True, top_p=0.9)
    tlp("min_p=0.05", top=True, min_p=0.05)
    tlp("top_p=0.9 T=0.7 entropy", bf16=True, top=True, top_p=0.9, temperature=0.7, return_entropy=True)
    tlp("invariant", invariant=True)
    entropy = lambda d, impl: lmloss.token_entropy(d["logits"], impl=impl)  # noqa: E731
    cases.append(Case("token_entropy", "plain", logits_inputs(), entropy, logit, logit))

    def ce(option, bf16=False, inplace=False, **kw):
        def call(d, impl):
            # inplace_backward overwrites its input, which must not be a leaf: give it a copy of the leaf
            x = d["logits"].clone() if inplace else d["logits"]
            extra = dict(inplace_backward=True) if inplace else {}
            return lmloss.cross_entropy(x, d["labels"], impl=impl, **extra, **kw)

        uses = (*kw, "inplace_backward") if inplace else tuple(kw)
        cases.append(Case("cross_entropy", option, logits_inputs(), call, logit, logit, uses, bf16))

    ce("mean", bf16=True)
    ce("reduction=sum", reduction="sum")
    ce("reduction=none", reduction="none")
    ce("label_smoothing=0.1", label_smoothing=0.1)
    ce("z_loss=1e-3", z_loss=1e-3)
    ce("inplace_backward", bf16=True, inplace=True)
    ce("invariant", invariant=True)

    def fused(op, option, bf16=False, top=False, half=False, **kw):
        def call(d, impl):
            return _op(op)(d["hidden"], d["weight"], d["labels"], impl=impl, **kw)

        make = head_inputs(top=top, half=half)
        cases.append(Case(op, option, make, call, head, head, tuple(kw), bf16, HEAD_BF16_TOL))

    fused("linear_cross_entropy", "mean", bf16=True)
    fused("linear_cross_entropy", "reduction=sum", reduction="sum")
    fused("linear_cross_entropy", "reduction=none", reduction="none")
    fused("linear_cross_entropy", "label_smoothing=0.1 z_loss=1e-3", label_smoothing=0.1, z_loss=1e-3)
    fused("linear_cross_entropy", "softcap=5 T=0.7", softcap=5.0, temperature=0.7)
    fused("linear_cross_entropy", f"memory_budget_mib={tight}", bf16=True, memory_budget_mib=tight)
    fused("linear_cross_entropy", "half ignored", bf16=True, half=True)
    fused("linear_cross_entropy", "invariant", invariant=True)
    fused("linear_token_logprobs", "plain", bf16=True)
    fused("linear_token_logprobs", "return_entropy", bf16=True, return_entropy=True)
    fused("linear_token_logprobs", "temperature=0.7", temperature=0.7)
    fused("linear_token_logprobs", "top_p=0.9", top=True, top_p=0.9)
    fused("linear_token_logprobs", "invariant", invariant=True)

    # rl.policy_loss takes log-probs: the device part is token_logprobs (and full_kl) with the row's impl
    def policy(option, bf16=False, entropy=False, full=False, **kw):
        def call(d, impl):
            out = lmloss.token_logprobs(d["logits"], d["labels"], impl=impl, return_entropy=entropy)
            lp, ent = out if entropy else (out, None)
            extra = dict(entropy=ent) if entropy else {}
            if full:  # the exact KL to the reference's logits, in place of ref_logprobs' estimate
                kl = lmloss.rl.full_kl(d["logits"], d["ref_logits"], d["labels"], impl=impl)
                extra.update(kl_loss_type="full", kl=kl, kl_loss_coef=0.1)
            else:
                extra.update(ref_logprobs=d["ref_lp"])
            return lmloss.rl.policy_loss(lp, d["old"], d["adv"], d["mask"], **extra, **kw)[0]

        more = rl_extra(fused=False)
        if full:
            more["ref_logits"] = ref_logits
        uses = (*kw, *(("entropy",) if entropy else ()), *(("kl",) if full else ()))
        make = logits_inputs((b, t), **more)
        cases.append(Case("rl.policy_loss", option, make, call, logit, (*logit, "ref_logits"), uses, bf16,
                          **rl_floor))  # fmt: skip

    ppo = dict(loss_mode="vanilla", clip_ratio_c=3.0, kl_loss_type="k3", kl_loss_coef=0.1)
    gspo = dict(loss_mode="gspo", loss_agg_mode="seq-mean-token-mean")
    policy("ppo vanilla dual-clip k3", bf16=True, **ppo)
    policy("gspo seq-mean-token-mean", **gspo)
    policy("full KL", full=True)
    policy("entropy_coeff=0.01", entropy=True, entropy_coeff=0.01)

    def linear_policy(option, bf16=False, mask=False, full=False, **kw):
        def call(d, impl):
            extra = dict(mask=d["mask"]) if mask else {}
            if full:
                extra.update(kl_loss_type="full", kl_loss_coef=0.1, ref_hidden=d["ref_hidden"],
                             ref_weight=d["ref_weight"])  # fmt: skip
            else:
                extra.update(ref_logprobs=d["ref_lp"])
            args = (d["hidden"], d["weight"], d["labels"], d["old"], d["adv"])
            return lmloss.rl.linear_policy_loss(*args, impl=impl, **extra, **kw)[0]

        more = rl_extra(fused=True)
        if full:
            more["ref_hidden"] = ref_head
        uses = (*kw, *(("mask",) if mask else ()), *(("ref_hidden", "ref_weight") if full else ()))
        make, low = head_inputs((b, t), **more), (*head, "ref_hidden", "ref_weight")
        cases.append(Case("rl.linear_policy_loss", option, make, call, head, low, uses, bf16, HEAD_BF16_TOL,
                          **rl_floor))  # fmt: skip

    linear_policy("ppo vanilla dual-clip k3", bf16=True, **ppo)
    linear_policy("gspo seq-mean-token-mean", **gspo)
    linear_policy("full KL (ref head)", bf16=True, full=True)
    linear_policy("entropy_coeff=0.01 T=0.7", entropy_coeff=0.01, temperature=0.7)
    linear_policy("mask=", mask=True)
    linear_policy("invariant", invariant=True)

    def distill(option, bf16=False, **kw):
        def call(d, impl):
            return lmloss.distillation_loss(d["logits"], d["teacher"], d["labels"], impl=impl, **kw)

        make = logits_inputs(teacher=teacher_logits)
        low = (*logit, "teacher")
        cases.append(Case("distillation_loss", option, make, call, logit, low, tuple(kw), bf16))

    distill("forward KL", bf16=True, beta=0.0)
    distill("reverse KL beta=1", beta=1.0)
    distill("JSD beta=0.5", beta=0.5)
    distill("forward KL T=2 none", beta=0.0, temperature=2.0, reduction="none")

    def linear_distill(option, bf16=False, **kw):
        def call(d, impl):
            args = (d["hidden"], d["weight"], d["teacher"], d["t_weight"], d["labels"])
            return lmloss.linear_distillation_loss(*args, impl=impl, **kw)

        make, low = head_inputs(teacher=teacher_head), (*head, "teacher", "t_weight")
        uses = tuple(kw)
        op = "linear_distillation_loss"
        cases.append(Case(op, option, make, call, head, low, uses, bf16, HEAD_BF16_TOL))

    linear_distill("forward KL", bf16=True, beta=0.0)
    linear_distill("JSD beta=0.5", beta=0.5)
    return cases


def _inputs(base: dict, case: Case, dtype, device, reference: bool) -> dict:
    """The row's tensors: `case.low` in `dtype`, other floats in fp32, on the device; the reference gets the
    same rounded values in float64 on the CPU (so only the op's own arithmetic differs)."""
    out = {}
    for k, x in base.items():
        if x.is_floating_point():
            x = x.to(dtype if k in case.low else torch.float32)
            x = x.double() if reference else x.to(device)
            if k in case.grads:
                x.requires_grad_()
        elif not reference:
            x = x.to(device)
        out[k] = x
    return out


def _forward_backward(case: Case, t: dict, impl: str, seed: int):
    """The op's outputs and the gradients of ``sum(out * u)`` (u: random, fp32-rounded, the same per case)."""
    outs = case.call(t, impl)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(seed)
    total = 0
    for o in outs:
        u = torch.randn(o.shape, generator=g).to(o.device, o.dtype)  # fp32 values whatever the output dtype
        total = total + (o * u).sum()
    total.backward()
    grads = [t[k].grad for k in case.grads]
    zero = [torch.zeros(t[k].shape, dtype=torch.float64) for k in case.grads]  # where no gradient came
    grads = [z if gr is None else gr.double().cpu() for z, gr in zip(zero, grads)]
    return [o.detach().double().cpu() for o in outs], grads


def _error(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> dict:
    """Max abs error, the reference's max abs (over its finite values; at least `floor`) and their ratio;
    equal infinities (a label outside a truncation's kept set) count as no error, NaN or an infinity on one
    side as infinite."""
    same = got == want
    diff = torch.where(same, torch.zeros_like(got), (got - want).abs()).nan_to_num(nan=math.inf)
    finite = want[want.isfinite()].abs()
    scale = max(finite.max().item() if finite.numel() else 0.0, floor)
    err = diff.max().item() if diff.numel() else 0.0
    rel = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
    return dict(abs=err, scale=scale, rel=rel)


def _num(x):
    """JSON has no infinity or NaN: those as strings."""
    return x if isinstance(x, float) and math.isfinite(x) else str(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    p.add_argument("--tiny", action="store_true", help="small shapes (a dry run of the script)")
    p.add_argument("--budget-s", type=float, default=45.0, help="start no row after this many seconds")
    args = p.parse_args()
    start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cpu":
        # impl="triton" on CPU tensors needs Triton's interpreter, read once when triton is first imported
        # (lmloss imports it lazily, so setting it here, before the first op, is early enough)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import lmloss  # noqa: F401 - after the interpreter's switch

    cases = _cases(args.tiny)
    # priority order: what a time box cuts is the least needed
    plan = [(c, "triton", torch.float32) for c in cases] + [(c, "torch", torch.float32) for c in cases]
    plan += [(c, impl, torch.bfloat16) for impl in ("triton", "torch") for c in cases if c.bf16]
    bases: dict[int, dict] = {}
    refs: dict[tuple[int, torch.dtype], tuple] = {}
    rows: list[dict] = []
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    info = dict(device=name, torch=torch.__version__, tiny=args.tiny,
                tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
                float32_matmul_precision=torch.get_float32_matmul_precision(),
                tolerance={"float32": TOL[torch.float32], "bfloat16": TOL[torch.bfloat16],
                           "bfloat16 fused head": HEAD_BF16_TOL})  # fmt: skip

    def write():
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "parity.json"), "w") as f:
                done = {**info, "seconds": time.perf_counter() - start}
                json.dump({"info": done, "rows": rows}, f, indent=1)

    print(f"{'op':<25} {'option':<28} {'impl':<6} {'dtype':<5} {'value':>8} {'grad':>8} {'tol':>7}  ok")
    for case, impl, dtype in plan:
        i = cases.index(case)
        dt = str(dtype).removeprefix("torch.")
        # passed: None where the row does not run (skipped), False where it raises
        row = dict(op=case.op, option=case.option, impl=impl, dtype=dt, tolerance=case.tolerance(dtype),
                   passed=None)  # fmt: skip
        params = inspect.signature(_op(case.op)).parameters
        missing = [k for k in case.uses if k not in params]
        if missing:
            row["skipped"] = f"{case.op} takes no {', '.join(missing)}"
        elif time.perf_counter() - start > args.budget_s:
            row["skipped"] = f"time box ({args.budget_s:.0f} s) spent"
        else:
            t0 = time.perf_counter()
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    if i not in bases:
                        bases[i] = case.make(torch.Generator().manual_seed(1000 + i))
                    if (i, dtype) not in refs:  # the float64 reference, shared by both impls' rows
                        ref_inputs = _inputs(bases[i], case, dtype, device, True)
                        refs[i, dtype] = _forward_backward(case, ref_inputs, "torch", i)
                    got = _forward_backward(case, _inputs(bases[i], case, dtype, device, False), impl, i)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                want_outs, want_grads = refs[i, dtype]
                values = [_error(g, w, case.value_floor) for g, w in zip(got[0], want_outs)]
                grads = {k: _error(g, w) for k, g, w in zip(case.grads, got[1], want_grads)}
                worst = max([e["rel"] for e in values] + [e["rel"] for e in grads.values()])
                row.update(
                    value_abs=max(e["abs"] for e in values), value_scale=max(e["scale"] for e in values),
                    value_rel=max(e["rel"] for e in values), grads=grads, worst_rel=worst,
                    passed=worst <= row["tolerance"], warnings=sorted({str(w.message)[:200] for w in caught}),
                )  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - record it and go on with the other rows
                row.update(error=f"{type(exc).__name__}: {str(exc)[:500]}", passed=False)
            row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        _print_row(row)
        write()
    _summary(rows)
    write()


def _print_row(row: dict) -> None:
    short = {"float32": "fp32", "bfloat16": "bf16"}.get(row["dtype"], row["dtype"])
    head = f"{row['op']:<25} {row['option'][:28]:<28} {row['impl']:<6} {short:<5}"
    if "skipped" in row:
        print(f"{head} skipped: {row['skipped']}", flush=True)
    elif "error" in row:
        print(f"{head} ERROR {row['error'][:200]}", flush=True)
    else:
        grad = max((e["rel"] for e in row["grads"].values()), default=0.0)
        print(f"{head} {row['value_rel']:>8.1e} {grad:>8.1e} {row['tolerance']:>7.0e}  "
              f"{'yes' if row['passed'] else 'NO'}", flush=True)  # fmt: skip
    for k in ("value_abs", "value_scale", "value_rel", "worst_rel"):  # JSON-safe numbers
        if k in row:
            row[k] = _num(row[k])
    for e in row.get("grads", {}).values():
        for k in e:
            e[k] = _num(e[k])


def _summary(rows: list[dict]) -> None:
    ran = [r for r in rows if "worst_rel" in r]
    errors = [r for r in rows if "error" in r]
    skipped = [r for r in rows if "skipped" in r]
    failed = [r for r in ran if not r["passed"]]
    print(f"\n{len(rows)} rows: {len(ran) - len(failed)} pass, {len(failed)} over tolerance, "
          f"{len(errors)} errors, {len(skipped)} skipped")  # fmt: skip
    for dt in ("float32", "bfloat16"):
        sub = [r for r in ran if r["dtype"] == dt]
        if not sub:
            continue
        worst = max(sub, key=lambda r: float(r["worst_rel"]))
        over = [r for r in sub if not r["passed"]]
        tols = "/".join(f"{t:.0e}" for t in sorted({r["tolerance"] for r in sub}))
        err = float(worst["worst_rel"])
        print(f"{dt}: every op x option run within {err:.1e} of float64 (max abs error /"
              f" the reference's max abs, value and gradients; tolerance {tols}, {len(over)} rows over it);"
              f" worst: {worst['op']} {worst['option']} impl={worst['impl']}")  # fmt: skip
    for r in failed + errors:
        why = r["error"][:120] if "error" in r else f"{float(r['worst_rel']):.1e} > {r['tolerance']:.0e}"
        print(f"  FAIL {r['op']} {r['option']} impl={r['impl']} {r['dtype']}: {why}")


if __name__ == "__main__":
    main()
