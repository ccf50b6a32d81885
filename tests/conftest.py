import ast
import functools
import os
import sys
from pathlib import Path

import pytest

# Test helpers and fixture generators are imported by name, also in spawned ranks; so are test
# modules by other test modules (``from test_tiers import ...``) wherever under tests/ each lives
# (its folders mirror src/ckptguard/).
_TESTS = Path(__file__).parent
for path in [
    str(_TESTS),
    str(_TESTS / "fixtures"),
    *sorted(
        str(d)
        for d in _TESTS.rglob("*")
        if d.is_dir()
        and "__pycache__" not in d.parts
        and "fixtures" not in d.relative_to(_TESTS).parts
    ),
]:
    if path not in sys.path:
        sys.path.insert(0, path)

import venvs  # noqa: E402  (tests/: on sys.path just above)

# ``make test-fast`` (the edit loop) runs ``-m "not slow"``. A test is slow when it is marked
# ``@pytest.mark.slow`` or lives in one of these modules: each starts real training jobs or
# torchrun/Ray groups in new processes, forms multi-rank gloo groups many times, or needs its own
# venv. ``make test`` runs everything and prints the 25 slowest tests: move a module here when
# its tests show up there.
SLOW_MODULES = {
    "test_suite_groups",
    "test_bench_train_loop",
    "test_elastic",
    "test_examples",
    "test_faults",
    "test_healthy",
    "test_hf_integration",
    "test_single_writer",
    "test_cli_honest_answers",
    "test_commit",
    "test_vllm_integration",
    "test_objectstore",
    "test_objectstore_ops",
    "test_objectstore_tiers",
    "test_export",
    "test_megatron",
    "test_goodput",
    "test_proof_resumes",
    "test_memory_bench",
    "test_node_local",
    "test_openrlhf_integration",
    "test_preempt",
    "test_ray_actors",
    "test_readside",
    "test_rehearse",
    "test_replicas",
    "test_reshard_proof",
    "test_resume",
    "test_root_safety",
    "test_run_ops",
    "test_run_roles",
    "test_store_threads",
    "test_tiers",
    "test_tiers_async",
    "test_onbusy",
    "test_trajectory",
    "test_transfer",
    "test_verl_integration",
    "test_cli_progress",
    "test_cli_start",
    "test_ops_refusals",
    "test_verify_restore_once",
    "test_replicas_after_load",
    "test_operations",
    "test_proof",
    "test_rollout_ledger",
    "test_hf_skip",
    "test_logging_default",
    "test_memory_report",
}


# ``make test`` runs the suite on two pytest-xdist workers with ``--dist loadgroup``. The modules
# that start a local Ray cluster run on one worker, one after the other (two local clusters on one
# host collide); the tests sharing an expensive module fixture (SHARED_FIXTURES below) go as one
# unit; every other test is handed out alone to whichever worker is free, so a module's other
# fixtures are built on each worker that runs one of its tests. (Whole modules as units made the
# vLLM tests one serial chain on one worker: the suite took 22 min from a fresh clone, against 16
# with the tests handed out one by one. Two vLLM engines on the CPU at once only share the cores;
# each TRL job takes a free MASTER_PORT.)
GROUPS = {
    "test_examples": "ray",
    "test_ray_actors": "ray",
    "test_vllm_integration": "vllm",
    "test_vllm_lora": "vllm",
    "test_vllm_trl": "vllm",
    "test_vllm_memory": "vllm",
    "test_turns_vllm": "vllm",
}
TOGETHER = {"ray", *filter(None, os.environ.get("CKPTGUARD_TEST_TOGETHER", "").split(","))}
"""The groups whose tests run on one worker (the environment variable adds some:
tests/test_suite_groups.py)."""


def group_of(nodeid: str) -> str:
    module = Path(nodeid.split("::", 1)[0]).stem
    return GROUPS.get(module, module)


# Module-scoped fixtures that start real jobs (an engine, a multi-rank run, S3 servers): the tests
# taking one (or a fixture of their module that takes one) are handed out as one unit, so the
# fixture runs once in the suite. Handed out alone, its tests landed on both workers and each built
# it (fresh 3 of session 8: test_export's transformers job, 32 s, and the object store's races, 37
# s, set up on both).
SHARED_FIXTURES = {
    "test_vllm_integration": ("reference",),
    "test_vllm_trl": ("probe",),
    "test_vllm_lora": ("runs",),
    "test_preempt": ("straight",),
    "test_export": ("hf_jobs", "lora_job"),
    "test_hf_integration": ("grpo_reference",),
    "test_objectstore": ("races",),
    "test_trajectory": ("one_rank", "two_ranks"),
    "test_proof_resumes": ("replayed", "crash_loop"),
    "test_proof_evidence": ("loop_root",),
    "test_single_writer": ("live_writer", "two_ranks"),
    "test_goodput": ("killed_run",),
    "test_megatron": ("cpu",),
    "test_pathlike": ("roots",),
    "test_verify": ("two_rank_ckpt",),
    "test_healthy": ("nan_root",),
    "test_cli_json": ("root",),
    "test_cli_progress": ("root",),
    "test_cli_start": ("roots",),
    "test_confinement": ("probe_results",),
    "test_rollout_ledger": ("zygote",),
    "test_turns_proof": ("new_ids",),
}


