"""`MemoryProfiler`: a memory snapshot per rank for chosen training steps.

On CUDA it turns on PyTorch's allocation history for the step and dumps it with
``torch.cuda.memory._dump_snapshot`` (open the pickle at pytorch.org/memory_viz, or summarize it with
``lmloss memory-report``). On a machine without CUDA it does not fail: it follows the step's live tensors
(`LiveTensorTracker`) and writes a JSON report of the same name with the peak, the largest tensors alive at
the peak and a timeline of live bytes.

Files: ``out_dir/step_{N}/rank{R}_pp{P}_dp{D}_cp{C}_tp{T}.pickle`` (CUDA) or ``.json`` (CPU), where R is
the global rank and P/D/C/T the rank's pipeline / data / context / tensor-parallel coordinates.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from lmloss.profiling.memory import LiveTensorTracker

#: ``stacks`` values: the two that ``torch.cuda.memory._record_memory_history(stacks=...)`` accepts
#: ("python": Python frames; "all": also C++ frames), and "none" for no tracebacks at all (``context=None``).
STACKS_MODES = ("python", "all", "none")

#: Parallel coordinates in file names, in order, with the Megatron ``parallel_state`` getter of each.
COORDS = (
    ("pp", "get_pipeline_model_parallel_rank"),
    ("dp", "get_data_parallel_rank"),
    ("cp", "get_context_parallel_rank"),
    ("tp", "get_tensor_model_parallel_rank"),
)

CPU_REPORT_FORMAT = "lmloss-cpu-memory-report"

#: Default `MemoryProfilerConfig.min_bytes`: small enough that a small model's activations are listed, large
#: enough that the tracker does not record a call stack for every scalar (each listed tensor costs one).
DEFAULT_MIN_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class MemoryProfilerConfig:
    """Which steps and ranks to snapshot, and how much history to keep.

    profile_steps: global step numbers (>= 0) to record.
    max_entries: most allocation events kept (CUDA: the history ring buffer; CPU: timeline points). The
        most recent ones are kept.
    ranks: global ranks that record; None means every rank.
    stacks: ``"python"`` (Python frames), ``"all"`` (also C++ frames, CUDA only), ``"none"`` (no tracebacks).
    min_bytes: CPU reports list the tensors of at least this many bytes alive at the peak (smaller ones are
        counted in the peak, not listed; the report says how many bytes that leaves out). 0 lists every
        tensor, at the cost of a call stack recorded per allocation. CUDA snapshots record every block.
    """

    profile_steps: tuple[int, ...] = (0, 1)
    max_entries: int = 100_000
    ranks: tuple[int, ...] | None = None
    stacks: str = "python"
    min_bytes: int = DEFAULT_MIN_BYTES

    def __post_init__(self) -> None:
        steps = tuple(self.profile_steps)
        if any(not isinstance(s, int) or isinstance(s, bool) for s in steps):
            raise ValueError(f"profile_steps must be integers, got {self.profile_steps!r}")
        if any(s < 0 for s in steps):
            raise ValueError(f"profile_steps must be >= 0, got {self.profile_steps!r}")
        object.__setattr__(self, "profile_steps", steps)
        if (
            not isinstance(self.max_entries, int)
            or isinstance(self.max_entries, bool)
            or self.max_entries <= 0
        ):
            raise ValueError(f"max_entries must be a positive integer, got {self.max_entries!r}")
        if self.ranks is not None:
            ranks = tuple(self.ranks)
            if any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in ranks):
                raise ValueError(f"ranks must be non-negative integers or None, got {self.ranks!r}")
            object.__setattr__(self, "ranks", ranks)
        if self.stacks not in STACKS_MODES:
            raise ValueError(f"stacks must be one of {', '.join(STACKS_MODES)}, got {self.stacks!r}")
        _check_min_bytes(self.min_bytes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryProfilerConfig:
        """Build from a mapping (e.g. a section of a training config); unknown keys are an error."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(
                f"unknown memory profiler option(s): {', '.join(unknown)}; known: {', '.join(sorted(fields))}"
            )
        kwargs = dict(data)
        for key in ("profile_steps", "ranks"):
            if kwargs.get(key) is not None:
                value = kwargs[key]
                kwargs[key] = (value,) if isinstance(value, int) else tuple(value)
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str | Path, key: str | None = None) -> MemoryProfilerConfig:
        """Read a YAML file; with `key`, the mapping under that top-level key (e.g. ``memory_profile``)."""
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        if key is not None:
            data = data.get(key) or {}
        if not isinstance(data, Mapping):
            raise ValueError(
                f"{path}: expected a mapping of memory profiler options, got {type(data).__name__}"
            )
        return cls.from_dict(data)


def _check_min_bytes(value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"min_bytes must be a non-negative integer (bytes), got {value!r}")


def resolve_coords(coords: Mapping[str, int] | Any | None) -> dict[str, int]:
    """``{"pp", "dp", "cp", "tp"}`` from a dict, or an object with Megatron-style getters; missing -> 0."""
    out = {}
    for name, getter in COORDS:
        value = 0
        if isinstance(coords, Mapping):
            value = coords.get(name, 0)
        elif coords is not None and callable(getattr(coords, getter, None)):
            try:
                value = getattr(coords, getter)()
            except Exception:  # Megatron asserts when that group was never initialized
                value = 0
        out[name] = int(value or 0)
    return out


