"""The read side: every read stays inside the root, is bounded, and bad input is one clear message.

One test (or one parametrised group) per rule: metadata storage paths stay in the step;
symlinks are refused; FIFOs and unbounded files hang nothing; huge sizes and deep JSON are
one finding; no command shows a traceback on malformed input; file names cannot forge output
lines; verify is honest; status, transfer on ENOSPC, units and the code hash; the restore
check stays within a host budget. Anything that could hang runs in a subprocess with a
timeout, so a hang fails fast.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptguard as cg
from ckptguard._disk import layout as _layout
from ckptguard._disk.digest import file_digest
from ckptguard._records import retention
from ckptguard._records.checks import verify_step
from ckptguard.cli import main
from ckptguard.errors import CheckpointError, UnsafeCheckpointError
from ckptguard.ops.verify import verify_root
from ckptguard.storage import DCPStorage, StreamingStorage, read_dcp_metadata
from cli_helper import run_cli

NAMING = _layout.StepNaming("step_{step:08d}")
TIMEOUT = 60  # seconds; a FIFO read blocks forever, so anything near this is a hang


def _state(value: float = 1.0) -> dict:
    return {
        "w": torch.full((16,), value),
        "b": torch.arange(4.0) + value,
        "meta": {"tokens": int(value)},
    }


def _save(root: Path, step: int = 1, value: float = 1.0) -> Path:
    cg.CheckpointManager(root).save(step, _state(value))
    # This test process is alive: its lease would refuse the other processes these tests start.
    (root / "lease.json").unlink()
    return root / NAMING.name(step)


def _cli(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """The real command line in a new process: a hang becomes a TimeoutExpired, not a stuck
    suite."""
    return run_cli(*args, timeout=timeout)


def _py(code: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def _no_traceback(result) -> None:
    text = result.output if hasattr(result, "exit_code") else result.stdout + result.stderr
    assert "Traceback" not in text, text
    if hasattr(result, "exit_code"):
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(
            result.exception
        )


def _fix_manifest_entry(step: Path, rel: str) -> None:
    """Rewrite the manifest's size and xxh3 of ``rel`` as a careful attacker would."""
    manifest = json.loads((step / "manifest.json").read_text())
    for f in manifest["files"]:
        if f["path"] == rel:
            f["size"], f["xxh3"] = file_digest(str(step / rel))
    (step / "manifest.json").write_text(json.dumps(manifest))


def _edit_manifest(step: Path, fn) -> None:
    manifest = json.loads((step / "manifest.json").read_text())
    fn(manifest)
    (step / "manifest.json").write_text(json.dumps(manifest))


# ---------------------------------------------------------------- metadata paths


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_metadata_storage_paths_leaving_the_step_are_refused(tmp_path, how):
    step = _save(tmp_path / "ck", value=1.0)
    other = _save(tmp_path / "other", value=7.0)  # same keys and shapes, other values
    state_dir = step / "state"
    md = read_dcp_metadata(state_dir)
    for index, info in list(md.storage_data.items()):
        target = other / "state" / info.relative_path
        rel = str(target) if how == "absolute" else os.path.relpath(target, state_dir)
        md.storage_data[index] = dataclasses.replace(info, relative_path=rel)
    with open(state_dir / ".metadata", "wb") as f:
        pickle.dump(md, f)
    _fix_manifest_entry(step, "state/.metadata")

    with pytest.raises(UnsafeCheckpointError, match="leaves"):
        read_dcp_metadata(state_dir)
    assert "unsafe-path" in [f.code for f in verify_step(step, deep=True)]
    out = _invoke("verify", tmp_path / "ck", "--deep", "--restore")
    assert out.exit_code == 1 and "unsafe-path" in out.output and "OK" not in out.output, out.output
    for storage in (DCPStorage(), StreamingStorage()):
        target = _state(0.0)
        with pytest.raises(CheckpointError, match="leaves"):
            cg.CheckpointManager(tmp_path / "ck", storage=storage).restore(target)
        assert not torch.equal(
            target["w"], torch.full((16,), 7.0)
        )  # nothing came from the other root


# ---------------------------------------------------------------- symlinks


