"""The suite's tree mirrors the package's: a module's tests are found by its path.

``tests/<pkg>/test_*.py`` holds the tests of ``src/ckptguard/<pkg>/`` (or of the module
``src/ckptguard/<pkg>.py``: ``tests/cli/``, ``tests/tiers/``); a test module at ``tests/`` itself
covers a top-level module (``test_run_roles.py``: ``run.py``) or the repository as a whole (the
README, the examples, the benchmarks, the suite's own schedule). Helpers and job scripts (not
``test_*``) stay at ``tests/``, where every test imports them by name (tests/conftest.py puts every
folder here on ``sys.path``)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "src" / "ckptguard"
# What a root-level test module may cover besides a top-level module of the package.
WHOLE_REPO = {
    "architecture",
    "bench_train_loop",
    "examples",
    "readme_drift",
    "suite_groups",
    "venv_wait",
    "logging_default",
    "tree",
}


def _folders() -> list[Path]:
    return sorted(
        d
        for d in TESTS.rglob("*")
        if d.is_dir()
        and "__pycache__" not in d.parts
        and "fixtures" not in d.relative_to(TESTS).parts
    )


def test_every_test_folder_names_a_package_folder_or_module():
    stray = [
        str(d.relative_to(TESTS))
        for d in _folders()
        if not (PACKAGE / d.relative_to(TESTS)).is_dir()
        and not (PACKAGE / d.relative_to(TESTS)).with_suffix(".py").is_file()
    ]
    assert stray == [], (
        f"tests/{stray}: no src/ckptguard/ folder or module of that path; put the tests where "
        "the code they cover lives"
    )


def test_a_root_test_module_covers_a_top_level_module_or_the_repository():
    top = {p.stem.lstrip("_") for p in PACKAGE.glob("*.py")} | {
        p.name for p in PACKAGE.iterdir() if p.is_dir()
    }
    stray = [
        p.name
        for p in TESTS.glob("test_*.py")
        if p.stem[len("test_") :] not in WHOLE_REPO
        and not any(p.stem[len("test_") :].startswith(t) for t in top)
    ]
    assert stray == [], (
        f"{stray} at tests/: move each to the tests/ folder of the package it covers"
    )


def test_test_module_names_are_unique_across_folders():
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert len(names) == len(set(names)), (
        "two test modules of one name: conftest's groups and imports key by name"
    )
