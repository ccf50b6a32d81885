"""Proof that a resume is exact: append-only records, and the gates of docs/practices.md, section 6.

Contract: each rank appends JSON lines to ``ROOT/proof/rank_NNNNN.jsonl`` (one record per event:
save, restore, step, export, logprobs, update), never rewriting earlier lines. ``evaluate`` reads
them and decides each gate as PASS, FAIL, MISSING, INFO or N/A, with evidence. FAIL means a
difference was found; MISSING that the gate had nothing to compare (an event never recorded, or a
kill that landed before the reference was recorded): never PASS, never FAIL. A gate the job's
``ProofPlan`` (recorded with the save) says does not apply is N/A. ``outcome`` turns the gates into
PROVEN, DIVERGED or EVIDENCE_MISSING. A run segment is one PID; the gates look at the newest restore
of a non-zero step on each rank of the newest run.

The replay gates compare the steps the resumed run runs again (restored step + 1 up to the
last step the killed run recorded) with the ``step`` records of the same step and rank
(under resharding: of the rank whose extras it took) made by the process that saved the
restored step and ran on from it until it was killed: the data exactly, always; the
numbers exactly where the plan is deterministic, else as information.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._records import checks as _checks
from .._records import runmanifest as _runmanifest
from .._records.proofreader import ProofRecord, read_records, record_roles
from .._resume.layoutcheck import differing_chunks, replica_report
from .._state.trajectory import difference, numerics, same_bits
from ..config import ProofPlan
from ..errors import CheckpointError
from . import reference as _reference_mod
from . import resumes as _resumes
from .inspect import tracker_run_step
from .lora import lora_gate, merged_multiple
from .prove_turns import rows as turn_rows

LEGACY_PLAN = ProofPlan(rl=True)
"""The plan of records written before plans were recorded: every gate applied."""

DATA_FIELDS = ("sample_ids", "batch")
# ids of a step shown in evidence (a record keeps more: a shift within a step is seen in them)
IDS_SHOWN = 4


class Status(str, enum.Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    MISSING = "MISSING"
    INFO = "INFO"
    NA = "N/A"


@dataclass(frozen=True)
class Gate:
    name: str
    status: Status
    evidence: str
    required: bool = True
    qualifies: str = ""
    """What the verdict must say with ``resume PROVEN`` because of this gate (numerics not
    compared)."""

    def to_json(self) -> dict[str, Any]:
        out = {
            "gate": self.name,
            "status": self.status.value,
            "evidence": self.evidence,
            "required": self.required,
        }
        return {**out, "qualifies": self.qualifies} if self.qualifies else out


@dataclass
class _Segment:
    """One rank's newest restore and what its process recorded around it."""

    rank: int
    restore: ProofRecord | None
    before: list[ProofRecord] = field(default_factory=list)  # every earlier record
    same_pid_before: list[ProofRecord] = field(default_factory=list)
    after: list[ProofRecord] = field(default_factory=list)

    def first(self, event: str) -> ProofRecord | None:
        return next((r for r in self.after if r["event"] == event), None)


def _segment(rank: int, records: list[ProofRecord], at: int | None = -1) -> _Segment:
    """The segment around restore record ``at`` (-1: the newest; None: none, every record is
    before)."""
    idx = (
        max((i for i, r in enumerate(records) if r["event"] == "restore"), default=None)
        if at == -1
        else at
    )
    if idx is None:
        return _Segment(rank, None, list(records))
    restore = records[idx]
    pid = restore["pid"]
    before = records[:idx]
    same = [r for r in records[:idx] if r["pid"] == pid]
    after = [r for r in records[idx + 1 :] if r["pid"] == pid]
    return _Segment(rank, restore, before, same, after)


def _combine(name: str, per_rank: list[tuple[Status, str]], required: bool = True) -> Gate:
    statuses = {s for s, _ in per_rank}
    if not per_rank:
        return Gate(name, Status.MISSING, "no proof records", required)
    if Status.FAIL in statuses:
        status = Status.FAIL
    elif Status.MISSING in statuses:
        status = Status.MISSING
    elif statuses == {Status.NA}:
        return Gate(name, Status.NA, per_rank[0][1], False)
    else:
        status = Status.PASS
    shown = [e for s, e in per_rank if s is status] or [e for _, e in per_rank]
    return Gate(name, status, "; ".join(dict.fromkeys(shown)), required)


def _restored(seg: _Segment) -> bool:
    return seg.restore is not None and int(seg.restore.get("step", 0)) > 0


def _raised(seg: _Segment) -> bool:
    return _restored(seg) and seg.restore.get("ok") is False  # type: ignore[union-attr]


def _needs_restore(seg: _Segment) -> tuple[Status, str] | None:
    """MISSING without a completed restore of a non-zero step (a restore that raised is not one)."""
    if not _restored(seg):
        return Status.MISSING, "no restore of a non-zero step"
    if _raised(seg):
        step = seg.restore["step"]  # type: ignore[index]
        return Status.MISSING, f"rank {seg.rank}: the restore of step {step} raised"
    return None


def _gate_confirmed(seg: _Segment) -> tuple[Status, str]:
    if not _restored(seg):
        return Status.MISSING, "no restore of a non-zero step"
    assert seg.restore is not None
    if _raised(seg):
        error = seg.restore.get("error") or "an error (not recorded)"
        return (
            Status.FAIL,
            f"rank {seg.rank}: the restore of step {seg.restore['step']} raised {error}",
        )
    early = [r for r in seg.same_pid_before if r["event"] in ("update", "step")]
    if early:
        return (
            Status.FAIL,
            f"rank {seg.rank}: process trained (step {early[0].get('step')}) before restore",
        )
    return Status.PASS, f"step {seg.restore['step']} confirmed before the first training step"


def _gate_pids(seg: _Segment) -> tuple[Status, str]:
    if (missing := _needs_restore(seg)) is not None:
        return missing
    assert seg.restore is not None
    step = seg.restore["step"]
    if seg.restore.get("saved_world_size") not in (None, seg.restore.get("world_size")) and not any(
        r["event"] == "save" for r in seg.before
    ):
        return (
            Status.PASS,
            "every rank restored in a new process",
        )  # a rank the saving run did not have
    saver = next(
        (r for r in reversed(seg.before) if r["event"] == "save" and r["step"] == step), None
    )
    if (
        saver is None
    ):  # a kill right after the commit, before the save record: the process that trained step k
        saver = next(
            (
                r
                for r in reversed(seg.before)
                if r["event"] in ("step", "update") and r["step"] == step
            ),
            None,
        )
    if saver is None:
        return Status.MISSING, f"rank {seg.rank}: no record of the process that saved step {step}"
    same = saver["pid"] == seg.restore["pid"] and saver.get("host") == seg.restore.get("host")
    starts = saver.get("start"), seg.restore.get("start")
    if same and None not in starts and starts[0] != starts[1]:
        same = False  # the PID given back to a relaunch (a restarted container): a new process
    if same:
        return (
            Status.FAIL,
            f"rank {seg.rank}: restored in the same process (pid {saver['pid']}) that saved",
        )
    return Status.PASS, "every rank restored in a new process"


def _gate_digests(seg: _Segment) -> tuple[Status, str]:
    if not _restored(seg):
        return Status.MISSING, "no restore of a non-zero step"
    assert seg.restore is not None
    items = seg.restore.get("digests_match") or {}
    free = seg.restore.get("layout_free_match") or {}
    bad = sorted(k for k, ok in items.items() if not ok)
    bad += sorted(f"{k} (layout-free)" for k, ok in free.items() if not ok)
    if bad:
        return Status.FAIL, f"rank {seg.rank}: items {bad} differ from the save"
    if _raised(seg):
        return Status.MISSING, f"rank {seg.rank}: the restore of step {seg.restore['step']} raised"
    old, new = seg.restore.get("saved_world_size"), seg.restore.get("world_size")
    if old and new and old != new:
        if not free:
            return Status.MISSING, (
                f"rank {seg.rank}: resharded restore ({old} -> {new} ranks) and the save recorded "
                "no layout-free digests (written by an older ckptguard): tensor items not compared"
            )
        by_rule = (seg.restore.get("reshard") or {}).get("mode") == "by_item"
        source = "what their reshard rules give" if by_rule else "the saving rank's"
        extras = f"; {', '.join(sorted(items))} equal {source}" if items else ""
        return Status.PASS, (
            f"resharded {old} -> {new} ranks: {', '.join(sorted(free))} equal the save's "
            f"layout-free digests{extras}"
        )
    if not items:
        return Status.MISSING, f"rank {seg.rank}: digests were not compared (verify_restored off)"
    also = f"; layout-free digests equal too ({', '.join(sorted(free))})" if free else ""
    return (
        Status.PASS,
        f"{len(items)} items per rank equal the save's ({', '.join(sorted(items))}){also}",
    )


def _gate_replicas(seg: _Segment) -> tuple[Status, str]:
    """Every tensor chunk that several ranks hold had one value across its holders after the
    load."""
    if not _restored(seg):
        return Status.MISSING, "no restore of a non-zero step"
    assert seg.restore is not None
    rep = seg.restore.get("replicas")
    later = next((r for r in seg.after if r["event"] == "replicas" and r.get("ok") is False), None)
    if (
        later is not None
    ):  # drift after restore() returned (a hook, a late broadcast): the next save refused it
        return Status.FAIL, (
            f"rank {seg.rank}: the save of step {later['step']} after the restore of step "
            f"{seg.restore['step']} found replicas that differ across ranks: {later.get('error')}"
        )
    if rep and rep.get("differing"):
        shown = differing_chunks(rep, short=True)
        return Status.FAIL, (
            f"{rep['differing']} tensor chunk(s) held by several ranks differ between their "
            f"replicas after the load of step {seg.restore['step']}: {shown}"
        )
    if _raised(seg):
        return Status.MISSING, f"rank {seg.rank}: the restore of step {seg.restore['step']} raised"
    if not rep:
        why = (
            "the restore compared no layout-free digests (verify_restored off, or a "
            "save written before them)"
            if "replicas" in seg.restore
            else "not recorded (a restore by an older ckptguard)"
        )
        return Status.MISSING, f"rank {seg.rank}: replicas not compared: {why}"
    if not rep.get("checked"):
        return Status.NA, (
            f"no tensor chunk is held by more than one of the {rep.get('world')} rank(s) "
            "(one rank, or every tensor sharded): no replicas to compare"
        )
    return Status.PASS, (
        f"{rep['checked']} tensor chunk(s) held by several ranks (up to {rep.get('most')} each) "
        "have one value across their replicas, equal to the save's"
    )


def _partials(seg: _Segment) -> tuple[int, dict[str, list[str]]] | None:
    """A rank's replica partials from its first step record after the restore (``replica_partials``:
    what ``layout_free_partials`` gave of its live replicated tensors), checked before use; None:
    not recorded."""
    if not _restored(seg) or _raised(seg):
        return None
    first = seg.first("step")
    parts = first.get("replica_partials") if first is not None else None
    if first is None or not isinstance(parts, dict):
        return None
    ok = all(
        isinstance(v, list) and len(v) == 4 and all(isinstance(x, str) for x in v)
        for v in parts.values()
    )
    return (int(first["step"]), {str(k): list(v) for k, v in parts.items()}) if ok else None


def _first_step_drift(
    segments: list[_Segment], step: int, report: dict[str, Any]
) -> tuple[Status, str]:
    """Replicas that differ at the first step after the restore, judged by what the resumed run's
    later saves found: some jobs keep replicas equal only at save points (local SGD / DiLoCo
    averaging there, BatchNorm stats synced before each save), so a difference between saves is a
    FAIL only where a save refused it."""
    seen = (
        f"at the first step after the restore (step {step}) {report['differing']} tensor chunk(s) "
        f"held by several ranks differ between their replicas: "
        f"{differing_chunks(report, short=True)}"
    )
    k = max(int(s.restore["step"]) for s in segments if s.restore is not None)
    refused = [
        r for s in segments for r in s.after if r["event"] == "replicas" and r.get("ok") is False
    ]
    if refused:
        return Status.FAIL, (
            f"{seen}; the save of step {refused[0]['step']} refused them too: they drifted after "
            "restore() returned (a hook, a late broadcast, a rank-local change)"
        )
    saves = sorted(
        {
            int(r["step"])
            for s in segments
            for r in s.after
            if r["event"] == "save" and r["step"] > k
        }
    )
    if saves:
        return Status.PASS, (
            f"{seen}, and the save of step {saves[0]} found them equal again: this job keeps its "
            "replicas equal at save points only (parameters averaged there, as local SGD does, or "
            "statistics synced before each save), as its uninterrupted run did"
        )
    return Status.MISSING, (
        f"{seen}; no save of the resumed run compared them afterwards, so a drift after restore() "
        "returned (a hook, a late broadcast) cannot be told from replicas that this job keeps "
        "equal at save points only (local SGD, statistics synced before a save): not judged"
    )


