"""`lmloss sft` under DP x CP x TP on gloo: every layout trains exactly like one process.

All layouts run inside ONE 4-process launch (each launch costs seconds of imports and group set-up):
DP=2 x CP=2 and TP=2 x CP=2 over all four ranks, then CP=2 on ranks {0, 1} and TP=2 on ranks {2, 3} at
the same time, then TP=2 with the naive logits head on ranks {0, 1}. The single-process reference runs in the test process itself. The
memory profiler and the world-size check ride along in the same launch. Everything runs on the CPU with gloo
(device pinned), also on a machine with GPUs.

Tolerances (fp32): the step-1 loss and gradient norm, and every later step's loss (STEPS steps of AdamW),
agree with one process to rtol 1e-5. Only the order of summation differs (attention over the gathered
K/V, vocab shards combined over TP, gradients summed over ranks); the observed differences are ~1e-7.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from lmloss.sft import checkpoint as sft_checkpoint  # noqa: E402
from lmloss.sft.config import SFTConfig  # noqa: E402
from lmloss.sft.parallel import Mesh  # noqa: E402
from lmloss.sft.report import MetricsLog  # noqa: E402
from lmloss.sft.trainer import Trainer, prepare_data  # noqa: E402

STEPS = 12  # the reference loss falls by 1.9 over them (6.27 -> a last-five mean of 4.36)
LAYOUTS = {  # name: (dp, cp, tp, ranks, extra config)
    "dp2_cp2": (2, 2, 1, [0, 1, 2, 3], {"memory_profile": {"profile_steps": [1]}}),
    "tp2_cp2": (1, 2, 2, [0, 1, 2, 3], {"memory_profile": {"profile_steps": [2], "ranks": [0, 3]}}),
    "cp2": (1, 2, 1, [0, 1], {}),
    "tp2": (1, 1, 2, [2, 3], {}),
    "tp2_naive": (1, 1, 2, [0, 1], {"loss_impl": "naive"}),
}
SIDE_BY_SIDE = (("cp2", "tp2"), ("tp2_naive",))  # 2-rank layouts that run at the same time


def _config(out: str, tokenizer: str | None, dp: int = 1, cp: int = 1, tp: int = 1, **extra) -> SFTConfig:
    # 2 micro-batches of 256 tokens per step, so DP=2 and one process see the same global batch;
    # 1024 embedding rows for 512 tokens: the padded rows are masked in the loss
    return SFTConfig(out=out, tokenizer=tokenizer, dp=dp, cp=cp, tp=tp, micro_batches=2, tokens_per_batch=256,
                     steps=STEPS, warmup_steps=2, lr=3e-3, vocab_size=1024, head_memory=False, track_memory=False,
                     progress=False, **extra)  # fmt: skip


def _train(trainer: Trainer) -> dict[str, list[float]]:
    rows = [trainer.run_step() for _ in range(STEPS)]
    return {"loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows],
            "n_tokens": [r["n_tokens"] for r in rows]}  # fmt: skip


def _worker(rank: int, world: int, out_dir: str, tokenizer: str) -> dict:
    results = {}
    prepared = prepare_data(_config(out_dir, tokenizer))
    try:
        Mesh.build(2, 2, 2)
    except ValueError as err:
        results["bad_layout_error"] = str(err)

    def trainer(name: str, mesh: Mesh) -> Trainer:
        dp, cp, tp, _, extra = LAYOUTS[name]
        cfg = _config(f"{out_dir}/{name}", tokenizer, dp, cp, tp, **extra)
        return Trainer(cfg, mesh, torch.device("cpu"), prepared)

    for name in ("dp2_cp2", "tp2_cp2"):
        trained = trainer(name, Mesh.build(*LAYOUTS[name][:4]))
        results[name] = _train(trained)
    # a checkpoint of tp2_cp2: two head shards, written by the cp=0 rank of each TP rank (2 of the 4)
    log = (
        MetricsLog(Path(out_dir) / "tp2_cp2" / "metrics.jsonl", resume_step=0)
        if trained.mesh.is_main
        else None
    )
    trained.save(log)
    # 2-rank layouts side by side: every rank takes part in creating every group, then uses its own
    for names in SIDE_BY_SIDE:
        meshes = {name: Mesh.build(*LAYOUTS[name][:4]) for name in names}
        for name, mesh in meshes.items():
            if mesh is not None:
                results[name] = _train(trainer(name, mesh))
    return results


def _launch(worker, nprocs: int, *args) -> list[dict]:
    """`dist_utils.run_ranks` (forked CPU/gloo ranks, with a deadline). Where CUDA is available, this process
    may already have initialised it (transformers queries the device while building a model): the ranks are
    spawned then, with the GPUs hidden, since everything here runs on the CPU."""
    if not torch.cuda.is_available():
        return run_ranks(worker, nprocs, *args)
    hidden_before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read by the children at start-up
    try:
        return run_ranks(worker, nprocs, *args)
    finally:
        if hidden_before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden_before


@pytest.fixture(scope="module")
def runs():
    """The single-process reference and every rank's results of the 4-process launch."""
    with tempfile.TemporaryDirectory() as out_dir:
        cfg = _config(out_dir, None)
        prepared = prepare_data(cfg)  # trains the tokenizer once, cached as out_dir/tokenizer.json
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the 2-core CI machine: more threads only contend
        try:
            reference = _train(Trainer(cfg, Mesh(), torch.device("cpu"), prepared))
            per_rank = _launch(_worker, 4, out_dir, os.path.join(out_dir, "tokenizer.json"))
        finally:
            torch.set_num_threads(threads)
        out = Path(out_dir)
        memory = {name: sorted(str(p.relative_to(out / name / "memory")) for p in out.glob(f"{name}/memory/**/*.json"))
                  for name in ("dp2_cp2", "tp2_cp2", "cp2")}  # fmt: skip
        reports = {p: json.loads((out / "dp2_cp2" / "memory" / p).read_text()) for p in memory["dp2_cp2"]}
        saved = out / "tp2_cp2" / "checkpoints" / f"step_{STEPS}"
        checkpoint = {
            "files": sorted(p.name for p in saved.iterdir()),
            "manifest": json.loads((saved / "manifest.json").read_text()),
            "sha256": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in saved.glob("tp*.pt")},
            "bytes": {p.name: p.stat().st_size for p in saved.glob("tp*.pt")},
            "head_rows": {p.name: torch.load(p, weights_only=True)["model"]["lm_head.weight"].shape[0]
                          for p in saved.glob("tp*.pt")},
            "path": saved,
        }  # fmt: skip
        yield {"reference": reference, "per_rank": per_rank, "memory": memory, "reports": reports,
               "checkpoint": checkpoint}  # fmt: skip


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process(runs, name):
    ref = runs["reference"]
    ref_loss, ref_norm = torch.tensor(ref["loss"]), torch.tensor(ref["grad_norm"])
    assert ref_loss[-5:].mean() < ref_loss[0] - 1.0, "the reference run should learn"
    for r in LAYOUTS[name][3]:
        got = runs["per_rank"][r][name]
        assert got["n_tokens"] == ref["n_tokens"], f"rank {r} saw another global batch"
        loss, norm = torch.tensor(got["loss"]), torch.tensor(got["grad_norm"])
        torch.testing.assert_close(loss[0], ref_loss[0], rtol=1e-5, atol=0, msg=f"rank {r}: step-1 loss")
        torch.testing.assert_close(norm[0], ref_norm[0], rtol=1e-5, atol=0, msg=f"rank {r}: step-1 grad norm")
        torch.testing.assert_close(
            loss, ref_loss, rtol=1e-5, atol=0, msg=f"rank {r}: losses over {STEPS} steps"
        )


