"""SIGKILL exact example jobs at random moments and count how ``ckptguard prove`` judges every
resume.

The acceptance of issue 39: an exact resume is never called ``NOT proven`` (a gate FAILs only on a
difference), and ``EVIDENCE MISSING`` comes only where no rank recorded anything past the restored
step (the run that saved it, or an earlier resume of it, was killed before its first step past it;
or the resumed run itself was killed before its first step). Each such case is counted and shown.

Jobs (each 2 ranks on the CPU under torchrun, gloo):

- ``demo``: the embedded RL job (``python -m ckptguard.demo``): FSDP2, FP8 export with a scale
  cache, old-logprobs, Adam and a scheduler; ``ProofPlan(rl=True, deterministic=True)``.
- ``ddp``: a DDP job in this file (``ddp-job``): Dropout, AdamW, a scheduler, ``DistributedSampler``
  with ``set_epoch`` over many short epochs, a ``DataLoader`` with its own generator, fast-forwarded
  after a restore; ``ProofPlan(deterministic=True)`` and ``record_step(..., epoch=)``.
- ``nanogpt``: ``examples/nanogpt.py`` (nanoGPT's train.py loop: memmap'd tokens, ``get_batch`` from
  torch's global RNG with a prefetch, grad accumulation, cosine lr, eval on rank 0).
- ``grpo_vllm``: ``examples/grpo_vllm.py`` with a real vLLM engine, in the vLLM venv (.venv-vllm),
  one rank, runs of 12 steps; its kill moments are ``VLLM_KINDS`` (``mid_generation``: the example's
  own SIGKILL inside the engine's generate; no ``rank_ahead``). A launch that ends its run starts a
  new root.

After the kills, the same job runs once never killed, as far as the killed one got: every step
record of every launch, and the final checkpoint's digests, are compared with it
(``compare_records``, ``compare_final``; grpo_vllm: each completed run's RESULT). Every resume is
judged by ``evaluate`` and by ``ckptguard prove --all --json``. ``--combine`` sums campaigns run
side by side into one JSON and markdown (benchmarks/results/proof_campaign.md says how the committed
figures were made).

Kill moments, drawn at random per launch: ``after_commit`` (as soon as the tracker moves),
``mid_save`` (a save paused mid-write, ``_faults.PAUSE_ENV``), ``random`` (a uniform delay after the
launch's first step), ``rank_ahead`` (rank 1's worker SIGSTOPped, rank 0 runs on until it blocks,
then the whole tree is killed), and ``crash_loop`` (3 launches in a row killed before their next
commit: the same step resumed three times). Every kill takes the whole process tree
(``ops._proctree``, as ``ckptguard rehearse``). A last launch runs until it recorded steps past a
new commit, so the last resume has evidence.

    python benchmarks/proof_campaign.py --kills 30 --jobs nanogpt --seed 50 --out /tmp/nanogpt.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("after_commit", "mid_save", "random", "rank_ahead", "crash_loop")
VLLM_KINDS = (
    "after_commit",
    "mid_save",
    "mid_generation",
    "random",
    "crash_loop",
)  # one rank: no rank ahead
WORLD = 2
ONLY: tuple[str, ...] = ()  # --kinds: draw only these (the first kill stays after_commit)
REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


# ---------------------------------------------------------------- the DDP job (one rank, under
# torchrun)


def ddp_job(root: str, steps: int, save_every: int, sleep_s: float) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    import ckptguard as cg

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
    )
    model = DistributedDataParallel(net)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=7, gamma=0.9)
    torch.manual_seed(100 + rank)  # each rank's own dropout stream
    data: Any = range(24)  # sample i is its index
    sampler: DistributedSampler[int] = DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=True, seed=7
    )
    # Its own generator: iter(loader) draws its base seed from it, not from the restored global RNG
    loader: DataLoader[int] = DataLoader(
        data, batch_size=4, sampler=sampler, generator=torch.Generator().manual_seed(3)
    )
    pos = _Position()
    state = {"model": model, "optim": optim, "sched": sched, "position": pos}
    plan = cg.ProofPlan(deterministic=True, total_steps=steps)
    mgr = cg.CheckpointManager(
        root, config=cg.CheckpointConfig(proof=plan, retention=cg.KeepLast(2))
    )
    step = mgr.restore(state)
    while step < steps:
        sampler.set_epoch(pos.epoch)
        it = iter(loader)
        for _ in range(pos.batch):  # fast-forward to the saved position in this epoch
            next(it)
        for ids in it:
            step += 1
            pos.batch += 1
            x = torch.stack(
                [torch.randn(8, generator=torch.Generator().manual_seed(int(i))) for i in ids]
            )
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            optim.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optim.step()
            sched.step()
            mgr.record_step(step, sample_ids=ids, loss=loss, grad_norm=norm, epoch=pos.epoch)
            if step % save_every == 0:
                mgr.save(step, state)
            if step >= steps:
                break
            time.sleep(sleep_s)
        else:
            pos.epoch, pos.batch = pos.epoch + 1, 0
    dist.destroy_process_group()


class _Position:
    """The epoch and the batches consumed in it."""

    def __init__(self) -> None:
        self.epoch, self.batch = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.batch = int(sd["epoch"]), int(sd["batch"])


# ---------------------------------------------------------------- the controller


@dataclass
class Kill:
    job: str
    kind: str
    launch: int
    restored: int | None  # the step this launch restored (None: not recorded before the kill)
    tracker: int  # the committed step when killed
    seconds: float
    survivors: list[int] = field(default_factory=list)
    exited_before_kill: list[int | None] = field(
        default_factory=list
    )  # a rank that ended by itself (port in use)


def _rank_main(
    job: str, rank: int, port: int, root: str, steps: int, env: dict[str, str], log: str
) -> None:
    """One rank of a launch, forked from a server that imported torch once: what torchrun's worker
    runs."""
    os.environ.update(
        {
            **env,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "LOCAL_WORLD_SIZE": str(WORLD),
        }
    )
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if job == "demo":
        from ckptguard.demo.job import worker

        worker(root=root, steps=steps, save_every=3, kill_at=None, derived_fix=True)
    elif job == "nanogpt":
        import torch

        torch.set_num_threads(1)
        torch.distributed.init_process_group("gloo")
        nano = _example("nanogpt")
        # the tokens beside the root: the killed and the reference run each make the same files
        nano.train(
            str(Path(root).parent),
            nano.Config(max_iters=steps),
            data_dir=str(Path(root).parent / "data"),
            root=root,
        )
        torch.distributed.destroy_process_group()
    else:
        ddp_job(root, steps, 4, 0.05)


def _example(name: str) -> Any:
    """A module of examples/ (not a package), imported by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


