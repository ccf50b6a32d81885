"""Healthy steps only, and how much each committed step is trusted.

Contract (docs/practices.md, 7): a step is **unhealthy** when, on any
rank, its ``loss`` or ``grad_norm`` is not finite (taken from the ``save`` arguments, else from
this rank's ``record_step`` record of the same step), when ``save(..., healthy=False)`` was
passed, or when the policy's ``check`` returns False. An unhealthy step is never committed:
every rank learns the verdict of every rank at one agreement, so one rank's NaN skips the save
on all of them, nothing is written and the tracker stays.

Every committed step carries a trust state, kept outside the (immutable) step directory in the
sidecar ``ROOT/trust.json``, written atomically by rank 0 after the ranks agreed:

- ``candidate``: at commit;
- ``verified``: once ``verify_after`` (N) distinct later steps of the same run were healthy on
  every rank before any later step was found unhealthy. A later step counts when this run
  recorded it (``record_step`` with finite loss and grad norm, passing the check) or saved it
  healthily; "the same run" means this process's trajectory: the step it restored and the older
  ones, and the steps it committed itself (a step of a trajectory abandoned by a rollback is
  never verified by the new one's steps). The evidence reaches rank 0 at the next save (or
  skipped save), where every rank ships the steps it saw since the previous one.
- A candidate followed by an unhealthy step before it was verified stays a candidate for good
  (its ``unhealthy_after`` names that step): the state that produced the NaN may be in it.

A committed step without an entry (committed before this record existed, or a crash between the
tracker and the sidecar) is a candidate that is never promoted. Retention never deletes the
newest verified step; ``prefer=Prefer.VERIFIED`` makes ``ResumeMode.AUTO`` resume it.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .._agree import Wire
from .._disk import layout as _layout
from .._state.scalars import Metrics, scalar
from .._types import JsonObject
from ..errors import CheckpointCorruptError, ConfigError
from .entries import is_int, is_number

TRUST_NAME = "trust.json"
TRUST_FORMAT = 1
TRUST_BYTES = 4 << 20


class Prefer(str, enum.Enum):
    """Which committed step ``ResumeMode.AUTO`` (and ``MUST``) resumes."""

    LATEST = "latest"
    """The tracker's step."""
    VERIFIED = "verified"
    """The newest verified step no newer than the tracker; with none verified yet, the tracker's
    step if no unhealthy step followed it, else the restore raises."""


class Trust(str, enum.Enum):
    CANDIDATE = "candidate"
    VERIFIED = "verified"


HealthCheck = Callable[[int, Mapping[str, Any]], bool]
"""``check(step, metrics)``: False marks the step unhealthy. ``metrics`` holds ``loss``,
``grad_norm`` and the ``record_step`` extras that are known for the step (maybe none)."""


@dataclass(frozen=True, kw_only=True)
class HealthPolicy:
    """Which steps may be committed, and when a committed step counts as verified."""

    require_finite: bool = True
    """A non-finite (NaN, inf) loss or grad norm makes the step unhealthy."""
    check: HealthCheck | None = None
    """An extra user check, called on every rank with ``(step, metrics)`` for each saved and
    each recorded step; False makes that step unhealthy (an exception in it fails the save on
    every rank)."""
    verify_after: int = 10
    """N: healthy later steps after which a committed step is verified. Without ``record_step``
    only saves count, one step each."""
    prefer: Prefer = Prefer.LATEST
    """The default ``prefer`` of ``restore`` and ``resolve``."""

    def __post_init__(self) -> None:
        if not isinstance(self.require_finite, bool):
            raise ConfigError(
                f"HealthPolicy.require_finite must be a bool, got {self.require_finite!r}"
            )
        if self.check is not None and not callable(self.check):
            raise ConfigError(
                f"HealthPolicy.check must be a callable (step, metrics) -> bool, got {self.check!r}"
            )
        n = self.verify_after
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(
                f"HealthPolicy.verify_after must be an int >= 1 (later healthy steps), got {n!r}"
            )
        object.__setattr__(self, "prefer", as_prefer(self.prefer, "HealthPolicy.prefer"))


