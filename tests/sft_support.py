"""What the `lmloss sft` command-line test modules share (their `small_runs` fixture is in conftest.py)."""

from __future__ import annotations

SMALL_DATA: list[str] = []  # ["--data", path]: set by the `small_runs` fixture
