"""Proof that a resume is exact: append-only records, and the gates of the guide's section 6.

Contract: each rank appends JSON lines to ``ROOT/proof/rank_NNNNN.jsonl`` (one record
per event: save, restore, export, logprobs, update), never rewriting earlier lines.
``evaluate`` reads them and decides each gate as PASS, FAIL or NOT RUN, with evidence.
A gate whose event never happened is NOT RUN, never PASS. A run segment is one PID;
the gates look at the newest restore of a non-zero step on each rank.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._resume.prooflog import ProofLog, export_fingerprint, logprob_diff, read_records  # noqa: F401 (re-exported)


class Status(str, enum.Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    NOT_RUN = "NOT RUN"
    INFO = "INFO"


@dataclass(frozen=True)
class Gate:
    name: str
    status: Status
    evidence: str
    required: bool = True


@dataclass
class _Segment:
    """One rank's newest restore and what its process recorded around it."""

    rank: int
    restore: dict[str, Any] | None
    before: list[dict[str, Any]] = field(default_factory=list)  # every earlier record
    same_pid_before: list[dict[str, Any]] = field(default_factory=list)
    after: list[dict[str, Any]] = field(default_factory=list)

    def first(self, event: str) -> dict[str, Any] | None:
        return next((r for r in self.after if r["event"] == event), None)


def _segment(rank: int, records: list[dict[str, Any]]) -> _Segment:
    idx = max((i for i, r in enumerate(records) if r["event"] == "restore"), default=None)
    if idx is None:
        return _Segment(rank, None)
    restore = records[idx]
    pid = restore["pid"]
    before = records[:idx]
    same = [r for r in records[:idx] if r["pid"] == pid]
    after = [r for r in records[idx + 1 :] if r["pid"] == pid]
    return _Segment(rank, restore, before, same, after)


def _combine(name: str, per_rank: list[tuple[Status, str]], required: bool = True) -> Gate:
    statuses = {s for s, _ in per_rank}
    if not per_rank:
        return Gate(name, Status.NOT_RUN, "no proof records", required)
    if Status.FAIL in statuses:
        status = Status.FAIL
    elif Status.NOT_RUN in statuses:
        status = Status.NOT_RUN
    else:
        status = Status.PASS
    shown = [e for s, e in per_rank if s is status] or [e for _, e in per_rank]
    return Gate(name, status, "; ".join(dict.fromkeys(shown)), required)


def _restored(seg: _Segment) -> dict[str, Any] | None:
    """The segment's restore record when it restored a non-zero step, else None."""
    return seg.restore if seg.restore is not None and int(seg.restore.get("step", 0)) > 0 else None


def _gate_confirmed(seg: _Segment) -> tuple[Status, str]:
    restore = _restored(seg)
    if restore is None:
        return Status.NOT_RUN, "no restore of a non-zero step"
    early = [r for r in seg.same_pid_before if r["event"] == "update"]
    if early:
        return Status.FAIL, f"rank {seg.rank}: process trained (update of step {early[0].get('step')}) before restore"
    return Status.PASS, f"step {restore['step']} confirmed before the first training step"


def _gate_pids(seg: _Segment) -> tuple[Status, str]:
    restore = _restored(seg)
    if restore is None:
        return Status.NOT_RUN, "no restore of a non-zero step"
    step = restore["step"]
    saver = next((r for r in reversed(seg.before) if r["event"] == "save" and r["step"] == step), None)
    if saver is None:
        return Status.NOT_RUN, f"rank {seg.rank}: no record of the process that saved step {step}"
    if saver["pid"] == restore["pid"] and saver.get("host") == restore.get("host"):
        return Status.FAIL, f"rank {seg.rank}: restored in the same process (pid {saver['pid']}) that saved"
    return Status.PASS, "every rank restored in a new process"


def _gate_digests(seg: _Segment) -> tuple[Status, str]:
    restore = _restored(seg)
    if restore is None:
        return Status.NOT_RUN, "no restore of a non-zero step"
    items = restore.get("digests_match") or {}
    if not items:
        return Status.NOT_RUN, f"rank {seg.rank}: digests were not compared (verify_restored off or resharded)"
    bad = sorted(k for k, ok in items.items() if not ok)
    if bad:
        return Status.FAIL, f"rank {seg.rank}: items {bad} differ from the save"
    return Status.PASS, f"{len(items)} items per rank equal the save's ({', '.join(sorted(items))})"


