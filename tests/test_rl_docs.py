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
