"""Compile lmloss's Triton kernels ahead of time for an H100 (sm_90) without a GPU, in a child process.

The test process runs Triton's interpreter (TRITON_INTERPRET=1 is read once, at import), so the compile
happens in a fresh interpreter with it off and a private cache. Used by the kernel test modules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PREAMBLE = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lmloss.kernels import triton_kernels as tk
"""


def compile_for_h100(script: str, cache_dir: Path):
    """Run ``PREAMBLE + script`` (which prints JSON) in a child process; return the parsed JSON."""
    import triton

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend")
    import lmloss

    src = str(Path(lmloss.__file__).resolve().parents[1])
    env = dict(
        os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(cache_dir), TRITON_DEFAULT_FP_FUSION="1"
    )
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", PREAMBLE + script], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)
