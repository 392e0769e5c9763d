"""`lmloss bench`: forward+backward time and peak memory of lmloss against naive PyTorch and peers.

Layers: `impls` (workloads, inputs, implementations and peer adapters), `runner` (the sweep: memory,
check, timing, out-of-memory), `report` (table, JSON, CSV), `plots` (PNG), `cli` (the subcommand).
"""

from lmloss.bench.runner import Result, SweepConfig, run_sweep

__all__ = ["Result", "SweepConfig", "run_sweep"]
