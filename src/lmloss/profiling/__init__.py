"""Memory measurement: `peak_memory()` for a block of code, `MemoryProfiler` for chosen training steps."""

from lmloss.profiling.memory import Allocation, LiveTensorTracker, PeakMemory, peak_memory
from lmloss.profiling.profiler import MemoryProfiler, MemoryProfilerConfig

__all__ = [
    "Allocation",
    "LiveTensorTracker",
    "MemoryProfiler",
    "MemoryProfilerConfig",
    "PeakMemory",
    "peak_memory",
]