def _first_step_replicas(segments: list[_Segment]) -> list[tuple[Status, str]]:
    """Replicas compared again at the first step after the restore, across the ranks that recorded
    their partials at the same step: drift that appeared after restore() returned (a hook, a late
    broadcast)."""
    found = {s.rank: p for s in segments if (p := _partials(s)) is not None}
    # The load's own comparison stands without this one: a digest that failed here is said, not
    # MISSING.
    errors = [
        (
            Status.PASS,
            f"rank {s.rank}: replicas not compared again at the first step after the restore "
            f"({first['replicas_error']})",
        )
        for s in segments
        if (first := s.first("step")) is not None and isinstance(first.get("replicas_error"), str)
    ]
    steps = [step for step, _ in found.values()]
    if len(found) < 2:
        return errors
    step = max(
        set(steps), key=steps.count
    )  # a rank one record behind has not recorded that step yet
    views = [
        found[r][1] if r in found and found[r][0] == step else {} for r in range(max(found) + 1)
    ]
    report = replica_report(views)
    if report["differing"]:
        return [*errors, _first_step_drift(segments, step, report)]
    if not report["checked"]:
        return errors
    return [
        *errors,
        (
            Status.PASS,
            f"compared again at the first step after the restore (step {step}): "
            f"{report['checked']} chunk(s) equal across their replicas",
        ),
    ]


def _export_tensors(ref: ProofRecord, first: ProofRecord) -> str:
    """The tensors two export records differ in, where both recorded per-tensor digests (a rollout
    engine's)."""
    a = ref.get("tensors") or (ref.get("fingerprint") or {}).get("tensors")
    b = first.get("tensors") or (first.get("fingerprint") or {}).get("tensors")
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return ""
    names = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
    return f": tensors {names[:6]}{' ...' if len(names) > 6 else ''}" if names else ""


def _gate_export(seg: _Segment) -> tuple[Status, str]:
    if (missing := _needs_restore(seg)) is not None:
        return missing
    assert seg.restore is not None
    first = seg.first("export")
    if first is None:
        return Status.MISSING, f"rank {seg.rank}: no export recorded after the restore"
    step, k, pid = first["step"], int(seg.restore["step"]), seg.restore["pid"]
    chosen, ref = _reference_mod.at_step(seg.before, k, pid, ("export",), step)
    if ref is None or chosen is None:
        return Status.MISSING, (
            f"rank {seg.rank}: no run before this resume recorded an export of step {step} "
            f"({_reference_mod.nothing_past(seg.before, k, pid, 'export of that step')})"
        )
    who = "the saving run's" if chosen.saved else f"that of {chosen.describe()}"
    diffs = [
        k for k in ("bytes", "scales") if ref["fingerprint"].get(k) != first["fingerprint"].get(k)
    ]
    if diffs:
        return Status.FAIL, (
            f"rank {seg.rank}: first export of step {step} differs in {diffs} from {who}"
            f"{_export_tensors(ref, first)}{merged_multiple(ref.raw, first.raw)}"
        )
    return Status.PASS, f"first export of step {step} byte-identical to {who}, scales included"


UNSEEDED = "unseeded"  # a logprobs record's seeds where no request had a seed (integrations.vllm)


def _differ(a: Mapping[str, Any], b: Mapping[str, Any], key: str) -> bool | None:
    """Whether two records' digests ``key`` differ (None: one of them recorded none, e.g. an older
    record)."""
    x, y = a.get(key), b.get(key)
    return x != y if isinstance(x, str) and isinstance(y, str) else None


def _engine_weights(seg: _Segment, step: int) -> tuple[bool | None, str]:
    """Whether the engine that generated ``step``'s rollouts held the reference run's weights: its
    export of step - 1 (the weights after step - 1 updates) against the earliest earlier run's
    export of that step."""
    assert seg.restore is not None
    k, pid = int(seg.restore["step"]), seg.restore["pid"]
    mine = next((r for r in seg.after if r["event"] == "export" and r["step"] == step - 1), None)
    _chosen, ref = _reference_mod.at_step(seg.before, k, pid, ("export",), step - 1)
    if mine is None or ref is None:
        where = "after the restore" if mine is None else "in a run before this resume"
        return None, f"no export of step {step - 1} {where} to compare the engine's weights with"
    a, b = ref.get("fingerprint") or {}, mine.get("fingerprint") or {}
    differ = [
        key for key in ("bytes", "scales") if a.get(key) != b.get(key)
    ]  # a stale scale is the weights too
    said = f"differs in {differ} from" if differ else "equals"
    return not differ, f"its export of step {step - 1} {said} the reference's"


def _logprob_cause(seg: _Segment, ref: ProofRecord, first: ProofRecord) -> str:
    """The cause class of an old-logprob that differs: the engine's weights, or its sampling
    state."""
    step = int(first["step"])
    weights, said = _engine_weights(seg, step)
    tokens, seeds = _differ(ref, first, "sampled"), _differ(ref, first, "seeds")
    if weights is False:
        return (
            f"Cause: the rollout engine's weights: {said} (see 'first export byte-identical'): a "
            f"push skipped or stale after the restore"
        )
    if tokens is False:
        return (
            f"Cause: weights (or scales): the same sampled token ids got other logprobs; {said}: "
            + (
                "the trainer's recompute holds other weights"
                if weights
                else "the engine or the trainer holds other weights than before the kill"
            )
        )
    if tokens:
        seeded = {
            True: "the request seeds differ too",
            False: "with the same request seeds",
            None: "request seeds not recorded",
        }[seeds]
        if first.get("seeds") == UNSEEDED:
            seeded = "requests unseeded: the engine's own generator drew them"
        if weights and seeds is False and first.get("seeds") != UNSEEDED:
            # same weights, scales and request seeds: not the seeds; what the export does not hold
            # differs
            return (
                f"Cause: the rollout engine, beyond what its export records: same weights and "
                f"scales ({said}) and the same request seeds, yet other sampled token ids: "
                f"engine state the export does not hold differs (a cached quantized copy or "
                f"scale, a kernel whose result depends on the batch), or the sampled tokens "
                f"depend on more than the request seed"
            )
        if weights:
            return (
                f"Cause: the rollout engine's sampling state: same weights ({said}) but other "
                f"sampled token ids, {seeded}: seed each request from (run seed, step, prompt, "
                f"sample) (integrations.vllm.request_seed), never from the engine's own generator, "
                f"which a restart does not put back"
            )
        return (
            f"Cause: other sampled token ids ({seeded}) and {said}: the engine's sampling state or "
            f"its weights; record the export of each push to tell them apart"
        )
    return (
        "The rollout engine or the trainer holds other weights (or scales) than before the kill "
        "(no sampled token ids recorded to tell the engine's sampling state apart)"
    )


def _gate_logprobs(seg: _Segment) -> tuple[Status, str]:
    if (missing := _needs_restore(seg)) is not None:
        return missing
    assert seg.restore is not None
    first = seg.first("logprobs")
    if first is None:
        return Status.MISSING, f"rank {seg.rank}: no old-logprob recorded after the restore"
    diff = first["probs_diff"]
    step, k, pid = first["step"], int(seg.restore["step"]), seg.restore["pid"]
    chosen, ref = _reference_mod.at_step(seg.before, k, pid, ("logprobs",), step)
    if diff == 0.0 and not (ref is not None and _differ(ref, first, "sampled")):
        return Status.PASS, f"first old-logprob aligned: probs_diff 0 over {first['tokens']} tokens"
    # A real rollout engine (vLLM) runs other kernels than the trainer: probs_diff is not 0 without
    # batch-invariant kernels on both sides. It is aligned when it is bitwise the one the saving
    # run measured at the same step (what the engine and trainer would have given without the
    # kill); a stale engine or scale after the restore changes it, a lost sampling state the tokens.
    if ref is None or chosen is None:  # where the kill landed, not a difference
        return Status.MISSING, (
            f"rank {seg.rank}: first old-logprob of step {step} has probs_diff {diff:.3g}, and no "
            f"run before this resume recorded an old-logprob of that step to compare with "
            f"({_reference_mod.nothing_past(seg.before, k, pid, 'old-logprob of that step')})"
        )
    who = "the saving run's" if chosen.saved else f"that of {chosen.describe()}"
    same = all(
        same_bits(ref.get(k), first.get(k))
        for k in ("probs_diff", "max_abs_logprob_diff", "tokens")
    )
    if not same or _differ(ref, first, "sampled"):
        return Status.FAIL, (
            f"rank {seg.rank}: first old-logprob of step {step} has probs_diff {diff:.3g}, {who} "
            f"of the same step {ref['probs_diff']:.3g}. {_logprob_cause(seg, ref, first)}"
        )
    return Status.PASS, (
        f"first old-logprob of step {step}: probs_diff {diff:.3g} over {first['tokens']} tokens, "
        f"bitwise {who} of the same step (engine and trainer kernels differ)"
        + (", the same sampled token ids" if _differ(ref, first, "sampled") is False else "")
    )


def _updates(records: list[ProofRecord]) -> list[dict[str, Any]]:
    """The updates a run recorded, in order: its update records, else its step records with a
    grad_norm."""
    found = [
        {
            "step": r["step"],
            "grad_norm": r.get("grad_norm"),
            "params_changed": r.get("params_changed"),
        }
        for r in records
        if r["event"] == "update"
    ]
    if found:
        return found
    return [
        {
            "step": r["step"],
            "grad_norm": r["grad_norm"],
            "params_changed": (r.get("extra") or {}).get("params_changed", True),
        }
        for r in records
        if r["event"] == "step" and "grad_norm" in r
    ]


def _zero(update: Mapping[str, Any]) -> bool:
    norm = update.get("grad_norm")
    return (
        not isinstance(norm, (int, float))
        or not norm
        or norm != norm
        or not update.get("params_changed")
    )


def _gate_update(seg: _Segment, plan: ProofPlan) -> tuple[Status, str]:
    """The first non-zero update after the restore; a zero one is judged against what the reference
    run (``ops.reference``) did at that step: zero there too is the trajectory (a GRPO group whose
    rewards were all equal), non-zero there is a failure, not recorded there is missing evidence."""
    if (missing := _needs_restore(seg)) is not None:
        return missing
    assert seg.restore is not None
    k, pid = int(seg.restore["step"]), seg.restore["pid"]
    updates = _updates(seg.after)
    if not updates:
        return Status.MISSING, _no_update(seg)
    zeros: list[int] = []
    for i, u in enumerate(updates):
        if not _zero(u):
            also = (
                f" (steps {zeros} had a zero update, as the reference run had there)"
                if zeros
                else ""
            )
            return (
                Status.PASS,
                f"first non-zero update: grad_norm {u['grad_norm']:.3g} at step {u['step']}{also}",
            )
        chosen, ref = _reference_mod.at_step(seg.before, k, pid, ("update", "step"), u["step"])
        shown = (
            f"rank {seg.rank}: update of step {u['step']} had grad_norm {u['grad_norm']} and "
            f"params_changed={u['params_changed']}"
        )
        ref_update = _updates([ref])[0] if ref is not None and _updates([ref]) else None
        if (
            chosen is None or ref_update is None
        ) and zeros:  # compared as far as any earlier run recorded
            return _past_reference(seg, zeros, updates[i:], plan)
        if chosen is None or ref_update is None:
            return Status.MISSING, (
                f"{shown}, and no run before this resume recorded step {u['step']}'s update to "
                f"tell a zero the trajectory has from one the restore caused "
                f"({_reference_mod.nothing_past(seg.before, k, pid, 'update of that step')})"
            )
        if not _zero(ref_update):
            return Status.FAIL, (
                f"{shown}, where {chosen.describe()} had grad_norm {ref_update['grad_norm']:.3g} "
                f"at the same step: the optimizer or the gradients were lost in the restore"
            )
        zeros.append(int(u["step"]))
    return Status.PASS, (
        f"every update after the restore (steps {zeros[0]}-{zeros[-1]}) was zero, as the reference "
        "run's at the same steps (the trajectory has zero updates there)"
    )


