"""`lmloss sft` on one process: data, tokenizer, packed attention, learning, resume, bad input.

The multi-process layouts (DP x CP x TP) are checked against these single-process runs in
tests/distributed/test_sft_parallel.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from lmloss.sft import cli, data, tasks  # noqa: E402
from lmloss.sft.attention import PackedAttention, packed_causal_mask  # noqa: E402
from lmloss.sft.config import SFTConfig  # noqa: E402
from lmloss.sft.launch import run  # noqa: E402
from lmloss.sft.model import build_model  # noqa: E402
from lmloss.sft.tokenizer import prepare_tokenizer, train_bpe  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: more threads only contend on a small machine
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> str:
    texts = [(e.prompt or "") + e.text for e in data.load_jsonl(None)]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    prepare_tokenizer(texts, 512, path)
    return str(path)


def _config(out: Path, tokenizer: str, **kw) -> SFTConfig:
    # device cpu: these runs are compared bit for bit (resume) or at rtol 1e-5 (naive vs fused head), which
    # CPU kernels guarantee and CUDA's atomics (embedding backward) need not; CUDA has its own test below
    base = dict(out=str(out), tokenizer=tokenizer, tokens_per_batch=256, steps=4, warmup_steps=2,
                head_memory=False, track_memory=False, progress=False, device="cpu")  # fmt: skip
    return SFTConfig(**{**base, **kw})


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(out: Path) -> list[float]:
    return [row["loss"] for row in _metrics(out)]


# -- data and tokenizer ------------------------------------------------------------------------------


def test_shipped_dataset_is_the_generators_output():
    shipped = [json.loads(line) for line in data.default_dataset_path().read_text().splitlines()]
    assert shipped == tasks.generate()


def test_bpe_training_is_deterministic_and_cached_only_for_the_same_texts(tmp_path):
    texts = ["next: monday\n tuesday", "add: 1 + 2\n 3"] * 50
    assert train_bpe(texts, 300).to_str() == train_bpe(texts, 300).to_str()
    cache = tmp_path / "tok.json"
    first = prepare_tokenizer(texts, 300, cache)
    written = cache.stat().st_mtime_ns
    again = prepare_tokenizer(texts, 300, cache)
    assert cache.stat().st_mtime_ns == written  # read from the cache, not retrained
    assert again.encode("add: 1 + 2") == first.encode("add: 1 + 2") and len(first.encode("add: 1 + 2")) < 6
    # another dataset (an earlier run's tokenizer left in --out) is never reused: it is retrained on these
    other = prepare_tokenizer(["zebra quartz xylophone"] * 50, 300, cache)
    assert other.encode("add: 1 + 2") == train_bpe(["zebra quartz xylophone"] * 50, 300).encode(
        "add: 1 + 2", add_special_tokens=False).ids  # fmt: skip
    assert len(other.encode("add: 1 + 2")) > len(first.encode("add: 1 + 2"))
    # a cache file changed since it was written (its sha256 no longer matches) is retrained too
    prepare_tokenizer(texts, 300, cache)
    cache.write_text(cache.read_text() + " ")
    assert prepare_tokenizer(texts, 300, cache).encode("add: 1 + 2") == first.encode("add: 1 + 2")
    assert not cache.read_text().endswith(" ")


def test_prompt_tokens_are_not_targets_and_eos_is(tokenizer_file):
    from lmloss.sft.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_file)
    examples = [data.Example(line=1, prompt="add: 1 + 2\n", text=" 3"), data.Example(line=2, text="hello")]
    (qa, plain), _ = data.tokenize(examples, tok.encode, tok.eos_id, max_tokens=64, truncate=False)
    n_prompt = len(tok.encode("add: 1 + 2\n"))
    assert qa.targets == [False] * n_prompt + [True] * (len(qa.ids) - n_prompt)
    assert qa.ids[-1] == tok.eos_id and plain.ids[-1] == tok.eos_id and all(plain.targets)


def test_batch_order_is_deterministic_and_within_budget():
    lengths = [5, 9, 3, 7, 8, 2, 6] * 5
    a, b = data.BatchOrder(lengths, 20, seed=3), data.BatchOrder(lengths, 20, seed=3)
    assert [a.micro_batch(i) for i in range(30)] == [b.micro_batch(i) for i in range(30)]
    for e in range(2):
        batches = a.epoch(e)
        assert sorted(i for mb in batches for i in mb) == list(range(len(lengths)))  # nothing dropped
        assert all(sum(lengths[i] for i in mb) <= 20 for mb in batches)


# -- packed attention ---------------------------------------------------------------------------------


def test_packed_causal_mask_follows_the_zigzag_layout():
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)  # sequences of 8 and 4 positions, cp = 2
    seq = [0] * 8 + [1] * 4
    # zigzag by hand: each sequence in 4 chunks; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    held = {0: [0, 1, 6, 7, 8, 11], 1: [2, 3, 4, 5, 9, 10]}
    for rank, positions in held.items():
        expected = torch.tensor([[seq[q] == seq[k] and k <= q for k in range(12)] for q in positions])
        assert torch.equal(packed_causal_mask(cu, 2, rank), expected)


def test_packed_attention_matches_each_sequence_run_alone(tokenizer_file):
    from transformers import AutoModelForCausalLM

    model = build_model(None, vocab_rows=512, seed=0).eval()
    reference = AutoModelForCausalLM.from_config(model.config, attn_implementation="sdpa").eval()
    reference.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 512, (n,), generator=gen) for n in (5, 9, 4)]
    cu = torch.tensor([0, 5, 14, 18], dtype=torch.int32)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.no_grad():
        packed = model.model(input_ids=torch.cat(seqs)[None], position_ids=positions[None],
                             packed=PackedAttention.build(cu, None)).last_hidden_state[0]  # fmt: skip
        alone = torch.cat([reference.model(input_ids=s[None]).last_hidden_state[0] for s in seqs])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


# -- training ---------------------------------------------------------------------------------------


def test_embedded_demo_learns_and_writes_its_outputs(tmp_path, tokenizer_file, capsys):
    # the demo's data and model, fewer steps: the response-token loss starts near ln(512) = 6.2
    out = tmp_path / "demo"
    # --device cpu: the head-memory comparison below is the CPU's. On CUDA the auto chunk's budget is 2 GiB,
    # so at 512 tokens one chunk holds them all and fused and naive peaks come out equal.
    code = cli.standalone(["--out", str(out), "--tokenizer", tokenizer_file, "--steps", "30", "--no-progress",
                           "--head-memory-vocab", "8192", "--log-every", "10", "--no-track-memory",
                           "--device", "cpu"])  # fmt: skip
    assert code == 0
    losses = _losses(out)
    assert len(losses) == 30 and losses[0] > 5.5
    assert sum(losses[-5:]) / 5 < 3.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["head_memory"]["naive_mib"] > summary["head_memory"]["fused_mib"] > 0
    assert (out / "loss.png").stat().st_size > 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-12].startswith("step   30 | loss") and printed[-11] == "summary"
    head = summary["head_memory"]
    fused, naive = f"{head['fused_mib']:.1f} MiB", f"{head['naive_mib']:.1f} MiB"
    # the measurement says that its vocabulary is the flag's, not the model's, and what its tokens are
    assert (f"loss head alone, forward + backward, at --head-memory-vocab 8192, not this model's 512: 512 tokens x "
            f"8192 vocab rows per rank: fused {fused} vs naive {naive}") in printed  # fmt: skip
    # the run ends with three lines: what it showed, where its outputs are (all there), what to try next
    tail_mean = sum(losses[-10:]) / 10
    assert printed[-3] == (f"shown: a 0.16M-parameter LlamaForCausalLM trained 30 steps on dp=1 cp=1 tp=1, loss "
                           f"{losses[0]:.2f} -> {tail_mean:.2f} (mean of the last 10) through lmloss's fused head "
                           f"(no [tokens, vocab] logits); at vocab 8192 the loss head alone peaks at {fused} fused "
                           f"vs {naive} naive ({head['naive_mib'] / head['fused_mib']:.1f}x)")  # fmt: skip
    files = ["metrics.jsonl", "loss.png", "summary.json"]  # tokenizer.json: --tokenizer names one elsewhere
    assert printed[-2] == f"outputs: {out}/ ({', '.join(files)}); no checkpoints (--save-every N writes them)"
    assert sorted(p.name for p in out.iterdir()) == sorted(files)
    assert printed[-1].startswith("next: --save-every N keeps checkpoints that --resume latest continues from; "
                                  "--tp 2 --nproc 2 shards the LM head over 2 ranks;")  # fmt: skip


def test_resume_continues_exactly_like_the_uninterrupted_run(tmp_path, tokenizer_file):
    full = tmp_path / "full"
    run(_config(full, tokenizer_file, steps=4, save_every=2))
    uninterrupted = _metrics(full)
    checkpoint = full / "checkpoints" / "step_2"
    assert (checkpoint / "tp0.pt").is_file()
    # resumed into another directory, so its metrics log holds only what the resumed run computed
    resumed_out = tmp_path / "resumed"
    run(_config(resumed_out, tokenizer_file, steps=4, resume=str(checkpoint)))
    resumed = _metrics(resumed_out)
    assert [r["step"] for r in resumed] == [3, 4]
    for key in ("loss", "grad_norm", "lr", "n_tokens"):  # bit for bit: same data, same state, same kernels
        assert [r[key] for r in resumed] == [r[key] for r in uninterrupted[2:]], key
    assert resumed[0]["loss"] != uninterrupted[1]["loss"]  # the comparison is of different steps' numbers


def test_naive_head_trains_like_the_fused_head(tmp_path, tokenizer_file):
    fused = run(_config(tmp_path / "fused", tokenizer_file, steps=3, vocab_size=1024))["losses"]
    naive = run(_config(tmp_path / "naive", tokenizer_file, steps=3, vocab_size=1024, loss_impl="naive"))[
        "losses"
    ]
    torch.testing.assert_close(torch.tensor(naive), torch.tensor(fused), rtol=1e-5, atol=0)


def test_config_yaml_with_command_line_override(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 7\ncp: 2\ntokens-per-batch: 128\nmemory_profile: {profile_steps: [0, 3]}\n")
    parser = __import__("argparse").ArgumentParser()
    cli.add_arguments(parser)
    cfg = cli.config_from_args(parser.parse_args(["--config", str(path), "--steps", "9"]))
    assert (cfg.steps, cfg.cp, cfg.tokens_per_batch) == (9, 2, 128)
    assert cfg.memory_profile == {"profile_steps": [0, 3]}


def test_config_yaml_values_are_coerced_to_their_field_types(tmp_path):
    # YAML 1.1 reads 1e-3 as a string (no dot) and keeps quoted "false" a string: both are unambiguous
    path = tmp_path / "run.yaml"
    path.write_text('lr: 1e-3\nweight_decay: 1e-2\nsteps: "5"\ngrad_clip: 1\nshuffle: "false"\n'
                    'truncate: "Yes"\nchunk_size: "64"\nresume: latest\noverride: [lr, tokens-per-batch]\n')  # fmt: skip
    cfg = SFTConfig.from_yaml(path)
    assert (cfg.lr, cfg.weight_decay, cfg.steps, cfg.grad_clip) == (1e-3, 1e-2, 5, 1.0)
    assert type(cfg.lr) is float and type(cfg.steps) is int and type(cfg.grad_clip) is float
    assert cfg.shuffle is False and cfg.truncate is True and cfg.chunk_size == 64
    assert cfg.override == ("lr", "tokens_per_batch")
    # shuffle: "false" keeps the file order (it used to be a truthy string, and shuffled)
    order = data.BatchOrder([1] * 8, 2, seed=0, shuffle=cfg.shuffle)
    assert order.epoch(0) == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("shuffle: maybe", "shuffle must be true or false, got 'maybe'"),
        ("shuffle: 2", "shuffle must be true or false, got 2"),
        ("lr: fast", "lr must be a number, got 'fast'"),
        ("steps: 2.5", "steps must be an integer, got 2.5"),
        ("lr: .nan", "lr must be a finite number >= 0, got nan"),
        ("data: 7", "data must be a string, got 7 (int)"),
        ("override: [learning_rate]", "override names ['learning_rate'] are not run settings"),
        ("override: lr", "override ['lr'] applies to a resumed run only (--resume)"),
    ],
)
def test_config_yaml_value_of_the_wrong_type_names_the_field(tmp_path, capsys, line, message):
    path = tmp_path / "run.yaml"
    path.write_text(line + "\n")
    err = _cli_error(capsys, "--config", str(path), "--out", str(tmp_path / "out"))
    assert err.startswith(f"lmloss sft: error: {message}")
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_device_trains_on_cuda_and_starts_where_the_cpu_run_starts(tmp_path, tokenizer_file):
    # step 1's loss is a forward before any update: CUDA and CPU agree up to summation order
    cpu = run(_config(tmp_path / "cpu", tokenizer_file, steps=2))
    cuda = run(_config(tmp_path / "cuda", tokenizer_file, steps=2, device="auto"))
    assert cuda["layout"] == cpu["layout"]
    torch.testing.assert_close(cuda["losses"][0], cpu["losses"][0], rtol=1e-4, atol=0)
    assert all(torch.isfinite(torch.tensor(cuda["losses"])))


# -- device choice -----------------------------------------------------------------------------------


def _gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


@pytest.mark.parametrize(
    ("gpus", "nproc", "device"), [(0, 1, "cpu"), (0, 4, "cpu"), (1, 1, "cuda"), (1, 2, "cpu"), (8, 4, "cuda")]
)
def test_auto_takes_cuda_only_when_every_local_process_gets_its_own_gpu(monkeypatch, gpus, nproc, device):
    from lmloss.sft.parallel import resolve_device

    _gpus(monkeypatch, gpus)
    chosen, note = resolve_device("auto", nproc)
    assert chosen == device
    if gpus and device == "cpu":  # CUDA is there but not used: the user is told why, in one line
        assert f"{nproc} processes on this node but {gpus} CUDA device(s)" in note and "\n" not in note
    else:
        assert note is None
    assert resolve_device("cpu", nproc) == ("cpu", None)


def test_explicit_cuda_without_a_gpu_per_process_stops_naming_device_and_nproc(tmp_path, monkeypatch, capsys):
    _gpus(monkeypatch, 1)
    err = _cli_error(capsys, "--nproc", "2", "--cp", "2", "--device", "cuda", "--out", str(tmp_path))
    assert "--device cuda needs one GPU per process: 2 processes on this node" in err
    assert "--nproc" in err and "--device cpu" in err
    _gpus(monkeypatch, 0)
    err = _cli_error(capsys, "--device", "cuda", "--out", str(tmp_path))
    assert "CUDA is not available" in err
    err = _cli_error(capsys, "--device", "tpu", "--out", str(tmp_path))
    assert "device must be auto, cpu or cuda, got 'tpu'" in err


def test_demo_layout_on_a_one_gpu_machine_runs_on_cpu_and_says_so(
    tmp_path, tokenizer_file, monkeypatch, capsys
):
    # `make demo` (--nproc 2 --cp 2, device auto) where one GPU is visible: the launcher picks cpu/gloo
    # before spawning anything. The spawn itself is replaced: the device it is handed is what is checked.
    from lmloss.sft import launch

    _gpus(monkeypatch, 1)
    launched = {}
    monkeypatch.setattr(
        launch, "spawn", lambda nproc, device, fn, *args: launched.update(nproc=nproc, device=device)
    )
    with pytest.raises(FileNotFoundError):  # no summary: nothing ran
        run(_config(tmp_path, tokenizer_file, cp=2, nproc=2, device="auto"))
    assert launched == {"nproc": 2, "device": "cpu"}
    assert "so the run is on CPU with gloo" in capsys.readouterr().out


# -- bad input ---------------------------------------------------------------------------------------


def _cli_error(capsys, *argv: str) -> str:
    assert cli.standalone([*argv, "--no-progress"]) == 2
    return capsys.readouterr().err


def test_missing_dataset_file_is_reported(tmp_path, capsys):
    err = _cli_error(capsys, "--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path))
    assert "nope.jsonl does not exist" in err


def test_empty_dataset_is_reported(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    err = _cli_error(capsys, "--data", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "out"))
    assert "holds no examples" in err


def test_malformed_lines_are_reported_with_line_numbers_and_nothing_is_loaded(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "broken"\n\n{"prompt": "p"}\n[1, 2]\n{"text": "fine too"}\n')
    with pytest.raises(data.DataError) as info:
        data.load_jsonl(path)
    msg = str(info.value)
    assert "3 malformed line(s)" in msg and "nothing was loaded" in msg
    assert "line 2: not valid JSON" in msg
    assert 'line 4: a prompt/response record needs string fields "prompt" and "response"' in msg
    assert "line 5: expected a JSON object, got list" in msg


def test_example_longer_than_a_micro_batch_is_rejected_or_truncated(tmp_path, tokenizer_file, capsys):
    path = tmp_path / "long.jsonl"
    path.write_text('{"text": "short"}\n' + json.dumps({"text": " monday" * 40}) + "\n")
    err = _cli_error(capsys, "--data", str(path), "--tokenizer", tokenizer_file, "--tokens-per-batch", "16",
                     "--out", str(tmp_path / "a"))  # fmt: skip
    assert (
        "1 example(s) are longer than tokens_per_batch=16: line 2 (41 tokens)" in err and "--truncate" in err
    )
    run(_config(tmp_path / "b", tokenizer_file, data=str(path), tokens_per_batch=16, truncate=True, steps=1))
    assert "1 example(s) were truncated to 16 tokens" in capsys.readouterr().out


def test_layout_that_does_not_match_the_process_count_is_rejected(tmp_path, capsys, monkeypatch):
    err = _cli_error(capsys, "--nproc", "3", "--cp", "2", "--out", str(tmp_path))
    assert "--nproc 3 processes cannot be laid out as dp*cp*tp = 1*2*1 = 2" in err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    err = _cli_error(capsys, "--tp", "2", "--out", str(tmp_path))
    assert "dp*cp*tp = 1*1*2 = 2 does not match the world size 3 of this torchrun launch" in err