def _gate_export(seg: _Segment) -> tuple[Status, str]:
    if not _restored(seg):
        return Status.NOT_RUN, "no restore of a non-zero step"
    first = seg.first("export")
    if first is None:
        return Status.NOT_RUN, f"rank {seg.rank}: no export recorded after the restore"
    step = first["step"]
    ref = next((r for r in reversed(seg.before) if r["event"] == "export" and r["step"] == step), None)
    if ref is None:
        return Status.NOT_RUN, f"rank {seg.rank}: no export of step {step} recorded by the saving run"
    diffs = [k for k in ("bytes", "scales") if ref["fingerprint"].get(k) != first["fingerprint"].get(k)]
    if diffs:
        return Status.FAIL, f"rank {seg.rank}: first export of step {step} differs in {diffs} from the saving run's"
    return Status.PASS, f"first export of step {step} byte-identical to the saving run's, scales included"


def _gate_logprobs(seg: _Segment) -> tuple[Status, str]:
    if not _restored(seg):
        return Status.NOT_RUN, "no restore of a non-zero step"
    first = seg.first("logprobs")
    if first is None:
        return Status.NOT_RUN, f"rank {seg.rank}: no old-logprob recorded after the restore"
    diff = first["probs_diff"]
    if diff != 0.0:
        return Status.FAIL, f"rank {seg.rank}: first old-logprob of step {first['step']} has probs_diff {diff:.3g}"
    return Status.PASS, f"first old-logprob aligned: probs_diff 0 over {first['tokens']} tokens"


def _gate_update(seg: _Segment) -> tuple[Status, str]:
    if not _restored(seg):
        return Status.NOT_RUN, "no restore of a non-zero step"
    first = seg.first("update")
    if first is None:
        return Status.NOT_RUN, f"rank {seg.rank}: no update recorded after the restore"
    if not first.get("grad_norm") or not first.get("params_changed"):
        return Status.FAIL, (
            f"rank {seg.rank}: first update (step {first['step']}) had grad_norm "
            f"{first.get('grad_norm')} and params_changed={first.get('params_changed')}"
        )
    return Status.PASS, f"first update non-zero: grad_norm {first['grad_norm']:.3g}, parameters changed"


def _gate_addresses(seg: _Segment) -> tuple[Status, str]:
    restore = _restored(seg)
    if restore is None:
        return Status.NOT_RUN, "no restore of a non-zero step"
    moved = restore.get("addresses_changed")
    if moved is None:
        return Status.NOT_RUN, f"rank {seg.rank}: addresses were not recorded"
    if moved:
        return Status.FAIL, (f"rank {seg.rank}: restore replaced {len(moved)} tensor(s) instead of copying into "
                             f"them, e.g. {moved[:3]}; CUDA graphs and rollout engines hold the old addresses")
    return Status.PASS, "every parameter and buffer kept its data_ptr through the restore"


_GATES = (
    ("restored step confirmed before training", _gate_confirmed),
    ("all PIDs changed", _gate_pids),
    ("digests equal, item by item", _gate_digests),
    ("addresses unchanged", _gate_addresses),
    ("first export byte-identical", _gate_export),
    ("first old-logprob aligned", _gate_logprobs),
    ("one non-zero update", _gate_update),
)


def _judged(gate: Any, seg: _Segment) -> tuple[Status, str]:
    """A gate over records missing a field or of the wrong type FAILs with that as evidence, never raises."""
    try:
        judged: tuple[Status, str] = gate(seg)
        return judged
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        return Status.FAIL, (
            f"rank {seg.rank}: malformed proof record ({type(exc).__name__}: {exc}); the records under proof/ "
            "were edited or damaged, so nothing can be proven from them"
        )


def evaluate(root: Path) -> list[Gate]:
    from .._commit.manifest import FORMAT_VERSION

    records = read_records(root)
    segments = [_segment(rank, recs) for rank, recs in sorted(records.items())]
    gates = [_combine(name, [_judged(fn, s) for s in segments]) for name, fn in _GATES]
    restores = [s.restore for s in segments if s.restore is not None]
    written = sorted({r["format_version"] for r in restores if r.get("format_version")})
    gates.append(
        Gate(
            "new code reads an old checkpoint",
            Status.INFO,
            f"format written {written or 'n/a'}, read by format {FORMAT_VERSION}; the test suite "
            "restores a committed fixture of every version",
            required=False,
        )
    )
    return gates


def passed(gates: list[Gate]) -> bool:
    return all(g.status is Status.PASS for g in gates if g.required)
