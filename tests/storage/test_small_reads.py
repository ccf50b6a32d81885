"""Every small file ckptguard reads goes through the bounded reader (``_disk.layout.read_small``:
never a link, never a FIFO or device, never past a size), and large files through a reader that
refuses what is not a regular file without blocking.

A FIFO planted as a run role's manifest (``step_N/<role>/manifest.json``) used to hang restore,
``verify``, ``list`` and ``gc --dry-run`` in a plain ``open()``: each must now answer at once and
name the file. The source scan lists every call that opens a file for reading outside the bounded
reader, each with the reason it is allowed; a new one fails here until it is either routed through
``read_small`` or added to the allow-list with its reason.
"""

from __future__ import annotations

import ast
import contextlib
import os
import threading
from pathlib import Path

import torch

import ckptguard as cg
from ckptguard import ProofPlan

SRC = Path(__file__).resolve().parents[2] / "src" / "ckptguard"
PROMPT_S = 10.0  # "at once" on a loaded 2-core machine; a hang is cut at this point


# ---------------------------------------------------------------- a FIFO as a role manifest


def _run_root(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    run = cg.RunCheckpoint(
        root,
        [cg.Role("actor"), cg.Role("driver")],
        config=cg.CheckpointConfig(timeout_s=30.0, proof=ProofPlan(record=False), retention=None),
    )
    for step in (1, 2):
        run.save(step, {"actor": {"model": torch.nn.Linear(2, 2)}, "driver": {"n": step}})
    fifo = root / "step_00000002" / "actor" / "manifest.json"
    fifo.unlink()
    os.mkfifo(fifo)
    return root


def _bounded(fn, fifo: Path) -> tuple[bool, object]:
    """Run ``fn`` in a thread; if it is still blocked after PROMPT_S, release the FIFO (open its
    write end and close it: the reader sees end of file) and report the hang."""
    out: dict = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # reported, the test decides
            out["value"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(PROMPT_S)
    hung = t.is_alive()
    while t.is_alive():
        with contextlib.suppress(OSError):  # no reader at this instant
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(0.2)
    return hung, out.get("value")


def _cli(*argv: str):
    from click.testing import CliRunner

    from ckptguard.cli import main

    return CliRunner().invoke(main, list(argv))


def test_a_fifo_as_a_role_manifest_is_refused_at_once_by_restore_verify_list_and_gc(tmp_path):
    root = _run_root(tmp_path)
    fifo = root / "step_00000002" / "actor" / "manifest.json"

    def restore():
        run = cg.RunCheckpoint(
            root,
            [cg.Role("actor"), cg.Role("driver")],
            config=cg.CheckpointConfig(
                timeout_s=30.0, proof=ProofPlan(record=False), retention=None
            ),
        )
        return run.restore(
            {"actor": {"model": torch.nn.Linear(2, 2)}, "driver": {"n": 0}},
            path=root / "step_00000002",
        )

    calls = {
        "restore": restore,
        "verify": lambda: _cli("verify", str(root)),
        "list": lambda: _cli("list", str(root)),
        "gc --dry-run": lambda: _cli("gc", str(root), "--dry-run"),
    }
    for name, fn in calls.items():
        hung, value = _bounded(fn, fifo)
        assert not hung, f"{name} blocked on the FIFO {fifo} for {PROMPT_S} s"
        text = str(value) if isinstance(value, BaseException) else value.output  # type: ignore[union-attr]
        if name == "restore":
            assert isinstance(value, cg.CheckpointError), (name, value)
        if name in ("restore", "verify"):
            assert "FIFO" in text and "actor" in text, (name, text)
        assert "Traceback" not in text, (name, text)


# ---------------------------------------------------------------- every read outside the bounded
# reader

# (module, function, call): why this read is not a small file of a checkpoint root, or how it
# stays safe on a FIFO. Anything else that opens a file for reading must use read_small.
ALLOWED: dict[tuple[str, str, str], str] = {
    (
        "_disk/tempfiles.py",
        "proc_start",
        "read_text",
    ): "/proc/<pid>/stat: a kernel file, not in a root",
    ("_records/proofwriter.py", "process_start", "read_text"): "/proc/self/stat",
    (
        "_disk/filedigest.py",
        "file_digest",
        "open",
    ): "large data files: opened O_NONBLOCK, fstat must be regular",
    ("_disk/filedigest.py", "reader", "open"): "a dup of the descriptor file_digest checked",
    (
        "_commit/p2p.py",
        "send_file",
        "open",
    ): "a large step file this rank sends to a peer (not size-bounded)",
    (
        "_commit/stepdir.py",
        "copy_verified",
        "open",
    ): "a data file copied between roots (per-node publish)",
    ("_disk/lease.py", "_create", "fdopen"): "writes a lease file it created with O_EXCL",
    (
        "_records/contract.py",
        "hash_data_files",
        "open",
    ): "the user's data files named in the run contract",
    (
        "_records/contract.py",
        "hash_imported_files",
        "read_bytes",
    ): "the user's imported source files",
    (
        "_records/proofwriter.py",
        "_write",
        "open",
    ): "the last byte of a proof log (not yet through read_small)",
    ("testing.py", "run_ranks", "open"): "the result pickle of a test rank (testing only)",
    ("storage/s3/_transfer.py", "_read", "open"): "a data file of the staging root (upload)",
    ("storage/s3/_transfer.py", "_check", "open"): "a downloaded data file it just wrote",
    # Operator tools and the memory wing: files the user names on the command line, /proc and /sys.
    ("memory/_files.py", "read_text", "read_text"): "/proc and /sys/fs/cgroup files",
    ("memory/cli.py", "recipe", "read_text"): "a recipe file named on the command line",
    ("memory/cli.py", "report", "read_text"): "a records file named on the command line",
    ("memory/cli.py", "vllm_log", "read_text"): "a log file named on the command line",
    ("memory/cli.py", "killer", "read_text"): "a log file named on the command line",
    (
        "memory/estimate.py",
        "read_safetensors_header",
        "open",
    ): "a model file named by the user (header only)",
    ("memory/plan.py", "load_plan_toml", "read_text"): "a plan file named on the command line",
    ("memory/ray_cluster.py", "object_store_pss", "read_text"): "/proc/<pid>/smaps_rollup",
    ("memory/records.py", "read_records", "read_text"): "a records file named on the command line",
    ("memory/sampler.py", "self_rss", "open"): "/proc/self/statm",
    ("ops/_proctree.py", "_stat", "read_text"): "/proc/<pid>/stat",
    (
        "ops/hffiles.py",
        "read_header",
        "open",
    ): "a safetensors file of an export (header bounded by its length)",
    ("ops/hffiles.py", "read_tensors", "open"): "a safetensors file of an export",
    (
        "ops/merge.py",
        "_base_configs",
        "read_bytes",
    ): "the base model's config files named by the user",
    ("ops/repro.py", "filesystem", "read_text"): "/proc/mounts",
    ("ops/repro.py", "_process_figures", "read_text"): "/proc/<pid> files",
    ("ops/repro.py", "run_repro", "read_text"): "the output of a repro child it started",
    (
        "ops/repro.py",
        "_report_rounds",
        "read_text",
    ): "the progress file a repro child it started writes",
    (
        "ops/status.py",
        "record_files",
        "open",
    ): "the head of a memory records file that is_file() checked",
    ("ops/status.py", "_cpu_and_io", "read_text"): "/proc/<pid>/stat and io",
    (
        "ops/transfer.py",
        "_same_copy",
        "read_bytes",
    ): "manifests compared between two roots (ops/, not yet read_small)",
    (
        "ops/transfer.py",
        "_copy_contract",
        "read_bytes",
    ): "a contract file copied (ops/, not yet read_small)",
}


def _reads(path: Path) -> list[tuple[str, str, int]]:
    """(function, call, line) of every call in ``path`` that opens a file for reading directly."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, fn: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if isinstance(child, ast.Call) and (call := _read_call(child)) is not None:
                found.append((name, call, child.lineno))
            visit(child, name)

    visit(tree, "<module>")
    return found


def _read_call(node: ast.Call) -> str | None:
    f = node.func
    if isinstance(f, ast.Name) and f.id == "open":
        mode = (
            node.args[1]
            if len(node.args) > 1
            else next((k.value for k in node.keywords if k.arg == "mode"), None)
        )
        text = mode.value if isinstance(mode, ast.Constant) else "r"
        return (
            None if any(c in str(text) for c in "wax") else "open"
        )  # writes create their own files
    if isinstance(f, ast.Attribute):
        if f.attr in ("read_text", "read_bytes", "fdopen"):
            return f.attr
        if (
            f.attr in ("load", "open")
            and isinstance(f.value, ast.Name)
            and f.value.id in ("json", "io", "gzip")
        ):
            return f"{f.value.id}.{f.attr}"
    return None


def _all_reads() -> dict[tuple[str, str, str], list[int]]:
    sites: dict[tuple[str, str, str], list[int]] = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "cli.py":
            # the command line: it reads only through the library (no file of a root itself)
            continue
        for fn, call, line in _reads(path):
            sites.setdefault((rel, fn, call), []).append(line)
    return sites


def test_every_read_of_a_file_outside_the_bounded_reader_is_listed_with_its_reason():
    sites = _all_reads()
    new = {k: v for k, v in sites.items() if k not in ALLOWED}
    assert not new, (
        f"files opened for reading outside _disk.layout.read_small (a FIFO there hangs, a huge "
        f"file is read whole): {new}; read small files with read_small, or add the site to ALLOWED "
        f"with the reason it is safe"
    )
    gone = sorted(set(ALLOWED) - set(sites))
    assert not gone, f"ALLOWED lists reads that no longer exist (remove them): {gone}"


def test_the_scan_sees_a_new_bare_read(tmp_path):
    """Negative control: the scan finds the three shapes of a bare read in a module."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from pathlib import Path\nimport json\n\ndef role_manifest(p):\n"
        "    with open(p) as f:\n        a = json.load(f)\n    return Path(p).read_text(), a\n"
    )
    assert {(fn, call) for fn, call, _ in _reads(probe)} == {
        ("role_manifest", "open"),
        ("role_manifest", "json.load"),
        ("role_manifest", "read_text"),
    }


def test_file_digest_refuses_a_fifo_without_blocking(tmp_path):
    from ckptguard._disk.digest import file_digest

    target = tmp_path / "x.distcp"
    os.mkfifo(target)
    hung, value = _bounded(lambda: file_digest(str(target)), target)
    assert not hung, "file_digest blocked on a FIFO"
    assert (
        isinstance(value, cg.CheckpointError) and "FIFO" in str(value) and str(target) in str(value)
    ), value