def test_symlinked_tracker_is_refused_and_never_printed(tmp_path):
    root = tmp_path / "ck"
    _save(root)
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:SECRET-LINE:/root:/bin/bash\n")
    tracker = root / _layout.TRACKER_NAME
    tracker.unlink()
    tracker.symlink_to(secret)
    for args in (["resolve", root], ["verify", root], ["preflight", root], ["list", root]):
        out = _invoke(*args)
        assert out.exit_code == 1, (args, out.output)
        assert "SECRET" not in out.output and "symlink" in out.output, (args, out.output)
        _no_traceback(out)
    with pytest.raises(UnsafeCheckpointError, match="symlink"):
        cg.CheckpointManager(root).restore(_state(0.0))
    # A link to a well-formed tracker elsewhere is refused just the same: it is not this root's.
    secret.write_text("1\n")
    assert _invoke("resolve", root).exit_code == 1
    with pytest.raises(UnsafeCheckpointError):
        cg.CheckpointManager(root).save(2, _state(2.0))
    assert secret.read_text() == "1\n"


def test_symlinked_step_directory_is_refused_by_verify_resolve_preflight_restore(tmp_path):
    root = tmp_path / "ck"
    step = _save(root)
    real = tmp_path / "elsewhere" / step.name
    real.parent.mkdir()
    shutil.move(str(step), str(real))
    step.symlink_to(real, target_is_directory=True)
    for args in (["verify", step], ["verify", root], ["resolve", root], ["preflight", root]):
        out = _invoke(*args)
        assert out.exit_code == 1 and "symlink" in out.output, (args, out.output)
        _no_traceback(out)
    with pytest.raises(UnsafeCheckpointError, match="symlink"):
        cg.CheckpointManager(root).restore(_state(0.0))
    with pytest.raises(UnsafeCheckpointError, match="symlink"):
        cg.CheckpointManager(root).restore(_state(0.0), path=step)


def test_symlinked_manifest_is_refused(tmp_path):
    root = tmp_path / "ck"
    step = _save(root)
    copy = tmp_path / "manifest-copy.json"
    shutil.copy(step / "manifest.json", copy)
    (step / "manifest.json").unlink()
    (step / "manifest.json").symlink_to(copy)
    out = _invoke("verify", step)
    assert out.exit_code == 1 and "symlink" in out.output, out.output
    assert _invoke("resolve", root).exit_code == 1
    with pytest.raises(UnsafeCheckpointError):
        cg.CheckpointManager(root).restore(_state(0.0))


def test_symlinked_proof_and_holds_directories_are_refused(tmp_path):
    root = tmp_path / "ck"
    _save(root)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.rmtree(root / _layout.PROOF_DIR)
    (root / _layout.PROOF_DIR).symlink_to(outside, target_is_directory=True)
    (outside / "rank_00000.jsonl").write_text(
        json.dumps({"event": "restore", "pid": 1, "rank": 0}) + "\n"
    )
    out = _invoke("prove", root)
    assert out.exit_code == 1 and "symlink" in out.output, out.output
    _no_traceback(out)
    from ckptguard._records.proofwriter import ProofLog

    before = (outside / "rank_00000.jsonl").read_text()
    with pytest.raises(UnsafeCheckpointError):
        ProofLog(root, 0).append("save", step=1)
    target = _state(0.0)
    assert (
        cg.CheckpointManager(root).restore(target) == 1
    )  # the proof record is refused and logged, not fatal
    assert torch.equal(target["w"], _state(1.0)["w"])
    assert (outside / "rank_00000.jsonl").read_text() == before  # nothing written through the link
    (root / retention.HOLDS_DIR).symlink_to(outside, target_is_directory=True)
    with pytest.raises(UnsafeCheckpointError):
        retention.hold(root, 1, "eval")
    assert not (outside / "1.json").exists()
    with pytest.raises(UnsafeCheckpointError):
        retention.holds(root)
    found = _invoke("verify", root)
    assert found.exit_code == 1 and "holds" in found.output and "proof" in found.output, (
        found.output
    )


# ---------------------------------------------------------------- FIFOs and unbounded reads


