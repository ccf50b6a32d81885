"""A background sampler that keeps the peak of a few cheap readings per open window.

Contract: ``Sampler`` polls each reader every ``1/hz`` seconds on one daemon thread and folds the
value into every open window. A phase opens a window at its start and closes it at its end; the
window's peak is the maximum over the boundary readings and every sample in between, so a phase
shorter than one period still has a peak (its boundary readings). A reader that returns None
(source not obtained) leaves that figure None in the window rather than 0.

The sampler runs at 4 Hz or faster because Ray's monitor polls every 250 ms and a save spike
that lasts less than a second was missed by 1 Hz system metrics (verl #1964). Readers must be
cheap (one small file); a full smaps walk does not belong here.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

__all__ = ["Sampler", "SamplerConfig", "WindowPeak", "self_rss"]

Reader = Callable[[], "int | None"]


@dataclass(frozen=True, kw_only=True)
class SamplerConfig:
    """How often to sample."""

    hz: float = 4.0
    """Samples per second; at least 4 (Ray's monitor polls at 4 Hz), at most 1000."""

    def __post_init__(self) -> None:
        if not (4.0 <= self.hz <= 1000.0):
            raise ConfigError(
                f"SamplerConfig.hz must be in [4, 1000] (Ray polls at 4 Hz), got {self.hz}"
            )


@dataclass(frozen=True)
class WindowPeak:
    """Peaks of one window: per reader, the max seen (None if never obtained), and the sample
    count."""

    peaks: dict[str, int | None]
    samples: int


class Sampler:
    """Polls ``readers`` on a daemon thread; use as a context manager or start()/stop()."""

    def __init__(self, readers: Mapping[str, Reader], config: SamplerConfig | None = None) -> None:
        self.config = config or SamplerConfig()
        self._readers = dict(readers)
        self._lock = threading.Lock()
        self._windows: dict[int, tuple[dict[str, int | None], list[int]]] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples_taken = 0

    def start(self) -> Sampler:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name="ckptguard-mem-sampler", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def read_all(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for name, read in self._readers.items():
            try:
                out[name] = read()
            except OSError:
                out[name] = None
        return out

    def open_window(self, seed: Mapping[str, int | None] | None = None) -> int:
        """Start tracking peaks; ``seed`` is the boundary reading (read now if not given)."""
        values = dict(seed) if seed is not None else self.read_all()
        token = next(self._ids)
        with self._lock:
            # A boundary reading of a nested phase is a sample of every enclosing phase too.
            for peaks, count in self._windows.values():
                _fold(peaks, values)
                count[0] += 1
            self._windows[token] = ({k: values.get(k) for k in self._readers}, [1])
        return token

    def close_window(self, token: int, final: Mapping[str, int | None] | None = None) -> WindowPeak:
        """Stop tracking; ``final`` (the end boundary reading) is folded in first."""
        values = dict(final) if final is not None else self.read_all()
        with self._lock:
            peaks, count = self._windows.pop(token)
            for other, other_count in self._windows.values():
                _fold(other, values)
                other_count[0] += 1
        _fold(peaks, values)
        return WindowPeak(peaks, count[0] + 1)

    def _run(self) -> None:
        period = 1.0 / self.config.hz
        while not self._stop.wait(period):
            values = self.read_all()
            self.samples_taken += 1
            with self._lock:
                for peaks, count in self._windows.values():
                    _fold(peaks, values)
                    count[0] += 1


def _fold(peaks: dict[str, int | None], values: Mapping[str, int | None]) -> None:
    for name, value in values.items():
        if value is None:
            continue
        old = peaks.get(name)
        peaks[name] = value if old is None else max(old, value)


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def self_rss(proc_root: Path = Path("/proc")) -> int | None:
    """This process's RSS from /proc/self/statm: one read, cheap enough for the sampler."""
    try:
        with open(proc_root / "self" / "statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None
