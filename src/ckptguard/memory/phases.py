"""Phase records: one JSON line at each phase boundary, and a failure record when a phase raises.

Contract::

    rec = PhaseRecorder(RecorderConfig(path=Path("mem.jsonl"), rank=rank))
    with rec.phase(PhaseKind.SAVE, step=step, policy_version=v):
        save(...)

writes a ``phase_start`` line (monotonic time, node, rank, PID, policy version, host/ray/process/
GPU figures) and a ``phase_end`` line with the in-phase peak from a sampler running at 4 Hz or
faster. If the body raises, a ``phase_failure`` line replaces the end line: the phase, the first
failing call (the line of the phase body that raised) and where it was raised, the requested
bytes parsed from a CUDA OOM message, allocated/reserved/device-free, the host figures, the last
completed phase and the load-phase peak. The exception is always re-raised, unchanged.

While a recorder is open it is the process's active one: when the host staging pool of
``save_async`` is released (``close()``, or ``AsyncOptions.pool_idle_s`` without a save), the
release is measured and written as a ``host_cache_release`` record (``host_cache_released``),
naming the step of the last save phase this recorder ended.

Each line is written with one ``write`` to a file opened with O_APPEND and is on disk (page
cache) before the phase body runs, so a SIGKILL during the phase leaves its start record. Phases
may nest (generate contains wake). A boundary costs well under 2 ms (see
benchmarks/memory/overhead.py). Library code here never prints or logs.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import TracebackType
from typing import Any

from ..errors import ConfigError
from .gpu import parse_cuda_oom, read_gpu
from .host import HostProbe, hostname
from .process import read_process
from .ray import RayConfig, ray_figure
from .records import FORMAT_VERSION, RecordKind
from .sampler import Sampler, SamplerConfig, WindowPeak, self_rss

__all__ = ["PhaseKind", "PhaseRecorder", "RecorderConfig", "host_cache_released"]

_ACTIVE: list[weakref.ref[PhaseRecorder]] = []
"""The open recorders of this process, newest last; the newest one records host cache releases.
Weak: a recorder dropped without ``close()`` is not kept alive by this list."""


class PhaseKind(Enum):
    """The phases of an RL post-training step that docs/practices.md asks to record."""

    LOAD = "load"
    SAVE = "save"
    SLEEP = "sleep"
    WAKE = "wake"
    KV_RESET = "kv_reset"
    GENERATE = "generate"
    LOGPROB = "logprob"
    UPDATE = "update"
    WEIGHT_SYNC = "weight_sync"
    EXPORT = "export"


@dataclass(frozen=True, kw_only=True)
class RecorderConfig:
    """Where and how a PhaseRecorder writes."""

    path: Path
    """The JSONL file; appended to. One per rank, or one per node on a local filesystem."""
    rank: int = 0
    """Global rank written into every record."""
    node: str | None = None
    """Node name; None: the host name."""
    sample_hz: float = 4.0
    """In-phase sampling rate; at least 4 Hz."""
    probe_process: bool = True
    """Read this process's RSS split (/proc/self/status), threads and FDs at each boundary."""
    pss_every_s: float = 10.0
    """Read PSS (smaps_rollup) at a boundary only if the last read is this old. The page-table walk
    costs ~3 ms for a 300 MB torch process and more for a large one, which would break the 2 ms
    boundary budget; 0 reads it at every boundary. Growth floors come from ``mem watch`` anyway."""
    probe_gpu: bool = True
    """Read GPU allocator figures at each boundary (only if CUDA is already initialized)."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, Path):
            raise ConfigError(
                f"RecorderConfig.path must be a pathlib.Path, got {type(self.path).__name__}"
            )
        if self.rank < 0:
            raise ConfigError(f"RecorderConfig.rank must be >= 0, got {self.rank}")
        SamplerConfig(hz=self.sample_hz)  # same bounds, same message
        if self.pss_every_s < 0:
            raise ConfigError(
                f"RecorderConfig.pss_every_s must be >= 0 seconds, got {self.pss_every_s}"
            )


def _gpu_reader(name: str):  # type: ignore[no-untyped-def]
    def read() -> int | None:
        torch = sys.modules.get("torch")
        # Never the first CUDA call of a process: only read once someone else initialized it.
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        return int(getattr(torch.cuda, name)())

    return read


class PhaseRecorder:
    """Writes phase records; see the module docstring. Close it (or use ``with``) to stop
    sampling."""

    def __init__(
        self,
        config: RecorderConfig,
        *,
        host_probe: HostProbe | None = None,
        ray_config: RayConfig | None = None,
    ) -> None:
        self.config = config
        self._host = host_probe or HostProbe()
        self._ray = ray_config or RayConfig.from_env()
        self._node = config.node or hostname()
        self._pid = os.getpid()
        self._fd = os.open(config.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._write_lock = threading.Lock()
        readers = {
            "host_current": self._host.read_current,
            "process_rss": self_rss,
            "gpu_allocated": _gpu_reader("memory_allocated"),
            "gpu_reserved": _gpu_reader("memory_reserved"),
        }
        self._sampler = Sampler(readers, SamplerConfig(hz=config.sample_hz))
        self._last_pss_ns: int | None = None
        self.last_completed: dict[str, Any] | None = None
        self.load_peak: dict[str, Any] | None = None
        self.last_save: dict[str, Any] | None = None
        """The save phase this recorder ended last (step, mono_ns): what a host cache release
        follows."""
        _ACTIVE.append(weakref.ref(self))

    def phase(
        self, kind: PhaseKind | str, *, step: int | None = None, policy_version: Any = None
    ) -> _Phase:
        if not isinstance(kind, PhaseKind):
            try:
                kind = PhaseKind(kind)
            except ValueError:
                names = ", ".join(k.value for k in PhaseKind)
                raise ConfigError(f"unknown phase {kind!r}; use one of: {names}") from None
        return _Phase(self, kind, step, policy_version)

    def close(self) -> None:
        _ACTIVE[:] = [r for r in _ACTIVE if r() not in (None, self)]
        self._sampler.stop()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> PhaseRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- record building -------------------------------------------------------------------

    def _base(
        self, kind: RecordKind, phase: PhaseKind, step: int | None, policy_version: Any
    ) -> dict[str, Any]:
        return {
            "v": FORMAT_VERSION,
            "kind": kind.value,
            "mono_ns": time.monotonic_ns(),
            "wall_time": time.time(),
            "node": self._node,
            "rank": self.config.rank,
            "pid": self._pid,
            "phase": phase.value,
            "step": step,
            "policy_version": policy_version,
        }

    def _figures(self, rec: dict[str, Any]) -> dict[str, int | None]:
        host = self._host.read()
        rec["host"] = host.to_json()
        rec["ray"] = ray_figure(host, self._ray).to_json()
        proc = None
        if self.config.probe_process:
            now = rec["mono_ns"]
            due = (
                self._last_pss_ns is None
                or now - self._last_pss_ns >= self.config.pss_every_s * 1e9
            )
            proc = read_process("self", with_fds=True, with_pss=due)
            if due:
                self._last_pss_ns = now
        rec["process"] = proc.to_json() if proc else None
        gpu = read_gpu() if self.config.probe_gpu else None
        rec["gpu"] = gpu.to_json() if gpu else None
        return {
            "host_current": host.current,
            "process_rss": proc.rss if proc else self_rss(),
            "gpu_allocated": gpu.allocated if gpu else None,
            "gpu_reserved": gpu.reserved if gpu else None,
        }

    def _write(self, rec: dict[str, Any]) -> None:
        line = (json.dumps(rec, separators=(",", ":"), default=str) + "\n").encode()
        with self._write_lock:
            if self._fd < 0:
                raise ConfigError(f"PhaseRecorder for {self.config.path} is closed")
            os.write(self._fd, line)


def host_cache_released(
    released_bytes: int, how: str, *, pinned: bool, rss_before: int | None, rss_after: int | None
) -> bool:
    """Write a measured host staging release into the active recorder (module docstring); False when
    no recorder is open. ``rss_before``/``rss_after``: this process's RSS around the unmapping."""
    live = [r for r in (ref() for ref in _ACTIVE) if r is not None]
    if not live:
        return False
    rec = live[-1]
    save = rec.last_save
    record: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "kind": RecordKind.HOST_CACHE_RELEASE.value,
        "mono_ns": time.monotonic_ns(),
        "wall_time": time.time(),
        "node": rec._node,
        "rank": rec.config.rank,
        "pid": rec._pid,
        "step": save["step"] if save else None,
        "after_save_s": (time.monotonic_ns() - save["mono_ns"]) / 1e9 if save else None,
        "released_bytes": int(released_bytes),
        "how": how,
        "pinned": pinned,
        "rss_before": rss_before,
        "rss_after": rss_after,
        "rss_drop": rss_before - rss_after
        if rss_before is not None and rss_after is not None
        else None,
        "host": rec._host.read().to_json(),
    }
    missing = {}
    if save is None:
        missing["step"] = "this recorder ended no save phase before the release"
    if record["rss_drop"] is None:
        missing["rss_drop"] = "/proc/self/statm could not be read"
    if missing:
        record["not_obtained"] = missing
    rec._write(record)
    return True