def as_prefer(value: Any, where: str) -> Prefer:
    try:
        return Prefer(value)
    except ValueError:
        raise ConfigError(
            f"{where} must be 'latest' or 'verified' (ckptguard.Prefer), got {value!r}"
        ) from None


# ---------------------------------------------------------------- health of one step, on one rank


def _finite_reasons(metrics: Mapping[str, Any], source: str) -> list[str]:
    out = []
    for name in ("loss", "grad_norm"):
        value = metrics.get(name)
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and not math.isfinite(value)
        ):
            out.append(f"{name} is {value} ({source})")
    return out


def reasons(policy: HealthPolicy, step: int, metrics: Mapping[str, Any], source: str) -> list[str]:
    """Why ``step`` is unhealthy on this rank (empty: healthy)."""
    out = _finite_reasons(metrics, source) if policy.require_finite else []
    if policy.check is not None and not policy.check(step, dict(metrics)):
        out.append(f"the HealthPolicy.check returned False ({source}: {_shown(metrics)})")
    return out


def _shown(metrics: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(metrics.items())) or "no metrics"


@dataclass(frozen=True)
class HealthView(Wire):
    """One rank's part of a save's health agreement: why this step is unhealthy here (empty:
    healthy), and the steps this rank recorded since the previous agreement."""

    reasons: list[str] = field(default_factory=list)
    healthy: list[int] = field(default_factory=list)
    unhealthy: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class HealthVerdict(Wire):
    """Rank 0's decision: the step's unhealthy reasons by rank (none: commit), and the steps
    seen."""

    reasons: dict[str, list[str]] = field(default_factory=dict)
    healthy: list[int] = field(default_factory=list)
    unhealthy: list[int] = field(default_factory=list)

    @property
    def skip(self) -> bool:
        return bool(self.reasons)

    def describe(self) -> str:
        ranks = sorted(self.reasons, key=int)
        return "; ".join(f"rank {r}: {', '.join(self.reasons[r])}" for r in ranks)


def agree(views: list[HealthView], step: int) -> HealthVerdict:
    """Rank 0: one rank's reason skips the step everywhere; a step is healthy only if no rank saw it
    unhealthy."""
    bad = {u for v in views for u in v.unhealthy}
    why = {str(r): v.reasons for r, v in enumerate(views) if v.reasons}
    if why:
        bad.add(step)
    good = {h for v in views for h in v.healthy} - bad
    return HealthVerdict(why, sorted(good), sorted(bad))


