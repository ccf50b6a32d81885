"""GPU allocator figures, the pinned host allocator's stats, and CUDA OOM messages.

Contract: ``read_gpu()`` never initializes CUDA. If torch is not imported, CUDA is not
available, or this process has not initialized CUDA yet, every figure is None with that reason:
creating a CUDA context from a probe would take ~500 MiB of device memory in a process (a data
loader worker, a forked rank) that was never meant to hold one. ``mem_get_info`` is global
(all processes on the device); ``memory_stats`` is this process's caching allocator only.

``host_memory_stats`` key names changed in late 2025; ``pinned_figures`` reads both schemas:
older ``allocated_bytes``/``reserved_bytes``/``segment``, newer ``allocated_bytes`` (rounded
bytes owned) and ``active_bytes`` (checked out to callers). Cached idle pinned bytes are
``allocated - active`` in the newer schema and not obtainable in the older one.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CudaOomInfo", "GpuSnapshot", "parse_cuda_oom", "pinned_figures", "read_gpu"]


@dataclass(frozen=True, kw_only=True)
class GpuSnapshot:
    """One device as seen by this process; bytes, None when not obtained."""

    device: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    active: int | None = None
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    device_free: int | None = None
    device_total: int | None = None
    pinned_allocated: int | None = None
    pinned_active: int | None = None
    pinned_cached: int | None = None
    pinned_schema: str | None = None
    not_obtained: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GpuSnapshot:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


_ALL = (
    "allocated",
    "reserved",
    "active",
    "peak_allocated",
    "peak_reserved",
    "num_alloc_retries",
    "num_ooms",
    "device_free",
    "device_total",
    "pinned_allocated",
    "pinned_active",
    "pinned_cached",
)


def _unobtained(reason: str, device: int | None = None) -> GpuSnapshot:
    return GpuSnapshot(device=device, not_obtained={name: reason for name in _ALL})


def read_gpu(device: int | None = None) -> GpuSnapshot:
    """Allocator and device figures for ``device`` (default: current), without initializing CUDA."""
    torch = sys.modules.get("torch")
    if torch is None:
        return _unobtained("torch is not imported in this process")
    cuda = torch.cuda
    if not cuda.is_available():
        return _unobtained("CUDA is not available")
    if not cuda.is_initialized():
        return _unobtained(
            "CUDA is not initialized in this process (the probe does not create a context)"
        )
    dev = cuda.current_device() if device is None else device
    missing: dict[str, str] = {}
    values: dict[str, Any] = {}
    try:
        stats = cuda.memory_stats(dev)
    except RuntimeError as exc:
        stats = {}
        missing["memory_stats"] = f"torch.cuda.memory_stats failed: {exc}"
    for name, key in (
        ("allocated", "allocated_bytes.all.current"),
        ("reserved", "reserved_bytes.all.current"),
        ("active", "active_bytes.all.current"),
        ("peak_allocated", "allocated_bytes.all.peak"),
        ("peak_reserved", "reserved_bytes.all.peak"),
        ("num_alloc_retries", "num_alloc_retries"),
        ("num_ooms", "num_ooms"),
    ):
        values[name] = stats.get(key)
        if values[name] is None:
            missing[name] = (
                f"memory_stats has no {key!r} (cudaMallocAsync backend, or not yet allocated)"
            )
    try:
        free, total = cuda.mem_get_info(dev)
        values["device_free"], values["device_total"] = int(free), int(total)
    except RuntimeError as exc:
        missing["device_free"] = missing["device_total"] = f"mem_get_info failed: {exc}"
    host_stats = getattr(cuda, "host_memory_stats", None)
    if host_stats is None:
        for name in ("pinned_allocated", "pinned_active", "pinned_cached"):
            missing[name] = (
                "torch.cuda.host_memory_stats does not exist in this torch (added in 2.8)"
            )
    else:
        pin = pinned_figures(host_stats())
        values.update({k: v for k, v in pin.items() if k != "not_obtained"})
        missing.update(pin["not_obtained"])
    return GpuSnapshot(device=dev, not_obtained=missing, **values)


def pinned_figures(stats: Mapping[str, Any]) -> dict[str, Any]:
    """Pinned host allocator bytes from ``host_memory_stats()`` in either key schema."""
    missing: dict[str, str] = {}
    allocated = stats.get("allocated_bytes.current")
    active = stats.get("active_bytes.current")
    if active is not None or "allocations.current" in stats:
        schema = "new"
    elif "reserved_bytes.current" in stats or "segment.current" in stats:
        schema = "old"
        # Old schema: reserved = what the allocator holds from CUDA, allocated = handed out.
        active = allocated
        allocated = stats.get("reserved_bytes.current", allocated)
    else:
        schema = None
    if allocated is None:
        missing["pinned_allocated"] = "host_memory_stats has no allocated/reserved bytes key"
    if active is None:
        missing["pinned_active"] = "host_memory_stats has no active bytes key"
    cached = allocated - active if allocated is not None and active is not None else None
    if cached is None:
        missing["pinned_cached"] = "needs both owned and active pinned bytes"
    return {
        "pinned_allocated": allocated,
        "pinned_active": active,
        "pinned_cached": cached,
        "pinned_schema": schema,
        "not_obtained": missing,
    }


_UNITS = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIZE = r"(\d+(?:\.\d+)?) (bytes|B|KiB|MiB|GiB|TiB)"


@dataclass(frozen=True)
class CudaOomInfo:
    """Figures printed in a CUDA caching-allocator OOM message.

    The message prints sizes with two decimals, so every byte figure is exact only to within
    0.5% of its unit; ``None`` where the message did not contain the field.
    """

    requested: int | None = None
    device: int | None = None
    device_total: int | None = None
    device_free: int | None = None
    process_in_use: int | None = None
    allocated: int | None = None
    reserved_unallocated: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _size(m: re.Match[str] | None, group: int = 1) -> int | None:
    if m is None:
        return None
    return round(float(m.group(group)) * _UNITS[m.group(group + 1)])


def parse_cuda_oom(message: str) -> CudaOomInfo | None:
    """Parse ``torch.OutOfMemoryError``'s text; None if it is not a CUDA OOM message."""
    if "out of memory" not in message.lower():
        return None
    dev = re.search(
        r"GPU (\d+) has a total capacity of " + _SIZE + r" of which " + _SIZE + " is free", message
    )
    in_use = re.search(r"(?:this process|Process \d+) has " + _SIZE + " memory in use", message)
    return CudaOomInfo(
        requested=_size(re.search(r"Tried to allocate " + _SIZE, message)),
        device=int(dev.group(1)) if dev else None,
        device_total=_size(dev, 2) if dev else None,
        device_free=_size(dev, 4) if dev else None,
        process_in_use=_size(in_use),
        allocated=_size(re.search(_SIZE + " is allocated by PyTorch", message)),
        reserved_unallocated=_size(
            re.search(_SIZE + " is reserved by PyTorch but unallocated", message)
        ),
    )
