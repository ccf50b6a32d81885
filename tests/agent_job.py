"""Environments and a small multi-turn loop for the tests of TurnLedger (tests/test_turns*.py).

``FileEnv``: an environment of any of the three kinds whose state and own record of effects live in
one JSON file (rewritten atomically per call, so a SIGKILL leaves the last completed call): what the
environment did is then known independently of ckptguard, across kills of the job.

``python tests/agent_job.py ROOT WORK [--die-at-seq N] [--control C]`` runs the loop: 6 rollouts of
a few turns each, two in flight at a time, a model that draws its tokens from the turn's seed, an
environment call of each kind chosen from the drawn tokens, a CheckpointManager save of the ledger
(and a tensor witness of every finished rollout) after every loop step. ``--die-at-seq N`` SIGKILLs
the job when the ledger's record sequence reaches N: after the environment's effect, before the turn
is recorded (the hardest moment). ``--control``: ``no-turns`` leaves the ledger out of the saved
state, ``new-ids`` re-issues calls under a new call id, ``wrong-revision`` restores the restorable
environment one revision back. Prints ``RESULT {json}`` (the witness and the finished
conversations).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

from ckptguard.environments import Effect, EnvCall, EnvKind, EnvResult


class FileEnv:
    """A per-rollout counter with a log of effects, of the declared kind, kept in ``path``."""

    def __init__(
        self,
        name: str,
        kind: EnvKind,
        path: Path,
        *,
        restore_off_by: int = 0,
        rename_ids: bool = False,
    ) -> None:
        self.name, self.kind, self.path = name, kind, Path(path)
        self.restore_off_by = (
            restore_off_by  # the wrong-revision control: restores that many revisions back
        )
        self.rename_ids = (
            rename_ids  # the new-ids control: an adapter that mints a new id per process
        )
        self.data: dict[str, Any] = {"rev": {}, "fence": {}, "first": {}, "log": []}
        if self.path.exists():
            self.data = json.loads(self.path.read_text())

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)

    def call(self, call: EnvCall) -> EnvResult:
        cid = f"{call.call_id}#{os.getpid()}" if self.rename_ids else call.call_id
        if self.kind is EnvKind.IDEMPOTENT and cid in self.data["first"]:
            value, rev, digest = self.data["first"][cid]
            return EnvResult(value, rev, digest)
        if self.kind is EnvKind.RESTART_ONLY and call.epoch != self.data["fence"].get(
            call.rollout, 0
        ):
            raise RuntimeError(
                f"{self.name}: stale attempt of rollout {call.rollout} (epoch {call.epoch})"
            )
        rev = self.data["rev"].get(call.rollout, 0) + 1
        live = sum(1 for e in self.data["log"] if e["rollout"] == call.rollout and e["live"])
        value = live * 10 + int(call.args["x"])
        self.data["rev"][call.rollout] = rev
        self.data["log"].append(
            Effect(cid, call.rollout, call.attempt, call.turn, call.index, rev).to_json()
        )
        if self.kind is EnvKind.IDEMPOTENT:
            self.data["first"][cid] = [value, rev, call.args_digest]
        self._save()
        return EnvResult(value, rev, call.args_digest)

    def revision(self, rollout: str) -> int:
        return int(self.data["rev"].get(rollout, 0))

    def restore(self, rollout: str, revision: int) -> int:
        actual = max(0, revision - self.restore_off_by) if revision else 0
        for e in self.data["log"]:
            if e["rollout"] == rollout and e["revision"] > actual:
                e["live"] = False
        self.data["rev"][rollout] = actual
        self._save()
        return (
            revision if self.restore_off_by else actual
        )  # the buggy one reports what it was asked

    def fence(self, rollout: str) -> int:
        for e in self.data["log"]:
            if e["rollout"] == rollout:
                e["live"] = False
        rev = self.data["rev"].get(rollout, 0) + 1
        self.data["rev"][rollout] = self.data["fence"][rollout] = rev
        self._save()
        return rev

    def effects(self) -> list[Effect]:
        return [Effect.from_json(e) for e in self.data["log"]]


def envs(
    work: Path, control: str = "", kinds: tuple[EnvKind, ...] = tuple(EnvKind)
) -> list[FileEnv]:
    return [
        FileEnv(
            k.value,
            k,
            work / f"{k.value}.json",
            restore_off_by=int(control == "wrong-revision"),
            rename_ids=control == "new-ids" and k is EnvKind.IDEMPOTENT,
        )
        for k in kinds
    ]


def model(seed: int, n: int = 3) -> list[int]:
    """The tokens a seeded model call draws (the stand-in for a per-request seeded engine)."""
    rng = random.Random(seed)
    return [rng.randrange(50) for _ in range(n)]


USES = [
    ("idempotent", "restorable"),
    ("idempotent", "restart-only"),
    ("idempotent", "restorable", "restart-only"),
]
"""The environments each prompt's rollouts may call: prompt 0's always continue, prompt 1's
restart."""


def choose(tokens: list[int], prompt: int) -> list[tuple[str, int]]:
    """The calls a turn makes (environment, argument), chosen from its tokens (a tool call parsed
    from them)."""
    names = USES[prompt]
    return [(names[t % len(names)], t) for t in tokens[:2] if t % 4 != 3]


def turns_of(rollout: str) -> int:
    return 2 + sum(map(ord, rollout)) % 3


ROLLOUTS = [f"p{p}/s{s}" for p in range(3) for s in range(2)]
AT_ONCE = 2


def job(root: Path, work: Path, die_at_seq: int | None, control: str) -> dict[str, Any]:
    import torch

    import ckptguard as cg

    ledger = cg.TurnLedger(envs(work, control), root=root)
    progress = torch.zeros(
        len(ROLLOUTS), dtype=torch.int64
    )  # 0 not started, 1 in flight, 2 finished
    witness = torch.zeros(
        3, dtype=torch.int64
    )  # per prompt: what its finished rollouts' tokens sum to
    state: dict[str, Any] = {"progress": progress, "witness": witness}
    if control != "no-turns":
        state["turns"] = ledger
    mgr = cg.CheckpointManager(
        root, config=cg.CheckpointConfig(retention=cg.KeepLast(2), timeout_s=60)
    )
    step = mgr.restore(state, mode=cg.ResumeMode.AUTO)
    while bool((progress < 2).any()):
        step += 1
        active = [i for i in range(len(ROLLOUTS)) if progress[i] == 1]
        for i in range(len(ROLLOUTS)):
            if len(active) < AT_ONCE and progress[i] == 0:
                progress[i] = 1
                active.append(i)
        for i in active:
            rid, prompt = ROLLOUTS[i], i // 2
            if rid not in ledger.in_flight:
                ledger.start(rid, prompt, [1, prompt])
            turn = ledger.next_turn(rid, step=step)
            tokens = model(turn.seed)
            ledger.model_call(turn, tokens)
            answers = [ledger.env_call(turn, env, {"x": t}) for env, t in choose(tokens, prompt)]
            if die_at_seq is not None and ledger.state_dict()["seq"] + 1 >= die_at_seq:
                os.kill(
                    os.getpid(), signal.SIGKILL
                )  # after the effects, before the turn is committed
            ledger.end_turn(turn, [a % 50 for a in answers])
            if turn.turn == turns_of(rid):
                conv = ledger.finish(rid)
                ledger.acknowledge([rid])
                progress[i] = 2
                witness[prompt] += sum(conv.tokens) + 1
        mgr.save(step, state)
    ledger.record_effects()
    return {"witness": witness.tolist(), "step": step}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("work")
    p.add_argument("--die-at-seq", type=int)
    p.add_argument("--control", default="", choices=["", "no-turns", "new-ids", "wrong-revision"])
    a = p.parse_args()
    print(
        "RESULT " + json.dumps(job(Path(a.root), Path(a.work), a.die_at_seq, a.control)), flush=True
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
