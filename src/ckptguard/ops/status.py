"""Where each rank is now, from the phase records: "slow is not a hang".

Contract: for each rank, the newest phase that started and has not ended, how long it has
run, how that compares with the median duration of that phase in the same records, and
whether the process is using CPU or doing I/O right now (two /proc readings ``sample_s``
apart, on this node only). A rank with neither CPU nor I/O far beyond its typical
duration is reported as stalled; a busy one as slow. Processes on other nodes are
reported without a sample, never guessed.

PATH may be a RunCheckpoint root: each rank is shown with the roles it holds (from the tracker's
run step; ranks are the run's ranks, as the PhaseRecorders of the run's processes number them).

On a checkpoint root, ``busy_saves`` adds what a commit in flight kept from the disk: the saves
skipped, coalesced and redirected to the fast tier since the last save rank 0 recorded, from its
proof records (``ckptguard goodput`` has them per launch).
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._records import proofreader as _proofreader
from ..errors import CheckpointCorruptError
from ..memory.records import read_records

TICKS = os.sysconf("SC_CLK_TCK")
STALL_FACTOR = 3.0
"""A phase this many times longer than its median counts as overdue."""


@dataclass
class RankStatus:
    rank: int
    pid: int
    node: str
    phase: str | None
    step: int | None
    in_phase_s: float | None
    typical_s: float | None
    cpu_fraction: float | None
    io_bytes_per_s: float | None
    verdict: str
    roles: list[str] | None = None  # a run root: the roles this rank holds
    host_cache: str | None = None  # the newest measured release of the save_async staging pool

    @property
    def needs_attention(self) -> bool:
        """Stalled, or died inside a phase: what a watchdog acts on (``ckptguard status`` exits
        1)."""
        return self.verdict.startswith("STALLED") or self.verdict.startswith("EXITED inside")


def _cpu_and_io(pid: int) -> tuple[float, int] | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / TICKS
        io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        return cpu, int(io["rchar"]) + int(io["wchar"])
    except (OSError, IndexError, KeyError, ValueError):
        return None


def _open_phases(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per rank: the newest phase_start without a matching end or failure."""
    open_: dict[int, dict[str, Any]] = {}
    for rec in records:
        kind, rank = rec.get("kind"), rec.get("rank")
        if rank is None:
            continue
        if kind == "phase_start":
            open_[rank] = rec
        elif (
            kind in ("phase_end", "phase_failure")
            and rank in open_
            and open_[rank].get("phase") == rec.get("phase")
        ):
            del open_[rank]
    return open_


def _typical(records: list[dict[str, Any]]) -> dict[str, float]:
    durations: dict[str, list[float]] = {}
    for rec in records:
        if rec.get("kind") == "phase_end" and rec.get("duration_s") is not None:
            durations.setdefault(rec["phase"], []).append(float(rec["duration_s"]))
    return {phase: statistics.median(v) for phase, v in durations.items()}


def _check(records: list[dict[str, Any]]) -> None:
    """Rank records carry what ``status`` relies on; a damaged one is one clear error, not a
    KeyError."""
    for rec in records:
        if rec.get("rank") is None:
            continue
        bad = [
            name
            for name, ok in (
                ("rank", _int(rec.get("rank"))),
                ("pid", _int(rec.get("pid"))),
                ("mono_ns", _int(rec.get("mono_ns"))),
                ("wall_time", isinstance(rec.get("wall_time"), (int, float))),
                ("node", isinstance(rec.get("node", ""), str)),
                (
                    "phase",
                    isinstance(rec.get("phase"), str)
                    or not str(rec.get("kind")).startswith("phase_"),
                ),
                (
                    "duration_s",
                    rec.get("duration_s") is None
                    or isinstance(rec.get("duration_s"), (int, float)),
                ),
            )
            if not ok
        ]
        if bad:
            raise CheckpointCorruptError(
                f"a {rec.get('kind')} record of rank {rec.get('rank')!r} has no valid {bad} (ints "
                f"for rank, pid and mono_ns, a number for wall_time); it was not written by "
                f"PhaseRecorder: fix or cut that line"
            )


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


BUSY_KINDS = {"busy_skip": "skipped", "busy_coalesced": "coalesced", "busy_redirect": "redirected"}