def _peak_json(peak: WindowPeak) -> dict[str, Any]:
    return {**peak.peaks, "samples": peak.samples}


def _frame_text(fs: traceback.FrameSummary) -> str:
    return f"{fs.filename}:{fs.lineno} in {fs.name}: {(fs.line or '').strip()}"


class _Phase:
    def __init__(
        self, rec: PhaseRecorder, kind: PhaseKind, step: int | None, policy_version: Any
    ) -> None:
        self._rec, self._kind, self._step, self._pv = rec, kind, step, policy_version

    def __enter__(self) -> _Phase:
        rec = self._rec
        record = rec._base(RecordKind.PHASE_START, self._kind, self._step, self._pv)
        seed = rec._figures(record)
        rec._write(record)
        rec._sampler.start()
        self._token = rec._sampler.open_window(seed)
        self._t0 = record["mono_ns"]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        rec = self._rec
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            exc = None  # a clean sys.exit() inside a phase ends it; it is not a failure
        kind = RecordKind.PHASE_END if exc is None else RecordKind.PHASE_FAILURE
        record = rec._base(kind, self._kind, self._step, self._pv)
        final = rec._figures(record)
        peak = rec._sampler.close_window(self._token, final)
        record["duration_s"] = (record["mono_ns"] - self._t0) / 1e9
        record["peak"] = _peak_json(peak)
        if exc is None:
            rec._write(record)
            rec.last_completed = {
                "phase": self._kind.value,
                "step": self._step,
                "mono_ns": record["mono_ns"],
            }
            if self._kind is PhaseKind.LOAD:
                rec.load_peak = {**record["peak"], "step": self._step}
            if self._kind is PhaseKind.SAVE:
                rec.last_save = {"step": self._step, "mono_ns": record["mono_ns"]}
            return
        record.update(_failure_fields(exc, tb, record.get("gpu")))
        record["last_completed"] = rec.last_completed
        record["load_peak"] = rec.load_peak
        if rec.last_completed is None:
            record.setdefault("not_obtained", {})["last_completed"] = (
                "no phase completed before this one"
            )
        if rec.load_peak is None:
            record.setdefault("not_obtained", {})["load_peak"] = (
                "no load phase was recorded by this recorder"
            )
        rec._write(record)