def _exact_zero(update: Mapping[str, Any]) -> bool:
    norm = update.get("grad_norm")
    return isinstance(norm, (int, float)) and not isinstance(norm, bool) and norm == 0


def _past_reference(
    seg: _Segment, zeros: list[int], rest: list[dict[str, Any]], plan: ProofPlan
) -> tuple[Status, str]:
    """The updates past the last one an earlier run recorded, after zero updates that matched it. A
    zero gradient there continues the trajectory's (a converged GRPO policy); an optimizer that
    changed no parameter with a non-zero gradient is what a lost optimizer looks like, which nothing
    recorded can tell from a learning rate of zero (a warmup), so it is never a PASS."""
    matched = (
        f"the updates of steps {zeros[0]}-{zeros[-1]} were zero, as the reference run's at the "
        "same steps"
    )
    unrecorded: list[int] = []
    for u in rest:
        if not _zero(u):
            return Status.PASS, (
                f"first non-zero update: grad_norm {u['grad_norm']:.3g} at step "
                f"{u['step']} ({matched}; steps {unrecorded} past what any earlier run "
                f"recorded had a zero gradient)"
            )
        if not _exact_zero(u):
            return Status.MISSING, (
                f"rank {seg.rank}: {matched}, then step {u['step']}, which no earlier run "
                f"recorded, had grad_norm {u['grad_norm']} and "
                f"params_changed={u['params_changed']}: the optimizer changed no parameter with a "
                f"non-zero gradient, a lost optimizer state or a learning rate of zero (nothing "
                f"recorded tells which); kill a run later, so that an earlier run records that step"
            )
        unrecorded.append(int(u["step"]))
    if len(zeros) < plan.replay_steps:
        return Status.MISSING, (
            f"rank {seg.rank}: {matched}, {len(zeros)} step(s) compared where the plan asks for "
            f"{plan.replay_steps} (ProofPlan.replay_steps); steps {unrecorded} were recorded by no "
            "earlier run"
        )
    return Status.PASS, (
        f"{matched} (the trajectory has zero updates there); step {unrecorded[0]} and later were "
        "recorded by no earlier run and had a zero gradient"
    )


def _no_update(seg: _Segment) -> str:
    """Why the update gate has no evidence, and the call that records it."""
    calls = (
        "record_step(step, ..., grad_norm=<the step's gradient norm>) or "
        "record_update(step, grad_norm=..., params_changed=...) after the optimizer step"
    )
    steps = [int(r["step"]) for r in seg.after if r["event"] == "step"]
    if steps:
        return (
            f"rank {seg.rank}: steps {min(steps)}-{max(steps)} were recorded after the restore "
            f"without grad_norm, so no update was recorded: pass {calls}"
        )
    return f"rank {seg.rank}: no update recorded after the restore: call {calls}"


def _gate_trained(seg: _Segment, plan: ProofPlan) -> tuple[Status, str]:
    """A resume that trains zero steps and exits 0 looks like success (an exhausted loader at an
    epoch boundary): after the restore the process must record a step, unless the job had no steps
    left."""
    if (missing := _needs_restore(seg)) is not None:
        return missing
    assert seg.restore is not None
    k = int(seg.restore["step"])
    trained = sorted(
        {int(r["step"]) for r in seg.after if r["event"] in ("step", "update") and r["step"] > k}
    )
    if trained:
        return (
            Status.PASS,
            f"trained {len(trained)} step(s) after the restore of step {k} (to step {trained[-1]})",
        )
    ended = seg.first("exit")
    declared = ended.get("total_steps") if ended is not None else None
    total = declared if isinstance(declared, int) else plan.total_steps
    later = [int(r["step"]) for r in seg.before if r["event"] == "step" and r["step"] > k]
    of = f" of {total}" if total is not None else ""
    if ended is None:
        return Status.MISSING, (
            f"rank {seg.rank}: the process that restored step {k}{of} recorded no step and no exit "
            "(killed before its first step, or still running: prove again when it ends)"
        )
    if total is not None and k >= total:
        return (
            Status.NA,
            f"step {k} restored, the job's last (total_steps {total}): nothing left to train",
        )
    if total is None and not later:
        return Status.MISSING, (
            f"rank {seg.rank}: resumed at step {k} and trained 0 steps before the process "
            "exited; no total_steps declared and no earlier run recorded a step past it, so "
            "whether steps were left is unknown: declare ProofPlan(total_steps=)"
        )
    why = (
        f"the plan's total_steps is {total}"
        if total is not None
        else f"the killed run had reached step {max(later)}"
    )
    raised = ended.get("raised")
    if (
        isinstance(raised, str) and raised
    ):  # an exit record that names the uncaught exception the process died on
        return Status.FAIL, (
            f"rank {seg.rank}: resumed at step {k}{of} and trained 0 steps ({why}): the process "
            f"died on an uncaught exception before its first step: {raised[:500]}"
        )
    return Status.FAIL, (
        f"rank {seg.rank}: resumed at step {k}{of} and trained 0 steps, then the process exited "
        f"({why}): the data loader or the step range ended right after the restore, typically "
        "an exhausted loader at an epoch boundary (a loader iterator built once, a sampler whose "
        "epoch was not advanced); the job made no progress"
    )


def _gate_addresses(seg: _Segment) -> tuple[Status, str]:
    if (missing := _needs_restore(seg)) is not None:
        return missing
    assert seg.restore is not None
    moved = seg.restore.get("addresses_changed")
    if moved is None:
        return Status.MISSING, f"rank {seg.rank}: addresses were not recorded"
    if moved:
        return Status.FAIL, (
            f"rank {seg.rank}: restore replaced {len(moved)} tensor(s) instead of copying into "
            f"them, e.g. {moved[:3]}; CUDA graphs and rollout engines hold the old addresses"
        )
    return Status.PASS, "every parameter and buffer kept its data_ptr through the restore"


def _code_text(code: dict[str, Any]) -> str:
    parts = [f"code {code['hash']}" if code.get("hash") else "no code hash"]
    parts += [f"{k} {code[k]}" for k in ("ckptguard", "torch", "python") if code.get(k)]
    return ", ".join(parts)


def _code(segments: list[_Segment]) -> Gate | None:
    """Which code saved the restored step and which resumed it (recorded with saves and restores),
    as information."""
    seg = next(
        (s for s in segments if _restored(s) and s.restore is not None and "code" in s.restore),
        None,
    )
    if seg is None or seg.restore is None:
        return None
    resumed, step = seg.restore["code"], seg.restore["step"]
    save = next(
        (r for r in reversed(seg.before) if r["event"] == "save" and r["step"] == step), None
    )
    saved = save.get("code") if save is not None else None
    hint = (
        ""
        if resumed.get("hash")
        else "; declare CheckpointConfig(contract=RunContract(code=hash_git_tree('.')))"
        " to record the code's own hash"
    )
    if not isinstance(saved, dict):
        return Gate(
            "code identity",
            Status.INFO,
            f"resumed by {_code_text(resumed)}; the save of step {step} "
            f"recorded no code identity (an older ckptguard){hint}",
            required=False,
        )
    if saved == resumed and not resumed.get(
        "hash"
    ):  # equal versions say nothing of the training code itself
        return Gate(
            "code identity",
            Status.INFO,
            f"the code was NOT compared: no code hash was declared; step {step} "
            f"was saved and resumed under the same versions ({_code_text(resumed)}){hint}",
            required=False,
        )
    if saved == resumed:
        return Gate(
            "code identity",
            Status.INFO,
            f"step {step} saved and resumed by the same code ({_code_text(resumed)})",
            required=False,
        )
    changed = sorted(k for k in {*saved, *resumed} if saved.get(k) != resumed.get(k))
    return Gate(
        "code identity",
        Status.INFO,
        (
            f"the saving and the resumed runs ran different code ({', '.join(changed)} "
            f"differ): saved by {_code_text(saved)}, resumed by {_code_text(resumed)}; the "
            f"replay compares the two{hint}"
        ),
        required=False,
    )


def _tier(segments: list[_Segment]) -> Gate | None:
    """Which tier the newest restore loaded (a TieredCheckpoint records it), as information."""
    tiers = [
        s.restore
        for s in segments
        if s.restore is not None and _restored(s) and "tier" in s.restore
    ]
    if not tiers:
        return None
    names = sorted({str(r.get("tier")) for r in tiers})
    fetched = sorted(
        {int(x) for r in tiers for x in (r.get("replica_ranks") or []) if isinstance(x, int)}
    )
    step = tiers[0].get("step")
    also = f"; ranks {fetched} fetched their files from peer replicas" if fetched else ""
    detail = str(tiers[0].get("tier_detail") or "")
    why = f" ({detail})" if detail and not fetched else ""
    return Gate(
        "restored from tier",
        Status.INFO,
        f"step {step} from the {' and '.join(names)} tier on {len(tiers)} rank(s){also}{why}",
        required=False,
    )


# ---------------------------------------------------------------- replayed steps


@dataclass
class _Replay:
    """One rank's comparison of its replayed steps with the killed run's."""

    rank: int
    status: Status = Status.MISSING
    evidence: str = ""
    steps: list[int] = field(default_factory=list)  # compared
    first_bad: int | None = None
    diffs: list[tuple[int, str, Any, Any]] = field(
        default_factory=list
    )  # (step, name, killed, resumed)
    numbers: int = 0  # values compared
    fields: set[str] = field(default_factory=set)  # data fields compared (sample_ids, batch)
    threads: dict[int, tuple[Any, Any]] = field(
        default_factory=dict
    )  # step -> (killed, resumed) CPU threads
    epoch: tuple[bool | None, str] = (
        None,
        "",
    )  # whether the compared steps crossed into the data's next pass
    reference: _reference_mod.Candidate | None = None  # the run compared with
    restored: int | None = None  # the restored step
    ref_steps: list[int] = field(default_factory=list)  # the steps the reference recorded past it
    resumed_steps: list[int] = field(
        default_factory=list
    )  # the steps the resumed run recorded past it
    no_reference: bool = (
        False  # no run before the resume recorded a step past the restored one on this rank
    )
    resumed_none: bool = (
        False  # the resumed run recorded no step past the restored one on this rank
    )
    rng: tuple[int, dict[str, Any], dict[str, Any]] | None = (
        None  # (step, killed, resumed) global RNG digests
    )
    once: str = ""  # what the exactly-once check against the steps up to the restored one found
    once_missing: bool = (
        False  # that check found a repeat it cannot tell from a new pass over the data
    )
    saver_recorded: bool = (
        False  # this rank holds the save record of the restored step, at one world size
    )
    data_cause: bool = (
        False  # the data order's FAIL names its cause from the ids (no RNG guess appended)
    )
    key_next: tuple[
        Any, ...
    ] = ()  # the data the resumed run consumed at the step after the restored one
    key_at_k: tuple[Any, ...] = ()  # the data the killed run consumed at the restored step


def _data(r: ProofRecord) -> dict[str, Any]:
    return {k: r[k] for k in DATA_FIELDS if k in r}


def _show(r: ProofRecord) -> str:
    if isinstance(r.get("ids_head"), list):
        shown = r["ids_head"][:IDS_SHOWN]
        more = " ..." if r.get("samples", 0) > len(shown) else ""
        return f"ids {shown}{more} (digest {r['sample_ids']})"
    return ", ".join(f"{k} {v}" for k, v in _data(r).items())


def _key(r: ProofRecord) -> tuple[Any, ...]:
    return tuple(sorted(_data(r).items()))


