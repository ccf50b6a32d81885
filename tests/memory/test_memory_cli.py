"""The `mem` click group: registration on a parent group, and its frozen command and option set."""

from __future__ import annotations

import click
from click.testing import CliRunner

from ckptguard.memory.cli import mem

FROZEN = {
    "watch": ["--interval", "--json", "--out"],
    "growth": ["--interval", "--json", "--min-rise", "--noise-s", "--noise-step", "--skip"],
    "plan": ["--from-records", "--json", "--ray-address"],
    "estimate": ["--as-dtype", "--json"],
    "report": ["--html", "--json", "--png", "--ray-log"],
    "killer": ["--json", "--ray-log"],
    "vllm-log": ["--json"],
    "recipe": [
        "--cpu",
        "--json",
        "--mode",
        "--modes-key",
        "--vllm-log",
    ],  # --cpu, --mode, --vllm-log: issue 28 item 4
}


def test_command_and_option_set_is_frozen():
    got = {
        name: sorted(
            opt
            for p in cmd.params
            if isinstance(p, click.Option)
            for opt in p.opts
            if opt.startswith("--")
        )
        for name, cmd in mem.commands.items()
    }
    assert got == FROZEN


def test_registers_under_a_parent_group_as_the_lead_will():
    @click.group()
    def main() -> None:
        pass

    main.add_command(mem)
    r = CliRunner().invoke(main, ["mem", "--help"])
    assert r.exit_code == 0
    for name in FROZEN:
        assert name in r.output
    r = CliRunner().invoke(main, ["mem", "growth", "--help"])
    assert r.exit_code == 0 and "rising" in r.output


def test_bad_records_file_is_exit_2_with_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('not json\n{"kind": "sample", "mono_ns": 1}\n')
    r = CliRunner().invoke(mem, ["growth", str(bad)])
    assert r.exit_code == 2 and "bad.jsonl:1" in r.output