def unit_of(nodeid: str) -> str:
    """What xdist hands out whole: a group that runs together, else the tests sharing a fixture of
    SHARED_FIXTURES, else the one test."""
    group = group_of(nodeid)
    if group in TOGETHER:
        return group
    path, _, rest = nodeid.partition("::")
    return shared_units(path).get(rest.rsplit("::", 1)[-1].split("[", 1)[0], nodeid)


@functools.cache
def shared_units(path: str) -> dict[str, str]:
    """Test function name -> its unit, for the tests of the module at ``path`` (relative to the
    repository) that take one of its SHARED_FIXTURES. Read from the source: xdist's controller,
    which hands the units out, sees node ids only, never a collected test's fixtures."""
    module = Path(path).stem
    if module not in SHARED_FIXTURES or not (_TESTS.parent / path).is_file():
        return {}
    return units_in((_TESTS.parent / path).read_text(), module, SHARED_FIXTURES[module])


def units_in(source: str, module: str, shared: tuple[str, ...]) -> dict[str, str]:
    """``shared_units`` of a module's source."""
    tree = ast.parse(source)
    functions = [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    fixtures = {
        f.name: _arguments(f)
        for f in functions
        if any("fixture" in ast.unparse(d) for d in f.decorator_list)
    }

    def reached(
        names: list[str],
    ) -> set[str]:  # a fixture taking a shared fixture takes what it builds
        seen: set[str] = set()
        while names:
            name = names.pop()
            if name not in seen:
                seen.add(name)
                names.extend(fixtures.get(name, []))
        return seen & set(shared)

    uses = {
        f.name: reached(_arguments(f))
        for f in functions
        if f.name.startswith("test") and f.name not in fixtures
    }
    # fixtures taken together by one test are one unit: union them, then name each unit by its
    # fixtures
    owner = {name: name for name in shared}
    for taken in uses.values():
        for name in taken:
            owner[_root(owner, name)] = _root(owner, min(taken))
    members: dict[str, list[str]] = {}
    for name in owner:
        members.setdefault(_root(owner, name), []).append(name)
    return {
        test: f"{module}::{'+'.join(sorted(members[_root(owner, min(taken))]))}"
        for test, taken in uses.items()
        if taken
    }


def _arguments(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = function.args
    return [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


def _root(owner: dict[str, str], name: str) -> str:
    while owner[name] != name:
        name = owner[name]
    return name


# xdist hands the units out in collection order. ``make test`` builds the framework venvs in the
# background for the first minutes of the suite, so the heavy groups that need none go first, then
# the groups that need one (the longest first: the suite ends no sooner than the vLLM tests do) and
# the Ray group (a local Ray cluster started while the venvs build timed out starting its actors),
# then the rest in file order.
FIRST_GROUPS = (
    "test_preempt",
    "test_rehearse",
    "test_replicas",
    "test_proof",
    "test_readside",
    "test_operations",
    "test_node_local",
    "test_faults",
    "test_commit",
)
VENV_GROUPS = (
    "vllm",
    "ray",
    "test_hf_integration",
    "test_objectstore",
    "test_export",
    "test_objectstore_tiers",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    order = {g: n for n, g in enumerate((*FIRST_GROUPS, *VENV_GROUPS))}
    items.sort(
        key=lambda it: order.get(group_of(it.nodeid), len(order))
    )  # stable: file order within and after


@pytest.hookimpl(
    optionalhook=True
)  # xdist's hook: a run without xdist (-p no:xdist) has no such hookspec
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` by ``unit_of``, on the controller: xdist's own loadgroup reads
    ``xdist_group`` marks by appending them to each node id, which pytest 9.2's structured node ids
    ignore (pytest-xdist#1386), so its groups silently fell apart (the Ray modules ran on both
    workers)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = (
        False  # the order above, not xdist's default (3.7+) of the most tests first
    )

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return Units(config, log)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Outside the test's timeout: wait for a framework venv ``make test`` still builds
    (tests/venvs.py)."""
    for mark in item.iter_markers("needs_venv"):
        venvs.wait_for(mark.args[0])
    yield


def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs_venv"):
        if not venvs.ready(mark.args[0]):
            pytest.skip(mark.kwargs["reason"])