def _drawn_before_restore(
    step: int,
    k: int,
    key: tuple[Any, ...],
    firsts: dict[tuple[Any, ...], int],
    ref: dict[int, list[Any]],
    after: dict[int, list[Any]],
) -> str | None:
    """A batch drawn before ``restore`` (nanoGPT's naive loop: ``X, Y = get_batch()`` above the
    loop) comes from an RNG not yet restored: the first replayed step consumes what a fresh
    process's first step consumed, and the next step, drawn after the restore, is the killed run's
    again."""
    if step != k + 1 or key not in firsts:
        return None
    nxt_a, nxt_b = ref.get(step + 1), after.get(step + 1)
    if nxt_a and nxt_b and _key(nxt_a[0]) != _key(nxt_b[0]):
        return None  # the next step differs too: not one batch drawn early
    if nxt_a and nxt_b:
        return (
            f"The resumed run consumed at its first step after the restore (step {step}) what a "
            f"freshly started process consumed at its first step (step {firsts[key]}); step "
            f"{step + 1} matches the killed run's again: the batch was drawn before restore(), "
            f"from an RNG not yet restored. Draw the first batch after restore() (or keep the "
            f"batch drawn ahead in the state: state['batch'] = ckptguard.PerRank(batch))"
        )
    # No next step to tell the two apart: a sampler without its generator that starts a new pass
    # right after the restore draws the fresh process's first order too.
    return (
        f"The resumed run consumed at its first step after the restore (step {step}) what a "
        f"freshly started process consumed at its first step (step {firsts[key]}); step {step + 1} "
        f"was not recorded by both runs, so two causes fit: the batch was drawn before restore(), "
        f"from an RNG not yet restored (draw it after restore(), or keep it in the state: "
        f"state['batch'] = ckptguard.PerRank(batch)), or a sampler whose torch.Generator is not in "
        f"the state began a new epoch in its first order (add state['sampler_gen'] = "
        f"ckptguard.GeneratorState(sampler.generator)); more replayed steps, "
        f"ProofPlan(replay_steps=2), tell which"
    )


_GENERIC_HINT = (
    "The state usually lacks one of:"  # no cause read from the ids: the RNG streams may tell
)


def _shift_within(killed: ProofRecord, resumed: ProofRecord) -> int | None:
    """How many samples the resumed step's ids are ahead of the killed step's within the step: the
    resumed ids start with the killed ids from position m on (a micro-batch drawn before the save
    point, lost), seen in the ids each record keeps (``ids_head``); None: no such shift (at least 2
    ids overlapping)."""
    a, b = killed.get("ids_head"), resumed.get("ids_head")
    if not (isinstance(a, list) and isinstance(b, list)) or len(a) != len(b) or a == b:
        return None
    # ids repeated within the step (padding ids, a periodic list) would match at a shift by chance
    return next(
        (
            m
            for m in range(1, len(a) - 1)
            if a[m:] == b[: len(a) - m]
            and len(set(map(repr, a[m:]))) > 1
            and len(set(map(repr, a))) == len(a)
        ),
        None,
    )


def _hint(
    rank: int,
    step: int,
    resumed: ProofRecord,
    ref: dict[int, list[Any]],
    history: dict[tuple[Any, ...], int],
    before_restore: str | None = None,
    restored: int | None = None,
) -> str:
    """What kind of state is usually missing, from where the resumed run's data came from."""
    if before_restore is not None:
        return before_restore
    shift = _shift_within(ref[step][0], resumed) if ref.get(step) else None
    if shift is not None:
        return (
            f"Prefetch lost within the step: the resumed run's ids of step {step} start with the "
            f"killed run's from position {shift} on, so {shift} sample(s) drawn before the save "
            f"point (a prefetched micro-batch, e.g. gradient accumulation's next batch drawn after "
            f"each forward) were not in the state; keep the prefetched batch in the state, e.g. "
            f"state['prefetched'] = ckptguard.PerRank(batch)"
        )
    key = tuple(sorted(_data(resumed).items()))
    ahead = [
        s
        for s, recs in ref.items()
        if s > step and any(tuple(sorted(_data(r).items())) == key for r in recs)
    ]
    if ahead and restored is not None and step > restored + 1:
        # The first replayed step(s) matched: the batch drawn before the save point was kept; the
        # data position that feeds the later steps was saved ahead of the training
        later = min(ahead)
        return (
            f"Cursor saved ahead of training: steps {restored + 1}-{step - 1} matched the killed "
            f"run's, then the resumed run consumed at step {step} what the killed run consumed at "
            f"step {later}: the data position saved with step {restored} was {later - step} "
            f"batch(es) ahead of the steps trained (a cursor advanced before the save point, or "
            f"saved after a batch was drawn for a later step); save the position of the last batch "
            f"trained (ckptguard.DataCursor counts consumed samples)"
        )
    if ahead:
        later = min(ahead)
        return (
            f"The resumed run consumed at step {step} what the killed run consumed at step "
            f"{later}: a batch drawn before the save point (a prefetch) was lost, or the "
            f"data cursor was saved ahead of the training; keep a prefetched batch in the "
            f"state, e.g. state['prefetched'] = ckptguard.PerRank(batch), and save the "
            f"position of the last batch trained"
        )
    if key in history and history[key] < step:
        return (
            f"The resumed run consumed at step {step} the data of step {history[key]} again: an "
            f"epoch or a stream replayed, typically a sampler whose torch.Generator is not in the "
            f"state; add state['sampler_gen'] = ckptguard.GeneratorState(sampler.generator)"
        )
    more = (
        " (with more replayed steps, ProofPlan(replay_steps=2), the gate tells which)"
        if len(ref) < 2
        else ""
    )
    return (
        f"{_GENERIC_HINT} a batch drawn before the save point (a prefetch: state['prefetched'] = "
        f"ckptguard.PerRank(batch)), a sampler's torch.Generator (state['sampler_gen'] = "
        f"ckptguard.GeneratorState(sampler.generator)), a data iterator's position (a loader "
        f"without state_dict/load_state_dict){more}"
    )


def _reference(
    seg: _Segment, before: list[ProofRecord]
) -> tuple[_reference_mod.Candidate | None, dict[int, list[Any]], dict[tuple[Any, ...], int]]:
    """The run the replay compares with (``ops.reference``: the saving run, else the earliest resume
    of the same step that recorded past it), its step records after the restored step, and every
    earlier step's data (for hints)."""
    assert seg.restore is not None
    k, pid = int(seg.restore["step"]), seg.restore["pid"]
    chosen, ref = _reference_mod.earliest(before, k, pid)
    history: dict[tuple[Any, ...], int] = {}
    for r in before:
        if r["event"] == "step" and r["pid"] != pid and _data(r):
            history.setdefault(tuple(sorted(_data(r).items())), int(r["step"]))
    return chosen, ref, history


def _against(chosen: _reference_mod.Candidate | None) -> str:
    """Which run a comparison used, when not the saving run (a crash loop's earlier resume)."""
    if chosen is None or chosen.saved:
        return ""
    return (
        f" (compared with {chosen.describe()}, the earliest run that recorded past it: the run "
        f"that saved it recorded nothing past it)"
    )


def _first_steps(before: list[ProofRecord], pid: Any) -> dict[tuple[Any, ...], int]:
    """The data of each earlier process's first step record, by its data (the first batch a fresh
    process draws)."""
    seen: set[Any] = set()
    out: dict[tuple[Any, ...], int] = {}
    for r in before:
        if r["event"] == "step" and r["pid"] != pid and r["pid"] not in seen:
            seen.add(r["pid"])
            if _data(r):
                out.setdefault(_key(r), int(r["step"]))
    return out


def _history(before: list[ProofRecord], pid: Any, k: int) -> dict[int, ProofRecord]:
    """Each step up to k with its data, as the runs before the resume recorded it last (the lineage
    that reached step k)."""
    out: dict[int, ProofRecord] = {}
    for r in before:
        if (
            r["event"] == "step"
            and r["pid"] != pid
            and r.step is not None
            and r.step <= k
            and _data(r)
        ):
            out[int(r.step)] = r
    return out


def _consumed_again(
    rank: int,
    k: int,
    steps: list[int],
    resumed: dict[int, list[ProofRecord]],
    before: list[ProofRecord],
    pid: Any,
) -> tuple[Status | None, str, int | None]:
    """Exactly once: whether a replayed step consumed data already consumed at or before step k. An
    earlier resume shares a restore bug that replays the same way every time (a data position put
    back to the pass's start), so where no run that trained step k recorded past it, this is the
    check left. A repeat in the same recorded epoch is a FAIL; without ``epoch=`` a repeat is also
    what a new pass beginning right after step k consumes, so it is missing evidence, never a PASS.
    Returns (status, why, the step): status None when nothing was found (why says what was
    checked)."""
    history = _history(before, pid, k)
    if not history:
        return (
            None,
            f"rank {rank}: no step up to {k} recorded with its data: data "
            f"consumed twice not checked",
            None,
        )
    keys = {step: _key(r) for step, r in history.items()}
    repeats = len(set(keys.values())) < len(keys)
    for s in steps:
        b = resumed[s][0]
        if not _data(b):
            continue
        earlier = [history[j] for j in sorted(history) if keys[j] == _key(b)]
        if not earlier:
            continue
        epoch = _epoch_of(b)
        same = [h for h in earlier if epoch is not None and _epoch_of(h) == epoch]
        if same:
            return (
                Status.FAIL,
                (
                    f"rank {rank}, step {s}: the resumed run consumed {_show(b)}, already consumed "
                    f"at step {same[-1]['step']} in the same epoch {epoch!r}, before the save of "
                    f"step {k}: data consumed twice in one pass, a data position put back in the "
                    "restore (a sampler's position or epoch, or a cursor, not in the state or "
                    "restored to an older value); a restore bug that every resume repeats, so "
                    "comparing resumes could not show it"
                ),
                s,
            )
        if epoch is not None and all(_epoch_of(h) is not None for h in earlier):
            continue  # consumed in an earlier epoch: a new pass over the data
        if repeats:
            return (
                None,
                (
                    f"rank {rank}: data consumed twice not checked: steps up to {k} consumed the "
                    f"same data more than once (passes over the data) and no epoch was recorded "
                    f"(record_step(..., epoch=))"
                ),
                None,
            )
        return (
            Status.MISSING,
            (
                f"rank {rank}, step {s}: the resumed run consumed {_show(b)}, which step "
                f"{earlier[-1]['step']} consumed before the save of step {k}: either a new pass "
                f"over the data began after step {k} or the restore put the data position back (a "
                "restore bug that every resume repeats, so comparing resumes cannot tell); no run "
                f"that trained step {k} recorded past it, and no epoch was recorded: "
                "record_step(..., epoch=) tells"
            ),
            s,
        )
    return None, f"no replayed step consumed data already consumed up to step {k}", None


def _compare_update(
    out: _Replay, seg: _Segment, before: list[ProofRecord], k: int, step: int
) -> None:
    """The replayed update's grad_norm (``record_update``: after the all-reduce, so it carries every
    rank's data) against the reference run's of the same step, where both recorded one."""
    assert seg.restore is not None
    _chosen, ref = _reference_mod.at_step(before, k, seg.restore["pid"], ("update",), step)
    mine = next((r for r in seg.after if r["event"] == "update" and r["step"] == step), None)
    a = ref.get("grad_norm") if ref is not None else None
    b = mine.get("grad_norm") if mine is not None else None
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        out.numbers += 1
        if not same_bits(a, b):
            out.diffs.append((step, "grad_norm (record_update)", a, b))


