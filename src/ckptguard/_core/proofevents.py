"""The proof records a ``CheckpointManager`` writes besides a commit's and a loaded restore's.

What the training loop reports (``record_step``, ``record_update``, ``record_export``,
``record_logprobs``: ``ckptguard prove`` compares a resumed run's with the killed run's), a step the
health round skipped, and a restore that loaded nothing (a fresh start) or failed. A save's record
and a loaded restore's are written by the manager on its walk (docs/architecture.md); none of these
is. Each goes to the root's ``ProofSink`` (``_core.root``), written as every record is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from .._records.exportdigest import ExportFingerprint, export_fingerprint, logprob_diff
from .._records.trust import HealthVerdict
from .._resume.resolve_local import Resolution
from .._state.trajectory import fingerprint, step_metrics
from .._types import JsonObject
from .root import ProofSink, Root, check_step

log = logging.getLogger("ckptguard")


def record_step(
    root: Root,
    step: int,
    sample_ids: Any,
    batch: Any,
    loss: Any,
    grad_norm: Any,
    extra: Mapping[str, Any],
) -> JsonObject:
    """``CheckpointManager.record_step``: the step's fields, noted as health evidence and
    recorded."""
    check_step(step, "record_step")
    fields = fingerprint(sample_ids, batch, loss, grad_norm, extra)
    # Judged now, shipped with the next save: the evidence of healthy and unhealthy steps.
    root.health.note(root.config.health, step, step_metrics(fields))
    root.proof.record("step", durable=False, step=step, **fields)
    return fields


def record_update(proof: ProofSink, step: int, grad_norm: float, params_changed: bool) -> None:
    """``CheckpointManager.record_update``: an optimizer update's gradient norm, whether it moved
    anything."""
    proof.record(
        "update", step=step, grad_norm=float(grad_norm), params_changed=bool(params_changed)
    )


def record_export(
    proof: ProofSink, step: int, payload: Any, scales: Any, **details: Any
) -> ExportFingerprint:
    """``CheckpointManager.record_export``: the digests of what the rollout receives, recorded."""
    fp = export_fingerprint(payload, scales)
    proof.record("export", step=step, fingerprint=fp, **details)
    return fp


def record_logprobs(
    proof: ProofSink, step: int, trainer: Any, rollout: Any, **details: Any
) -> dict[str, float]:
    """``CheckpointManager.record_logprobs``: the trainer's old-logprob against the rollout's,
    recorded."""
    diff = logprob_diff(trainer, rollout)
    proof.record("logprobs", step=step, **details, **dict[str, Any](diff))
    return diff


def skipped(root: Root, step: int, verdict: HealthVerdict, world_size: int) -> None:
    """A save the health round skipped (``verdict.skip``): logged as an error and recorded."""
    log.error(
        "ckptguard: step %d NOT committed: unhealthy on %d of %d rank(s): %s. Nothing was written; "
        "the tracker stays at %s under %s",
        step,
        len(verdict.reasons),
        world_size,
        verdict.describe(),
        root.safe_tracker(),
        root.path,
    )
    root.proof.record("skip", step=step, reasons=verdict.reasons)


def fresh_start(
    proof: ProofSink, res: Resolution, world_size: int, began: float, timing: JsonObject
) -> None:
    """A restore that resolved no step (``began``: when it began): logged loudly and recorded."""
    log.warning("ckptguard: %s", res.describe())
    seconds = round(time.monotonic() - began, 4)
    proof.record(
        "restore",
        step=0,
        fresh=True,
        reason=res.reason,
        world_size=world_size,
        seconds=seconds,
        **timing,
    )


def failed_restore(
    proof: ProofSink,
    res: Resolution,
    seen: Mapping[str, JsonObject],
    exc: BaseException,
    where: JsonObject,
) -> None:
    """A restore that raised ``exc`` after the verified items in ``seen``: recorded (prove shows it
    as FAIL)."""
    proof.record(
        "restore",
        step=res.step,
        path=str(res.path),
        digests_match=seen["digests"],
        layout_free_match=seen["layout_free"],
        replicas=seen["replicas"],
        ok=False,
        error=f"{type(exc).__name__}: {exc}"[:2000],
        **where,
    )
