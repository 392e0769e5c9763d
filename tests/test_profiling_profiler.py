"""MemoryProfiler on CPU (config, which steps and ranks write, file names, report content) and memory-report."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from lmloss.cli import main as cli_main
from lmloss.profiling import MemoryProfiler, MemoryProfilerConfig
from lmloss.profiling.report import format_summary, load_summary, summarize_snapshot

MiB = 1024**2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"profile_steps": (0, -1)},
        {"max_entries": 0},
        {"max_entries": -5},
        {"stacks": "cpp"},
        {"ranks": (0, -1)},
        {"min_bytes": -1},
        {"min_bytes": "64k"},
        {"min_bytes": True},
    ],
)
def test_bad_config_values_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        MemoryProfilerConfig(**kwargs)


def test_config_from_dict_and_yaml(tmp_path):
    cfg = MemoryProfilerConfig.from_dict({"profile_steps": [3, 5], "ranks": 0, "stacks": "all"})
    assert cfg == MemoryProfilerConfig(profile_steps=(3, 5), ranks=(0,), stacks="all")
    with pytest.raises(ValueError, match="unknown"):
        MemoryProfilerConfig.from_dict({"profile_step": [1]})
    path = tmp_path / "run.yaml"
    path.write_text("memory_profile:\n  profile_steps: [2]\n  max_entries: 500\n  stacks: none\n")
    assert MemoryProfilerConfig.from_yaml(path, key="memory_profile") == MemoryProfilerConfig(
        profile_steps=(2,), max_entries=500, stacks="none"
    )
    path.write_text("memory_profile:\n  max_entries: 0\n")
    with pytest.raises(ValueError):
        MemoryProfilerConfig.from_yaml(path, key="memory_profile")


def _train_step(n: int = 256) -> None:
    w = torch.randn(n, n, requires_grad=True)
    x = torch.randn(n, n)
    big = x @ w  # n*n*4 bytes: 256 KiB at n=256
    (big * big).sum().backward()


def test_cpu_profiler_writes_one_json_per_profiled_step_named_by_coords(tmp_path):
    prof = MemoryProfiler(
        MemoryProfilerConfig(profile_steps=(1,)), tmp_path, coords={"dp": 3, "tp": 1}, rank=5, device="cpu",
        min_bytes=64 * 1024,
    )  # fmt: skip
    paths = []
    for step in range(3):
        with prof.step(step) as path:
            _train_step()
        paths.append(path)
    assert paths[0] is None and paths[2] is None
    expected = tmp_path / "step_1" / "rank5_pp0_dp3_cp0_tp1.json"
    assert paths[1] == expected
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "step_1", "step_1/rank5_pp0_dp3_cp0_tp1.json",
    ]  # fmt: skip
    report = json.loads(expected.read_text())
    assert report["step"] == 1 and report["rank"] == 5
    assert report["coords"] == {"pp": 0, "dp": 3, "cp": 0, "tp": 1}
    assert report["peak_bytes"] >= 3 * 256 * 256 * 4  # big, big*big and w.grad are alive together
    top = report["top_allocations"][0]
    assert top["shape"] == [256, 256] and top["dtype"] == "torch.float32"
    assert "test_profiling_profiler.py" in top["site"]
    assert max(b for _, b in report["timeline"]) == report["peak_bytes"]


class _FakeParallelState:
    """Megatron parallel_state's getters; context parallel is missing, as in older Megatron."""

    def get_pipeline_model_parallel_rank(self):
        return 2

    def get_data_parallel_rank(self):
        return 1

    def get_tensor_model_parallel_rank(self):
        return 3


def test_coords_come_from_parallel_state_getters_and_default_to_zero(tmp_path):
    prof = MemoryProfiler(
        MemoryProfilerConfig(profile_steps=(0,)), tmp_path, _FakeParallelState(), rank=7, device="cpu"
    )
    assert prof.path_for(0).name == "rank7_pp2_dp1_cp0_tp3.json"
    assert MemoryProfiler(MemoryProfilerConfig(), tmp_path, rank=0, device="cpu").path_for(4).name == (
        "rank0_pp0_dp0_cp0_tp0.json"
    )


def test_ranks_outside_the_config_write_nothing(tmp_path):
    prof = MemoryProfiler(
        MemoryProfilerConfig(profile_steps=(0,), ranks=(0, 2)), tmp_path, rank=1, device="cpu"
    )
    with prof.step(0) as path:
        _train_step(64)
    assert path is None and not any(tmp_path.iterdir())


def test_the_report_is_written_when_the_step_raises(tmp_path):
    prof = MemoryProfiler(MemoryProfilerConfig(profile_steps=(0,)), tmp_path, rank=0, device="cpu")
    with pytest.raises(RuntimeError, match="simulated"), prof.step(0) as path:
        _train_step(64)
        raise RuntimeError("simulated failure mid-step")
    assert json.loads(path.read_text())["peak_bytes"] > 0