class HealthLog:
    """One rank's in-memory record of the steps it saw since the last save agreement."""

    # steps held between two saves; beyond it the oldest are forgotten (they only verify)
    HELD_MAX = 100_000

    def __init__(self) -> None:
        self._seen: dict[int, tuple[dict[str, Any], list[str]]] = {}
        self._roles: dict[
            int, dict[str, list[str]]
        ] = {}  # a run's ranks: step -> role -> its latest reasons

    def note(
        self, policy: HealthPolicy, step: int, metrics: Metrics, *, role: str | None = None
    ) -> None:
        """A ``record_step``: judged now, shipped at the next save (the latest record of a step
        wins). ``role`` (a RunCheckpoint rank holding several roles): each role's latest record
        wins, and the step is unhealthy if any role's is (a critic's finite loss must not hide the
        actor's NaN)."""
        source = (
            f"record_step of step {step}"
            if role is None
            else f"record_step of role {role!r}, step {step}"
        )
        why = reasons(policy, step, metrics, source)
        if role is not None:
            self._roles.setdefault(step, {})[role] = why
            why = [r for rs in self._roles[step].values() for r in rs]
        self._seen[step] = (metrics, why)
        if len(self._seen) > self.HELD_MAX:
            # Forget the older half of the healthy ones (amortized): an unhealthy step must still
            # block candidates.
            healthy = sorted(s for s, (_, why) in self._seen.items() if not why)
            for old in healthy[: len(healthy) // 2]:
                del self._seen[old]
                self._roles.pop(old, None)

    def save_view(
        self,
        policy: HealthPolicy,
        step: int,
        healthy: bool | None,
        loss: Any,
        grad_norm: Any,
        earlier: str | None,
    ) -> HealthView:
        """This rank's view of ``save(step, healthy=, loss=, grad_norm=)``: the arguments as scalars
        (a bad one raises, failing the save on every rank) and ``earlier``, why an earlier save of
        the step was skipped."""

        metrics = {
            n: scalar(n, v) for n, v in (("loss", loss), ("grad_norm", grad_norm)) if v is not None
        }
        known_bad = (
            [f"an earlier save of step {step} was skipped as unhealthy ({earlier})"]
            if earlier
            else None
        )
        return self.view(policy, step, healthy, metrics, known_bad)

    def view(
        self,
        policy: HealthPolicy,
        step: int,
        healthy: bool | None,
        metrics: Metrics,
        known_bad: list[str] | None = None,
    ) -> HealthView:
        """This rank's view of saving ``step``; the recorded steps are handed over (and forgotten).
        ``known_bad``: why an earlier save of this same step was skipped (it stays skipped: a second
        ``save`` of the step, a preemption save among them, has no metrics left to judge it by)."""
        why: list[str] = list(known_bad or [])
        if healthy is not None and not isinstance(healthy, bool):
            raise ConfigError(
                f"save(step={step}, healthy={healthy!r}): healthy must be True, False or None"
            )
        if healthy is False:
            why.append("save(..., healthy=False)")
        if metrics:
            why += reasons(policy, step, metrics, f"save of step {step}")
        elif step in self._seen:
            why += self._seen[step][1]
        else:
            why += (
                reasons(policy, step, {}, f"save of step {step}")
                if policy.check is not None
                else []
            )
        seen, self._seen, self._roles = self._seen, {}, {}
        seen.pop(step, None)
        return HealthView(
            why,
            sorted(s for s, (_, r) in seen.items() if not r) + ([] if why else [step]),
            sorted(s for s, (_, r) in seen.items() if r),
        )


# ---------------------------------------------------------------- the sidecar


def _path(root: Path) -> Path:
    return root / TRUST_NAME


@dataclass(frozen=True)
class TrustEntry:
    """One committed step's entry in ``trust.json``: its state, when it was committed (and
    verified), the N later healthy steps it needs, the ones seen so far, and the unhealthy step that
    stopped it."""

    state: Trust = Trust.CANDIDATE
    committed_unix: float = 0.0
    verify_after: int = 1
    healthy_after: tuple[int, ...] = ()
    unhealthy_after: int | None = None
    verified_unix: float | None = None

    def to_json(self) -> JsonObject:
        out: dict[str, Any] = {
            "state": self.state.value,
            "committed_unix": self.committed_unix,
            "verify_after": self.verify_after,
            "healthy_after": list(self.healthy_after),
            "unhealthy_after": self.unhealthy_after,
        }
        if self.verified_unix is not None:
            out["verified_unix"] = self.verified_unix
        return out

    @classmethod
    def from_json(cls, value: object) -> TrustEntry:
        """An entry as written; ValueError naming the field when it is not of the shape ckptguard
        writes."""
        if not isinstance(value, dict):
            raise ValueError("an entry is not an object")
        healthy, bad, need = (
            value.get("healthy_after", []),
            value.get("unhealthy_after"),
            value.get("verify_after", 1),
        )
        committed_at, verified_at = value.get("committed_unix", 0.0), value.get("verified_unix")
        if not (isinstance(healthy, list) and all(is_int(s) for s in healthy)):
            raise ValueError("'healthy_after' is not a list of steps")
        if not (bad is None or is_int(bad)) or not is_int(need) or need < 1:
            raise ValueError("'unhealthy_after' or 'verify_after' is not a step count")
        if not is_number(committed_at) or not (verified_at is None or is_number(verified_at)):
            raise ValueError("'committed_unix' or 'verified_unix' is not a time")
        state = Trust.VERIFIED if value.get("state") == Trust.VERIFIED.value else Trust.CANDIDATE
        return cls(
            state,
            float(committed_at),
            need,
            tuple(healthy),
            bad,
            None if verified_at is None else float(verified_at),
        )


def read(root: Path) -> dict[int, TrustEntry]:
    """Every step's trust entry; {} without a sidecar. Raises CheckpointCorruptError when it cannot
    be read."""
    path = _path(root)
    try:
        data = _layout.read_json(path, limit=TRUST_BYTES, what="trust record")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(
            f"{path} cannot be read ({exc}); it is written only by ckptguard (rank 0, atomically): "
            f"move it away to treat every step as a candidate again"
        ) from None
    steps = data.get("steps") if isinstance(data, dict) else None
    if not isinstance(steps, dict) or not all(isinstance(v, dict) for v in steps.values()):
        raise CheckpointCorruptError(
            f"{path} is not a trust record (no 'steps' object); move it away"
        )
    out = {}
    for key, value in steps.items():
        try:
            step = int(key)
        except ValueError:
            raise CheckpointCorruptError(
                f"{path} names a step that is not a number; move it away"
            ) from None
        try:
            out[step] = TrustEntry.from_json(value)
        except ValueError as exc:
            raise CheckpointCorruptError(f"{path} step {key}: {exc}; move it away") from None
    return out


def _write(root: Path, steps: Mapping[int, TrustEntry]) -> None:
    _layout.refuse_link(_path(root), "trust record")  # never written through a link
    body = {
        "format": TRUST_FORMAT,
        "steps": {str(k): v.to_json() for k, v in sorted(steps.items())},
    }
    _layout.atomic_write_json(_path(root), body)


def state(entry: TrustEntry | None) -> Trust:
    return Trust.CANDIDATE if entry is None else entry.state


def describe(entry: TrustEntry | None) -> str:
    """One phrase for ``ckptguard list``."""
    if entry is None:
        return "candidate (no trust record)"
    if entry.state is Trust.VERIFIED:
        return "verified"
    if entry.unhealthy_after is not None:
        return f"candidate (unhealthy step {entry.unhealthy_after} followed it: never verified)"
    return f"candidate ({len(entry.healthy_after)}/{entry.verify_after} healthy steps after it)"


def committed(root: Path, step: int, verify_after: int, *, on_disk: Iterable[int]) -> None:
    """Rank 0, after the tracker moved: ``step`` is a candidate (a replaced step starts over).
    Entries of steps no longer on disk are dropped."""
    keep = set(on_disk) | {step}
    steps = {k: v for k, v in read(root).items() if k in keep}
    steps[step] = TrustEntry(Trust.CANDIDATE, time.time(), verify_after)
    _write(root, steps)


def observe(
    root: Path, healthy: Iterable[int], unhealthy: Iterable[int], eligible: Callable[[int], bool]
) -> list[int]:
    """Rank 0, at a save agreement: apply the steps seen healthy and unhealthy to every eligible
    candidate older than them. Returns the steps that became verified."""
    good, bad = sorted(set(healthy)), sorted(set(unhealthy))
    if not (good or bad):
        return []
    steps = read(root)
    changed, promoted = False, []
    for k, entry in sorted(steps.items()):
        if entry.state is Trust.VERIFIED or entry.unhealthy_after is not None or not eligible(k):
            continue
        first_bad = next((s for s in bad if s > k), None)
        seen = sorted(set(entry.healthy_after) | {s for s in good if s > k})
        need = entry.verify_after
        if first_bad is not None:
            seen = [s for s in seen if s < first_bad]
        if len(seen) >= need:
            steps[k] = replace(
                entry,
                state=Trust.VERIFIED,
                verified_unix=time.time(),
                healthy_after=tuple(seen[:need]),
            )
            promoted.append(k)
        elif first_bad is not None:
            steps[k] = replace(entry, unhealthy_after=first_bad, healthy_after=tuple(seen))
        else:
            steps[k] = replace(entry, healthy_after=tuple(seen))
        changed = True
    if changed:
        _write(root, steps)
    return promoted


def newest_verified(root: Path, steps: Iterable[int]) -> int | None:
    """The newest of ``steps`` that is verified (raises CheckpointCorruptError for an unreadable
    sidecar)."""
    trust = read(root)
    return max((s for s in steps if state(trust.get(s)) is Trust.VERIFIED), default=None)
