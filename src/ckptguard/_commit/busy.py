"""A ``save_async`` requested while the previous commit still runs: one decision, alike on every
rank.

Contract. Whether a commit is in flight differs per rank (a rank's commit thread ends when it has
read the outcome; another's a moment later), so no rank may act on its own view: ``BusyRound``
gathers every rank's view through an agreement of its own (the commit thread uses the manager's
agreement meanwhile, and one agreement numbers its phases in one thread only) and rank 0 decides for
all, before any rank snapshots. ``OnBusy.SKIP``: nothing is snapshotted; the skip is logged with the
interval that fits the measured commit time, counted, and handed to the next committed step's cost
block (``pending_cost``) and to the proof log. ``OnBusy.WAIT`` needs no round. ``OnBusy.COALESCE``
(``_commit.coalesce``) and ``OnBusy.FAST_TIER`` (``ckptguard.tiers``) decide from the same round:
the views also carry the step queued on each rank (every rank must hold the same one, checked here)
and whether only a tiered save's persistent part still runs there; coalesced and redirected saves
are counted and reported like skips.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._agree import Agreement, Wire, gather_decide
from .._records.entries import Figure
from ..config import OnBusy
from ..errors import CheckpointError, ConfigError

log = logging.getLogger("ckptguard")


@dataclass(frozen=True)
class BusyView(Wire):
    """One rank's view: the step whose commit is in flight here (None: idle) and since when
    (seconds)."""

    running: int | None
    running_s: float
    queued: int | None = None
    """The step of a coalesced save queued here, not started (``OnBusy.COALESCE``)."""
    fast_busy: bool = False
    """A tiered save's fast part (commit, replica push) still runs here, not only its persistent
    part."""
    unready_bytes: int = 0
    """Host staging bytes still being prepared here in the background (0: ready, or none being
    prepared)."""


@dataclass(frozen=True)
class BusyDecision(Wire):
    """Rank 0's verdict: ``busy`` when a commit is in flight on any rank (``ranks``, ``running``);
    ``fast_busy`` when a tiered save's fast part still runs on any rank; ``queued``: the step queued
    on rank 0, ``queue_differs``: the ranks that hold another (never expected; every rank
    raises)."""

    busy: bool
    running: int | None = None
    ranks: list[int] = field(default_factory=list)
    running_s: float = 0.0
    fast_busy: bool = False
    queued: int | None = None
    queue_differs: list[int] = field(default_factory=list)
    unready_ranks: list[int] = field(default_factory=list)
    unready_bytes: int = 0  # the most any of them still lacks


# A save may read this much of its state live while the staging is still being prepared (tens of ms
# of the next optimizer step's wait); past it, under OnBusy.SKIP, it is skipped instead: on an H100
# the first fast-tier save, 1.2 s after the first step, held the loop 2.19 s reading 6.2 GiB live
# (benchmarks/results/issue41_h100).
UNREADY_LIVE_BYTES = 64 << 20


class InFlight(Protocol):
    """A background save as the busy round sees it (``PendingSave``, ``TieredSave``)."""

    step: int
    commit_seconds: float | None
    reported: bool

    def busy(self) -> bool: ...

    def running_seconds(self) -> float: ...

    def outcome(self) -> Any: ...


class TieredInFlight(InFlight, Protocol):
    """A tiered background save (``TieredSave``): also whether its fast part still runs here."""

    def fast_busy(self) -> bool: ...


def decide(views: list[BusyView]) -> BusyDecision:
    queued = views[0].queued
    differs = [r for r, v in enumerate(views) if v.queued != queued]
    ranks = [r for r, v in enumerate(views) if v.running is not None]
    unready = [r for r, v in enumerate(views) if v.unready_bytes > UNREADY_LIVE_BYTES]
    lacking = max((views[r].unready_bytes for r in unready), default=0)
    if not ranks:
        return BusyDecision(
            busy=False,
            queued=queued,
            queue_differs=differs,
            unready_ranks=unready,
            unready_bytes=lacking,
        )
    return BusyDecision(
        busy=True,
        running=views[ranks[0]].running,
        ranks=ranks,
        running_s=round(max(views[r].running_s for r in ranks), 3),
        fast_busy=any(v.fast_busy for v in views),
        queued=queued,
        queue_differs=differs,
        unready_ranks=unready,
        unready_bytes=lacking,
    )


@dataclass
class Skipped:
    """A save not committed as requested: ``kind`` is ``skipped``, ``coalesced`` (a newer one
    replaced it in the queue) or ``redirected`` (written to the fast tier only)."""

    step: int
    running: int | None
    reason: str
    kind: str = "skipped"


KINDS = ("skipped", "coalesced", "redirected")


class BusyRound:
    """The busy decision of one front door, its skip counter and the step-time/commit-time figures
    that say which interval would fit."""

    def __init__(
        self, agreement: Agreement, *, label: str = "step", policy: OnBusy = OnBusy.SKIP
    ) -> None:
        self.agreement = agreement
        self.label = label
        self.policy = policy
        """The front door's ``CheckpointConfig.async_save.on_busy`` (named in every cost block)."""
        self.skipped_total = 0
        """Saves this process skipped because a commit was in flight."""
        self.coalesced_total = 0
        """Queued saves a newer request replaced before they started (``OnBusy.COALESCE``)."""
        self.redirected_total = 0
        """Saves written to the fast tier only while the persistent tier committed
        (``OnBusy.FAST_TIER``)."""
        self.since_commit: list[Skipped] = []
        """Skips not yet reported in a committed step's cost block."""
        self.last_commit_s: float | None = None
        """How long the last completed background commit took (request to published)."""
        self._requests: list[tuple[int, float]] = []  # (step, monotonic) of the last two requests
        self._warned_interval: int | None = None

    def request(self, step: int) -> None:
        self._requests = [*self._requests, (step, time.monotonic())][-2:]

    def round(
        self,
        step: int,
        running: int | None,
        running_s: float,
        *,
        queued: int | None = None,
        fast_busy: bool = False,
        unready: int = 0,
    ) -> BusyDecision:
        """Collective: every rank's view, rank 0's verdict. Ranks holding different queued saves
        (never expected: they are queued and replaced only on this round's verdicts) raise alike on
        every rank. ``unready``: this rank's staging bytes still being prepared
        (``AsyncStaging.unready_bytes``)."""
        view = BusyView(
            running, round(running_s, 3), queued=queued, fast_busy=fast_busy, unready_bytes=unready
        )
        decision = gather_decide(self.agreement, "save.busy", view, decide, decision=BusyDecision)
        if decision.queue_differs:
            raise CheckpointError(
                f"save_async of {self.label} {step}: rank 0 holds queued {self.label} "
                f"{decision.queued} and ranks {decision.queue_differs} another (this rank: "
                f"{queued}); a queued save would start on some ranks only. This is a ckptguard "
                f"bug: report it; CheckpointConfig(async_save=AsyncOptions(on_busy=OnBusy.SKIP)) "
                f"avoids the queue"
            )
        return decision

    def commit_took(self, seconds: float) -> None:
        self.last_commit_s = seconds

    def step_seconds(self) -> float | None:
        if len(self._requests) < 2 or self._requests[1][0] <= self._requests[0][0]:
            return None
        (s0, t0), (s1, t1) = self._requests
        return (t1 - t0) / (s1 - s0)

    def fitting_interval(self, decision: BusyDecision) -> tuple[int, float] | None:
        """(steps, commit seconds): the smallest save interval in steps the measured commit time
        fits."""
        step_s = self.step_seconds()
        commit_s = max(self.last_commit_s or 0.0, decision.running_s)
        if step_s is None or step_s <= 0 or commit_s <= 0:
            return None
        # Strictly more steps than one commit lasts, and more than the interval that was just too
        # short: a job saving every 4 steps was told "4 fits" (ceil of 3.9) after a skip at that
        # very interval.
        (s0, _t0), (s1, _t1) = self._requests
        return max(math.floor(commit_s / step_s) + 1, s1 - s0 + 1), commit_s

    def running_reason(self, decision: BusyDecision) -> str:
        if not decision.busy:  # skipped for its staging alone (``may_start``)
            return unready_reason(decision)
        where = (
            f"ranks {decision.ranks}" if len(decision.ranks) > 1 else f"rank {decision.ranks[0]}"
        )
        return (
            f"{self.label} {decision.running}'s commit was still running on {where} "
            f"({decision.running_s:.2f} s in)"
        )

    def skip(self, step: int, decision: BusyDecision, why: str = "") -> Skipped:
        """Count, log and keep a skipped request (``OnBusy.SKIP``; ``why``: what kept another policy
        from it)."""
        fit = self.fitting_interval(decision)
        reason = self.running_reason(decision) + (f"; {why}" if why else "")
        skipped = Skipped(step, decision.running, reason)
        self.skipped_total += 1
        self.since_commit.append(skipped)
        advice = ""
        if fit is not None:
            every, commit_s = fit
            advice = (
                f"; one commit takes {commit_s:.2f} s, saves come every "
                f"{self.step_seconds() or 0:.2f} s per {self.label}: an interval of {every} "
                f"{self.label}s or more fits it"
            )
        message = (
            f"ckptguard: save_async of {self.label} {step} SKIPPED ({self.skipped_total} so "
            f"far): {reason}{advice}. "
            f"CheckpointConfig(async_save=AsyncOptions(on_busy=OnBusy.WAIT)) waits instead"
        )
        interval = fit[0] if fit is not None else None
        if self.skipped_total == 1 or interval != self._warned_interval:
            log.warning(message)
            self._warned_interval = interval
        else:
            log.info(message)
        return skipped

    def coalesce(self, step: int, by: int, reason: str) -> Skipped:
        """Count, log and keep a queued save that ``by`` replaced before it started
        (``OnBusy.COALESCE``)."""
        self.coalesced_total += 1
        gone = Skipped(
            step, None, f"replaced in the queue by {self.label} {by}: {reason}", kind="coalesced"
        )
        self.since_commit.append(gone)
        log.info(
            "ckptguard: queued save_async of %s %d COALESCED (%d so far): %s",
            self.label,
            step,
            self.coalesced_total,
            gone.reason,
        )
        return gone

    def redirect(self, step: int, decision: BusyDecision) -> Skipped:
        """Count, log and keep a save written to the fast tier only (``OnBusy.FAST_TIER``)."""
        self.redirected_total += 1
        moved = Skipped(
            step,
            decision.running,
            self.running_reason(decision).replace("commit", "persistent commit"),
            kind="redirected",
        )
        self.since_commit.append(moved)
        log.info(
            "ckptguard: save_async of %s %d REDIRECTED to the fast tier only (%d so far): %s",
            self.label,
            step,
            self.redirected_total,
            moved.reason,
        )
        return moved

    def pending_cost(self) -> dict[str, Figure]:
        """The skipped, coalesced and redirected saves since the last committed step, for the next
        one's cost block (then forgotten)."""
        totals = {
            "skipped": self.skipped_total,
            "coalesced": self.coalesced_total,
            "redirected": self.redirected_total,
        }
        out: dict[str, Figure] = {"on_busy": self.policy.value}
        for kind in KINDS:
            mine = [s for s in self.since_commit if s.kind == kind]
            out.update(
                {
                    f"{kind}_saves": len(mine),
                    f"{kind}_steps": [s.step for s in mine],
                    f"{kind}_saves_total": totals[kind],
                }
            )
        self.since_commit = []
        return out


