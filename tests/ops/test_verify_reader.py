"""``verify`` of a root that a training job rotates meanwhile: the step being checked is held with a
reader lease (its files are never deleted under ``verify --deep``, which read them as missing and
called the root damaged), and a step the rotation removed after verify listed it is said as that,
never an ERROR."""

from __future__ import annotations

from pathlib import Path

import torch

import ckptguard as cg
from ckptguard._disk import layout as _layout
from ckptguard._records import retention
from ckptguard.ops.verify import verify_root

NAMING = _layout.StepNaming("step_{step:08d}")


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=None))
    for step in (1, 2, 3):
        mgr.save(step, {"w": {"t": torch.full((1 << 16,), float(step))}})
    mgr.close()
    return root


def test_a_rotation_during_a_deep_verify_keeps_the_step_being_read(tmp_path):
    root = _root(tmp_path)
    rotated: list[list[int]] = []

    def progress(_hashed: int) -> None:
        if (
            not rotated
        ):  # while the first step's bytes are hashed, the job keeps its newest step only
            rotated.append(sorted(retention.apply(root, NAMING, cg.KeepLast(1)).deleted))

    checked, findings = verify_root(root, NAMING, deep=True, progress=progress)
    errors = [f.line() for f in findings if f.severity.value == "ERROR"]
    assert errors == [], errors
    assert rotated == [
        [2]
    ]  # step 1 held by verify's reader lease, step 2 rotated away before its turn
    assert [p.name for p in checked] == ["step_00000001", "step_00000003"]
    (removed,) = [f for f in findings if f.code == "removed-while-verified"]
    assert removed.path.endswith("step_00000002") and removed.severity.value == "WARNING"
    assert not list((root / "readers").glob("*.json"))
