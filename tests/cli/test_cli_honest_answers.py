"""Every command answers honestly and never crashes.

A malformed manifest, tracker, proof record or extras file is a clear error from every
command; DCP metadata that lists no tensors fails verify and preflight; verify on a directory
without a checkpoint fails and points below, and never claims a restore it skipped; a plain
value whose type changed restores as saved; a corrupted shard is named at restore; demo
refuses a non-empty directory it did not create; the README shows plain values are
snapshots; mem plan keeps measured terms, transfer on ENOSPC is a clear error, status exits
1 with a stalled rank, verify prints readable sizes, hash_imported_files is stable; verify
--restore holds one item at a time.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptguard as cg
from damage_helper import (
    DEEP,
    MANIFEST,
    TRACKER,
    cli,
    no_traceback,
    refresh_entry,
    refused,
    rewrite_manifest,
    run_py,
    step_dir,
    tiny_root,
)


@pytest.fixture(scope="module")
def base_root(tmp_path_factory) -> Path:
    return tiny_root(tmp_path_factory.mktemp("base") / "ck", (1, 2))


@pytest.fixture
def root(tmp_path, base_root) -> Path:
    copy = tmp_path / "ck"
    shutil.copytree(base_root, copy, symlinks=True)
    return copy


# ---------------------------------------------------------------- malformed files, every command


def _manifest_text(text: str | bytes):
    def corrupt(root: Path) -> None:
        path = root / "step_00000002" / MANIFEST
        path.write_bytes(text if isinstance(text, bytes) else text.encode())

    return corrupt


def _bad_entries(root: Path) -> None:
    rewrite_manifest(root / "step_00000002", lambda m: m.update(files=[5, "x", {"path": 3}, None]))


def _tracker_bytes(data: bytes):
    return lambda root: (root / TRACKER).write_bytes(data)


WRONG_TYPES = json.dumps(
    {
        "format_version": 1,
        "step": "two",
        "topology": [],
        "versions": 5,
        "items": [],
        "files": {"a": 1},
        "digests": 7,
    }
)
CORRUPTIONS = {
    "manifest: fields of the wrong type": _manifest_text(WRONG_TYPES),
    "manifest: null": _manifest_text("null"),
    "manifest: file entries that are not objects": _bad_entries,
    "manifest: nested 100k deep": _manifest_text(DEEP),
    "manifest: not UTF-8": _manifest_text(b'\xff\xfe{"step": 2}'),
    "tracker: not UTF-8": _tracker_bytes(b"\xff\xfe\x00\x01"),
    "tracker: not a number": _tracker_bytes(b"two\n"),
}
COMMANDS = {
    "resolve": lambda r, t: ["resolve", r],
    "list": lambda r, t: ["list", r],
    "verify ROOT": lambda r, t: ["verify", r],
    "verify ROOT --deep --json": lambda r, t: ["verify", r, "--deep", "--json"],
    "verify STEP": lambda r, t: ["verify", r / "step_00000002"],
    "preflight": lambda r, t: ["preflight", r],
    "gc --dry-run": lambda r, t: ["gc", r, "--dry-run"],
    "gc": lambda r, t: ["gc", r],
    "hold": lambda r, t: ["hold", r, "2", "--reason", "evaluation"],
    "transfer": lambda r, t: ["transfer", r / "step_00000002", t / "dest"],
}


def _must_fail(corruption: str, command: str) -> bool:
    """Where the damaged file is on the command's path, the command cannot succeed."""
    if command in ("resolve", "verify ROOT", "verify ROOT --deep --json", "preflight"):
        return True
    if corruption.startswith("manifest"):
        return command in ("verify STEP", "hold", "transfer")
    return command == "hold"


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_malformed_manifest_or_tracker_gives_a_clear_error(root, tmp_path, corruption, command):
    CORRUPTIONS[corruption](root)
    result = cli(*COMMANDS[command](root, tmp_path))
    no_traceback(result, f"{command} on a {corruption}")
    if _must_fail(corruption, command):
        assert result.exit_code in (1, 2), (
            f"{command} on a {corruption}: exit {result.exit_code}\n{result.output}"
        )


PROOFS = {
    "a record without an event": '{"x": 1}\n{"event": "save", "pid": 1}\n',
    "a line that is not JSON": 'not json\n{"event": "save", "pid": 1}\n',
    "a record that is a list": '[1, 2]\n{"event": "save", "pid": 1}\n',
}


