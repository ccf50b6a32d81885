"""Verify a written checkpoint without trusting it (docs/practices.md, 3.5).

Contract: ``verify_step`` returns findings, never raises on bad content. It reads the
manifest as JSON and DCP's ``.metadata`` only through the restricted unpickler; paths
from the manifest that are absolute, climb out with ``..`` or pass through a symlink
leaving the step directory are findings, and are never opened. A clean checkpoint
yields no ERROR finding; a directory that holds no checkpoint is one. ``--deep`` adds
every checksum; ``--restore`` (see ``_offline``) a real restore in a new process, rank by
rank within a bounded host budget.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .._disk import layout as _layout
from .._disk.lease import LEASE_NAME
from .._records import readers as _readers
from .._records.checks import cost, deep_bytes, read_any, verify_step
from .._records.entries import Cost
from .._records.findings import RESTORE_HINT, Finding, Severity, finding, printable
from .._records.leftovers import leftover_findings
from .._records.manifest import safe_member
from .._records.retention import HOLDS_DIR
from ..errors import CheckpointError

_ROOT_ENTRIES = {
    LEASE_NAME: "write lease",
    _layout.PROOF_DIR: "proof records",
    HOLDS_DIR: "holds",
    _layout.CONTRACT_DIR: "run contract",
    "transfers": "transfer records",
}

# The re-exported checks: ops.verify is where the CLI and users find them.
__all__ = [
    "RESTORE_HINT",
    "Cost",
    "Finding",
    "Severity",
    "cost",
    "deep_bytes",
    "printable",
    "restore_check",
    "safe_member",
    "tensor_findings",
    "verify_root",
    "verify_step",
    "worst",
]


def verify_root(
    root: str | os.PathLike[str],
    naming: _layout.StepNaming,
    *,
    deep: bool = False,
    progress: Callable[[int], None] | None = None,
    on_step: Callable[[Path], None] | None = None,
) -> tuple[list[Path], list[Finding]]:
    """(committed step directories checked, findings) for a whole root, tracker included.
    ``progress`` gets the bytes hashed (``deep``), ``on_step`` each step directory as its check
    starts.

    A root that holds no checkpoint at all is an ERROR finding (``no-checkpoint``) that
    names the root the caller probably meant, never an "OK" over zero steps."""
    root = Path(root)
    findings = [
        finding(
            "symlink",
            root / name,
            f"the root's {what} entry is a symlink",
            "replace it with the real file or directory; ckptguard never "
            "reads or writes through links",
        )
        for name, what in _ROOT_ENTRIES.items()
        if (root / name).is_symlink()
    ]
    try:
        tracker = _layout.read_tracker(root)
    except (CheckpointError, OSError) as exc:
        tracker_path = root / _layout.TRACKER_NAME
        return [], [
            *findings,
            finding("bad-tracker", tracker_path, str(exc), "fix or remove the tracker by hand"),
        ]
    dirs = _layout.step_dirs(root, naming)
    if tracker is None:
        if dirs:
            findings.append(
                finding(
                    "no-tracker",
                    root / _layout.TRACKER_NAME,
                    "is missing although steps exist",
                    "something outside ckptguard removed it; restore(path=...) the step you trust",
                )
            )
        else:
            findings.append(
                _no_checkpoint(
                    root, naming, f"no tracker {_layout.TRACKER_NAME} and no step directory"
                )
            )
        return [], findings + leftover_findings(root)
    checked = []
    for step, path in sorted(dirs.items()):
        if on_step is not None:
            on_step(path)
        if path.is_symlink():
            findings.append(
                finding(
                    "symlink",
                    path,
                    "the step directory is a symlink",
                    "replace it with the real directory; ckptguard never reads "
                    "or deletes through links",
                )
            )
            continue
        if step > tracker:
            findings.append(
                Finding(
                    Severity.WARNING,
                    "orphan",
                    str(path),
                    f"is newer than the tracker ({tracker}): a save died "
                    f"between publish and tracker",
                    "ignored for resume: resume from it with restore(path=...), point the "
                    "tracker at it with `ckptguard adopt ROOT STEP`, or delete it with "
                    "`ckptguard gc ROOT --orphans`",
                )
            )
            continue
        # A reader lease: the root's rotation or gc keeps the step while its bytes are checked (none
        # is taken where the root is not writable here; then a step removed meanwhile is said as
        # that).
        with _readers.reading(path, who=f"verify in pid {os.getpid()}") as unheld:
            if unheld is not None and not path.exists():
                findings.append(
                    Finding(
                        Severity.WARNING,
                        "removed-while-verified",
                        str(path),
                        "was removed by the root's rotation or gc after "
                        "verify listed it: not checked",
                        "nothing to do: rotation removes only steps its policy drops",
                    )
                )
                continue
            checked.append(path)
            findings += verify_step(path, deep=deep, progress=progress) + _named_step(path, step)
    if tracker > 0 and tracker not in dirs:
        hint = _template_hint(root, naming)
        findings.append(
            finding(
                "tracker-target",
                root / _layout.TRACKER_NAME,
                f"points at step {tracker}, which does not exist as {naming.name(tracker)}",
                hint or "restore the step directory, or restore(path=...) an older one",
            )
        )
    elif not checked and not any(f.severity is Severity.ERROR for f in findings):
        findings.append(
            _no_checkpoint(root, naming, f"the tracker says {tracker}: no step is committed yet")
        )
    findings += leftover_findings(root)
    return checked, findings


def _named_step(path: Path, step: int) -> list[Finding]:
    """A manifest that names another step than its directory: restore would load it as that step."""
    try:
        said = read_any(path).step
    except (CheckpointError, OSError):
        return []  # verify_step reported the manifest itself
    if said == step:
        return []
    return [
        finding(
            "wrong-step",
            path / _layout.MANIFEST_NAME,
            f"says step {said}, but its directory is step {step}'s: a restore "
            f"would resume at step {said}",
            "the manifest was edited or copied from another step: restore an earlier step",
        )
    ]


# ---------------------------------------------------------------- "did you mean"

_SEARCH_DEPTH = 3
_SEARCH_DIRS = 2000  # a home directory must not make verify walk for minutes
_NUMBERED = re.compile(r"(.*?)(\d+)\Z")


def _no_checkpoint(root: Path, naming: _layout.StepNaming, why: str) -> Finding:
    hints = [_template_hint(root, naming)] if _template_hint(root, naming) else []
    below = suggest_roots(root)
    if below:
        hints.append("did you mean " + " or ".join(f"`ckptguard verify {p}`" for p in below))
    return finding(
        "no-checkpoint",
        root,
        f"holds no checkpoint ({why})",
        "; ".join(h for h in hints if h)
        or "pass the checkpoint root (the directory holding the tracker) or one step directory",
    )


def suggest_roots(path: Path, *, limit: int = 3) -> list[Path]:
    """Directories below ``path`` (at most three levels, links not followed) that hold a tracker."""
    found: list[Path] = []
    level, seen = [path], 0
    for _depth in range(_SEARCH_DEPTH):
        nxt = []
        for directory in level:
            try:
                entries = sorted(os.scandir(directory), key=lambda e: e.name)
            except OSError:
                continue
            for entry in entries:
                if entry.is_dir(follow_symlinks=False) and not entry.name.startswith("."):
                    seen += 1
                    child = Path(entry.path)
                    if (child / _layout.TRACKER_NAME).exists():
                        found.append(child)
                        if len(found) == limit:
                            return found
                    else:
                        nxt.append(child)
                if seen > _SEARCH_DIRS:
                    return found
        level = nxt
    return found


def _template_hint(root: Path, naming: _layout.StepNaming) -> str | None:
    """``--template`` for step directories under another naming (verl's ``global_step_N``)."""
    try:
        names = sorted(e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False))
    except OSError:
        return None
    for name in names[:_SEARCH_DIRS]:
        match = _NUMBERED.match(name)
        if match is None or naming.parse(name) is not None or name.startswith("."):
            continue
        if not (root / name / _layout.MANIFEST_NAME).exists():
            continue
        head, digits = match.groups()
        field = (
            f"{{step:0{len(digits)}d}}" if digits.startswith("0") and len(digits) > 1 else "{step}"
        )
        return f"the step directories are named like {name!r}: pass --template '{head}{field}'"
    return None


