"""Append-only proof records, one JSONL file per rank (``ROOT/proof/rank_NNNNN.jsonl``; a role of a
``RunCheckpoint``: ``ROOT/proof/<role>/rank_NNNNN.jsonl``, numbered by the role's ranks).

Records are appended and never edited. A file that grew past ``ProofLog.PRUNE_BYTES`` is
rewritten at a save without the records no proof can read again (``prunable``): those
before the oldest checkpoint on disk, except what the proof of the newest restore reads.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import FullyShardedDataParallel

from .._disk.boxsum import layout_free_partials
from .._disk.layout import (
    PROOF_DIR,
    StepNaming,
    atomic_write_bytes,
    parse_json,
    read_small,
    refuse_link,
    step_dirs,
)
from .._disk.tempfiles import proc_start
from .._log import NAME
from .._state.state import ItemKind, KeyFn, classify, current_state, flatten
from .._state.trajectory import rng_digests
from .._types import JsonObject
from .._version import __version__
from ..errors import CheckpointCorruptError, ConfigError, UnsafeCheckpointError
from .proofreader import PROOF_BYTES, ProofRecord, header_problem, records_dir
from .resumewatch import ResumeWatch

_HOST = socket.gethostname()


@functools.lru_cache(maxsize=4)
def _start(pid: int) -> str | None:
    """The process's start time (``/proc``), read once per process: with the PID it tells a
    relaunch from the process that saved where a restarted container gives the PID back."""
    return proc_start(pid)


log = logging.getLogger(NAME)


class ProofLog:
    """One rank's append-only proof records.

    Records made before the root exists (a fresh run's restore record, its steps and exports
    before the first save) are held in memory and written, in order, as soon as the root exists:
    by the first save's prepare, right after it created the root (``write_held``), or by the
    first append that finds it. A mistyped root must stay visible, so a record never creates it.
    The bound: the first ``HELD_HEAD`` records (the launch's restore record, its first step:
    what prove compares a later launch's first step with) and the newest ``HELD_MAX``; the
    records between are dropped and counted (logged once written). A step record holds about
    1.3 KB in memory (measured), so at most about 26 MB per rank.
    """

    HELD_HEAD = 64  # the first records held, always kept
    HELD_MAX = 20_000  # the newest records held after those; older ones are dropped beyond this

    def __init__(self, root: Path, rank: int, *, role: str | None = None) -> None:
        self.root = Path(root)
        self.path = records_dir(root, role) / f"rank_{rank:05d}.jsonl"
        self.rank = rank
        self._head: list[ProofRecord] = []
        self._held: deque[ProofRecord] = deque(maxlen=self.HELD_MAX)
        self.dropped = 0
        self._tail_checked = False
        self._pruned_to = 0  # the file's size after the last prune: the next waits until it doubled
        # A save_async commits (and prunes, and writes the held records) in a background thread
        # while training appends step records: a record appended between a read and its rewrite
        # would be lost.
        self._lock = threading.Lock()
        self.watch = ResumeWatch(
            rank, str(self.path), lambda event, **fields: self.keep(self.build(event, **fields))
        )
        self.code: str | None = (
            None  # the run contract's code hash, recorded with saves and restores (prove shows it)
        )
        self._rng_due = (
            False  # the next step record carries the RNG streams' digests (after a save or restore)
        )
        self._first_step: Callable[[], JsonObject] | None = (
            None  # fields of the next step record (a restore's)
        )

    def build(self, event: str, **fields: Any) -> ProofRecord:
        """The record of ``event`` with the header every record carries; ConfigError for a field
        that would make it unreadable (a ``time`` that is not a number)."""
        if event == "step":  # the thread count splits CPU reductions: prove names a change of it
            fields.setdefault("threads", torch.get_num_threads())
            if (
                self._rng_due
            ):  # the streams after the first step past a save or restore: prove compares them
                self._rng_due = False
                fields.setdefault("rng", rng_digests())
            if (
                self._first_step is not None
            ):  # the replicas again, once training ran past the restore
                due, self._first_step = self._first_step, None
                fields.update(_computed(due, self.rank))
        elif event in (
            "save",
            "restore",
        ):  # which code saved, which resumed: prove says when they differ
            code = {
                "ckptguard": __version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
            }
            fields.setdefault("code", {**code, **({"hash": self.code} if self.code else {})})
            self._rng_due = True
        raw = {
            "event": event,
            "rank": self.rank,
            "pid": os.getpid(),
            "host": _HOST,
            "start": _start(os.getpid()),
            "time": time.time(),
            "mono": time.monotonic(),
            **fields,
        }
        problem = header_problem(raw)
        if problem:
            raise ConfigError(
                f"the {event} proof record of rank {self.rank} for {self.path} would not read back "
                f"({problem}): pass what the record_* call names as documented"
            )
        record = ProofRecord.of(raw)
        self.watch.observe(record)
        return record

    def after_restore(self, fields: Callable[[], JsonObject] | None) -> None:
        """The next step record carries ``fields()`` (``replica_fields`` of the restored state):
        replicas that drift after ``restore()`` returned (a hook, a late broadcast) are in the first
        step's records, named by tensor, before any save. None: nothing more in it."""
        self._first_step = fields

    def hold(self, record: ProofRecord) -> None:
        with self._lock:
            self._hold(record)

    def _hold(self, record: ProofRecord) -> None:
        if len(self._head) < self.HELD_HEAD:
            self._head.append(record)
        else:
            if len(self._held) == self._held.maxlen:
                self.dropped += 1
            self._held.append(record)
        with _HOLDING_LOCK:
            _HOLDING.add(self)

    @property
    def held(self) -> int:
        return len(self._head) + len(self._held)

    def write(self, record: ProofRecord, *, durable: bool = True) -> None:
        """Append the held records and ``record``. ``durable`` fsyncs (saves, restores); a step
        record is only written, which a SIGKILL of the process does not lose (a node crash may)."""
        with self._lock:
            self._write(record, durable)

    def _write(self, record: ProofRecord | None, durable: bool) -> None:
        refuse_link(
            self.root / PROOF_DIR, "proof directory"
        )  # appending through a link writes outside the root
        refuse_link(self.path.parent, "proof directory")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        held = [*self._head, *self._held]
        lines = [
            json.dumps(r.raw, sort_keys=True) + "\n" for r in (*held, *([record] if record else []))
        ]
        if not self._tail_checked:
            # A process killed mid-append leaves a torn last line: end it, so our records start on
            # their own.
            self._tail_checked = True
            if self.path.exists() and self.path.stat().st_size:
                with open(self.path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        lines.insert(0, "\n")
        with open(self.path, "a") as f:
            f.write("".join(lines))
            f.flush()
            if durable or held:
                os.fsync(f.fileno())
        self._head.clear()
        self._held.clear()
        with _HOLDING_LOCK:
            _HOLDING.discard(self)
        if self.dropped:
            log.warning(
                "ckptguard: %d proof records made before %s existed were dropped (the first %d and "
                "the newest %d were held)",
                self.dropped,
                self.root,
                self.HELD_HEAD,
                self.HELD_MAX,
            )
            self.dropped = 0

    def write_held(self) -> None:
        """Write the held records now if the root exists; a failure is logged, never raised."""
        with self._lock:
            if not (self._head or self._held) or not self.root.is_dir():
                return
            try:
                self._write(None, durable=True)
            except (OSError, UnsafeCheckpointError) as exc:
                log.warning(
                    "ckptguard: could not write %d held proof records to %s (%s)",
                    self.held,
                    self.path,
                    exc,
                )

    def append(self, event: str, **fields: Any) -> None:
        self.write(self.build(event, **fields))

    def keep(self, record: ProofRecord, *, durable: bool = True) -> None:
        """Write ``record`` (after the held ones), or hold it while the root does not exist; never
        raises: a read-only or full root, or a symlinked proof/, is logged and training goes on."""
        with self._lock:
            if (
                not self.root.is_dir()
            ):  # a record never creates the root: a mistyped path must stay visible
                self._hold(record)
                return
        try:
            self.write(record, durable=durable)
        except (OSError, UnsafeCheckpointError) as exc:
            log.warning(
                "ckptguard: could not append the %s proof record to %s (%s)",
                record.event,
                self.path,
                exc,
            )

    PRUNE_BYTES = 8 << 20
    """A records file smaller than this is never rewritten (the rewrite reads the whole file)."""
    PRUNE_GROWTH = 2.0
    """After a prune the next waits until the file grew this much: the rewrites cost O(1) per
    record."""

    def prune(self, naming: StepNaming) -> int:
        """Rewrite this rank's file without the records no proof can read again (``prunable``);
        returns how many lines were dropped. Called after a save, by the process that appends to
        the file (no other writer). A failure is logged, never raised: the records stay whole."""
        with self._lock:
            return self._prune(naming)

    def _prune(self, naming: StepNaming) -> int:
        try:
            size = self.path.stat().st_size if self.path.is_file() else 0
            if not size or size < max(self.PRUNE_BYTES, self.PRUNE_GROWTH * self._pruned_to):
                return 0
            steps = step_dirs(self.root, naming)  # committed or not: a smaller oldest keeps more
            if not steps:
                return 0
            refuse_link(self.path.parent, "proof directory")
            lines = read_small(self.path, limit=PROOF_BYTES, what="proof records").splitlines(
                keepends=True
            )
            drop = prunable([_parsed(line) for line in lines], min(steps))
            gone = sum(b - a for a, b in drop)
            self._pruned_to = (
                self.path.stat().st_size
            )  # also when nothing goes: no re-read at every save
            if not gone:
                return 0
            dropped = {i for a, b in drop for i in range(a, b)}
            kept = b"".join(line for i, line in enumerate(lines) if i not in dropped)
            if kept and not kept.endswith(b"\n"):
                kept += b"\n"  # a torn last line ends here, so the next append starts its own
            atomic_write_bytes(self.path, kept)
            self._pruned_to = len(kept)
        except (OSError, ValueError, CheckpointCorruptError) as exc:
            log.warning(
                "ckptguard: could not prune the proof records %s (%s); they are kept whole",
                self.path,
                exc,
            )
            return 0
        log.info(
            "ckptguard: pruned %d proof records of %s older than step %d's save",
            gone,
            self.path,
            min(steps),
        )
        return gone


def _computed(due: Callable[[], JsonObject], rank: int) -> JsonObject:
    try:
        return due()
    except Exception as exc:  # a record never stops training: it says why its digests are absent
        log.warning(
            "ckptguard: rank %d: the replica digests of the first step after the restore were not "
            "recorded (%s: %s)",
            rank,
            type(exc).__name__,
            exc,
        )
        return {"replicas_error": f"{type(exc).__name__}: {exc}"[:500]}


def replica_fields(state: Mapping[str, Any], keyfn: KeyFn) -> JsonObject:
    """This rank's digests of what several ranks may hold alike, for the first step record after a
    restore: ``{"replica_partials": {chunk id: [item, key, header, partial]}}``, the restore's own
    ``layout_free_partials`` of every tensor of the model, optimizer and tensor items that is not
    a sharded DTensor piece (a plain tensor, or a DTensor replicated on some mesh dimension).
    ``prove`` compares the ranks' with ``_resume.layoutcheck.replica_report``, as the restore did.
    Reads the live tensors only: no ``state_dict()`` of a stateful item (a loader's may draw from
    the global RNG), no copy."""
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in state.items():
        kind = classify(value)
        if kind not in (ItemKind.MODULE, ItemKind.OPTIMIZER, ItemKind.TENSORS):
            continue
        flat: dict[str, torch.Tensor] = {}
        flatten(current_state(name, value, kind, state), name, flat, keyfn)
        tensors[name] = {k: t for k, t in flat.items() if _maybe_replicated(t)}
    return {"replica_partials": layout_free_partials(tensors)}


def read_alone(state: Mapping[str, Any]) -> bool:
    """Whether this rank reads ``state``'s tensors without a collective (``replica_fields`` runs in
    a ``record_step``, which need not be called on every rank): not under FSDP1, whose optimizer
    ``state_dict`` gathers keys across ranks (torch's ``_map_param_key_to_optim_keys``)."""
    modules = [v for v in state.values() if isinstance(v, torch.nn.Module)]
    return not any(isinstance(m, FullyShardedDataParallel) for v in modules for m in v.modules())


def _maybe_replicated(t: torch.Tensor) -> bool:
    placements = getattr(t, "placements", None)
    return placements is None or any(p.is_replicate() for p in placements)


_HOLDING: weakref.WeakSet[ProofLog] = weakref.WeakSet()  # this process's logs holding records
# A save_async's prepare lists them in its thread while training holds a record in another: a set
# that changes size while it is listed raises (RuntimeError), which would fail the save.
_HOLDING_LOCK = threading.Lock()


def write_held() -> None:
    """Write the held records of every log of this process whose root exists now, in order. A save
    calls it right after its prepare created the root (``_commit.protocol.prepare``): a kill right
    after the first commit, before the save record, then leaves the fresh run's records on disk
    (prove's "all PIDs changed" finds the process that trained the saved step)."""
    with _HOLDING_LOCK:
        logs = list(_HOLDING)
    for (
        plog
    ) in logs:  # each its own lock, never under _HOLDING_LOCK (a hold takes them the other way)
        plog.write_held()


def process_start() -> float | None:
    """This process's start as a wall-clock time (seconds since the epoch), for the time to recover
    (``ckptguard goodput``): now less the process's age, its start in /proc against CLOCK_BOOTTIME
    (1/CLK_TCK resolution; /proc/stat's btime is whole seconds and drifts from the wall clock).
    None where it cannot be read."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(
            stat[stat.rindex(")") + 2 :].split()[19]
        )  # field 22, starttime (after the command name)
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _parsed(line: bytes) -> ProofRecord | None:
    try:
        return ProofRecord.from_json(parse_json(line, where="proof record"), where="proof record")
    except (CheckpointCorruptError, UnicodeDecodeError):
        return None  # a torn line (or not a record): kept where it is, unless in a dropped range


Records = Sequence[
    ProofRecord | None
]  # one rank's file, line by line; None where a line is not a record


def _step(rec: ProofRecord | None) -> int | None:
    return rec.step if rec is not None else None


def _last_save(recs: Records, step: int, before: int) -> int | None:
    return next(
        (i for i in range(before - 1, -1, -1) if _is(recs[i], "save") and _step(recs[i]) == step),
        None,
    )


def _is(rec: ProofRecord | None, event: str) -> bool:
    return rec is not None and rec.event == event


def _window(recs: Records, save: int) -> int:
    """Where the records that led to the save at ``save`` start: right after the previous save
    (the steps, export and logprobs of that interval belong to it)."""
    return next((i + 1 for i in range(save - 1, -1, -1) if _is(recs[i], "save")), 0)


def prunable(recs: Records, oldest: int) -> list[tuple[int, int]]:
    """The index ranges ``[a, b)`` of one rank's records that no proof reads again, with
    ``oldest`` the oldest step on disk (any later resume starts from it or a newer one).

    Kept: everything from the interval that led to the last save of ``oldest`` on (every later
    save, the killed segment after the last one); and, when the newest restore came before
    that, what its proof reads: the interval before the save it restored, the restore, and
    after it the process's records up to its first save, the last step the killed run recorded,
    and the first record of every kind. Nothing is dropped where a needed save is not found."""
    save = _last_save(recs, oldest, len(recs))
    if save is None:
        return []
    keep_from = _window(recs, save)
    restore = next((i for i in range(len(recs) - 1, -1, -1) if _is(recs[i], "restore")), None)
    if restore is None or restore >= keep_from:
        if restore is not None and (
            k := _step(recs[restore])
        ):  # its save may precede oldest's (a rerun)
            own = _last_save(recs, k, restore)
            if own is None:
                return []
            keep_from = min(keep_from, _window(recs, own))
        return [(0, keep_from)] if keep_from else []
    rec = recs[restore]
    assert rec is not None
    k, pid = _step(rec) or 0, rec.pid
    out: list[tuple[int, int]] = []
    if k:
        own = _last_save(recs, k, restore)
        if own is None:
            return []
        start = _window(recs, own)
        saver = recs[own].pid  # type: ignore[union-attr]  # _last_save found a save record there
        killed = [
            s
            for r in recs[own + 1 : restore]
            if r is not None
            and r.event == "step"
            and r.pid == saver
            and (s := r.step) is not None
            and s > k
        ]
        last_killed = max(killed, default=k)
    else:
        start, last_killed = restore, 0  # a fresh start reads nothing before it
    if start:
        out.append((0, start))
    end, seen, saved = restore, set(), False
    for i in range(restore + 1, keep_from):
        r = recs[i]
        if r is None or r.pid != pid:
            continue
        event, s = r.event, r.step
        if event not in seen or not saved or (s is not None and s <= last_killed):
            end = i
        seen.add(event)
        saved = saved or event == "save"
    if end + 1 < keep_from:
        out.append((end + 1, keep_from))
    return out
