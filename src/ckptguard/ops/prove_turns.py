"""The turn gates of ``prove``: multi-turn rollouts across a kill (``TurnLedger``'s evidence).

Reads ``ROOT/proof/turns_rank_*.jsonl`` (turn, finish, resume and effects records; one process
after another, each starting with a ``resume`` record when it restored a ledger) and the restore
records of ``proof/rank_*.jsonl``. Per rank, the records that a resume restored are found by
walking back the chain of resumes: a resume of sequence number S continues the latest earlier
process that recorded S, whose records up to S are committed, and so on back to a fresh start.

- ``environment calls took effect once``: in each environment's own record of its effects (the
  newest ``effects`` record), no call id took effect twice, no call of a rollout, turn and index
  took effect under two call ids, and every call of the final history's turns took effect (and
  still stands) exactly once.
- ``in-flight rollouts continued or restarted by kind``: every rollout in flight at a restored
  save was continued at its last turn, or restarted from its prompt under a new attempt where a
  restart-only environment forced it; none lost, none twice, no committed turn run again.
- ``continued turns' tokens equal``: a turn of a rollout run again with the same seed (by the
  killed run and the resumed one) produced the same tokens.

Each FAIL names the rank, the rollout, the turn and the call id. No turn records: no rows.
``rows`` returns plain tuples; ``prove`` wraps them as its ``Gate`` rows.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from .._disk.layout import PROOF_DIR, read_small, refuse_link
from .._records.proofreader import PROOF_BYTES, read_records
from ..environments import Effect
from ..errors import CheckpointCorruptError

__all__ = ["GATE_KIND", "GATE_ONCE", "GATE_TOKENS", "Row", "read_turn_records", "rows"]

GATE_ONCE = "environment calls took effect once"
GATE_KIND = "in-flight rollouts continued or restarted by kind"
GATE_TOKENS = "continued turns' tokens equal"
SHOWN = 4  # findings named per gate; the count says how many there are


class Row(NamedTuple):
    """One gate: name, status (PASS, FAIL, MISSING, INFO), evidence, whether the verdict needs it to
    pass."""

    name: str
    status: str
    evidence: str
    required: bool = True


Record = dict[str, Any]


@dataclass
class _Run:
    """One process's turn records on one rank (a relaunch is the next run)."""

    pid: int
    records: list[Record] = field(default_factory=list)

    @property
    def resume(self) -> Record | None:
        return next((r for r in self.records if r["event"] == "resume"), None)

    @property
    def base(self) -> int:
        return int(self.resume["seq"]) if self.resume is not None else 0

    @property
    def top(self) -> int:
        return max((int(r["seq"]) for r in self.records if "seq" in r), default=self.base)

    def turns(self) -> list[Record]:
        return [r for r in self.records if r["event"] in ("turn", "finish")]


# ---------------------------------------------------------------- reading

_FIELDS = {
    "turn": ("rollout", "attempt", "turn", "seed", "tokens", "calls", "seq"),
    "finish": ("rollout", "attempt", "turns", "seq"),
    "resume": ("seq", "continued", "restarted"),
    "effects": ("env", "kind", "effects"),
}


def read_turn_records(root: Path) -> dict[int, list[Record]]:
    """Every rank's turn records, in the order written; a torn last line (a kill mid-append) is left
    out, any other bad line is one CheckpointCorruptError naming file and line."""
    directory = Path(root) / PROOF_DIR
    if not directory.is_dir():
        return {}
    refuse_link(directory, "proof directory")
    out: dict[int, list[Record]] = {}
    for path in sorted(directory.glob("turns_rank_*.jsonl")):
        try:
            rank = int(path.stem.rsplit("_", 1)[1])
        except ValueError:
            continue  # not a name TurnLedger writes
        lines = (
            read_small(path, limit=PROOF_BYTES, what="turn records")
            .decode("utf-8", "replace")
            .splitlines()
        )
        out[rank] = [
            r for n, line in enumerate(lines, 1) if (r := _parsed(path, n, line, n == len(lines)))
        ]
    return out


def _parsed(path: Path, n: int, line: str, last: bool) -> Record | None:
    if not line.strip():
        return None
    try:
        rec = json.loads(line)
    except ValueError:
        if last or line.startswith("{"):
            return (
                None  # torn by a kill mid-append (the next process's first append ended the line)
            )
        raise CheckpointCorruptError(
            f"{path}:{n}: not a JSON line; turn records are written by TurnLedger only: "
            "cut that line to judge the rest"
        ) from None
    event = str(rec.get("event")) if isinstance(rec, dict) else ""
    missing = [
        k
        for k in ("event", "pid", *_FIELDS.get(event, ()))
        if not isinstance(rec, dict) or k not in rec
    ]
    if missing:
        raise CheckpointCorruptError(
            f"{path}:{n}: a turn record without field(s) {missing}; cut that line to judge the rest"
        )
    return rec  # type: ignore[no-any-return]