@pytest.mark.parametrize("proof", list(PROOFS))
def test_malformed_proof_records_give_a_clear_error(root, proof):
    (root / "proof").mkdir(exist_ok=True)
    (root / "proof" / "rank_00000.jsonl").write_text(PROOFS[proof])
    result = cli("prove", root)
    refused(result, f"prove with {proof}")
    assert "rank_00000.jsonl" in result.output, f"prove does not name the file\n{result.output}"


EXTRAS = {
    "a list": [1, 2, 3],
    "no items": {"format_version": 1, "step": 2, "rank": 0, "kinds": {}, "rng": None},
    "items of the wrong type": {
        "format_version": 1,
        "step": 2,
        "rank": 0,
        "kinds": {},
        "items": 5,
        "rng": None,
    },
}


@pytest.mark.parametrize("extras", list(EXTRAS))
def test_malformed_extras_give_a_clear_error(root, extras):
    step = root / "step_00000002"
    torch.save(EXTRAS[extras], step / "rank_00000.pt")
    refresh_entry(step, "rank_00000.pt")  # sizes and checksums agree: only the content is wrong
    if extras == "no items":  # the one CLI command that reads extras (a subprocess: once is enough)
        result = cli("verify", root, "--restore")
        refused(result, f"verify --restore with extras that are {extras}")
    try:
        cg.CheckpointManager(root).restore({"w": torch.zeros(4)})
    except cg.CheckpointError as exc:
        assert "rank_00000.pt" in str(exc), f"the error does not name the file: {exc}"
    except Exception as exc:  # the defect under test: anything but a ckptguard error
        pytest.fail(f"restore with extras that are {extras} raised {type(exc).__name__}: {exc}")
    else:
        pytest.fail(f"restore accepted extras that are {extras}")


# ---------------------------------------------------------------- metadata that lists no tensors


def test_metadata_listing_no_tensors_fails_verify_and_preflight(root):
    from torch.distributed.checkpoint.metadata import Metadata

    step = root / "step_00000002"
    md = Metadata(state_dict_metadata={})
    md.storage_data = {}
    with open(step / "state" / ".metadata", "wb") as f:
        pickle.dump(md, f)  # what DCP writes, minus every tensor
    refresh_entry(step, "state/.metadata")
    result = cli("verify", step, "--deep")
    refused(result, "verify --deep of a step whose .metadata lists no tensors")
    result = cli("preflight", root)
    refused(result, "preflight of a step whose .metadata lists no tensors")


# ---------------------------------------------------------------- honest answers from verify


def test_verify_on_a_directory_without_a_checkpoint_fails_and_points_below(tmp_path, base_root):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = cli("verify", empty)
    refused(result, "verify of an empty directory")
    project = tmp_path / "project"
    project.mkdir()
    shutil.copytree(base_root, project / "ckptguard", symlinks=True)
    result = cli("verify", project)
    refused(result, "verify of a directory whose checkpoint root is one level below")
    assert str(project / "ckptguard") in result.output, (
        f"verify did not suggest the root {project / 'ckptguard'}\n{result.output}"
    )


def test_verify_never_claims_a_restore_it_skipped(root):
    shard = root / "step_00000002" / "state" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = cli("verify", root, "--deep", "--restore")
    assert result.exit_code == 1, result.output
    verdict = result.output.strip().splitlines()[-1]
    claims = "real restore" in verdict and not re.search(r"skip|not run", verdict, re.IGNORECASE)
    assert not claims, f"the checksum failed, the restore was skipped, yet: {verdict!r}"


# ---------------------------------------------------------------- a plain value whose type changed


def test_a_plain_value_whose_type_changed_is_restored_as_saved(tmp_path):
    """Plain values are replaced on restore: a float saved is a float restored, whatever
    placeholder the caller passes (here a 0-d tensor), and never a model/optimizer hint."""
    root = tmp_path / "ck"
    cg.CheckpointManager(root).save(1, {"w": torch.ones(4), "lr": 0.5})
    state = {"w": torch.zeros(4), "lr": torch.tensor(0.0)}
    try:
        step = cg.CheckpointManager(root).restore(state)
    except cg.CheckpointError as exc:
        assert "'lr'" in str(exc) and "model/optimizer" not in str(exc), (
            f"a plain value whose type changed is refused with a hint about model/optimizer: {exc}"
        )
        return
    assert step == 1 and state["lr"] == 0.5 and isinstance(state["lr"], float), (
        f"lr came back as {state['lr']!r}"
    )


