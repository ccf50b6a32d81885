"""``verify --deep`` compares what restore compares: each tensor against the save's layout-free
digest.

A data file rewritten together with its size and xxh3 in the manifest passes the file checks; the
tensor pass reads every tensor back and refuses the changed one, naming its key, as restore does
(issue 33 item 3).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import ckptguard as cg
from damage_helper import cli, refresh_entry, step_dir, tiny_root

FIXTURES = Path(__file__).parents[1] / "fixtures"


def _data_file(step: Path) -> str:
    files = json.loads((step / "manifest.json").read_text())["files"]
    return next(
        f["path"] for f in files if f["path"].startswith("state/") and f["path"].endswith(".distcp")
    )


def test_a_data_file_rewritten_with_its_checksum_fails_the_tensor_pass_as_restore_does(
    tmp_path: Path,
) -> None:
    root = tiny_root(tmp_path / "ck", steps=(1, 2), mib=0.25)
    good = cli("verify", str(root), "--deep", "--json")
    assert good.exit_code == 0, good.output
    report = json.loads(good.output)
    assert "tensor digests" in report["compared"]
    assert all(t["checked"] >= 2 and t["not_checked"] is None for t in report["tensors"].values())

    step = step_dir(root, 2)
    rel = _data_file(step)
    raw = bytearray((step / rel).read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit of the 'big' tensor's bytes
    (step / rel).write_bytes(bytes(raw))
    refresh_entry(step, rel)  # size and xxh3 agree again: only the content is wrong
    files_only = cli("verify", str(step))
    assert files_only.exit_code == 0  # without --deep nothing reads the bytes

    deep = cli("verify", str(step), "--deep")
    assert deep.exit_code == 1, deep.output
    assert (
        "tensor-digest" in deep.output
        and "'big'" in deep.output
        and "the save recorded" in deep.output
    )
    with pytest.raises(cg.CheckpointError):  # restore refuses the same step
        cg.CheckpointManager(root).restore(
            {"w": torch.zeros(4), "big": torch.zeros((1 << 18) // 4)}, path=step
        )


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_every_format_version_fixture_is_compared_or_said_not_compared(
    tmp_path: Path, version: str
) -> None:
    root = tmp_path / version
    shutil.copytree(FIXTURES / version / "root", root)
    out = cli("verify", str(root), "--deep", "--json")
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    (check,) = report["tensors"].values()
    if version == "v1":  # written before the layout-free table: not compared, and never said to be
        assert check["checked"] == 0 and check["not_checked"].startswith(
            "the step records no layout-free"
        )
        assert "tensor digests" not in report["compared"]
        text = cli("verify", str(root), "--deep")
        assert "tensor digests NOT compared for 1 step(s)" in text.output, text.output
    else:
        assert (
            check["checked"] == 8
            and check["not_checked"] is None
            and "tensor digests" in report["compared"]
        )
