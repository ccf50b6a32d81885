"""The third hostile review (issue 42): sizes and paths read from files an attacker or a bug
controls are checked before they are trusted. One test per finding; each failed on the code before
its fix."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from click.testing import CliRunner

import ckptguard as cg
from ckptguard.cli import main
from ckptguard.ops import export as ex
from ckptguard.storage import read_dcp_metadata
from ckptguard.storage.dcpindex import read_dcp_index

_HUGE = 1 << 40


def _cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path]:
    """(a root with one committed step of a small model, an export of it)."""
    base = tmp_path_factory.mktemp("hostile3")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    root = base / "ck"
    cg.CheckpointManager(root).save(
        1, {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
    )
    ex.export_hf(root / "step_00000001", base / "export")
    return root, base / "export"


def _copy(src: Path, tmp: Path, name: str = "copy") -> Path:
    shutil.copytree(src, tmp / name, symlinks=True)
    return tmp / name


def _edit_export(out: Path, change) -> None:
    path = out / ex.EXPORT_MANIFEST
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _fix_checksum(step: Path, rel: str) -> None:
    """An attacker with write access fixes the manifest's size and checksum of the file they
    changed."""
    manifest = json.loads((step / "manifest.json").read_text())
    data = (step / rel).read_bytes()
    for entry in manifest["files"]:
        if entry["path"] == rel:
            entry["size"], entry["xxh3"] = len(data), xxhash.xxh3_64(data).hexdigest()
    (step / "manifest.json").write_text(json.dumps(manifest, indent=1))


# ---------------------------------------------------------------- 1. verify --deep reads only
# inside the export


def test_verify_deep_of_an_export_never_reads_a_file_outside_it(saved, tmp_path):
    _, export = saved
    out = _copy(export, tmp_path)
    outside = _copy(export, tmp_path, "elsewhere")
    first = sorted(p.name for p in out.glob("*.safetensors"))[0]
    _edit_export(
        out, lambda d: [t.update(file=f"../elsewhere/{first}") for t in d["tensors"].values()]
    )
    result = _cli("verify", str(out), "--deep")
    assert result.exit_code == 1 and "OK" not in result.output.splitlines()[-1], result.output
    assert "malformed" in result.output and str(outside) not in result.output.replace(str(out), "")


def test_verify_deep_of_an_export_does_not_hang_on_a_fifo_it_names(saved, tmp_path):
    _, export = saved
    out = _copy(export, tmp_path)
    shard = sorted(out.glob("*.safetensors"))[0]
    shard.unlink()
    os.mkfifo(shard)
    # a child with a deadline: a hang fails the test instead of the suite
    proc = subprocess.run(
        [sys.executable, "-m", "ckptguard.cli", "verify", str(out), "--deep"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "not a plain file" in proc.stdout, proc.stdout + proc.stderr


def test_verify_deep_of_an_export_refuses_a_symlinked_shard(saved, tmp_path):
    _, export = saved
    out = _copy(export, tmp_path)
    outside = _copy(export, tmp_path, "elsewhere")
    shard = sorted(out.glob("*.safetensors"))[0]
    shard.unlink()
    shard.symlink_to(outside / shard.name)
    result = _cli("verify", str(out), "--deep")
    assert result.exit_code == 1 and "symlink" in result.output, result.output


# ---------------------------------------------------------------- 2. declared sizes bounded by the
# real bytes


def _st_file(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_a_safetensors_shape_larger_than_the_file_is_refused_before_any_allocation(
    tmp_path, monkeypatch
):
    from ckptguard.ops import hffiles

    path = tmp_path / "x.safetensors"
    _st_file(
        path, {"w": {"dtype": "F32", "shape": [_HUGE], "data_offsets": [0, 4 * _HUGE]}}, b"\0" * 16
    )
    asked: list[object] = []
    real_empty = torch.empty
    monkeypatch.setattr(hffiles.torch, "empty", lambda *a, **k: asked.append(a) or real_empty(0))
    with pytest.raises(cg.CheckpointCorruptError, match="nothing was allocated"):
        list(hffiles.read_tensors(path))
    assert asked == []


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]},
        {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]},
        {"dtype": "F32", "shape": ["1"], "data_offsets": [0, 4]},
        {"dtype": "F32", "shape": [1], "data_offsets": [0]},
        {"dtype": "F32", "shape": 1, "data_offsets": [0, 4]},
    ],
)
def test_a_malformed_safetensors_entry_is_a_clear_refusal(tmp_path, entry):
    from ckptguard.ops import hffiles

    path = tmp_path / "x.safetensors"
    _st_file(path, {"w": entry}, b"\0" * 4)
    with pytest.raises(cg.CheckpointCorruptError, match="'w'"):
        list(hffiles.read_tensors(path))


def _rewrite_metadata(state: Path, change) -> None:
    md = read_dcp_metadata(state)
    change(md)
    with open(state / ".metadata", "wb") as f:
        pickle.dump(md, f)
    _fix_checksum(state.parent, "state/.metadata")


def test_chunk_offsets_that_disagree_with_the_storage_index_are_refused_by_both_readers(
    saved, tmp_path
):
    root, _ = saved
    root = _copy(root, tmp_path)
    state = root / "step_00000001" / "state"

    def moved(md):
        import dataclasses

        key = "model.0.weight"
        meta = md.state_dict_metadata[key]
        big = torch.Size([_HUGE, 8])
        chunk = dataclasses.replace(meta.chunks[0], offsets=torch.Size([1, 0]), sizes=big)
        md.state_dict_metadata[key] = dataclasses.replace(
            meta, size=torch.Size([_HUGE + 1, 8]), chunks=[chunk]
        )

    _rewrite_metadata(state, moved)
    for read in (read_dcp_metadata, read_dcp_index):
        with pytest.raises(
            cg.CheckpointCorruptError, match=r"has no storage entry|which the key does not have"
        ):
            read(state)
    result = _cli("verify", str(root), "--deep")
    assert result.exit_code == 1 and "bug in ckptguard" not in result.output, result.output


def test_a_span_beyond_its_data_file_is_refused_before_a_read(saved, tmp_path):
    root, _ = saved
    root = _copy(root, tmp_path)
    state = root / "step_00000001" / "state"

    def beyond(md):
        import dataclasses

        index = next(iter(md.storage_data))
        md.storage_data[index] = dataclasses.replace(md.storage_data[index], offset=_HUGE)

    _rewrite_metadata(state, beyond)
    with pytest.raises(cg.CheckpointCorruptError, match="which holds"):
        read_dcp_index(state)  # the checks: refused from the metadata and the file's size
    assert _cli("verify", str(root)).exit_code == 1
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    with pytest.raises(cg.CheckpointError):  # restore's reader refuses the span when it reaches it
        cg.CheckpointManager(root).restore(
            {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
        )


def test_a_pickle_declaring_a_huge_bytearray_or_memo_index_is_refused_before_unpickling(
    saved, tmp_path
):
    root, _ = saved
    state = _copy(root, tmp_path) / "step_00000001" / "state"
    clean = (state / ".metadata").read_bytes()
    for evil in (
        b"\x80\x04\x96" + struct.pack("<Q", 1 << 62) + b".",  # BYTEARRAY8 of 4 EiB
        b"\x80\x04N" + b"r" + struct.pack("<I", 1 << 31) + b".",
    ):  # LONG_BINPUT at 2^31: 32 GiB memo
        (state / ".metadata").write_bytes(evil)
        for read in (
            read_dcp_metadata,
            read_dcp_index,
        ):  # refused by the scan, before the unpickler allocates
            with pytest.raises(cg.CheckpointCorruptError, match=r"DCP never writes|beyond its"):
                read(state)
    (state / ".metadata").write_bytes(clean)
    read_dcp_metadata(state)


# ---------------------------------------------------------------- 3. one reader: the commands agree
# with restore


def test_a_metadata_entry_without_its_fields_is_refused_alike_by_the_commands_and_restore(
    saved, tmp_path
):
    root, _ = saved
    root = _copy(root, tmp_path)
    state = root / "step_00000001" / "state"
    # a 1-bit flip in a field name ("fqn" -> "fqo"), the checksum fixed: the key has no fqn any more
    data = (state / ".metadata").read_bytes()
    at = data.index(b"fqn")
    (state / ".metadata").write_bytes(data[:at] + b"fqo" + data[at + 3 :])
    _fix_checksum(root / "step_00000001", "state/.metadata")
    for read in (read_dcp_metadata, read_dcp_index):
        with pytest.raises(cg.CheckpointCorruptError):
            read(state)
    assert _cli("verify", str(root)).exit_code == 1
    assert _cli("preflight", str(root)).exit_code == 1
    listing = json.loads(_cli("list", str(root), "--json").output)
    assert listing["entries"][0]["state"] != "committed"
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    with pytest.raises(cg.CheckpointError):
        cg.CheckpointManager(root).restore(
            {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
        )


def test_a_renamed_key_is_found_by_verify_not_only_by_restore(saved, tmp_path):
    root, _ = saved
    root = _copy(root, tmp_path)
    state = root / "step_00000001" / "state"
    data = (state / ".metadata").read_bytes()
    (state / ".metadata").write_bytes(data.replace(b"model.0.bias", b"model.0.bia5"))
    _fix_checksum(root / "step_00000001", "state/.metadata")
    result = _cli("verify", str(root))
    assert (
        result.exit_code == 1
        and "missing-key" in result.output
        and "unrecorded-key" in result.output
    )


def test_the_stand_in_classes_are_unhashable_like_dcps(saved):
    root, _ = saved
    index = read_dcp_index(root / "step_00000001" / "state")
    meta = index.state_dict_metadata["model.0.weight"]
    with pytest.raises(TypeError):
        hash(meta)
    hash(next(iter(index.storage_data)))  # MetadataIndex is frozen in DCP: hashable in both


# ---------------------------------------------------------------- 5. verdicts say what was compared


def test_verify_deep_of_an_export_with_a_warning_says_the_tensors_were_compared_only_if_they_were(
    saved, tmp_path
):
    _, export = saved
    out = _copy(export, tmp_path)
    (out / "notes.txt").write_text("added later\n")
    result = _cli("verify", str(out), "--deep")
    assert result.exit_code == 0 and "unlisted" in result.output
    assert (
        "tensor digests" in result.output.splitlines()[-1]
    )  # a WARNING does not skip them: they ran
    shard = sorted(out.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1])
    result = _cli("verify", str(out), "--deep")
    last = result.output.splitlines()[-1]
    assert result.exit_code == 1 and "tensor digests NOT compared" in last, last


def test_plain_verify_of_an_export_refuses_the_malformed_tensor_entries_deep_refuses(
    saved, tmp_path
):
    _, export = saved
    out = _copy(export, tmp_path)
    _edit_export(out, lambda d: next(iter(d["tensors"].values())).update(shape="x"))
    for args in ([], ["--deep"]):
        result = _cli("verify", str(out), *args)
        assert result.exit_code == 1 and "malformed" in result.output, (args, result.output)


# ---------------------------------------------------------------- 6. the CLI


def test_adopt_refuses_a_template_that_pads_the_step_to_a_billion_digits(saved, tmp_path):
    import time

    root, _ = saved
    began = time.monotonic()
    result = CliRunner().invoke(main, ["adopt", str(root), "1", "--template", "{step:0999999999d}"])
    assert time.monotonic() - began < 10 and result.exit_code == 2, result.output
    assert "at most 20" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("text", [" 1", "1 ", "\t1\n", "1\n\n", "1\r\n"])
def test_whitespace_around_the_trackers_step_is_refused(saved, tmp_path, text):
    root = _copy(saved[0], tmp_path)
    (root / "latest_checkpointed_iteration.txt").write_text(text)
    with pytest.raises(cg.CheckpointCorruptError, match="not a step number"):
        cg.CheckpointManager(root).resolve()
    assert _cli("resolve", str(root)).exit_code == 1


def test_status_on_a_file_that_holds_no_phase_records_exits_1_as_its_help_says(tmp_path):
    other = tmp_path / "notes.jsonl"
    other.write_text('{"a": 1}\n')
    result = CliRunner().invoke(main, ["status", str(other)])
    assert result.exit_code == 1 and "no phase records" in result.output, result.output


def test_status_on_a_plain_checkpoint_root_says_the_roots_state(saved, tmp_path):
    root = _copy(saved[0], tmp_path)
    result = CliRunner().invoke(main, ["status", str(root)])
    assert result.exit_code == 0, result.output
    assert (
        "newest committed step 1" in result.output
        and "a resume now: resume from step 1" in result.output
    )
    assert "PhaseRecorder" in result.output  # said once, as what would add the ranks' phases
    (root / "latest_checkpointed_iteration.txt").write_text("7\n")
    result = CliRunner().invoke(main, ["status", str(root)])
    assert result.exit_code == 1 and "would REFUSE" in result.output, result.output


# ---------------------------------------------------------------- 7. paper cuts


def test_export_and_verify_take_plain_strings_as_paths(saved, tmp_path):
    root, _ = saved
    result = ex.export_hf(str(root / "step_00000001"), str(tmp_path / "out"))
    assert result.tensors == 4 and ex.verify_export(str(tmp_path / "out"), deep=True) == []
    from ckptguard.ops import inspect as _inspect

    assert _inspect.list_steps(str(root), "step_{step:08d}").entries[0].state == "committed"
    assert read_dcp_metadata(str(root / "step_00000001" / "state")).state_dict_metadata


def test_a_skipped_save_is_never_told_that_its_own_interval_fits(monkeypatch):
    from ckptguard._commit import busy

    clock = iter([0.0, 4.0])
    monkeypatch.setattr(busy.time, "monotonic", lambda: next(clock))
    round_ = busy.BusyRound(None)
    round_.request(4)
    round_.request(8)  # saves every 4 steps, one step a second
    round_.commit_took(3.9)  # the commit lasts 3.9 steps (ceil: "4 fits", yet 4 was just skipped)
    every, _ = round_.fitting_interval(
        busy.BusyDecision(busy=True, running=4, ranks=[0], running_s=3.9)
    )
    assert every == 5


def test_a_same_layout_restore_that_differs_does_not_blame_a_resharding_read(saved, tmp_path):
    root = _copy(saved[0], tmp_path)
    step = root / "step_00000001"
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["layout_free"]["model"]["model.0.bias"] = (
        "0" * 16
    )  # what a restore on the same layout compares
    (step / "manifest.json").write_text(json.dumps(manifest, indent=1))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    with pytest.raises(cg.StateMismatchError) as caught:
        cg.CheckpointManager(root).restore(
            {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
        )
    assert "on the same layout" in str(caught.value) and "resharding read" not in str(caught.value)
    assert "no resharding ran" in str(caught.value)
