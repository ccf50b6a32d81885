"""A path one level off is named as such: a step directory given where the root is taken, a root
where a step is taken, a step that does not exist, each with the command to run instead (exit 2 for
the usage, 1 for hold's refusal), never a verdict computed from the wrong place ("no proof records",
"never committed")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from damage_helper import cli, refused, tiny_root


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tiny_root(tmp_path_factory.mktemp("level") / "ck", (1, 2))


def test_prove_given_a_step_directory_points_at_the_root(root: Path) -> None:
    got = cli("prove", root / "step_00000002")
    refused(got, "prove STEP_DIR")
    assert got.exit_code == 2 and "is a step directory" in got.output, got.output
    assert (
        f"ckptguard prove {root.absolute()}" in got.output and "no proof records" not in got.output
    )
    shown = cli("prove", root / "step_00000002", "--json")
    assert (
        shown.exit_code == 2
        and "prove takes the checkpoint root" in json.loads(shown.output)["error"]
    )


def test_transfer_given_the_root_points_at_its_newest_step(root: Path, tmp_path: Path) -> None:
    got = cli("transfer", root, tmp_path / "dest")
    refused(got, "transfer ROOT DEST")
    assert (
        got.exit_code == 2 and "is a checkpoint root" in got.output and "which says 2" in got.output
    )
    assert str(root / "step_00000002") in got.output and "never committed" not in got.output, (
        got.output
    )
    assert not (tmp_path / "dest").exists(), (
        "nothing is made at the destination for a refused transfer"
    )


def test_hold_of_a_step_that_does_not_exist_lists_the_steps_there(root: Path) -> None:
    got = cli("hold", root, 999, "--reason", "eval")
    refused(got, "hold ROOT 999")
    assert "step 999 has no directory under" in got.output and "[1, 2]" in got.output, got.output
    assert "never committed" not in got.output and not (root / "holds" / "999.json").exists()


def test_repro_save_makes_no_tree_of_directories_for_a_typo(tmp_path: Path) -> None:
    typo = tmp_path / "scratc" / "ckptguard" / "repro"
    got = cli("repro-save", "--target", typo, "--rounds", "1", "--size", "0.0001")
    refused(got, "repro-save --target TYPO")
    assert (
        got.exit_code == 2
        and "is not a directory" in got.output
        and not (tmp_path / "scratc").exists()
    )
