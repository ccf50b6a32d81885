"""The environments a multi-turn rollout calls, and the three kinds a resume treats them by.

A rollout's environment call (a tool, a sandbox, a database, a judge) has effects outside the
trainer. A resume must make each of them take effect once, and what that takes depends on what
the environment offers, which the user declares as its ``EnvKind``:

- ``RESTORABLE``: keeps a resource per rollout whose state it can restore at a revision (a
  snapshotted sandbox). A continued rollout gets its resource back at the revision of its last
  committed turn: the effects of the turns lost with the kill are undone and redone once.
- ``IDEMPOTENT``: keyed by call id; a repeated id returns the first result (with the digest of the
  arguments it was first issued with) and has no second effect (a database keyed by request id,
  an API with idempotency keys). A call of a lost turn is re-issued with the same call id.
- ``RESTART_ONLY``: neither. A rollout whose committed turns called it restarts from its prompt,
  and its resource there is fenced: a new revision that discards the earlier attempts' effects and
  refuses their calls. Every new attempt of a rollout starts with a fence.

What nothing can make exactly-once: an effect with no idempotency key and no revision (a message
posted, a payment sent). ckptguard can neither undo nor recognise it again; put such an effect
behind an idempotent service first.

The adapter also reports the environment's own record of what took effect (``effects``), from the
environment's side (its table, its log), never from ckptguard's ledger: ``prove`` checks
exactly-once against that record.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ._types import JsonObject

__all__ = ["Effect", "EnvCall", "EnvKind", "EnvResult", "Environment", "args_digest"]


class EnvKind(str, enum.Enum):
    RESTORABLE = "restorable"
    IDEMPOTENT = "idempotent"
    RESTART_ONLY = "restart-only"


def args_digest(args: Any) -> str:
    """A digest of a call's arguments (JSON, keys sorted): a re-issued call must carry the same."""
    text = json.dumps(args, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class EnvCall:
    """One call, as the adapter receives it. ``call_id`` is stable: a re-issued call carries the
    same. ``epoch``: the fence revision the attempt runs under (restart-only; 0 for the other
    kinds)."""

    call_id: str
    rollout: str
    attempt: int
    turn: int
    index: int
    args: Any
    args_digest: str
    epoch: int = 0


@dataclass(frozen=True)
class EnvResult:
    """What a call returned: ``result`` (JSON values only: it is saved in the checkpoint), the
    rollout's resource ``revision`` after the call, and the digest of the arguments the call id was
    first issued with (an idempotent environment answering a repeat returns the first call's)."""

    result: Any
    revision: int
    args_digest: str


@dataclass(frozen=True)
class Effect:
    """One line of an environment's own record: a call that took effect, at which revision, and
    whether its effect still stands (``live``: False once a restore undid it or a fence discarded
    it)."""

    call_id: str
    rollout: str
    attempt: int
    turn: int
    index: int
    revision: int
    live: bool = True

    def to_json(self) -> JsonObject:
        return {
            "call_id": self.call_id,
            "rollout": self.rollout,
            "attempt": self.attempt,
            "turn": self.turn,
            "index": self.index,
            "revision": self.revision,
            "live": self.live,
        }

    @classmethod
    def from_json(cls, raw: Any) -> Effect:
        """An effect from a record line; ValueError naming the field that is missing or of a wrong
        type."""
        if not isinstance(raw, dict):
            raise ValueError(f"an effect is a JSON object, got {type(raw).__name__}")
        for key, kind in (
            ("call_id", str),
            ("rollout", str),
            ("attempt", int),
            ("turn", int),
            ("index", int),
            ("revision", int),
            ("live", bool),
        ):
            value = raw.get(key)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(
                    f"effect field {key!r}: expected {kind.__name__}, got {value!r:.40}"
                )
        return cls(
            raw["call_id"],
            raw["rollout"],
            raw["attempt"],
            raw["turn"],
            raw["index"],
            raw["revision"],
            raw["live"],
        )


@runtime_checkable
class Environment(Protocol):
    """What a user's environment adapter provides. ``name`` is unique within a ``TurnLedger``;
    ``kind`` says how a resume treats it. Methods a kind does not use may raise
    ``NotImplementedError``."""

    name: str
    kind: EnvKind

    def call(self, call: EnvCall) -> EnvResult:
        """Perform ``call`` (idempotent: answer a known call id with its first result, no new
        effect; restart-only: refuse a call whose ``epoch`` is not the rollout's newest fence)."""
        ...

    def revision(self, rollout: str) -> int:
        """The revision of ``rollout``'s resource now (0: untouched)."""
        ...

    def restore(self, rollout: str, revision: int) -> int:
        """Restorable: put ``rollout``'s resource back at ``revision`` (0: its initial state);
        returns the revision it holds now."""
        ...

    def fence(self, rollout: str) -> int:
        """Restart-only: discard ``rollout``'s effects, refuse its older calls, and return the new
        revision (greater than every earlier one of that rollout)."""
        ...

    def effects(self) -> list[Effect]:
        """The environment's own record of every call that took effect, in order."""
        ...
