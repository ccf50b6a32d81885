"""A save that ckptguard skips as unhealthy does not look saved to a real HF Trainer (transformers
in .venv-hf): no on_save callback hears of it, no folder of it exists, the next save commits."""

from __future__ import annotations

import json
import subprocess

from test_hf_integration import HF_PYTHON, REPO, _config, _env, needs_hf

__all__ = ["needs_hf"]

_SKIP = r"""
import json, logging, os, sys, warnings
warnings.filterwarnings("ignore")
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
logging.getLogger("transformers").setLevel(logging.WARNING)
sys.path.insert(0, os.environ["TESTS"])
from pathlib import Path
from transformers import TrainerCallback
import ckptguard as cg
import hf_job  # the tiny causal-LM job, configured by sys.argv[1] (mode "hf": a plain Trainer)
from ckptguard.integrations.hf import attach

saves = []

class Saved(TrainerCallback):  # as W&B's on_save does: it takes checkpoint-N to exist
    def on_save(self, args, state, control, **kw):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}" / "hf"
        saves.append([state.global_step, folder.is_dir()])

trainer = hf_job._causal()
trainer.add_callback(Saved())
attach(trainer, health=cg.HealthPolicy(check=lambda step, metrics: step != 4), timeout_s=60)
trainer.train()
mgr = trainer._ckptguard_manager()
print("SKIP" + json.dumps({"saves": saves, "committed": mgr.committed_steps(),
                           "skip": mgr.last_health.skip,
                           "should_save": trainer.control.should_save}))
"""


@needs_hf
def test_a_skipped_unhealthy_save_fires_no_on_save(tmp_path):
    cfg = _config(tmp_path, "skip", trainer="causal", mode="hf", epochs=1, save_steps=2)
    proc = subprocess.run(
        [str(HF_PYTHON), "-c", _SKIP, str(cfg)],
        capture_output=True,
        text=True,
        env=_env({"TESTS": str(REPO / "tests")}),
        timeout=180,
        cwd=cfg.parent,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("SKIP")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(line[len("SKIP") :])
    # 12 samples, 2 per step: saves at 2, 4, 6; step 4 is unhealthy and exists nowhere.
    assert out["committed"] == [2, 6] and out["skip"] is False, out
    assert out["saves"] == [[2, True], [6, True]], out
    assert not out["should_save"]
    assert not (cfg.parent / "out" / "checkpoint-4").exists()
    assert (
        "step 4 NOT committed" in proc.stderr and "on_save callbacks are not called" in proc.stderr
    )
