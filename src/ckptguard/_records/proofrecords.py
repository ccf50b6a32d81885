"""Reading the proof records of a root (``ROOT/proof/rank_*.jsonl``, per role on a run root), without torch.

``ProofLog`` (``prooflog``) writes them and imports torch for the facts it records; the readers
(``ckptguard prove``, ``goodput``, ``rehearse``) only parse JSON lines, so they live here and
``ckptguard goodput`` starts without torch's 1-2 s import.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .._disk.layout import PROOF_DIR, parse_json, read_small, refuse_link
from ..errors import CheckpointCorruptError

__all__ = ["PROOF_BYTES", "read_records", "record_roles", "records_dir"]



PROOF_BYTES = 256 << 20
"""Bound of one rank's proof records file."""


def records_dir(root: Path, role: str | None = None) -> Path:
    """Where the proof records of ``root`` (of one role of a run root) are."""
    return Path(root) / PROOF_DIR / role if role is not None else Path(root) / PROOF_DIR


def record_roles(root: Path) -> list[str]:
    """The roles of a run root that have proof records (``ROOT/proof/<role>/``), sorted."""
    directory = Path(root) / PROOF_DIR
    if not directory.is_dir() or directory.is_symlink():
        return []
    return sorted(d.name for d in directory.iterdir() if d.is_dir() and not d.is_symlink() and _ROLE.match(d.name))


_ROLE = re.compile(r"[a-z][a-z0-9_-]{0,63}\Z")  # runmanifest's role names


def read_records(root: Path, role: str | None = None) -> dict[int, list[dict[str, Any]]]:
    """Every rank's proof records (of ``role``, numbered by its ranks), checked for the shape ``evaluate``
    relies on.

    Never through a symlinked ``proof/`` or record file, never from a FIFO, bounded in size
    and JSON depth; a malformed line is one CheckpointCorruptError naming file and line."""
    out: dict[int, list[dict[str, Any]]] = {}
    directory = records_dir(root, role)
    refuse_link(Path(root) / PROOF_DIR, "proof directory")
    refuse_link(directory, "proof directory")
    for path in sorted(directory.glob("rank_*.jsonl")):
        try:
            rank = int(path.stem.split("_")[1])
        except (IndexError, ValueError):
            continue  # not a name ProofLog writes
        try:
            text = read_small(path, limit=PROOF_BYTES, what="proof records").decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointCorruptError(
                f"{path} is not UTF-8 text (byte {exc.start}); proof records are written by ckptguard only"
            ) from None
        lines = text.splitlines()
        records = []
        for n, line in enumerate(lines, 1):
            try:
                rec = parse_json(line, where=f"{path}:{n}")
            except CheckpointCorruptError as exc:
                if (n == len(lines) or line.startswith("{")) and "deeper" not in str(exc):
                    continue  # a record torn by a kill mid-append (the next process starts a new line)
                raise CheckpointCorruptError(f"{exc}; proof records are append-only") from None
            if not (isinstance(rec, dict) and isinstance(rec.get("event"), str) and _int(rec.get("pid"))):
                raise CheckpointCorruptError(
                    f"{path}:{n} is not a proof record (an object with a string 'event' and an int 'pid'); "
                    "proof records are append-only and written by ckptguard: move the file away to re-prove"
                )
            records.append(rec)
        out[rank] = records
    return out


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
