"""The operator commands start without torch: each runs in a new interpreter, on real roots, and
``torch`` (and numpy) must not be in ``sys.modules`` when it exits.

``import torch`` alone costs 1-2 s of CPU on 2 cores and 20-60 s of wall time on the loaded node
an operator uses during an incident; benchmarks/bench_cli_start.py measures the start-up itself.
What keeps them torch-free is the module split docs/architecture.md describes (start-up rule).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ckptguard.cli import _Group, main
from cli_roots import build_roots

# Runs the CLI as ``python -m ckptguard.cli`` does, then says which heavy modules it imported.
_PROBE = """
import json, runpy, sys
sys.argv = ["ckptguard", *sys.argv[1:]]
code = 0
try:
    runpy.run_module("ckptguard.cli", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
heavy = sorted(m for m in ("torch", "numpy") if m in sys.modules)
sys.stderr.write("\\nPROBE " + json.dumps({"code": code, "heavy": heavy}) + "\\n")
"""


def _run(*args: str) -> tuple[dict, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("CKPTGUARD_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=120, env=env
    )
    line = [x for x in proc.stderr.splitlines() if x.startswith("PROBE ")]
    assert line, f"the CLI did not finish: {proc.stderr[-2000:]}"
    return json.loads(line[-1][6:]), proc.stdout


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    return build_roots(tmp_path_factory.mktemp("start"))


COMMANDS = {
    "help": (["--help"], 0),
    "list": (["list", "{one}"], 0),
    "list-run": (["list", "{run}"], 0),
    "resolve": (["resolve", "{one}"], 0),
    "resolve-run": (["resolve", "{run}", "--json"], 0),
    "status": (["status", "{phases}", "--sample", "0.05"], 0),
    "preflight": (["preflight", "{one}"], 0),
    "preflight-run": (["preflight", "{run}", "--json"], 0),
    "hold": (["hold", "{one}", "1", "--reason", "eval"], 0),
    "release": (["release", "{one}", "1"], 0),
    "gc-dry": (["gc", "{one}", "--dry-run"], 0),
    "gc": (["gc", "{run}"], 0),
    "adopt": (["adopt", "{one}", "3"], 0),
    "goodput": (["goodput", "{one}"], 0),
    "goodput-json": (["goodput", "{run}", "--json"], 1),  # no proof records there: the error path
}


# What a command needs done first, in this process: each test stands alone (under xdist a module
# fixture may be set up again between two tests of the module, so ``release`` cannot count on
# ``hold``'s test).
BEFORE = {"release": ["hold", "{one}", "1", "--reason", "eval"]}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_an_operator_command_runs_without_importing_torch(roots, name):
    args, expected = COMMANDS[name]
    if name in BEFORE:
        done = CliRunner().invoke(main, [a.format(**roots) for a in BEFORE[name]])
        assert done.exit_code == 0, done.output
    probe, out = _run(*(a.format(**roots) for a in args))
    assert probe["code"] == expected, (name, out)
    assert probe["heavy"] == [], f"`ckptguard {' '.join(args)}` imported {probe['heavy']}"


def test_the_probe_sees_torch_when_a_command_imports_it(roots):
    """Negative control: ``transfer`` copies through the commit protocol, which imports torch."""
    dest = roots["one"].parent / "dest"
    probe, _ = _run("transfer", str(roots["one"] / "step_00000002"), str(dest))
    assert probe["code"] == 0 and "torch" in probe["heavy"]


def test_the_lazy_group_help_line_is_the_group_s_own():
    from ckptguard.memory.cli import mem

    for name, (_module, _attr, line) in _Group.lazy.items():
        assert line == (mem.help or "").splitlines()[0], name
    help_text = CliRunner().invoke(main, ["--help"]).output
    assert "mem " in help_text
