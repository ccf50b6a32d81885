"""TurnLedger: in-flight multi-turn rollouts saved at their last turn, resumed by their
environments' kinds.

In one process, with the file-backed environments of tests/agent_job.py (their own record of
effects survives the ledger): a "kill" is dropping the ledger and the adapters and building new
ones from the saved state and the environments' files."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptguard as cg
from agent_job import FileEnv, envs
from ckptguard._state.turnstate import tokens_from_text
from ckptguard.environments import EnvKind
from ckptguard.turns import turn_seed

IDEM, RESTORE, ONLY = EnvKind.IDEMPOTENT, EnvKind.RESTORABLE, EnvKind.RESTART_ONLY


def saved(ledger: cg.TurnLedger) -> dict[str, Any]:
    """The ledger's state as a checkpoint holds it: through torch.save and a weights_only load."""
    buf = io.BytesIO()
    torch.save({"turns": ledger.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["turns"]  # type: ignore[no-any-return]


def reborn(
    work: Path, state: dict[str, Any], kinds: tuple[EnvKind, ...] = tuple(EnvKind), **kw: Any
) -> cg.TurnLedger:
    """A new process: new adapters over the environments' files, a new ledger loaded from
    ``state``."""
    ledger = cg.TurnLedger(envs(work, kinds=kinds), **kw)
    ledger.load_state_dict(state)
    return ledger


def turn(ledger: cg.TurnLedger, rid: str, calls: list[tuple[str, int]], step: int = 1) -> list[Any]:
    t = ledger.next_turn(rid, step=step)
    ledger.model_call(t, [t.seed % 50])
    out = [ledger.env_call(t, env, {"x": x}) for env, x in calls]
    ledger.end_turn(t, [7])
    return out


def live(work: Path, kind: EnvKind, rollout: str) -> list[str]:
    return [
        e.call_id
        for e in FileEnv(kind.value, kind, work / f"{kind.value}.json").effects()
        if e.live and e.rollout == rollout
    ]


def test_state_loads_with_weights_only_and_holds_the_last_completed_turn(tmp_path):
    ledger = cg.TurnLedger(envs(tmp_path))
    ledger.start("r", 0, [1, 2])
    turn(ledger, "r", [("idempotent", 3)])
    t = ledger.next_turn("r", step=2)  # a turn in progress: not in the state
    ledger.model_call(t, [9, 9])
    state = saved(ledger)
    [r] = state["in_flight"]
    assert r["turn"] == 1 and tokens_from_text(r["tokens"]) == [1, 2, turn_seed(0, "r", 1) % 50, 7]
    assert [c[0] for c in r["calls"]] == ["r/t1/c0"] and r["calls"][0][
        5
    ] == "3"  # committed result, as JSON
    assert reborn(tmp_path, state).conversation("r").tokens == tokens_from_text(r["tokens"])


def test_a_continued_rollout_reissues_a_lost_call_with_its_id_and_runs_no_committed_turn(tmp_path):
    kinds = (IDEM, RESTORE)
    ledger = cg.TurnLedger(envs(tmp_path, kinds=kinds))
    ledger.start("r", 0, [1])
    first = turn(ledger, "r", [("idempotent", 1), ("restorable", 2)])
    state = saved(ledger)
    lost = turn(
        ledger, "r", [("idempotent", 3), ("restorable", 4)], step=2
    )  # took effect, never saved
    assert len(live(tmp_path, RESTORE, "r")) == 2

    again = reborn(tmp_path, state, kinds)
    plan = again.resume()
    assert plan.continued == [("r", 1)] and plan.restarted == []
    assert live(tmp_path, RESTORE, "r") == [
        "r/t1/c1"
    ]  # the lost turn's effect undone (revision 1 restored)
    t = again.next_turn("r", step=2)
    assert t.turn == 2 and t.seed == turn_seed(0, "r", 2)
    assert [
        again.env_call(t, "idempotent", {"x": 3}),
        again.env_call(t, "restorable", {"x": 4}),
    ] == lost
    assert live(tmp_path, IDEM, "r") == [
        "r/t1/c0",
        "r/t2/c0",
    ]  # the repeated id took no second effect
    assert live(tmp_path, RESTORE, "r") == ["r/t1/c1", "r/t2/c1"]
    assert again.result("r/t1/c0") == first[0]  # a committed turn's result comes from the ledger


def test_a_rollout_that_called_a_restart_only_environment_restarts_fenced(tmp_path):
    ledger = cg.TurnLedger(envs(tmp_path))
    ledger.start("r", 0, [1])
    turn(ledger, "r", [("restart-only", 5)])
    state = saved(ledger)
    again = reborn(tmp_path, state)
    plan = again.resume()
    assert plan.restarted == [("r", 1, "restart-only")] and plan.continued == []
    assert live(tmp_path, ONLY, "r") == []  # fenced: the earlier attempt's effect no longer stands
    t = again.next_turn("r", step=1)
    assert (t.turn, t.attempt, t.tokens) == (1, 1, (1,))
    assert (
        again.env_call(t, "restart-only", {"x": 5}) == 5
    )  # the same answer as the first attempt got
    old = FileEnv("restart-only", ONLY, tmp_path / "restart-only.json")
    with pytest.raises(RuntimeError, match="stale attempt"):  # the environment's own fence
        old.call(cg.environments.EnvCall("r/t1/c0", "r", 0, 1, 0, {"x": 5}, "d", epoch=1))


def test_an_idempotent_environment_behind_the_checkpoint_fails_closed_naming_rollout_and_turn(
    tmp_path,
):
    ledger = cg.TurnLedger(envs(tmp_path, kinds=(IDEM,)))
    ledger.start("r", 0, [1])
    turn(ledger, "r", [("idempotent", 1)])
    state = saved(ledger)
    (
        tmp_path / "idempotent.json"
    ).unlink()  # the database restored from an older backup: the effect is gone
    with pytest.raises(
        cg.StateMismatchError,
        match=r"rollout 'r', turn 1: environment 'idempotent' holds revision 0",
    ):
        reborn(tmp_path, state, (IDEM,)).resume()


def test_a_restorable_environment_restored_elsewhere_fails_closed(tmp_path):
    ledger = cg.TurnLedger(envs(tmp_path, kinds=(RESTORE,)))
    ledger.start("r", 0, [1])
    turn(ledger, "r", [("restorable", 1)])
    state = saved(ledger)
    env = FileEnv("restorable", RESTORE, tmp_path / "restorable.json")
    env.restore = lambda rollout, revision: revision + 1  # type: ignore[method-assign]
    again = cg.TurnLedger([env])
    again.load_state_dict(state)
    with pytest.raises(
        cg.StateMismatchError, match=r"rollout 'r', turn 1: .* revision 2 .* committed revision 1"
    ):
        again.resume()


def test_a_handle_of_before_the_restore_is_a_stale_attempt(tmp_path):
    ledger = cg.TurnLedger(envs(tmp_path, kinds=(IDEM,)))
    ledger.start("r", 0, [1])
    t = ledger.next_turn("r", step=1)
    ledger.load_state_dict(saved(ledger))
    with pytest.raises(
        cg.StateMismatchError, match=r"stale attempt: rollout 'r', turn 1 \(attempt 0\)"
    ):
        ledger.env_call(t, "idempotent", {"x": 1})


def test_a_reissued_call_with_other_arguments_fails_closed(tmp_path):
    ledger = cg.TurnLedger(envs(tmp_path, kinds=(IDEM,)))
    ledger.start("r", 0, [1])
    t = ledger.next_turn("r", step=1)
    ledger.env_call(t, "idempotent", {"x": 1})  # in flight at the save: issued, no committed result
    state = saved(ledger)
    assert state["in_flight"][0]["pending"][0][0] == "r/t1/c0"
    again = reborn(tmp_path, state, (IDEM,))
    t = again.next_turn("r", step=1)
    with pytest.raises(
        cg.StateMismatchError, match=r"rollout 'r', turn 1: call id 'r/t1/c0' was issued before"
    ):
        again.env_call(t, "idempotent", {"x": 2})


def test_a_finished_rollout_is_never_also_resumable_work(tmp_path):
    ledger = cg.TurnLedger(envs(tmp_path, kinds=(IDEM,)))
    ledger.start("r", 0, [1])
    turn(ledger, "r", [("idempotent", 1)])
    done = ledger.finish("r")
    state = saved(ledger)
    assert state["in_flight"] == [] and [r["rollout"] for r in state["finished"]] == ["r"]
    assert done.tokens == reborn(tmp_path, state, (IDEM,)).finished["r"].tokens
    both = {**state, "in_flight": state["finished"]}
    with pytest.raises(cg.StateMismatchError, match=r"\['r'\] are both finished and in flight"):
        reborn(tmp_path, both, (IDEM,))
    with pytest.raises(cg.ConfigError, match="not in flight: finished"):
        ledger.next_turn("r", step=2)


def test_continued_rollouts_are_not_new_work_for_the_prompt_ledger(tmp_path):
    prompts = cg.RolloutLedger(range(4))
    ledger = cg.TurnLedger(envs(tmp_path, kinds=(IDEM,)), prompts=prompts)
    for _ in range(2):
        pid = prompts.next_prompt()
        ledger.start(f"p{pid}", pid, [1])
    turn(ledger, "p0", [("idempotent", 1)])
    p_state, t_state = prompts.state_dict(), saved(ledger)

    prompts2 = cg.RolloutLedger(range(4))
    prompts2.load_state_dict(p_state)
    again = reborn(tmp_path, t_state, (IDEM,), prompts=prompts2)
    assert again.resume().prompts == [0, 1]
    assert prompts2.in_flight == {0: 0, 1: 0} and prompts2.pending_reissue == []
    assert prompts2.next_prompt() == 2  # not 0 again: its rollout goes on in the turn ledger


def test_run_seed_must_match_the_saving_run(tmp_path):
    state = saved(cg.TurnLedger(envs(tmp_path), run_seed=1))
    with pytest.raises(cg.StateMismatchError, match="run_seed 1, this ledger has 0"):
        reborn(tmp_path, state)


def test_turn_records_survive_a_line_torn_by_a_kill(tmp_path):
    from ckptguard.ops.prove_turns import read_turn_records

    root = tmp_path / "root"
    (root / "proof").mkdir(parents=True)
    (root / "proof" / "turns_rank_00000.jsonl").write_text(
        '{"event": "turn", "pid": 1, "roll'
    )  # killed mid-append
    ledger = cg.TurnLedger(envs(tmp_path, kinds=(IDEM,)), root=root)
    ledger.start("r", 0, [1])
    turn(ledger, "r", [("idempotent", 1)])
    [rec] = read_turn_records(root)[0]
    assert (rec["event"], rec["rollout"], rec["turn"], rec["calls"][0]["call_id"]) == (
        "turn",
        "r",
        1,
        "r/t1/c0",
    )


def test_arguments_that_are_not_json_are_refused_naming_rollout_and_turn(tmp_path):
    ledger = cg.TurnLedger(envs(tmp_path, kinds=(IDEM,)))
    ledger.start("r", 0, [1])
    t = ledger.next_turn("r", step=1)
    with pytest.raises(
        cg.ConfigError, match=r"env_call\(rollout 'r', turn 1\): the arguments must be JSON values"
    ):
        ledger.env_call(t, "idempotent", {"x": object()})


def _two_ranks(rank: int, world: int, root: str, work: str) -> list[Any]:
    mine = Path(work) / f"rank{rank}"
    mine.mkdir(parents=True, exist_ok=True)
    ledger = cg.TurnLedger(envs(mine, kinds=(IDEM,)), rank=rank, root=root)
    ledger.start(f"r{rank}", rank, [1, rank])
    turn(ledger, f"r{rank}", [("idempotent", rank)])
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(timeout_s=60))
    mgr.save(1, {"turns": ledger})
    again = cg.TurnLedger(envs(mine, kinds=(IDEM,)), rank=rank, root=root)
    assert (
        cg.CheckpointManager(root, config=cg.CheckpointConfig(timeout_s=60)).restore(
            {"turns": again}
        )
        == 1
    )
    return [again.resume().continued, again.conversation(f"r{rank}").tokens]


@pytest.mark.slow  # a gloo group of two spawned ranks
def test_each_rank_saves_and_gets_back_its_own_in_flight_rollouts(tmp_path):
    from ckptguard.testing import run_ranks, values

    got = values(run_ranks(_two_ranks, 2, str(tmp_path / "root"), str(tmp_path / "work")))
    assert [g[0] for g in got] == [[("r0", 1)], [("r1", 1)]]
    assert [g[1][:2] for g in got] == [[1, 0], [1, 1]]  # the prompt of each rank's own rollout
