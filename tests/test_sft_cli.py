"""`lmloss sft` as a user meets it on the command line: a used --out, Ctrl-C, and errors raised inside the
spawned ranks, each ending in one line (no traceback) that says what to do."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from lmloss.sft import cli  # noqa: E402
from lmloss.sft.model import default_model_config_path  # noqa: E402
from lmloss.sft.tokenizer import train_bpe  # noqa: E402
from lmloss.sft.trainer import Trainer  # noqa: E402
from sft_support import SMALL_DATA  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "small_runs")


FLAGS = ["--tokens-per-batch", "256", "--warmup-steps", "2", "--no-progress", "--no-head-memory",
         "--no-track-memory", "--device", "cpu"]  # fmt: skip


def _sft(capfd, out: Path, *argv: str) -> tuple[int, str, str]:
    code = cli.standalone(["--out", str(out), *SMALL_DATA, *FLAGS, *argv])
    captured = capfd.readouterr()
    return code, captured.out, captured.err


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_used_out_is_refused_and_overwrite_starts_afresh_with_its_own_tokenizer(tmp_path, capfd):
    out = tmp_path / "run"
    assert _sft(capfd, out, "--steps", "1", "--save-every", "1")[0] == 0
    code, _, err = _sft(capfd, out, "--steps", "2")
    assert code == 2 and err.count("\n") == 1
    assert f"--out {out} already holds a run (" in err and "--resume latest" in err and "--overwrite" in err
    assert _steps(out) == [1]  # untouched
    # another dataset into the same --out: its tokenizer is trained on that data, nothing of the first run stays
    other = [f"count: {' '.join(['zebra'] * k)}" for k in range(1, 40)]
    data = tmp_path / "other.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in other))
    code, _, err = _sft(capfd, out, "--steps", "2", "--data", str(data), "--overwrite")
    assert code == 0, err
    assert _steps(out) == [1, 2] and not (out / "checkpoints").exists()
    assert json.loads((out / "summary.json").read_text())["first_step"] == 1
    from tokenizers import Tokenizer

    used = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert used.to_str() == train_bpe(other, 512).to_str()
    # --overwrite deletes only what a run writes
    (out / "notes.txt").write_text("mine")
    code, _, err = _sft(capfd, out, "--steps", "2", "--overwrite")
    assert code == 2 and "also holds notes.txt, which lmloss sft does not write; nothing was deleted" in err
    assert (out / "notes.txt").exists() and _steps(out) == [1, 2]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("")
    code, _, err = _sft(capfd, mine, "--steps", "1")
    assert code == 2 and "is not empty (thesis.tex): pass a new or empty directory" in err


@pytest.fixture
def python_sigint_handler():
    """Python's own SIGINT handler for the test, as a process started from a terminal has it: a shell that
    starts a job in the background without job control (``cmd &`` in a script, as CI may) hands it SIGINT
    ignored, and a Ctrl-C then never reaches the command."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_prints_one_line_with_the_resume_hint_and_resuming_finishes(
    tmp_path, capfd, monkeypatch, python_sigint_handler
):
    out = tmp_path / "run"
    run_step = Trainer.run_step

    def interrupted_at_step_4(self):
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, delivered to this process
            time.sleep(5)  # not reached: the signal interrupts here
        return run_step(self)

    monkeypatch.setattr(Trainer, "run_step", interrupted_at_step_4)
    before = signal.getsignal(signal.SIGINT)
    code, _, err = _sft(capfd, out, "--steps", "4", "--save-every", "2")
    assert signal.getsignal(signal.SIGINT) is before
    assert code == 130
    assert err == (f"lmloss sft: interrupted after step 3; {out / 'checkpoints' / 'step_2'} is the newest checkpoint: "
                   "to continue, rerun the same command with --resume latest\n")  # fmt: skip
    monkeypatch.setattr(Trainer, "run_step", run_step)
    code, _, err = _sft(capfd, out, "--steps", "4", "--save-every", "2", "--resume", "latest")
    assert code == 0, err
    assert _steps(out) == [1, 2, 3, 4]


@pytest.fixture
def forked_ranks(monkeypatch):
    """Start the ranks by fork: they inherit this process's imports (spawn would import torch and transformers
    again in each, many seconds on a small machine). Where CUDA is available, keep spawn (fork is unsafe), and
    where this process already holds a default process group (an earlier test's, e.g. the bench's Megatron
    peer), too: a forked rank would inherit it and could not initialise its own."""
    import torch

    from lmloss.sft import parallel

    if not torch.cuda.is_available() and not torch.distributed.is_initialized():
        monkeypatch.setattr(parallel, "START_METHOD", "fork")
        from transformers import LlamaForCausalLM  # noqa: F401  (imported once here, not in every rank)


def test_spawned_ranks_report_errors_and_ctrl_c_in_one_line(tmp_path, capfd, forked_ranks):
    # 1. an error raised inside both spawned ranks (a tied LM head cannot be vocab-sharded)
    tied = tmp_path / "tied.json"
    tied.write_text(
        json.dumps({**json.loads(default_model_config_path().read_text()), "tie_word_embeddings": True})
    )
    code, _, err = _sft(capfd, tmp_path / "tied", "--nproc", "2", "--tp", "2", "--model-config", str(tied),
                        "--steps", "2")  # fmt: skip
    assert code == 2
    assert err == ("lmloss sft: error: tp > 1 needs an untied LM head (tie_word_embeddings: false): the embedding "
                   "is replicated\n")  # fmt: skip
    # 2. Ctrl-C on a terminal signals every process of its group: here the two ranks and this process. A timer
    # signal (no thread: the ranks are forked) presses it once the first step is logged.
    out = tmp_path / "run"

    give_up = time.monotonic() + 120  # pressed then anyway: the test fails instead of hanging

    def press_ctrl_c(*_) -> None:
        log = out / "metrics.jsonl"
        if not (log.is_file() and log.read_text().count("\n") >= 1) and time.monotonic() < give_up:
            return
        signal.setitimer(signal.ITIMER_REAL, 0)
        for child in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):  # a rank that has just exited
                os.kill(child.pid, signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGALRM, press_ctrl_c)
    signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
    try:
        code, printed, err = _sft(capfd, out, "--nproc", "2", "--cp", "2", "--steps", "1000")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert code == 130
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmloss sft: interrupted after step "), err
    assert lines[0].endswith(
        "no checkpoint was saved (--save-every N saves them); rerun with --overwrite to start over"
    )
    assert "Traceback" not in printed and multiprocessing.active_children() == []


def test_a_missing_sft_dependency_names_the_extra_to_install_from_this_checkout(capfd, monkeypatch, tmp_path):
    from lmloss.sft import launch

    def without_yaml(cfg):
        raise ModuleNotFoundError("No module named 'yaml'", name="yaml")

    monkeypatch.setattr(launch, "run", without_yaml)
    code, _, err = _sft(capfd, tmp_path / "run")
    checkout = Path(__file__).resolve().parents[1]  # lmloss is not on PyPI: never `pip install lmloss[sft]`
    assert code == 2
    hint = f'pip install -e "{checkout}[sft]"'
    assert err == f"lmloss sft: error: yaml is missing; install the sft extra: {hint}\n"