def _runs(records: list[Record]) -> list[_Run]:
    runs: list[_Run] = []
    for rec in records:
        if not runs or runs[-1].pid != rec["pid"]:
            runs.append(_Run(int(rec["pid"])))
        runs[-1].records.append(rec)
    return runs


def _committed(runs: list[_Run], i: int, seq: int) -> list[Record]:
    """The turn and finish records the state of sequence number ``seq`` holds, as seen before run
    ``i``."""
    out: list[Record] = []
    while seq > 0:
        j = next((j for j in range(i - 1, -1, -1) if runs[j].base < seq <= runs[j].top), None)
        if j is None:
            j = next((j for j in range(i - 1, -1, -1) if runs[j].base == seq), None)
            if j is None:
                break  # the records of that state are gone (pruned or never written)
            i, seq = j, runs[j].base
            continue
        out = [r for r in runs[j].turns() if runs[j].base < int(r["seq"]) <= seq] + out
        i, seq = j, runs[j].base
    return out


def _history(runs: list[_Run], i: int) -> list[Record]:
    """What run ``i`` built on (its restored state's records) and its own turn and finish
    records."""
    return _committed(runs, i, runs[i].base) + runs[i].turns()


# ---------------------------------------------------------------- in flight at a save


@dataclass
class _Flight:
    rollout: str
    attempt: int
    turn: int
    forced: str | None  # a restart-only environment its committed turns called
    calls: list[str]


def _in_flight(committed: list[Record]) -> dict[str, _Flight]:
    out: dict[str, _Flight] = {}
    for r in committed:
        rid = str(r["rollout"])
        if r["event"] == "finish":
            out.pop(rid, None)
            continue
        prev = out.get(rid)
        if prev is None or prev.attempt != r["attempt"]:
            prev = out[rid] = _Flight(rid, int(r["attempt"]), 0, None, [])
        prev.turn = int(r["turn"])
        for c in r["calls"]:
            prev.calls.append(str(c["call_id"]))
            if c.get("kind") == "restart-only" and prev.forced is None:
                prev.forced = f"{c['env']} (call {c['call_id']})"
    return out


# ---------------------------------------------------------------- gates


def rows(root: Path) -> list[Row]:
    """The three turn gates of ``root``; none when no TurnLedger recorded there."""
    try:
        records = read_turn_records(Path(root))
    except (CheckpointCorruptError, OSError) as exc:
        # evidence that cannot be read is missing evidence, never a difference found (prove's
        # MISSING)
        return [
            Row(g, "MISSING", f"turn records unreadable: {exc}")
            for g in (GATE_ONCE, GATE_KIND, GATE_TOKENS)
        ]
    if not any(records.values()):
        return []
    restores = _restores(Path(root))
    per_rank = {rank: _runs(recs) for rank, recs in sorted(records.items())}
    return [
        _combine(GATE_ONCE, [_gate_once(rank, runs) for rank, runs in per_rank.items()]),
        _combine(
            GATE_KIND,
            [_gate_kind(rank, runs, restores.get(rank, {})) for rank, runs in per_rank.items()],
        ),
        _combine(GATE_TOKENS, [_gate_tokens(rank, runs) for rank, runs in per_rank.items()]),
    ]


def _restores(root: Path) -> dict[int, dict[int, int]]:
    """Rank -> pid -> the step its restore put back (prove's records; none where they are
    unreadable)."""
    try:
        recs = read_records(root)
    except (CheckpointCorruptError, OSError):
        return {}
    return {
        rank: {int(r["pid"]): int(r.get("step") or 0) for r in rs if r["event"] == "restore"}
        for rank, rs in recs.items()
    }


def _combine(name: str, results: list[tuple[str, str, bool]]) -> Row:
    statuses = [s for s, _, _ in results]
    status = next((s for s in ("FAIL", "MISSING", "PASS") if s in statuses), "INFO")
    shown = [e for s, e, _ in results if s == status]
    return Row(name, status, "; ".join(dict.fromkeys(shown)), any(req for _, _, req in results))


def _named(findings: list[str]) -> str:
    more = f" (and {len(findings) - SHOWN} more)" if len(findings) > SHOWN else ""
    return "; ".join(findings[:SHOWN]) + more


def _newest_effects(runs: list[_Run]) -> dict[str, tuple[float, list[Effect]]]:
    out: dict[str, tuple[float, list[Effect]]] = {}
    for run in runs:
        for r in run.records:
            if r["event"] == "effects":
                out[str(r["env"])] = (
                    float(r.get("time", 0)),
                    [Effect.from_json(e) for e in r["effects"]],
                )
    return out


