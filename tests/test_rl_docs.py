"""docs/rl.md: its python example runs as written and prints the output shown under it."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "rl.md"


def test_rl_doc_example_prints_the_output_shown():
    text = DOC.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    shown = re.search(r"```python\n.*?```.*?```text\n(.*?)```", text, re.S).group(1)
    out = io.StringIO()
    rng = torch.get_rng_state()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(blocks[0], str(DOC), "exec"), {"__name__": "rl_doc"})
    finally:
        torch.set_rng_state(rng)  # the example seeds the global generator
    assert out.getvalue() == shown


VERL_LOSSES = (
    "vanilla",
    "dppo_tv",
    "dppo_kl",
    "gspo",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dro",
    "cispo",
    "bypass_mode",
)  # fmt: skip  (verl 0.9.1's registry: tests/test_rl_verl.py checks it)
TRL_LOSS_TYPES = (
    "grpo",
    "dr_grpo",
    "dapo",
    "bnpo",
    "cispo",
    "sapo",
    "luspo",
    "vespo",
)  # tests/test_rl_trl.py


def test_the_framework_table_names_every_loss_mode_and_every_peer_loss():
    import lmloss

    text = DOC.read_text()
    section = text[text.index("## The objectives and their names in each framework") :]
    section = section[: section.index("\n## ")]
    rows = [line.split(" | ") for line in section.split("\n") if line.startswith("| ")][2:]
    column = {name: " ".join(r[i] for r in rows) for i, name in enumerate(("lmloss", "verl", "trl"))}
    for mode in lmloss.rl.LOSS_MODES:
        assert f'"{mode}"' in column["lmloss"], mode
    for mode in lmloss.rl.LOSS_AGG_MODES:
        assert f'"{mode}"' in column["lmloss"], mode
    for name in VERL_LOSSES:
        assert f'"{name}"' in column["verl"], name
    for name in TRL_LOSS_TYPES:
        assert f"`{name}`" in column["trl"] or f'"{name}"' in column["trl"], name
