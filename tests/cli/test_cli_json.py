"""``--json``, one style for every command a script reads: one object on stdout, ``ok`` in it, and
on a failure ``error`` (what, where, what to do) and the exit code of the text mode; nothing else on
stdout.

Covers transfer (success and error, both JSON), hold, release, gc, adopt, demo (its usage errors: a
demo run itself takes a minute), mem watch and mem report.
"""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from ckptguard.cli import main
from ckptguard.memory import PhaseKind, PhaseRecorder, RecorderConfig
from cli_roots import build_roots


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return build_roots(tmp_path_factory.mktemp("json"))["one"]


def _json(*args: object, code: int = 0) -> dict:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, (args, result.output)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, f"{args}: stdout is not one JSON object: {result.stdout!r}"
    out = json.loads(lines[0])
    assert isinstance(out, dict) and isinstance(out.get("ok"), bool), out
    assert out["ok"] is (code == 0), out
    if code:
        assert isinstance(out.get("error"), str) and out["error"], out
    assert "Traceback" not in result.output
    return out


def test_bad_usage_under_json_is_one_json_object_for_every_command(tmp_path):
    """A path that does not exist or an unknown option, with ``--json``: the JSON object of a
    failure on stdout (exit 2, click's message in ``error``), never click's usage text alone."""
    commands = [
        name for name, cmd in main.commands.items() if any("--json" in p.opts for p in cmd.params)
    ]
    assert {"gc", "verify", "list", "transfer", "adopt"} <= set(commands)
    for name in commands:
        out = _json(name, "--json", "--no-such-option", code=2)
        # click's own words: the unknown option, or a required one missing, checked first
        assert "option" in out["error"].lower(), out
        assert f"ckptguard {name} --help" in out["error"], out
    out = _json("gc", tmp_path / "missing", "--json", code=2)
    assert "does not exist" in out["error"], out


def test_transfer_json_on_success_and_on_error(root, tmp_path):
    out = _json("transfer", root / "step_00000002", tmp_path / "dest", "--json")
    assert (
        out["step"] == 2 and out["tracker_set_to"] == 2 and out["files"] >= 3 and out["bytes"] > 0
    )
    assert out["resumed"] is False and out["record"].endswith(".json")
    again = _json("transfer", root / "step_00000002", tmp_path / "dest", "--json")
    assert again["resumed"] is True
    (tmp_path / "dest" / "step_00000002" / "rank_00000.pt").write_bytes(b"another run's file")
    clash = _json("transfer", root / "step_00000002", tmp_path / "dest", "--json", code=1)
    assert "already exists and is not a complete copy" in clash["error"]


def test_transfer_text_is_lines_for_a_person(root, tmp_path):
    result = CliRunner().invoke(
        main, ["transfer", str(root / "step_00000001"), str(tmp_path / "d")]
    )
    assert result.exit_code == 0 and result.stdout.startswith("step 1: "), result.output
    assert "tracker of the destination: step 1" in result.stdout and "{" not in result.stdout


def test_hold_and_release_json(root):
    held = _json("hold", root, 1, "--reason", "eval job 7", "--json")
    assert held["step"] == 1 and held["reason"] == "eval job 7" and held["hold"].endswith("1.json")
    assert _json("release", root, 1, "--json")["released"] is True
    gone = _json("release", root, 1, "--json", code=1)
    assert "has no hold" in gone["error"]
    newer = _json(
        "hold", root, 3, "--reason", "x", "--json", code=1
    )  # newer than the tracker: refused
    assert "not committed" in newer["error"]


def test_gc_json(root, tmp_path):
    leftover = root / ".tmp-00000009-deadbeef0000"
    leftover.mkdir()
    out = _json("gc", root, "--dry-run", "--json")
    assert (
        out["dry_run"] is True
        and isinstance(out["removed"], list)
        and isinstance(out["kept"], list)
    )
    assert any(k["path"].endswith("step_00000003") for k in out["kept"]), (
        out
    )  # the orphan is kept, with why
    leftover.rmdir()
    bare = tmp_path / "not-a-root"
    bare.mkdir()
    refused = _json("gc", bare, "--json", code=2)
    assert "is not a checkpoint root" in refused["error"]


def test_adopt_json(root, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    out = _json("adopt", copy, 3, "--json")
    assert (
        out["step"] == 3
        and out["tracker_was"] == 2
        and out["tracker"] == 3
        and "now points" in out["message"]
    )
    back = _json("adopt", copy, 3, "--json", code=1)
    assert "moving it back" in back["error"] or "is at step 3" in back["error"]


def test_demo_json_usage_errors(tmp_path):
    bad = _json("demo", "--save-every", "3", "--kill-at", "8", "--json", code=2)
    assert "multiple of --save-every" in bad["error"]
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    refused = _json("demo", "--workdir", foreign, "--json", code=2)
    assert (foreign / "notes.txt").exists() and refused["error"]


def test_mem_watch_and_report_json(tmp_path):
    samples = tmp_path / "w.jsonl"
    out = _json(
        "mem",
        "watch",
        "--interval",
        "0.05",
        "--out",
        samples,
        "--json",
        "--",
        sys.executable,
        "-c",
        "import sys; sys.exit(3)",
        code=3,
    )
    assert out["exit_status"] == 3 and out["returncode"] == 3 and out["samples"] == str(samples)
    assert out["command"][0] == sys.executable
    records = tmp_path / "rank0.jsonl"
    with PhaseRecorder(RecorderConfig(path=records)).phase(PhaseKind.SAVE, step=1):
        pass
    page = tmp_path / "r.html"
    rep = _json("mem", "report", records, "--html", page, "--json")
    assert rep["html"] == str(page) and rep["png"] is None and page.exists() and rep["records"] >= 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('not json\n{"kind": "sample", "mono_ns": 1}\n')  # a torn line before a record
    err = _json("mem", "report", bad, "--html", page, "--json", code=2)
    assert "bad.jsonl:1" in err["error"]


def test_the_reading_commands_share_the_style(root):
    assert _json("list", root, "--json")["tracker"] == 2
    assert _json("resolve", root, "--json")["step"] == 2
    proof = _json(
        "prove", root, "--json", code=3
    )  # no restore was recorded: evidence missing, never "diverged"
    assert (
        proof["proven"] is False and proof["error"] == proof["verdict"] and proof["exit_code"] == 3
    )
    assert proof["verdict"].startswith("resume EVIDENCE MISSING") and proof["failed"] == []