def test_fifo_tracker_hangs_nothing(tmp_path):
    root = tmp_path / "ck"
    _save(root)
    tracker = root / _layout.TRACKER_NAME
    tracker.unlink()
    os.mkfifo(tracker)
    for args in (
        ["resolve", root],
        ["verify", root],
        ["preflight", root],
        ["list", root],
        ["gc", root, "--dry-run"],
    ):
        proc = _cli(*map(str, args))
        assert proc.returncode == 1, (args, proc.stdout, proc.stderr)
        assert "not a regular file" in proc.stdout + proc.stderr, (args, proc.stdout, proc.stderr)
        _no_traceback(proc)
    for call in ("restore(_s())", "save(2, _s())"):
        proc = _py(f"""
            import torch, ckptguard as cg
            def _s(): return {{"w": torch.zeros(16), "b": torch.zeros(4), "meta": {{}}}}
            try:
                cg.CheckpointManager({str(root)!r}).{call}
            except cg.CheckpointError as exc:
                print("refused:", exc)
        """)
        assert "refused:" in proc.stdout and "not a regular file" in proc.stdout, (
            call,
            proc.stdout,
            proc.stderr,
        )


@pytest.mark.parametrize("name", ["manifest", "lease", "hold", "proof", "owner"])
def test_fifo_small_files_hang_nothing(tmp_path, name):
    root = tmp_path / "ck"
    step = _save(root)
    if name == "manifest":
        (step / "manifest.json").unlink()
        os.mkfifo(step / "manifest.json")
        runs = [["verify", root], ["resolve", root], ["preflight", root]]
    elif name == "lease":
        os.mkfifo(root / "lease.json")
        runs = [["gc", root]]
    elif name == "hold":
        (root / retention.HOLDS_DIR).mkdir()
        os.mkfifo(root / retention.HOLDS_DIR / "1.json")
        runs = []  # read by rotation, after the save below
    elif name == "proof":
        for p in (root / _layout.PROOF_DIR).glob("*"):
            p.unlink()
        os.mkfifo(root / _layout.PROOF_DIR / "rank_00000.jsonl")
        runs = [["prove", root]]
    else:
        tmp = root / ".tmp-step_00000002-abc"
        tmp.mkdir()
        os.mkfifo(tmp / _layout.OWNER_NAME)
        runs = [["gc", root, "--dry-run"], ["verify", root]]
    for args in runs:
        proc = _cli(*map(str, args))  # a hang raises TimeoutExpired
        _no_traceback(proc)
        assert proc.returncode in (0, 1), (args, proc.stdout, proc.stderr)
    if name in ("lease", "hold"):
        proc = _py(f"""
            import torch, ckptguard as cg
            try:
                cg.CheckpointManager({str(root)!r}).save(
                    2, {{"w": torch.zeros(16), "b": torch.zeros(4), "meta": {{}}}}
                )
                print("saved")
            except cg.CheckpointError as exc:
                print("refused:", exc)
        """)
        assert "saved" in proc.stdout or "refused:" in proc.stdout, (proc.stdout, proc.stderr)


def test_tracker_reads_are_bounded(tmp_path):
    root = tmp_path / "ck"
    _save(root)
    tracker = root / _layout.TRACKER_NAME
    tracker.unlink()
    tracker.symlink_to("/dev/zero")
    proc = _cli("resolve", str(root), timeout=20)
    assert proc.returncode == 1 and "symlink" in proc.stderr, proc.stderr
    tracker.unlink()
    with open(
        tracker, "wb"
    ) as f:  # a regular but huge tracker: refused by its size, never read whole
        f.truncate(64 << 20)
    out = _invoke("resolve", root)
    assert out.exit_code == 1 and "bytes" in out.output, out.output


# ---------------------------------------------------------------- sizes, depth, one bad step


def test_a_huge_world_size_is_one_fast_finding(tmp_path):
    root = tmp_path / "ck"
    step = _save(root)
    _edit_manifest(step, lambda m: m["topology"].update(world_size=10**8))
    t0 = time.monotonic()
    out = _invoke("verify", root, "--json")
    assert out.exit_code == 1, out.output
    findings = json.loads(out.output)["findings"]
    assert len(findings) <= 2 and any("world_size" in f["message"] for f in findings), findings
    assert _invoke("preflight", root).exit_code == 1
    moved = _invoke("transfer", step, tmp_path / "dest")
    assert moved.exit_code == 1 and "Traceback" not in moved.output, moved.output
    assert time.monotonic() - t0 < 30


def test_missing_ranks_are_counted_not_enumerated(tmp_path):
    root = tmp_path / "ck"
    step = _save(root)
    _edit_manifest(step, lambda m: m["topology"].update(world_size=5000))
    found = [f for f in verify_step(step) if f.code == "missing-rank"]
    assert len(found) == 1 and "4999 of 5000" in found[0].message, [f.line() for f in found]


