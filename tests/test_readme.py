"""The README's API example runs as written (one-rank gloo groups stand in for the TP / DP x CP groups)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"

HARNESS = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    from lmloss.distributed import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    B, S, V, H = 2, 8, 100, 16
    tp = dist.new_group([0]); dp_cp_group = dist.new_group([0])
    logits = torch.randn(B, S, V, requires_grad=True); labels = torch.randint(0, V, (B, S))
    shard = torch.randn(B, S, 151_936); hidden = torch.randn(B, S, H, requires_grad=True)
    lm_head = torch.nn.Linear(H, V, bias=False); w_shard = torch.randn(V, H, requires_grad=True)
    advantages = torch.randn(B, S); local_logits, local_labels = logits, labels
    """
)


def test_readme_api_example_runs_as_written():
    code = re.search(r"## The API in ten lines\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    script = HARNESS + code + "\nassert torch.isfinite(loss) and w_shard.grad is not None\nprint('ok')\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")
