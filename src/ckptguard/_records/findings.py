"""What a check of a step or a root found: a ``Finding`` (severity, code, path, message, fix).

Every check of ckptguard (``verify``, ``preflight``, ``gc``) reports findings, never raises on bad
content; a finding's line names what, where and what to do.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from pathlib import Path

from .._types import JsonObject

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\n``, ``\\x1b``, ``\\u202e``).

    File names come from the disk: a newline in one would forge a line of output, an
    ANSI escape would rewrite the terminal, and an undecodable byte (a surrogate after
    ``os.fsdecode``) would make printing raise. Undecodable bytes show as ``\\xNN``."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable():
            out.append(ch)
        elif ch in _NAMED:
            out.append(_NAMED[ch])
        elif 0xDC80 <= ord(ch) <= 0xDCFF:  # surrogateescape: the raw byte of the name
            out.append(f"\\x{ord(ch) - 0xDC00:02x}")
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
    return "".join(out)


class Severity(str, enum.Enum):
    ERROR = "ERROR"
    WARNING = "WARNING"


@dataclass(frozen=True)
class Finding:
    """One thing wrong: what, which file, what to do."""

    severity: Severity
    code: str
    path: str
    message: str
    fix: str

    def line(self) -> str:
        """One line of output; names from the disk are escaped, so it is always exactly one line."""
        text = f"{self.severity.value:<7} {self.code:<18} {self.path}: {self.message}; {self.fix}"
        return printable(text)

    def to_json(self) -> JsonObject:
        out = asdict(self)
        out["severity"] = self.severity.value
        # JSON escapes control characters itself; undecodable bytes of a name become \\xNN,
        # since a lone surrogate cannot be encoded as UTF-8 by the reader of the output.
        out["path"] = (
            out["path"].encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        )
        return out


def finding(code: str, path: Path | str, message: str, fix: str) -> Finding:
    return Finding(Severity.ERROR, code, str(path), message, fix)


RESTORE_HINT = "restore an earlier committed step, or copy the file back from where it was written"