def test_deep_json_is_a_finding_never_a_crash(tmp_path, caplog):
    deep = "[" * 200_000 + "]" * 200_000
    root = tmp_path / "ck"
    step = _save(root)
    _save(root, 2)
    (root / retention.HOLDS_DIR).mkdir()
    (root / retention.HOLDS_DIR / "1.json").write_text(deep)
    held = retention.holds(
        root
    )  # a warning, not a RecursionError; and still held (an unreadable hold protects)
    assert list(held) == [1] and held[1].startswith("UNREADABLE")
    report = retention.apply(root, NAMING, retention.KeepLast(5))
    assert report.deleted == []
    (step / "manifest.json").write_text(deep)
    out = _invoke("verify", root)
    assert out.exit_code == 1 and "bad-manifest" in out.output and "deeper" in out.output, (
        out.output
    )
    _no_traceback(out)
    assert "step_00000002" not in "".join(
        line for line in out.output.splitlines() if line.startswith("ERROR")
    )
    assert _invoke("preflight", root).exit_code == 0  # the tracker's step is fine
    (root / "contract" / "phase_0000.json").write_text(deep)
    with pytest.raises(CheckpointError, match="deeper"):
        cg.CheckpointManager(root).save(3, _state(3.0))


def test_one_bad_step_is_one_finding(tmp_path):
    root = tmp_path / "ck"
    _save(root, 1)
    _save(root, 2)
    _edit_manifest(root / "step_00000001", lambda m: m.update(files=[1, 2, 3]))
    checked, found = verify_root(root, NAMING)
    assert [f.code for f in found if f.severity.value == "ERROR"] == ["bad-manifest"], [
        f.line() for f in found
    ]
    assert len(checked) == 2
    loop = root / "step_00000002" / "state" / "loop"
    loop.symlink_to(loop)
    checked, found = verify_root(root, NAMING)
    assert {f.path for f in found if f.code == "unexpected-file"} == {str(loop)}
    assert retention.apply(root, NAMING, retention.KeepLast(5)).deleted == []


# ---------------------------------------------------------------- no traceback from any command


def _malformed_root(tmp_path: Path, what: str) -> Path:
    root = tmp_path / "ck"
    step = _save(root)
    if what == "manifest-files":
        _edit_manifest(step, lambda m: m.update(files="state/__0_0.distcp"))
    elif what == "manifest-items":
        _edit_manifest(step, lambda m: m.update(items=["w"]))
    elif what == "manifest-topology":
        _edit_manifest(step, lambda m: m.update(topology={"world": 1}))
    elif what == "manifest-utf8":
        (step / "manifest.json").write_bytes(b'{"format_version": 1, "step": "\xff\xfe"}')
    elif what == "tracker-utf8":
        (root / _layout.TRACKER_NAME).write_bytes(b"\xff\xfe1\n")
    elif what == "proof":
        (root / _layout.PROOF_DIR / "rank_00000.jsonl").write_text(
            '{"pid": 3}\n[1, 2]\n{"event": "x"}\n'
        )
    elif what == "proof-utf8":
        (root / _layout.PROOF_DIR / "rank_00000.jsonl").write_bytes(b'{"event": "\xff"}\n{}\n')
    elif what == "extras":
        torch.save({"items": {}}, step / "rank_00000.pt")
        _fix_manifest_entry(step, "rank_00000.pt")
    elif what == "metadata-name":
        md = read_dcp_metadata(step / "state")
        for index, info in list(md.storage_data.items()):
            md.storage_data[index] = dataclasses.replace(info, relative_path="data.bin")
        with open(step / "state" / ".metadata", "wb") as f:
            pickle.dump(md, f)
        _fix_manifest_entry(step, "state/.metadata")
    return root


def _records(tmp_path: Path, what: str) -> Path:
    path = tmp_path / "phases.jsonl"
    if what == "records-utf8":
        path.write_bytes(b'{"v": 1, "kind": "phase_start", "mono_ns": 1, "note": "\xff"}\n')
    elif what == "no-pid":
        path.write_text(
            json.dumps({"v": 1, "kind": "phase_start", "mono_ns": 1, "rank": 0, "phase": "save"})
            + "\n"
        )
    else:
        path.write_text(
            json.dumps(
                {
                    "v": 1,
                    "kind": "phase_start",
                    "mono_ns": 1,
                    "rank": 0,
                    "pid": "x",
                    "wall_time": "y",
                    "node": "n",
                    "phase": "save",
                }
            )
            + "\n"
        )
    return path


