"""TurnLedger: every in-flight multi-turn rollout at its last completed turn, saved in the same
commit as the models.

An agentic rollout is many turns of model calls and environment calls (``environments``), minutes
to hours long. ``RolloutLedger`` makes prompts exactly-once, but a rollout in flight at a kill is in
no checkpoint: the resume restarts it from its prompt, repeats environment calls that already
changed the world, or loses it. The turn ledger is a state item (``state_dict``/``load_state_dict``,
plain values only, so ``torch.load(weights_only=True)`` reads it): put it in the state you save,
``mgr.save(step, {..., "turns": ledger})``, on every rank that runs rollouts.

It holds, per in-flight rollout: the conversation's token ids (prompt, then per turn the model's
tokens and the environments' tokens), the sampling seed of the next turn (a function of the run
seed, the rollout and the turn only, so a continued turn samples what the killed run sampled),
every model call's id, and every environment call: its stable call id, its arguments' digest, its
committed result and the resource revision after it. A call of the turn in progress at a save is
saved as issued without a committed result.

The rollout loop drives it::

    turn = ledger.next_turn(rollout_id, step=step)  # the handle of the next turn (seed, tokens)
    ledger.model_call(turn, generated_token_ids)
    result = ledger.env_call(turn, "db", {"op": "insert", ...})  # stable call id, exactly-once
    ledger.end_turn(turn, env_token_ids)           # the turn is committed to the next save
    done = ledger.finish(rollout_id)               # done: no longer resumable work
    ledger.acknowledge([rollout_id])               # its consumer (RolloutLedger.completed) holds it

After a restore, ``resume()`` (also run by the first use) decides each in-flight rollout by the
kinds of the environments its committed turns called: continue at its last turn (restorable:
resources restored at their committed revisions; idempotent: checked to hold them; restart-only ones
it did not call yet: fenced), or restart from its prompt under a new attempt when it called a
restart-only environment (that one fenced, restorable ones restored to revision 0). A revision that
does not match, a call re-issued with other arguments, or a handle of an older attempt fails closed,
naming the rollout and the turn. A finished rollout is never also resumable: ``finish`` takes it out
of the in-flight set in the same step, and a state holding one rollout in both is refused.

With ``root``, the ledger appends its evidence to ``ROOT/proof/turns_rank_NNNNN.jsonl`` (a turn, a
finish, a resume, the environments' own records of their effects): ``ckptguard prove`` reads it
(``ops.prove_turns``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ._records.turnlog import TurnLog
from ._state.conversation import (
    Conversation,
    OpenTurn,
    Turn,
    TurnResumePlan,
    conversation_of,
    merged_calls,
    tokens_digest,
    turn_seed,
)
from ._state.turnchecks import (
    STATE_VERSION,
    check_handle,
    check_reissue,
    check_revision,
    checked_state,
    json_text,
)
from ._state.turnstate import Call, InFlight
from ._types import JsonObject, StateDict
from .environments import Effect, EnvCall, Environment, EnvKind, args_digest
from .errors import ConfigError, StateMismatchError
from .rollout import RolloutLedger

__all__ = ["Conversation", "Turn", "TurnLedger", "TurnResumePlan", "turn_seed"]

log = logging.getLogger("ckptguard")


class TurnLedger:
    """The in-flight multi-turn rollouts of one rank, each at its last completed turn (see the
    module doc).

    ``envs``: the environment adapters, by their names. ``prompts``: the run's ``RolloutLedger``, if
    any: ``resume`` marks the prompts of the rollouts it continues or restarts as issued again there
    (else that ledger re-issues them as new work). ``root`` and ``rank``: where the evidence
    goes."""

    def __init__(
        self,
        envs: Iterable[Environment],
        *,
        run_seed: int = 0,
        prompts: RolloutLedger | None = None,
        root: str | Path | None = None,
        rank: int = 0,
    ) -> None:
        self.envs: dict[str, Environment] = {}
        for env in envs:
            if not isinstance(env.kind, EnvKind) or env.name in self.envs:
                raise ConfigError(
                    f"TurnLedger: environment {env.name!r} is named twice or its kind {env.kind!r} "
                    "is not an EnvKind; give each adapter a unique name and an EnvKind"
                )
            self.envs[env.name] = env
        self.run_seed = int(run_seed)
        self.prompts = prompts
        self._records = TurnLog(None if root is None else Path(root), int(rank))
        self._lock = threading.RLock()
        self._flight: dict[str, InFlight] = {}
        self._finished: dict[str, InFlight] = {}
        self._open: dict[str, OpenTurn] = {}
        self._seq = 0
        self._generation = 0
        self._step: int | None = None  # the training step of the turns now run (recorded with them)
        self._pending_resume = False

    # ------------------------------------------------------------ the rollout loop

    def start(self, rollout: str, prompt: int | str, prompt_tokens: Sequence[int]) -> None:
        """Open ``rollout`` (of ``prompt``): restorable resources back at revision 0, restart-only
        ones fenced (a run killed after this rollout started may have left effects there that no
        save holds)."""
        with self._lock:
            self._resume_if_pending()
            if rollout in self._flight or rollout in self._finished:
                raise ConfigError(
                    f"TurnLedger.start({rollout!r}): the rollout is already in flight or finished; "
                    "rollout ids are unique within a run"
                )
            r = InFlight(str(rollout), prompt, len(prompt_tokens), [int(t) for t in prompt_tokens])
            self._fresh_resources(r)
            self._flight[r.rollout] = r
            self._seq += 1

    def next_turn(self, rollout: str, *, step: int) -> Turn:
        """The handle of ``rollout``'s next turn at training step ``step``; a turn left open is
        dropped (its calls stay pending: the next ones must be re-issued with the same call ids and
        arguments)."""
        with self._lock:
            self._resume_if_pending()
            r = self._in_flight(rollout, "next_turn")
            self._step = int(step)
            turn = Turn(
                r.rollout,
                r.prompt,
                r.attempt,
                r.turn + 1,
                turn_seed(self.run_seed, r.rollout, r.turn + 1),
                tuple(r.tokens),
                self._generation,
            )
            old = self._open.pop(r.rollout, None)
            if old is not None:
                r.pending = merged_calls(r.pending, old.calls)
            self._open[r.rollout] = OpenTurn(turn)
            return turn

    def model_call(self, turn: Turn, tokens: Sequence[int], call_id: str | None = None) -> str:
        """The model's tokens of this turn (one model call); returns the call's id."""
        with self._lock:
            o = self._current(turn, "model_call")
            cid = call_id or f"{turn.rollout}/t{turn.turn}/m{len(o.model_calls)}"
            o.model_tokens += [int(t) for t in tokens]
            o.model_calls.append(cid)
            return cid

    def env_call(self, turn: Turn, env: str, args: Any) -> Any:
        """Call environment ``env`` with ``args`` under a stable call id (rollout, turn, index): a
        call of a committed turn is never made (its result is in the ledger); a re-issued call
        carries its first id."""
        with self._lock:
            o = self._current(turn, "env_call")
            adapter = self.envs.get(env)
            if adapter is None:
                raise ConfigError(
                    f"env_call(rollout {turn.rollout!r}, turn {turn.turn}): no environment {env!r} "
                    f"(known: {sorted(self.envs)})"
                )
            r = self._flight[turn.rollout]
            index = len(o.calls)
            where = f"env_call(rollout {turn.rollout!r}, turn {turn.turn}): the arguments"
            call = Call(
                f"{turn.rollout}/t{turn.turn}/c{index}",
                env,
                turn.turn,
                index,
                json_text(args_digest, args, where),
            )
            check_reissue(r, call)
            request = EnvCall(
                call.call_id,
                r.rollout,
                r.attempt,
                turn.turn,
                index,
                args,
                call.args_digest,
                r.epochs.get(env, 0),
            )
            o.calls.append(call)
        result = adapter.call(request)  # outside the lock: a slow tool must not stall a save
        with self._lock:
            self._current(turn, "env_call")
            if result.args_digest != call.args_digest:
                raise StateMismatchError(
                    f"rollout {turn.rollout!r}, turn {turn.turn}: environment {env!r} answered "
                    f"call id {call.call_id!r} with the result of other arguments (first issued "
                    f"with {result.args_digest}, now {call.args_digest}): the turn did not replay "
                    f"as the killed run ran it; seed sampling per rollout and turn "
                    f"(TurnLedger.next_turn's seed), or start a new rollout id"
                )
            call.result = json_text(
                lambda v: json.dumps(v, sort_keys=True, allow_nan=False),
                result.result,
                f"rollout {turn.rollout!r}, turn {turn.turn}: environment {env!r}'s result",
            )
            call.revision = int(result.revision)
            return result.result

    def end_turn(self, turn: Turn, env_tokens: Sequence[int] = ()) -> None:
        """The turn completed: its model tokens, then ``env_tokens`` (the environments' answers as
        the model reads them), its model calls and its environment calls with their results are
        committed."""
        with self._lock:
            o = self._current(turn, "end_turn")
            r = self._flight[turn.rollout]
            unanswered = [c.call_id for c in o.calls if c.result is None]
            if unanswered:
                raise ConfigError(
                    f"end_turn(rollout {turn.rollout!r}, turn {turn.turn}): call(s) {unanswered} "
                    "returned no result; end the turn after its calls returned"
                )
            env = [int(t) for t in env_tokens]
            r.tokens += o.model_tokens + env
            r.spans.append([len(o.model_tokens), len(env)])
            r.model_calls += o.model_calls
            r.calls += o.calls
            r.pending = [c for c in r.pending if c.turn > turn.turn]
            r.turn = turn.turn
            del self._open[r.rollout]
            self._seq += 1
            self._record_turn(r, turn, o)

    def finish(self, rollout: str) -> Conversation:
        """``rollout`` is done: out of the in-flight set (never resumed again), held as finished
        until ``acknowledge``; returns its conversation (prompt, tokens, spans, attempt, turns)."""
        with self._lock:
            self._resume_if_pending()
            r = self._in_flight(rollout, "finish")
            if r.rollout in self._open:
                raise ConfigError(
                    f"finish({rollout!r}): turn {self._open[r.rollout].turn.turn} is still open; "
                    f"end it first (an unfinished turn is not part of the rollout)"
                )
            del self._flight[r.rollout]
            self._finished[r.rollout] = r
            self._seq += 1
            self._records.write(
                "finish",
                rollout=r.rollout,
                attempt=r.attempt,
                turns=r.turn,
                seq=self._seq,
                step=self._step,
                conv=tokens_digest(r.tokens),
            )
            return conversation_of(r)

    def acknowledge(self, rollouts: Iterable[str]) -> None:
        """Their consumer holds these finished rollouts now (e.g. ``RolloutLedger.completed(prompt,
        ref)`` in the same step, before the next save): the ledger lets them go."""
        ids = list(rollouts)
        with self._lock:
            unknown = [r for r in ids if r not in self._finished]
            if unknown:
                raise ConfigError(
                    f"acknowledge: rollout(s) {unknown[:8]} are not finished (finish() them first)"
                )
            for rid in ids:
                del self._finished[rid]

    # ------------------------------------------------------------ queries

    @property
    def in_flight(self) -> list[str]:
        with self._lock:
            return list(self._flight)

    @property
    def finished(self) -> dict[str, Conversation]:
        with self._lock:
            return {rid: conversation_of(r) for rid, r in self._finished.items()}

    def conversation(self, rollout: str) -> Conversation:
        """An in-flight rollout's conversation at its last completed turn."""
        with self._lock:
            return conversation_of(self._in_flight(rollout, "conversation"))

    def result(self, call_id: str) -> Any:
        """The committed result of ``call_id`` (a committed turn's call is never made again: read it
        here)."""
        with self._lock:
            for r in [*self._flight.values(), *self._finished.values()]:
                for c in r.calls:
                    if c.call_id == call_id and c.result is not None:
                        return json.loads(c.result)
        raise KeyError(f"no committed result of call id {call_id!r} in this ledger")

    # ------------------------------------------------------------ state

    def state_dict(self) -> StateDict:
        """Plain values only: every in-flight rollout at its last completed turn, the finished ones
        not yet acknowledged, and the record sequence number."""
        with self._lock:
            flight = {rid: r.to_state() for rid, r in self._flight.items()}
            # Calls of a turn in progress: issued, no committed result.
            for rid, o in self._open.items():
                flight[rid]["pending"] = [
                    c.to_state() for c in merged_calls(self._flight[rid].pending, o.calls)
                ]
                for c in flight[rid]["pending"]:
                    c[5] = None
            return {
                "version": STATE_VERSION,
                "seq": self._seq,
                "run_seed": self.run_seed,
                "in_flight": list(flight.values()),
                "finished": [r.to_state() for r in self._finished.values()],
            }

    def load_state_dict(self, state: StateDict) -> None:
        """Exactly the saved state; the rules are applied by ``resume`` (run by the first use if not
        called)."""
        flight, finished = checked_state(state, self.run_seed)
        with self._lock:
            self._flight = {r.rollout: r for r in flight}
            self._finished = {r.rollout: r for r in finished}
            self._open = {}
            self._seq = int(state["seq"])
            self._generation += 1  # every handle of before the restore is stale now
            self._pending_resume = True

    # ------------------------------------------------------------ after a restore

    def resume(self) -> TurnResumePlan:
        """Decide and prepare every in-flight rollout (once after each restore; see the module
        doc)."""
        with self._lock:
            self._pending_resume = False
            continued: list[tuple[str, int]] = []
            restarted: list[tuple[str, int, str]] = []
            for r in self._flight.values():
                forced = self._restart_only_used(r)
                if forced is None:
                    self._continue(r)
                    continued.append((r.rollout, r.turn))
                else:
                    restarted.append((r.rollout, r.turn, forced))
                    self._restart(r)
            prompts = list(
                dict.fromkeys(r.prompt for r in [*self._flight.values(), *self._finished.values()])
            )
            plan = TurnResumePlan(continued, restarted, list(self._finished), prompts)
            self._records.write(
                "resume",
                durable=True,
                seq=self._seq,
                continued=[[rid, self._flight[rid].attempt, t] for rid, t in continued],
                restarted=[[rid, self._flight[rid].attempt, t, env] for rid, t, env in restarted],
                finished=plan.finished,
            )
        if self.prompts is not None:
            self.prompts.take(0)  # takes nothing: applies the prompt ledger's own resume first
            for pid in prompts:  # their rollouts go on here: not new work for the prompt ledger
                if pid in self.prompts.pending_reissue:
                    self.prompts.issued(pid)
        log.info(
            "ckptguard: turn ledger resumed: %d rollout(s) continued at their last turn, %d "
            "restarted from their prompt (restart-only environments), %d finished kept",
            len(continued),
            len(restarted),
            len(plan.finished),
        )
        return plan

    def record_effects(self) -> None:
        """Append every environment's own record of its effects to the evidence (``prove`` reads the
        newest)."""
        for name, env in self.envs.items():
            effects: list[Effect] = env.effects()
            self._records.write(
                "effects",
                durable=True,
                env=name,
                kind=env.kind.value,
                effects=[e.to_json() for e in effects],
            )

    # ------------------------------------------------------------ inside

    def _restart_only_used(self, r: InFlight) -> str | None:
        return next(
            (c.env for c in r.calls if self._env(c.env, r).kind is EnvKind.RESTART_ONLY), None
        )

    def _env(self, name: str, r: InFlight) -> Environment:
        env = self.envs.get(name)
        if env is None:
            raise StateMismatchError(
                f"rollout {r.rollout!r}, turn {r.turn}: the saved ledger holds calls to "
                f"environment {name!r}, which this ledger does not have (known: "
                f"{sorted(self.envs)}); pass the same environments as the saving run"
            )
        return env

    def _continue(self, r: InFlight) -> None:
        """Resources back at the revisions of the last committed turn; restart-only ones not called
        yet fenced."""
        committed = r.revisions()
        for name, env in self.envs.items():
            want, turn = committed.get(name, (0, r.turn))
            if env.kind is EnvKind.RESTORABLE:
                got = env.restore(r.rollout, want)
                check_revision(r, name, turn, want, got, got == want)
            elif env.kind is EnvKind.IDEMPOTENT and name in committed:
                got = env.revision(r.rollout)
                check_revision(r, name, turn, want, got, got >= want)
            elif env.kind is EnvKind.RESTART_ONLY:
                r.epochs[name] = env.fence(r.rollout)

    def _restart(self, r: InFlight) -> None:
        """From the prompt under a new attempt: committed calls forgotten, resources fresh (fenced
        or at 0)."""
        r.tokens = r.tokens[: r.prompt_len]
        r.attempt += 1
        r.turn = 0
        r.spans, r.model_calls, r.calls, r.pending = [], [], [], []
        self._fresh_resources(r)

    def _fresh_resources(self, r: InFlight) -> None:
        for name, env in self.envs.items():
            if env.kind is EnvKind.RESTORABLE:
                got = env.restore(r.rollout, 0)
                check_revision(r, name, r.turn, 0, got, got == 0)
            elif env.kind is EnvKind.RESTART_ONLY:
                r.epochs[name] = env.fence(r.rollout)

    def _in_flight(self, rollout: str, what: str) -> InFlight:
        r = self._flight.get(rollout)
        if r is None:
            where = "finished" if rollout in self._finished else "not started (start() it)"
            raise ConfigError(f"{what}({rollout!r}): the rollout is not in flight: {where}")
        return r

    def _current(self, turn: Turn, what: str) -> OpenTurn:
        """The open turn of this handle; a handle of an older attempt or of before a restore fails
        closed."""
        return check_handle(
            turn,
            self._flight.get(turn.rollout),
            self._open.get(turn.rollout),
            self._generation,
            what,
        )

    def _resume_if_pending(self) -> None:
        if self._pending_resume:
            self.resume()

    def _record_turn(self, r: InFlight, turn: Turn, o: OpenTurn) -> None:
        calls: list[JsonObject] = [
            {
                "call_id": c.call_id,
                "env": c.env,
                "kind": self.envs[c.env].kind.value,
                "index": c.index,
                "args": c.args_digest,
                "revision": c.revision,
            }
            for c in o.calls
        ]
        self._records.write(
            "turn",
            rollout=r.rollout,
            prompt=r.prompt,
            attempt=r.attempt,
            turn=turn.turn,
            seed=turn.seed,
            tokens=tokens_digest(o.model_tokens),
            conv=tokens_digest(r.tokens),
            calls=calls,
            model_calls=o.model_calls,
            seq=self._seq,
            step=self._step,
        )
