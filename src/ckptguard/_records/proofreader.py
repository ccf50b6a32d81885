"""Reading the proof records of a root (``ROOT/proof/rank_*.jsonl``, per role on a run root),
without torch.

``ProofLog`` (``proofwriter``) writes them and imports torch for the facts it records; the readers
(``ckptguard prove``, ``goodput``, ``rehearse``) only parse JSON lines, so they live here and
``ckptguard goodput`` starts without torch's 1-2 s import.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._disk.layout import PROOF_DIR, parse_json, read_small, refuse_link
from .._types import JsonObject
from ..errors import CheckpointCorruptError
from .entries import is_int, is_number

__all__ = ["PROOF_BYTES", "ProofRecord", "read_records", "record_roles", "records_dir"]

PROOF_BYTES = 256 << 20
"""Bound of one rank's proof records file."""


@dataclass(frozen=True, eq=False)
class ProofRecord(Mapping[str, Any]):
    """One line of a rank's proof records: the header every record carries, typed and checked on
    read, over the JSON object as written (a record still reads as that object: ``rec["plan"]``,
    ``rec.get("digests_match")``; ``to_json`` gives it back unchanged).

    ``event`` and ``pid`` are in every record; ``rank``, ``host``, ``time`` and ``mono`` in every
    record ``ProofLog`` writes (records written by hand in tests may lack them); ``step`` in all but
    a few events: None where absent or not an int (``record_export`` and ``record_update`` of
    earlier releases did not check it; the raw object keeps what was written). The event's own
    fields (a save's ``plan``, a step's ``sample_ids``) are the rest of the object; which event has
    which is ``ProofLog``'s callers'. ``raw`` is not to be changed: records are append-only.
    """

    event: str
    pid: int
    rank: int | None
    host: str | None
    time: float | None
    mono: float | None
    step: int | None
    raw: JsonObject

    @classmethod
    def from_json(cls, obj: object, *, where: str) -> ProofRecord:
        """The record in ``obj``; CheckpointCorruptError naming ``where`` when its header is not
        one."""
        problem = header_problem(obj)
        if problem:
            raise CheckpointCorruptError(
                f"{where} is not a proof record ({problem}); proof records are written by "
                f"ckptguard only: restore that line from a copy or cut it, then prove again"
            )
        assert isinstance(obj, dict)
        return cls.of(dict(obj))

    @classmethod
    def of(cls, raw: JsonObject) -> ProofRecord:
        """The record of ``raw``, an object ``header_problem`` passed; the record keeps it (not a
        copy)."""
        step = raw.get("step")
        return cls(
            event=raw["event"],
            pid=raw["pid"],
            rank=raw.get("rank"),
            host=raw.get("host"),
            time=raw.get("time"),
            mono=raw.get("mono"),
            step=step if is_int(step) else None,
            raw=raw,
        )

    def to_json(self) -> JsonObject:
        return dict(self.raw)

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)


def header_problem(obj: object) -> str | None:
    """What makes ``obj`` not a proof record's object, in words; None when it is one."""
    if not isinstance(obj, dict):
        return f"a JSON {type(obj).__name__}, not an object"
    if not isinstance(obj.get("event"), str):
        return "no string 'event'"
    if not is_int(obj.get("pid")):
        return "no int 'pid'"
    for key, kind, ok in (
        ("rank", "an int", is_int),
        ("host", "a string", _str),
        ("time", "a number", is_number),
        ("mono", "a number", is_number),
    ):
        if key in obj and not ok(obj[key]):
            return f"'{key}' is {obj[key]!r}, not {kind}"
    return None


def records_dir(root: Path, role: str | None = None) -> Path:
    """Where the proof records of ``root`` (of one role of a run root) are."""
    return Path(root) / PROOF_DIR / role if role is not None else Path(root) / PROOF_DIR