CLI_CASES = {
    "resolve": [
        ("manifest-files", ["resolve", "{root}"]),
        ("tracker-utf8", ["resolve", "{root}"]),
        ("manifest-utf8", ["resolve", "{root}", "--json"]),
        ("manifest-topology", ["resolve", "{root}"]),
    ],
    # `list` reports each step's state; a malformed manifest is a listed "NOT committed", exit 0.
    "list": [
        ("tracker-utf8", ["list", "{root}"]),
        ("manifest-items", ["list", "{root}"], "NOT committed"),
    ],
    "verify": [
        ("manifest-files", ["verify", "{root}"]),
        ("manifest-items", ["verify", "{root}", "--restore"]),
        ("extras", ["verify", "{root}", "--restore"]),
        ("manifest-topology", ["verify", "{step}"]),
        ("metadata-name", ["verify", "{root}", "--restore"]),
        ("tracker-utf8", ["verify", "{root}"]),
    ],
    "preflight": [
        ("manifest-files", ["preflight", "{root}"]),
        ("manifest-topology", ["preflight", "{root}"]),
        ("tracker-utf8", ["preflight", "{root}", "--json"]),
    ],
    "prove": [("proof", ["prove", "{root}"]), ("proof-utf8", ["prove", "{root}", "--json"])],
    "status": [
        ("no-pid", ["status", "{records}"]),
        ("bad-types", ["status", "{records}", "--json"]),
    ],
    "gc": [("tracker-utf8", ["gc", "{root}", "--dry-run"])],
    "hold": [
        ("manifest-items", ["hold", "{root}", "1", "--reason", "eval"]),
        ("tracker-utf8", ["hold", "{root}", "1", "--reason", "eval"]),
    ],
    "release": [("none", ["release", "{root}", "3"])],
    "transfer": [
        ("manifest-files", ["transfer", "{step}", "{dest}"]),
        ("manifest-topology", ["transfer", "{step}", "{dest}"]),
    ],
    "adopt": [
        ("manifest-items", ["adopt", "{root}", "1"]),
        ("tracker-utf8", ["adopt", "{root}", "1"]),
    ],
    "demo": [("none", ["demo", "--workdir", "{file}"])],
    "repro-save": [
        ("none", ["repro-save", "--target", "{file}", "--rounds", "1", "--size", "0.0001"])
    ],
    "rehearse": [
        (
            "none",
            ["rehearse", "--root", "{file}", "--timeout", "5", "--", sys.executable, "-c", "pass"],
        )
    ],
    "mem": [("records-utf8", ["mem", "report", "{records}"])],
    "export": [
        ("manifest-files", ["export", "{root}", "--hf", "{dest}"]),
        ("tracker-utf8", ["export", "{root}", "--hf", "{dest}", "--json"]),
        ("metadata-name", ["export", "{step}", "--hf", "{dest}"]),
    ],
    "goodput": [("proof", ["goodput", "{root}"]), ("proof-utf8", ["goodput", "{root}", "--json"])],
}


def test_every_command_has_a_malformed_input_case():
    import click

    assert set(CLI_CASES) == set(
        main.list_commands(click.Context(main))
    )  # mem included: it is imported lazily


@pytest.mark.parametrize(
    ("what", "argv", "listed"),
    [(*case, None)[:3] for cases in CLI_CASES.values() for case in cases],
    ids=lambda v: str(v)[:40],
)
def test_malformed_input_is_a_message_never_a_traceback(tmp_path, what, argv, listed):
    record_cases = ("no-pid", "bad-types", "records-utf8")
    root = tmp_path if what in record_cases else _malformed_root(tmp_path, what)
    records = _records(tmp_path, what) if what in record_cases else tmp_path / "none.jsonl"
    plain = tmp_path / "a-file"
    plain.write_text("not a directory\n")
    fill = {
        "root": root,
        "step": root / "step_00000001",
        "dest": tmp_path / "dest",
        "records": records,
        "file": plain,
    }
    args = [a.format(**fill) if a.startswith("{") else a for a in argv]
    proc = _cli(*args, timeout=120)
    _no_traceback(proc)
    text = proc.stdout + proc.stderr
    if listed is not None:
        assert proc.returncode == 0 and listed in text, (args, proc.returncode, text)
        return
    assert proc.returncode in (1, 2), (args, proc.returncode, proc.stdout, proc.stderr)
    assert "error" in text.lower() or "FAIL" in text or "ERROR" in text or "NOT READY" in text, text


