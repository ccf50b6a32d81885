"""``make test``'s schedule (conftest.unit_of): the Ray modules run on one xdist worker, every other test is
handed out alone. xdist's own loadgroup silently stopped grouping under pytest 9.2 (pytest-xdist#1386), so the
grouping is checked on a real two-worker run, with a light module put in a group that runs together."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import group_of, unit_of

TESTS = Path(__file__).parent


def test_a_ray_test_is_handed_out_with_its_group_and_others_alone():
    ray = unit_of("tests/integrations/test_ray_actors.py::test_y")
    assert unit_of("tests/test_examples.py::test_z") == ray == "ray"
    assert group_of("tests/integrations/test_vllm_trl.py::test_x[a]") == "vllm"
    assert unit_of("tests/integrations/test_vllm_trl.py::test_x[a]") == "tests/integrations/test_vllm_trl.py::test_x[a]"
    typed = "tests/_records/test_manifest_typed.py::test_w[v1]"
    assert unit_of(typed) == typed


def _workers(together: str) -> set[str]:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider",
         "-k", "every_format or bad_header", str(TESTS / "_records" / "test_manifest_typed.py")],
        capture_output=True, text=True, timeout=300, cwd=TESTS.parent,
        env={**os.environ, "CKPTGUARD_TEST_TOGETHER": together},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "scheduling tests via Units" in run.stdout, run.stdout[-3000:]
    assert len(re.findall(r"PASSED", run.stdout)) >= 6, run.stdout[-3000:]
    return set(re.findall(r"\[(gw\d+)\] \[ *\d+%\] PASSED", run.stdout))


def test_a_group_that_runs_together_stays_on_one_worker_of_two():
    assert len(_workers("test_manifest_typed")) == 1
    assert len(_workers("")) == 2  # handed out one by one, both workers take some
