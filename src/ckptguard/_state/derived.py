"""Derived state: caches computed from parameters, invalidated on restore and on update.

Contract: every cache built from parameters (quantization scales, packed or fused
weights, version markers) is registered once with its invalidation callback. The
parameter version rises on ``mark_restored()`` (the manager calls it after a restore)
and on ``mark_updated()`` (the trainer calls it after each optimizer step); both run
the same invalidation path. A cache stamped with an older version raises in ``check``
when checks are on. This is the derived-state chain of docs/practices.md (5, pitfall 13): files
restored correctly, but the first export used scales built from the initial weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ConfigError, StaleDerivedStateError

log = logging.getLogger("ckptguard")


@dataclass
class _Entry:
    invalidate: Callable[[], None]
    invalidations: int = 0


class DerivedState:
    """The registry of parameter-derived caches of one process."""

    def __init__(self, *, checks: bool = True) -> None:
        self.checks = checks
        self.version = 0
        self._entries: dict[str, _Entry] = {}
        self.history: list[tuple[int, str]] = []  # (version, reason) of every bump

    def register(self, name: str, invalidate: Callable[[], None]) -> None:
        """Register a cache once, with the callback that drops or rebuilds it."""
        if name in self._entries:
            raise ConfigError(
                f"derived state {name!r} is already registered; register each cache once"
            )
        if not callable(invalidate):
            raise ConfigError(f"derived state {name!r}: invalidate must be callable")
        self._entries[name] = _Entry(invalidate)

    def stamp(self) -> int:
        """The version a cache built now belongs to; store it with the cache."""
        return self.version

    def check(self, name: str, built_for: int) -> None:
        """Raise if the cache ``name`` was built for an older parameter version."""
        if name not in self._entries:
            raise ConfigError(f"derived state {name!r} is not registered; register it before use")
        if self.checks and built_for != self.version:
            raise StaleDerivedStateError(
                f"derived state {name!r} was built for parameter version {built_for}, but the "
                f"parameters are at version {self.version} (last change: "
                f"{self.history[-1][1] if self.history else 'none'}). Its invalidation callback "
                f"did not rebuild it: fix the callback, do not wait a step for it to recover."
            )

    def mark_updated(self) -> int:
        """Call after every optimizer step."""
        return self._bump("update")

    def mark_restored(self, step: int | None = None) -> int:
        """Called by the manager after a restore; the same path as an update."""
        return self._bump(f"restore of step {step}" if step is not None else "restore")

    def invalidations(self, name: str) -> int:
        return self._entries[name].invalidations

    def _bump(self, reason: str) -> int:
        self.version += 1
        self.history.append((self.version, reason))
        for name, entry in self._entries.items():
            entry.invalidate()
            entry.invalidations += 1
            log.debug(
                "ckptguard: invalidated derived state %s (%s, version %d)",
                name,
                reason,
                self.version,
            )
        return self.version
