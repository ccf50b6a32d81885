"""Whether a resumed process trained: the zero-step resume (an exhausted loader at an epoch
boundary, a loop whose range ended) exits 0 and looks like success.

Contract: a ``ResumeWatch`` sees every proof record its rank's ``ProofLog`` builds. A restore of a
non-zero step arms it (a later restore in the same process re-arms it); a ``step`` or ``update``
record past that step counts as trained. At interpreter exit, an armed watch appends an ``exit``
record (the restored step, the steps trained, the plan's ``total_steps``, and ``raised``: the
uncaught exception the process died on, where one did) and, when nothing was trained, logs one loud
line: ``resumed at step 120 of 200 and trained 0 steps``. ``ckptguard prove`` reads the ``exit``
record (gate ``resumed run trained``). It only logs and records; it never raises.
"""

from __future__ import annotations

import atexit
import logging
import sys
from collections.abc import Callable
from types import TracebackType

from .._log import NAME
from .proofreader import ProofRecord

log = logging.getLogger(NAME)

_WATCHES: set[ResumeWatch] = (
    set()
)  # armed ones; held strongly: a manager dropped when main() returns still reports
_UNCAUGHT: list[
    str
] = []  # the uncaught exception the main thread died on, seen by the chained sys.excepthook
_HOOKED: list[bool] = []


def _watch_uncaught() -> None:
    """Chain ``sys.excepthook`` once an armed watch exists: a resumed process that dies on an
    exception before its first step (a save of the restored step refused, a bad config) is then
    recorded as that, not taken for an exhausted loader. The previous hook still runs; nothing else
    is changed."""
    if _HOOKED:
        return
    _HOOKED.append(True)
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        _UNCAUGHT[:] = [f"{kind.__name__}: {value}"[:500]]
        previous(kind, value, tb)

    sys.excepthook = hook


class ResumeWatch:
    """One rank's restored step and the steps trained after it, in this process."""

    def __init__(self, rank: int, where: str, keep: Callable[..., None]) -> None:
        """``keep(event, **fields)`` appends a record of this rank (``ProofLog``'s build and
        keep)."""
        self.rank, self.where, self.keep = rank, where, keep
        self.restored: int | None = None
        self.total: int | None = None
        self.trained: set[int] = set()
        self.done = False

    def observe(self, record: ProofRecord) -> None:
        step, event = record.step, record.event
        if step is None:
            return
        if event == "restore" and step > 0 and record.get("ok") is not False:
            plan = record.get("plan") if isinstance(record.get("plan"), dict) else {}
            total = plan.get("total_steps") if plan else None
            self.restored, self.trained, self.done = step, set(), False
            self.total = total if isinstance(total, int) and not isinstance(total, bool) else None
            _WATCHES.add(self)
            _watch_uncaught()
        elif (
            event in ("step", "update", "save")
            and self.restored is not None
            and step > self.restored
        ):
            # a save past the restored step trained too (a job that saves without record_step)
            self.trained.add(step)

    def line(self) -> str:
        """What this process did after its restore, in words."""
        of = f" of {self.total}" if self.total is not None else ""
        n = len(self.trained)
        return f"resumed at step {self.restored}{of} and trained {n} step{'' if n == 1 else 's'}"

    def at_exit(self) -> None:
        if self.restored is None or self.done:
            return
        self.done = True
        try:
            raised = {"raised": _UNCAUGHT[0]} if _UNCAUGHT else {}
            self.keep(
                "exit",
                step=self.restored,
                trained=len(self.trained),
                total_steps=self.total,
                **raised,
            )
        except Exception as exc:  # an exit hook never raises: the process is ending
            log.warning(
                "ckptguard: could not record the exit of rank %d under %s (%s)",
                self.rank,
                self.where,
                exc,
            )
        if self.trained:
            return
        if self.total is not None and self.restored >= self.total:
            log.info(
                "ckptguard: rank %d %s: the job had ended (total_steps %d)",
                self.rank,
                self.line(),
                self.total,
            )
            return
        if self.total is None:  # whether steps were left is for prove to tell from the records
            log.warning(
                "ckptguard: rank %d %s before the process exited (%s); declare "
                "ProofPlan(total_steps=) to have a zero-step resume called out here",
                self.rank,
                self.line(),
                self.where,
            )
            return
        log.error(
            "ckptguard: rank %d %s before the process exited: the data loader or the step "
            "range ended right after the restore (an exhausted loader at an epoch boundary?); "
            "the run made no progress (%s)",
            self.rank,
            self.line(),
            self.where,
        )


@atexit.register
def _at_exit() -> None:
    for watch in list(_WATCHES):
        watch.at_exit()
