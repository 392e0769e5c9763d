"""What the Triton kernel test modules share: where their tensors live, and the static sm_90 report
(`lmloss.kernels.report`) run without a GPU.

The test process runs Triton's interpreter (TRITON_INTERPRET=1 is read once, at import), so the compile
happens in a child process with it off and a private cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def kernel_test_device() -> str:
    """``"cpu"`` under the interpreter, ``"cuda"`` with it off and a GPU; else the calling module is skipped."""
    import torch

    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("TRITON_INTERPRET is off and there is no GPU", allow_module_level=True)


def _without_interpreter(argv: list[str], cache_dir: Path):
    """``python *argv`` in a child process with the interpreter off and a private Triton cache; the JSON
    it prints, parsed. Skips the calling test where this triton has no NVIDIA backend."""
    import triton

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend")
    import lmloss

    src = str(Path(lmloss.__file__).resolve().parents[1])
    env = dict(
        os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(cache_dir), TRITON_DEFAULT_FP_FUSION="1"
    )
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def report_for_h100(args: list[str], cache_dir: Path) -> list[dict]:
    """``python -m lmloss.kernels.report --json *args`` without the interpreter: the rows it prints."""
    return _without_interpreter(["-m", "lmloss.kernels.report", "--json", *args], cache_dir)


#: What a `compile_for_h100` script may use without importing it.
PREAMBLE = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
"""


def compile_for_h100(script: str, cache_dir: Path):
    """Run ``PREAMBLE + script`` (which prints JSON) without the interpreter; return the parsed JSON."""
    return _without_interpreter(["-c", PREAMBLE + script], cache_dir)