def unready_reason(decision: BusyDecision) -> str:
    ranks = decision.unready_ranks
    where = f"ranks {ranks}" if len(ranks) > 1 else f"rank {ranks[0]}"
    return (
        f"the host staging is still being prepared in the background on {where} "
        f"({decision.unready_bytes} B to go, since the state was first known): this save would "
        f"read that much live and hold the next optimizer step until it had; prepare_async(state) "
        f"early in the job starts it sooner"
    )


def check_policy(policy: OnBusy, front_door: str, able: tuple[OnBusy, ...]) -> None:
    """Refuse an ``on_busy`` policy ``front_door`` cannot follow, naming the ones it can."""
    if policy not in able:
        raise ConfigError(
            f"{front_door}: "
            f"CheckpointConfig(async_save=AsyncOptions(on_busy=OnBusy.{policy.name})) is not a "
            f"policy it can follow ({policy.name}: see the OnBusy docstring); use one of "
            f"{', '.join('OnBusy.' + p.name for p in able)}"
        )


def may_start(
    busy: BusyRound,
    step: int,
    pending: InFlight | None,
    policy: OnBusy,
    *,
    wait: Callable[[], Any],
    record: Callable[..., None],
    unready: int = 0,
) -> bool:
    """``CheckpointConfig.async_save.on_busy`` for a ``save_async`` of ``step``: False when it is
    skipped, on every rank alike. Otherwise every rank's previous commit is published (its error is
    raised here, alike on every rank); its cleanup may still run, and the new commit starts after
    it. ``record``: the proof record. ``unready``: this rank's staging bytes still being prepared;
    past ``UNREADY_LIVE_BYTES`` on any rank, a save under ``OnBusy.SKIP`` is skipped as one is while
    a commit runs (``WAIT`` reads them live, as before)."""
    busy.request(step)
    if policy is OnBusy.WAIT:
        wait()
        return True
    running = pending if pending is not None and pending.busy() else None
    decision = busy.round(
        step,
        running.step if running else None,
        running.running_seconds() if running else 0.0,
        unready=unready,
    )
    if decision.busy or (decision.unready_ranks and policy is OnBusy.SKIP):
        skipped = busy.skip(step, decision)
        record(
            "busy_skip",
            durable=False,
            step=step,
            running=decision.running,
            reason=skipped.reason,
            policy=policy.value,
        )
        return False
    settle(busy, pending)
    return True


