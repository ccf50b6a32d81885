"""Nothing outside the root is read or written, and nothing hangs.

DCP ``.metadata`` whose paths leave the step is refused by verify and restore; a symlinked
step directory, tracker, manifest, proof or holds directory is refused, never followed; a
FIFO, a device or an absurd world size where a small file belongs fails fast with the file's
name; file names cannot forge verify's output lines. (tests/storage/test_readside.py guards the same
read side with its own cases.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import secrets
import shutil
import stat
import sys
from pathlib import Path

import pytest
import torch

import ckptguard as cg
from ckptguard.demo.toyjob import build_job, train_step
from damage_helper import (
    MANIFEST,
    TRACKER,
    cli,
    no_traceback,
    refresh_entry,
    refused,
    rewrite_manifest,
    tiny_root,
)

# ---------------------------------------------------------------- absolute paths in DCP metadata


@pytest.fixture(scope="module")
def outside_metadata(tmp_path_factory):
    """A committed step whose DCP ``.metadata`` points every tensor at a copy outside the step.

    Written with DCP's own classes and pickle, as DCP writes it. The in-tree decoy (the same
    bytes under ``state/<absolute path>``) and the manifest entries for it make every size,
    listing and checksum check pass, so only confinement of metadata paths can catch it.
    """
    root = tmp_path_factory.mktemp("absmeta") / "ck"
    job = build_job()
    train_step(job)
    cg.CheckpointManager(root).save(1, job.state())
    (root / "lease.json").unlink()
    # A directory name without '_' (DCP names files __R_I.distcp and readers split on '_').
    outside = Path("/tmp") / f"ckptguard-outside-{secrets.token_hex(6)}"
    outside.mkdir()
    step = root / "step_00000001"
    state = step / "state"
    shutil.copy(state / "__0_0.distcp", outside / "__0_0.distcp")
    target = str(outside / "__0_0.distcp")
    decoy = state / target.lstrip("/")
    decoy.parent.mkdir(parents=True)
    shutil.copy(state / "__0_0.distcp", decoy)
    with open(state / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, just written by DCP
    md.storage_data = {
        k: dataclasses.replace(v, relative_path=target) for k, v in md.storage_data.items()
    }
    with open(state / ".metadata", "wb") as f:
        pickle.dump(md, f)
    refresh_entry(step, "state/.metadata")
    entry = next(
        f
        for f in json.loads((step / MANIFEST).read_text())["files"]
        if f["path"] == "state/__0_0.distcp"
    )

    def add(m: dict) -> None:
        for rel in ("state/" + target, "state/" + target.lstrip("/")):
            m["files"].append({**entry, "path": rel})

    rewrite_manifest(step, add)
    yield root, outside
    shutil.rmtree(outside, ignore_errors=True)


def test_verify_refuses_metadata_paths_outside_the_step(outside_metadata):
    root, outside = outside_metadata
    result = cli("verify", root, "--deep", "--restore")
    refused(
        result, f"verify --deep --restore of a step whose .metadata reads tensors from {outside}"
    )
    assert ".metadata" in result.output, f"the finding does not name .metadata\n{result.output}"


@pytest.mark.parametrize("storage", ["DCPStorage", "StreamingStorage"])
def test_restore_refuses_metadata_paths_outside_the_step(outside_metadata, storage):
    root, outside = outside_metadata
    mgr = cg.CheckpointManager(root, storage=getattr(cg, storage)())
    with pytest.raises(cg.CheckpointError) as info:
        mgr.restore(build_job(seed=4).state())
        pytest.fail(f"{storage} restored tensor data from {outside}, outside the step directory")
    assert ".metadata" in str(info.value), f"the refusal does not name .metadata: {info.value}"


# ---------------------------------------------------------------- symlinks are refused


@pytest.fixture
def linked_step(tmp_path):
    """The tracker's step directory is a symlink to a real, complete step elsewhere."""
    root = tiny_root(tmp_path / "ck", (1, 2))
    real = tmp_path / "elsewhere" / "step_00000002"
    real.parent.mkdir()
    shutil.move(root / "step_00000002", real)
    os.symlink(real, root / "step_00000002")
    return root


