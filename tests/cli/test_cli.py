"""The command line: exit codes, output, and a frozen option set."""

from __future__ import annotations

import json

import click
from click.testing import CliRunner

import ckptguard as cg
from ckptguard.cli import main
from ckptguard.demo.toyjob import build_job, train_step

# Changing a command's options is a user-visible change: update this and the CHANGELOG.
FROZEN = {
    "adopt": ["root", "step", "template", "as_json"],
    "demo": [
        "workdir",
        "world_size",
        "steps",
        "save_every",
        "kill_at",
        "no_derived_fix",
        "as_json",
    ],
    "export": [
        "root",
        "step",
        "out",
        "dtype",
        "item",
        "merged",
        "max_host_bytes",
        "template",
        "as_json",
    ],
    "gc": [
        "root",
        "dry_run",
        "orphans",
        "force",
        "min_age_s",
        "template",
        "as_json",
    ],  # --min-age: s3:// roots
    "goodput": ["root", "mtbf_s", "as_json"],
    "hold": ["root", "step", "reason", "ttl_s", "template", "as_json"],
    "list": ["root", "template", "as_json"],
    "mem": [],
    "preflight": ["root", "hosts", "rank_hosts", "expect_step", "template", "as_json"],
    "prove": ["root", "as_json", "resume", "every"],
    "rehearse": ["root", "timeout_s", "as_json", "cmd"],
    "release": ["root", "step", "as_json"],
    "repro-save": ["target", "control", "rounds", "size_gib", "ranks", "report", "as_json"],
    "resolve": ["root", "mode", "path", "prefer", "template", "as_json"],
    "status": ["path", "sample_s", "as_json"],
    "transfer": [
        "step_dir",
        "dest_root",
        "record",
        "step",
        "template",
        "as_json",
    ],  # --step, --template: s3:// sources
    "verify": ["path", "deep", "do_restore", "template", "as_json"],
}


def _commands() -> dict:
    ctx = click.Context(main)  # mem included: it is imported when used (cli._Group.lazy)
    return {name: main.get_command(ctx, name) for name in main.list_commands(ctx)}


def test_cli_option_set_is_frozen():
    seen = {
        name: [p.name for p in cmd.params if p.name != "help"] for name, cmd in _commands().items()
    }
    assert seen == FROZEN


def test_resolve_command(tmp_path):
    runner = CliRunner()
    fresh = runner.invoke(main, ["resolve", str(tmp_path / "none"), "--json"])
    assert fresh.exit_code == 0 and json.loads(fresh.output)["fresh"] is True
    job = build_job()
    train_step(job)
    cg.CheckpointManager(tmp_path / "ck").save(5, job.state())
    out = runner.invoke(main, ["resolve", str(tmp_path / "ck")])
    assert out.exit_code == 0 and "resume from step 5" in out.output
    (tmp_path / "ck/step_00000005/manifest.json").unlink()
    bad = runner.invoke(main, ["resolve", str(tmp_path / "ck")])
    assert bad.exit_code == 1 and "points at step 5" in bad.output
    listing = runner.invoke(main, ["list", str(tmp_path / "ck")])
    assert "NOT committed" in listing.output and "tracker: 5" in listing.output
    usage = runner.invoke(main, ["resolve", str(tmp_path), "--mode", "sometimes"])
    assert usage.exit_code == 2


def test_demo_usage_error():
    result = CliRunner().invoke(main, ["demo", "--save-every", "3", "--kill-at", "8"])
    assert result.exit_code == 2 and "multiple of --save-every" in result.output