def _failure_fields(
    exc: BaseException, tb: TracebackType | None, gpu: dict[str, Any] | None
) -> dict[str, Any]:
    frames = traceback.extract_tb(tb) if tb is not None else []
    message = str(exc)
    oom = (
        parse_cuda_oom(message)
        if "CUDA" in message or type(exc).__name__ == "OutOfMemoryError"
        else None
    )
    gpu = gpu or {}
    missing: dict[str, str] = {}

    def pick(name: str, from_oom: int | None) -> int | None:
        value = gpu.get(name)
        if value is None:
            value = from_oom
        if value is None:
            missing[name] = (gpu.get("not_obtained") or {}).get(
                name, "not in the GPU probe nor the error message"
            )
        return value

    out = {
        "error": {
            "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": message[:4000],
            "failing_call": _frame_text(frames[0]) if frames else None,
            "raised_at": _frame_text(frames[-1]) if frames else None,
        },
        "cuda_oom": oom.to_json() if oom else None,
        "requested_bytes": oom.requested if oom else None,
        "allocated": pick("allocated", oom.allocated if oom else None),
        "reserved": pick("reserved", None),
        "device_free": pick("device_free", oom.device_free if oom else None),
    }
    if out["requested_bytes"] is None:
        missing["requested_bytes"] = (
            "the error is not a CUDA OOM message" if oom is None else "not in the message"
        )
    out["not_obtained"] = missing
    return out