@dataclass(frozen=True)
class BusySaves:
    """Saves requested while a commit was in flight, from rank 0's proof records (the first role's
    on a run root): those no committed step's cost block carries yet, the ones after the newest step
    this launch saved (``since_step``; None: it saved none yet), and the count in all its
    records."""

    since_step: int | None
    pending: dict[str, list[int]]  # skipped / coalesced / redirected -> the steps, since since_step
    totals: dict[str, int]

    def line(self) -> str:
        def said(kinds: dict[str, int]) -> str:
            return ", ".join(f"{n} {kind}" for kind, n in kinds.items() if n) or "none"

        since = (
            f"after step {self.since_step}"
            if self.since_step is not None
            else "before this launch's first save"
        )
        steps = "; ".join(
            f"{kind} steps {v[:8]}{' ...' if len(v) > 8 else ''}"
            for kind, v in self.pending.items()
            if v
        )
        now = said({k: len(v) for k, v in self.pending.items()})
        hint = (
            (
                ": a save was requested while the previous commit ran; space the saves wider than "
                "one commit (ckptguard goodput ROOT prints the interval)"
            )
            if any(self.pending.values())
            else ""
        )
        return (
            f"saves held back by a commit in flight {since}: "
            f"{now}{f' ({steps})' if steps else ''}; in all the proof records: "
            f"{said(self.totals)}{hint}"
        )


def busy_saves(root: str | os.PathLike[str]) -> BusySaves | None:
    """What a commit in flight kept from the disk (``BusySaves``), or None where ``root`` has no
    proof records."""
    root = Path(root)
    if not _proofreader.records_dir(root).is_dir():
        return None
    roles = _proofreader.record_roles(root)
    records = _proofreader.read_records(root, roles[0] if roles else None, rank=0).get(0, [])
    if not records:
        return None
    # This launch's records (from its restore on): a skip made while step k committed is carried by
    # the next committed step's cost block, so what is still held back is what came after the newest
    # saved step.
    launch = max((i for i, r in enumerate(records) if r.event == "restore"), default=0)
    saved = max(
        (r.step for r in records[launch:] if r.event == "save" and r.step is not None), default=None
    )
    pending: dict[str, list[int]] = {kind: [] for kind in BUSY_KINDS.values()}
    totals = dict.fromkeys(BUSY_KINDS.values(), 0)
    for i, r in enumerate(records):
        kind = BUSY_KINDS.get(r.event)
        if kind is None:
            continue
        totals[kind] += 1
        if i >= launch and r.step is not None and (saved is None or r.step > saved):
            pending[kind].append(r.step)
    return BusySaves(saved, pending, totals)


def run_rank_roles(path: str | os.PathLike[str]) -> dict[int, list[str]] | None:
    """A RunCheckpoint root: each run rank and the roles it holds (the tracker's run step), else
    None."""
    path = Path(path)
    from .._records import runmanifest
    from .inspect import tracker_run_step

    step_dir = tracker_run_step(path) if path.is_dir() else None
    if step_dir is None:
        return None
    out: dict[int, list[str]] = {}
    for role, entry in runmanifest.read(step_dir).roles.items():
        for rank in entry.ranks:
            out.setdefault(rank, []).append(role)
    return {rank: sorted(roles) for rank, roles in sorted(out.items())}


def status(
    paths: Sequence[str | os.PathLike[str]],
    *,
    sample_s: float = 0.5,
    roles: dict[int, list[str]] | None = None,
) -> list[RankStatus]:
    records = read_records([Path(p) for p in paths])
    _check(records)
    open_ = _open_phases(records)
    typical = _typical(records)
    last, released = {}, {}
    for rec in records:
        if rec.get("rank") is None:
            continue
        if (
            rec.get("kind") == "host_cache_release"
        ):  # after a save, not a phase: the phase lines stay the rank's
            released[rec["rank"]] = _released(rec)
        else:
            last[rec["rank"]] = rec
    here = socket.gethostname()
    local = [r["pid"] for r in last.values() if r.get("node") == here]
    first = {pid: _cpu_and_io(pid) for pid in local}
    time.sleep(sample_s if local else 0)
    second = {pid: _cpu_and_io(pid) for pid in local}
    out = []
    for rank in sorted(last):
        rec = open_.get(rank, last[rank])
        st = _judge(
            rank,
            rec,
            rank in open_,
            typical,
            first.get(rec["pid"]),
            second.get(rec["pid"]),
            sample_s,
            rec.get("node") == here,
        )
        if roles is not None:
            st.roles = roles.get(rank, [])
        st.host_cache = released.get(rank)
        out.append(st)
    return out


def _mib(n: Any) -> str | None:
    return (
        f"{n / (1 << 20):.1f} MiB"
        if isinstance(n, (int, float)) and not isinstance(n, bool)
        else None
    )


def _released(rec: dict[str, Any]) -> str:
    """One line for a host_cache_release record (memory.records): what was released, after which
    save."""
    after, drop = rec.get("after_save_s"), _mib(rec.get("rss_drop"))
    save = (
        f"{after:.1f} s after the save of step {rec.get('step')}"
        if isinstance(after, (int, float))
        else "after no recorded save phase"
    )
    rss = f"RSS -{drop}" if drop is not None else "RSS drop not measured"
    return (
        f"host staging {_mib(rec.get('released_bytes')) or '?'} released {save} "
        f"({rec.get('how')}; {rss})"
    )


