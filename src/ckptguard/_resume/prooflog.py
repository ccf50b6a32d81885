"""Append-only proof records, one JSONL file per rank (``ROOT/proof/rank_NNNNN.jsonl``)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch

from .._commit.layout import PROOF_DIR
from ..errors import CheckpointCorruptError, ConfigError
from .digest import digest


class ProofLog:
    """One rank's append-only proof records."""

    def __init__(self, root: Path, rank: int) -> None:
        self.path = Path(root) / PROOF_DIR / f"rank_{rank:05d}.jsonl"
        self.rank = rank

    def append(self, event: str, **fields: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "event": event,
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time": time.time(),
            "mono": time.monotonic(),
            **fields,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())


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


def read_records(root: Path) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for path in sorted((Path(root) / PROOF_DIR).glob("rank_*.jsonl")):
        rank = int(path.stem.split("_")[1])
        lines = path.read_text().splitlines()
        records = []
        for n, line in enumerate(lines, 1):
            try:
                records.append(json.loads(line))
            except ValueError:
                if n == len(lines):
                    continue  # a torn last line from a kill mid-append
                raise CheckpointCorruptError(f"{path}:{n} is not JSON; proof records are append-only") from None
        out[rank] = records
    return out