@pytest.mark.parametrize("command", ["verify STEP", "resolve", "preflight"])
def test_a_symlinked_step_directory_is_refused(linked_step, command):
    target = linked_step / "step_00000002" if command == "verify STEP" else linked_step
    result = cli(command.split()[0], target)
    refused(result, f"{command} read through the symlinked step directory step_00000002")
    assert "link" in result.output.lower(), f"{command} does not say it is a link\n{result.output}"


def test_restore_refuses_a_symlinked_step_directory(linked_step):
    with pytest.raises(cg.CheckpointError, match="link"):
        cg.CheckpointManager(linked_step).restore({"w": torch.zeros(4)})
        pytest.fail("restore read step 2 through a symlinked step directory")


SECRET = "SECRET-do-not-print-4f1c"


def test_a_symlinked_tracker_is_not_read(tmp_path):
    root = tiny_root(tmp_path / "ck", (1,))
    secret = tmp_path / "passwd"
    secret.write_text(f"{SECRET}:x:0:0:root:/root:/bin/bash\n")
    (root / TRACKER).unlink()
    os.symlink(secret, root / TRACKER)
    for args in (("resolve", root), ("verify", root), ("list", root)):
        result = cli(*args)
        no_traceback(result, f"{args[0]} with a symlinked tracker")
        assert SECRET not in result.output, (
            f"`{args[0]}` read the file the tracker links to and printed it\n{result.output}"
        )
    assert cli("resolve", root).exit_code == 1, "resolve accepted a symlinked tracker"


def test_a_symlinked_manifest_is_refused(tmp_path):
    root = tiny_root(tmp_path / "ck", (1,))
    step = root / "step_00000001"
    real = tmp_path / "manifest-copy.json"
    shutil.move(step / MANIFEST, real)
    os.symlink(real, step / MANIFEST)
    for args in (("verify", step), ("resolve", root)):
        result = cli(*args)
        refused(result, f"{args[0]} read the step's manifest.json through a symlink")


@pytest.mark.parametrize("link", ["proof", "holds"])
def test_writes_never_go_through_a_symlinked_directory(tmp_path, link):
    root = tiny_root(tmp_path / "ck", (1,))
    outside = tmp_path / f"outside-{link}"
    outside.mkdir()
    shutil.rmtree(root / link, ignore_errors=True)
    os.symlink(outside, root / link)
    if link == "proof":
        with contextlib.suppress(cg.CheckpointError):  # refusing the root is fine too
            cg.CheckpointManager(root).restore({"w": torch.zeros(4)})  # appends a proof record
    else:
        no_traceback(
            cli("hold", root, "1", "--reason", "evaluation"), "hold with a symlinked holds/"
        )
    assert not list(outside.iterdir()), (
        f"ckptguard wrote {[p.name for p in outside.iterdir()]} through the symlink {link}/ "
        f"into {outside}"
    )


# ---------------------------------------------------------------- names that forge lines


def test_file_names_cannot_forge_verify_output(tmp_path):
    root = tiny_root(tmp_path / "ck", (1,))
    forged = "x\nOK: 1 step(s) checked, 0 finding(s)\x1b[2K\x1b[1A"
    (root / "step_00000001" / forged).write_bytes(b"x")
    result = cli("verify", root)
    no_traceback(result, "verify with a forged file name")
    assert result.exit_code == 1
    assert not [line for line in result.output.splitlines() if line.startswith("OK:")], (
        f"a file name forged an 'OK:' line in verify's output\n{result.output}"
    )
    assert "\x1b" not in result.output, f"an ANSI escape reached the terminal: {result.output!r}"


# ---------------------------------------------------------------- nothing hangs or spins