def tensor_findings(step_dir: str | os.PathLike[str]) -> Any:
    """``ops.tensorcheck.tensor_findings`` (``verify --deep``'s tensor pass), imported when it runs:
    it needs torch, which the operator commands do not import."""
    step_dir = Path(step_dir)
    from .tensorcheck import tensor_findings as run  # lazy: torch

    return run(step_dir)


def worst(findings: Iterable[Finding]) -> int:
    """Exit code: 1 if any ERROR finding, else 0."""
    return 1 if any(f.severity is Severity.ERROR for f in findings) else 0


OFFLINE = ["-m", "ckptguard.ops._offline"]
"""The restore check's child: ``python -m ckptguard.ops._offline STEP_DIR...``."""


def restore_check(
    step_dirs: Iterable[str | os.PathLike[str]],
    *,
    budget_bytes: int | None = None,
    progress: Callable[[Path, dict[str, Any]], None] | None = None,
) -> list[Finding]:
    """A real restore of every step in one new process, rank by rank and item by item within
    ``budget_bytes`` of host memory; digests compared item by item. ``progress`` gets
    (step directory, {"rank", "world", "item", "bytes"}) after each item. A process that dies
    fails the step it was on; the steps after it are checked in a new process."""
    from ._offline import compare

    findings: list[Finding] = []
    todo = [Path(p) for p in step_dirs]
    while todo:
        results, tail = _restore_process(todo, budget_bytes, progress)
        for step_dir in todo[: len(results)]:
            findings += _restore_findings(step_dir, results[step_dir], compare)
        if len(results) < len(todo):  # the process died inside this step
            dead = todo[len(results)]
            findings.append(
                finding(
                    "restore-failed",
                    dead,
                    f"a restore in a new process failed: {tail}",
                    RESTORE_HINT,
                )
            )
            todo = todo[len(results) + 1 :]
        else:
            todo = []
    return findings


