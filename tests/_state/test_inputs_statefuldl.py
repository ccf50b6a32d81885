"""torchdata's StatefulDataLoader (what torchtitan and verl checkpoint) as a state item, with worker
processes and a shuffle, on a model with a Dropout: SIGKILLed mid-epoch (batches in flight in the
workers) and resumed, the run ends bitwise equal to the uninterrupted one and ``ckptguard prove``
says PROVEN; left out of the state, the resume re-reads the epoch and ``prove`` FAILs "data order
identical"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "torchdata.stateful_dataloader",
    reason="torchdata not installed: pip install ckptguard[torchdata]",
)

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "statefuldl_job.py"
KILL_AT = 17  # mid-epoch 2 (10 steps an epoch); the last save before it is step 15, mid-epoch too

pytestmark = pytest.mark.timeout(600)


def _env() -> dict:
    return {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_"))
        },
        "PYTHONPATH": str(REPO / "src"),
        "OMP_NUM_THREADS": "1",
    }


def _launch(root: Path, kill_at: int, *flags: str) -> subprocess.CompletedProcess:
    root.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, str(JOB), str(root), str(kill_at), *flags],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )


def _result(proc: subprocess.CompletedProcess) -> dict:
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(line[len("RESULT ") :])


def _prove(root: Path) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "ckptguard.cli", "prove", "--json", str(root)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    return proc.returncode, json.loads(proc.stdout)


def _killed_and_resumed(tmp: Path, *flags: str) -> tuple[dict, dict]:
    ref = _result(_launch(tmp / "ref", 0, *flags))
    first = _launch(tmp / "killed", KILL_AT, *flags)
    assert first.returncode == -9, first.stderr[-3000:]
    return ref, _result(_launch(tmp / "killed", 0, *flags))


@pytest.mark.parametrize("flags", [("--own-generator",), ()], ids=["own-generator", "global-rng"])
def test_a_stateful_dataloader_with_workers_killed_mid_epoch_resumes_bitwise_and_is_proven(
    tmp_path, flags
):
    """Both with the loader's own generator (the recipe) and without one: its iterator rebuilt from
    the loaded state draws a seed from torch's global RNG (torchdata 0.11), and the digest check
    after the restore, which builds it, puts the global RNG back, so the dropout masks after the
    resume are the uninterrupted run's."""
    ref, resumed = _killed_and_resumed(tmp_path, *flags)
    assert resumed["start"] == 15 and resumed["step"] == ref["step"] == 25
    assert (
        resumed["seen"] == ref["seen"][15 * 4 :]
    )  # the rest of the epoch, then the next ones, in order
    assert resumed["params"] == ref["params"] and resumed["optim"] == ref["optim"]
    rc, proof = _prove(tmp_path / "killed")
    gates = {g["gate"]: g for g in proof["gates"]}
    assert rc == 0 and proof["verdict"] == "resume PROVEN", proof
    assert (
        "steps 16-17 replayed after the restore of step 15"
        in gates["data order identical"]["evidence"]
    )
    assert gates["replayed steps identical"]["status"] == "PASS"
    assert "loader" in gates["digests equal, item by item"]["evidence"]


def test_a_stateful_dataloader_left_out_of_the_state_fails_the_data_order_gate(tmp_path):
    ref, resumed = _killed_and_resumed(tmp_path, "--own-generator", "--loader-not-in-state")
    assert resumed["seen"] != ref["seen"][15 * 4 :]  # the resume started the epoch over
    rc, proof = _prove(tmp_path / "killed")
    gates = {g["gate"]: g for g in proof["gates"]}
    assert rc == 1 and gates["data order identical"]["status"] == "FAIL", proof


@pytest.mark.parametrize("own_generator", [True, False], ids=["own-generator", "global-rng"])
def test_a_fresh_run_with_a_stateful_dataloader_draws_what_it_draws_without_ckptguard(
    tmp_path, own_generator
):
    """ckptguard never changes the training: a restore (fresh start) and a save read the loader's
    state_dict() before its first iteration, which builds the iterator the loop's iter() then
    reuses, drawing the same."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    import ckptguard as cg

    def run(root: Path | None) -> tuple[list, float]:
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 2)
        loader = StatefulDataLoader(
            list(range(20)),
            batch_size=2,
            shuffle=True,
            num_workers=2,
            generator=torch.Generator() if own_generator else None,
        )
        if root is not None:
            root.mkdir()
            mgr = cg.CheckpointManager(root)
            mgr.restore({"model": model, "loader": loader})
            mgr.save(1, {"model": model, "loader": loader})
        return [b.tolist() for b in loader], torch.rand(1).item()

    assert run(tmp_path / "ck") == run(None)
