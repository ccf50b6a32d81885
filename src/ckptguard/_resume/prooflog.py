"""Append-only proof records, one JSONL file per rank (``ROOT/proof/rank_NNNNN.jsonl``)."""

from __future__ import annotations

import json
import os
import socket
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from .._commit.layout import PROOF_DIR, parse_json, read_small, refuse_link
from ..errors import CheckpointCorruptError, ConfigError
from .digest import digest

_HOST = socket.gethostname()


class ProofLog:
    """One rank's append-only proof records.

    Records made before the root exists (an export before the first save, the steps before
    it) are held in memory and written, in order, by the first append that finds the root:
    a mistyped root must stay visible, so a record never creates it.
    """

    HELD_MAX = 100_000  # records held before the root exists; older ones are dropped beyond this

    def __init__(self, root: Path, rank: int) -> None:
        self.path = Path(root) / PROOF_DIR / f"rank_{rank:05d}.jsonl"
        self.rank = rank
        self._held: deque[dict[str, Any]] = deque(maxlen=self.HELD_MAX)
        self.dropped = 0
        self._tail_checked = False

    def build(self, event: str, **fields: Any) -> dict[str, Any]:
        return {
            "event": event,
            "rank": self.rank,
            "pid": os.getpid(),
            "host": _HOST,
            "time": time.time(),
            "mono": time.monotonic(),
            **fields,
        }

    def hold(self, record: dict[str, Any]) -> None:
        if len(self._held) == self._held.maxlen:
            self.dropped += 1
        self._held.append(record)

    @property
    def held(self) -> int:
        return len(self._held)

    def write(self, record: dict[str, Any], *, durable: bool = True) -> None:
        """Append the held records and ``record``. ``durable`` fsyncs (saves, restores); a step
        record is only written, which a SIGKILL of the process does not lose (a node crash may)."""
        refuse_link(self.path.parent, "proof directory")  # appending through a link writes outside the root
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps(r, sort_keys=True) + "\n" for r in (*self._held, record)]
        if not self._tail_checked:
            # A process killed mid-append leaves a torn last line: end it, so our records start on their own.
            self._tail_checked = True
            if self.path.exists() and self.path.stat().st_size:
                with open(self.path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        lines.insert(0, "\n")
        with open(self.path, "a") as f:
            f.write("".join(lines))
            f.flush()
            if durable or self._held:
                os.fsync(f.fileno())
        self._held.clear()

    def append(self, event: str, **fields: Any) -> None:
        self.write(self.build(event, **fields))


def export_fingerprint(payload: Any, scales: Any = None) -> dict[str, str]:
    """Digests of exported bytes and of the quantization scales that go with them."""
    return {"bytes": digest(payload), "scales": digest(scales) if scales is not None else "none"}


def logprob_diff(trainer: torch.Tensor, rollout: torch.Tensor) -> dict[str, float]:
    """Max absolute difference of logprobs and of probabilities (probs_diff)."""
    a, b = trainer.detach().double().cpu(), rollout.detach().double().cpu()
    if a.shape != b.shape:
        raise ConfigError(f"record_logprobs: shapes differ, trainer {tuple(a.shape)} vs rollout {tuple(b.shape)}")
    return {
        "max_abs_logprob_diff": float((a - b).abs().max()) if a.numel() else 0.0,
        "probs_diff": float((a.exp() - b.exp()).abs().max()) if a.numel() else 0.0,
        "tokens": int(a.numel()),
    }


# ---------------------------------------------------------------- evaluation


PROOF_BYTES = 256 << 20
"""Bound of one rank's proof records file."""


def read_records(root: Path) -> dict[int, list[dict[str, Any]]]:
    """Every rank's proof records, checked for the shape ``evaluate`` relies on.

    Never through a symlinked ``proof/`` or record file, never from a FIFO, bounded in size
    and JSON depth; a malformed line is one CheckpointCorruptError naming file and line."""
    out: dict[int, list[dict[str, Any]]] = {}
    directory = Path(root) / PROOF_DIR
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
