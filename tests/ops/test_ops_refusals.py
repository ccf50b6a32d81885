"""The operator commands refuse what restore refuses (hostile review, issue 33 item 3):

- ``verify`` on a run step whose role part is another step's (its run manifest's recorded checksum
  rewritten to match): restore and ``list`` refuse it, so verify FAILs naming the role;
- ``resolve`` on a tracker step whose files restore would refuse: exit 1 naming the file, not 0;
- ``resolve`` on a root a killed transfer left (steps, no tracker) names the transfer, not only
  "something outside ckptguard".
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

import ckptguard as cg
from ckptguard.cli import main
from ckptguard.ops.verify import Severity, verify_step


def _cli(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def test_verify_fails_a_run_step_whose_role_part_is_another_step_s(tmp_path):
    root = tmp_path / "run"
    run = cg.RunCheckpoint(
        root, [cg.Role("actor"), cg.Role("driver")], config=cg.CheckpointConfig(retention=None)
    )
    for step in (1, 2):
        run.save(step, {"actor": {"model": torch.nn.Linear(2, 2)}, "driver": {"n": step}})
    two = root / "step_00000002"
    shutil.rmtree(two / "actor")
    shutil.copytree(root / "step_00000001" / "actor", two / "actor")
    manifest = json.loads((two / "manifest.json").read_text())
    from ckptguard._disk.filedigest import file_digest

    size, xxh3 = file_digest(str(two / "actor" / "manifest.json"))
    manifest["roles"]["actor"].update(manifest_bytes=size, manifest_xxh3=xxh3)
    (two / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(cg.CheckpointError, match="holds step 1"):
        run.restore({"actor": {"model": torch.nn.Linear(2, 2)}, "driver": {"n": 0}})
    code, out = _cli("verify", two)
    assert code == 1 and "role-step" in out and "role 'actor' holds step 1" in out, out
    assert [f.code for f in verify_step(two) if f.severity is Severity.ERROR] == ["role-step"]


def test_resolve_refuses_the_step_restore_refuses(tmp_path):
    root = tmp_path / "ck"
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=None))
    model = torch.nn.Linear(4, 4)
    mgr.save(1, {"model": model})
    assert _cli("resolve", root)[0] == 0
    shard = next((root / "step_00000001" / "state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])  # truncated: restore refuses before reading
    with pytest.raises(cg.CheckpointError):
        cg.CheckpointManager(tmp_path / "ck").restore({"model": torch.nn.Linear(4, 4)})
    code, out = _cli("resolve", root)
    assert code == 1 and "a restore would refuse step 1" in out and shard.name in out, out
    code, out = _cli("resolve", root, "--json")
    assert code == 1 and json.loads(out)["ok"] is False


def test_resolve_names_a_killed_transfer(tmp_path):
    src = tmp_path / "src"
    cg.CheckpointManager(src, config=cg.CheckpointConfig(retention=None)).save(
        1, {"model": torch.nn.Linear(2, 2)}
    )
    dest = tmp_path / "dest"
    dest.mkdir()
    shutil.copytree(
        src / "step_00000001", dest / "step_00000001"
    )  # what a transfer killed before its tracker leaves
    shutil.copytree(src / "contract", dest / "contract")
    code, out = _cli("resolve", dest)
    assert code == 1 and "ckptguard transfer" in out and "run the same transfer again" in out, out


def test_verify_deep_says_what_it_compared(tmp_path):
    """A rank file rewritten together with its manifest entry passes the checksums (they compare the
    files with the manifest); verify --deep says so instead of a bare OK, and --json lists it."""
    root = tmp_path / "ck"
    cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=None)).save(
        1, {"model": torch.nn.Linear(2, 2), "n": 1}
    )
    step = root / "step_00000001"
    extras = torch.load(step / "rank_00000.pt", weights_only=True)
    extras["items"]["n"] = 999
    torch.save(extras, step / "rank_00000.pt")
    manifest = json.loads((step / "manifest.json").read_text())
    from ckptguard._disk.filedigest import file_digest

    for f in manifest["files"]:
        if f["path"] == "rank_00000.pt":
            f["size"], f["xxh3"] = file_digest(str(step / "rank_00000.pt"))
    (step / "manifest.json").write_text(json.dumps(manifest))
    code, out = _cli("verify", step, "--deep")
    assert code == 0 and "--restore also compares the non-tensor items a restore compares" in out, (
        out
    )
    code, out = _cli("verify", step, "--deep", "--json")
    # a non-tensor item rewritten with its checksum: the tensors compare equal, the item only a
    # restore sees
    assert code == 0 and json.loads(out)["compared"] == ["files", "checksums", "tensor digests"]
