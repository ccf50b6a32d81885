"""``make test``'s schedule (conftest.unit_of): the Ray modules run on one xdist worker, the tests
taking an expensive module fixture of SHARED_FIXTURES go together (the fixture is built once in the
suite, not on each worker), every other test is handed out alone. xdist's own loadgroup silently
stopped grouping under pytest 9.2 (pytest-xdist#1386), so the grouping is checked on a real
two-worker run, with a light module put in a group that runs together. Also the test jobs' exit
(tests/jobexit.py), which the suite's time depends on too."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SHARED_FIXTURES, group_of, unit_of, units_in

TESTS = Path(__file__).parent


def test_a_ray_test_is_handed_out_with_its_group_and_others_alone():
    ray = unit_of("tests/integrations/test_ray_actors.py::test_y")
    assert unit_of("tests/test_examples.py::test_z") == ray == "ray"
    assert group_of("tests/integrations/test_vllm_trl.py::test_x[a]") == "vllm"
    assert (
        unit_of("tests/integrations/test_vllm_trl.py::test_x[a]")
        == "tests/integrations/test_vllm_trl.py::test_x[a]"
    )
    typed = "tests/_records/test_manifest_typed.py::test_w[v1]"
    assert unit_of(typed) == typed


def _workers(together: str) -> set[str]:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-v",
            "-p",
            "no:cacheprovider",
            "-k",
            "every_format or bad_header",
            str(TESTS / "_records" / "test_manifest_typed.py"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=TESTS.parent,
        env={**os.environ, "CKPTGUARD_TEST_TOGETHER": together},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "scheduling tests via Units" in run.stdout, run.stdout[-3000:]
    assert len(re.findall(r"PASSED", run.stdout)) >= 6, run.stdout[-3000:]
    return set(re.findall(r"\[(gw\d+)\] \[ *\d+%\] PASSED", run.stdout))


def test_a_group_that_runs_together_stays_on_one_worker_of_two():
    assert len(_workers("test_manifest_typed")) == 1
    assert len(_workers("")) == 2  # handed out one by one, both workers take some


def test_the_tests_taking_a_shared_fixture_are_one_unit_and_the_others_alone():
    vllm = "tests/integrations/test_vllm_integration.py::"
    kills = unit_of(
        vllm + "test_grpo_with_vllm_killed_at_random_moments_resumes_bitwise_and_is_proven"
    )
    assert kills == unit_of(
        vllm + "test_phase_records_of_every_phase_hold_the_engine_in_the_save_peak"
    )
    assert kills == "test_vllm_integration::reference"
    alone = vllm + "test_an_engine_in_its_own_process_replays_with_per_request_seeds_only[seeded]"
    assert unit_of(alone) == alone  # takes only the cheap `work` directory
    export = "tests/ops/test_export.py::"
    assert (
        unit_of(export + "test_fsdp2_step_exported_loads_in_transformers_with_the_trainers_logits")
        == unit_of(export + "test_tied_embeddings_export_loads_tied_with_the_trainers_logits")
        == "test_export::hf_jobs"
    )
    assert (
        unit_of(export + "test_lora_exported_merged_once_equals_peft_merge")
        == "test_export::lora_job"
    )
    parametrized = (
        "tests/storage/s3/test_objectstore.py::"
        "test_two_writers_racing_for_one_step_exactly_one_commits"
    )
    assert (
        unit_of(parametrized + "[moto]")
        == unit_of(parametrized + "[ministack]")
        == "test_objectstore::races"
    )


def test_a_fixture_taken_through_another_and_two_taken_together_make_one_unit():
    source = """
import pytest

@pytest.fixture(scope="module")
def engine(tmp_path_factory): ...

@pytest.fixture(scope="module")
def servers(): ...

@pytest.fixture
def built(engine): ...

def test_direct(engine): ...
def test_through(built, tmp_path): ...
def test_both(engine, servers): ...
def test_servers(servers): ...
def test_neither(tmp_path): ...
"""
    units = units_in(source, "test_m", ("engine", "servers"))
    assert units == {
        "test_direct": "test_m::engine+servers",
        "test_through": "test_m::engine+servers",
        "test_both": "test_m::engine+servers",
        "test_servers": "test_m::engine+servers",
    }
    assert units_in(
        source.replace("def test_both(engine, servers)", "def test_both(engine)"),
        "test_m",
        ("engine", "servers"),
    ) == {
        "test_direct": "test_m::engine",
        "test_through": "test_m::engine",
        "test_both": "test_m::engine",
        "test_servers": "test_m::servers",
    }


@pytest.mark.parametrize("module", sorted(SHARED_FIXTURES))
def test_every_shared_fixture_is_a_module_fixture_its_tests_take(module):
    """A fixture renamed or moved leaves its entry naming nothing: its tests would go back to being
    built on every worker, unnoticed."""
    [path] = [p for p in TESTS.rglob(f"{module}.py") if "fixtures" not in p.parts]
    tree = ast.parse(path.read_text())
    scoped = {
        f.name
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
        for d in f.decorator_list
        if isinstance(d, ast.Call) and "fixture" in ast.unparse(d.func)
        for k in d.keywords
        if k.arg == "scope" and ast.literal_eval(k.value) == "module"
    }
    units = units_in(path.read_text(), module, SHARED_FIXTURES[module])
    for name in SHARED_FIXTURES[module]:
        assert name in scoped, (
            f"{path}: no module-scoped fixture {name!r}; update "
            f"SHARED_FIXTURES in tests/conftest.py"
        )
        assert any(name in unit.split("::")[1].split("+") for unit in units.values()), (path, name)


def test_a_job_s_heap_is_frozen_at_exit_after_every_later_finalizer_and_its_exit_handlers_still_run(
    tmp_path,
):
    """tests/jobexit.py: a finalizer made after ``freeze_at_exit`` (vLLM's engine shutdown, which
    unfreezes and collects) runs before the freeze; an atexit handler registered before it still
    runs, after it."""
    seen = tmp_path / "seen"
    job = f"""
import atexit, gc, weakref
from pathlib import Path
atexit.register(
    lambda: Path({str(seen)!r}).open("a").write(f"atexit {{gc.get_freeze_count() > 0}}\\n")
)
import jobexit
jobexit.freeze_at_exit()
class Engine: pass
engine = Engine()
weakref.finalize(
    engine, lambda: Path({str(seen)!r}).open("a").write(f"engine {{gc.get_freeze_count()}}\\n")
)
"""
    proc = subprocess.run(
        [sys.executable, "-c", job],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=TESTS,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
    )
    assert proc.returncode == 0, proc.stderr
    assert seen.read_text().splitlines() == ["engine 0", "atexit True"]
