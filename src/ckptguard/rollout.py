"""RolloutLedger: what an asynchronous RL driver owes each prompt, saved in the same commit as the
models.

An asynchronous pipeline has prompts in three places at any save: in flight (sent to generation, no
rollout yet), buffered (a rollout is back, not trained on) and trained. A resume that restores the
models and the dataloader but not these loses the buffered and in-flight prompts (the dataloader is
already past them) or trains some twice. The ledger is a state item
(``state_dict``/``load_state_dict``): put it in the driver's state, e.g. ``RunCheckpoint.save(step,
{..., "driver": {"ledger": ledger}})``, and it is committed with the models.

The driver feeds it: ``issued(prompt_id, policy_version)`` (or ``next_prompt()``, which draws and
issues in one step), ``completed(prompt_id, rollout_ref)``, ``take(n)`` and ``trained(prompt_ids,
step)``. After a restore, ``resume()`` (called by the first ``next_prompt``/``take`` if not before)
applies the declared rule once: prompts in flight at the save are re-issued (their producer is
gone); buffered rollouts are kept with their policy version, unless older than ``max_staleness``
policy versions, or unless ``keep_buffered=False`` (the rollouts lived in memory), and then dropped
and re-issued.

Prompt sources: ``source`` is any iterable of prompt ids (ints or strings, unique within the run).
A source with ``state_dict``/``load_state_dict`` (e.g. a ``DataCursor``) is saved inside the ledger
under the ledger's lock, so its position and the ledger always agree; do not save it as a separate
item too. Any other iterable must yield the same sequence each time it is iterated (a ``range``, a
list, a shuffle with a fixed seed): the ledger counts what it drew and skips that many after a
restore. ``rollout_ref`` is what the trainer needs to find the rollout again: with
``keep_buffered=True`` it must survive a restart (a file written before ``completed``, or the
rollout itself if small), and a plain value (str, int, float, list, dict) for the safe load.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypedDict

from . import _log
from ._types import StateDict
from .errors import ConfigError, StateMismatchError

log = _log.logger()

PromptId = int | str
STATE_VERSION = 1


class LedgerCounters(TypedDict):
    """``RolloutLedger.counters()``: the totals, the policy version and the staleness, by name."""

    issued: int
    completed: int
    trained: int
    reissued: int
    dropped_stale: int
    policy_version: int
    last_step: int
    drawn: int
    in_flight: int
    buffered: int
    max_buffered_staleness: int
    trained_staleness: dict[int, int]


@dataclass(frozen=True)
class Rollout:
    """A buffered rollout: its prompt, the policy version that generated it, and where it is."""

    prompt_id: PromptId
    policy_version: int
    ref: Any


@dataclass(frozen=True)
class ResumePlan:
    """What ``resume`` decided after a restore."""

    reissue: list[PromptId]
    """Prompts to generate again, first: in flight at the save, or buffered and dropped by the
    rule."""
    kept: list[Rollout]
    """Buffered rollouts kept, with their policy version."""
    dropped_stale: list[PromptId] = field(default_factory=list)
    """The buffered ones dropped for being more than ``max_staleness`` versions old (also in
    ``reissue``)."""
    trained: int = 0
    policy_version: int = 0


def _check_id(prompt_id: Any, where: str) -> PromptId:
    if isinstance(prompt_id, bool) or not isinstance(prompt_id, (int, str)):
        raise ConfigError(
            f"{where}: a prompt id is an int or a str, got "
            f"{type(prompt_id).__name__} {prompt_id!r:.40}"
        )
    return prompt_id


class RolloutLedger:
    """The prompts of an asynchronous RL run: in flight, buffered (with their policy version),
    trained.

    Thread-safe: a producer thread may issue and complete while the trainer takes, trains and saves.
    """

    def __init__(
        self,
        source: Iterable[PromptId] | None = None,
        *,
        max_staleness: int | None = None,
        keep_buffered: bool = True,
    ) -> None:
        if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
            raise ConfigError(
                f"RolloutLedger(max_staleness={max_staleness!r}): an int >= 0, or None for no limit"
            )
        self.max_staleness = max_staleness
        self.keep_buffered = bool(keep_buffered)
        self._source = source
        self._stateful = callable(getattr(source, "state_dict", None)) and callable(
            getattr(source, "load_state_dict", None)
        )
        self._iter: Iterator[PromptId] | None = None
        self._source_open = (
            False  # a stateful source's iteration was started (saved: a restore continues it)
        )
        self._lock = threading.RLock()
        self._pending_resume = False
        self.policy_version = 0
        self._drawn = 0
        self._in_flight: dict[PromptId, int] = {}
        self._buffered: dict[PromptId, tuple[int, Any]] = {}  # completion order
        self._taken: dict[PromptId, tuple[int, Any]] = {}  # handed to the trainer, not trained yet
        self._reissue: list[PromptId] = []
        self._trained: set[PromptId] = set()
        self._last_step = 0
        self._counts = {
            "issued": 0,
            "completed": 0,
            "trained": 0,
            "reissued": 0,
            "dropped_stale": 0,
        }
        self._trained_staleness: dict[int, int] = {}

    # ------------------------------------------------------------ feeding

    def issued(self, prompt_id: PromptId, policy_version: int | None = None) -> None:
        """``prompt_id`` went to generation with the policy of ``policy_version`` (default: the
        current one)."""
        _check_id(prompt_id, "issued")
        with self._lock:
            self._resume_if_pending()  # the first use after a restore applies the rule first
            if (
                prompt_id in self._in_flight
                or prompt_id in self._buffered
                or prompt_id in self._taken
            ):
                raise ConfigError(
                    f"issued({prompt_id!r}): the prompt is already in flight or buffered"
                )
            if prompt_id in self._trained:
                raise ConfigError(
                    f"issued({prompt_id!r}): the prompt was already trained on; "
                    f"prompt ids are unique within a run (for several epochs use "
                    f"e.g. epoch * len(dataset) + index)"
                )
            if prompt_id in self._reissue:
                self._reissue.remove(prompt_id)
                self._counts["reissued"] += 1
            version = self.policy_version if policy_version is None else int(policy_version)
            self._in_flight[prompt_id] = version
            self._counts["issued"] += 1

    def completed(self, prompt_id: PromptId, rollout_ref: Any = None) -> None:
        """The rollout of ``prompt_id`` is back and buffered; ``rollout_ref`` finds it again."""
        with self._lock:
            self._resume_if_pending()  # the first use after a restore applies the rule first
            if prompt_id not in self._in_flight:
                raise ConfigError(
                    f"completed({prompt_id!r}): the prompt is not in flight (never "
                    f"issued, completed twice, or issued before a restore: its "
                    f"producer is gone and it is re-issued)"
                )
            self._buffered[prompt_id] = (self._in_flight.pop(prompt_id), rollout_ref)
            self._counts["completed"] += 1

    def take(self, n: int) -> list[Rollout]:
        """Up to ``n`` buffered rollouts, oldest completion first, for the next training step.

        Rollouts more than ``max_staleness`` versions behind the current policy are dropped
        (re-issued, counted) instead. Taken rollouts stay in the saved state as buffered until
        ``trained`` names them."""
        with self._lock:
            self._resume_if_pending()
            out: list[Rollout] = []
            for pid in list(self._buffered):
                if len(out) == n:
                    break
                version, ref = self._buffered[pid]
                if self._stale(version):
                    self._drop(pid)
                    continue
                del self._buffered[pid]
                self._taken[pid] = (version, ref)
                out.append(Rollout(pid, version, ref))
            return out

    def trained(
        self, prompt_ids: Iterable[PromptId], step: int, *, policy_version: int | None = None
    ) -> None:
        """Training step ``step`` consumed the rollouts of ``prompt_ids``; the policy is then at
        version ``policy_version`` (default: ``step``)."""
        ids = list(prompt_ids)
        with self._lock:
            self._resume_if_pending()  # the first use after a restore applies the rule first
            unknown = [p for p in ids if p not in self._taken and p not in self._buffered]
            if unknown or len(set(ids)) != len(ids):
                raise ConfigError(
                    f"trained(step={step}): prompts {unknown[:8] or ids} were not completed (or "
                    f"are named twice); a prompt is trained once, after completed()"
                )
            for pid in ids:
                version, _ref = (
                    self._taken.pop(pid) if pid in self._taken else self._buffered.pop(pid)
                )
                lag = self.policy_version - version
                self._trained_staleness[lag] = self._trained_staleness.get(lag, 0) + 1
                self._trained.add(pid)
            self._counts["trained"] += len(ids)
            self._last_step = int(step)
            self.policy_version = int(step if policy_version is None else policy_version)

    def next_prompt(self) -> PromptId | None:
        """The next prompt to issue, marked issued at the current policy version: re-issues first,
        then the source's next id; None when both are exhausted."""
        with self._lock:
            self._resume_if_pending()
            if self._reissue:
                pid = self._reissue[0]
            else:
                if self._source is None:
                    raise ConfigError(
                        "next_prompt(): this ledger has no source; pass RolloutLedger(source=...)"
                    )
                if self._iter is None:
                    self._iter = self._open_source()
                drawn = next(self._iter, None)
                if drawn is None:
                    return None
                pid = drawn
                self._drawn += 1
            self.issued(pid)
            return pid

    def _open_source(self) -> Iterator[PromptId]:
        """The source's iteration: a plain source restarts and skips what was drawn; a stateful one
        resumes itself, and one that was being iterated at the save continues that iteration
        (``DataCursor.rest``: a cursor restored at the end of its epoch yields nothing, as the
        uninterrupted iteration, instead of starting the next epoch over prompts already
        trained)."""
        assert self._source is not None
        if not self._stateful:
            return itertools.islice(iter(self._source), self._drawn, None)
        rest = getattr(self._source, "rest", None)
        if self._source_open and callable(rest):
            return iter(rest())
        self._source_open = True
        return iter(self._source)

    # ------------------------------------------------------------ after a restore

    def resume(self) -> ResumePlan:
        """Apply the declared rule to what the restored state holds (once after each restore)."""
        with self._lock:
            self._pending_resume = False
            reissue = list(self._in_flight)
            self._in_flight.clear()
            # Taken but untrained rollouts were buffered at the save: back to the buffer first.
            self._buffered = {**self._taken, **self._buffered}
            self._taken.clear()
            stale = [p for p, (v, _r) in self._buffered.items() if self._stale(v)]
            dropped = stale if self.keep_buffered else list(self._buffered)
            for pid in dropped:
                del self._buffered[pid]
            self._counts["dropped_stale"] += len(stale)
            self._reissue = [
                *self._reissue,
                *[p for p in reissue + dropped if p not in self._reissue],
            ]
            plan = ResumePlan(
                reissue=list(self._reissue),
                kept=[Rollout(p, v, r) for p, (v, r) in self._buffered.items()],
                dropped_stale=stale,
                trained=len(self._trained),
                policy_version=self.policy_version,
            )
        log.info(
            "ckptguard: rollout ledger resumed at policy version %d: %d prompt(s) trained, %d "
            "buffered rollout(s) kept, %d prompt(s) re-issued (%d in flight at the save, %d "
            "stale beyond %s version(s)%s)",
            plan.policy_version,
            plan.trained,
            len(plan.kept),
            len(plan.reissue),
            len(reissue),
            len(stale),
            self.max_staleness,
            "" if self.keep_buffered else ", and every buffered one: keep_buffered=False",
        )
        return plan

    def _resume_if_pending(self) -> None:
        if self._pending_resume:
            self.resume()

    def _stale(self, version: int) -> bool:
        return self.max_staleness is not None and self.policy_version - version > self.max_staleness

    def _drop(self, pid: PromptId) -> None:
        del self._buffered[pid]
        self._reissue.append(pid)
        self._counts["dropped_stale"] += 1

    # ------------------------------------------------------------ queries

    @property
    def in_flight(self) -> dict[PromptId, int]:
        with self._lock:
            return dict(self._in_flight)

    @property
    def buffered(self) -> list[Rollout]:
        with self._lock:
            return [Rollout(p, v, r) for p, (v, r) in {**self._taken, **self._buffered}.items()]

    @property
    def trained_ids(self) -> set[PromptId]:
        with self._lock:
            return set(self._trained)

    @property
    def pending_reissue(self) -> list[PromptId]:
        with self._lock:
            return list(self._reissue)

    def counters(self) -> LedgerCounters:
        """Totals (issued, completed, trained, reissued, dropped_stale, drawn from the source), the
        policy version, and staleness: of the buffered rollouts now (the largest) and of the trained
        ones (versions behind -> count)."""
        with self._lock:
            lags = [
                self.policy_version - v
                for v, _r in [*self._taken.values(), *self._buffered.values()]
            ]
            c = self._counts
            return {
                "issued": c["issued"],
                "completed": c["completed"],
                "trained": c["trained"],
                "reissued": c["reissued"],
                "dropped_stale": c["dropped_stale"],
                "policy_version": self.policy_version,
                "last_step": self._last_step,
                "drawn": self._drawn,
                "in_flight": len(self._in_flight),
                "buffered": len(lags),
                "max_buffered_staleness": max(lags, default=0),
                "trained_staleness": dict(sorted(self._trained_staleness.items())),
            }

    # ------------------------------------------------------------ state

    def state_dict(self) -> StateDict:
        """Plain values (and the source's state), so ``torch.load(weights_only=True)`` reads them
        back."""
        with self._lock:
            out: dict[str, Any] = {
                "version": STATE_VERSION,
                "policy_version": self.policy_version,
                "last_step": self._last_step,
                "drawn": self._drawn,
                "in_flight": [[p, v] for p, v in self._in_flight.items()],
                # taken-but-untrained rollouts are buffered as far as a restart is concerned
                "buffered": [[p, v, r] for p, (v, r) in {**self._taken, **self._buffered}.items()],
                "reissue": list(self._reissue),
                "trained": sorted(self._trained, key=lambda p: (isinstance(p, str), p)),
                "counts": dict(self._counts),
                "trained_staleness": [[k, n] for k, n in sorted(self._trained_staleness.items())],
            }
            if self._stateful:
                out["source"] = self._source.state_dict()  # type: ignore[union-attr]
                out["source_open"] = self._source_open
            return out

    def load_state_dict(self, state: StateDict) -> None:
        """Exactly the saved state; the rule is applied by ``resume`` (a restore checks the digest
        first)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise StateMismatchError(
                f"RolloutLedger.load_state_dict: not a ledger state of version {STATE_VERSION} "
                f"(got {type(state).__name__} with version "
                f"{getattr(state, 'get', lambda k: None)('version')!r})"
            )
        if self._stateful != ("source" in state):
            raise StateMismatchError(
                "RolloutLedger.load_state_dict: the saved ledger "
                + (
                    "held its source's state, this one has a plain source"
                    if "source" in state
                    else "had a plain source, this one has a stateful one"
                )
                + "; build the ledger with the same kind of source as the saving run"
            )
        with self._lock:
            self.policy_version = int(state["policy_version"])
            self._last_step = int(state["last_step"])
            self._drawn = int(state["drawn"])
            self._in_flight = {p: int(v) for p, v in state["in_flight"]}
            self._buffered = {p: (int(v), r) for p, v, r in state["buffered"]}
            self._taken = {}
            self._reissue = list(state["reissue"])
            self._trained = set(state["trained"])
            self._counts = {k: int(n) for k, n in state["counts"].items()}
            self._trained_staleness = {int(k): int(n) for k, n in state["trained_staleness"]}
            if self._stateful:
                self._source.load_state_dict(state["source"])  # type: ignore[union-attr]
            self._source_open = bool(
                state.get("source_open", False)
            )  # absent in states of older ckptguard
            self._iter = None
            self._pending_resume = True
