"""Every public operator function that takes a local path takes it as ``str`` too (issue 42, item
7).

Each case calls one function of ``ckptguard.ops`` with plain ``str`` paths on a real root
(tests/cli_roots.py) and checks it did its work, not only that it did not raise: a function that
used a ``str`` as a ``Path`` failed with a bare ``AttributeError``/``TypeError`` ("'str' object has
no attribute 'exists'"). The object-store transfers run against one moto server on 127.0.0.1.
``ops.rehearse.rehearse`` (it makes the test process a subreaper) and ``ops.repro.run_repro`` (it
spawns saving ranks) are not called here; both convert with ``Path(os.fspath(...))`` as these do.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptguard._disk import layout as _layout
from ckptguard.errors import CheckpointError, ConfigError
from ckptguard.ops import gc as _gc
from ckptguard.ops import goodput as _goodput
from ckptguard.ops import merge as _merge
from ckptguard.ops import repro as _repro
from cli_roots import build_roots

NAMING = _layout.StepNaming("step_{step:08d}")


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_roots(tmp_path_factory.mktemp("roots"))


def _identify(roots: dict[str, Path], tmp: Path) -> None:
    _gc.identify(str(roots["one"]))  # a checkpoint root: no error
    with pytest.raises(ConfigError, match="is not a checkpoint root"):
        _gc.identify(str(tmp))


def _gc_dry_run(roots: dict[str, Path], tmp: Path) -> None:
    report = _gc.gc(str(roots["one"]), NAMING, dry_run=True)
    assert [p.name for p, _ in report.kept] == ["step_00000003"]  # the orphan, reported and kept


def _adopt(roots: dict[str, Path], tmp: Path) -> None:
    root = shutil.copytree(roots["one"], tmp / "one")
    assert "now points at step 3" in _gc.adopt_step(str(root), NAMING, 3)
    assert _layout.read_tracker(root) == 3


def _merged(roots: dict[str, Path], tmp: Path) -> None:
    # A step without a LoRA binding: refused by name once the step is read, which needs the paths as
    # Paths.
    with pytest.raises(ConfigError, match="holds no LoRA binding"):
        _merge.export_merged(str(roots["one"] / "step_00000001"), str(tmp / "out"))
    assert not (tmp / "out").exists()


def _goodput_of(roots: dict[str, Path], tmp: Path) -> None:
    got = _goodput.goodput(str(roots["one"]))
    assert got.root == str(roots["one"]) and len(got.launches) == 1


def _filesystem(roots: dict[str, Path], tmp: Path) -> None:
    got = _repro.filesystem(str(tmp / "not" / "yet"))  # the nearest existing parent's filesystem
    assert got["free_bytes"] > 0 and got["type"]


CASES: dict[str, Callable[[dict[str, Path], Path], None]] = {
    "gc.identify": _identify,
    "gc.gc": _gc_dry_run,
    "gc.adopt_step": _adopt,
    "merge.export_merged": _merged,
    "goodput.goodput": _goodput_of,
    "repro.filesystem": _filesystem,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_local_public_function_takes_str_paths(
    name: str, roots: dict[str, Path], tmp_path: Path
) -> None:
    CASES[name](roots, tmp_path)


@pytest.fixture(scope="module")
def moto() -> Any:
    pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")
    pytest.importorskip("moto.server", reason="moto[server] (dev extra) is not installed")
    import objstore_helper as h

    with h.moto_endpoint() as endpoint:  # ObjectStoreOptions() takes boto3's endpoint
        yield endpoint


@pytest.mark.timeout(600)
def test_the_store_transfers_and_proof_fetch_take_str_paths(
    moto: str, roots: dict[str, Path], tmp_path: Path
) -> None:
    import boto3

    from ckptguard.ops import remote as _objectstore
    from ckptguard.ops import storetransfer as _storetransfer

    boto3.client("s3", endpoint_url=moto).create_bucket(Bucket="pathlike")
    url = "s3://pathlike/run"
    sent = _storetransfer.to_store(str(roots["one"] / "step_00000002"), url)
    assert sent["step"] == 2 and sent["tracker_set_to"] == 2
    record = tmp_path / "records" / "back.json"
    got = _storetransfer.from_store(url, str(tmp_path / "dest"), record=str(record))
    assert got["destination"] == str(tmp_path / "dest" / "step_00000002") and got["record"] == str(
        record
    )
    assert (
        json.loads(record.read_text())["step"] == 2 and _layout.read_tracker(tmp_path / "dest") == 2
    )
    # The store holds no proof records (to_store copies none): refused by name, after the
    # destination was taken.
    with pytest.raises(CheckpointError, match="holds no proof records"):
        _objectstore.fetch_proof(url, "step_{step:08d}", str(tmp_path / "proof"))


def test_the_proofs_public_functions_take_a_str_root(roots):
    from ckptguard.ops import prove

    root = str(roots["one"])
    gates = prove.evaluate(root)
    assert gates and prove.verdict(gates).startswith(
        "resume EVIDENCE MISSING"
    )  # no restore recorded there
    assert prove.resume_count(root) == [] and prove.run_roles(root) == []
    assert prove.recorded_plan(root)[0].record is True
