"""A peer's fetch plan, checked before a byte of it is written (a replacement node fetching its
rank's part of a step from a peer replica, ``replica.recv_part``): the header's file specs
(``header_specs``), then each file against the manifest that came first (``Admission``: only this
rank's extras, the DCP metadata and the shards the metadata says it reads, with the manifest's size
and xxh3; only contract phases the manifest names, linked into the root never over one). A plan that
names anything else is refused within the exchange."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from .._disk import layout as _layout
from .._disk.digest import file_digest
from .._records import manifest as _manifest
from .._records.manifest import rank_reads
from ..errors import CheckpointError
from ..storage.base import DCP_METADATA
from ..storage.unpickler import read_dcp_metadata
from .p2p import FileSpec

FETCH_RETRY = "restore again"


CRAFTED = "the peer's plan is damaged or crafted; check rank {src}'s checkpoint root"


def header_specs(header: Any, step: int) -> tuple[list[FileSpec], tuple[str, str] | None]:
    """The specs of a fetch header, and why it is refused (None: it is not): the specs read up to
    the first that does not parse, so the first file's exchange can still carry the refusal."""
    todo = "the sender runs another ckptguard version, or its plan is damaged or crafted"
    raw = header.get("files") if isinstance(header, dict) else None
    if not isinstance(raw, list):
        return [], ("the header: it holds no 'files' list", todo)
    specs: list[FileSpec] = []
    for entry in raw:
        if (
            not isinstance(entry, dict)
            or set(entry) - _SPEC_FIELDS
            or not {"path", "size", "xxh3"} <= set(entry)
        ):
            extra = sorted(set(entry) - _SPEC_FIELDS) if isinstance(entry, dict) else []
            return specs, (
                f"the header: an entry {str(entry)[:120]} is not a file spec"
                + (f" (unknown field {extra})" if extra else ""),
                todo,
            )
        ok = (
            isinstance(entry["path"], str)
            and isinstance(entry["xxh3"], str)
            and type(entry["size"]) is int
            and 0 <= entry["size"] <= _MAX_FILE_BYTES
            and isinstance(entry.get("where", "step"), str)
        )
        if not ok:
            return specs, (f"the header: an entry {str(entry)[:120]} is not a file spec", todo)
        specs.append(FileSpec(**entry))
    if header.get("step") != step:
        return specs, (
            f"the header: it is of step {str(header.get('step'))[:40]}, the ranks agreed on {step}",
            todo,
        )
    if not specs or (specs[0].path, specs[0].where) != (_layout.MANIFEST_NAME, "step"):
        return specs, ("the header: its first file is not the step's manifest", todo)
    return specs, None


_SPEC_FIELDS = {"path", "size", "xxh3", "where"}
_MAX_FILE_BYTES = 1 << 50
_PHASE = re.compile(r"phase_(\d{4})\.json\Z")


class Admission:
    """Which files of a fetched part the receiver accepts, by the manifest that came first."""

    def __init__(
        self, manifest: _manifest.Manifest, rank: int, tmp: Path, staged: Path, src: int
    ) -> None:
        self.manifest, self.rank, self.tmp, self.staged, self.src = manifest, rank, tmp, staged, src
        self.entries = {f.path: f for f in manifest.files}
        self.reads: set[str] | None = (
            None  # the DCP files the rank reads, once the metadata arrived
        )
        self.received: list[FileSpec] = []
        phase = manifest.contract.get("phase")
        self.phases = phase if isinstance(phase, int) and not isinstance(phase, bool) else -1

    def where(self, spec: FileSpec) -> tuple[Path, tuple[str, str] | None]:
        why = self._why_not(spec)
        dest = self.staged / spec.path if spec.where == "root" else self.tmp / spec.path
        if why is None:
            self.received.append(spec)
            return dest, None
        return dest, (
            f"the file: {why}",
            CRAFTED.format(src=self.src) + "; nothing else of the part is written",
        )

    def _why_not(self, spec: FileSpec) -> str | None:
        if spec.where == "root":
            phase = (
                _PHASE.match(spec.path[len(_layout.CONTRACT_DIR) + 1 :])
                if spec.path.startswith(f"{_layout.CONTRACT_DIR}/")
                else None
            )
            if phase is None or int(phase.group(1)) > self.phases:
                return (
                    f"of the root it is none of the contract phases 0..{self.phases} "
                    f"the step's manifest names"
                )
            return None
        if spec.where != "step":
            return f"its destination {spec.where!r:.40} is neither the step nor the contract"
        entry = self.entries.get(spec.path)
        if entry is None or (entry.size, entry.xxh3) != (spec.size, spec.xxh3):
            return "the step's manifest does not list it with this size and xxh3"
        mine = {_layout.extras_name(self.rank), f"{_layout.STATE_DIR}/{DCP_METADATA}"} | (
            self.reads or set()
        )
        if spec.path not in mine:
            return (
                f"it is not part of rank {self.rank}'s files of the step (its extras, the DCP "
                f"metadata and the shards the metadata says it reads; the metadata comes first)"
            )
        return None

    def learn_reads(self, metadata: Path) -> None:
        try:
            self.reads = rank_reads(read_dcp_metadata(metadata.parent), self.rank)
        except (CheckpointError, OSError):  # refused below: no shard is admitted without it
            self.reads = set()

    def finish(self, root: Path) -> list[str]:
        """Every file the rank reads arrived; then the contract phases go into the root (never over
        one)."""
        step = self.manifest.step
        got = {s.path for s in self.received if s.where == "step"}
        need = {_layout.extras_name(self.rank), f"{_layout.STATE_DIR}/{DCP_METADATA}"} | (
            self.reads or set()
        )
        if need - got:
            return [
                f"fetch from a peer replica, step {step}: rank {self.src} sent rank "
                f"{self.rank}'s part without {sorted(need - got)[:5]}; {FETCH_RETRY} (the "
                f"peer's replica is incomplete)"
            ]
        problems: list[str] = []
        for spec in (s for s in self.received if s.where == "root"):
            dest, staged = root / spec.path, self.staged / spec.path
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.link(
                    staged, dest
                )  # a sibling receiver may link it at the same time: never replaced
                _layout.fsync_dir(dest.parent)
            except FileExistsError:  # a root of this run already holds its contract: the same bytes
                if file_digest(str(dest))[1] != spec.xxh3:
                    problems.append(
                        f"{dest} differs from the run's contract file on rank {self.src}: "
                        f"this node's root holds another run; give the replacement node an "
                        f"empty root (or this run's)"
                    )
            except OSError as exc:
                problems.append(f"fetch from a peer replica, step {step}: placing {dest}: {exc}")
        shutil.rmtree(self.staged / _layout.CONTRACT_DIR, ignore_errors=True)
        return problems
