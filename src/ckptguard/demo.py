"""The embedded main job: a small training run that is killed and resumed, then proven.

The job is small enough for a laptop CPU and has every kind of state an exact resume
needs: a model with dropout (CPU RNG), Adam (optimizer step and moments), a warmup LR
schedule, and a data loader whose cursor draws NumPy and Python randomness. The tests'
resume-equivalence oracle trains the same job.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._digest import digest

FEATURES = 16
HIDDEN = 64


class ToyLoader:
    """A data stream with a cursor; each batch draws NumPy and Python randomness."""

    def __init__(self, *, batch: int = 8, rank: int = 0) -> None:
        self.batch = batch
        self.rank = rank
        self.cursor = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        noise = np.random.standard_normal((self.batch, FEATURES)).astype(np.float32)
        scale = 0.5 + random.random()
        x = torch.from_numpy(noise) * scale + 0.01 * self.cursor
        y = x[:, :2].sum(dim=1, keepdim=True).sin()
        self.cursor += 1
        return x, y

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.cursor}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.cursor = int(sd["cursor"])


@dataclass
class Job:
    model: torch.nn.Module
    optim: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    loader: ToyLoader
    rank: int

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.optim, "sched": self.sched, "loader": self.loader}


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def build_job(*, rank: int = 0, world: int = 1, seed: int = 0, warmup: int = 5) -> Job:
    """The same initial weights on every rank; per-rank data and dropout streams.
    Under a process group of world > 1 the model is sharded with FSDP2."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(HIDDEN, 1),
    )
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / warmup))
    seed_everything(seed + 1000 * (rank + 1))
    return Job(model, optim, sched, ToyLoader(rank=rank), rank)


def train_step(job: Job) -> float:
    x, y = job.loader.next_batch()
    loss = torch.nn.functional.mse_loss(job.model(x), y)
    job.optim.zero_grad(set_to_none=True)
    loss.backward()
    job.optim.step()
    job.sched.step()
    return float(loss.item())


def fingerprint(job: Job) -> dict[str, str]:
    """Bitwise digest of every parameter and every optimizer tensor this rank holds."""
    out = {f"param:{n}": digest(p) for n, p in job.model.named_parameters()}
    names = {id(p): n for n, p in job.model.named_parameters()}
    for group in job.optim.param_groups:
        for p in group["params"]:
            for k, v in job.optim.state.get(p, {}).items():
                out[f"optim:{names[id(p)]}:{k}"] = digest(v)
    out["lr"] = json.dumps(job.sched.get_last_lr())
    return out


# ---------------------------------------------------------------- the worker process


def _init_dist() -> tuple[int, int]:
    """Rank and world from torchrun's environment; one process without it."""
    import os

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    dist.init_process_group("gloo")
    return dist.get_rank(), world


def worker(*, mode: str, root: str, out: str, steps: int, save_every: int, kill_at: int | None) -> None:
    """One rank of the demo job. ``mode`` is 'train' (resume, train, save, maybe die) or
    'reference' (train straight through without checkpoints)."""
    import logging
    import os
    import signal
    from pathlib import Path

    from . import CheckpointManager

    torch.set_num_threads(1)
    rank, world = _init_dist()
    logging.basicConfig(level=logging.INFO, format=f"  [rank {rank}] %(message)s")
    job = build_job(rank=rank, world=world)
    record: dict[str, Any] = {"pid": os.getpid(), "rank": rank, "losses": {}}
    start = 0
    mgr = None
    if mode == "train":
        mgr = CheckpointManager(root)
        start = mgr.restore(job.state())
        record["restored_step"] = start
    log_path = Path(out) / f"{mode}_rank{rank}.jsonl"
    with open(log_path, "a") as log_file:
        for step in range(start + 1, steps + 1):
            if kill_at is not None and step == kill_at:
                log_file.write(json.dumps({"event": "killed", "step": step, "pid": os.getpid()}) + "\n")
                log_file.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            loss = train_step(job)
            record["losses"][step] = loss
            log_file.write(json.dumps({"step": step, "loss": loss}) + "\n")
            log_file.flush()
            if mgr is not None and step % save_every == 0:
                mgr.save(step, job.state())
                log_file.write(json.dumps({"event": "committed", "step": step}) + "\n")
    record["fingerprint"] = fingerprint(job)
    (Path(out) / f"{mode}_rank{rank}.json").write_text(json.dumps(record))


# ---------------------------------------------------------------- the orchestrator


@dataclass
class Gate:
    name: str
    passed: bool
    evidence: str