def _restore_process(
    step_dirs: list[Path],
    budget_bytes: int | None,
    progress: Callable[[Path, dict[str, Any]], None] | None,
) -> tuple[dict[Path, dict[str, Any]], str]:
    """Run ``_offline`` once over ``step_dirs``: the results it printed, in order, and its last
    stderr line."""
    import json
    import subprocess
    import sys
    import tempfile

    from ._offline import DEFAULT_BUDGET

    cmd = [
        sys.executable,
        *OFFLINE,
        *map(str, step_dirs),
        "--budget-bytes",
        str(budget_bytes or DEFAULT_BUDGET),
    ]
    results: dict[Path, dict[str, Any]] = {}
    # stderr goes to a file: a pipe nobody reads while stdout is followed could fill and stall the
    # child.
    with tempfile.TemporaryFile(mode="w+") as err:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(event, dict) or "step_dir" not in event:
                    continue
                where = Path(event["step_dir"])
                if "progress" in event and progress is not None:
                    progress(where, event["progress"])
                elif (
                    len(results) < len(step_dirs)
                    and where == step_dirs[len(results)]
                    and isinstance(event.get("result") or event.get("error"), (dict, str))
                ):
                    results[where] = (
                        event["result"] if "result" in event else {"error": str(event["error"])}
                    )
        err.seek(0)
        tail = (err.read().strip().splitlines() or [f"exit status {proc.returncode}, no output"])[
            -1
        ]
    if proc.returncode != 0 and len(results) == len(
        step_dirs
    ):  # died after its last result: say so
        results.pop(step_dirs[-1])
    return results, tail


def _restore_findings(
    step_dir: Path, result: dict[str, Any], compare: Callable[..., list[str]]
) -> list[Finding]:
    if (
        "error" in result
    ):  # the restore of this step raised (the process went on with the next step)
        return [
            finding(
                "restore-failed",
                step_dir,
                f"a restore in a new process failed: {result['error']}",
                RESTORE_HINT,
            )
        ]
    findings = [
        finding("restore-failed", step_dir, problem, RESTORE_HINT)
        for problem in result.get("failed", [])
    ]
    findings += [
        finding("digest-mismatch", step_dir, problem, RESTORE_HINT)
        for problem in compare(step_dir, result)
    ]
    elsewhere = result.get("elsewhere") or []
    if elsewhere:  # never a PASS for what was not restored: said, as not checked here
        findings.append(
            Finding(
                Severity.WARNING,
                "not-checked",
                str(step_dir),
                f"saved on node-local roots: ranks {elsewhere} are on other nodes' "
                f"disks, not restored here"
                + (
                    "; the tensor bytes of format-3 tensor items (covered only by "
                    "their layout-free digests, which need every rank's chunks) were "
                    "not compared on any rank"
                    if "layout_free" in result
                    else ""
                ),
                "run `ckptguard verify --restore` on those nodes too",
            )
        )
    return findings
