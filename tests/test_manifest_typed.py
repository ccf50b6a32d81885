"""The manifest builder returns a typed Manifest whose JSON is exactly what is on disk."""

from __future__ import annotations

import json
from pathlib import Path

import ckptguard as cg
from ckptguard._records import manifest as _manifest
from ckptguard.demo.toyjob import build_job, train_step

FIXTURE = Path(__file__).parent / "fixtures" / "v1" / "root" / "step_00000003"


def test_written_manifest_round_trips_through_the_typed_manifest(tmp_path):
    job = build_job()
    train_step(job)
    step_dir = cg.CheckpointManager(tmp_path).save(1, job.state())
    raw = json.loads((step_dir / "manifest.json").read_text())
    typed = _manifest.read(step_dir)
    assert isinstance(typed, _manifest.Manifest)
    assert typed.to_json() == raw  # nothing lost, nothing added between the builder and the disk
    assert typed.cost is not None and typed.cost["bytes"] > 0
    assert typed.layout_free and set(typed.layout_free) <= set(typed.items)


def test_an_older_manifest_without_the_optional_fields_reads_and_writes_back_the_same():
    raw = json.loads((FIXTURE / "manifest.json").read_text())
    typed = _manifest.read(FIXTURE)
    assert typed.layout_free is None
    assert typed.to_json() == raw