# ---------------------------------------------------------------- a corrupted shard at restore


def test_a_corrupted_shard_is_named_at_restore(tmp_path):
    root = tmp_path / "ck"
    cg.CheckpointManager(root).save(1, {"w": torch.arange(4096, dtype=torch.float32)})
    (root / "lease.json").unlink()
    shard = root / "step_00000001" / "state" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40  # inside the tensor's bytes: DCP reads it without complaint
    shard.write_bytes(bytes(data))
    with pytest.raises(cg.CheckpointError) as info:
        cg.CheckpointManager(root).restore({"w": torch.zeros(4096)})
    msg = str(info.value)
    for needed in ("__0_0.distcp", "verify --deep", "restore(path="):
        assert needed in msg, f"the restore error lacks {needed!r}: {msg}"


# ---------------------------------------------------------------- demo --workdir


@pytest.mark.timeout(150)
def test_demo_refuses_a_non_empty_directory_it_did_not_create(tmp_path):
    mine = tmp_path / "mine"
    (mine / "src").mkdir(parents=True)
    (mine / "notes.txt").write_text("a week of notes")
    (mine / "src" / "train.py").write_text("print('hi')\n")
    cmd = [
        sys.executable,
        "-m",
        "ckptguard.cli",
        "demo",
        "--workdir",
        str(mine),
        "--world-size",
        "1",
        "--steps",
        "4",
        "--save-every",
        "1",
        "--kill-at",
        "2",
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        proc, output = None, "(still running after 120 s)"
    gone = [n for n in ("notes.txt", "src/train.py") if not (mine / n).exists()]
    assert not gone, f"demo --workdir wiped {gone} from a directory it did not create\n{output}"
    assert proc is not None and proc.returncode in (1, 2) and "Traceback" not in output, output


# ---------------------------------------------------------------- the README's usage


def test_the_readme_shows_plain_values_are_snapshots():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    usage = readme.split("## Usage", 1)[1].split("\n## ", 1)[0]
    code = "\n".join(re.findall(r"```python\n(.*?)```", usage, re.DOTALL))
    assert "snapshot" in usage.lower(), "the README's Usage does not say plain values are snapshots"
    assert re.search(r'state\["tokens"\]\s*[+]?=', code), (
        "the README's loop never refreshes state['tokens'] before save"
    )
    assert re.search(r'=\s*state\["tokens"\]', code), (
        "the README never reads state['tokens'] back after restore"
    )
    assert "prefetch" in usage.lower(), "the README shows no loop that prefetches its next batch"


# ---------------------------------------------------------------- the smaller honest answers


def test_mem_plan_with_toml_and_records_keeps_the_measured_terms(tmp_path):
    from click.testing import CliRunner

    from ckptguard.memory import PhaseKind, PhaseRecorder, RecorderConfig
    from ckptguard.memory.cli import mem

    records = tmp_path / "mem.jsonl"
    with (
        PhaseRecorder(RecorderConfig(path=records, probe_gpu=False)) as rec,
        rec.phase(PhaseKind.SAVE, step=7),
    ):
        (tmp_path / "shard.bin").write_bytes(b"\0" * (4 << 20))
    toml = tmp_path / "plan.toml"
    toml.write_text(
        '[limit]\nmemory_max = "480 GiB"\n[staging]\nranks = 8\nbytes_per_rank = "5 GiB"\n'
    )
    result = CliRunner().invoke(mem, ["plan", str(toml), "--from-records", str(records), "--json"])
    no_traceback(result, "mem plan with a TOML and records")
    plan = json.loads(result.output)
    measured = [t["name"] for t in plan["terms"] if t["measured"]]
    assert measured, f"with PLAN.toml and --from-records the measured terms were dropped: {plan}"
    assert plan["limit_base"] == 480 << 30 and not plan["limit_measured"], (
        f"the TOML's limit is labelled measured: {plan['limit_base']} {plan['limit_measured']}"
    )


def test_transfer_on_enospc_gives_a_clear_error(tmp_path):
    src = tiny_root(tmp_path / "src", (1,), mib=2)
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"mounting a small tmpfs is refused here ({mounted.stderr.decode().strip()})")
    try:
        result = cli("transfer", src / "step_00000001", small / "dest")
        refused(result, "transfer onto a full filesystem")
        assert "ENOSPC" in result.output or "No space" in result.output, result.output
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


