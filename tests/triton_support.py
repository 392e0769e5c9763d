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
    return _many_without_interpreter([argv], cache_dir)[0]


def _many_without_interpreter(argvs: list[list[str]], cache_dir: Path) -> list:
    """`_without_interpreter` of each of `argvs`, the children running at once (each with its own cache
    below `cache_dir`): a compile is one core's work, and the machine has more than one."""
    import triton

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend")
    import lmloss

    src = str(Path(lmloss.__file__).resolve().parents[1])
    children = []
    for i, argv in enumerate(argvs):
        env = dict(
            os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(Path(cache_dir) / str(i)),
            TRITON_DEFAULT_FP_FUSION="1",
        )  # fmt: skip
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
        children.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True))  # fmt: skip
    results = []
    try:
        for child in children:
            out, err = child.communicate(timeout=300)
            assert child.returncode == 0, err[-3000:]
            results.append(json.loads(out))
    finally:
        for child in children:
            child.kill()
            child.wait()
    return results


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


def compile_many_for_h100(scripts: list[str], cache_dir: Path) -> list:
    """`compile_for_h100` of each script, in child processes running at once; their parsed JSON, in order."""
    return _many_without_interpreter([["-c", PREAMBLE + script] for script in scripts], cache_dir)
