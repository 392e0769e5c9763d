"""docs/preference.md: its python examples run in order, in one namespace, and print the output shown under
each (the TRL run included: a tiny model built offline)."""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from pathlib import Path

import pytest
import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "preference.md"

pytestmark = pytest.mark.usefixtures("one_thread")


def test_preference_doc_examples_print_the_output_shown(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    monkeypatch.chdir(tmp_path)
    text = DOC.read_text()
    pairs = re.findall(r"```python\n(.*?)```\s*```text\n(.*?)```", text, re.S)
    assert len(pairs) == 4 == text.count("```python")
    namespace = {"__name__": "preference_doc"}
    rng = torch.get_rng_state()
    try:
        for code, shown in pairs:
            out = io.StringIO()
            with contextlib.redirect_stdout(out), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exec(compile(code, str(DOC), "exec"), namespace)
            assert out.getvalue() == shown
    finally:
        torch.set_rng_state(rng)  # the examples seed the global generator
