"""Deterministic peak-memory measurement.

On CPU, `peak_memory()` follows every storage created inside the block (a `TorchDispatchMode` sees each
op's outputs; a weak reference on the storage sees it freed), so the figure is the exact sum of live tensor
bytes at the worst moment, independent of the allocator and repeatable run to run. On CUDA it reads the
caching allocator's `max_memory_allocated`. Both report bytes *above what was live when the block began*:
add the inputs' size for a total.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import traceback
import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MiB = 1024**2


@dataclasses.dataclass
class Allocation:
    """One storage alive at the peak: its size, the first tensor seen on it, and where it was made."""

    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    op: str
    stack: list[str]

    @property
    def site(self) -> str:
        """The innermost frame outside torch and this module: the line a user would look at."""
        return self.stack[-1] if self.stack else "<unknown>"


@dataclasses.dataclass
class PeakMemory:
    """Result of `peak_memory()`; filled in when the `with` block exits.

    `peak_bytes`: the most bytes allocated inside the block and alive at one time.
    `allocations`: with ``record=True`` (CPU), the storages of at least ``min_bytes`` alive at that
    moment, largest first.
    """

    device: str
    peak_bytes: int = 0
    allocations: list[Allocation] = dataclasses.field(default_factory=list)

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / MiB


def _user_stack(limit: int = 12) -> list[str]:
    frames = traceback.extract_stack()[:-3]
    keep = [
        f"{f.filename}:{f.lineno} in {f.name}"
        for f in frames
        if "/torch/" not in f.filename and not f.filename.endswith("profiling/memory.py")
    ]
    return keep[-limit:]


class LiveTensorTracker(TorchDispatchMode):
    """Counts the bytes of storages created while active; `peak` is the high-water mark.

    Storages are keyed by their data pointer so views are counted once; a storage's size is re-read
    whenever an op touches it again (``out=`` ops resize empty tensors).
    """

    def __init__(self, *, record: bool = False, min_bytes: int = MiB) -> None:
        super().__init__()
        self.record = record
        self.min_bytes = min_bytes
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._info: dict[int, Allocation] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()
        self.peak_allocations: list[Allocation] = []

    def on_live_change(self, delta: int, op: str | None) -> None:
        """Called after every change of `live` by `delta` bytes: by an allocation made by `op`, or by a
        free (``op is None``, from a weak-reference callback, so it must not raise). Override to watch."""

    def _freed(self, key: int) -> None:
        with self._lock:
            delta = -self._sizes.pop(key, 0)
            self.live += delta
            self._info.pop(key, None)
            self._refs.pop(key, None)
        if delta:
            self.on_live_change(delta, None)

    def _track(self, t: torch.Tensor, op: str) -> None:
        if t.device.type == "meta" or t.is_sparse:
            return
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        key = storage.data_ptr()
        if nbytes == 0 or key == 0:
            return
        with self._lock:
            old = self._sizes.get(key)
            if old is None:
                self._refs[key] = weakref.ref(storage, lambda _r, k=key: self._freed(k))
                if self.record and nbytes >= self.min_bytes:
                    self._info[key] = Allocation(nbytes, tuple(t.shape), str(t.dtype), op, _user_stack())
            elif old == nbytes:
                return
            self._sizes[key] = nbytes
            delta = nbytes - (old or 0)
            self.live += delta
            if self.live > self.peak:
                self.peak = self.live
                if self.record:
                    self.peak_allocations = sorted(self._info.values(), key=lambda a: -a.nbytes)
        self.on_live_change(delta, op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # An output on an input's storage (a view, an in-place or out= op) is no new allocation: counting
        # it would charge the block for tensors that existed before it began. Read the inputs' storages
        # before the call: an out= op that resizes an empty tensor moves it to a new (counted) storage.
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                key = t.untyped_storage().data_ptr()
                if key in inputs and key not in self._sizes:
                    continue
                self._track(t, str(func.overloadpacket.__name__))
        return out


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@contextlib.contextmanager
def peak_memory(
    device: torch.device | str | None = None, *, record: bool = False, min_bytes: int = MiB
) -> Iterator[PeakMemory]:
    """Measure the peak bytes allocated inside the block, above what was live at entry.

    Args:
        device: ``"cpu"`` (default) tracks live tensors exactly; a CUDA device uses the allocator's
            peak counter (reset at entry).
        record: CPU only — also keep the storages alive at the peak (shape, dtype, op, call site).
        min_bytes: with ``record``, smaller storages are counted but not listed.

    Example::

        with peak_memory() as mem:
            token_logprobs(logits, labels).sum().backward()
        print(f"{mem.peak_mib:.0f} MiB above the inputs")
    """
    device = _resolve_device(device)
    result = PeakMemory(device=str(device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            yield result
        finally:
            torch.cuda.synchronize(device)
            result.peak_bytes = torch.cuda.max_memory_allocated(device) - start
        return
    tracker = LiveTensorTracker(record=record, min_bytes=min_bytes)
    try:
        with tracker:
            yield result
    finally:
        result.peak_bytes = tracker.peak
        result.allocations = list(tracker.peak_allocations)
