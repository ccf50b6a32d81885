"""A multi-turn rollout's conversation as a TurnLedger (``ckptguard.turns``) hands it out.

``Turn`` is the handle of a turn in progress (its sampling seed: ``turn_seed``, a function of the
run seed, the rollout and the turn only, so a continued turn samples what the killed run sampled);
``OpenTurn`` is what that turn did so far, committed by ``end_turn``; ``Conversation`` is a rollout
at its last completed turn (``conversation_of`` makes it from the saved form, ``_state.turnstate``);
``TurnResumePlan`` is what a resume did with each conversation in flight. Plain values: nothing
here calls an environment.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .turnstate import Call, InFlight

__all__ = [
    "Conversation",
    "OpenTurn",
    "Turn",
    "TurnResumePlan",
    "conversation_of",
    "merged_calls",
    "tokens_digest",
    "turn_seed",
]


def turn_seed(run_seed: int, rollout: str, turn: int) -> int:
    """The sampling seed of ``turn`` of ``rollout``: the same in the killed run, a continued one and
    a restart."""
    key = f"ckptguard.turn|{int(run_seed)}|{rollout}|{int(turn)}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def tokens_digest(tokens: Sequence[int]) -> str:
    return hashlib.blake2b(json.dumps(list(tokens)).encode(), digest_size=12).hexdigest()


@dataclass(frozen=True)
class Conversation:
    """A rollout's conversation at its last completed turn: the prompt's and every turn's tokens
    (``spans``: per turn, how many came from the model, then from the environments), its attempt
    (restarts), its turns, and the committed result of every environment call by call id."""

    rollout: str
    prompt: int | str
    prompt_len: int
    tokens: list[int]
    spans: list[list[int]]
    attempt: int
    turns: int
    calls: dict[str, Any]

    def model_mask(self) -> list[bool]:
        """Per token: whether the model produced it (the tokens a policy update scores)."""
        mask = [False] * self.prompt_len
        for model, env in self.spans:
            mask += [True] * model + [False] * env
        return mask


def conversation_of(r: InFlight) -> Conversation:
    """``r``'s conversation, a copy: the caller may keep it while the ledger goes on."""
    return Conversation(
        r.rollout,
        r.prompt,
        r.prompt_len,
        list(r.tokens),
        [list(s) for s in r.spans],
        r.attempt,
        r.turn,
        {c.call_id: json.loads(c.result) for c in r.calls if c.result is not None},
    )


@dataclass(frozen=True)
class Turn:
    """The handle of one turn in progress: the rollout, its attempt, the turn number (1 = first),
    the sampling seed of this turn's model call, and the conversation's token ids before it."""

    rollout: str
    prompt: int | str
    attempt: int
    turn: int
    seed: int
    tokens: tuple[int, ...]
    generation: int


@dataclass
class OpenTurn:
    """What the turn in progress has done so far (committed by ``end_turn``)."""

    turn: Turn
    model_tokens: list[int] = field(default_factory=list)
    model_calls: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)


def merged_calls(old: list[Call], new: list[Call]) -> list[Call]:
    """The pending calls ``old`` with an open turn's ``new`` ones, issued without a result (a call
    id issued again keeps its place among the new ones)."""
    ids = {c.call_id for c in new}
    issued = [Call(c.call_id, c.env, c.turn, c.index, c.args_digest) for c in new]
    return [*[c for c in old if c.call_id not in ids], *issued]


@dataclass(frozen=True)
class TurnResumePlan:
    """What ``resume`` did: rollouts continued at their last turn (id, turn), restarted from their
    prompt (id, the turns that are redone, the restart-only environment that forced it), and
    finished ones kept."""

    continued: list[tuple[str, int]]
    restarted: list[tuple[str, int, str]]
    finished: list[str]
    prompts: list[int | str]