PROBE_LIMIT_S = 6
PROBES = """
import json, resource, signal, sys, time
from pathlib import Path

# A command that reads /dev/zero or builds 10**8 findings must fail here, not eat the machine.
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


class Hung(BaseException):
    pass


def _alarm(*_):
    raise Hung()


signal.signal(signal.SIGALRM, _alarm)
import torch
import ckptguard as cg
from click.testing import CliRunner
from ckptguard.cli import main

spec = json.loads(Path(sys.argv[1]).read_text())
warm = Path(spec["warm"])  # first-use imports and allocations, outside every probe's budget
cg.CheckpointManager(warm).save(1, {"w": torch.ones(4)})
cg.CheckpointManager(warm).restore({"w": torch.zeros(4)})
CliRunner().invoke(main, ["verify", str(warm)])
out = {}
for name, probe in spec["probes"].items():
    t0 = time.monotonic()
    res = {}
    signal.alarm(spec["limit_s"])
    try:
        if probe["kind"] == "cli":
            r = CliRunner().invoke(main, probe["args"])
            exc = r.exception
            res = {"exit": r.exit_code, "output": r.output[-4000:]}
            if exc is not None and not isinstance(exc, SystemExit):
                res["exception"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        else:
            mgr = cg.CheckpointManager(probe["root"])
            try:
                if probe["kind"] == "save":
                    mgr.save(5, {"w": torch.ones(4)})
                else:
                    mgr.restore({"w": torch.zeros(4)})
                res = {"outcome": "succeeded"}
            except Exception as exc:
                res = {"outcome": "raised", "type": type(exc).__name__, "message": str(exc)[:2000],
                       "clear": isinstance(exc, cg.CheckpointError)}
    except Hung:
        res = {"hung": True}
    except MemoryError:
        res = {"exception": "MemoryError"}
    finally:
        signal.alarm(0)
    res["seconds"] = round(time.monotonic() - t0, 2)
    out[name] = res
    Path(sys.argv[2]).write_text(json.dumps(out))  # partial results survive a crash
"""


def _scenes(base: Path) -> dict[str, dict]:
    """Roots with a FIFO, a device or an absurd world size where a small regular file belongs."""
    probes: dict[str, dict] = {}

    def cli_probe(name: str, *args: object) -> None:
        probes[name] = {"kind": "cli", "args": [str(a) for a in args]}

    fifo_tracker = tiny_root(base / "fifo-tracker", (1, 2))
    (fifo_tracker / TRACKER).unlink()
    os.mkfifo(fifo_tracker / TRACKER)
    for command in ("resolve", "list", "verify", "preflight", "gc"):
        cli_probe(f"fifo tracker: {command}", command, fifo_tracker)
    cli_probe("fifo tracker: hold", "hold", fifo_tracker, 1, "--reason", "eval")
    probes["fifo tracker: save"] = {"kind": "save", "root": str(fifo_tracker)}
    probes["fifo tracker: restore"] = {"kind": "restore", "root": str(fifo_tracker)}

    fifo_manifest = tiny_root(base / "fifo-manifest", (1, 2))
    (fifo_manifest / "step_00000002" / MANIFEST).unlink()
    os.mkfifo(fifo_manifest / "step_00000002" / MANIFEST)
    cli_probe("fifo manifest: verify STEP", "verify", fifo_manifest / "step_00000002")
    cli_probe("fifo manifest: resolve", "resolve", fifo_manifest)
    probes["fifo manifest: restore"] = {"kind": "restore", "root": str(fifo_manifest)}

    fifo_lease = tiny_root(base / "fifo-lease", (1,))
    os.mkfifo(fifo_lease / "lease.json")
    probes["fifo lease: save"] = {"kind": "save", "root": str(fifo_lease)}
    cli_probe("fifo lease: gc", "gc", fifo_lease)

    zero = tiny_root(base / "zero-tracker", (1,))
    (zero / TRACKER).unlink()
    os.symlink("/dev/zero", zero / TRACKER)
    cli_probe("/dev/zero tracker: resolve", "resolve", zero)
    cli_probe("/dev/zero tracker: verify", "verify", zero)

    device = tiny_root(base / "device-tracker", (1,))
    (device / TRACKER).unlink()
    try:  # the tracker itself a character device (/dev/zero's numbers), no link involved
        os.mknod(device / TRACKER, 0o644 | stat.S_IFCHR, os.makedev(1, 5))
        cli_probe("device tracker: resolve", "resolve", device)
    except OSError:
        pass  # no CAP_MKNOD here: the test of this probe skips

    huge = tiny_root(base / "huge-world", (1,))
    rewrite_manifest(huge / "step_00000001", lambda m: m["topology"].update(world_size=10**8))
    for command in ("verify", "preflight"):
        cli_probe(f"world_size 10**8: {command}", command, huge)
    cli_probe("world_size 10**8: transfer", "transfer", huge / "step_00000001", base / "huge-dest")
    return probes