def _replay(seg: _Segment, before: list[ProofRecord], plan: ProofPlan) -> _Replay:
    out = _Replay(seg.rank)
    if (missing := _needs_restore(seg)) is not None:
        out.status, out.evidence = missing
        return out
    assert seg.restore is not None
    k = int(seg.restore["step"])
    chosen, ref, history = _reference(seg, before)
    out.reference = chosen
    resumed: dict[int, list[ProofRecord]] = {}
    for r in seg.after:
        if r["event"] == "step" and r["step"] > k:
            resumed.setdefault(int(r["step"]), []).append(r)
    out.restored, out.ref_steps, out.resumed_steps = k, sorted(ref), sorted(resumed)
    out.key_next = _key(resumed[k + 1][0]) if resumed.get(k + 1) else ()
    out.key_at_k = next(
        (_key(r) for r in reversed(before) if r["event"] == "step" and r["step"] == k), ()
    )
    found = _reference_mod.candidates(before, k, seg.restore["pid"])
    out.saver_recorded = any(c.saved and c.save_recorded for c in found) and seg.restore.get(
        "saved_world_size", seg.restore.get("world_size")
    ) == seg.restore.get("world_size")
    if not found:
        out.no_reference = True
        lost = (
            "no record of any run before this resume on this rank (its records "
            "lost, e.g. with its node)"
            if not any(r.pid != seg.restore["pid"] for r in before)
            else f"no record of the process that saved step {k} (its save record lost "
            f"with a kill right after the "
            "commit) and no earlier resume of it"
        )
        out.evidence = f"rank {seg.rank}: {lost}: no killed run to compare with"
        return _unreferenced(out, k, resumed, before, seg.restore["pid"])
    if not ref:
        out.no_reference = True
        out.evidence = (
            f"rank {seg.rank}: no run before this resume recorded a step past step {k} "
            f"({_reference_mod.nothing_past(before, k, seg.restore['pid'], 'step')}; killed right "
            f"after the save, or record_step not called): nothing to compare the replay with"
        )
        return _unreferenced(out, k, resumed, before, seg.restore["pid"])
    if not resumed:
        out.resumed_none = True
        out.evidence = (
            f"rank {seg.rank}: the resumed run recorded no step after the restore of step {k}"
        )
        return out
    last = max(ref)
    out.steps = sorted(set(ref) & set(resumed))
    data_seen = False
    for s in out.steps:
        a_recs, b_recs = ref[s], resumed[s]
        if len(a_recs) != len(b_recs) and s != last:
            out.status, out.first_bad = Status.FAIL, s
            out.evidence = (
                f"rank {seg.rank}, step {s}: recorded {len(a_recs)} time(s) by the killed run and "
                f"{len(b_recs)} by the resumed run"
            )
            return out
        for a, b in zip(a_recs, b_recs, strict=False):
            if (
                out.rng is None
                and isinstance(a.get("rng"), dict)
                and isinstance(b.get("rng"), dict)
            ):
                out.rng = (s, a["rng"], b["rng"])  # the first step past the save and the restore
            da, db = _data(a), _data(b)
            data_seen = data_seen or bool(da or db)
            out.fields |= set(da) & set(db)
            if set(da) != set(db):
                out.status, out.first_bad = Status.FAIL, s
                out.evidence = (
                    f"rank {seg.rank}, step {s}: the killed run recorded "
                    f"{sorted(da) or 'no data'}, the resumed run {sorted(db) or 'no data'}"
                )
                return out
            if da != db:
                out.status, out.first_bad = Status.FAIL, s
                early = _drawn_before_restore(
                    s, k, _key(b), _first_steps(before, seg.restore["pid"]), ref, resumed
                )
                hint = _hint(seg.rank, s, b, ref, history, early, k)
                out.data_cause = not hint.startswith(_GENERIC_HINT)
                out.evidence = (
                    f"rank {seg.rank}, step {s} (first replayed step {min(out.steps)}): the "
                    f"resumed run consumed {_show(b)}, the killed run {_show(a)}. {hint}"
                )
                return out
            out.threads.setdefault(s, (a.get("threads"), b.get("threads")))
            na, nb = numerics(a), numerics(b)
            for name in [*na, *(n for n in nb if n not in na)]:  # loss, grad_norm, then the extras
                out.numbers += 1
                if name not in na or name not in nb or not same_bits(na[name], nb[name]):
                    out.diffs.append((s, name, na.get(name, "absent"), nb.get(name, "absent")))
        _compare_update(out, seg, before, k, s)
    out.epoch = _epoch_crossing(k, [ref[s][0] for s in out.steps], before)
    if not out.steps:
        out.evidence = (
            f"rank {seg.rank}: the killed run recorded steps {min(ref)}-{last} after step {k}, the "
            f"resumed run steps {min(resumed)}-{max(resumed)}: no step in common"
        )
    elif not data_seen:
        out.evidence = (
            f"rank {seg.rank}: steps {out.steps[0]}-{out.steps[-1]} were recorded without "
            f"sample_ids or batch: the data order was not compared"
        )
    elif len(out.steps) < plan.replay_steps:
        out.evidence = (
            f"rank {seg.rank}: {len(out.steps)} step(s) replayed, the plan asks for "
            f"{plan.replay_steps} (ProofPlan.replay_steps)"
        )
    else:
        out.status = Status.PASS
        span = (
            f"step {out.steps[0]}"
            if len(out.steps) == 1
            else f"steps {out.steps[0]}-{out.steps[-1]}"
        )
        out.evidence = f"{span} replayed after the restore of step {k}{_against(chosen)}"
        if chosen is not None and not chosen.saved:  # an earlier resume may share the restore bug
            once, out.once, step = _consumed_again(
                seg.rank, k, out.steps, resumed, before, seg.restore["pid"]
            )
            if once is not None:
                out.status, out.evidence = once, out.once
                out.first_bad = step if once is Status.FAIL else None
    return out


def _unreferenced(
    out: _Replay, k: int, resumed: dict[int, list[ProofRecord]], before: list[ProofRecord], pid: Any
) -> _Replay:
    """A rank with no run to compare its replay with is still checked for data consumed twice in one
    epoch (any step), and its first replayed step for a repeat that may also be a new pass (what
    another rank judges it by, ``_symmetric``; a later step may begin the next pass, as a wrapping
    cursor's does)."""
    once, out.once, step = _consumed_again(out.rank, k, sorted(resumed), resumed, before, pid)
    if once is not Status.FAIL:
        first = [s for s in resumed if s == k + 1]
        once, out.once, step = _consumed_again(out.rank, k, first, resumed, before, pid)
        out.once_missing = once is Status.MISSING
    else:
        out.status, out.evidence, out.no_reference, out.first_bad = (
            Status.FAIL,
            out.once,
            False,
            step,
        )
    return out


def _epoch_of(r: ProofRecord) -> Any:
    return (r.get("extra") or {}).get("epoch")


def _epoch_crossing(
    k: int, compared: list[ProofRecord], before: list[ProofRecord]
) -> tuple[bool | None, str]:
    """Whether the compared steps (the killed run's records) reach the data's next pass: exactly
    from a recorded ``epoch`` extra, else when a compared step consumes an id already consumed in
    the pass of step k (found back from k to the first repeated id; only each step's first ids are
    recorded)."""
    if not compared:
        return None, ""
    at_k = next((r for r in reversed(before) if r["event"] == "step" and r["step"] == k), None)
    epochs = [
        e for e in [_epoch_of(at_k) if at_k else None, *map(_epoch_of, compared)] if e is not None
    ]
    if epochs:
        for prev, r in zip([at_k, *compared], compared, strict=False):
            if prev is not None and _epoch_of(prev) is not None and _epoch_of(r) != _epoch_of(prev):
                return (
                    True,
                    f"epoch {_epoch_of(prev)} -> {_epoch_of(r)} at step "
                    f"{r['step']} (record_step epoch=)",
                )
        return False, f"all in epoch {epochs[-1]} (record_step epoch=)"
    heads = {
        int(r["step"]): list(r.get("ids_head") or [])
        for r in before
        if r["event"] == "step" and r["step"] <= k
    }
    seen: dict[
        Any, int
    ] = {}  # the ids of the pass the restored step is in: back from k to the first repeat
    for step in sorted(heads, reverse=True):
        if any(i in seen for i in heads[step]):
            break
        seen.update({i: step for i in heads[step]})
    for r in compared:
        again = [i for i in r.get("ids_head") or [] if i in seen]
        if again:
            first = seen[again[0]]
            return (
                True,
                f"step {r['step']} consumed sample {again[0]!r} again (also "
                f"consumed at step {first})",
            )
        seen.update({i: int(r["step"]) for i in r.get("ids_head") or []})
    if not any("ids_head" in r for r in compared):
        return None, "not known (record_step(..., epoch=) or integer/string sample_ids tell)"
    return None, (
        "not seen: no compared step's first recorded ids were consumed before (only the first ids "
        "of each step are recorded; record_step(..., epoch=) tells exactly)"
    )


def _coverage(replays: list[_Replay]) -> Gate | None:
    """How much the replay compared, and whether a state used only at the next epoch could have
    shown."""
    compared = [r for r in replays if r.steps]
    if not compared:
        return None
    counts = sorted({len(r.steps) for r in compared})
    per_rank = (
        f"{counts[0]} replayed step(s) compared on each of {len(compared)} rank(s)"
        if len(counts) == 1
        else "replayed steps compared per rank: "
        + ", ".join(f"rank {r.rank}: {len(r.steps)}" for r in compared)
    )
    crossed = next((r.epoch for r in compared if r.epoch[0] is True), None)
    if crossed is not None:
        return Gate(
            "replay coverage",
            Status.INFO,
            f"{per_rank}; they crossed into the data's next pass: {crossed[1]}",
            required=False,
        )
    known = next((r.epoch for r in compared if r.epoch[0] is False), None) or compared[0].epoch
    return Gate(
        "replay coverage",
        Status.INFO,
        (
            f"{per_rank}; epoch boundary: {known[1] or 'not known'}. The replay could not have "
            f"seen a state that acts only at the next pass over the data (a sampler's "
            f"torch.Generator left out of the state, a per-epoch seed or set_epoch): kill a run "
            f"past an epoch boundary, with ProofPlan(replay_steps=) reaching it, to compare there"
        ),
        required=False,
    )


def _same_data_as(lacking: _Replay, judged: list[_Replay]) -> bool:
    """Whether ``lacking`` consumed after the restore the data a judged rank consumed at that step
    although, at the restored step, the two ranks consumed different data (data parallel): its shard
    of the data was lost. Ranks that share their data (tensor parallel: equal at the restored step
    too) stay symmetric."""
    return bool(lacking.key_next) and any(
        lacking.key_next == j.key_next
        and lacking.key_at_k
        and j.key_at_k
        and lacking.key_at_k != j.key_at_k
        for j in judged
    )


def _symmetric(replays: list[_Replay], plan: ProofPlan) -> str | None:
    """Where a job-wide kill left ranks one record apart, what the ranks that recorded show for the
    others, in words (None: not that case). It is that case when every rank either replayed and
    matched, or had no reference at all; the ranks with one recorded only the step after the
    restored one (DDP ranks meet at every step's all-reduce, so they are at most one record apart);
    and the ranks without one replayed that step too. Ranks of one world size that restored one
    step run the same step on their own samples: the matching replay stands for theirs. It stands
    only where the plan is deterministic (the judged ranks' bitwise numbers then carry every rank's
    contribution through the all-reduce), every rank without a reference holds the save record of
    that step at the same world size (else nothing says that rank ran the job at all: a node whose
    records were lost), and none of them consumed data it had consumed before the save."""
    judged = [r for r in replays if r.status is Status.PASS]
    behind = [r for r in replays if r.resumed_none and not r.no_reference]
    if (
        behind and judged and len(behind) + len(judged) == len(replays)
    ):  # the resumed run's ranks one apart
        k = judged[0].restored
        if k is not None and all(r.restored == k and r.resumed_steps == [k + 1] for r in judged):
            return _behind_note(([r.rank for r in behind], [r.rank for r in judged], k))
    lacking = [r for r in replays if r.no_reference]
    if not lacking or not judged or len(lacking) + len(judged) != len(replays):
        return None
    k = judged[0].restored
    if k is None or any(r.restored != k or r.ref_steps != [k + 1] for r in judged):
        return None
    if any(r.restored != k or k + 1 not in r.resumed_steps for r in lacking):
        return None
    if not plan.deterministic or any(not r.saver_recorded or r.once_missing for r in lacking):
        return None  # the lacking ranks stay MISSING: nothing stands for their data
    shared = [r for r in lacking if _same_data_as(r, judged)]
    # a rank that consumed another rank's samples does not run "the same step on its own samples"
    for r in shared:
        r.evidence += (
            f"; not judged by rank(s) {[j.rank for j in judged]}: at step {k + 1} it "
            f"consumed the data a judged rank consumed there, although at step {k} the "
            f"ranks consumed different data (its own shard of the data lost, e.g. a "
            f"sampler's rank or world size not restored)"
        )
    if shared:
        return None
    ranks, others = [r.rank for r in lacking], [r.rank for r in judged]
    return (
        f"; rank(s) {ranks}: the killed run had recorded nothing past step {k} there when the "
        f"job-wide kill landed, one record behind rank(s) {others}, which had recorded step "
        f"{k + 1}: judged by rank(s) {others}, whose replay of step {k + 1} matched (ranks "
        f"taken as symmetric: one world size, one restored step, each rank running the same "
        f"step on its own samples)"
    )


