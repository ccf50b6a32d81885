"""How long the operator commands take from exec to exit, and whether they import torch.

Builds a small root (three steps, one an orphan), a RunCheckpoint root and a phase-records file,
then runs each command REPS times in a new interpreter (``python -m ckptguard.cli ...``) and
reports the median wall time and the median CPU time (user + system of the child, from
``getrusage``), next to ``python -c pass`` and ``python -c 'import torch'``. ``--pythonpath``
runs the same commands against another checkout's ``src`` (the code before a change), with this
interpreter and its torch. The load average is recorded before and after: on a shared machine
read the CPU figures, which load changes far less than wall time.

    python benchmarks/bench_cli_start.py --reps 7 --out benchmarks/results/cli_start.json
    python benchmarks/bench_cli_start.py --reps 3 --pythonpath /path/to/old/src --out before.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS = {
    "--help": ["--help"],
    "list": ["list", "{one}"],
    "list (run root)": ["list", "{run}"],
    "resolve": ["resolve", "{one}"],
    "status": ["status", "{phases}", "--sample", "0.05"],
    "preflight": ["preflight", "{one}"],
    "hold": ["hold", "{one}", "1", "--reason", "bench"],
    "release": ["release", "{one}", "1"],
    "gc --dry-run": ["gc", "{one}", "--dry-run"],
    "gc": ["gc", "{run}"],
    "adopt": ["adopt", "{copy}", "3"],
    "goodput": ["goodput", "{one}"],
}
BASELINES = {"python -c pass": ["-c", "pass"], "python -c 'import torch'": ["-c", "import torch"]}


def build(base: Path) -> dict[str, Path]:
    import torch

    import ckptguard as cg
    from ckptguard.memory import PhaseKind, PhaseRecorder, RecorderConfig

    one = base / "one"
    mgr = cg.CheckpointManager(one, config=cg.CheckpointConfig(retention=None))
    for step in (1, 2, 3):
        mgr.save(step, {"model": torch.nn.Linear(64, 64), "n": step})
    (one / "latest_checkpointed_iteration.txt").write_text("2\n")
    run = base / "run"
    rc = cg.RunCheckpoint(
        run, [cg.Role("actor"), cg.Role("driver")], config=cg.CheckpointConfig(retention=None)
    )
    rc.save(1, {"actor": {"model": torch.nn.Linear(8, 8)}, "driver": {"n": 1}})
    phases = base / "phases"
    phases.mkdir()
    with PhaseRecorder(RecorderConfig(path=phases / "rank0.jsonl")).phase(PhaseKind.SAVE, step=1):
        pass
    return {"one": one, "run": run, "phases": phases, "copy": base / "copy"}


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """(wall s, child CPU s, exit code) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, timeout=600
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.returncode


def medians(runs: list[tuple[float, float, int]]) -> dict[str, float]:
    return {
        "wall_s": statistics.median(r[0] for r in runs),
        "cpu_s": statistics.median(r[1] for r in runs),
    }


def imports_torch(args: list[str], env: dict[str, str]) -> bool:
    probe = (
        "import runpy, sys\nsys.argv = ['ckptguard', *sys.argv[1:]]\ntry:\n"
        "    runpy.run_module('ckptguard.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "sys.stderr.write('\\nTORCH=%s\\n' % ('torch' in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, *args], capture_output=True, text=True, env=env, timeout=600
    )
    return "TORCH=True" in out.stderr


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--pythonpath", default=None, help="run the commands against this src directory instead"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    load_before = os.getloadavg()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        roots = build(Path(tmp))
        for name, argv in BASELINES.items():
            runs = [timed([sys.executable, *argv], env) for _ in range(args.reps)]
            rows[name] = medians(runs)
        for name, template in COMMANDS.items():
            cmd = [a.format(**roots) for a in template]
            runs = []
            for _ in range(args.reps):
                if name == "adopt":  # adopt moves the tracker: each run adopts in a fresh copy
                    subprocess.run(["rm", "-rf", str(roots["copy"])], check=True)
                    subprocess.run(["cp", "-a", str(roots["one"]), str(roots["copy"])], check=True)
                runs.append(timed([sys.executable, "-m", "ckptguard.cli", *cmd], env))
            if name == "adopt":
                subprocess.run(["rm", "-rf", str(roots["copy"])], check=True)
                subprocess.run(["cp", "-a", str(roots["one"]), str(roots["copy"])], check=True)
            rows[name] = {
                **medians(runs),
                "exit": sorted({r[2] for r in runs}),
                "imports_torch": imports_torch(cmd, env),
            }
    result = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "src": args.pythonpath or "this checkout",
        "reps": args.reps,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "rows": rows,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    print(f"\n{'command':<28} {'wall s':>8} {'cpu s':>8}  torch", file=sys.stderr)
    for name, r in rows.items():
        print(
            f"{name:<28} {r['wall_s']:8.3f} {r['cpu_s']:8.3f}  {r.get('imports_torch', '')}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
