"""``make test``'s units (conftest.unit_of): the tests taking an expensive module fixture of SHARED_FIXTURES are
handed out together, so the fixture (a vLLM engine's runs, a transformers job, S3 servers) is built once in the
suite, not once on each of the two workers; every other test stays alone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import SHARED_FIXTURES, unit_of, units_in

TESTS = Path(__file__).parent


def test_the_tests_taking_a_shared_fixture_are_one_unit_and_the_others_alone():
    vllm = "tests/integrations/test_vllm_integration.py::"
    kills = unit_of(vllm + "test_grpo_with_vllm_killed_at_random_moments_resumes_bitwise_and_is_proven")
    assert kills == unit_of(vllm + "test_phase_records_of_every_phase_hold_the_engine_in_the_save_peak")
    assert kills == "test_vllm_integration::reference"
    alone = vllm + "test_an_engine_in_its_own_process_replays_with_per_request_seeds_only[seeded]"
    assert unit_of(alone) == alone  # takes only the cheap `work` directory
    export = "tests/ops/test_export.py::"
    assert unit_of(export + "test_fsdp2_step_exported_loads_in_transformers_with_the_trainers_logits") == \
        unit_of(export + "test_tied_embeddings_export_loads_tied_with_the_trainers_logits") == "test_export::hf_jobs"
    assert unit_of(export + "test_lora_exported_merged_once_equals_peft_merge") == "test_export::lora_job"
    parametrized = "tests/storage/s3/test_objectstore.py::test_two_writers_racing_for_one_step_exactly_one_commits"
    assert unit_of(parametrized + "[moto]") == unit_of(parametrized + "[ministack]") == "test_objectstore::races"


def test_a_fixture_taken_through_another_and_two_taken_together_make_one_unit():
    source = '''
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
'''
    units = units_in(source, "test_m", ("engine", "servers"))
    assert units == {"test_direct": "test_m::engine+servers", "test_through": "test_m::engine+servers",
                     "test_both": "test_m::engine+servers", "test_servers": "test_m::engine+servers"}
    assert units_in(source.replace("def test_both(engine, servers)", "def test_both(engine)"), "test_m",
                    ("engine", "servers")) == {"test_direct": "test_m::engine", "test_through": "test_m::engine",
                                               "test_both": "test_m::engine", "test_servers": "test_m::servers"}


@pytest.mark.parametrize("module", sorted(SHARED_FIXTURES))
def test_every_shared_fixture_is_a_module_fixture_its_tests_take(module):
    """A fixture renamed or moved leaves its entry naming nothing: its tests would go back to being built on
    every worker, unnoticed."""
    [path] = [p for p in TESTS.rglob(f"{module}.py") if "fixtures" not in p.parts]
    tree = ast.parse(path.read_text())
    scoped = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
              for d in f.decorator_list if isinstance(d, ast.Call) and "fixture" in ast.unparse(d.func)
              for k in d.keywords if k.arg == "scope" and ast.literal_eval(k.value) == "module"}
    units = units_in(path.read_text(), module, SHARED_FIXTURES[module])
    for name in SHARED_FIXTURES[module]:
        assert name in scoped, f"{path}: no module-scoped fixture {name!r}; update SHARED_FIXTURES in tests/conftest.py"
        assert any(name in unit.split("::")[1].split("+") for unit in units.values()), (path, name)