def record_roles(root: Path) -> list[str]:
    """The roles of a run root that have proof records (``ROOT/proof/<role>/``), sorted."""
    directory = Path(root) / PROOF_DIR
    if not directory.is_dir() or directory.is_symlink():
        return []
    return sorted(
        d.name
        for d in directory.iterdir()
        if d.is_dir() and not d.is_symlink() and _ROLE.match(d.name)
    )


_ROLE = re.compile(r"[a-z][a-z0-9_-]{0,63}\Z")  # runmanifest's role names


def read_records(
    root: Path, role: str | None = None, *, rank: int | None = None
) -> dict[int, list[ProofRecord]]:
    """Every rank's proof records (of ``role``, numbered by its ranks), checked for the shape
    ``evaluate`` relies on; ``rank``: that rank's file only.

    Never through a symlinked ``proof/`` or record file, never from a FIFO, bounded in size
    and JSON depth; a malformed line is one CheckpointCorruptError naming file and line."""
    out: dict[int, list[ProofRecord]] = {}
    directory = records_dir(root, role)
    refuse_link(Path(root) / PROOF_DIR, "proof directory")
    refuse_link(directory, "proof directory")
    for path in sorted(
        directory.glob("rank_*.jsonl" if rank is None else f"rank_{rank:05d}.jsonl")
    ):
        try:
            number = int(path.stem.split("_")[1])
        except (IndexError, ValueError):
            continue  # not a name ProofLog writes
        try:
            text = read_small(path, limit=PROOF_BYTES, what="proof records").decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointCorruptError(
                f"{path} is not UTF-8 text (byte {exc.start}); proof records are "
                f"written by ckptguard only"
            ) from None
        lines = text.splitlines()
        records = []
        for n, line in enumerate(lines, 1):
            try:
                rec = parse_json(line, where=f"{path}:{n}")
            except CheckpointCorruptError as exc:
                if (n == len(lines) or line.startswith("{")) and "deeper" not in str(exc):
                    # a record torn by a kill mid-append (the next process starts a new line)
                    continue
                raise CheckpointCorruptError(f"{exc}; proof records are append-only") from None
            records.append(ProofRecord.from_json(rec, where=f"{path}:{n}"))
        out[number] = distinct_processes(records)
    return out


REUSED_PID = 1 << 32
"""Added to an OS pid that a later process reused (more than any OS pid): the records of that
process read with ``pid + n * REUSED_PID`` (``os_pid`` keeps the one written)."""


def shown_pid(pid: Any) -> str:
    """A pid as evidence shows it: the OS pid, with which later process reused it."""
    if is_int(pid) and pid >= REUSED_PID:
        return f"{pid % REUSED_PID}, its reuse {pid // REUSED_PID}"
    return str(pid)


def distinct_processes(records: list[ProofRecord]) -> list[ProofRecord]:
    """One rank's records with one pid per process: a container restarted with the same entrypoint
    reuses the pid (pid 1, one hostname), and every gate that tells the saving process from the
    resumed one keys by pid. A restore record (every launch's first) whose host or ``process_start``
    differs from the previous process's of that pid starts a new process; records without
    ``process_start`` (older releases) keep their pid."""
    current: dict[
        int, tuple[Any, Any]
    ] = {}  # os pid -> (host, process_start) of the process now using it
    reused: dict[int, int] = {}  # os pid -> how many earlier processes used it
    out = []
    for r in records:
        start = r.get("process_start")
        if r.event == "restore" and is_number(start):
            ident = (r.host, start)
            if r.pid in current and current[r.pid] != ident:
                reused[r.pid] = reused.get(r.pid, 0) + 1
            current[r.pid] = ident
        n = reused.get(r.pid, 0)
        out.append(
            r
            if not n
            else ProofRecord.of({**r.raw, "pid": r.pid + n * REUSED_PID, "os_pid": r.pid})
        )
    return out


def _str(value: object) -> bool:
    return isinstance(value, str)
