"""Memory measurement: `peak_memory()` for a block of code, `MemoryProfiler` for chosen training steps."""

from lmloss.profiling.memory import Allocation, LiveTensorTracker, PeakMemory, peak_memory

__all__ = ["Allocation", "LiveTensorTracker", "PeakMemory", "peak_memory"]
