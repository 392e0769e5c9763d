"""`lmloss sft` checkpoints and resume: checksums, falling back past a damaged checkpoint, the resumed run's
settings (steps, schedule, what may change) and its metrics log.

One uninterrupted 6-step run (checkpoints at steps 2, 4, 6) is shared by every test; each test copies it and
turns the copy into the state it needs (interrupted after step 4, a damaged file, a foreign log), then
resumes through the command line.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from lmloss.sft import checkpoint, cli  # noqa: E402
from lmloss.sft.parallel import Mesh  # noqa: E402
from sft_support import SMALL_DATA  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "small_runs")


STEPS, LR, MIN_LR_RATIO, WARMUP = 6, 1e-2, 0.1, 2
FLAGS = ["--tokens-per-batch", "256", "--warmup-steps", str(WARMUP), "--save-every", "2", "--no-progress",
         "--no-head-memory", "--no-track-memory", "--device", "cpu"]  # fmt: skip


def _sft(capsys, out: Path, *argv: str) -> tuple[int, str, str]:
    code = cli.standalone(["--out", str(out), *SMALL_DATA, *FLAGS, *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint / "tp0.pt", weights_only=True)["model"]


@pytest.fixture(scope="module")
def full(tmp_path_factory, small_runs) -> Path:
    """The uninterrupted run: 6 steps, checkpoints after steps 2, 4 and 6."""
    out = tmp_path_factory.mktemp("sft_full") / "run"
    assert cli.standalone(["--out", str(out), "--steps", str(STEPS), *SMALL_DATA, *FLAGS]) == 0
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_2", "step_4", "step_6"]
    return out


def _interrupted(full: Path, dst: Path, *, after: int = 4) -> Path:
    """A copy of `full` as if killed during step `after` + 1: checkpoints up to `after`, its metrics line
    half written."""
    shutil.copytree(full, dst)
    for ckpt in (dst / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > after:
            shutil.rmtree(ckpt)
    (dst / "checkpoints" / "latest").write_text(f"step_{after}")
    lines = (full / "metrics.jsonl").read_text().splitlines()
    (dst / "metrics.jsonl").write_text("".join(ln + "\n" for ln in lines[:after]) + lines[after][:40])
    (dst / "summary.json").unlink()
    return dst


def _reseal(ckpt: Path, name: str = "tp0.pt") -> None:
    """Rewrite the manifest's size and sha256 of shard `name` to match the file now on disk (as someone
    forging a checkpoint would)."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / name).read_bytes()
    manifest["shards"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


class _WritesMarker:
    """Unpickling this writes a file: what a hostile shard could do (anything else code can do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.write_text, (self.marker, "unpickling ran code")


def _flip_byte(path: Path, at: float = 0.5) -> None:
    raw = bytearray(path.read_bytes())
    raw[int(len(raw) * at)] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_damaged_newest_checkpoint_falls_back_and_ends_bit_identical(full, tmp_path, capsys, damage):
    out = _interrupted(full, tmp_path / "run")
    shard = out / "checkpoints" / "step_4" / "tp0.pt"
    if damage == "flipped byte":
        _flip_byte(shard)  # inside the tensor data: torch.load would read it without complaint
    else:
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    code, printed, err = _sft(capsys, out, "--resume", "latest")  # --steps: the resumed run's 6
    assert code == 0, err
    reason = "tp0.pt fails its sha256 check" if damage == "flipped byte" else "tp0.pt is truncated"
    notes = [ln for ln in printed.splitlines() if "not intact" in ln]
    assert len(notes) == 1 and reason in notes[0] and "resuming from step_2" in notes[0]
    assert "dropped a torn last line" in printed
    resumed, uninterrupted = (
        _weights(out / "checkpoints" / "step_6"),
        _weights(full / "checkpoints" / "step_6"),
    )
    assert resumed.keys() == uninterrupted.keys()
    for name, tensor in uninterrupted.items():
        assert torch.equal(resumed[name], tensor), name
    # the log holds the run's 6 steps once (steps 3-4 recomputed, bit for bit), the summary all of them
    assert _without_timing(_rows(out)) == _without_timing(_rows(full))
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["first_step"], summary["last_step"]) == (1, STEPS)


def test_no_intact_checkpoint_stops_in_one_line_and_resumes_nothing(full, tmp_path, capsys):
    out = _interrupted(full, tmp_path / "run")
    _flip_byte(out / "checkpoints" / "step_4" / "tp0.pt")
    (out / "checkpoints" / "step_2" / "manifest.json").unlink()  # as if its save never finished
    code, _, err = _sft(capsys, out, "--resume", "latest")
    assert code == 2 and err.count("\n") == 1, err
    assert "no intact checkpoint" in err and "step_4 (tp0.pt fails its sha256 check)" in err
    assert "step_2 (no manifest.json" in err
    code, _, err = _sft(capsys, out, "--resume", str(out / "checkpoints" / "step_4"))  # named: no fallback
    assert code == 2 and err.count("\n") == 1 and "not intact (tp0.pt fails its sha256 check)" in err
    assert not (out / "checkpoints" / "step_6").exists()


def test_resume_refuses_changed_run_settings_unless_overridden(full, tmp_path, capsys):
    out = _interrupted(full, tmp_path / "run")
    code, _, err = _sft(capsys, out, "--resume", "latest", "--lr", "0.02", "--seed", "1")
    assert code == 2 and err.count("\n") == 1
    assert "would change the run: lr (0.01 -> 0.02), seed (0 -> 1)" in err and "--override lr,seed" in err
    code, _, err = _sft(capsys, out, "--resume", "latest", "--lr", "0.02", "--seed", "1", "--override", "lr")
    assert code == 2 and "seed (0 -> 1)" in err and "lr (" not in err
    data = tmp_path / "other.jsonl"
    data.write_text('{"prompt": "add: 1 + 1\\n", "response": " 2"}\n' * 50)
    code, _, err = _sft(capsys, out, "--resume", "latest", "--data", str(data), "--tokens-per-batch", "128")
    assert (
        code == 2
        and "data (sha256 " in err
        and "tokenizer (sha256 " in err
        and "tokens_per_batch (256 -> 128)" in err
    )
    code, _, err = _sft(
        capsys, out, "--resume", "latest", "--lr", "0.02", "--seed", "1", "--override", "lr,seed"
    )
    assert code == 0, err
    assert [r["step"] for r in _rows(out)] == list(range(1, STEPS + 1))
    # the changed lr is what the resumed steps used: step 5 (index 4) on the original cosine at the new peak
    progress = (4 - WARMUP) / (STEPS - WARMUP)
    assert _rows(out)[4]["lr"] == pytest.approx(
        0.02 * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))
    )


def test_resume_trains_on_at_the_original_schedule_and_needs_more_steps(full, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(full, out)
    code, _, err = _sft(capsys, out, "--resume", "latest", "--steps", "5")
    assert code == 2 and err.count("\n") == 1
    assert "nothing to train: checkpoint" in err and "is at step 6 and --steps is 5" in err
    assert "pass --steps greater than 6" in err
    assert _sft(capsys, out, "--resume", "latest")[0] == 2  # --steps left out: the run's 6, also done
    # another run's log in its place: the resumed run's summary must not take it up
    (out / "metrics.jsonl").write_text(json.dumps({**_rows(full)[0], "loss": 99.0}) + "\n")
    code, printed, err = _sft(capsys, out, "--resume", "latest", "--steps", "8")
    assert code == 0, err
    assert "does not hold this run's 6 line(s) up to step 6" in printed
    rows = _rows(out)
    assert [r["step"] for r in rows] == [7, 8]
    assert [r["lr"] for r in rows] == [LR * MIN_LR_RATIO] * 2  # the cosine ended at step 6 and stays there
    summary = json.loads((out / "summary.json").read_text())
    assert summary["first_step"] == 7 and 99.0 not in summary["losses"]
    assert "(mean of the last 2:" in printed
    # re-stretching the schedule is a change of the run: named explicitly
    code, _, err = _sft(capsys, out, "--resume", "latest", "--steps", "10", "--schedule-steps", "10")
    assert code == 2 and "schedule_steps (6 -> 10)" in err
    code, _, err = _sft(capsys, out, "--resume", "latest", "--steps", "9", "--schedule-steps", "10",
                        "--override", "schedule_steps")  # fmt: skip
    assert code == 0, err
    progress = (8 - WARMUP) / (10 - WARMUP)  # row 9 is step index 8
    expected = LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))
    assert _rows(out)[-1]["step"] == 9 and _rows(out)[-1]["lr"] == pytest.approx(expected, rel=1e-12)


def test_a_run_that_saves_checkpoints_ends_by_naming_them_and_how_to_train_on(full, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(full, out)
    code, printed, err = _sft(capsys, out, "--resume", "latest", "--steps", "7")
    assert code == 0, err
    shown, where, then = printed.splitlines()[-3:]
    assert shown.startswith("shown: a 0.16M-parameter LlamaForCausalLM trained 7 steps (resumed after step 6) on "
                            "dp=1 cp=1 tp=1, loss ")  # fmt: skip
    assert where == (f"outputs: {out}/ (metrics.jsonl, summary.json, tokenizer.json); checkpoints: "
                     f"{out / 'checkpoints'}/ (step_2 .. step_7)")  # fmt: skip
    saved = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert saved == ["step_2", "step_4", "step_6", "step_7"]
    assert then.startswith("next: the same command with --resume latest --steps 14 (not --overwrite) trains on "
                           "from step_7; --tp 2 --nproc 2 shards the LM head over 2 ranks;")  # fmt: skip


def test_resume_with_another_tp_stops_before_any_process_starts(full, tmp_path, capsys):
    code, _, err = _sft(
        capsys, full, "--resume", "latest", "--steps", "8", "--tp", "2", "--vocab-size", "512"
    )
    assert code == 2 and err.count("\n") == 1
    assert "was written with tp=1; resume with --tp 1" in err


def test_load_of_a_checkpoint_written_with_another_tp_names_that_tp_and_restores_nothing(full):
    """`checkpoint.load` itself (for a caller that did not go through the command line's check): a tp=1
    checkpoint into a tp=2 layout's rank is refused, naming the tp to resume with, and nothing is restored."""
    point = checkpoint.find(full, "latest")
    model = torch.nn.Linear(2, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(checkpoint.CheckpointError, match=r"was written with tp=1; resume with --tp 1 "):
        checkpoint.load(point, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        mesh=Mesh(tp=2, tp_rank=0), device=torch.device("cpu"))  # fmt: skip
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_resume_with_more_micro_batches_per_step_continues_the_data_where_it_stopped(full, tmp_path, capsys):
    out = _interrupted(full, tmp_path / "run")  # 4 micro-batches consumed, one per step
    code, _, err = _sft(capsys, out, "--resume", "latest", "--steps", "5", "--micro-batches", "2")
    assert code == 2 and "micro_batches (1 -> 2)" in err
    code, _, err = _sft(capsys, out, "--resume", "latest", "--steps", "5", "--micro-batches", "2",
                        "--override", "micro_batches")  # fmt: skip
    assert code == 0, err
    # step 5 takes micro-batches 4 and 5: the uninterrupted run's steps 5 and 6, one each
    step5 = _rows(out)[4]
    assert step5["step"] == 5
    assert step5["n_tokens"] == _rows(full)[4]["n_tokens"] + _rows(full)[5]["n_tokens"]


def test_shard_whose_unpickling_runs_code_is_refused_on_resume_and_never_run(full, tmp_path, capsys):
    out = _interrupted(full, tmp_path / "run")
    ckpt = out / "checkpoints" / "step_4"
    marker = tmp_path / "marker"
    blob = torch.load(ckpt / "tp0.pt", weights_only=True)
    blob["optimizer"]["state"][0]["payload"] = _WritesMarker(marker)
    torch.save(blob, ckpt / "tp0.pt")
    _reseal(ckpt)  # its checksum matches: only how the shard is read can stop it
    torch.load(ckpt / "tp0.pt", weights_only=False)  # the payload works when unpickled without the guard
    assert marker.read_text() == "unpickling ran code"
    marker.unlink()
    for resume in ("latest", str(ckpt)):  # refused, not skipped for step_2: a forged shard is not damage
        code, printed, err = _sft(capsys, out, "--resume", resume)
        assert code == 2 and err.count("\n") == 1, err
        assert f"{ckpt / 'tp0.pt'} holds objects other than tensors and plain Python values" in err
        assert "it was not loaded (loading it could run code). Nothing was resumed" in err
        assert "resum" not in printed and not marker.exists()
    assert not (out / "checkpoints" / "step_6").exists()
    # load() itself reads safely, without verify() before it
    model = torch.nn.Linear(2, 2)
    point = checkpoint.ResumePoint(ckpt, 4, json.loads((ckpt / "manifest.json").read_text()))
    with pytest.raises(checkpoint.UnsafeShardError, match="tp0.pt holds objects other than tensors"):
        checkpoint.load(point, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), mesh=Mesh(),
                        device=torch.device("cpu"))  # fmt: skip
    assert not marker.exists()


def test_swapped_step_directories_are_skipped_by_name_and_reason_and_the_run_resumes_correctly(
    full, tmp_path, capsys
):
    out = tmp_path / "run"
    shutil.copytree(full, out)
    root = out / "checkpoints"
    (root / "step_4").rename(root / "swap")
    (root / "step_6").rename(root / "step_4")
    (root / "swap").rename(root / "step_6")
    code, _, err = _sft(capsys, out, "--resume", str(root / "step_6"))  # named: refused, not resumed
    assert code == 2 and err.count("\n") == 1
    assert "not intact (its manifest.json records step 4, not 6: a renamed or swapped directory)" in err
    code, printed, err = _sft(capsys, out, "--resume", "latest")
    assert code == 0, err
    notes = [ln for ln in printed.splitlines() if "not intact" in ln]
    assert notes == [
        "lmloss sft: checkpoint step_6 (its manifest.json records step 4, not 6: a renamed or swapped "
        "directory); step_4 (its manifest.json records step 6, not 4: a renamed or swapped directory): not "
        "intact; resuming from step_2, the newest intact one"
    ]
    assert f"resumed from {root / 'step_2'} after step 2;" in printed
    for name, tensor in _weights(full / "checkpoints" / "step_6").items():
        assert torch.equal(_weights(root / "step_6")[name], tensor), name


def test_shard_recording_another_step_than_its_manifest_is_not_intact(full, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(full / "checkpoints", root)
    shutil.copyfile(root / "step_4" / "tp0.pt", root / "step_6" / "tp0.pt")
    _reseal(root / "step_6")  # the step-4 shard under a step-6 manifest whose checksum matches it
    reason = "tp0.pt records step 4 with tp=1, its manifest.json step 6 with tp=1"
    assert checkpoint.verify(root / "step_6") == reason
    point = checkpoint.find(tmp_path, "latest")
    assert point.step == 4 and point.note == f"checkpoint step_6 ({reason}): not intact; resuming from step_4, " \
        "the newest intact one"  # fmt: skip


def _copy_checkpoints(full: Path, tmp_path: Path) -> Path:
    root = tmp_path / "checkpoints"
    shutil.copytree(full / "checkpoints", root)
    return root


def test_shard_recording_another_tp_than_its_manifest_is_not_intact(full, tmp_path):
    root = _copy_checkpoints(full, tmp_path)
    shard = root / "step_6" / "tp0.pt"
    blob = torch.load(shard, weights_only=True)
    blob["tp"] = 2
    torch.save(blob, shard)
    _reseal(root / "step_6")  # its checksum matches: only what it records is wrong
    reason = "tp0.pt records step 6 with tp=2, its manifest.json step 6 with tp=1"
    assert checkpoint.verify(root / "step_6") == reason
    assert checkpoint.find(tmp_path, "latest").step == 4


def test_manifest_listing_a_shard_of_another_tp_rank_is_not_intact(full, tmp_path):
    root = _copy_checkpoints(full, tmp_path)
    manifest = json.loads((root / "step_6" / "manifest.json").read_text())
    manifest["shards"]["tp1.pt"] = dict(manifest["shards"]["tp0.pt"])  # tp=1 writes tp0.pt only
    (root / "step_6" / "manifest.json").write_text(json.dumps(manifest))
    assert checkpoint.verify(root / "step_6") == "its manifest.json (tp=1) lists tp1.pt, which tp=1 does not write"
    assert checkpoint.find(tmp_path, "latest").step == 4


def test_a_shard_on_disk_that_its_manifest_does_not_list_is_not_intact(full, tmp_path):
    root = _copy_checkpoints(full, tmp_path)
    shutil.copyfile(root / "step_6" / "tp0.pt", root / "step_6" / "tp1.pt")  # e.g. left by a tp=2 run
    assert checkpoint.verify(root / "step_6") == "tp1.pt is on disk but not in its manifest.json (tp=1)"
    assert checkpoint.find(tmp_path, "latest").step == 4


def test_load_of_a_shard_that_changed_after_its_checkpoint_was_found_restores_nothing(full, tmp_path):
    """`checkpoint.load` checks the shard it reads against the manifest again: one replaced between `find` and
    `load` (here by the step-4 shard) is refused, naming both, and nothing is restored."""
    root = _copy_checkpoints(full, tmp_path)
    point = checkpoint.find(tmp_path, "latest")
    assert point.step == 6
    shutil.copyfile(root / "step_4" / "tp0.pt", root / "step_6" / "tp0.pt")
    model = torch.nn.Linear(2, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(checkpoint.CheckpointError, match=r"tp0.pt records step 4 with tp=1, its manifest step 6 "
                                                         r"with tp=1"):  # fmt: skip
        checkpoint.load(point, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), mesh=Mesh(),
                        device=torch.device("cpu"))  # fmt: skip
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