def settle(busy: BusyRound, pending: InFlight | None) -> None:
    """Every rank's commit ended: note how long it took, and raise its error (alike on every
    rank)."""
    if pending is not None:
        if pending.commit_seconds is not None:
            busy.commit_took(pending.commit_seconds)
        if not pending.reported:
            pending.outcome()


def route_tiered(
    busy: BusyRound,
    step: int,
    pending: TieredInFlight | None,
    *,
    record: Callable[..., None],
    unready: int = 0,
) -> str:
    """``OnBusy.FAST_TIER`` for a tiered ``save_async`` of ``step``, alike on every rank:
    ``"start"`` (no commit in flight on any rank; its error raised here, as ``may_start``),
    ``"fast"`` (only persistent commits run: write it to the fast tier alone, recorded as
    redirected) or ``"skip"`` (the fast tier still commits on some rank)."""
    busy.request(step)
    running = pending if pending is not None and pending.busy() else None
    decision = busy.round(
        step,
        running.step if running else None,
        running.running_seconds() if running else 0.0,
        fast_busy=running is not None and running.fast_busy(),
        unready=unready,
    )
    if not decision.busy and decision.unready_ranks:
        skipped = busy.skip(step, decision)
        record(
            "busy_skip",
            durable=False,
            step=step,
            running=None,
            reason=skipped.reason,
            policy=OnBusy.FAST_TIER.value,
        )
        return "skip"
    if not decision.busy:
        settle(busy, pending)
        return "start"
    if decision.fast_busy:
        skipped = busy.skip(
            step, decision, why="the fast tier still commits too, so it is not redirected there"
        )
        record(
            "busy_skip",
            durable=False,
            step=step,
            running=decision.running,
            reason=skipped.reason,
            policy=OnBusy.FAST_TIER.value,
        )
        return "skip"
    moved = busy.redirect(step, decision)
    record("busy_redirect", durable=False, step=step, running=decision.running, reason=moved.reason)
    return "fast"
