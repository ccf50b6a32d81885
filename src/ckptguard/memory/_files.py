"""Small readers for /proc and cgroup files that say why a value was not obtained.

Contract: every reader returns either a value or ``None`` together with a reason string; a file
that cannot be read never turns into 0, because a 0 in a memory record reads as "nothing was
used" and hides the very figure the record was written for.
"""

from __future__ import annotations

from pathlib import Path

# Values at or above this are the kernel's "no limit" sentinels (v1 prints 2**63 - 4096 rounded
# down to a page; v2 prints "max"); treating them as a byte count would make every plan "fit".
UNLIMITED_SENTINEL = 1 << 62


def read_text(path: Path) -> tuple[str | None, str | None]:
    """The file's text, or None with the reason (missing, permission, vanished process)."""
    try:
        return path.read_text(encoding="ascii", errors="replace"), None
    except FileNotFoundError:
        return None, f"{path} does not exist"
    except PermissionError:
        return None, f"{path} is not readable (permission denied)"
    except OSError as exc:  # ESRCH on a process that exited between listing and reading
        return None, f"{path} could not be read ({exc.strerror or exc})"


def read_int(path: Path) -> tuple[int | None, str | None]:
    """A file holding one integer (or "max"); "max" and huge sentinels come back as None."""
    text, why = read_text(path)
    if text is None:
        return None, why
    word = text.strip()
    if word == "max":
        return None, f"{path} is 'max' (no limit set)"
    try:
        value = int(word)
    except ValueError:
        return None, f"{path} holds {word[:40]!r}, not an integer"
    if value >= UNLIMITED_SENTINEL:
        return None, f"{path} is {value} (no limit set)"
    return value, None


def read_keyed(path: Path, *, unit_kib: bool = False) -> tuple[dict[str, int] | None, str | None]:
    """A "key value" or "Key: value kB" file (memory.stat, memory.events, meminfo, smaps_rollup).

    With ``unit_kib`` the values are kB figures and are returned in bytes.
    """
    text, why = read_text(path)
    if text is None:
        return None, why
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) < 2:
            continue
        try:
            value = int(parts[1])
        except ValueError:
            continue
        out[parts[0]] = value * 1024 if unit_kib else value
    return out, None