def _gate_once(rank: int, runs: list[_Run]) -> tuple[str, str, bool]:
    last = max(
        (i for i, run in enumerate(runs) if run.turns() or run.resume is not None), default=None
    )
    history = [] if last is None else _history(runs, last)
    # a restarted rollout's newer attempt re-issues its earlier calls' ids: the newest issue of each
    # id counts
    calls = list(
        {c["call_id"]: (r, c) for r in history if r["event"] == "turn" for c in r["calls"]}.values()
    )
    try:
        effects = _newest_effects(runs)
    except ValueError as exc:
        return "FAIL", f"rank {rank}: an effects record is malformed ({exc})", True
    if not effects:
        if not calls:
            return "INFO", f"rank {rank}: no environment call recorded", False
        return (
            "MISSING",
            (
                f"rank {rank}: {len(calls)} environment call(s), and no environment reported its "
                f"own record of effects (TurnLedger.record_effects)"
            ),
            True,
        )
    findings = []
    for env, (_, got) in sorted(effects.items()):
        findings += _twice(rank, env, got)
    findings += _missing(rank, calls, effects)
    if findings:
        return "FAIL", _named(findings), True
    counted = sum(len(got) for _, got in effects.values())
    return (
        "PASS",
        (
            f"rank {rank}: {len(calls)} committed call(s) each took effect once in the "
            f"environments' own records ({', '.join(sorted(effects))}: {counted} effect(s), "
            f"{sum(not e.live for _, got in effects.values() for e in got)} undone or fenced)"
        ),
        True,
    )


def _twice(rank: int, env: str, effects: list[Effect]) -> list[str]:
    live = [e for e in effects if e.live]
    by_id: dict[str, list[Effect]] = defaultdict(list)
    by_call: dict[tuple[str, int, int], set[str]] = defaultdict(set)
    for e in live:
        by_id[e.call_id].append(e)
        by_call[(e.rollout, e.turn, e.index)].add(e.call_id)
    out = [
        f"rank {rank}, rollout {es[0].rollout!r}, turn {es[0].turn}: call id {cid!r} took effect "
        f"{len(es)} times in {env!r} (revisions {[e.revision for e in es]})"
        for cid, es in by_id.items()
        if len(es) > 1
    ]
    out += [
        f"rank {rank}, rollout {rid!r}, turn {turn}: call {index} took effect in {env!r} under "
        f"{len(ids)} call ids {sorted(ids)} (re-issued with a new call id)"
        for (rid, turn, index), ids in by_call.items()
        if len(ids) > 1
    ]
    return out


def _missing(
    rank: int, calls: list[tuple[Record, Any]], effects: dict[str, tuple[float, list[Effect]]]
) -> list[str]:
    out = []
    for r, c in calls:
        env = str(c["env"])
        if env not in effects or float(r.get("time", 0)) > effects[env][0]:
            continue  # its environment reported before this call: nothing to compare
        live = [e for e in effects[env][1] if e.call_id == c["call_id"] and e.live]
        if len(live) != 1:
            gone = [e.revision for e in effects[env][1] if e.call_id == c["call_id"]]
            why = (
                f"undone or fenced (effects at revisions {gone})"
                if gone
                else "absent from its record"
            )
            out.append(
                f"rank {rank}, rollout {r['rollout']!r}, turn {r['turn']}: committed call id "
                f"{c['call_id']!r} has {len(live)} standing effect(s) in {env!r}: {why}"
            )
    return out


def _gate_kind(rank: int, runs: list[_Run], restores: dict[int, int]) -> tuple[str, str, bool]:
    findings: list[str] = []
    judged = 0
    for i, run in enumerate(runs):
        if run.resume is not None:
            judged += 1
            findings += _judge_resume(rank, runs, i)
        elif restores.get(run.pid, 0) > 0 and i > 0 and run.turns():
            judged += 1
            findings += _unrestored(rank, runs, i, restores[run.pid])
    if findings:
        return "FAIL", _named(findings), True
    if not judged:
        return "MISSING", f"rank {rank}: no resume of a turn ledger recorded", True
    return (
        "PASS",
        (
            f"rank {rank}: {judged} resume(s): every in-flight rollout continued at its last turn "
            f"or restarted where a restart-only environment said so; no committed turn run again"
        ),
        True,
    )