def _qualifies(replays: list[_Replay], sym: str | None) -> str:
    """What a data order PASS rests on besides each rank's own comparison with the run that saved
    the step."""
    notes = []
    loop = [
        r
        for r in replays
        if r.status is Status.PASS and r.reference is not None and not r.reference.saved
    ]
    if loop:
        k = loop[0].restored
        notes.append(
            f"data order of rank(s) {[r.rank for r in loop]} compared with an earlier resume of "
            f"step {k}, not with the run that saved it (which recorded nothing past it): a restore "
            f"bug every resume repeats would match; checked instead that no replayed step consumed "
            f"data consumed up to step {k}"
        )
    if sym is not None:
        lacking = [r.rank for r in replays if r.status is not Status.PASS]
        notes.append(
            f"data order of rank(s) {lacking} judged by the other ranks' replay (ranks taken as "
            "symmetric)"
        )
    return "; ".join(notes)


def _replay_gates(replays: list[_Replay], plan: ProofPlan) -> list[Gate]:
    sym = _symmetric(replays, plan)
    data = _combine(
        "data order identical",
        [(r.status, r.evidence) for r in replays if sym is None or r.status is Status.PASS],
    )
    failed = sorted(
        (r.first_bad, r.rank, r)
        for r in replays
        if r.status is Status.FAIL and r.first_bad is not None
    )
    if failed:  # the earliest differing step, and which other ranks differ too
        others = [rank for _s, rank, _r in failed[1:]]
        also = f" (ranks {others} differ too)" if others else ""
        rng = None if failed[0][2].data_cause else _rng_hint(replays, failed[0][2], data=True)
        data = Gate(
            data.name, Status.FAIL, failed[0][2].evidence + also + (f" {rng}" if rng else "")
        )
    elif data.status is Status.PASS:
        steps = sorted({s for r in replays for s in r.steps})
        names = {"sample_ids": "sample ids", "batch": "batch"}
        what = " and ".join(names[f] for f in DATA_FIELDS if any(f in r.fields for r in replays))
        ranks = (
            len(replays) if sym is None else len([r for r in replays if r.status is Status.PASS])
        )
        data = Gate(
            data.name,
            Status.PASS,
            f"{data.evidence} on {ranks} rank(s): {what} digests equal the "
            f"killed run's ({len(steps)} step(s)){sym or ''}",
            qualifies=_qualifies(replays, sym),
        )
    diffs = [(s, r.rank, name, a, b) for r in replays for s, name, a, b in r.diffs]
    diffs.sort(
        key=lambda d: (d[0], d[1])
    )  # stable: within a step, loss and grad_norm before the extras
    compared = [r for r in replays if r.steps and r.status is not Status.FAIL]
    count = sum(r.numbers for r in compared)
    name = "replayed steps identical"
    coverage = [g for g in [_coverage(replays)] if g is not None]
    if plan.deterministic:
        return [data, _deterministic_numbers(name, data, replays, diffs, count), *coverage]
    return [data, _declared_numbers(name, diffs, count), *coverage]


NOT_COMPARED = "replayed numerics not compared: the plan declares non-deterministic steps"


def _deterministic_numbers(
    name: str, data: Gate, replays: list[_Replay], diffs: list[Any], count: int
) -> Gate:
    """Bitwise: the first differing value FAILs, with the likely causes in order."""
    if diffs:
        # A rank whose own RNG streams differ is the cause even where an all-reduce spread it to the
        # others' numbers
        by_rank = {r.rank: r for r in replays}
        s, rank, what, a, b = next((d for d in diffs if _rng_streams(by_rank[d[1]])), diffs[0])
        replay = by_rank[rank]
        hint = _rng_hint(replays, replay) or _numbers_hint(replay, s)
        return Gate(
            name,
            Status.FAIL,
            f"rank {rank}, step {s}: {what} {a!r} in the killed run, {b!r} after the "
            f"resume (the plan compares replayed numerics bitwise). {hint}",
        )
    if data.status is not Status.PASS or not count:
        why = (
            "no values (loss, grad_norm, extras) recorded"
            if data.status is Status.PASS
            else "no replay compared"
        )
        return Gate(name, Status.MISSING, why)
    return Gate(
        name,
        Status.PASS,
        f"{count} values (loss, grad_norm, extras) bitwise equal to the killed run's",
    )


def _numbers_hint(replay: _Replay, step: int) -> str:
    """The likely causes of a bitwise difference where the data was the same, most likely first."""
    threads = replay.threads.get(step)
    if threads is not None and None not in threads and threads[0] != threads[1]:
        return (
            f"The killed run ran with {threads[0]} CPU threads, the resumed run with {threads[1]} "
            "(torch.get_num_threads()): reductions split differently; set OMP_NUM_THREADS or "
            "torch.set_num_threads alike in both."
        )
    batch = (
        "a changed batch composition (padding, packing, collate order: only sample ids were "
        "recorded, record_step(..., batch=...) compares the tensors too)"
        if "batch" not in replay.fields
        else "a changed batch composition inside the step (the batch tensors recorded "
        "are equal, so after them)"
    )
    streams = _rng_streams(replay)
    which = (
        f"not torch's global RNG: its streams after step {replay.rng[0]} equal the killed run's"
        if streams == [] and replay.rng is not None
        else "or torch's global RNG drawn at another point than in the killed run"
    )
    return (
        f"Likely causes, in order: (1) a generator used inside the step and not in the state "
        f"(dropout, noise, sampling; {which}: add state['gen'] = ckptguard.GeneratorState(gen)); "
        f"(2) a different thread count or kernel (OMP_NUM_THREADS, torch.set_num_threads, "
        f"torch.use_deterministic_algorithms, another device or library version); (3) {batch}. "
        f"Steps that are legitimately not bitwise (rollouts sampled across processes) declare "
        f"ProofPlan(deterministic=False)."
    )


def _rng_streams(replay: _Replay) -> list[str] | None:
    """The global RNG streams that differ from the reference's after the first step past the restore
    (None: not recorded by both runs)."""
    if replay.rng is None:
        return None
    _step, a, b = replay.rng
    return sorted(n for n in {*a, *b} if a.get(n) != b.get(n))


def _rng_hint(replays: list[_Replay], replay: _Replay, data: bool = False) -> str | None:
    """The cause a difference of the global RNG streams names: one rank's streams not put back, or
    on every rank a draw made at another point than in the killed run (a DataLoader iterator; for a
    data order that differs, first a batch drawn from the global RNG before the save point and not
    kept)."""
    mine = _rng_streams(replay)
    if not mine or replay.rng is None:
        return None
    step = replay.rng[0]
    compared = [r for r in replays if _rng_streams(r) is not None]
    same = [r.rank for r in compared if not _rng_streams(r)]
    if same:
        return (
            f"Cause: rank {replay.rank}'s RNG stream: its global RNG streams ({', '.join(mine)}) "
            f"after step {step} differ from the killed run's, while rank(s) {same} match: the "
            f"restore did not put back rank {replay.rank}'s own streams (each rank's RNG is its "
            f"own: restore every rank's, not rank 0's on all, and do not reseed after restore())."
        )
    prefetch = (
        "a batch drawn from the global RNG before the save point (a prefetch, e.g. get_batch() "
        "after the forward) and not kept in the state, so the resumed run draws it again at "
        "another point (keep it: state['prefetched'] = ckptguard.PerRank(batch)), or "
        if data
        else ""
    )
    return (
        f"Cause: the global RNG streams ({', '.join(mine)}) after step {step} differ from "
        f"the killed run's on every rank ({[r.rank for r in compared]}) although restore() "
        f"put them back: something drew from them at another point than in the killed run: "
        f"{prefetch or 'typically '}a DataLoader iterator created after restore() "
        f"(iter(DataLoader) draws its base seed, and a shuffling sampler without a "
        f"generator its order, from torch's global RNG: before step 1 in a fresh run, "
        f"after the restore in a resumed one). Fix: give the loader its own generator, "
        f"DataLoader(..., generator=g) with state['loader_gen'] = "
        f"ckptguard.GeneratorState(g), or feed it from a ckptguard.DataCursor."
    )


def _declared_numbers(name: str, diffs: list[Any], count: int) -> Gate:
    """The plan declares non-deterministic steps: the numbers are information, and the verdict says
    so."""
    plan_note = "information only: ProofPlan(deterministic=False)"
    if not count:
        return Gate(
            name,
            Status.INFO,
            f"not compared (no replayed values); {plan_note}",
            required=False,
            qualifies=NOT_COMPARED,
        )
    if not diffs:
        return Gate(
            name,
            Status.INFO,
            f"{count} values bitwise equal to the killed run's; {plan_note}",
            required=False,
            qualifies=NOT_COMPARED,
        )
    numeric = [(difference(a, b), s, rank, what, a, b) for s, rank, what, a, b in diffs]
    sized = [d for d in numeric if d[0] is not None]
    worst = max(sized, key=lambda d: d[0] or 0.0) if sized else (None, *diffs[0])
    size, s, rank, what, a, b = worst
    largest = f"largest difference {size:.3g}" if size is not None else "differs"
    return Gate(
        name,
        Status.INFO,
        f"{len(diffs)} of {count} values not bitwise; {largest} in {what} at "
        f"step {s}, rank {rank} ({a!r} killed, {b!r} resumed); {plan_note}",
        required=False,
        qualifies=NOT_COMPARED,
    )


# ---------------------------------------------------------------- resharded resumes


def _resharded(segments: list[_Segment]) -> tuple[int, int, int] | None:
    """(restored step, old world, new world) when the newest run restored onto another world
    size."""
    for seg in segments:
        r = seg.restore
        if (
            r is not None
            and _restored(seg)
            and r.get("saved_world_size") not in (None, 0, r.get("world_size"))
        ):
            return int(r["step"]), int(r["saved_world_size"]), int(r["world_size"])
    return None


def _gate_topology(segments: list[_Segment], old: int, new: int) -> Gate:
    name = "resharded resume"
    info = next(
        (s.restore.get("reshard") for s in segments if s.restore and s.restore.get("reshard")), None
    )
    if not info:
        return Gate(
            name,
            Status.INFO,
            f"{old} -> {new} ranks; the reshard rules were not recorded (older ckptguard)",
            required=False,
        )
    rules = ", ".join(f"{n}={r}" for n, r in sorted((info.get("rules") or {}).items()))
    return Gate(
        name, Status.INFO, f"{old} -> {new} ranks under {info.get('mode')}: {rules}", required=False
    )


def _gate_rng_distinct(segments: list[_Segment]) -> Gate:
    """After a resharded restore every rank's RNG streams must differ from every other's: a copy of
    another rank's (a rule that copies them) gives identical dropout and sampling."""
    name = "RNG streams distinct across ranks"
    digests: dict[int, str | None] = {}
    mode = None
    for seg in segments:
        if (missing := _needs_restore(seg)) is not None:
            return Gate(name, missing[0], missing[1])
        info = seg.restore.get("reshard") if seg.restore else None
        if not isinstance(info, dict):
            return Gate(
                name,
                Status.MISSING,
                f"rank {seg.rank}: the resharded restore recorded no RNG streams "
                "(written by an older ckptguard)",
            )
        digests[seg.rank], mode = info.get("rng"), info.get("mode")
    if all(d is None for d in digests.values()):
        return Gate(name, Status.NA, "no RNG streams were saved or put back", required=False)
    alike: dict[str | None, list[int]] = {}
    for rank, d in sorted(digests.items()):
        alike.setdefault(d, []).append(rank)
    same = [ranks for d, ranks in alike.items() if len(ranks) > 1 or d is None]
    if same:
        return Gate(
            name,
            Status.FAIL,
            (
                f"ranks {same[0]} hold the same RNG streams after the resharded restore (mode "
                f"{mode}): their dropout masks and sampling are identical. Restore under "
                f"ReshardRule.BY_ITEM with CheckpointConfig(reshard=ReshardOptions(rng_seed=<the "
                f"job's seed>)): each rank's streams are re-derived from (seed, step, rank)"
            ),
        )
    how = "re-derived from (seed, step, rank)" if mode == "by_item" else f"under {mode}"
    return Gate(
        name, Status.PASS, f"the {len(digests)} ranks' streams differ from each other ({how})"
    )


