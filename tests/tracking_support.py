"""Live-tensor tracking for the tests that bound single allocations (no ``[tokens, vocab]`` tensor, no
``[V, H]`` accumulator): `LargestAllocation`."""

from __future__ import annotations

from lmloss.profiling import LiveTensorTracker


class LargestAllocation(LiveTensorTracker):
    """`lmloss.profiling.LiveTensorTracker`, also remembering the largest single allocation (its `delta`, bytes)
    seen in the block as ``largest``."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def on_live_change(self, delta: int, op: str | None) -> None:
        self.largest = max(self.largest, delta)
