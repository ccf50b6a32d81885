"""Reader leases: a step that an evaluation or export process is reading is never rotated away.

Contract. A reader writes ``ROOT/readers/<step>-<owner>.json`` before it opens the step
(``open_step``, a context manager; ``ckptguard hold --ttl`` for scripts) and removes it when done. A
lease is live while its expiry (``expires_unix``) is in the future or, on the host that wrote it,
while its process runs (PID and process start time, as the temp files record them); ``open_step``
renews its expiry from a thread every third of ``ttl_s``, so a reader on another host whose process
died frees its step once ``ttl_s`` passed, and one on the same host at once (there its process
decides, not the expiry). ``live`` reports the live leases by step (retention and gc keep those
steps, ``holds`` counts them); retention and gc also remove the dead ones. A lease file that cannot
be read holds its step (the name gives it) until it is older than ``UNREADABLE_AGE_S``: a damaged
lease never frees a step early.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import xxhash

from .._disk import layout as _layout
from .._disk import tempfiles as _tempfiles
from ..errors import CheckpointError, ConfigError

READERS_DIR = "readers"
UNREADABLE_AGE_S = 24 * 3600.0
_NAME = re.compile(r"(\d+)-[0-9a-z.]+\.json\Z")


def _host() -> str:
    return _tempfiles.this_host()


def _path(root: Path, step: int, owner: str) -> Path:
    return root / READERS_DIR / f"{step}-{owner}.json"


def acquire(
    root: Path,
    step: int,
    *,
    ttl_s: float | None,
    who: str,
    bind_process: bool = True,
    key: str | None = None,
) -> Path:
    """Write a lease on ``step``. ``bind_process``: live while this process runs (on its host), else
    by its expiry alone (a script's ``hold --ttl``; ``key`` then names it, so the same call renews
    it)."""
    if ttl_s is not None and not ttl_s > 0:
        raise ConfigError(f"a reader lease needs ttl_s > 0 seconds, got {ttl_s!r}")
    if not bind_process and ttl_s is None:
        raise ConfigError(
            "a reader lease not bound to a process needs a ttl (it could never expire)"
        )
    directory = root / READERS_DIR
    _layout.refuse_link(directory, "readers directory")  # never written through a link
    directory.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    ttl_owner = (
        "ttl." + xxhash.xxh3_64_hexdigest((key or who).encode())[:12]
    )  # the same key renews its lease
    owner = _tempfiles.owner_tag() if bind_process else ttl_owner
    path = _path(root, step, owner)
    _layout.atomic_write_json(path, _record(step, ttl_s, who, pid if bind_process else None))
    return path


def _record(step: int, ttl_s: float | None, who: str, pid: int | None) -> dict[str, object]:
    now = time.time()
    return {
        "step": step,
        "who": who,
        "pid": pid,
        "start": _tempfiles.proc_start(pid) if pid else None,
        "host": _host(),
        "created_unix": now,
        "expires_unix": now + ttl_s if ttl_s is not None else None,
    }


def renew(path: Path, ttl_s: float) -> None:
    data = _layout.read_json(path, limit=64 << 10, what="reader lease")
    if isinstance(data, dict):
        data["expires_unix"] = time.time() + ttl_s
        _layout.atomic_write_json(path, data)


def release_ttl(root: Path, step: int) -> int:
    """Remove the leases on ``step`` that are not bound to a process (``hold --ttl``); how many."""
    removed = 0
    for path in sorted((root / READERS_DIR).glob(f"{step}-ttl.*.json")):
        if path.is_file() and not path.is_symlink():
            path.unlink()
            removed += 1
    return removed


def _alive(data: dict[str, object]) -> bool:
    pid, start = data.get("pid"), data.get("start")
    if isinstance(pid, int) and data.get("host") == _host():
        return (
            _tempfiles.proc_start(pid) == start
        )  # this host: the writing process still runs, whatever its expiry
    expires = data.get("expires_unix")
    return isinstance(expires, (int, float)) and expires > time.time()


def live(root: Path, *, sweep: bool = True) -> dict[int, str]:
    """Steps with a live reader lease, and who reads them; ``sweep``: dead leases are removed (a
    read-only command such as ``list`` passes False and leaves them)."""
    out: dict[int, str] = {}
    directory = root / READERS_DIR
    _layout.refuse_link(directory, "readers directory")  # never read through a link
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return out
    for entry in entries:
        match = _NAME.match(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False):
            # a temp file of a lease being written, or something ckptguard never writes here
            continue
        step, path = int(match.group(1)), Path(entry.path)
        try:
            data = _layout.read_json(path, limit=64 << 10, what="reader lease")
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError, CheckpointError) as exc:
            if time.time() - entry.stat(follow_symlinks=False).st_mtime < UNREADABLE_AGE_S:
                out[step] = f"UNREADABLE reader lease {path} ({str(exc)[:120]}): treated as live"
            continue
        if _alive(data):
            until = data.get("expires_unix")
            when = (
                f" until {time.strftime('%H:%M:%S', time.localtime(until))}"
                if isinstance(until, float)
                else ""
            )
            out[step] = (
                f"read by {data.get('who')} (pid {data.get('pid')} on {data.get('host')}){when}"
            )
        elif sweep:
            with contextlib.suppress(OSError):
                path.unlink()  # a dead reader's lease: its step is free again
    return out


@contextlib.contextmanager
def open_step(
    root: str | os.PathLike[str],
    step: int | None = None,
    *,
    ttl_s: float = 600.0,
    template: str = "step_{step:08d}",
    who: str | None = None,
) -> Iterator[Path]:
    """Read a committed step without rotation or gc deleting it meanwhile: ``with
    ckptguard.open_step(root) as step_dir: ...`` (the tracker's step by default).

    The lease is written before the step is checked, renewed every ``ttl_s / 3`` seconds while the
    block runs and removed after it; a killed reader frees the step at once on its host, and after
    ``ttl_s`` on another host."""
    text = os.fspath(root)
    if isinstance(text, str) and text[:3].lower() == "s3:":  # never a local directory named "s3:"
        raise ConfigError(
            f"open_step({text!r}): open_step holds a step of a local root; on an s3:// "
            f"root hold it with CheckpointManager(url).hold(step) (kept by the store's "
            f"rotation until released)"
        )
    root = Path(root)
    if step is None:
        step = _layout.read_tracker(root)
        if step is None:
            raise ConfigError(f"open_step: {root} has no tracker: name the step to read")
    path = acquire(root, step, ttl_s=ttl_s, who=who or f"open_step in pid {os.getpid()}")
    stop = threading.Event()

    def renewing() -> None:
        while not stop.wait(ttl_s / 3):
            with contextlib.suppress(OSError, CheckpointError):
                renew(path, ttl_s)

    thread = threading.Thread(target=renewing, name="ckptguard-reader-lease", daemon=True)
    thread.start()
    try:
        step_dir = root / _layout.StepNaming(template).name(step)
        if not (step_dir / _layout.MANIFEST_NAME).is_file():
            raise CheckpointError(
                f"open_step: step {step} is not committed under {root} (no {step_dir.name}/"
                f"{_layout.MANIFEST_NAME}): `ckptguard list {root}` shows the steps"
            )
        yield step_dir
    finally:
        stop.set()
        thread.join()
        with contextlib.suppress(OSError):
            path.unlink()


@contextlib.contextmanager
def reading(step_dir: Path, *, who: str, ttl_s: float = 600.0) -> Iterator[str | None]:
    """``open_step`` for a step given by its directory (a transfer's source): rotation and gc of its
    root keep the step while the block runs. Yields None, or why no lease could be taken (a root
    this process cannot write, a directory that is not a committed step of its root's naming): the
    block then runs unprotected, and a rotation meanwhile fails it loudly (files missing), never
    silently."""
    stack = contextlib.ExitStack()
    try:
        manifest = _layout.read_json(step_dir / _layout.MANIFEST_NAME, what="manifest")
        step = manifest.get("step") if isinstance(manifest, dict) else None
        template = manifest.get("dir_template") if isinstance(manifest, dict) else None
        if not isinstance(step, int) or not isinstance(template, str):
            raise ConfigError(f"{step_dir}'s manifest names no step and step template")
        if _layout.StepNaming(template).name(step) != step_dir.name:
            raise ConfigError(
                f"{step_dir.name} is not the name its manifest's template gives step {step}"
            )
        stack.enter_context(
            open_step(step_dir.parent, step, ttl_s=ttl_s, template=template, who=who)
        )
    except (OSError, CheckpointError, ValueError) as exc:
        stack.close()
        yield f"{type(exc).__name__}: {exc}"
        return
    with stack:
        yield None