_CONTEXT: Any = None


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        import multiprocessing as mp

        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(
            [
                "torch",
                "torch.distributed",
                "numpy",
                "ckptguard",
                "ckptguard.demo.job",
                "torch.nn.parallel",
                "torch.utils.data",
            ]
        )
    return _CONTEXT


def _tracker(root: Path) -> int:
    try:
        return int((root / "latest_checkpointed_iteration.txt").read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def _records(root: Path, rank: int) -> list[dict[str, Any]]:
    path = root / "proof" / f"rank_{rank:05d}.jsonl"
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line torn by a kill
    return out


def _since(root: Path, since: float, event: str) -> list[dict[str, Any]]:
    return _since_rank(root, since, event, 0)


def _since_rank(root: Path, since: float, event: str, rank: int) -> list[dict[str, Any]]:
    return [
        r for r in _records(root, rank) if r.get("event") == event and r.get("time", 0) >= since
    ]


class Launch:
    """One launch of a job: its ranks forked at once; a kill stops them all, then SIGKILLs them
    all."""

    def __init__(self, job: str, root: Path, steps: int, env: dict[str, str], log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.since = time.time()
        ctx = _context()
        self.procs = [
            ctx.Process(target=_rank_main, args=(job, rank, port, str(root), steps, env, str(log)))
            for rank in range(WORLD)
        ]
        for proc in self.procs:
            proc.start()

    def wait(self, ready: Any, timeout_s: float = 300.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return True
            if any(
                not p.is_alive() for p in self.procs
            ):  # a rank that died alone leaves its peer hanging
                return False
            time.sleep(0.01)
        return False

    def rank_pid(self, rank: int) -> int | None:
        pid: int | None = self.procs[rank].pid
        return pid

    def kill(self) -> list[int]:
        for p in self.procs:  # one instant for every rank: stopped first, then killed
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(p.pid, signal.SIGSTOP)
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.join(30)
        return [p.pid for p in self.procs if p.is_alive()]


def _restored(root: Path, since: float) -> int | None:
    found = _since(root, since, "restore")
    return int(found[-1]["step"]) if found else None


def _one_kill(
    job: str,
    kind: str,
    root: Path,
    steps: int,
    env: dict[str, str],
    log: Path,
    rng: random.Random,
    number: int,
    pause: Path,
) -> Kill:
    extra = {}
    if kind == "mid_save":
        shutil.rmtree(pause, ignore_errors=True)
        pause.mkdir(parents=True)
        extra = {"CKPTGUARD_REHEARSE_PAUSE_DIR": str(pause)}
    launch = Launch(job, root, steps, {**env, **extra}, log)
    start_tracker = _tracker(root)
    first_step = lambda: bool(_since(root, launch.since, "step"))  # noqa: E731
    if kind == "after_commit":
        launch.wait(lambda: _tracker(root) > start_tracker)
    elif kind == "mid_save":
        launch.wait(lambda: len(list(pause.glob("paused_rank_*"))) >= WORLD)
    elif kind == "crash_loop":  # killed after its first step or two, before its next commit
        launch.wait(first_step)
        time.sleep(rng.uniform(0.0, 0.05))
    elif kind == "rank_ahead":
        launch.wait(first_step)
        time.sleep(rng.uniform(0.0, 1.5))
        pid = launch.rank_pid(1)
        if pid is not None:
            os.kill(pid, signal.SIGSTOP)  # rank 0 runs on until it blocks in the next collective
            time.sleep(0.5)
    else:  # random
        launch.wait(first_step)
        time.sleep(rng.uniform(0.0, 2.0))
    exited = [p.exitcode for p in launch.procs if not p.is_alive()]
    survivors = launch.kill()
    return Kill(
        job,
        kind,
        number,
        _restored(root, launch.since),
        _tracker(root),
        round(time.time() - launch.since, 2),
        survivors,
        exited,
    )


def _finish(job: str, root: Path, steps: int, env: dict[str, str], log: Path) -> None:
    """A last launch that records steps past a new commit: the last resume has evidence too."""
    launch = Launch(job, root, steps, env, log)
    start = _tracker(root)
    launch.wait(
        lambda: (
            _tracker(root) > start
            and any(r.get("step", 0) > _tracker(root) for r in _since(root, launch.since, "step"))
        )
    )
    launch.kill()


def _plan(kills: int, rng: random.Random, kinds: tuple[str, ...] = KINDS) -> list[str]:
    """Kill kinds in a random order: each kind about equally often; a crash loop is 3 kills in a
    row. The first kill comes right after a commit: the later ones then have a step to resume."""
    out: list[str] = ["after_commit"]
    kinds = tuple(k for k in kinds if k in ONLY) if ONLY else kinds
    while len(out) < kills:
        kind = rng.choice(kinds)
        out += [kind] * (3 if kind == "crash_loop" else 1)
    return out[:kills]


# ---------------------------------------------------------------- examples/grpo_vllm.py (vLLM venv,
# one process)

GRPO_EPOCHS = (
    3  # 4 steps an epoch (4 prompts x 4 completions), a save every 2 steps: 12 steps a run
)
GRPO_RANKS = {
    "grpo_vllm": 1,
    "grpo_vllm2": 2,
}  # grpo_vllm2: 2 gloo ranks (DDP), an engine each, 8 steps a run


def _vllm_env() -> dict[str, str]:
    """tests/venvs.vllm_env: this repository's source first, one thread, offline, a 1 GiB KV cache,
    and none of a launcher's rank variables or VLLM_* settings (the example sets
    VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "VLLM_", "CKPTGUARD_REHEARSE")
        )
    }
    env.update(
        {
            "PYTHONPATH": str(REPO / "src"),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


class VllmLaunch:
    """One launch of examples/grpo_vllm.py, in a session of its own: a kill takes the session (the
    trainer and its in-process engine), as a scheduler ends a job."""

    def __init__(
        self,
        root: Path,
        model_dir: Path,
        out: Path,
        extra_env: dict[str, str],
        args: list[str],
        nproc: int = 1,
    ) -> None:
        self.since = time.time()
        self.out = out
        # --nproc 2: the example starts its ranks in this session; its own kills take the whole
        # process group
        ranks = [f"--nproc={nproc}", "--epochs=2"] if nproc > 1 else [f"--epochs={GRPO_EPOCHS}"]
        cmd = [
            str(VLLM_PYTHON),
            str(EXAMPLES / "grpo_vllm.py"),
            "--root",
            str(root),
            "--model-dir",
            str(model_dir),
            *ranks,
            *args,
        ]
        with open(out, "w") as f:
            self.proc = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**_vllm_env(), **extra_env},
                cwd=root.parent,
                start_new_session=True,
            )

    def wait(self, ready: Any, timeout_s: float = 900.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.02)
        return False

    def kill(self) -> int | None:
        """SIGKILL the session; the exit code if the process had ended by itself before."""
        code = self.proc.poll()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        return code

    def result(self) -> dict[str, Any] | None:
        line = next(
            (ln for ln in self.out.read_text().splitlines() if ln.startswith("RESULT ")), None
        )
        return json.loads(line[len("RESULT ") :]) if line else None


def _grpo_kill(
    job: str,
    kind: str,
    root: Path,
    model_dir: Path,
    out: Path,
    rng: random.Random,
    number: int,
    pause: Path,
) -> tuple[Kill, VllmLaunch]:
    nproc = GRPO_RANKS[job]
    extra: dict[str, str] = {}
    args: list[str] = []
    start_tracker = _tracker(root)
    if kind == "mid_save":
        shutil.rmtree(pause, ignore_errors=True)
        pause.mkdir(parents=True)
        extra = {"CKPTGUARD_REHEARSE_PAUSE_DIR": str(pause)}
    if (
        kind == "mid_generation"
    ):  # the example's own timer, 50 ms into the engine's generate of that step
        args = [
            f"--kill=generate@{start_tracker + rng.randint(1, 2)}",
            f"--kills-file={out.with_suffix('.fired')}",
        ]
    launch = VllmLaunch(root, model_dir, out, extra, args, nproc)

    def first_step() -> bool:
        return bool(_since_rank(root, launch.since, "step", 0))

    if kind == "after_commit":
        launch.wait(lambda: _tracker(root) > start_tracker)
    elif kind == "mid_save":
        launch.wait(lambda: len(list(pause.glob("paused_rank_*"))) >= nproc)
    elif (
        kind == "rank_ahead"
    ):  # rank 1 (its pid from its own records) stopped; rank 0 runs on until it blocks
        launch.wait(lambda: first_step() and bool(_since_rank(root, launch.since, "step", 1)))
        time.sleep(rng.uniform(0.0, 3.0))
        pids = [r["pid"] for r in _since_rank(root, launch.since, "step", 1)]
        if pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[-1], signal.SIGSTOP)
            time.sleep(1.0)
    elif kind == "mid_generation":
        launch.wait(lambda: False)  # until it kills itself
    elif kind == "crash_loop":
        launch.wait(first_step)
        time.sleep(rng.uniform(0.0, 0.3))
    else:  # random
        launch.wait(first_step)
        time.sleep(rng.uniform(0.0, 4.0))
    exited = launch.kill()
    restored = _since_rank(root, launch.since, "restore", 0)
    return Kill(
        job,
        kind,
        number,
        int(restored[-1]["step"]) if restored else None,
        _tracker(root),
        round(time.time() - launch.since, 2),
        [],
        [exited] if exited is not None else [],
    ), launch


def run_grpo(
    job: str, kills: int, rng: random.Random, work: Path, deadline: float | None
) -> dict[str, Any]:
    """Runs of 12 steps, each launch killed at a drawn moment; a launch that ends by itself ends its
    run (a new root then); the last run is completed by a launch left alone. Each completed run's
    RESULT (params, AdamW state, completions) is compared with an uninterrupted run's."""
    nproc = GRPO_RANKS[job]
    base = work / job
    base.mkdir(parents=True, exist_ok=True)
    model_dir = base / "model"
    (base / "ref").mkdir(exist_ok=True)
    ref_launch = VllmLaunch(base / "ref" / "ckpt", model_dir, base / "ref.out", {}, [], nproc)
    ref_launch.wait(lambda: False, timeout_s=3600)
    ref_launch.kill()
    reference = ref_launch.result()
    if reference is None:
        raise SystemExit(f"{job}: the uninterrupted run printed no RESULT: {base / 'ref.out'}")
    began, done, runs = time.time(), [], []
    run, launches = 0, 0
    plan = _plan(kills, rng, VLLM_KINDS + (("rank_ahead",) if nproc > 1 else ()))
    for n, kind in enumerate(plan, 1):
        if deadline is not None and time.time() > deadline and kind != "crash_loop":
            print(f"{job}: the deadline passed after {n - 1} kills", flush=True)
            break
        root = base / f"run{run}" / "ckpt"
        root.parent.mkdir(parents=True, exist_ok=True)
        kill, launch = _grpo_kill(
            job,
            kind,
            root,
            model_dir,
            base / f"run{run}" / f"launch-{launches}.out",
            rng,
            n,
            work / "pause-grpo",
        )
        launches += 1
        done.append(kill)
        print(
            f"{job} kill {n}/{len(plan)} {kind}: run {run}, restored {kill.restored}, tracker "
            f"{kill.tracker}, {kill.seconds} s",
            flush=True,
        )
        if launch.proc.returncode not in (0, -signal.SIGKILL):
            print(f"{job}: launch exited {launch.proc.returncode}: {launch.out}", flush=True)
        if (
            launch.proc.returncode == 0
        ):  # the run reached its last step before the kill: a new run, a new root
            runs.append(_grpo_run(run, root, launch.result(), reference, nproc))
            run, launches = run + 1, 0
    root = base / f"run{run}" / "ckpt"
    if root.exists():  # the last run to its end, untouched
        last = VllmLaunch(
            root, model_dir, base / f"run{run}" / f"launch-{launches}.out", {}, [], nproc
        )
        last.wait(lambda: False, timeout_s=3600)
        last.kill()
        runs.append(_grpo_run(run, root, last.result(), reference, nproc))
    rows = []
    for r in runs:
        rows += [{**row, "run": r["run"]} for row in judge(job, Path(r["root"]), world=nproc)]
    return {
        "job": job,
        "kills": [asdict(k) for k in done],
        "resumes": rows,
        "runs": runs,
        "seconds": round(time.time() - began),
    }


def _grpo_run(
    run: int, root: Path, result: dict[str, Any] | None, reference: dict[str, Any], nproc: int = 1
) -> dict[str, Any]:
    """A completed run against the uninterrupted one: final parameters, AdamW state, and the
    completions of every step its last launch generated; and every step record against the
    reference's."""
    out: dict[str, Any] = {"run": run, "root": str(root), "completed": result is not None}
    if result is not None:
        out["final_params_equal"] = result["params"] == reference["params"]
        out["final_optim_equal"] = result["optim"] == reference["optim"]
        out["completions_equal"] = all(
            reference["completions"].get(k) == v for k, v in result["completions"].items()
        )
    out["records"] = compare_records(root, root.parents[1] / "ref" / "ckpt", world=nproc)
    return out


# ---------------------------------------------------------------- against an uninterrupted run

COMPARED = ("sample_ids", "ids_sum", "samples", "batch", "loss", "grad_norm", "extra")


def compare_records(root: Path, ref: Path, world: int = WORLD) -> dict[str, Any]:
    """Every step record of every launch in ``root`` against the uninterrupted run's record of the
    same rank and step: the data read and every value produced, bitwise (the JSON floats are exact),
    and the CPU RNG digest where both recorded one (the first step after a restore). Python's and
    numpy's global RNGs are left out: these jobs never use them, and each process starts them from
    OS entropy."""
    compared, differ, missing = 0, [], 0
    for rank in range(world):
        want = {r["step"]: r for r in _records(ref, rank) if r.get("event") == "step"}
        for r in _records(root, rank):
            if r.get("event") != "step":
                continue
            w = want.get(r["step"])
            if w is None:
                missing += 1
                continue
            compared += 1
            keys = [k for k in COMPARED if r.get(k) != w.get(k)]
            if r.get("rng") and w.get("rng") and r["rng"].get("cpu") != w["rng"].get("cpu"):
                keys.append("rng.cpu")
            if keys:
                differ.append(
                    {"rank": rank, "step": r["step"], "pid": r.get("pid"), "fields": keys}
                )
    return {"compared": compared, "differ": differ, "not_in_reference": missing}


def compare_final(root: Path, ref: Path) -> dict[str, Any]:
    """The newest committed step of ``root`` against the uninterrupted run's checkpoint of that
    step: every item's per-rank digest and every tensor's layout-free digest from the two manifests,
    and the CPU RNG state in each rank's extras file (loaded with weights_only=True)."""
    import torch

    step = _tracker(root)
    mine, theirs = root / f"step_{step:08d}", ref / f"step_{step:08d}"
    if not (theirs / "manifest.json").is_file():
        return {"step": step, "compared": False, "why": f"the reference's step {step} is not kept"}
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (mine, theirs))
    differ = [
        f"rank {r} {item}"
        for r in a["digests"]
        for item, v in a["digests"][r].items()
        if item != "_rng" and b["digests"].get(r, {}).get(item) != v
    ]
    differ += [
        f"{item} {key}"
        for item, keys in a.get("layout_free", {}).items()
        for key, v in keys.items()
        if b.get("layout_free", {}).get(item, {}).get(key) != v
    ]
    for extras in sorted(mine.glob("rank_*.pt")):
        rng = [
            torch.load(d / extras.name, weights_only=True).get("rng", {}).get("cpu")
            for d in (mine, theirs)
        ]
        if rng[0] is None or rng[1] is None or not torch.equal(rng[0], rng[1]):
            differ.append(f"{extras.stem} rng.cpu")
    return {
        "step": step,
        "compared": True,
        "items": sum(len(v) for v in a["digests"].values()),
        "tensors": sum(len(v) for v in a.get("layout_free", {}).values()),
        "differ": differ,
    }


def reference_run(
    job: str, root: Path, ref: Path, steps: int, env: dict[str, str], log: Path
) -> None:
    """The same job never killed, in ``ref``, until every rank recorded the killed run's last step
    and the tracker reached its newest commit; then stopped."""
    last = {
        rank: max([r["step"] for r in _records(root, rank) if r.get("event") == "step"], default=0)
        for rank in range(WORLD)
    }
    target = _tracker(root)
    launch = Launch(job, ref, steps, env, log)
    launch.wait(
        lambda: (
            _tracker(ref) >= target
            and all(
                any(
                    r.get("event") == "step" and r.get("step", 0) >= last[rank]
                    for r in _records(ref, rank)
                )
                for rank in range(WORLD)
            )
        ),
        timeout_s=3600,
    )
    launch.kill()


def cli_prove(root: Path) -> dict[int, dict[str, Any]]:
    """``ckptguard prove --all --json ROOT``, as a user runs it: each resume's outcome and exit
    code."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "ckptguard.cli", "prove", "--all", "--json", str(root)],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    try:
        out = json.loads(proc.stdout)
    except ValueError:
        return {0: {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}}
    return {
        int(r["resume"]): {
            "outcome": r["outcome"],
            "exit_code": r["exit_code"],
            "verdict": r["verdict"],
        }
        for r in out.get("resumes", [])
    }


# ---------------------------------------------------------------- judging


def _past(root: Path, k: int, before: float, pid_of: dict[int, int], world: int = WORLD) -> bool:
    """Whether any rank recorded a step past k before the resume at ``before``, in a process that
    saved or restored k (or, no save record of k left by a kill, one that recorded step k itself).
    The step records are compared whatever their order with the save record: an async save's record
    comes after the steps that ran while it was written."""
    for rank in range(world):
        recs = [
            r
            for r in _records(root, rank)
            if r.get("time", 0) < before and r.get("pid") != pid_of.get(rank)
        ]
        pids = {
            r.get("pid")
            for r in recs
            if r.get("event") in ("save", "restore") and r.get("step") == k
        } or {r.get("pid") for r in recs if r.get("event") == "step" and r.get("step") == k}
        if any(
            r.get("event") == "step" and r.get("step", 0) > k and r.get("pid") in pids for r in recs
        ):
            return True
    return False


def _resumed_recorded(
    root: Path, time0: float, pid_of: dict[int, int], k: int, world: int = WORLD
) -> bool:
    return any(
        r.get("event") == "step"
        and r.get("pid") == pid_of.get(rank)
        and r.get("step", 0) > k
        and r.get("time", 0) >= time0
        for rank in range(world)
        for r in _records(root, rank)
    )


def judge(job: str, root: Path, world: int = WORLD) -> list[dict[str, Any]]:
    from ckptguard._records.proofreader import read_records
    from ckptguard.ops import resumes as _resumes
    from ckptguard.ops.prove import evaluate, missing, outcome, resume_count, verdict

    rows = []
    records = read_records(root)
    by_cli = cli_prove(root)
    times = _resumes.launch_times(records)
    for r in resume_count(root):
        gates = evaluate(root, resume=r.number)
        pid_of = {}
        for rank, recs in records.items():
            idx = _resumes.record_of(recs, r.time, times)
            if idx is not None:
                pid_of[rank] = recs[idx]["pid"]
        past = _past(root, r.step, r.time, pid_of, world)
        resumed = _resumed_recorded(root, r.time, pid_of, r.step, world)
        cli = by_cli.get(r.number, by_cli.get(0, {"error": "not in prove --all --json"}))
        rows.append(
            {
                "job": job,
                "resume": r.number,
                "step": r.step,
                "outcome": outcome(gates).value,
                "verdict": verdict(gates),
                "missing": [g.name for g in missing(gates)],
                "recorded_past_before": past,
                "resumed_recorded": resumed,
                "one_record_apart": any("one record behind" in g.evidence for g in gates),
                "against_earlier_resume": any(
                    "compared with an earlier resume" in g.evidence for g in gates
                ),
                "failed": [f"{g.name}: {g.evidence}" for g in gates if g.status.value == "FAIL"],
                "cli": cli,
            }
        )
    return rows


def run_job(
    job: str, kills: int, rng: random.Random, work: Path, steps: int, deadline: float | None = None
) -> dict[str, Any]:
    if job in GRPO_RANKS:
        return run_grpo(job, kills, rng, work, deadline)
    root = work / job / "ck"
    root.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("CKPTGUARD_REHEARSE_PAUSE_DIR", None)
    done: list[Kill] = []
    began = time.time()
    log = work / f"{job}.log"
    for n, kind in enumerate(_plan(kills, rng), 1):
        if deadline is not None and time.time() > deadline and kind != "crash_loop":
            print(f"{job}: the deadline passed after {n - 1} kills", flush=True)
            break
        done.append(_one_kill(job, kind, root, steps, env, log, rng, n, work / "pause"))
        print(
            f"{job} kill {n}/{kills} {kind}: restored {done[-1].restored}, tracker "
            f"{done[-1].tracker}, {done[-1].seconds} s",
            flush=True,
        )
    _finish(job, root, steps, env, log)
    ref = work / job / "ref" / "ck"
    reference_run(job, root, ref, steps, env, work / f"{job}-ref.log")
    rows = judge(job, root)
    against = {"records": compare_records(root, ref), "final": compare_final(root, ref)}
    return {
        "job": job,
        "kills": [asdict(k) for k in done],
        "resumes": rows,
        "reference": against,
        "seconds": round(time.time() - began),
    }


def rejudge(res: dict[str, Any], work: Path) -> dict[str, Any]:
    """A job of an earlier campaign judged again by this prove (its kills and reference comparisons
    kept)."""
    if res["job"] not in GRPO_RANKS:
        return {**res, "resumes": judge(res["job"], work / res["job"] / "ck")}
    rows = []
    for run in res["runs"]:
        rows += [
            {**row, "run": run["run"]}
            for row in judge(res["job"], Path(run["root"]), world=GRPO_RANKS[res["job"]])
        ]
    return {**res, "resumes": rows}


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    rows = [r for res in results for r in res["resumes"]]
    kills = [k for res in results for k in res["kills"]]
    missing = [r for r in rows if r["outcome"] == "evidence missing"]
    # Missing evidence is allowed only where nothing past the restored step was recorded by a run
    # before the resume, or the resumed run itself recorded nothing past it
    unexplained = [r for r in missing if r["recorded_past_before"] and r["resumed_recorded"]]
    crash_steps = Counter((r["job"], r.get("run"), r["step"]) for r in rows)
    cli = [r.get("cli", {}) for r in rows]
    return {
        "by_job": {
            res.get("label", res["job"]): {
                "kills": len(res["kills"]),
                "resumes": len(res["resumes"]),
                "outcomes": dict(Counter(r["outcome"] for r in res["resumes"])),
            }
            for res in results
        },
        # what `ckptguard prove --all --json` said of each resume, and where it disagrees with
        # evaluate()
        "cli_outcomes": dict(Counter(c.get("outcome", "error") for c in cli)),
        "cli_disagrees": [
            {k: r.get(k) for k in ("job", "run", "resume", "outcome", "cli")}
            for r in rows
            if r.get("cli", {}).get("outcome") != r["outcome"]
        ],
        "against_uninterrupted": _against(results),
        "kills": len(kills),
        "kills_by_kind": dict(Counter(k["kind"] for k in kills)),
        "survivors": sum(len(k["survivors"]) for k in kills),
        # a launch whose process ended before the campaign's kill: a crash of its own (grpo_vllm's
        # mid_generation kills are the example's own SIGKILL, 50 ms into the engine's generate, and
        # counted apart)
        "ended_before_kill": [
            {k: x[k] for k in ("job", "launch", "kind", "exited_before_kill")}
            for x in kills
            if x["exited_before_kill"] and not _self_killed(x)
        ],
        "killed_mid_generation_by_the_example": sum(_self_killed(x) for x in kills),
        "resumes": len(rows),
        "outcomes": dict(Counter(r["outcome"] for r in rows)),
        "not_proven": [r for r in rows if r["outcome"] == "diverged"],
        "missing_explained": len(missing) - len(unexplained),
        "missing_unexplained": unexplained,
        "missing_cases": [
            {
                k: r[k]
                for k in (
                    "job",
                    "resume",
                    "step",
                    "missing",
                    "recorded_past_before",
                    "resumed_recorded",
                )
            }
            for r in missing
        ],
        "steps_resumed_3_or_more_times": sorted(
            f"{j}{'' if u is None else f' run {u}'} step {s}"
            for (j, u, s), n in crash_steps.items()
            if n >= 3
        ),
        "judged_by_ranks_one_record_apart": sum(r.get("one_record_apart", False) for r in rows),
        "judged_against_an_earlier_resume": sum(
            r.get("against_earlier_resume", False) for r in rows
        ),
    }


def _self_killed(kill: dict[str, Any]) -> bool:
    return bool(
        kill["kind"] == "mid_generation" and kill["exited_before_kill"] == [-signal.SIGKILL]
    )


def _against(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per job: the step records compared with the uninterrupted run's and those that differ; the
    final checkpoint's items and tensors (or, for grpo_vllm, each completed run's RESULT) and what
    differs."""
    out: dict[str, Any] = {}
    for res in results:
        if res["job"] in GRPO_RANKS:
            runs = res.get("runs", [])
            out[res.get("label", res["job"])] = {
                "runs_completed": sum(r["completed"] for r in runs),
                "final_equal": sum(
                    bool(
                        r.get("final_params_equal")
                        and r.get("final_optim_equal")
                        and r.get("completions_equal")
                    )
                    for r in runs
                ),
                "records_compared": sum(r["records"]["compared"] for r in runs),
                "records_differ": [d for r in runs for d in r["records"]["differ"]],
            }
        elif "reference" in res:
            ref = res["reference"]
            out[res.get("label", res["job"])] = {
                "records_compared": ref["records"]["compared"],
                "records_differ": ref["records"]["differ"],
                "final": ref["final"],
            }
    return out


# ---------------------------------------------------------------- several campaigns summed, in
# markdown

JOB_TITLES = {
    "demo": "demo (RL: FSDP2, FP8 export, old-logprobs)",
    "ddp": "ddp (DDP, Dropout, sampler, epochs)",
    "nanogpt": "nanogpt (nanoGPT's loop, 2 ranks)",
    "grpo_vllm": "grpo_vllm (GRPO, vLLM engine, 1 rank)",
    "grpo_vllm2": "grpo_vllm2 (GRPO, vLLM engines, 2 ranks)",
}


def combine(paths: list[str]) -> dict[str, Any]:
    """Campaigns run side by side (one JSON each), summed: every job's kills and resumes, one
    summary."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    jobs = [{**res, "seed": part["seed"]} for part in parts for res in part["jobs"]]
    names = Counter(res["job"] for res in jobs)
    for res in jobs:  # a job in two campaigns: each its own column, named with its seed
        if names[res["job"]] > 1:
            res["label"] = f"{res['job']} (seed {res['seed']})"
            res["resumes"] = [{**r, "job": res["label"]} for r in res["resumes"]]
    return {"commands": [part["command"] for part in parts], "summary": summary(jobs), "jobs": jobs}


def _cell(values: dict[str, Any], job: str | None) -> str:
    return str(values.get(job, 0) if job else sum(values.values()))


def markdown(out: dict[str, Any], head: str) -> str:
    """The results page: ``head`` (what ran, on what), then tables made from the JSON only."""
    jobs = [res.get("label", res["job"]) for res in out["jobs"]]
    cols = [*jobs, None]
    by = {res.get("label", res["job"]): res for res in out["jobs"]}
    titles = {
        res.get("label", res["job"]): JOB_TITLES.get(res["job"], res["job"])
        + (f" (seed {res['seed']})" if "label" in res else "")
        for res in out["jobs"]
    }

    def row(title: str, values: dict[str, Any]) -> str:
        return f"| {title} | " + " | ".join(_cell(values, j) for j in cols) + " |"

    def count(pred: Any, what: str = "resumes") -> dict[str, int]:
        return {j: sum(1 for x in by[j][what] if pred(x)) for j in jobs}

    lines = [
        head.rstrip(),
        "",
        "## Totals",
        "",
        "| | " + " | ".join(titles[j] for j in jobs) + " | all |",
        "|---|" + "---|" * len(cols),
        row("SIGKILLs", {j: len(by[j]["kills"]) for j in jobs}),
    ]
    for kind in dict.fromkeys(k["kind"] for res in out["jobs"] for k in res["kills"]):
        lines.append(row(f"- {kind}", count(lambda k, kind=kind: k["kind"] == kind, "kills")))
    lines += [
        row(
            "processes surviving a kill",
            {j: sum(len(k["survivors"]) for k in by[j]["kills"]) for j in jobs},
        ),
        row(
            "launches that ended before the kill",
            count(lambda k: bool(k["exited_before_kill"]) and not _self_killed(k), "kills"),
        ),
        row("resumes judged", {j: len(by[j]["resumes"]) for j in jobs}),
    ]
    for outcome, title in (
        ("proven", "**resume PROVEN**"),
        ("diverged", "**resume NOT proven (a FAIL)**"),
        ("evidence missing", "**resume EVIDENCE MISSING**"),
    ):
        lines.append(row(title, count(lambda r, o=outcome: r["outcome"] == o)))
    lines += [
        row(
            "- of which an earlier run had recorded past the restored step and the resumed run too",
            count(
                lambda r: (
                    r["outcome"] == "evidence missing"
                    and r["recorded_past_before"]
                    and r["resumed_recorded"]
                )
            ),
        ),
        row(
            "`prove --all --json` agrees with the verdict",
            count(lambda r: r["cli"].get("outcome") == r["outcome"]),
        ),
        row(
            "judged against an earlier resume (crash loop)",
            count(lambda r: r["against_earlier_resume"]),
        ),
        row("judged by the ranks one record apart", count(lambda r: r["one_record_apart"])),
    ]
    lines += [
        "",
        "## Against an uninterrupted run of the same job",
        "",
        "| job | step records compared (every launch, every rank) | differing | final state |",
        "|---|---|---|---|",
    ]
    for job, v in out["summary"]["against_uninterrupted"].items():
        if "runs_completed" in v:
            final = (
                f"{v['final_equal']} of {v['runs_completed']} completed runs: parameters, AdamW "
                f"state and the last launch's completions equal"
            )
        elif v["final"]["compared"]:
            f = v["final"]
            final = (
                f"step {f['step']}: {f['items']} per-rank item digests, {f['tensors']} layout-free "
                f"tensor digests, the CPU RNG of each rank: "
                f"{'all equal' if not f['differ'] else f['differ']}"
            )
        else:
            final = f"not compared: {v['final']['why']}"
        lines.append(f"| {job} | {v['records_compared']} | {len(v['records_differ'])} | {final} |")
    missing = [
        r for res in out["jobs"] for r in res["resumes"] if r["outcome"] == "evidence missing"
    ]
    lines += [
        "",
        "## Every EVIDENCE MISSING case",
        "",
        "| job | run | resume | restored step | gates with nothing to compare | an earlier run "
        "recorded past the step | the resumed run recorded past it |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['job']} | {r.get('run', '')} | {r['resume']} | {r['step']} | "
        f"{', '.join(r['missing'])} | {'yes' if r['recorded_past_before'] else 'no'} | "
        f"{'yes' if r['resumed_recorded'] else 'no'} |"
        for r in missing
    ]
    failed = [r for res in out["jobs"] for r in res["resumes"] if r["outcome"] == "diverged"]
    lines += ["", "## Every NOT proven case", ""]
    lines += [
        f"- {r['job']} run {r.get('run', '-')} resume {r['resume']} (step "
        f"{r['step']}): {r['failed']}"
        for r in failed
    ] or ["None."]
    ended = out["summary"]["ended_before_kill"]
    lines += ["", "## Launches that ended before the kill", ""]
    lines += [
        f"- {e['job']} launch {e['launch']} ({e['kind']}): exit {e['exited_before_kill']}"
        for e in ended
    ] or ["None."]
    crash = out["summary"]["steps_resumed_3_or_more_times"]
    lines += [
        "",
        f"Steps resumed 3 or more times (crash loops): {', '.join(crash) if crash else 'none'}.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "ddp-job":
        p = argparse.ArgumentParser()
        p.add_argument("cmd")
        p.add_argument("--root", required=True)
        p.add_argument("--steps", type=int, required=True)
        p.add_argument("--save-every", type=int, required=True)
        p.add_argument("--sleep", type=float, default=0.05)
        a = p.parse_args()
        ddp_job(a.root, a.steps, a.save_every, a.sleep)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=60, help="kills per job")
    p.add_argument("--jobs", default="demo,ddp,nanogpt,grpo_vllm")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--steps", type=int, default=100000, help="the jobs' total steps (never reached)"
    )
    p.add_argument("--work", default=None, help="working directory (default: a new temporary one)")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--minutes", type=float, default=None, help="start no kill (but a crash loop's) after this"
    )
    p.add_argument(
        "--combine",
        nargs="+",
        default=None,
        metavar="JSON",
        help="sum campaigns run side by side into --out (JSON) and --markdown, "
        "with --head's text first",
    )
    p.add_argument("--markdown", default=None)
    p.add_argument(
        "--kinds",
        default=None,
        help="comma-separated: draw only these kill kinds (after the first)",
    )
    p.add_argument("--head", default=None, help="a file: the results page's text before its tables")
    p.add_argument(
        "--rejudge",
        default=None,
        metavar="JSON",
        help=(
            "judge the roots of an earlier campaign's JSON again (its kills kept), with this prove"
        ),
    )
    a = p.parse_args()
    global ONLY
    ONLY = tuple(a.kinds.split(",")) if a.kinds else ()
    if a.combine:
        out = combine(a.combine)
        if a.out:
            Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
        if a.markdown:
            Path(a.markdown).write_text(
                markdown(out, Path(a.head).read_text() if a.head else "# Proof campaign\n")
            )
        print(
            json.dumps({k: v for k, v in out["summary"].items() if k != "missing_cases"}, indent=1)
        )
        return
    rng = random.Random(a.seed)
    work = Path(a.work or tempfile.mkdtemp(prefix="proof-campaign-"))
    if a.rejudge:
        earlier = json.loads(Path(a.rejudge).read_text())
        work = Path(earlier["work"])
        results = [rejudge(res, work) for res in earlier["jobs"]]
        a.seed = earlier["seed"]
    else:
        deadline = time.time() + 60 * a.minutes if a.minutes else None
        results = [run_job(job, a.kills, rng, work, a.steps, deadline) for job in a.jobs.split(",")]
    command = " ".join([Path(sys.executable).name, *sys.argv])
    if a.rejudge:
        command = f"{earlier['command']}; judged again by: {command}"
    out = {
        "command": command,
        "seed": a.seed,
        "work": str(work),
        "summary": summary(results),
        "jobs": results,
    }
    text = json.dumps(out, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(json.dumps(out["summary"], indent=1))


if __name__ == "__main__":
    main()