def snapshot_name(rank: int, coords: Mapping[str, int], suffix: str) -> str:
    return f"rank{rank}_pp{coords['pp']}_dp{coords['dp']}_cp{coords['cp']}_tp{coords['tp']}{suffix}"


class _TimelineTracker(LiveTensorTracker):
    """`LiveTensorTracker` that also keeps ``(event, live bytes)`` after each allocation and free."""

    def __init__(self, max_entries: int, min_bytes: int) -> None:
        super().__init__(record=True, min_bytes=min_bytes)
        self.events = 0
        self.timeline: collections.deque[tuple[int, int]] = collections.deque(maxlen=max_entries)

    def on_live_change(self, delta: int, op: str | None) -> None:
        if delta:
            self.events += 1
            self.timeline.append((self.events, self.live))


class MemoryProfiler:
    """Snapshot memory during chosen steps, one file per rank.

    Example::

        profiler = MemoryProfiler(MemoryProfilerConfig(profile_steps=(1,)), "runs/mem", coords=parallel_state)
        for step, batch in enumerate(loader):
            with profiler.step(step):
                loss = model(batch).loss
                loss.backward()

    Args:
        config: steps, ranks, history size and stack mode.
        out_dir: where ``step_{N}/`` folders are written.
        coords: this rank's parallel coordinates: a dict with any of ``pp``, ``dp``, ``cp``, ``tp``, or an
            object with Megatron ``parallel_state``'s getters (``get_pipeline_model_parallel_rank()``...).
            Missing ones are 0.
        rank: global rank; default ``torch.distributed.get_rank()`` when initialized, else 0.
        device: ``"cuda"`` to record the allocator's history, ``"cpu"`` to track live tensors; default CUDA
            when available.
        min_bytes: overrides ``config.min_bytes`` (CPU reports list the tensors of at least this size alive
            at the peak); default: the config's.
    """

    def __init__(
        self,
        config: MemoryProfilerConfig,
        out_dir: str | Path,
        coords: Mapping[str, int] | Any | None = None,
        *,
        rank: int | None = None,
        device: str | torch.device | None = None,
        min_bytes: int | None = None,
    ) -> None:
        self.config = config
        self.out_dir = Path(out_dir)
        self.coords = resolve_coords(coords)
        if rank is None:
            dist = torch.distributed
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = int(rank)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if min_bytes is not None:
            _check_min_bytes(min_bytes)
        self.min_bytes = config.min_bytes if min_bytes is None else min_bytes

    def enabled_for(self, global_step: int) -> bool:
        """Whether this rank records `global_step`."""
        ranks = self.config.ranks
        return global_step in self.config.profile_steps and (ranks is None or self.rank in ranks)

    def path_for(self, global_step: int) -> Path:
        suffix = ".pickle" if self.device.type == "cuda" else ".json"
        return self.out_dir / f"step_{global_step}" / snapshot_name(self.rank, self.coords, suffix)

    @contextlib.contextmanager
    def step(self, global_step: int) -> Iterator[Path | None]:
        """Record the block when `global_step` is profiled on this rank; yields the file it will write, or
        None. The file is written when the block ends, also when it ends with an exception (an OOM is
        what one most wants a snapshot of); the exception then propagates.
        """
        if not self.enabled_for(global_step):
            yield None
            return
        path = self.path_for(global_step)
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.device.type == "cuda":
            with self._record_cuda(path):
                yield path
        else:
            with self._record_cpu(path, global_step):
                yield path

    @contextlib.contextmanager
    def _record_cuda(self, path: Path) -> Iterator[None]:
        mem = torch.cuda.memory
        context = None if self.config.stacks == "none" else "all"
        stacks = "python" if self.config.stacks == "none" else self.config.stacks
        mem._record_memory_history(
            enabled="all",
            context=context,
            stacks=stacks,
            max_entries=self.config.max_entries,
            device=self.device,
        )
        try:
            yield
        finally:
            try:
                mem._dump_snapshot(str(path))
            finally:
                mem._record_memory_history(enabled=None, device=self.device)

    @contextlib.contextmanager
    def _record_cpu(self, path: Path, global_step: int) -> Iterator[None]:
        tracker = _TimelineTracker(self.config.max_entries, self.min_bytes)
        start = time.time()
        try:
            with tracker:
                yield
        finally:
            report = {
                "format": CPU_REPORT_FORMAT,
                "version": 1,
                "step": global_step,
                "rank": self.rank,
                "coords": self.coords,
                "device": str(self.device),
                "seconds": round(time.time() - start, 6),
                "peak_bytes": tracker.peak,
                "min_bytes": self.min_bytes,
                "top_allocations": [
                    {
                        "nbytes": a.nbytes,
                        "shape": list(a.shape),
                        "dtype": a.dtype,
                        "op": a.op,
                        "site": a.site,
                        "stack": [] if self.config.stacks == "none" else list(a.stack),
                    }
                    for a in tracker.peak_allocations
                ],
                "timeline": [list(p) for p in tracker.timeline],
                "timeline_dropped": tracker.events - len(tracker.timeline),
            }
            path.write_text(json.dumps(report, indent=1) + "\n")