def _killed_steps(
    records: dict[int, list[ProofRecord]], k: int, old: int, new_pids: set[Any]
) -> tuple[dict[int, dict[int, list[ProofRecord]]], list[int]]:
    """Per step and old rank, the step records of the processes that saved step k and ran on; and
    the old ranks without a record of that save."""
    out: dict[int, dict[int, list[ProofRecord]]] = {}
    missing = []
    for r in range(old):
        recs = records.get(r, [])
        saver = next(
            (
                x["pid"]
                for x in reversed(recs)
                if x["event"] == "save" and x["step"] == k and x["pid"] not in new_pids
            ),
            None,
        )
        if saver is None:
            missing.append(r)
            continue
        for x in recs:
            if x["event"] == "step" and x["pid"] == saver and x["step"] > k:
                out.setdefault(int(x["step"]), {}).setdefault(r, []).append(x)
    return out, missing


def _spans(
    by_step: dict[int, dict[int, list[ProofRecord]]], k: int, world: int
) -> list[tuple[int, int, int]] | None:
    """(step, samples so far, multiset sum so far) over the steps after k that every rank recorded,
    in order; None when a record lacks the order-free digest of its sample ids."""
    out: list[tuple[int, int, int]] = []
    count = total = 0
    step = k + 1
    while len(by_step.get(step, {})) == world:
        for recs in by_step[step].values():
            for x in recs:
                if not isinstance(x.get("ids_sum"), str) or not isinstance(x.get("samples"), int):
                    return None
                count += x["samples"]
                total = (total + int(x["ids_sum"], 16)) % (1 << 64)
        out.append((step, count, total))
        step += 1
    return out


def _union_data(
    segments: list[_Segment],
    records: dict[int, list[ProofRecord]],
    plan: ProofPlan,
    k: int,
    old: int,
    new: int,
) -> Gate:
    """Exactly-once over the union of ranks: the samples the resumed run consumed after step k, as a
    multiset over all its ranks, equal the killed run's over all of its ranks, up to the last point
    where both had consumed the same number (batch boundaries differ when the world size does)."""
    name = "data order identical"
    for seg in segments:
        if (missing := _needs_restore(seg)) is not None:
            return Gate(name, missing[0], missing[1])
    new_pids = {s.restore["pid"] for s in segments if s.restore is not None}
    killed, missing_savers = _killed_steps(records, k, old, new_pids)
    if missing_savers:
        return Gate(
            name,
            Status.MISSING,
            f"no record of the processes that saved step {k} on old ranks "
            f"{missing_savers}: no killed run to compare with",
        )
    resumed: dict[int, dict[int, list[ProofRecord]]] = {}
    for seg in segments:
        for x in seg.after:
            if x["event"] == "step" and x["step"] > k:
                resumed.setdefault(int(x["step"]), {}).setdefault(seg.rank, []).append(x)
    a, b = _spans(killed, k, old), _spans(resumed, k, new)
    if a is None or b is None:
        return Gate(
            name,
            Status.MISSING,
            f"resharded {old} -> {new} ranks: steps after {k} were recorded without integer or "
            f"string sample_ids (or by an older ckptguard): exactly-once consumption over the "
            f"union of ranks was not checked",
        )
    if not a or not b:
        who = "the run that saved" if not a else "the resumed run"
        return Gate(
            name,
            Status.MISSING,
            f"resharded {old} -> {new} ranks: {who} step {k} recorded no step after it "
            "on all of its ranks: nothing to compare",
        )
    at_a = {count: (step, total) for step, count, total in a}
    common = [(count, step, total) for step, count, total in b if count in at_a and count > 0]
    if not common:
        return Gate(
            name,
            Status.MISSING,
            (
                f"resharded {old} -> {new} ranks: after step {k} the killed run consumed "
                f"{[c for _s, c, _t in a]} samples by step, the resumed run "
                f"{[c for _s, c, _t in b]}: no step where both had consumed as many; record more "
                "steps"
            ),
        )
    for count, step, total in common:
        killed_step, killed_total = at_a[count]
        if total != killed_total:
            return Gate(
                name,
                Status.FAIL,
                (
                    f"resharded {old} -> {new} ranks: the {count} samples the resumed run "
                    f"consumed in steps {k + 1}-{step} over its {new} ranks are not, as a "
                    f"multiset, the {count} the killed run consumed in steps "
                    f"{k + 1}-{killed_step} over its {old} ranks: a sample was repeated or "
                    f"skipped. A per-rank data position does not survive a change of world "
                    f"size: count the global position with ckptguard.DataCursor"
                ),
            )
    count, step, _total = common[-1]
    if step - k < plan.replay_steps:
        return Gate(
            name,
            Status.MISSING,
            f"resharded {old} -> {new} ranks: {step - k} step(s) replayed, the plan "
            f"asks for {plan.replay_steps} (ProofPlan.replay_steps)",
        )
    return Gate(
        name,
        Status.PASS,
        (
            f"resharded {old} -> {new} ranks: the {count} samples the killed run consumed in "
            f"steps {k + 1}-{at_a[count][0]} over {old} ranks are exactly, as a multiset over "
            f"the union of ranks, the {count} the resumed run consumed in steps {k + 1}-{step} "
            f"over {new} ranks: each sample once"
        ),
    )


def _resharded_gates(
    segments: list[_Segment],
    records: dict[int, list[ProofRecord]],
    plan: ProofPlan,
    k: int,
    old: int,
    new: int,
) -> list[Gate]:
    data = _union_data(segments, records, plan, k, old, new)
    numbers = Gate(
        "replayed steps identical",
        Status.INFO,
        (
            f"resharded {old} -> {new} ranks: each rank's batches differ from the killed run's, so "
            f"loss and grad_norm are not compared step by step"
        ),
        required=False,
        qualifies=f"replayed numerics not compared: resharded {old} -> {new} ranks",
    )
    return [data, numbers]


# ---------------------------------------------------------------- plan and evaluation


def _newest_run(segments: list[_Segment]) -> list[_Segment]:
    """The ranks of the newest run: a resharded resume onto fewer ranks leaves the others' files
    behind."""
    restores = [s for s in segments if s.restore is not None]
    if not restores:
        return segments
    newest = max(restores, key=lambda s: s.restore["time"])  # type: ignore[index]
    world = newest.restore.get("world_size")  # type: ignore[union-attr]
    return [s for s in segments if s.rank < world] if isinstance(world, int) else segments


def recorded_plan(root: str | os.PathLike[str]) -> tuple[ProofPlan, str]:
    """The plan recorded with the save of the newest restored step, and where it came from."""
    records = read_records(Path(os.fspath(root)))
    return _plan(records, _newest_run([_segment(r, recs) for r, recs in sorted(records.items())]))


def _plan(records: dict[int, list[ProofRecord]], segments: list[_Segment]) -> tuple[ProofPlan, str]:
    step = next((s.restore["step"] for s in segments if _restored(s)), None)  # type: ignore[index]
    saves = [r for recs in records.values() for r in recs if r["event"] == "save" and "plan" in r]
    if step is not None:
        own = [r for r in saves if r["step"] == step]
        if own:
            return ProofPlan(
                **max(own, key=lambda r: r["time"])["plan"]
            ), f"recorded with the save of step {step}"
    restores = [s.restore for s in segments if s.restore is not None and "plan" in s.restore]
    if restores:
        return ProofPlan(**restores[0]["plan"]), "recorded by the restoring run"
    if saves:
        return ProofPlan(
            **max(saves, key=lambda r: r["time"])["plan"]
        ), "recorded with the newest save"
    return LEGACY_PLAN, "not recorded (records written before ProofPlan): every gate applies"


def _behind(segments: list[_Segment]) -> tuple[list[int], list[int], int] | None:
    """(behind, ahead, k) where a job-wide kill caught the resumed run's ranks one record apart: the
    ranks ``behind`` recorded nothing after their restore of step k (and no exit), while every other
    rank recorded step k+1 and nothing past it. None otherwise."""
    if len(segments) < 2 or not all(_restored(s) and not _raised(s) for s in segments):
        return None
    steps = {int(s.restore["step"]) for s in segments if s.restore is not None}
    if len(steps) != 1:
        return None
    k = steps.pop()
    last = {
        s.rank: max(
            (
                int(r["step"])
                for r in s.after
                if r["event"] in ("step", "update") and r.step is not None and r.step > k
            ),
            default=None,
        )
        for s in segments
    }
    behind = [rank for rank, v in last.items() if v is None]
    ahead = [rank for rank, v in last.items() if v is not None]
    if not behind or not ahead or {last[r] for r in ahead} != {k + 1}:
        return None
    if any(s.first("exit") is not None for s in segments if s.rank in behind):
        return None  # a process that exited was not caught by a kill
    return behind, ahead, k


def _behind_note(behind: tuple[list[int], list[int], int]) -> str:
    ranks, ahead, k = behind
    return (
        f"; rank(s) {ranks} recorded nothing after the restore when the job-wide kill landed, one "
        f"record behind rank(s) {ahead}, which recorded step {k + 1}: judged by those (ranks taken "
        f"as symmetric: one world size, one restored step, each rank running the same step)"
    )


def _by_ranks_ahead(
    name: str, segments: list[_Segment], gate: Any, behind: tuple[list[int], list[int], int] | None
) -> Gate:
    """A gate over every rank, where a rank a kill caught one record behind (``_behind``) and that
    has nothing to show is judged by the ranks that recorded the step."""
    judged = [(s.rank, _judged(gate, s)) for s in segments]
    if behind is None or not any(
        rank in behind[0] and res[0] is Status.MISSING for rank, res in judged
    ):
        return _combine(name, [res for _rank, res in judged])
    kept = [res for rank, res in judged if not (rank in behind[0] and res[0] is Status.MISSING)]
    combined = _combine(name, kept)
    if combined.status is not Status.PASS:
        return combined
    return Gate(name, Status.PASS, combined.evidence + _behind_note(behind), combined.required)


def _resumes_agree(gate: Gate) -> Gate:
    """A PASS against an earlier resume (the saving run recorded nothing past the save) shows two
    resumes agree, which a restore bug every resume repeats (an adapter merged twice) also gives:
    the verdict says so."""
    if gate.status is not Status.PASS or "that of an earlier resume of step" not in gate.evidence:
        return gate
    return dataclasses.replace(
        gate,
        qualifies=f"{gate.name} compared with an earlier resume, not with the run that "
        "saved the step: a restore bug every resume repeats would match",
    )


def _not_rl(
    name: str, per_rank: list[tuple[Status, str]], plan: ProofPlan, where: str, recorded: bool
) -> Gate:
    if not plan.rl and not recorded:
        return Gate(
            name, Status.NA, f"(not an RL job): ProofPlan(rl=False), {where}", required=False
        )
    return _combine(name, per_rank)


def _judged(gate: Any, seg: _Segment) -> tuple[Status, str]:
    """A gate over records missing a field or of the wrong type FAILs with that as evidence, never
    raises."""
    try:
        judged: tuple[Status, str] = gate(seg)
        return judged
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        return Status.FAIL, (
            f"rank {seg.rank}: malformed proof record ({type(exc).__name__}: {exc}); the records "
            f"under proof/ were edited or damaged, so nothing can be proven from them"
        )


