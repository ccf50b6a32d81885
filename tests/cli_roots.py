"""Checkpoint roots for the operator-command tests, written by a process that has exited.

Its write lease then belongs to a dead process, as on a root an operator inspects after a job:
``gc`` and ``adopt`` act on it (a live writer's lease refuses them, as it must).

- ``one``: steps 1, 2, 3 of one CheckpointManager, the tracker moved back to 2 (step 3 is a
  complete orphan for ``adopt``);
- ``run``: step 1 of a RunCheckpoint with the roles actor and driver;
- ``phases``: a phase-records file with one save phase.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_BUILD = """
import sys
from pathlib import Path
import torch
import ckptguard as cg
from ckptguard.memory import PhaseKind, PhaseRecorder, RecorderConfig
base = Path(sys.argv[1])
mgr = cg.CheckpointManager(base / "one", config=cg.CheckpointConfig(retention=None))
model = torch.nn.Linear(16, 16)
for step in (1, 2, 3):
    with torch.no_grad():
        model.weight.add_(1.0)
    mgr.save(step, {"model": model, "n": step})
(base / "one" / "latest_checkpointed_iteration.txt").write_text("2\\n")
run = cg.RunCheckpoint(
    base / "run", [cg.Role("actor"), cg.Role("driver")], config=cg.CheckpointConfig(retention=None)
)
run.save(1, {"actor": {"model": torch.nn.Linear(2, 2)}, "driver": {"n": 1}})
(base / "phases").mkdir()
with PhaseRecorder(RecorderConfig(path=base / "phases" / "rank0.jsonl")).phase(
    PhaseKind.SAVE, step=1
):
    pass
"""


def build_roots(base: Path) -> dict[str, Path]:
    proc = subprocess.run(
        [sys.executable, "-c", _BUILD, str(base)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"one": base / "one", "run": base / "run", "phases": base / "phases"}
