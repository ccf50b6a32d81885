"""Every on-disk format version ever written stays readable (fixtures under tests/fixtures)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import ckptguard as cg
from ckptguard._records.manifest import FORMAT_VERSION, READABLE_VERSIONS

FIXTURES = Path(__file__).parents[1] / "fixtures"


def test_every_readable_version_has_a_fixture():
    assert FORMAT_VERSION in READABLE_VERSIONS
    for version in READABLE_VERSIONS:
        assert (FIXTURES / f"v{version}" / "root").is_dir(), f"keep a fixture of format v{version}"


@pytest.mark.parametrize("version", READABLE_VERSIONS)
def test_fixture_restores_exactly(tmp_path, version):
    import make_v1  # the fixture's own object definitions

    src = FIXTURES / f"v{version}"
    shutil.copytree(src / "root", tmp_path / "root")
    expected = json.loads((src / "expected.json").read_text())
    model, optim, sched = make_v1.tiny()
    state = {"model": model, "optim": optim, "sched": sched, "tokens_seen": 0}
    assert cg.CheckpointManager(tmp_path / "root").restore(state) == expected["step"]
    assert model.weight.tolist() == expected["weight"]
    assert model.bias.tolist() == expected["bias"]
    assert optim.state[model.weight]["exp_avg_sq"].tolist() == expected["exp_avg_sq_weight"]
    assert sched.get_last_lr() == expected["lr"]
    assert state["tokens_seen"] == expected["tokens_seen"]


def test_unknown_future_format_is_refused(tmp_path):
    shutil.copytree(FIXTURES / "v1" / "root", tmp_path / "root")
    manifest = tmp_path / "root/step_00000003/manifest.json"
    data = json.loads(manifest.read_text())
    data["format_version"] = FORMAT_VERSION + 1
    manifest.write_text(json.dumps(data))
    with pytest.raises(cg.ResumeError, match="Upgrade ckptguard"):
        cg.CheckpointManager(tmp_path / "root").resolve()