def evaluate(
    root: str | os.PathLike[str], *, plan: ProofPlan | None = None, resume: int | None = None
) -> list[Gate]:
    """Every gate, in order. ``plan`` overrides the recorded plan (to read the same records under
    another). ``resume`` judges that resume (1 the oldest, ``ops.resumes``); None the newest with
    evidence.

    A RunCheckpoint root (``run_roles``): a required gate that every role restored one run step
    holding every role, then every role's gates, each named ``<role>: <gate>``; a role without
    records has its gates MISSING."""
    root = Path(os.fspath(root))
    roles = run_roles(root)
    gates = (
        _evaluate_run(root, roles, plan, resume) if roles else _evaluate(root, plan, None, resume)
    )
    # A TurnLedger's gates (ops.prove_turns): every environment call once, every in-flight rollout
    # continued or restarted as its environment's kind says, continued turns' tokens equal; none
    # where no ledger recorded.
    return gates + [Gate(n, Status(s), e, q) for n, s, e, q in turn_rows(root)]


def resume_count(root: str | os.PathLike[str]) -> list[_resumes.Resume]:
    """The resumes recorded under ``root`` (of its first role, on a run root), oldest first."""
    root = Path(os.fspath(root))
    roles = run_roles(root)
    return _resumes.resumes(read_records(root, roles[0] if roles else None))


def _chosen_segments(
    records: dict[int, list[ProofRecord]], resume: int | None
) -> tuple[list[_Segment], Gate | None]:
    """Each rank's segment around the judged resume, and the line saying which one (None: no
    resume)."""
    try:
        chosen, why = _resumes.pick(records, resume)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if chosen is None:
        return [_segment(rank, recs) for rank, recs in sorted(records.items())], None
    times = _resumes.launch_times(records)
    out = []
    for rank, recs in sorted(records.items()):
        idx = _resumes.record_of(recs, chosen.time, times)
        if idx is None:
            out.append(
                _Segment(rank, None, [r for r in recs if float(r.get("time", 0)) < chosen.time])
            )
        else:
            out.append(_segment(rank, recs, idx))
    return out, Gate("resume judged", Status.INFO, why, required=False)


def _evaluate(
    root: Path, plan: ProofPlan | None, role: str | None, resume: int | None = None
) -> list[Gate]:
    from .._records.manifest import FORMAT_VERSION

    records = read_records(root, role)
    all_segments, judged = _chosen_segments(records, resume)
    segments = _newest_run(all_segments)
    found, where = _plan(records, segments)
    if plan is None:
        plan = found
    else:
        where = "given to evaluate"
    by_rank = {s.rank: s for s in all_segments}

    def before(seg: _Segment) -> list[ProofRecord]:
        """The killed run's records this rank replays: its own, or under resharding its source
        rank's."""
        if seg.restore is None:
            return []
        src = seg.restore.get("source_rank", seg.rank)
        if src == seg.rank or src not in by_rank:
            return seg.before
        source = by_rank[src]
        in_new_run = source.restore is not None and any(x is source for x in segments)
        return source.before if in_new_run else records.get(src, [])

    events = {r["event"] for recs in records.values() for r in recs}
    total = f", total_steps={plan.total_steps}" if plan.total_steps is not None else ""
    rl_events = sorted(events & {"export", "logprobs"})
    # A job that records exports or old-logprobs under a plan without rl=True gets those gates
    # judged: the table says so rather than showing rl=False above gates it then evaluates.
    judged_rl = (
        (
            f"; the records hold {' and '.join(rl_events)} records, so their gates are judged as "
            f"under rl=True (declare ProofPlan(rl=True) for an RL job)"
        )
        if rl_events and not plan.rl
        else ""
    )
    gates = [
        Gate(
            "proof plan",
            Status.INFO,
            f"rl={plan.rl}, deterministic={plan.deterministic}, "
            f"replay_steps={plan.replay_steps}{total} ({where}){judged_rl}",
            required=False,
        )
    ]
    if judged is not None:
        gates.append(judged)
    resharded = _resharded(segments)
    if resharded is not None:
        gates.append(_gate_topology(segments, *resharded[1:]))
    for name, fn in (
        ("restored step confirmed before training", _gate_confirmed),
        ("all PIDs changed", _gate_pids),
        ("digests equal, item by item", _gate_digests),
        ("addresses unchanged", _gate_addresses),
    ):
        gates.append(_combine(name, [_judged(fn, s) for s in segments]))
    # Required once a restore compared replicas; a restore that could not (older ckptguard, a save
    # without layout-free digests) shows MISSING without holding back a verdict the other gates
    # earn.
    compared = any(s.restore is not None and s.restore.get("replicas") for s in segments)
    replicas = [_judged(_gate_replicas, s) for s in segments] + _first_step_replicas(segments)
    gates.insert(len(gates) - 1, _combine("replicas equal after load", replicas, required=compared))
    if (tier := _tier(segments)) is not None:
        gates.insert(next(i for i, g in enumerate(gates) if g.name == "all PIDs changed"), tier)
    if resharded is not None:
        gates.append(_gate_rng_distinct(segments))
    gates.append(
        _resumes_agree(
            _not_rl(
                "first export byte-identical",
                [_judged(_gate_export, s) for s in segments],
                plan,
                where,
                "export" in events,
            )
        )
    )
    gates.append(
        _resumes_agree(
            _not_rl(
                "first old-logprob aligned",
                [_judged(_gate_logprobs, s) for s in segments],
                plan,
                where,
                "logprobs" in events,
            )
        )
    )
    behind = _behind(segments)
    gates.append(
        _by_ranks_ahead("one non-zero update", segments, lambda s: _gate_update(s, plan), behind)
    )
    gates.append(
        _by_ranks_ahead("resumed run trained", segments, lambda s: _gate_trained(s, plan), behind)
    )
    if (
        resharded is not None
    ):  # ranks changed: exactly-once over the union of ranks, not rank by rank
        gates += _resharded_gates(segments, records, plan, *resharded)
    else:
        gates += _replay_gates([_replay(s, before(s), plan) for s in segments], plan)
    if (code := _code(segments)) is not None:
        gates.append(code)
    restores = [s.restore for s in segments if s.restore is not None]
    if (lora := lora_gate(restores)) is not None:
        gates.append(Gate("LoRA base and adapter", Status.INFO, lora, required=False))
    written = sorted({int(r["format_version"]) for r in restores if r.get("format_version")})
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


class Outcome(str, enum.Enum):
    """What a launcher script acts on: exact, a difference found, or not enough evidence to tell."""

    PROVEN = "proven"
    DIVERGED = "diverged"
    EVIDENCE_MISSING = "evidence missing"


EXIT_CODES = {Outcome.PROVEN: 0, Outcome.DIVERGED: 1, Outcome.EVIDENCE_MISSING: 3}
"""``ckptguard prove`` and ``rehearse``'s exit code of each outcome (2 is bad usage, as in every
command)."""


def outcome(gates: list[Gate]) -> Outcome:
    """DIVERGED when any gate found a difference (FAIL); PROVEN when every required gate passed;
    else EVIDENCE_MISSING: nothing differed, but a required gate had nothing to compare
    (MISSING)."""
    if any(g.status is Status.FAIL for g in gates):
        return Outcome.DIVERGED
    if all(g.status is Status.PASS for g in gates if g.required):
        return Outcome.PROVEN
    return Outcome.EVIDENCE_MISSING


def worst(outcomes: list[Outcome]) -> Outcome:
    """The outcome of several resumes together: any DIVERGED, else any EVIDENCE_MISSING, else
    PROVEN."""
    order = [Outcome.DIVERGED, Outcome.EVIDENCE_MISSING]
    return next((o for o in order if o in outcomes), Outcome.PROVEN)


def passed(gates: list[Gate]) -> bool:
    return outcome(gates) is Outcome.PROVEN


def missing(gates: list[Gate]) -> list[Gate]:
    """The required gates that had nothing to compare."""
    return [
        g
        for g in gates
        if g.required and g.status is not Status.PASS and g.status is not Status.FAIL
    ]


def verdict(gates: list[Gate]) -> str:
    """One line: ``resume PROVEN`` (with what was not compared, in parentheses); ``resume NOT
    proven: <first failing gate> (FAIL)``; or ``resume EVIDENCE MISSING (...)`` naming each gate
    that had nothing to compare and why."""
    result = outcome(gates)
    if result is Outcome.PROVEN:
        notes = list(dict.fromkeys(g.qualifies for g in gates if g.qualifies))
        return "resume PROVEN" + (f" ({'; '.join(notes)})" if notes else "")
    if result is Outcome.DIVERGED:
        fails = [g for g in gates if g.status is Status.FAIL]
        first = next((g for g in fails if g.required), fails[0])
        return f"resume NOT proven: {first.name} ({first.status.value})"
    shown = "; ".join(f"{g.name}: {g.evidence}" for g in missing(gates))
    return f"resume EVIDENCE MISSING (no gate found a difference; not compared: {shown})"


def to_json(gates: list[Gate]) -> dict[str, Any]:
    """The verdict, the outcome and its exit code, the FAILed and the MISSING gates, and every
    gate."""
    result = outcome(gates)
    return {
        "verdict": verdict(gates),
        "proven": result is Outcome.PROVEN,
        "outcome": result.value,
        "exit_code": EXIT_CODES[result],
        "failed": [g.to_json() for g in gates if g.status is Status.FAIL],
        "missing": [g.to_json() for g in missing(gates)],
        "gates": [g.to_json() for g in gates],
    }


# ---------------------------------------------------------------- run roots (RunCheckpoint)


def run_roles(root: str | os.PathLike[str]) -> list[str]:
    """The roles of a RunCheckpoint root: those with records under ``proof/<role>/`` and those of
    the tracker's run step; empty for a root of a single CheckpointManager."""
    root = Path(os.fspath(root))
    roles = set(record_roles(root))
    step_dir = tracker_run_step(root)
    if step_dir is not None:
        roles |= set(_runmanifest.read(step_dir).roles)
    return sorted(roles)


def _gate_run_step(root: Path, roles: list[str]) -> Gate:
    """Every role restored the same run step, and that step (as on disk now) holds every role."""
    name = "every role restored one run step"
    restored: dict[str, set[tuple[int, str]]] = {}
    for role in roles:
        segments = _newest_run(
            [_segment(r, recs) for r, recs in sorted(read_records(root, role).items())]
        )
        got = {
            (int(r["step"]), str(Path(str(r.get("path", ""))).parent))
            for s in segments
            if _restored(s) and (r := s.restore) is not None
        }
        if got:
            restored[role] = got
    if not restored:
        return Gate(
            name, Status.MISSING, f"no role of {roles} recorded a restore of a non-zero step"
        )
    steps = sorted({step for got in restored.values() for step, _ in got})
    if len(steps) > 1:
        shown = "; ".join(
            f"role {r!r}: step(s) {sorted(s for s, _ in got)}"
            for r, got in sorted(restored.items())
        )
        return Gate(
            name,
            Status.FAIL,
            f"the roles restored different steps ({shown}): a run resumes every role "
            "from one run step",
        )
    step = steps[0]
    recorded = Path(next(iter(restored.values())).pop()[1])
    step_dir = recorded if recorded.is_dir() else root / recorded.name  # the root was moved since
    try:
        run = _checks.checked_run_step(step_dir)
    except CheckpointError as exc:
        return Gate(name, Status.FAIL, f"run step {step}: {str(exc).split('. ')[0]}")
    declared = sorted(set(roles) | set(run.roles))
    unrecorded = [r for r in declared if r not in restored]
    if unrecorded:
        return Gate(
            name,
            Status.MISSING,
            f"run step {step} was restored by roles {sorted(restored)}; role(s) "
            f"{unrecorded} recorded no restore of it (record_proof off there, or records removed)",
        )
    return Gate(
        name,
        Status.PASS,
        f"roles {', '.join(declared)} restored run step {step} ({step_dir.name}), which "
        "holds every role",
    )


def _evaluate_run(
    root: Path, roles: list[str], plan: ProofPlan | None, resume: int | None
) -> list[Gate]:
    gates = [
        Gate(
            "run roles",
            Status.INFO,
            f"RunCheckpoint root: roles {', '.join(roles)}; each role's gates are "
            "its own records (proof/<role>/)",
            required=False,
        ),
        _gate_run_step(root, roles),
    ]
    for role in roles:
        for g in _evaluate(root, plan, role, resume):
            evidence = (
                g.evidence if g.evidence.startswith("role ") else f"role {role!r}: {g.evidence}"
            )
            gates.append(Gate(f"{role}: {g.name}", g.status, evidence, g.required))
    return gates