def _judge_resume(rank: int, runs: list[_Run], i: int) -> list[str]:
    run, resume = runs[i], runs[i].resume
    assert resume is not None
    flight = _in_flight(_committed(runs, i, run.base))
    continued = {str(rid): (int(a), int(t)) for rid, a, t, *_ in resume["continued"]}
    restarted = {str(rid): (int(a), int(t)) for rid, a, t, *_ in resume["restarted"]}
    where = f"rank {rank}, pid {run.pid} (resume of seq {run.base})"
    out = [
        f"{where}: rollout {rid!r} continued and restarted"
        for rid in continued.keys() & restarted.keys()
    ]
    for rid, f in flight.items():
        if rid not in continued and rid not in restarted:
            out.append(
                f"{where}: rollout {rid!r} (turn {f.turn} committed) was neither "
                f"continued nor restarted: lost"
            )
        elif rid in continued and f.forced is not None:
            out.append(
                f"{where}: rollout {rid!r}, turn {f.turn}: continued although its committed turns "
                f"called restart-only {f.forced}"
            )
        elif rid in restarted and f.forced is None and f.turn > 0:
            out.append(
                f"{where}: rollout {rid!r}: restarted from its prompt although its environments "
                f"let it continue at turn {f.turn} (calls {f.calls[:3]} re-executed)"
            )
        elif rid in continued and continued[rid] != (f.attempt, f.turn):
            out.append(
                f"{where}: rollout {rid!r} continued at attempt/turn {continued[rid]}, the save "
                f"held {(f.attempt, f.turn)}"
            )
    out += [
        f"{where}: rollout {rid!r} resumed but was not in flight at the save (finished or unknown)"
        for rid in [*continued, *restarted]
        if rid not in flight and (continued.get(rid) or restarted[rid])[1] > 0
    ]
    return out + _rerun(where, run, flight, continued)


def _rerun(
    where: str, run: _Run, flight: dict[str, _Flight], continued: dict[str, tuple[int, int]]
) -> list[str]:
    """Committed turns of continued rollouts that the resumed run ran again."""
    out = []
    for r in run.turns():
        f = flight.get(str(r["rollout"]))
        if (
            r["event"] == "turn"
            and f is not None
            and f.rollout in continued
            and r["attempt"] == f.attempt
            and int(r["turn"]) <= f.turn
        ):
            ids = [c["call_id"] for c in r["calls"]]
            out.append(
                f"{where}: rollout {f.rollout!r}, turn {r['turn']}: a committed turn was run again "
                f"(call ids {ids})"
            )
    return out


def _unrestored(rank: int, runs: list[_Run], i: int, step: int) -> list[str]:
    """A run that restored step ``step`` of the trainer but no turn ledger: the turns it runs
    again."""
    before = [
        r
        for run in runs[:i]
        for r in run.turns()
        if isinstance(r.get("step"), int) and r["step"] <= step
    ]
    flight = _in_flight(before)
    done = {(r["rollout"], r["attempt"], r["turn"]) for r in before if r["event"] == "turn"}
    again = [
        r
        for r in runs[i].turns()
        if r["event"] == "turn"
        and (r["rollout"], r["attempt"], r["turn"]) in done
        and str(r["rollout"]) in flight
    ]
    where = f"rank {rank}, pid {runs[i].pid} (restored step {step} without a turn ledger)"
    out = [
        f"{where}: rollout {r['rollout']!r}, turn {r['turn']}: a committed turn was run again "
        f"(call ids {[c['call_id'] for c in r['calls']]})"
        for r in again
    ]
    if flight and not again:
        out.append(
            f"{where}: rollouts {sorted(flight)[:SHOWN]} were in flight at step {step} and no "
            f"turn ledger put them back"
        )
    return out


def _gate_tokens(rank: int, runs: list[_Run]) -> tuple[str, str, bool]:
    seen: dict[tuple[str, int, int], list[tuple[int, str, list[str]]]] = defaultdict(list)
    for run in runs:
        for r in run.turns():
            if r["event"] == "turn":
                ids = [str(c["call_id"]) for c in r["calls"]]
                seen[(str(r["rollout"]), int(r["turn"]), int(r["seed"]))].append(
                    (run.pid, str(r["tokens"]), ids)
                )
    again = {k: v for k, v in seen.items() if len({pid for pid, _, _ in v}) > 1}
    findings = []
    for (rid, turn, seed), got in again.items():
        if len({t for _, t, _ in got}) > 1:
            shown = ", ".join(f"pid {pid}: {t}" for pid, t, _ in got[:3])
            findings.append(
                f"rank {rank}, rollout {rid!r}, turn {turn} (seed {seed}, call ids {got[-1][2]}): "
                f"tokens differ between runs ({shown})"
            )
    if findings:
        return "FAIL", _named(findings), True
    if not again:
        return (
            "INFO",
            f"rank {rank}: no turn was run by two processes with the same seed: nothing to compare",
            False,
        )
    return (
        "PASS",
        (
            f"rank {rank}: {len(again)} turn(s) run again with the same seed after a kill "
            f"produced the same tokens"
        ),
        True,
    )