def test_status_exits_1_with_a_stalled_rank(tmp_path):
    import socket

    stalled = subprocess.Popen(["sleep", "60"])
    try:
        now_ns, now = time.monotonic_ns(), time.time()

        def rec(kind: str, ago: float, **extra) -> dict:
            return {
                "v": 1,
                "kind": kind,
                "mono_ns": now_ns - int(ago * 1e9),
                "wall_time": now - ago,
                "node": socket.gethostname(),
                "rank": 0,
                "pid": stalled.pid,
                "phase": "save",
                "step": 40,
                **extra,
            }

        path = tmp_path / "phases.jsonl"
        lines = [
            rec("phase_start", 30),
            rec("phase_end", 29, duration_s=1.0),
            rec("phase_start", 12),
        ]
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))
        result = cli("status", path, "--sample", "0.2")
        no_traceback(result, "status with a stalled rank")
        assert "STALLED" in result.output, result.output
        assert result.exit_code == 1, f"status exits {result.exit_code} with a stalled rank"
    finally:
        stalled.kill()
        stalled.wait()


def test_verify_prints_a_readable_size_for_small_checkpoints(root):
    result = cli("verify", root)
    cost = [line for line in result.output.splitlines() if line.startswith("cost")]
    assert cost, result.output
    assert not any("0.000 GiB" in line for line in cost), f"{cost[0]!r}"
    assert all(re.search(r"\d(\.\d+)? ?(B|KiB|MiB|GiB|TiB)\b", line) for line in cost), cost


HASH_TWICE = """
import ckptguard as cg
first = cg.hash_imported_files(["ckptguard"])
# lazily imported by real runs
import ckptguard.cli, ckptguard.ops.transfer, ckptguard.memory.report
print(first == cg.hash_imported_files(["ckptguard"]))
print(repr(cg.hash_imported_files.__doc__))
"""


def test_hash_imported_files_does_not_depend_on_when_it_is_called():
    proc = run_py(HASH_TWICE)
    assert proc.returncode == 0, proc.stderr
    same, doc = proc.stdout.splitlines()[:2]
    documented = "after" in doc and "import" in doc and ("call" in doc or "when" in doc)
    assert same == "True" or documented, (
        f"hash_imported_files changed after lazy imports and its docstring names no call point: "
        f"{doc}"
    )


# ---------------------------------------------------------------- verify --restore memory

MEASURE = """
import json, resource, subprocess, sys
proc = subprocess.run([sys.executable, "-m", "ckptguard.cli", "verify", sys.argv[1], "--restore"],
                      capture_output=True, text=True)
print(json.dumps({"rc": proc.returncode, "out": proc.stdout[-3000:], "err": proc.stderr[-3000:],
                  "peak_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""

ITEMS, ITEM_MIB = 8, 48


@pytest.mark.timeout(200)
def test_verify_restore_holds_one_item_at_a_time(tmp_path):
    """Peak RSS of verify --restore (the largest of its processes) on a 384 MiB checkpoint of
    8 items, above the same command on a tiny checkpoint: bounded by far less than the whole."""
    big = tmp_path / "big"
    state = {f"t{i}": torch.randn(ITEM_MIB << 18) for i in range(ITEMS)}
    cg.CheckpointManager(big, config=cg.CheckpointConfig(retention=None)).save(1, state)
    del state
    small = tiny_root(tmp_path / "small", (1,))
    peaks = {}
    for name, root in (("small", small), ("big", big)):
        proc = run_py(MEASURE, root, timeout=180)
        out = json.loads(proc.stdout)
        assert out["rc"] == 0, (
            f"verify --restore of the {name} checkpoint failed:\n{out['out']}\n{out['err']}"
        )
        peaks[name] = out["peak_kib"] << 10
    ckpt = ITEMS * ITEM_MIB << 20
    extra = peaks["big"] - peaks["small"]
    assert extra < ckpt // 2, (
        f"verify --restore held {extra >> 20} MiB more for a {ckpt >> 20} MiB checkpoint than "
        f"for a tiny one (peaks {peaks['big'] >> 20} / {peaks['small'] >> 20} MiB): it "
        f"materialises the whole checkpoint"
    )


def test_helpers_build_real_checkpoints(root):
    """The scenes above start from committed steps that pass every check."""
    assert cli("verify", root, "--deep").exit_code == 0
    assert step_dir(root, 2).is_dir() and os.path.isfile(root / TRACKER)