@pytest.fixture(scope="module")
def probe_results(tmp_path_factory):
    if not hasattr(os, "mkfifo"):
        pytest.skip("this platform has no mkfifo")
    base = tmp_path_factory.mktemp("probes")
    probes = _scenes(base)
    spec = base / "spec.json"
    spec.write_text(
        json.dumps({"probes": probes, "limit_s": PROBE_LIMIT_S, "warm": str(base / "warm")})
    )
    out = base / "out.json"
    import subprocess

    try:
        proc = subprocess.run(
            [sys.executable, "-c", PROBES, str(spec), str(out)],
            capture_output=True,
            text=True,
            timeout=60 + len(probes) * (PROBE_LIMIT_S + 2),
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        tail = proc.stderr[-3000:]
    except subprocess.TimeoutExpired:
        tail = "the probe process itself hung and was killed"
    results = json.loads(out.read_text()) if out.exists() else {}
    yield {name: results.get(name, {"lost": tail}) for name in probes}, probes
    # FIFOs and device nodes left in a temp dir would hang the next tool that reads it.
    for path in base.rglob("*"):
        if stat.S_ISFIFO(path.lstat().st_mode) or stat.S_ISCHR(path.lstat().st_mode):
            path.unlink()


PROBE_NAMES = [
    *(
        f"fifo tracker: {c}"
        for c in ("resolve", "list", "verify", "preflight", "gc", "hold", "save", "restore")
    ),
    "fifo manifest: verify STEP",
    "fifo manifest: resolve",
    "fifo manifest: restore",
    "fifo lease: save",
    "fifo lease: gc",
    "/dev/zero tracker: resolve",
    "/dev/zero tracker: verify",
    "device tracker: resolve",
    "world_size 10**8: verify",
    "world_size 10**8: preflight",
    "world_size 10**8: transfer",
]
NAMED_FILE = {
    "fifo tracker": TRACKER,
    "fifo manifest": MANIFEST,
    "fifo lease": "lease.json",
    "/dev/zero tracker": TRACKER,
    "device tracker": TRACKER,
}


@pytest.mark.timeout(60 + len(PROBE_NAMES) * (PROBE_LIMIT_S + 2) + 30)
@pytest.mark.parametrize("name", PROBE_NAMES)
def test_no_command_hangs_on_a_non_regular_or_absurd_file(probe_results, name):
    results, made = probe_results
    if name not in made:
        pytest.skip(f"{name}: this machine cannot make that file (mknod needs CAP_MKNOD)")
    res = results[name]
    assert "lost" not in res, f"{name}: no result ({res['lost']})"
    assert not res.get("hung"), f"{name} still running after {PROBE_LIMIT_S} s (it hangs)"
    assert "exception" not in res, f"{name} raised {res['exception']}\n{res.get('output', '')}"
    scene, what = name.split(": ")
    if "outcome" in res:  # save / restore through the API
        assert res["outcome"] == "raised" and res["clear"], f"{name}: {res}"
        assert NAMED_FILE[scene] in res["message"], f"{name} does not name the file: {res}"
        return
    if what != "list":
        assert res["exit"] in (1, 2), f"{name}: exit {res['exit']}\n{res['output']}"
        if scene in NAMED_FILE:
            assert NAMED_FILE[scene] in res["output"], (
                f"{name} does not name the file it refused\n{res['output']}"
            )