# ---------------------------------------------------------------- escaped names


def test_file_names_cannot_forge_verify_lines(tmp_path):
    root = tmp_path / "ck"
    step = _save(root)
    forged = "x\nOK: 9 step(s) checked, 0 finding(s)\x1b[2K\x1b[1A"
    (step / "state" / forged).write_bytes(b"1")
    (step / "state" / os.fsdecode(b"bad-\xff-name")).write_bytes(b"1")
    (step / "state" / "rtl\u202eevil").write_bytes(b"1")
    out = _invoke("verify", root)
    assert out.exit_code == 1
    lines = out.output.splitlines()
    assert not any(line.startswith("OK: 9") for line in lines), out.output
    assert "\x1b" not in out.output and "\u202e" not in out.output and "\\x1b" in out.output
    assert sum("unexpected-file" in line for line in lines) == 3
    _no_traceback(out)
    tmp = root / ".tmp-\x1b[31mred\nline"
    tmp.mkdir()
    listing = _invoke("list", root)
    assert "\x1b" not in listing.output and listing.exit_code == 0, listing.output


# ---------------------------------------------------------------- honest verify


def test_verify_of_a_directory_without_a_checkpoint_fails_and_suggests_the_root(tmp_path):
    empty = tmp_path / "run"
    empty.mkdir()
    out = _invoke("verify", empty)
    assert out.exit_code == 1 and "no checkpoint" in out.output, out.output
    _save(empty / "outputs" / "ckptguard")
    out = _invoke("verify", empty)
    assert out.exit_code == 1 and str(empty / "outputs" / "ckptguard") in out.output, out.output
    verl = tmp_path / "verl"
    _save(verl)
    (verl / "step_00000001").rename(verl / "global_step_1")
    out = _invoke("verify", verl)
    assert out.exit_code == 1 and "--template" in out.output, out.output


def test_verify_restore_never_claims_a_skipped_restore(tmp_path):
    root = tmp_path / "ck"
    step = _save(root)
    (step / "state" / "stray").write_bytes(b"1")
    out = _invoke("verify", root, "--deep", "--restore")
    assert out.exit_code == 1
    assert "a real restore" not in out.output and "restore skipped" in out.output, out.output
    (step / "state" / "stray").unlink()
    out = _invoke("verify", root, "--deep", "--restore")
    assert out.exit_code == 0 and "a real restore" in out.output, out.output


# ---------------------------------------------------------------- status, ENOSPC, units, code hash


def _phase(kind: str, rank: int, pid: int, ago_s: float, **extra) -> dict:
    import socket

    return {
        "v": 1,
        "kind": kind,
        "mono_ns": time.monotonic_ns() - int(ago_s * 1e9),
        "wall_time": time.time() - ago_s,
        "node": socket.gethostname(),
        "rank": rank,
        "pid": pid,
        "phase": "save",
        "step": 40,
        **extra,
    }


def test_status_exits_1_with_a_stalled_rank(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        path = tmp_path / "phases.jsonl"
        recs = [
            _phase("phase_start", 0, sleeper.pid, 30),
            _phase("phase_end", 0, sleeper.pid, 29, duration_s=1.0),
            _phase("phase_start", 0, sleeper.pid, 12),
        ]
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        out = _invoke("status", path, "--sample", "0.2")
        assert "STALLED" in out.output and out.exit_code == 1, out.output
        js = _invoke("status", path, "--sample", "0.2", "--json")
        assert js.exit_code == 1 and json.loads(js.output)[0]["verdict"].startswith("STALLED")
        fine = [_phase("phase_start", 0, sleeper.pid, 0.1)]
        path.write_text("".join(json.dumps(r) + "\n" for r in fine))
        assert _invoke("status", path, "--sample", "0.2").exit_code == 0
    finally:
        sleeper.kill()
        sleeper.wait()


def test_transfer_on_enospc_is_a_clear_error(tmp_path, monkeypatch):
    cg.CheckpointManager(tmp_path / "ck").save(1, {"w": torch.zeros(64 << 10)})  # 256 KiB of state
    step = tmp_path / "ck" / "step_00000001"
    mnt = tmp_path / "small"
    mnt.mkdir()
    # A real full filesystem where we may mount one (root in a container), else the same errno
    # raised by the copy itself.
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True
        ).returncode
        == 0
    )
    if not mounted:
        from ckptguard.ops import transfer as _t

        def full(src, dst, **kw):
            raise OSError(28, "No space left on device", str(dst))

        monkeypatch.setattr(_t, "_copy_verified", full)
    try:
        out = _invoke("transfer", step, mnt / "dest")
        assert out.exit_code == 1, out.output
        assert "No space left" in out.output and "ENOSPC" in out.output, out.output
        _no_traceback(out)
        assert not list((mnt / "dest").glob(".tmp-*"))  # the partial copy is gone
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=True)


