"""`lmloss bench`: the CLI end to end, the memory figures it reports, OOM and failure handling, the check."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch

from lmloss.bench.impls import Case, Impl, build_impls, parse_chunk
from lmloss.bench.report import CSV_COLUMNS, format_table, load_json, write_csv, write_json
from lmloss.bench.runner import SweepConfig, run_case, run_sweep

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _config(**overrides) -> SweepConfig:
    base = dict(
        workloads=["logits"], tokens={"logits": [256], "fused": [64]}, vocab=[1024], hidden=[32],
        dtypes={"logits": ["float32"], "fused": ["float32"]}, chunks={"logits": [64, None], "fused": ["auto"]},
        impls={"logits": ["naive", "chunked"], "fused": ["naive", "fused"]}, repeats=1,
    )  # fmt: skip
    base.update(overrides)
    return SweepConfig(**base)


def test_cli_runs_end_to_end_and_writes_json_csv_and_plots(tmp_path):
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "lmloss.cli", "bench", "--tokens", "64", "--vocab", "512", "--hidden", "32",
        "--dtype", "float32", "--chunk", "32,none,auto", "--repeats", "1", "--out", str(out),
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
        assert ("logits", tokens, "chunked", "auto") not in labels  # auto is the fused op's alone
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
    rows = run_sweep(_config(impls={"logits": ["naive", "megatron"], "fused": []}), show_progress=False)
    write_json(tmp_path / "r.json", rows, {"note": "x"})
    write_csv(tmp_path / "r.csv", rows)
    meta, back = load_json(tmp_path / "r.json")
    assert meta == {"note": "x"} and back == rows
    megatron = back[-1]
    assert megatron.impl == "megatron"
    assert megatron.status in {"ok", "skipped"}
    if megatron.status == "skipped":
        assert "megatron" in megatron.note


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
