"""verify, preflight, retention and gc: one test per finding, and rotation across restarts."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptguard as cg
from ckptguard._disk import layout as _layout
from ckptguard._records import retention
from ckptguard._records.checks import verify_step
from ckptguard.cli import main
from ckptguard.demo.toyjob import build_job, train_step
from ckptguard.ops.gc import gc
from ckptguard.ops.preflight import preflight
from ckptguard.ops.verify import verify_root
from ckptguard.testing import run_ranks, values

NAMING = _layout.StepNaming("step_{step:08d}")


def _save_two_ranks(rank: int, world: int, root: str) -> None:
    job = build_job(rank=rank, world=world)
    mgr = cg.CheckpointManager(root)
    train_step(job)
    mgr.save(1, job.state())


@pytest.fixture(scope="module")
def two_rank_ckpt(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("two") / "ck"
    values(run_ranks(_save_two_ranks, 2, str(root)))
    return root


@pytest.fixture
def ckpt(tmp_path, two_rank_ckpt) -> Path:
    root = tmp_path / "ck"
    shutil.copytree(two_rank_ckpt, root)
    return root


def codes(findings) -> list[str]:
    return [f.code for f in findings if f.severity.value == "ERROR"]


def test_clean_checkpoint_passes_quick_deep_and_restore(ckpt):
    assert verify_step(ckpt / "step_00000001", deep=True) == []
    result = CliRunner().invoke(main, ["verify", str(ckpt), "--deep", "--restore"])
    assert result.exit_code == 0, result.output
    assert (
        "OK: 1 step(s) checked with checksums and tensor digests and a real restore, 0 finding(s)"
        in result.output
    )


def test_missing_rank_file(ckpt):
    (ckpt / "step_00000001" / "rank_00001.pt").unlink()
    found = verify_step(ckpt / "step_00000001")
    assert codes(found) == ["missing-file"] and "rank 1" in found[0].message
    result = CliRunner().invoke(main, ["verify", str(ckpt / "step_00000001"), "--json"])
    assert result.exit_code == 1
    assert json.loads(result.output)["findings"][0]["code"] == "missing-file"


def test_truncated_file(ckpt):
    shard = ckpt / "step_00000001" / "state" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    assert codes(verify_step(ckpt / "step_00000001")) == ["size-mismatch"]


def test_flipped_byte_is_found_only_by_deep(ckpt):
    shard = ckpt / "step_00000001" / "state" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert verify_step(ckpt / "step_00000001") == []
    assert codes(verify_step(ckpt / "step_00000001", deep=True)) == ["checksum"]


def test_restore_check_catches_what_checksums_cannot(ckpt):
    """A rank file rewritten with its manifest updated: sizes and checksums agree, values do not."""
    step = ckpt / "step_00000001"
    extras_path = step / "rank_00000.pt"
    extras = torch.load(extras_path, weights_only=True)
    extras["items"]["loader"]["cursor"] = 999
    torch.save(extras, extras_path)
    manifest = json.loads((step / "manifest.json").read_text())
    from ckptguard._disk.digest import file_digest

    for f in manifest["files"]:
        if f["path"] == "rank_00000.pt":
            f["size"], f["xxh3"] = file_digest(str(extras_path))
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert verify_step(step, deep=True) == []
    result = CliRunner().invoke(main, ["verify", str(step), "--restore"])
    assert (
        result.exit_code == 1
        and "digest-mismatch" in result.output
        and "rank 0 item loader" in result.output
    )


def test_restore_check_catches_a_tensor_byte_through_the_layout_free_digests(ckpt):
    """Format 3 records no xxh3 of tensor bytes per rank: a flipped byte in a data file whose
    manifest entry was updated is caught by the layout-free digests the offline restore
    recomputes."""
    step = ckpt / "step_00000001"
    state_dir = step / "state"
    infos = [
        i
        for k, i in cg.read_dcp_metadata(state_dir).storage_data.items()
        if k.fqn.startswith("model.")
    ]
    info = max(infos, key=lambda i: i.length)
    shard = state_dir / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    manifest = json.loads((step / "manifest.json").read_text())
    from ckptguard._disk.digest import file_digest

    for f in manifest["files"]:
        if f["path"] == f"state/{info.relative_path}":
            f["size"], f["xxh3"] = file_digest(str(shard))
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert verify_step(step, deep=True) == []
    result = CliRunner().invoke(main, ["verify", str(step), "--restore"])
    assert result.exit_code == 1 and "digest-mismatch" in result.output, result.output
    assert "item model: restored layout-free digests differ" in result.output, result.output


def test_leftover_temp_file(ckpt):
    (ckpt / "step_00000001" / "state" / "__0_0.distcp.part-1234").write_bytes(b"x")
    assert codes(verify_step(ckpt / "step_00000001")) == ["unexpected-file"]


def test_missing_and_malformed_manifest(ckpt):
    step = ckpt / "step_00000001"
    (step / "manifest.json").write_text("{not json")
    assert codes(verify_step(step)) == ["bad-manifest"]
    (step / "manifest.json").unlink()
    assert codes(verify_step(step)) == ["no-manifest"]
    _checked, found = verify_root(ckpt, NAMING)
    assert "no-manifest" in codes(found)


def test_path_traversal_and_symlinks_are_never_followed(ckpt, tmp_path):
    step = ckpt / "step_00000001"
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"precious")
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"].append({"path": "../../outside.bin", "size": 8, "xxh3": "0", "rank": 0})
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert "unsafe-path" in codes(verify_step(step, deep=True))
    manifest["files"][-1]["path"] = str(outside)
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert "unsafe-path" in codes(verify_step(step))
    # A symlinked step directory pointing outside is reported and never deleted through.
    manifest["files"].pop()
    (step / "manifest.json").write_text(json.dumps(manifest))
    real = tmp_path / "real_step"
    shutil.copytree(step, real)
    os.symlink(real, ckpt / "step_00000000")
    _checked, found = verify_root(ckpt, NAMING)
    assert "symlink" in codes(found)
    report = retention.apply(ckpt, NAMING, retention.KeepLast(1))
    assert (
        "step_00000000" in report.not_counted
        and real.exists()
        and (real / "manifest.json").exists()
    )
    assert outside.read_bytes() == b"precious"


def test_preflight_checks_the_real_files_not_the_recorded_hosts(ckpt, tmp_path):
    step = ckpt / "step_00000001"
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["topology"]["rank_hosts"] = ["nodeA", "nodeB"]
    (step / "manifest.json").write_text(json.dumps(manifest))
    # One shared root: every file is where preflight looks, wherever the ranks ran and will run
    # (the recorded hosts once made this a guessed "missing-on-host").
    for placement in ({0: "nodeA", 1: "nodeB"}, {0: "nodeA", 1: "nodeC"}):
        report = preflight(ckpt, NAMING, rank_hosts=placement, expect_step=1)
        assert report.step == 1 and report.ok and not report.findings, [
            f.line() for f in report.findings
        ]
    hosts = tmp_path / "map.txt"
    hosts.write_text("0 nodeA\n1 nodeC\n")
    result = CliRunner().invoke(main, ["preflight", str(ckpt), "--rank-hosts", str(hosts)])
    assert result.exit_code == 0 and "READY" in result.output, result.output
    (step / "rank_00001.pt").unlink()
    result = CliRunner().invoke(main, ["preflight", str(ckpt), "--rank-hosts", str(hosts)])
    assert (
        result.exit_code == 1 and "rank_00001.pt" in result.output and "NOT READY" in result.output
    )
    wrong = CliRunner().invoke(main, ["preflight", str(ckpt), "--expect-step", "7"])
    assert wrong.exit_code == 1 and "unexpected-step" in wrong.output
    (ckpt / _layout.TRACKER_NAME).unlink()
    assert codes(preflight(ckpt, NAMING).findings) == ["no-tracker"]
    # A root that does not exist (a replacement node's empty disk) is NOT READY, not a usage error.
    missing = CliRunner().invoke(main, ["preflight", str(tmp_path / "nope")])
    assert (
        missing.exit_code == 1 and "no-root" in missing.output and "NOT READY" in missing.output
    ), missing.output


def test_verify_usage_error(tmp_path):
    assert CliRunner().invoke(main, ["verify", str(tmp_path / "nope")]).exit_code == 2


# ---------------------------------------------------------------- retention


def _mgr(root: Path, policy) -> cg.CheckpointManager:
    return cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=policy))


def _state(step: int) -> dict:
    return {"w": torch.full((4,), float(step))}


def test_retention_across_restart_with_hold_orphan_and_corrupt(tmp_path):
    root = tmp_path / "ck"
    policy = retention.KeepLast(2) | retention.KeepEvery(5)
    mgr = _mgr(root, policy)
    for step in range(1, 8):
        mgr.save(step, _state(step))
    assert mgr.committed_steps() == [5, 6, 7]
    mgr.hold(6, "eval job 42")
    # A simulated restart: a new manager knows nothing but what is on disk.
    mgr = _mgr(root, policy)
    (root / "step_00000003").mkdir()  # corrupt: no manifest, inside the tracker's range
    for step in range(8, 12):
        mgr.save(step, _state(step))
    assert mgr.committed_steps() == [5, 6, 10, 11]
    assert (root / "step_00000003").exists()  # reported, not deleted, not counted
    # An orphan newer than the tracker is ignored by rotation and by resume.
    shutil.copytree(root / "step_00000011", root / "step_00000099")
    mgr.save(12, _state(12))
    assert mgr.committed_steps() == [5, 6, 10, 11, 12] or mgr.committed_steps() == [5, 6, 11, 12]
    assert (root / "step_00000099").exists()
    assert mgr.release(6)
    mgr.save(13, _state(13))
    assert mgr.committed_steps() == [5, 10, 12, 13]
    # gc never removes a complete checkpoint (the orphan 99) or a directory it did not create (3: no
    # manifest, no owner record); --orphans removes the orphan. (The dropped steps' trash is deleted
    # off the commit's path: waited for here, so gc finds none of it left.)
    assert retention.DELETER.wait(30)
    report = gc(root, NAMING)
    assert report.removed == [] and {p.name for p, _ in report.kept} == {
        "step_00000003",
        "step_00000099",
    }
    report = gc(root, NAMING, orphans=True)
    assert [p.name for p, _ in report.removed] == ["step_00000099"] and (
        root / "step_00000003"
    ).exists()


def test_retention_keeps_the_restored_step_and_default_policy(tmp_path):
    root = tmp_path / "ck"
    mgr = _mgr(root, retention.KeepLast(1))
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    assert mgr.committed_steps() == [2]
    again = _mgr(root, retention.KeepLast(1))
    target = _state(0)
    assert again.restore(target, path=root / "step_00000002") == 2
    again.save(3, _state(3))
    assert again.committed_steps() == [2, 3]  # the restored step is protected in this process
    assert cg.CheckpointConfig().retention.keep(list(range(1, 45))) == {20, 40, 42, 43, 44}


def test_failed_delete_is_reported_and_retried(tmp_path, monkeypatch, caplog):
    root = tmp_path / "ck"
    mgr = _mgr(root, retention.KeepLast(1))
    mgr.save(1, _state(1))
    real = shutil.rmtree
    calls = []

    def flaky(path, *a, **kw):
        calls.append(path)
        if len(calls) == 1:
            raise OSError(16, "Device or resource busy", str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(_layout.shutil, "rmtree", flaky)
    caplog.set_level(logging.WARNING, logger="ckptguard")
    mgr.save(2, _state(2))  # training goes on
    assert retention.DELETER.wait(30)  # the delete runs off the commit's path
    assert "could not delete step 1" in caplog.text
    assert not (root / "step_00000001" / "manifest.json").exists()  # uncommitted first
    assert mgr.committed_steps() == [2]
    assert [p.name.split("-")[1] for p in root.glob(".trash-*")] == ["step_00000001"]
    mgr.save(3, _state(3))  # the next rotation retries the delete
    assert retention.DELETER.wait(30)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith((".trash", "step_"))) == [
        "step_00000003"
    ]