def test_memory_report_summarizes_a_cpu_report_and_plots_it(tmp_path, capsys):
    prof = MemoryProfiler(
        MemoryProfilerConfig(profile_steps=(0,)), tmp_path, rank=0, device="cpu", min_bytes=1024
    )
    with prof.step(0) as path:
        _train_step()
    png = tmp_path / "timeline.png"
    assert cli_main(["memory-report", str(path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "peak:" in out and "by call site" in out and "test_profiling_profiler.py" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _frames(filename: str, line: int, name: str) -> list[dict]:
    # Innermost first, as torch records them: allocator internals, then torch, then the user's line.
    return [
        {"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::malloc"},
        {"filename": "/site-packages/torch/nn/functional.py", "line": 10, "name": "log_softmax"},
        {"filename": filename, "line": line, "name": name},
    ]


def _fake_snapshot() -> dict:
    """A snapshot as `torch.cuda.memory._snapshot()` lays it out: 4 MiB allocated before recording began,
    then a 16 MiB and an 8 MiB tensor alive together (peak 28 MiB), the 16 MiB one freed, 2 MiB allocated."""
    trace = [
        {"action": "alloc", "addr": 100, "size": 16 * MiB, "frames": _frames("train.py", 40, "loss_fn")},
        {"action": "alloc", "addr": 200, "size": 8 * MiB, "frames": _frames("model.py", 12, "forward")},
        {"action": "free_requested", "addr": 100, "size": 16 * MiB, "frames": []},
        {"action": "free_completed", "addr": 100, "size": 16 * MiB, "frames": []},
        {"action": "alloc", "addr": 300, "size": 2 * MiB, "frames": _frames("train.py", 41, "loss_fn")},
    ]
    blocks = [
        {"size": 4 * MiB, "state": "active_allocated"},
        {"size": 8 * MiB, "state": "active_allocated"},
        {"size": 2 * MiB, "state": "active_allocated"},
        {"size": 16 * MiB, "state": "inactive"},
    ]
    return {"segments": [{"device": 0, "blocks": blocks}], "device_traces": [trace]}


def test_snapshot_summary_replays_the_history_to_the_peak():
    s = summarize_snapshot(_fake_snapshot(), "fake.pickle")
    assert s.baseline_bytes == 4 * MiB
    assert s.peak_bytes == 28 * MiB
    assert [(a.nbytes // MiB, a.site) for a in s.allocations] == [
        (16, "train.py:40 in loss_fn"),
        (8, "model.py:12 in forward"),
    ]
    assert s.timeline[-1] == (5, 14 * MiB)
    assert "28.0 MiB" in format_summary(s)


def test_memory_report_reads_a_snapshot_pickle(tmp_path, capsys):
    path = tmp_path / "rank0_pp0_dp0_cp0_tp0.pickle"
    with path.open("wb") as f:
        pickle.dump(_fake_snapshot(), f)
    assert load_summary(path).peak_bytes == 28 * MiB
    assert cli_main(["memory-report", str(tmp_path), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "cuda-snapshot" in out and "train.py:40 in loss_fn" in out and "model.py" not in out


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("other.json", '{"format": "something-else"}', "not an lmloss CPU memory report"),
        ("notes.json", "peak: 3 MiB", "not an lmloss CPU memory report (not JSON"),
        ("list.json", "[1, 2]", "not an lmloss CPU memory report (a JSON list)"),
        ("notes.txt", "hello", "not a torch.cuda.memory snapshot pickle"),
    ],
)
def test_memory_report_rejects_a_file_that_is_not_a_report_in_one_line_naming_it_once(
    tmp_path, capsys, name, content, says
):
    path = tmp_path / name
    path.write_text(content)
    assert cli_main(["memory-report", str(path)]) == 1
    err = capsys.readouterr().err
    assert says in err and err.count(str(path)) == 1 and len(err.strip().splitlines()) == 1, err


def test_min_bytes_is_a_config_option_and_the_constructor_keyword_overrides_it(tmp_path):
    assert MemoryProfilerConfig.from_dict({"min_bytes": 0}) == MemoryProfilerConfig(min_bytes=0)
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text("memory_profile:\n  profile_steps: [0]\n  min_bytes: 0\n")
    config = MemoryProfilerConfig.from_yaml(yaml_path, key="memory_profile")

    def listed_shapes(profiler) -> list[list[int]]:
        with profiler.step(0) as path:
            _train_step(64)  # every tensor is 64 x 64 fp32 = 16 KiB
        return [a["shape"] for a in json.loads(path.read_text())["top_allocations"]]

    assert [64, 64] in listed_shapes(MemoryProfiler(config, tmp_path / "a", rank=0, device="cpu"))
    assert listed_shapes(MemoryProfiler(config, tmp_path / "b", rank=0, device="cpu", min_bytes=MiB)) == []
    with pytest.raises(ValueError, match="min_bytes"):
        MemoryProfiler(config, tmp_path, rank=0, device="cpu", min_bytes=-1)


def test_memory_report_says_how_much_of_the_peak_is_in_tensors_too_small_to_list(tmp_path, capsys):
    # The default config lists tensors of at least 64 KiB; this step's are 16 KiB: none is listed, and the
    # report says so instead of printing an empty list.
    prof = MemoryProfiler(
        MemoryProfilerConfig(profile_steps=(0,)), tmp_path / "default", rank=0, device="cpu"
    )
    with prof.step(0) as path:
        _train_step(64)
    peak = json.loads(path.read_text())["peak_bytes"]
    assert peak >= 3 * 64 * 64 * 4
    assert cli_main(["memory-report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "of at least 64 KiB alive at the peak (0 listed, 0.0 MiB)" in out
    assert f"{peak / MiB:10,.1f} MiB  in tensors under 64 KiB, not listed" in out
    assert "min_bytes: 0" in out

    prof = MemoryProfiler(MemoryProfilerConfig(profile_steps=(0,), min_bytes=0), tmp_path / "all", rank=0,
                          device="cpu")  # fmt: skip
    with prof.step(0) as path:
        _train_step(64)
    assert cli_main(["memory-report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "torch.float32 [64, 64]" in out and "not listed" not in out
