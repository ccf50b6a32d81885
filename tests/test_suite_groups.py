"""``make test``'s schedule keeps a module on one xdist worker (its module fixtures are computed once) and
the shared groups together (conftest.group_of): xdist's own loadgroup silently stopped grouping under
pytest 9.2 (pytest-xdist#1386), so the grouping is checked on a real two-worker run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import group_of

TESTS = Path(__file__).parent


def test_shared_groups_and_modules_name_their_group():
    assert group_of("tests/test_vllm_trl.py::test_x[a]") == group_of("tests/test_vllm_lora.py::test_y") == "vllm"
    assert group_of("tests/test_examples.py::test_z") == "ray"
    assert group_of("tests/test_manifest_typed.py::test_w[v1]") == "test_manifest_typed"


def test_a_module_runs_on_one_worker_of_two():
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider",
         "-k", "every_format or bad_header", str(TESTS / "test_manifest_typed.py")],
        capture_output=True, text=True, timeout=300, cwd=TESTS.parent,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "scheduling tests via ModuleGroups" in run.stdout, run.stdout[-3000:]
    workers = set(re.findall(r"\[(gw\d+)\] \[ *\d+%\] PASSED", run.stdout))
    assert len(re.findall(r"PASSED", run.stdout)) >= 6 and len(workers) == 1, run.stdout[-3000:]
