"""Append-only turn records of a TurnLedger: ``ROOT/proof/turns_rank_NNNNN.jsonl``
(``ops.prove_turns`` reads them)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

from .._disk.layout import PROOF_DIR, refuse_link
from ..errors import UnsafeCheckpointError

__all__ = ["RECORDS", "TurnLog"]

log = logging.getLogger("ckptguard")

RECORDS = "turns_rank_{rank:05d}.jsonl"
HELD_MAX = 100_000  # records made before the root exists; older ones are dropped beyond this


class TurnLog:
    """Append-only JSON lines under ROOT/proof/, held in memory until the root exists (a record
    never creates it)."""

    def __init__(self, root: Path | None, rank: int) -> None:
        self.root = None if root is None else Path(root)
        self.rank = rank
        self.held: deque[str] = deque(maxlen=HELD_MAX)
        self._tail_checked = False

    def write(self, event: str, durable: bool = False, **fields: Any) -> None:
        if self.root is None:
            return
        line = (
            json.dumps(
                {
                    "event": event,
                    "rank": self.rank,
                    "pid": os.getpid(),
                    "time": time.time(),
                    **fields,
                },
                sort_keys=True,
                allow_nan=False,
            )
            + "\n"
        )
        self.held.append(line)
        if not self.root.is_dir():  # a mistyped root must stay visible: the first save creates it
            return
        try:
            self._append(durable)
        except (OSError, UnsafeCheckpointError) as exc:
            log.warning(
                "ckptguard: could not append the %s turn record under %s (%s)",
                event,
                self.root,
                exc,
            )

    def _append(self, durable: bool) -> None:
        directory = self.root / PROOF_DIR  # type: ignore[operator]
        refuse_link(
            directory, "proof directory"
        )  # appending through a link writes outside the root
        directory.mkdir(exist_ok=True)
        path = directory / RECORDS.format(rank=self.rank)
        refuse_link(path, "turn records")
        with open(path, "a+b") as f:
            if not self._tail_checked:
                # A process killed mid-append leaves a torn last line: end it, so our records start
                # on their own.
                self._tail_checked = True
                size = f.seek(0, os.SEEK_END)
                if size:
                    f.seek(size - 1)
                    if f.read(1) != b"\n":
                        self.held.appendleft("\n")
            f.write("".join(self.held).encode())
            f.flush()
            if durable:
                os.fsync(f.fileno())
        self.held.clear()
