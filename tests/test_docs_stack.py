"""docs/use_in_your_stack.md: every ```python block runs as written.

The blocks run one after another in one forked child of the test process (it inherits the imports of
torch, transformers and megatron-core, seconds each; spawned if this process holds a process group), each in a fresh namespace, and the FSDP2 block
with the environment ``torchrun --nproc_per_node 1`` would set.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import multiprocessing
import os
import re
import tempfile
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lmloss.distributed import free_port

DOC = Path(__file__).resolve().parents[1] / "docs" / "use_in_your_stack.md"


def _blocks() -> list[tuple[str, str]]:
    """(heading it sits under, code) for every python block of the page."""
    out, heading = [], "top"
    for part in re.split(r"(^## [^\n]*$|^```python\n.*?^```$)", DOC.read_text(), flags=re.S | re.M):
        if part.startswith("## "):
            heading = part[3:].strip()
        elif part.startswith("```python"):
            out.append((heading, part[len("```python\n") : -3]))
    return out


BLOCKS = _blocks()


def _shown() -> dict[str, str]:
    """code -> what the page shows it prints: a plain ``` block right after the python block, nothing between."""
    fences = list(re.finditer(r"^```(\w*)\n(.*?)^```$", DOC.read_text(), flags=re.S | re.M))
    return {
        block[2]: after[2]
        for block, after in zip(fences, fences[1:])
        if block[1] == "python" and after[1] == "" and after.start() == block.end() + 1
    }


SHOWN = _shown()


def _why_not_run(code: str) -> str | None:
    """Why this environment cannot run a block (an optional dependency is missing), or None."""
    if "megatron.core" in code and importlib.util.find_spec("megatron") is None:
        return "megatron-core is not installed (optional)"
    if "transformers" in code and importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (optional)"
    if "Trainer(" in code and importlib.util.find_spec("accelerate") is None:
        return "transformers.Trainer needs accelerate"
    for module in ("trl", "datasets", "tokenizers"):
        if f"import {module}" in code and importlib.util.find_spec(module) is None:
            return f"{module} is not installed (optional: the trl extra)"
    if _imports_verl(code) and importlib.util.find_spec("verl") is None:
        return "verl is not installed (optional: the verl extra; make venv installs it)"
    return None


def _imports_verl(code: str) -> bool:
    return bool(re.search(r"^(from|import) (verl\b|lmloss\.integrations\.verl)|integrations import verl", code, re.M))


def _run_blocks(codes: list[str], out_path: str) -> None:
    import faulthandler
    import sys

    import torch
    import torch.distributed as dist

    # A forked child must not enter the parent's OpenMP thread pool (it would wait forever for threads that
    # were not forked): one intra-op thread, as DataLoader workers do.
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(240, exit=True, file=sys.stderr)  # a stack instead of a silent hang
    torchrun_env = dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
    )  # fmt: skip
    if any(_imports_verl(code) for code in codes):
        # verl's modules, imported as the verl tests import them (ray stubbed where it is not installed): the
        # blocks' own imports of verl then find them loaded
        import verl_support

        verl_support.load_model_patch()
    results = []
    for i, code in enumerate(codes):
        # what `torchrun --nproc_per_node 1` sets, for the blocks written for torchrun only (with it set,
        # Trainer would start a process group of its own)
        launched = 'init_process_group("gloo")' in code
        if launched:
            os.environ.update(torchrun_env)
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(compile(code, f"<{DOC.name} block {i}>", "exec"), {"__name__": "__main__"})
            results.append({"error": None, "printed": printed.getvalue()})
        except BaseException:
            results.append({"error": traceback.format_exc()[-3000:], "printed": printed.getvalue()})
        finally:
            if launched:
                for key in torchrun_env:
                    os.environ.pop(key, None)
            if dist.is_initialized():  # a failed block may leave its group behind
                dist.destroy_process_group()
    Path(out_path).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def block_errors() -> dict[int, dict]:
    runnable = [i for i, (_, code) in enumerate(BLOCKS) if _why_not_run(code) is None]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "results.json")
        # Fork, unless this process holds a process group (another test may have started one): a forked
        # copy of live gloo state crashes; or CUDA is available: a forked child cannot run a backward once
        # this process has (autograd's device threads). Spawning costs the imports again, but always works.
        method = "spawn" if (dist.is_available() and dist.is_initialized()) or torch.cuda.is_available() else "fork"
        child = multiprocessing.get_context(method).Process(
            target=_run_blocks, args=([BLOCKS[i][1] for i in runnable], out_path)
        )
        child.start()
        child.join(timeout=280)
        if child.is_alive():
            child.kill()
            pytest.fail("the doc blocks did not finish in 280 s")
        assert child.exitcode == 0, f"the child running the doc blocks exited with {child.exitcode}"
        return dict(zip(runnable, json.loads(Path(out_path).read_text())))


def test_the_page_has_a_block_for_every_stack():
    headings = {h for h, _ in BLOCKS}
    assert len(BLOCKS) >= 6
    for stack in ("Hugging Face", "Trainer", "FSDP2", "RL scoring", "verl", "Megatron"):
        assert any(stack in h for h in headings), stack
    assert any("trl.SFTTrainer" in code for _, code in BLOCKS)  # TRL's SFTTrainer runs, not only described
    assert any(_imports_verl(code) and code in SHOWN for _, code in BLOCKS)  # the verl recipe, with its output


@pytest.mark.parametrize(
    "index", range(len(BLOCKS)), ids=[f"{i}-{h.split(':')[0]}" for i, (h, _) in enumerate(BLOCKS)]
)
def test_doc_block_runs_as_written(index, block_errors):
    heading, code = BLOCKS[index]
    reason = _why_not_run(code)
    if reason is not None:
        pytest.skip(reason)
    result = block_errors[index]
    assert result["error"] is None, f"block {index} under '{heading}' failed:\n{result['error']}"
    if code in SHOWN:  # the page shows what it prints: exactly that
        assert result["printed"] == SHOWN[code], f"block {index} under '{heading}' printed:\n{result['printed']}"