def test_memory_profiler_writes_one_report_per_rank_for_configured_steps_only(runs):
    assert runs["memory"]["dp2_cp2"] == [
        "step_1/rank0_pp0_dp0_cp0_tp0.json",
        "step_1/rank1_pp0_dp0_cp1_tp0.json",
        "step_1/rank2_pp0_dp1_cp0_tp0.json",
        "step_1/rank3_pp0_dp1_cp1_tp0.json",
    ]
    assert runs["memory"]["tp2_cp2"] == [
        "step_2/rank0_pp0_dp0_cp0_tp0.json",
        "step_2/rank3_pp0_dp0_cp1_tp1.json",
    ]
    assert runs["memory"]["cp2"] == []  # not configured: nothing written
    for report in runs["reports"].values():
        assert report["step"] == 1 and report["peak_bytes"] > 0


def test_layout_that_does_not_match_the_world_size_is_rejected(runs):
    for r in range(4):
        assert (
            "dp*cp*tp = 2*2*2 = 8 does not match the 4 processes" in runs["per_rank"][r]["bad_layout_error"]
        )


def test_checkpoint_of_a_tp_layout_holds_each_shard_with_its_checksum(runs):
    ckpt = runs["checkpoint"]
    assert ckpt["files"] == ["manifest.json", "tp0.pt", "tp1.pt"]  # no temporary file left
    manifest = ckpt["manifest"]
    assert manifest["step"] == STEPS and manifest["tp"] == 2
    assert manifest["shards"] == {
        name: {"bytes": ckpt["bytes"][name], "sha256": ckpt["sha256"][name]} for name in ("tp0.pt", "tp1.pt")
    }
    assert ckpt["head_rows"] == {"tp0.pt": 512, "tp1.pt": 512}  # the 1024-row head, one half in each


@pytest.mark.parametrize("manifest_tp", [2, 1])
def test_manifest_that_omits_a_shard_of_a_tp_checkpoint_is_not_resumed(runs, tmp_path, manifest_tp):
    ckpt = tmp_path / "checkpoints" / f"step_{STEPS}"
    shutil.copytree(runs["checkpoint"]["path"], ckpt)
    assert sft_checkpoint.verify(ckpt) is None
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["shards"]["tp1.pt"]  # tp1.pt stays on disk, of the right size and checksum
    manifest["tp"] = manifest_tp  # 1: as if the checkpoint were a whole one-shard model
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    reason = {2: "its manifest.json (tp=2) does not list tp1.pt",
              1: "tp1.pt is on disk but not in its manifest.json (tp=1)"}[manifest_tp]  # fmt: skip
    assert sft_checkpoint.verify(ckpt) == reason
    with pytest.raises(sft_checkpoint.CheckpointError) as err:
        sft_checkpoint.find(tmp_path, "latest")
    assert str(err.value) == (f"--resume latest: no intact checkpoint under {tmp_path / 'checkpoints'}: "
                              f"step_{STEPS} ({reason}). Nothing was resumed")  # fmt: skip
