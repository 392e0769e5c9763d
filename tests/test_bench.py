"""`lmloss bench`: the CLI end to end, the memory figures it reports, OOM and failure handling, the check."""

from __future__ import annotations

import csv
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmloss.bench.impls import (
    ENTROPY_COEF,
    Case,
    Impl,
    _as_model_output,
    build_impls,
    ce_weight_grad_float64,
    parse_chunk,
)
from lmloss.bench.report import CSV_COLUMNS, format_table, load_json, write_csv, write_json
from lmloss.bench.runner import Result, SweepConfig, run_case, run_sweep

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _config(**overrides) -> SweepConfig:
    base = dict(
        workloads=["logits"], tokens={"logits": [256], "fused": [64]}, vocab=[1024], hidden=[32],
        dtypes={"logits": ["float32"], "fused": ["float32"]}, chunks={"logits": [64, None], "fused": ["auto"]},
        impls={"logits": ["naive", "chunked"], "fused": ["naive", "fused"]}, repeats=1, warmup=0,
    )  # fmt: skip
    base.update(overrides)
    return SweepConfig(**base)


def test_cli_runs_end_to_end_and_writes_json_csv_and_plots(tmp_path):
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "lmloss.cli", "bench", "--tokens", "64", "--vocab", "512", "--hidden", "32",
        "--dtype", "float32", "--chunk", "32,none,auto", "--repeats", "1", "--warmup", "0", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "time/naive" in proc.stdout and "peak MiB" in proc.stdout
    assert "lmloss bench" in proc.stderr  # the progress bar

    payload = json.loads((out / "results.json").read_text())
    assert payload["columns"] == CSV_COLUMNS
    assert payload["meta"]["environment"]["torch"] == torch.__version__
    rows = payload["results"]
    labels = {(r["workload"], r["tokens"], r["impl"], r["chunk"]) for r in rows}
    for tokens in (64,):
        assert ("logits", tokens, "chunked", "32") in labels
        assert ("logits", tokens, "chunked", "none") in labels
        assert ("logits", tokens, "chunked", "auto") in labels  # the logits ops' default, run like the others
        assert ("fused", tokens, "matmul-floor", "-") in labels
        assert ("fused", tokens, "torch-fused", "-") in labels
    for r in rows:
        assert r["status"] in {"ok", "skipped"}, r
        if r["status"] == "skipped":
            assert r["note"], f"{r['impl']} skipped without a reason"
        elif r["impl"] == "naive":
            assert r["check"] == "ref"
        elif r["impl"] != "matmul-floor":
            assert r["check"] == "ok", r
            assert r["peak_mib"] == pytest.approx(r["input_mib"] + r["delta_mib"])
    # Liger and (without CUDA) Cut Cross-Entropy cannot run here: listed, not hidden.
    liger = [r for r in rows if r["impl"] == "liger"]
    assert liger and all(r["status"] == "skipped" for r in liger)

    with (out / "results.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == CSV_COLUMNS
        assert len(list(reader)) == len(rows)
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["fused_float32_V512_H32.png", "logits_float32_V512.png"]
    assert all((out / p).read_bytes()[:8] == PNG_MAGIC for p in pngs)


def test_help_lists_the_subcommands(capsys):
    from lmloss.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "bench" in out and "memory-report" in out


def test_memory_figures_match_the_naive_and_chunked_accounting():
    # fp32 logits [512, 4096] = 8 MiB. Naive keeps log_softmax's output, the gather's zero-filled gradient
    # and log_softmax's gradient: 4x the input. Chunked keeps the input and one gradient buffer (2x) plus
    # one fp32 chunk of 64 rows (1/8 of the input).
    rows = run_sweep(_config(tokens={"logits": [512], "fused": []}, vocab=[4096]), show_progress=False)
    by = {r.label: r for r in rows}
    logits_mib = 512 * 4096 * 4 / 2**20
    assert by["naive"].peak_mib == pytest.approx(4 * logits_mib, rel=0.02)
    assert by["chunked[64]"].peak_mib <= 2.125 * logits_mib + 0.1
    assert by["chunked[64]"].mem_vs_naive < 0.6
    assert by["chunked[none]"].peak_mib < by["naive"].peak_mib


def test_a_run_past_the_memory_cap_is_recorded_as_oom_and_the_sweep_goes_on():
    # logits fp32 [256, 1024] = 1 MiB: naive needs ~4 MiB in all, chunk 64 about 2.1 MiB.
    rows = run_sweep(_config(max_memory_mib=3.0), show_progress=False)
    by = {r.label: r for r in rows}
    assert by["naive"].status == "oom"
    assert "passes the cap" in by["naive"].note
    assert by["naive"].time_ms is None and by["naive"].peak_mib is None
    for label in ("chunked[64]", "chunked[none]"):
        assert by[label].status == "ok" and by[label].time_ms is not None
        assert by[label].check == "no-ref"  # naive did not finish, so there is nothing to compare with
    assert "oom" in format_table(rows)


def _boom(x):
    raise RuntimeError("injected failure")


def _real_oom(x):
    raise MemoryError("injected allocation failure")


def _off_by_one_percent(x):
    loss = 1.01 * torch.nn.functional.log_softmax(x.logits.float(), -1).gather(1, x.labels[:, None]).sum()
    loss.backward()
    return loss.detach()


def test_errors_and_disagreements_are_reported_per_impl_without_stopping_the_case():
    case = Case("logits", 128, 256, "float32", "cpu")
    impls = build_impls("logits", "cpu", ["naive", "chunked"], [32])
    impls[1:1] = [
        Impl("broken", "-", _boom),
        Impl("oom", "-", _real_oom),
        Impl("wrong", "-", _off_by_one_percent),
    ]
    rows = run_case(case, impls, _config())
    by = {r.label: r for r in rows}
    assert by["broken"].status == "error" and "injected failure" in by["broken"].note
    assert by["oom"].status == "oom"
    assert by["wrong"].status == "ok" and by["wrong"].check == "FAIL"
    assert by["wrong"].loss_err == pytest.approx(0.01, rel=1e-3)
    assert by["chunked[32]"].check == "ok"  # ran after the failures
    assert "FAIL" in format_table(rows)


def test_bf16_impls_pass_the_check_at_bf16_tolerance():
    rows = run_sweep(_config(dtypes={"logits": ["bfloat16"], "fused": []}), show_progress=False)
    checks = {r.label: r.check for r in rows}
    assert checks == {"naive": "ref", "chunked[64]": "ok", "chunked[none]": "ok"}


def test_results_round_trip_through_json_and_csv(tmp_path):
    # ok rows and a skipped one (Liger needs CUDA): numbers, Nones and notes all make the trip
    rows = run_sweep(
        _config(impls={"logits": ["naive", "chunked", "liger"], "fused": []}), show_progress=False
    )
    assert {r.status for r in rows} == {"ok", "skipped"}
    write_json(tmp_path / "r.json", rows, {"note": "x"})
    write_csv(tmp_path / "r.csv", rows)
    meta, back = load_json(tmp_path / "r.json")
    assert meta == {"note": "x"} and back == rows
    with (tmp_path / "r.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == [f.name for f in dataclasses.fields(rows[0])]
        cells = list(reader)
    assert len(cells) == len(rows)
    for row, line in zip(rows, cells):
        for name, value in dataclasses.asdict(row).items():
            cell = line[name]
            if name == "times_ms":  # ';'-joined, 3 decimals
                assert [float(t) for t in cell.split(";") if t] == pytest.approx(value, abs=5e-4), name
            elif value is None:
                assert cell == "", name
            elif isinstance(value, float):
                assert float(cell) == value, name  # repr round-trips a float exactly
            elif isinstance(value, int):
                assert int(cell) == value, name
            else:
                assert cell == value, name


def test_megatron_peer_runs_and_agrees_with_naive():
    try:
        import megatron.core.tensor_parallel  # noqa: F401
    except Exception as err:  # not installed, or broken at import
        pytest.skip(f"megatron-core not importable here ({type(err).__name__}: {err})")
    rows = run_sweep(_config(impls={"logits": ["naive", "megatron"], "fused": []}), show_progress=False)
    naive, megatron = rows
    assert megatron.impl == "megatron" and megatron.status == "ok", megatron.note
    assert megatron.check == "ok" and megatron.loss_err <= 1e-6 and megatron.grad_err <= 1e-5
    assert megatron.loss == pytest.approx(naive.loss, rel=1e-6)
    # Megatron keeps the input and one fp32 gradient-sized buffer: no more than naive's four
    assert megatron.input_mib < megatron.peak_mib <= naive.peak_mib
    assert megatron.time_ms > 0 and megatron.bytes_moved == 3 * 256 * 1024 * 4


@pytest.mark.parametrize(("text", "value"), [("none", None), ("AUTO", "auto"), ("4096", 4096)])
def test_chunk_values_parse(text, value):
    assert parse_chunk(text) == value


def test_bad_flag_values_exit_with_usage_error():
    from lmloss.cli import main

    for argv in (["bench", "--chunk", "0"], ["bench", "--dtype", "float8"], ["bench", "--impl", "magic"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2


def _scribbles_on_its_input(x):
    loss = torch.nn.functional.log_softmax(x.logits.float(), -1).gather(1, x.labels[:, None]).sum()
    loss.backward()
    with torch.no_grad():
        x.logits.mul_(2.0)
    return loss.detach()


def test_an_impl_that_writes_into_shared_inputs_is_named_and_later_impls_get_clean_inputs():
    case = Case("logits", 128, 256, "float32", "cpu")
    impls = build_impls("logits", "cpu", ["naive", "chunked"], [32])
    impls.insert(1, Impl("scribbler", "-", _scribbles_on_its_input))
    by = {r.label: r for r in run_case(case, impls, _config())}
    assert "wrote into its inputs" in by["scribbler"].note
    assert by["chunked[32]"].check == "ok"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relative_error_is_max_abs_difference_over_max_abs_reference_and_leaves_inputs_alone(dtype):
    from lmloss.bench.runner import relative_error

    ref = torch.randn(2100, 7).to(dtype)  # more rows than one block
    got = ref.clone()
    got[2050, 3] += 0.5
    ref_before, got_before = ref.clone(), got.clone()
    expected = (got.double() - ref.double()).abs().max() / ref.double().abs().max()
    assert relative_error(got, ref) == pytest.approx(float(expected), rel=1e-2)
    assert torch.equal(ref, ref_before) and torch.equal(got, got_before)


# -- optional packages ---------------------------------------------------------------------------------


def test_without_tqdm_and_matplotlib_progress_is_plain_lines_and_plots_name_the_extra(
    tmp_path, monkeypatch, capsys
):
    from lmloss.cli import main

    for name in ("tqdm", "tqdm.auto", "matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)  # import of <name> halted: as if not installed
    out = tmp_path / "bench"
    code = main(["bench", "--workload", "logits", "--impl", "naive,chunked", "--tokens", "32", "--vocab", "64",
                 "--dtype", "float32", "--chunk", "16", "--repeats", "1", "--warmup", "1", "--out", str(out)])  # fmt: skip
    assert code == 0
    captured = capsys.readouterr()
    progress = [line for line in captured.err.splitlines() if line.startswith("lmloss bench: ")]
    assert progress == [  # per row its tracked run, then per round (1 warm-up, 1 timed) the rows' runs
        "lmloss bench: 1/6 logits float32 T=32 naive",
        "lmloss bench: 2/6 logits float32 T=32 chunked[16]",
        "lmloss bench: 4/6 logits float32 T=32 warm-up round 1/1",
        "lmloss bench: 6/6 logits float32 T=32 timed round 1/1",
    ]
    checkout = Path(__file__).resolve().parents[1]  # lmloss is not on PyPI: the hint names this checkout
    assert f'no plots: matplotlib is not installed (pip install -e "{checkout}[bench]" gives them)' in captured.out
    assert sorted(p.name for p in out.iterdir()) == ["results.csv", "results.json"]


# -- the rows added for the GPU (their CPU paths) --------------------------------------------------------


def _by_impl(rows):
    return {(r.impl, r.chunk, r.kernel): r for r in rows}


def test_logits_rows_report_bytes_moved_and_bandwidth():
    rows = run_sweep(_config(chunks={"logits": [64], "fused": []}), show_progress=False)
    logits_bytes = 256 * 1024 * 4
    for r in rows:
        assert r.bytes_moved == 3 * logits_bytes  # out of place: read (forward), read + write (backward)
        assert r.bandwidth_gbs == pytest.approx(r.bytes_moved / (r.time_ms * 1e-3) / 1e9)
    assert {r.label: r.kernel for r in rows} == {"naive": "-", "chunked[64]": "torch"}
    assert "GB/s" in format_table(rows)


def test_entropy_rows_are_checked_against_the_naive_entropy_objective():
    config = _config(
        impls={"logits": ["naive", "naive-entropy", "entropy"], "fused": []}, chunks={"logits": [64]}
    )
    rows = run_sweep(config, show_progress=False)
    by = {r.label: r for r in rows}
    naive, entropy = by["naive-entropy"], by["entropy[64]"]
    assert naive.check == "ref" and entropy.check == "ok" and entropy.objective == "logprobs+entropy"
    # the entropy term is really in the loss: written out here, not taken from the bench
    x = torch.nn.functional.log_softmax(
        _inputs_of(Case("logits", 256, 1024, "float32", "cpu")).logits.double(), -1
    )
    labels = _inputs_of(Case("logits", 256, 1024, "float32", "cpu")).labels
    expected = x.gather(1, labels[:, None]).sum() - ENTROPY_COEF * (x.exp() * x).sum()
    assert entropy.loss == pytest.approx(float(expected.detach()), rel=1e-5)
    assert by["naive"].loss != pytest.approx(entropy.loss, rel=1e-3)


def _inputs_of(case):
    from lmloss.bench.impls import make_inputs

    return make_inputs(case, 0)


class _InplaceLogprobSum(torch.autograd.Function):
    """A stand-in for an in-place loss (the gradient of sum log p written over the logits in the forward)."""

    @staticmethod
    def forward(ctx, logits, labels):
        logp = torch.log_softmax(logits.detach().float(), -1)
        value = logp.gather(1, labels[:, None]).sum()
        grad = -logp.exp()
        grad.scatter_add_(1, labels[:, None], torch.ones(labels.shape[0], 1))
        logits.copy_(grad)
        ctx.mark_dirty(logits)
        ctx.grad = logits
        return value, logits

    @staticmethod
    def backward(ctx, g_value, g_logits):
        return ctx.grad.mul_(g_value), None


def _fake_inplace_step(x):
    value, _ = _InplaceLogprobSum.apply(x.logits, x.labels)
    value.backward()
    return value.detach()


def test_in_place_rows_get_a_non_leaf_copy_and_are_checked_with_the_gradient_that_arrived():
    case = Case("logits", 128, 256, "float32", "cpu")
    impls = build_impls("logits", "cpu", ["naive"], [])
    impls.append(Impl("fake-inplace", "-", _fake_inplace_step, prepare=_as_model_output,
                      grads_of=lambda x: dict(x.sink), traffic=2))  # fmt: skip
    by = {r.label: r for r in run_case(case, impls, _config())}
    row = by["fake-inplace"]
    assert row.status == "ok" and row.check == "ok", row.note
    assert row.grad_err < 1e-6 and "wrote into its inputs" not in row.note  # the case's inputs stay clean
    assert row.bytes_moved == 2 * 128 * 256 * 4


def test_lmloss_in_place_row_holds_the_logits_and_one_chunk():
    rows = run_sweep(_config(impls={"logits": ["naive", "inplace"], "fused": []}, chunks={"logits": [64]}),
                     show_progress=False)  # fmt: skip
    row = rows[-1]
    assert row.status == "ok" and row.check == "ok", row.note
    # logits fp32 [256, 1024] = 1 MiB; one fp32 chunk of 64 rows = 1/4 MiB, plus O(T) vectors
    assert row.peak_mib <= row.input_mib + 0.25 + 0.05
    assert row.bytes_moved == 2 * 256 * 1024 * 4


def test_fused_rows_rl_objective_and_weight_gradient_error_against_float64():
    config = _config(
        workloads=["fused"], dtypes={"logits": [], "fused": ["float32", "bfloat16"]},
        impls={"logits": [], "fused": ["naive", "fused", "fused-lowacc", "naive-rl", "fused-rl", "liger", "matmul-floor"]},
    )  # fmt: skip
    rows = run_sweep(config, show_progress=False)
    for dtype in ("float32", "bfloat16"):
        by = _by_impl(r for r in rows if r.dtype == dtype)
        naive, fused = by[("naive", "-", "-")], by[("fused", "auto", "torch")]
        rl = by[("fused-rl", "auto", "torch")]
        assert fused.check == "ok" and rl.check == "ok" and rl.objective == "rl", (fused.note, rl.note)
        assert by[("naive-rl", "-", "-")].check == "ref"
        assert by[("liger", "-", "-")].status == "skipped" and "CUDA" in by[("liger", "-", "-")].note
        assert rl.wgrad_err is None and by[("matmul-floor", "-", "-")].wgrad_err is None  # ce rows only
        rounded = float(naive.note.rsplit(" ", 1)[1])  # the float64 gradient rounded once to the dtype
        if dtype == "float32":
            assert fused.wgrad_err < 1e-5 and rounded < 1e-7
        else:  # the fp32 accumulator adds little to rounding the exact gradient once to bf16
            assert 0.9 * rounded < fused.wgrad_err < 1.5 * rounded
        lowacc = by[("fused-lowacc", "auto", "torch")]
        assert lowacc.check == "ok" and lowacc.wgrad_err >= fused.wgrad_err * 0.99
    assert "wgrad err" in format_table(rows)


def test_float64_weight_gradient_reference_matches_autograd_in_float64():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(37, 8, generator=g), torch.randn(50, 8, generator=g)
    labels = torch.randint(0, 50, (37,), generator=g)
    w64 = weight.double().requires_grad_()
    torch.nn.functional.cross_entropy(hidden.double() @ w64.T, labels).backward()
    rows = torch.tensor([0, 3, 17, 49])
    got = ce_weight_grad_float64(hidden, weight, labels, rows, block=16)  # several vocabulary blocks
    torch.testing.assert_close(got, w64.grad[rows], rtol=1e-12, atol=1e-15)


def test_device_defaults_cpu_as_before_cuda_the_gpu_shapes():
    import argparse

    from lmloss.bench.cli import config_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    cpu = config_from_args(parser.parse_args(["bench"]))
    assert (cpu.tokens, cpu.vocab, cpu.hidden, cpu.kernels) == (
        {"logits": [2048, 4096], "fused": [2048]},
        [32000],
        [256],
        ["torch"],
    )
    assert cpu.impls["logits"] == ["naive", "chunked", "megatron"]
    assert (cpu.warmup, cpu.repeats) == (1, 5)
    cuda = config_from_args(parser.parse_args(["bench", "--device", "cuda"]))
    assert cuda.tokens == {"logits": [32768], "fused": [8192, 16384]}
    assert (cuda.vocab, cuda.hidden, cuda.kernels) == ([128256], [4096], ["triton", "torch"])
    assert cuda.dtypes == {"logits": ["bfloat16"], "fused": ["bfloat16"]}
    assert (cuda.warmup, cuda.repeats) == (2, 10)
    assert "compile" in cuda.impls["logits"] and "cce" in cuda.impls["fused"]
    picked = config_from_args(
        parser.parse_args(["bench", "--device", "cuda", "--impl", "naive,fused", "--kernel", "torch"])
    )
    assert picked.impls == {"logits": ["naive"], "fused": ["naive", "fused"]} and picked.kernels == ["torch"]


def test_triton_rows_on_cpu_are_skipped_with_the_reason_and_torch_rows_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    impls = build_impls("logits", "cpu", ["chunked"], [64], ["triton", "torch"])
    assert [(i.label, i.kernel) for i in impls] == [
        ("chunked[64]/triton", "triton"),
        ("chunked[64]", "torch"),
    ]
    assert impls[0].step is None and ("impl=" in impls[0].unavailable or "CUDA" in impls[0].unavailable)
    assert impls[1].step is not None


# -- timing: warm-up, interleaved rounds, spread --------------------------------------------------------


class _Script:
    """Steps that take scripted times on a fake clock: ``durations[i]`` ms at the impl's i-th call (call 0
    is its tracked run). Every call is logged by name, so the order of the runs can be read back."""

    def __init__(self) -> None:
        self.now, self.log = 0.0, []

    def clock(self) -> float:
        return self.now

    def impl(self, name: str, durations, **kw) -> Impl:
        calls = iter(durations)

        def step(x):
            self.log.append(name)
            self.now += next(calls) / 1e3
            return torch.tensor(1.0)  # no gradients: checked on the loss alone

        return Impl(name, "-", step, **kw)


def _scripted_case(monkeypatch, impls_of, **config) -> tuple[_Script, dict]:
    from lmloss.bench import runner

    script = _Script()
    monkeypatch.setattr(runner, "_clock", script.clock)
    rows = run_case(Case("logits", 8, 16, "float32", "cpu"), impls_of(script), _config(**config))
    return script, {r.label: r for r in rows}


def test_timed_rounds_come_after_the_warm_up_rounds_and_interleave_the_rows(monkeypatch):
    script, by = _scripted_case(
        monkeypatch,
        lambda s: [
            s.impl("a", [0, 50, 11, 12, 13], is_reference=True),
            s.impl("b", [0, 60, 21, 22, 23]),
            s.impl("c", [0, 70, 31, 32, 33]),
        ],
        warmup=1, repeats=3,
    )  # fmt: skip
    assert script.log == [
        "a", "b", "c",  # tracked runs (memory, check)
        "a", "b", "c",  # warm-up round: not timed
        "b", "c", "a",  # timed rounds, each starting one row further on
        "c", "a", "b",
        "a", "b", "c",
    ]  # fmt: skip
    assert by["a"].times_ms == pytest.approx([11, 12, 13])  # the warm-up run (50 ms) left out
    assert by["b"].times_ms == pytest.approx([21, 22, 23]) and by["c"].times_ms == pytest.approx([31, 32, 33])
    assert by["b"].time_ms == pytest.approx(22) and by["b"].time_vs_naive == pytest.approx(22 / 12)
    assert by["c"].spread == pytest.approx((33 - 31) / 2 / 32) and "noisy" not in by["c"].note


def test_a_cycle_a_run_leaves_is_collected_before_the_next_row_and_the_collector_is_left_as_found(monkeypatch):
    import gc
    import weakref

    class Node:  # a reference cycle, as an autograd ctx holding its own output makes
        def __init__(self) -> None:
            self.me = self

    left: list[weakref.ref] = []
    seen: list[list[bool]] = []  # at each call of the row after it: which cycles are alive

    def leaves_a_cycle(x):
        left.append(weakref.ref(Node()))
        return torch.tensor(1.0)

    def looks(x):
        seen.append([r() is not None for r in left])
        return torch.tensor(1.0)

    case = Case("logits", 8, 16, "float32", "cpu")
    impls = [Impl("cycle", "-", leaves_a_cycle, is_reference=True), Impl("after", "-", looks)]
    older = Node()  # alive before the case: frozen while it runs, back in the collector's sight after
    gc.disable()  # no automatic collection: only the sweep's own can have freed the cycles
    try:
        assert gc.get_freeze_count() == 0
        run_case(case, impls, _config(warmup=0, repeats=1))
        assert gc.get_freeze_count() == 0
        gc.collect()  # (the first case's timed run left a cycle: a freeze would keep it)
        gc.freeze()  # a caller's own freeze is kept as it is
        frozen = gc.get_freeze_count()
        run_case(case, impls, _config(warmup=0, repeats=1))
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
        gc.enable()
    # each case: the tracked run of each row, then one timed round (no collection between timed runs)
    tracked_first_case, tracked_second_case = seen[0], seen[2]
    assert tracked_first_case == [False] and tracked_second_case == [False, False, False]
    assert gc.is_tracked(older) and any(o is older for o in gc.get_objects(generation=2))


def test_with_the_default_warm_up_a_cold_first_run_does_not_count(monkeypatch):
    import argparse

    from lmloss.bench.cli import config_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    defaults = config_from_args(parser.parse_args(["bench"]))
    # The floor is 2x faster than naive once warm, but its first untracked run is cold (6x its warm time).
    script, by = _scripted_case(
        monkeypatch,
        lambda s: [s.impl("naive", [0] + [100] * 20, is_reference=True), s.impl("floor", [0, 300] + [50] * 20)],
        warmup=defaults.warmup, repeats=defaults.repeats,
    )  # fmt: skip
    assert len(by["floor"].times_ms) == defaults.repeats >= 5
    assert by["floor"].time_ms == pytest.approx(50) and by["floor"].time_vs_naive == pytest.approx(0.5)
    assert by["floor"].spread == pytest.approx(0) and by["naive"].spread == pytest.approx(0)


def test_a_row_whose_spread_passes_the_threshold_is_marked_noisy_with_its_spread(monkeypatch):
    from lmloss.bench.runner import NOISY_SPREAD

    script, by = _scripted_case(
        monkeypatch,
        lambda s: [
            s.impl("steady", [0, 99, 10, 10.5, 10, 10, 10], is_reference=True),
            s.impl("jumpy", [0, 99, 10, 14, 10, 10, 10]),
        ],
        warmup=1, repeats=5,
    )  # fmt: skip
    jumpy, steady = by["jumpy"], by["steady"]
    assert jumpy.spread == pytest.approx((14 - 10) / 2 / 10) and jumpy.spread > NOISY_SPREAD
    assert jumpy.note == "noisy: ±20% > ±10%"
    assert steady.spread == pytest.approx(0.5 / 2 / 10) and steady.note == ""
    table = format_table([steady, jumpy])
    assert "±20%" in table and "±2%" in table and table.splitlines()[3].endswith("noisy: ±20% > ±10%")
    assert table.splitlines()[-1].startswith("noisy: the spread passes ±10%")
    assert "noisy: the spread" not in format_table([steady])


def test_a_spread_printed_as_the_threshold_is_not_noisy_and_a_noisy_note_prints_a_larger_one(monkeypatch):
    # median 10 ms, min 10: a max of 12.08 / 12.12 ms is a spread of 10.4% / 10.6%, printed ±10% / ±11%
    _, by = _scripted_case(
        monkeypatch,
        lambda s: [
            s.impl("steady", [0, 99, 10, 10, 10, 10, 10], is_reference=True),
            s.impl("just_under", [0, 99, 10, 12.08, 10, 10, 10]),
            s.impl("just_over", [0, 99, 10, 12.12, 10, 10, 10]),
        ],
        warmup=1, repeats=5,
    )  # fmt: skip
    under, over = by["just_under"], by["just_over"]
    assert under.spread == pytest.approx(0.104) and over.spread == pytest.approx(0.106)
    assert under.note == "" and over.note == "noisy: ±11% > ±10%"
    lines = format_table([by["steady"], under, over]).splitlines()
    assert re.findall(r"±\d+%", lines[3]) == ["±10%"] and "noisy" not in lines[3]  # the spread column only
    assert re.findall(r"±\d+%", lines[4]) == ["±11%", "±11%", "±10%"]  # the column, then the note
    assert lines[4].endswith("noisy: ±11% > ±10%")
    assert lines[-1].startswith("noisy: the spread passes ±10%")
    assert "noisy: the spread" not in format_table([by["steady"], under])


def test_a_long_note_is_printed_in_full_below_the_table():
    long_note = "peer not importable (ModuleNotFoundError: " + "x" * 120 + ") end of note"
    rows = [
        Result("fused", 64, 512, 32, "float32", "cpu", "cce", "-", status="skipped", note=long_note),
        Result("fused", 64, 512, 32, "float32", "cpu", "liger", "-", status="skipped", note="short"),
    ]
    table = format_table(rows, note_width=40)
    assert long_note in table and "…" not in table
    lines = table.splitlines()
    assert lines[2].endswith("see [1]") and lines[3].endswith("short")
    assert lines[-2:] == ["notes:", f"[1] fused float32 T=64 cce: {long_note}"]


def test_logits_chunk_auto_builds_lmloss_rows_at_the_ops_default():
    impls = build_impls("logits", "cpu", ["chunked", "entropy"], ["auto"])
    assert [(i.label, i.step is not None) for i in impls] == [
        ("chunked[auto]", True),
        ("entropy[auto]", True),
    ]


def test_out_twice_replaces_the_earlier_runs_results_and_plots_and_keeps_other_files(tmp_path, capsys):
    from lmloss.cli import main

    out = tmp_path / "bench"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = ["bench", "--workload", "logits", "--impl", "naive", "--tokens", "32", "--vocab", "64", "--repeats",
            "1", "--warmup", "0", "--no-progress", "--out", str(out), "--dtype"]  # fmt: skip
    assert main([*argv, "float32"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "logits_float32_V64.png", "notes.txt", "results.csv", "results.json",
    ]  # fmt: skip
    capsys.readouterr()
    assert main([*argv, "bfloat16"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "logits_bfloat16_V64.png", "notes.txt", "results.csv", "results.json",
    ]  # fmt: skip
    assert [r.dtype for r in load_json(out / "results.json")[1]] == ["bfloat16"]
    assert f"removed an earlier run's logits_float32_V64.png from {out}" in capsys.readouterr().out


def test_impl_help_names_the_cpu_default_impls():
    import argparse

    from lmloss.bench.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    bench = parser._subparsers._group_actions[0].choices["bench"]
    (impl,) = [a for a in bench._actions if a.dest == "impl"]
    assert "README" not in impl.help
    assert impl.help.endswith(
        "(default: CPU logits naive,chunked,megatron; fused naive,fused,torch-fused,cce,liger,matmul-floor; "
        "CUDA all)"
    )


def test_invariant_adds_a_checked_invariant_row_beside_each_row_of_an_op_that_takes_it():
    config = _config(
        workloads=["logits", "fused"], impls={"logits": ["naive", "chunked"], "fused": ["naive", "fused"]},
        tokens={"logits": [128], "fused": [64]}, chunks={"logits": [64], "fused": ["auto"]}, invariant=True,
    )  # fmt: skip
    rows = run_sweep(config, show_progress=False)
    labels = [r.label for r in rows]
    assert labels == ["naive", "chunked[64]", "chunked+inv[64]", "naive", "fused[auto]", "fused+inv[auto]"]
    for r in rows:
        assert r.status == "ok" and r.check in ("ref", "ok"), (r.label, r.note)
        if "+inv" in r.label:
            base = next(b for b in rows if b.label == r.label.replace("+inv", "") and b.workload == r.workload)
            assert f"invariant: {r.time_ms / base.time_ms:.2f}x {base.label}'s time" in r.note
    assert "chunked+inv[64]" in format_table(rows)  # (without the flag there are none: the tests above)


def test_budget_adds_a_row_per_budget_whose_note_gives_what_it_held_against_the_budget():
    config = _config(
        workloads=["fused"], impls={"fused": ["naive", "fused"]}, tokens={"fused": [256]}, vocab=[2000],
        hidden=[32], dtypes={"fused": ["bfloat16"]}, chunks={"fused": ["auto"]}, budgets=[None, 0.1],
    )  # fmt: skip
    rows = run_sweep(config, show_progress=False)
    assert [r.label for r in rows] == ["naive", "fused[auto]", "fused[auto]@0.1MiB"]
    lean = rows[-1]
    assert lean.status == "ok" and lean.check == "ok" and lean.budget_mib == 0.1
    held = float(re.search(r"([\d.]+) MiB beyond inputs and gradients, budget 0.1 MiB", lean.note).group(1))
    grads = (256 * 32 + 2000 * 32) * 2 / 2**20
    assert held == pytest.approx(lean.delta_mib - grads, abs=0.05) and held <= 0.1 + 0.05
    assert rows[1].delta_mib - grads > 2000 * 32 * 4 / 2**20  # the default budget keeps the fp32 accumulator
    assert "fused[auto]@0.1MiB" in format_table(rows)


def test_dpo_rows_are_checked_against_naive_and_timed_against_the_four_matmul_floor():
    """The preference rows: lmloss's fused DPO and TRL's own fused-head path agree with the materialized
    logits (loss and gradients), their time/floor is against ``dpo-floor``, Liger's rows run or say why not."""
    config = _config(workloads=["fused"], tokens={"logits": [], "fused": [64]},
                     impls={"logits": [], "fused": ["naive-dpo", "trl-dpo", "fused-dpo", "liger-dpo", "dpo-floor",
                                                    "matmul-floor"]})  # fmt: skip
    by = _by_impl(run_sweep(config, show_progress=False))
    assert by[("naive-dpo", "-", "-")].check == "ref"
    for key in (("fused-dpo", "auto", "torch"), ("trl-dpo", "-", "-")):
        row = by[key]
        assert row.objective == "dpo" and row.check == "ok", (key, row.status, row.note)
        assert row.time_vs_floor == pytest.approx(row.time_ms / by[("dpo-floor", "-", "-")].time_ms)
    liger = by[("liger-dpo", "-", "-")]
    assert liger.status == "ok" or (liger.status == "skipped" and "liger" in liger.note)
