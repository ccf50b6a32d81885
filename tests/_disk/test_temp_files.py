"""Temp files of atomic writes (``NAME.tmp-...`` next to the tracker, ``lease.json``,
``trust.json``, a hold) are swept at the next save once their owner is dead, never while it lives;
``verify`` reports them and a clean run leaves none.

The owner is recorded in the name (``_disk/tempfiles.py``); a name of the older form, without an
owner, counts as dead once older than ``stale_temp_age_s``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptguard as cg
from ckptguard import ProofPlan
from ckptguard._disk import layout as _layout

NAMES = ["latest_checkpointed_iteration.txt", "lease.json", "trust.json", "holds/5.json"]


def _cfg(**kw) -> cg.CheckpointConfig:
    return cg.CheckpointConfig(proof=ProofPlan(record=False), **kw)


def _cli(*argv: str):
    from click.testing import CliRunner

    from ckptguard.cli import main

    return CliRunner().invoke(main, list(argv))


def _temp_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.tmp-*"))


def _dead_writer(root: Path) -> list[str]:
    """A process that starts an atomic write of each name and dies before the rename (its temp
    names)."""
    code = (
        "import sys; from pathlib import Path; from ckptguard._disk import tempfiles as t\nfor "
        "n in sys.argv[2:]:\n    p = t.temp_name(Path(sys.argv[1]) / n); "
        "p.write_bytes(b'torn'); print(p)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(root), *NAMES], check=True, capture_output=True, text=True
    )
    return [Path(line).relative_to(root).as_posix() for line in out.stdout.split()]


def test_temp_files_of_dead_writers_are_reported_and_swept_and_a_live_writers_kept(tmp_path):
    root = tmp_path / "ckpt"
    mgr = cg.CheckpointManager(
        root, config=_cfg(storage=cg.StorageOptions(stale_temp_age_s=3600.0))
    )
    mgr.save(1, {"w": torch.zeros(3)})
    (root / "holds").mkdir(exist_ok=True)
    dead = _dead_writer(root)
    # Older names without an owner, from before the owner was recorded: dead once past
    # stale_temp_age_s.
    old = [f"{n}.tmp-0badf00d" for n in NAMES if "/" not in n]
    for rel in old:
        (root / rel).write_bytes(b"torn")
        os.utime(root / rel, (time.time() - 3 * 86400, time.time() - 3 * 86400))
    from ckptguard._disk import tempfiles

    live = tempfiles.temp_name(root / "trust.json")  # this process: a write in flight
    live.write_bytes(b"in flight")
    report = _cli("verify", str(root))
    for rel in [*dead, *old]:
        if not rel.startswith("holds/"):  # verify looks at the root's own entries
            assert Path(rel).name in report.output, (
                rel,
                "verify does not report it",
                report.output,
            )
    gc = _cli("gc", str(root), "--dry-run")
    assert f"would remove {live}" not in gc.output and f"kept    {live}" in gc.output, gc.output
    assert all(
        f"would remove {root / rel}" in gc.output for rel in [*dead, *old] if "/" not in rel
    ), gc.output
    mgr.save(2, {"w": torch.ones(3)})
    left = _temp_files(root)
    assert left == [live.relative_to(root).as_posix()], (
        "the save swept a live write or left dead ones",
        left,
    )
    live.unlink()
    assert "temp-file" not in _cli("verify", str(root)).output


def test_a_failed_atomic_write_leaves_no_temp_file(tmp_path):
    def fail() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        _layout.atomic_write_bytes(tmp_path / "trust.json", b"{}", before_rename=fail)
    assert list(tmp_path.iterdir()) == []


def test_a_clean_run_leaves_no_temp_file(tmp_path):
    root = tmp_path / "ckpt"
    mgr = cg.CheckpointManager(root, config=_cfg(retention=cg.KeepLast(1)))
    state = {"w": torch.zeros(3), "n": 0}
    for step in range(1, 4):
        state["n"] = step
        mgr.save(step, state)
    mgr.save_async(4, state)
    mgr.wait()
    mgr.close()
    assert _temp_files(root) == []
    assert "temp-file" not in _cli("verify", str(root)).output