def _judge(
    rank: int,
    rec: dict[str, Any],
    in_phase: bool,
    typical: dict[str, float],
    a: Any,
    b: Any,
    sample_s: float,
    local: bool,
) -> RankStatus:
    phase = rec.get("phase") if in_phase else None
    elapsed = (
        (time.monotonic_ns() - rec["mono_ns"]) / 1e9 if local else time.time() - rec["wall_time"]
    )
    st = RankStatus(
        rank,
        rec["pid"],
        rec.get("node", "?"),
        phase,
        rec.get("step"),
        elapsed if in_phase else None,
        typical.get(phase) if phase else None,
        None,
        None,
        "",
    )
    if not local:
        st.verdict = "on another node: not sampled"
        return st
    if a is None or b is None:
        st.verdict = "EXITED" + (
            f" inside phase {phase!r} (no end record: it died there)" if in_phase else ""
        )
        return st
    st.cpu_fraction = (b[0] - a[0]) / sample_s
    st.io_bytes_per_s = (b[1] - a[1]) / sample_s
    busy = st.cpu_fraction > 0.05 or st.io_bytes_per_s > (1 << 20)
    activity = f"CPU {100 * st.cpu_fraction:.0f}%, I/O {st.io_bytes_per_s / (1 << 20):.1f} MiB/s"
    overdue = in_phase and st.typical_s and elapsed > STALL_FACTOR * st.typical_s
    if not in_phase:
        st.verdict = f"between phases ({activity})"
    elif overdue and not busy:
        st.verdict = (
            f"STALLED: {elapsed:.0f} s in {phase!r} (typical {st.typical_s:.1f} s) with no CPU and "
            f"no I/O; look at what it waits for (a peer, a lock, the filesystem)"
        )
    elif overdue:
        st.verdict = (
            f"SLOW, not hung: {elapsed:.0f} s in {phase!r} (typical {st.typical_s:.1f} s), "
            f"{activity}"
        )
    else:
        st.verdict = f"in {phase!r} for {elapsed:.1f} s ({activity})"
    return st


def record_files(path: str | os.PathLike[str]) -> list[Path]:
    """A records file, or every regular *.jsonl with phase records under a directory; a file that
    holds no phase records (its head shows none) is not one, named on the command line or found
    below.

    Only regular files are opened (a FIFO would block forever), and only their first
    2000 bytes are read to tell records from other JSONL."""
    path = Path(path)
    if path.is_file() and not path.is_symlink():
        candidates = [path]
    elif path.is_dir():
        candidates = [
            p for p in sorted(path.rglob("*.jsonl")) if p.is_file() and not p.is_symlink()
        ]
    else:
        raise CheckpointCorruptError(
            f"{path} is neither a records file nor a directory (a FIFO or device?)"
        )
    out = []
    for p in candidates:
        with open(p, "rb") as f:
            if b'"kind"' in f.read(2000):
                out.append(p)
    return out


@dataclass(frozen=True)
class RootState:
    """A checkpoint root in words, for ``status ROOT`` after a crash: its newest committed step,
    what a resume would do now, and the steps a resume skips (orphans, damaged)."""

    lines: list[str]
    resumable: bool
    """A restore would resume (or start fresh, as declared); False: it would refuse."""


def root_state(root: str | os.PathLike[str], template: str = "step_{step:08d}") -> RootState | None:
    """``RootState`` of a checkpoint root, or None where ``root`` holds no tracker and no step
    directory."""
    from .._disk import layout as _layout
    from ..config import ResumeMode
    from ..errors import CheckpointError
    from .inspect import list_steps, resolve

    root = Path(root)
    if not (root / _layout.TRACKER_NAME).exists() and not _layout.step_dirs(
        root, _layout.StepNaming(template)
    ):
        return None
    listing = list_steps(root, template)
    committed = [
        e.step for e in listing.entries if e.step is not None and e.state.startswith("committed")
    ]
    tracker = listing.tracker if listing.tracker is not None else "absent"
    lines = [
        f"checkpoint root {root}: tracker {tracker}, newest committed step "
        f"{max(committed) if committed else 'none'} ({len(committed)} committed)"
    ]
    lines += [
        f"  step {e.step}: {e.state}"
        for e in listing.entries
        if e.step is not None and not e.state.startswith("committed")
    ][:8]
    try:
        lines.append(f"a resume now: {resolve(root, template, ResumeMode.AUTO).describe()}")
        resumable = True
    except CheckpointError as exc:
        lines.append(f"a resume now would REFUSE: {exc}")
        resumable = False
    return RootState(lines, resumable)
