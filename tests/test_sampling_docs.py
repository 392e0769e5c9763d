"""docs/sampling.md: its example runs as written and prints the output the page shows."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "sampling.md"

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_example_prints_what_the_page_shows():
    text = DOC.read_text()
    code, shown = re.search(r"```python\n(.*?)```\n```\n(.*?)```", text, flags=re.S).groups()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DOC), "exec"), {})
    assert out.getvalue() == shown
