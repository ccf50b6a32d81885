"""The blocking budget of a synchronous save: below a fraction of the process group's collective
timeout.

Contract. A rank held in a save is a rank whose next collective is late: when one rank is held
longer than the process group's timeout while its peers already wait in a collective, the collective
watchdog kills the job (VeOmni PR#1164: 11 minutes blocked, a 600 s NCCL timeout, a restart from
step 0 in a loop). ckptguard's own cross-rank waits inside a save go through the c10d store with
``CheckpointConfig.timeout_s``, never through a collective of the process group, so no watchdog can
fire inside ckptguard; what is left is how long ``save`` holds the caller. ``BudgetRound.over``
estimates that, before anything is captured: this manager's measured seconds per byte of its last
synchronous save, or, before the first, a probe of the root's write speed; every rank's estimate is
gathered and rank 0 decides for all with the slowest. Over the budget (``BlockingBudget.fraction``
of the group's timeout, read from the group or declared), ``save`` warns and saves
(``OverBudget.WARN``, the default), commits in the background as ``save_async`` does
(``OverBudget.BACKGROUND``) or raises ``SaveBudgetError`` on every rank (``OverBudget.REFUSE``),
before any rank snapshots. A save sent to the background feeds its measured time (request to
published, what a synchronous save would have held the caller) to the next estimate, as a
synchronous save does: the estimate never stays on the probe's figure. One rank, or no readable
timeout and none declared: no budget, no round.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._agree import Agreement, Wire, gather_decide
from .._disk import tempfiles as _tempfiles
from .._state import state as _state
from ..config import BlockingBudget, OverBudget
from ..errors import SaveBudgetError
from .snapshot import Snapshot

log = logging.getLogger("ckptguard")

PROBE_BYTES = 16 << 20
FLOOR_BYTES_PER_S = 50 << 20
"""Before a manager's first measured save: a state that fits the budget at this speed is not probed
(a probe of every rank's disk at the first save of a thousand ranks would write 16 GiB for
nothing)."""


def write_speed(root: Path, nbytes: int = PROBE_BYTES) -> float:
    """Bytes per second of an fsynced write of ``nbytes`` into ``root`` (created if missing: the
    save it plans for would create it), through a temp file named for this process and removed
    after."""
    root.mkdir(parents=True, exist_ok=True)
    path = _tempfiles.temp_name(root / ".ckptguard-disk-probe")
    block = os.urandom(
        1 << 20
    )  # incompressible: a compressing filesystem must not flatter the figure
    began = time.perf_counter()
    try:
        with open(path, "wb") as f:
            for _ in range(max(1, nbytes // len(block))):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        return max(1, nbytes // len(block)) * len(block) / max(time.perf_counter() - began, 1e-6)
    finally:
        path.unlink(missing_ok=True)


def tensor_bytes(value: Any) -> int:
    """This rank's tensor bytes in ``value`` read without ``state_dict()`` (which would hash or
    all-gather in the time being estimated): tensors (a DTensor's local shard), a module's
    parameters and buffers, an optimizer's state tensors, containers of them, a ``PerRank``'s value.
    Other items count 0 (their writers are not seen)."""
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return int(local.numel() * local.element_size())
    if isinstance(value, torch.nn.Module):
        return sum(tensor_bytes(t) for t in (*value.parameters(), *value.buffers()))
    if isinstance(value, torch.optim.Optimizer):
        return sum(tensor_bytes(v) for st in value.state.values() for v in st.values())
    if isinstance(value, _state.PerRank):
        return tensor_bytes(value.value)
    if isinstance(value, Mapping):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def group_timeout_s(group: Any | None) -> float | None:
    """The smallest collective timeout of ``group``'s backends (None: the default group), in
    seconds; None when there is no process group or torch does not expose it
    (``ProcessGroup._get_backend(device) .options._timeout``, read in torch 2.13 for gloo and
    NCCL)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg: Any = group if group is not None else dist.group.WORLD
    found: list[float] = []
    for device in ("cpu", "cuda"):
        try:
            options = pg._get_backend(torch.device(device)).options
            # torch's private field, no public reader in 2.13
            timeout = getattr(options, "_timeout")  # noqa: B009
        except Exception:  # no backend for that device, or a torch without these names
            continue
        found.append(timeout.total_seconds())
    return min(found) if found else None


@dataclass(frozen=True)
class _Estimate(Wire):
    """One rank's estimate of the synchronous save it is asked for (seconds; None: none) and its
    bytes."""

    seconds: float | None
    nbytes: int
    source: str


@dataclass(frozen=True)
class BudgetVerdict(Wire):
    """Rank 0's decision: ``over`` when the slowest rank's estimate exceeds ``budget_s``."""

    over: bool
    seconds: float = 0.0
    rank: int = 0
    source: str = ""
    budget_s: float = 0.0
    timeout_s: float = 0.0


class BudgetRound:
    """The blocking budget of one manager: its measured save speed and the round that applies it."""

    def __init__(
        self,
        agreement: Agreement,
        world: int,
        group: Any | None,
        budget: BlockingBudget,
        root: Path,
        storage: Any = None,
    ) -> None:
        self.agreement, self.world, self.budget, self.root = agreement, world, budget, root
        # A storage whose writers run a framework's own collective save (ExternalFiles: HF,
        # DeepSpeed, Megatron) never writes in a background commit: BACKGROUND is WARN there.
        self.background_ok = not getattr(storage, "foreground_only", False)
        self.timeout_s = (
            budget.timeout_s if budget.timeout_s is not None else group_timeout_s(group)
        )
        self.timeout_source = (
            "declared" if budget.timeout_s is not None else "read from the process group"
        )
        self._bytes_per_s: float | None = None
        self.measured_by = ""
        """Which save the estimate's speed was measured on (``synchronous``, ``background``); empty:
        none yet."""
        self._asked_bytes = 0
        """The tensor bytes of the save the last round estimated (what ``observe`` measures it
        against)."""
        self.redirected = 0
        """Synchronous saves this manager committed in the background instead
        (``OverBudget.BACKGROUND``)."""

    @property
    def budget_s(self) -> float | None:
        if self.world <= 1 or self.timeout_s is None or self.budget.fraction is None:
            return None
        return self.timeout_s * self.budget.fraction

    def observe(self, snap: Snapshot, seconds: float, *, by: str = "synchronous") -> None:
        """A save of ``snap`` took ``seconds`` (a synchronous one held the caller that long;
        ``by="background"``: a save ``OverBudget.BACKGROUND`` sent to the background, from its
        request until it was published): the speed the next estimate uses."""
        local = [
            t.to_local() if hasattr(t, "to_local") else t
            for c in snap.items.values()
            for t in c.tensors.values()
        ]
        # A committed snapshot may have let its tensors go (a synchronous save's items are empty
        # after the write): then the bytes this round estimated for the same save, or the speed
        # would never be learnt.
        nbytes = sum(t.numel() * t.element_size() for t in local) or self._asked_bytes
        if nbytes > 0 and seconds > 0:
            self._bytes_per_s = nbytes / seconds
            self.measured_by = by

    def _estimate(self, state: Mapping[str, Any], budget_s: float) -> _Estimate:
        """Never raises: a rank that cannot estimate posts None (the others' estimates decide), so
        no rank leaves the round that every rank walks."""
        try:
            return self._estimated(state, budget_s)
        except Exception as exc:  # a probe that cannot write, an item that cannot be walked
            return _Estimate(None, 0, f"no estimate ({type(exc).__name__}: {exc})")

    def _estimated(self, state: Mapping[str, Any], budget_s: float) -> _Estimate:
        nbytes = self._asked_bytes = tensor_bytes(dict(state))
        if self._bytes_per_s is not None:
            return _Estimate(
                nbytes / self._bytes_per_s, nbytes, f"this manager's last {self.measured_by} save"
            )
        if (
            nbytes / FLOOR_BYTES_PER_S <= budget_s
        ):  # fits even at a slow disk's speed: no probe write
            return _Estimate(
                nbytes / FLOOR_BYTES_PER_S, nbytes, f"a floor of {FLOOR_BYTES_PER_S >> 20} MiB/s"
            )
        speed = write_speed(self.root)
        return _Estimate(
            nbytes / speed, nbytes, f"a {PROBE_BYTES >> 20} MiB write probe of {self.root}"
        )

    def over(self, step: int, state: Mapping[str, Any]) -> bool:
        """Collective (when a budget applies): True on every rank when the save of ``step`` would
        hold the slowest rank longer than the budget and ``OverBudget.BACKGROUND`` applies; raises
        ``SaveBudgetError`` on every rank under ``OverBudget.REFUSE``."""
        budget_s = self.budget_s
        if budget_s is None:
            return False
        assert self.timeout_s is not None
        timeout_s = self.timeout_s

        def decide(views: list[_Estimate]) -> BudgetVerdict:
            known = [(v.seconds, r, v.source) for r, v in enumerate(views) if v.seconds is not None]
            if not known:
                return BudgetVerdict(over=False)
            seconds, rank, source = max(known)
            return BudgetVerdict(
                over=seconds > budget_s,
                # unrounded: the error's figures keep seconds > budget_s for a tiny budget
                seconds=seconds,
                rank=rank,
                source=source,
                budget_s=budget_s,
                timeout_s=timeout_s,
            )

        verdict = gather_decide(
            self.agreement,
            "save.budget",
            self._estimate(state, budget_s),
            decide,
            decision=BudgetVerdict,
        )
        if not verdict.over:
            return False
        what = (
            f"the save of step {step} would hold rank {verdict.rank} about "
            f"{verdict.seconds:.1f} s (from {verdict.source}), above the blocking budget of "
            f"{verdict.budget_s:.1f} s ({self.budget.fraction:.0%} of the "
            f"{verdict.timeout_s:.0f} s collective timeout, {self.timeout_source})"
        )
        if self.budget.over is OverBudget.REFUSE:
            raise SaveBudgetError(
                f"{self.root}: {what}; nothing was written and the tracker did not move. Use "
                f"save_async (it holds the caller only for the copies), raise the process group's "
                f"timeout, or "
                f"CheckpointConfig(blocking=BlockingBudget(over=OverBudget.BACKGROUND))",
                step=step,
                seconds=verdict.seconds,
                budget_s=verdict.budget_s,
            )
        if self.budget.over is OverBudget.WARN or not self.background_ok:
            why = (
                "BlockingBudget(over=OverBudget.WARN); OverBudget.BACKGROUND commits it in the "
                "background instead, OverBudget.REFUSE refuses it"
                if self.background_ok
                else "its storage's writers are a framework's "
                "own collective save, which never runs in a background commit; "
                "OverBudget.REFUSE refuses it"
            )
            log.warning("ckptguard: %s: saving synchronously (%s)", what, why)
            return False
        self.redirected += 1
        log.warning(
            "ckptguard: %s: committed in the background instead, as save_async does (mgr.wait() "
            "joins it; %d so far). "
            "CheckpointConfig(blocking=BlockingBudget(over=OverBudget.REFUSE)) refuses instead",
            what,
            self.redirected,
        )
        return True
