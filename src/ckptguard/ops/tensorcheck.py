"""``verify --deep``'s tensor pass: every tensor of a step read back and compared with its
layout-free digest.

Contract: ``tensor_findings(step_dir)`` reads each tensor the manifest's ``layout_free`` table
lists, one at a time, from the step's DCP files through ckptguard's streaming reader, and compares
its layout-free digest with the one the save recorded: what ``restore`` compares after a load. The
file checksums alone pass a data file rewritten together with its checksum in the manifest; this
pass does not (the digests were computed from the live tensors at the save, and a rewrite that also
fixed them would have to recompute the layout-free digest of every changed tensor). Host memory: the
largest tensor plus the reader's pool. A step written before the table existed, a run step, or a
step whose files already failed, is reported as not checked, never as passed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .._disk import layout as _layout
from .._disk.boxsum import REPLICAS_DIFFER
from .._records import manifest as _manifest
from .._records.findings import Finding, Severity
from ..errors import CheckpointError
from ..storage import StorageContext, StreamingConfig, StreamingStorage, read_dcp_metadata
from .hffiles import digests

__all__ = ["TensorCheck", "tensor_findings"]

_POOL = 16 << 20


@dataclass
class TensorCheck:
    """What the tensor pass of one step found: ERROR findings, the tensors compared, or why it could
    not run."""

    findings: list[Finding] = field(default_factory=list)
    checked: int = 0
    not_checked: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"checked": self.checked, "not_checked": self.not_checked}


def tensor_findings(step_dir: str | os.PathLike[str]) -> TensorCheck:
    """ERROR ``tensor-digest`` findings for each tensor whose bytes read back differ from the save's
    layout-free digest, and how many were compared; ``not_checked`` says why none could be (never a
    pass)."""
    step_dir = Path(step_dir)
    try:
        manifest = _manifest.read(step_dir)
    except (CheckpointError, OSError) as exc:
        return TensorCheck(not_checked=f"no plain step manifest ({exc})")
    if manifest.nodes:
        return TensorCheck(
            not_checked="a node-local step: its shards live on several "
            "nodes, this one holds its part"
        )
    table = manifest.layout_free or {}
    if not table:
        return TensorCheck(
            not_checked="the step records no layout-free digests (written before they existed)"
        )
    state_dir = step_dir / _layout.STATE_DIR
    try:
        md = read_dcp_metadata(state_dir)
    except (
        CheckpointError,
        OSError,
    ) as exc:  # what restore reads: a refusal here is restore's refusal
        return TensorCheck(
            [
                Finding(
                    Severity.ERROR,
                    "bad-metadata",
                    str(state_dir),
                    str(exc),
                    "restore an earlier step",
                )
            ]
        )
    storage = StreamingStorage(
        StreamingConfig(pool_bytes=_POOL, buffer_bytes=_POOL // 2, read_threads=1)
    )
    ctx = StorageContext(rank=0, world_size=1, process_group=None)
    findings: list[Finding] = []
    checked = 0
    for item, keys in sorted(table.items()):
        for key, expected in sorted(keys.items()):
            meta = md.state_dict_metadata.get(key)
            if expected == REPLICAS_DIFFER:
                # the save found replicas that differ: no true value to compare with (verify says
                # so)
                continue
            if not isinstance(meta, TensorStorageMetadata):
                findings.append(
                    Finding(
                        Severity.ERROR,
                        "tensor-digest",
                        str(state_dir),
                        f"item {item!r}: key {key!r} has a layout-free digest but no "
                        f"tensor in the DCP metadata",
                        "the step's metadata and manifest disagree: restore an earlier step",
                    )
                )
                continue
            t = torch.empty(tuple(int(s) for s in meta.size), dtype=meta.properties.dtype)
            try:
                storage.read(state_dir, {key: t}, ctx)
            except Exception as exc:  # a torn or unreadable shard: what restore would meet too
                findings.append(
                    Finding(
                        Severity.ERROR,
                        "tensor-digest",
                        str(state_dir),
                        f"key {key!r} cannot be read: {type(exc).__name__}: {exc}",
                        "restore an earlier step",
                    )
                )
                continue
            now = digests({key: t})[key]
            del t
            checked += 1
            if now != expected:
                findings.append(
                    Finding(
                        Severity.ERROR,
                        "tensor-digest",
                        str(state_dir),
                        f"key {key!r} reads back with layout-free digest {now}, the save recorded "
                        f"{expected}: its bytes changed after the commit (a data file rewritten "
                        "together with its checksum in the manifest passes the file checks, not "
                        "this one)",
                        "restore refuses this step: restore an earlier one, and "
                        "find what rewrote the files",
                    )
                )
    return TensorCheck(findings, checked)
