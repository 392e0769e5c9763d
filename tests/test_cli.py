"""The `lmloss` command itself: --version, and no torch warning about a missing numpy (the core install)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import lmloss
from lmloss.cli import main

SRC = str(Path(lmloss.__file__).resolve().parents[1])


def test_version_prints_lmloss_torch_and_triton_versions(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"lmloss {lmloss.__version__} (torch {torch.__version__}, triton ")
    assert out.endswith(")\n") and len(out.splitlines()) == 1


def test_without_numpy_the_command_and_the_processes_it_starts_print_no_numpy_warning(tmp_path):
    # numpy made unimportable, as on the core install (torch then warns when imported); a stand-in subcommand
    # starts a child process that imports torch, as `lmloss sft --nproc` does. Both check that numpy is
    # really blocked, so that a quiet stderr means the warning was silenced, not never raised.
    blocker = tmp_path / "numpy"
    blocker.mkdir()
    (blocker / "__init__.py").write_text('raise ModuleNotFoundError("No module named numpy", name="numpy")\n')
    blocked = f"import importlib.util as u; assert u.find_spec('numpy').origin.startswith({str(tmp_path)!r})"
    (tmp_path / "fake_subcommand.py").write_text(
        textwrap.dedent(f"""
        import subprocess, sys

        def run(args):
            {blocked}
            subprocess.run([sys.executable, "-c", "import torch; {blocked}; print('child ran')"], check=True)
            return 0

        def register(subparsers):
            subparsers.add_parser("spawn").set_defaults(func=run)
    """)
    )
    script = "import sys, lmloss.cli as cli; cli.SUBCOMMAND_MODULES = ('fake_subcommand',); sys.exit(cli.main(['spawn']))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), SRC])}
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "child ran\n"
    assert proc.stderr == "", proc.stderr