def test_verify_prints_readable_units(tmp_path):
    mgr = cg.CheckpointManager(tmp_path / "ck")
    mgr.save(1, _state())
    time.sleep(0.05)
    mgr.save(2, _state())
    out = _invoke("verify", tmp_path / "ck")
    assert "0.000 GiB" not in out.output and "KiB" in out.output, out.output


def test_hash_imported_files_does_not_depend_on_when_it_is_called(tmp_path):
    pkg = tmp_path / "lazypkg_s15"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    (pkg / "later.py").write_text("Y = 2\n")
    code = f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import ckptguard as cg
        import lazypkg_s15
        first = cg.hash_imported_files(["lazypkg_s15"])
        import lazypkg_s15.later
        print(first, cg.hash_imported_files(["lazypkg_s15"]))
    """
    a, b = _py(code).stdout.split()
    assert a == b
    (pkg / "later.py").write_text("Y = 3\n")
    c, _ = _py(code).stdout.split()
    assert c != a  # a change in a lazily imported module still changes the code hash


# ---------------------------------------------------------------- bounded restore check


_RSS = """
import resource, runpy, sys
sys.argv = ["_offline", *sys.argv[1:]]
try:
    runpy.run_module("ckptguard.ops._offline", run_name="__main__")
finally:
    print("maxrss_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


def _offline_rss(step: Path, *extra: str) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-c", _RSS, str(step), *extra], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    rss = int(proc.stderr.rsplit("maxrss_kib", 1)[1].split()[0])
    return rss << 10, proc.stdout


def test_restore_check_stays_within_a_host_budget(tmp_path):
    tiny = _save(tmp_path / "tiny")
    big = {f"t{i}": torch.randn(12 << 20) for i in range(4)}  # 4 x 48 MiB
    cg.CheckpointManager(tmp_path / "big").save(1, big)
    del big
    base, _ = _offline_rss(tiny)
    used, out = _offline_rss(tmp_path / "big" / "step_00000001", "--budget-bytes", str(16 << 20))
    result = json.loads(out.strip().splitlines()[-1])[
        "result"
    ]  # one line per step: {"step_dir", "result"}
    assert result["ranks"]["0"] and not result["unverifiable"]
    # The largest tensor is 48 MiB and the whole state 192 MiB: one tensor at a time, plus the
    # reader's pool.
    assert used - base < 120 << 20, (used >> 20, base >> 20)
    assert result["peak_tensor_bytes"] <= 48 << 20
    cli = _invoke("verify", tmp_path / "big", "--restore")
    assert cli.exit_code == 0 and "a real restore" in cli.output, cli.output


def test_the_streamed_digest_equals_the_digest_of_the_rebuilt_item():
    from ckptguard._disk.digest import digest
    from ckptguard._state.state import TENSOR_REF, _unflatten
    from ckptguard.ops._offline import skeleton_digest

    tensors = {
        "a": torch.arange(6.0).reshape(2, 3),
        "b": torch.ones(2, dtype=torch.int8),
        "c": torch.tensor(3.5),
    }
    skeleton = {
        "x": {TENSOR_REF: "a"},
        2: [{TENSOR_REF: "b"}, 1.5, ("t", {TENSOR_REF: "c"})],
        "n": None,
        "s": {"lr": 0.1, "ids": [1, 2]},
    }
    fetched = []
    assert skeleton_digest(skeleton, lambda k: fetched.append(k) or tensors[k]) == digest(
        _unflatten(skeleton, tensors)
    )
    assert sorted(fetched) == ["a", "b", "c"]