def _launch(
    mode: str, *, ranks: int, root: str, out: str, steps: int, save_every: int, kill_at: int | None, echo: Any
) -> int:
    import os
    import socket
    import subprocess
    import sys

    args = [
        "-m",
        "ckptguard.demo",
        mode,
        "--root",
        root,
        "--out",
        out,
        "--steps",
        str(steps),
        "--save-every",
        str(save_every),
    ]
    if kill_at is not None:
        args += ["--kill-at", str(kill_at)]
    if ranks == 1:
        cmd = [sys.executable, *args]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(ranks),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            *args,
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    other = []
    for line in proc.stdout:
        if line.startswith("  [rank"):
            echo(line.rstrip())
        else:
            other.append(line)
    code = proc.wait()
    if code != 0 and kill_at is None:
        echo("".join(other[-40:]))
    return code


def _read(out: str, name: str) -> dict[str, Any]:
    from pathlib import Path

    return json.loads((Path(out) / name).read_text())


def run_demo(
    directory: str, *, ranks: int = 2, steps: int = 12, save_every: int = 3, kill_at: int = 8, echo: Any = print
) -> list[Gate]:
    """Train, SIGKILL, resume in a new process, and compare with a straight run."""
    import shutil
    from pathlib import Path

    base = Path(directory).absolute()
    shutil.rmtree(base, ignore_errors=True)
    root, out = base / "ckpt", base / "records"
    out.mkdir(parents=True)
    common = {
        "ranks": ranks,
        "root": str(root),
        "out": str(out),
        "steps": steps,
        "save_every": save_every,
        "echo": echo,
    }
    echo(
        f"[1/3] training {steps} steps on {ranks} CPU rank(s)"
        f"{' under FSDP2' if ranks > 1 else ''}, saving every {save_every}; SIGKILL at step {kill_at}"
    )
    died = _launch("train", kill_at=kill_at, **common)
    first = [json.loads(x) for x in (out / "train_rank0.jsonl").read_text().splitlines()]
    killed = [e for e in first if e.get("event") == "killed"]
    echo(
        f"      the job died (exit {died}) at step {killed[0]['step'] if killed else '?'}, "
        f"pid {killed[0]['pid'] if killed else '?'}"
    )
    (out / "train_rank0.jsonl").rename(out / "killed_rank0.jsonl")
    echo("[2/3] relaunching the same command: it resumes by itself")
    resumed_code = _launch("train", kill_at=None, **common)
    echo(f"[3/3] reference: {steps} steps straight through, never interrupted")
    ref_code = _launch("reference", kill_at=None, **common)
    if resumed_code or ref_code:
        return [Gate("runs completed", False, f"resume exit {resumed_code}, reference exit {ref_code}")]
    return _gates(out, ranks, steps, save_every, kill_at, killed)


def _gates(out: Any, ranks: int, steps: int, save_every: int, kill_at: int, killed: list) -> list[Gate]:
    expected_step = (kill_at - 1) // save_every * save_every
    gates = []
    res = [_read(out, f"train_rank{r}.json") for r in range(ranks)]
    ref = [_read(out, f"reference_rank{r}.json") for r in range(ranks)]
    restored = {r["restored_step"] for r in res}
    gates.append(
        Gate("killed mid-run", bool(killed), f"SIGKILL at step {kill_at}, after the save of step {expected_step}")
    )
    gates.append(
        Gate(
            "resolved the last committed step",
            restored == {expected_step},
            f"restored step {sorted(restored)} on every rank, from the tracker",
        )
    )
    old_pid = killed[0]["pid"] if killed else None
    gates.append(
        Gate(
            "restored in a new process",
            old_pid not in {r["pid"] for r in res},
            f"pid {old_pid} -> {res[0]['pid']} (rank 0)",
        )
    )
    gates.append(
        Gate(
            "per-rank, per-item digests equal the save's",
            True,
            "checked inside restore (model, optim, sched, loader, rng); it raises otherwise",
        )
    )
    same_loss = all(
        r["losses"][str(s)] == f["losses"][str(s)]
        for r, f in zip(res, ref, strict=True)
        for s in range(expected_step + 1, steps + 1)
    )
    gates.append(
        Gate(
            f"losses of steps {expected_step + 1}..{steps} bitwise equal",
            same_loss,
            f"{ranks} rank(s) x {steps - expected_step} steps compared with float equality",
        )
    )
    tensors = sum(len(r["fingerprint"]) for r in res)
    equal = sum(
        1 for r, f in zip(res, ref, strict=True) for k, v in r["fingerprint"].items() if f["fingerprint"].get(k) == v
    )
    gates.append(
        Gate(
            f"model and optimizer bitwise equal at step {steps}",
            equal == tensors,
            f"{equal}/{tensors} tensors and LR values equal (xxh3 of every byte)",
        )
    )
    return gates


def _main() -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m ckptguard.demo", description="one rank of the demo job")
    p.add_argument("mode", choices=["train", "reference"])
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--kill-at", type=int)
    a = p.parse_args()
    worker(mode=a.mode, root=a.root, out=a.out, steps=a.steps, save_every=a.save_every, kill_at=a.kill_at)


if __name__ == "__main__":
    _main()
