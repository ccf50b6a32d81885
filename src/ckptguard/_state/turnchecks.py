"""The checks a TurnLedger (``ckptguard.turns``) fails closed on, each naming the rollout and the
turn.

A state a load refuses (another version, a rollout both finished and in flight, another run seed), a
handle of an older attempt or of before a restore (``check_handle``), a call re-issued with other
arguments (``check_reissue``), a resource at another revision than the committed turns left it
(``check_revision``), and a value that is not JSON where the ledger saves it (``json_text``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._types import StateDict
from ..errors import ConfigError, StateMismatchError
from .conversation import OpenTurn, Turn
from .turnstate import Call, InFlight

__all__ = [
    "STATE_VERSION",
    "check_handle",
    "check_reissue",
    "check_revision",
    "checked_state",
    "json_text",
]

STATE_VERSION = 1
"""The version of a TurnLedger's state dict: ``state_dict`` writes it, a load accepts only it."""


def json_text(fn: Callable[[Any], str], value: Any, what: str) -> str:
    """``fn(value)`` for a JSON value; a value that is not one is a ConfigError naming ``what`` (it
    is saved)."""
    try:
        out: str = fn(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{what} must be JSON values (str, int, float, bool, None, lists, dicts): they are "
            f"saved in the checkpoint ({exc})"
        ) from None
    return out


def checked_state(state: StateDict, run_seed: int) -> tuple[list[InFlight], list[InFlight]]:
    """The in-flight and the finished rollouts of a saved ledger state, refused unless a ledger of
    ``run_seed`` wrote it (``TurnLedger.load_state_dict``)."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise StateMismatchError(
            f"TurnLedger.load_state_dict: not a turn ledger state of version {STATE_VERSION} "
            f"(got {type(state).__name__})"
        )
    flight = [InFlight.from_state(r) for r in state["in_flight"]]
    finished = [InFlight.from_state(r) for r in state["finished"]]
    both = sorted({r.rollout for r in flight} & {r.rollout for r in finished})
    if both:
        raise StateMismatchError(
            f"TurnLedger.load_state_dict: rollout(s) {both[:8]} are both finished and in "
            "flight in this state: a finished result would also be resumed as work; the "
            "state was not written by TurnLedger.state_dict"
        )
    if int(state["run_seed"]) != run_seed:
        raise StateMismatchError(
            f"TurnLedger.load_state_dict: the state was saved with run_seed "
            f"{state['run_seed']}, this ledger has {run_seed}: continued turns would "
            "sample other tokens; build the ledger with the saving run's run_seed"
        )
    return flight, finished


def check_handle(
    turn: Turn, r: InFlight | None, o: OpenTurn | None, generation: int, what: str
) -> OpenTurn:
    """The open turn ``o`` of this handle (``r``: its rollout in flight, ``generation``: the
    ledger's now); a handle of an older attempt or of before a restore fails closed."""
    if r is None or o is None or o.turn != turn or turn.generation != generation:
        now = "not in flight" if r is None else f"at attempt {r.attempt}, turn {r.turn} committed"
        raise StateMismatchError(
            f"{what}: stale attempt: rollout {turn.rollout!r}, turn {turn.turn} (attempt "
            f"{turn.attempt}) is not the turn in progress (the rollout is {now}; a restore "
            f"or a newer next_turn superseded it): drop the work of this handle, ask "
            f"next_turn for the turn to run"
        )
    return o


def check_reissue(r: InFlight, call: Call) -> None:
    """A call of the turn in progress at the save, issued again: with the arguments it was first
    issued with."""
    first = next((c for c in r.pending if c.call_id == call.call_id), None)
    if first is not None and first.args_digest != call.args_digest:
        raise StateMismatchError(
            f"rollout {r.rollout!r}, turn {call.turn}: call id {call.call_id!r} was issued before "
            f"the restore with other arguments (digest {first.args_digest}, now "
            f"{call.args_digest}): the turn did not replay; its sampling must be seeded per "
            f"rollout and turn (Turn.seed)"
        )


def check_revision(r: InFlight, env: str, turn: int, want: int, got: int, ok: bool) -> None:
    """An environment's resource of ``r`` at revision ``got`` where the committed turns left
    ``want``."""
    if not ok:
        raise StateMismatchError(
            f"rollout {r.rollout!r}, turn {turn}: environment {env!r} holds revision {got} of the "
            f"rollout's resource, the checkpoint committed revision {want}: continuing would build "
            f"on other state than the committed turns saw; restore the environment's data of this "
            f"checkpoint (or start over)"
        )
