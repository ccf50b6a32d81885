"""The saved form of a TurnLedger's rollouts: plain lists, dicts and bytes, so ``weights_only``
loads read them.

Token ids are saved as base64 text of little-endian int32s: a pickled list of ints loads at about 5
us per token through ``torch.load(weights_only=True)``'s unpickler (180 ms for one 33k-token
rollout, measured), a str at memory speed (``bytes`` would pickle, at torch.save's protocol 2, as
latin-1 text that grows by half). Not a tensor: a tensor in a state item would be saved as
replicated DCP state, merged across ranks, and each rank's rollouts are its own.
"""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._types import StateDict

__all__ = ["Call", "InFlight", "tokens_from_text", "tokens_to_text"]

TOKEN_BYTES = 4


def tokens_to_text(tokens: Sequence[int]) -> str:
    a = array("i", tokens)  # OverflowError for an id outside int32: no vocabulary has one
    if sys.byteorder == "big":
        a.byteswap()
    return base64.b64encode(a.tobytes()).decode("ascii")


def tokens_from_text(text: str) -> list[int]:
    data = base64.b64decode(text, validate=True) if isinstance(text, str) else b"?"
    if len(data) % TOKEN_BYTES:
        raise ValueError(
            f"token ids are base64 text of {TOKEN_BYTES}-byte little-endian ints, got "
            f"{type(text).__name__} {str(text)[:40]!r}"
        )
    a = array("i")
    a.frombytes(data)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


@dataclass
class Call:
    """One environment call of a rollout: committed once ``result`` is set (its turn ended)."""

    call_id: str
    env: str
    turn: int
    index: int
    args_digest: str
    result: str | None = None  # the result as JSON text (plain str: loads with weights_only)
    revision: int = 0

    def to_state(self) -> list[Any]:
        return [
            self.call_id,
            self.env,
            self.turn,
            self.index,
            self.args_digest,
            self.result,
            self.revision,
        ]

    @classmethod
    def from_state(cls, raw: list[Any]) -> Call:
        call_id, env, turn, index, digest, result, revision = raw
        return cls(
            str(call_id),
            str(env),
            int(turn),
            int(index),
            str(digest),
            None if result is None else str(result),
            int(revision),
        )


@dataclass
class InFlight:
    """One in-flight rollout at its last completed turn."""

    rollout: str
    prompt: int | str
    prompt_len: int
    tokens: list[int]
    attempt: int = 0
    turn: int = 0
    spans: list[list[int]] = field(default_factory=list)  # per turn: [model tokens, env tokens]
    model_calls: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    pending: list[Call] = field(
        default_factory=list
    )  # issued in the turn in progress, no committed result
    epochs: dict[str, int] = field(
        default_factory=dict
    )  # restart-only env -> fence revision of this attempt

    def to_state(self) -> StateDict:
        return {
            "rollout": self.rollout,
            "prompt": self.prompt,
            "prompt_len": self.prompt_len,
            "tokens": tokens_to_text(self.tokens),
            "attempt": self.attempt,
            "turn": self.turn,
            "spans": [list(s) for s in self.spans],
            "model_calls": list(self.model_calls),
            "calls": [c.to_state() for c in self.calls],
            "pending": [c.to_state() for c in self.pending],
            "epochs": dict(self.epochs),
        }

    @classmethod
    def from_state(cls, raw: Mapping[str, Any]) -> InFlight:
        return cls(
            str(raw["rollout"]),
            raw["prompt"],
            int(raw["prompt_len"]),
            tokens_from_text(raw["tokens"]),
            int(raw["attempt"]),
            int(raw["turn"]),
            [[int(a), int(b)] for a, b in raw["spans"]],
            [str(m) for m in raw["model_calls"]],
            [Call.from_state(c) for c in raw["calls"]],
            [Call.from_state(c) for c in raw["pending"]],
            {str(k): int(v) for k, v in raw["epochs"].items()},
        )

    def revisions(self) -> dict[str, tuple[int, int]]:
        """Env -> (revision after its last committed call, that call's turn)."""
        out: dict[str, tuple[int, int]] = {}
        for c in self.calls:
            out[c.env] = (c.revision, c.turn)
        return out
