"""Megatron-core GPT through ckptguard on one GPU: kills at every point of a save, exact resumes,
figures.

    # >= 5 SIGKILLs, resume checks, prove:
    python benchmarks/megatron_h200.py campaign --work /tmp/mg --out $OUT
    # save/commit/restore vs ckptguard's own:
    python benchmarks/megatron_h200.py bench --work /tmp/mgb --out $OUT
    # the tiny committed root of the tests:
    python benchmarks/megatron_h200.py fixture --work /tmp/mgf --out $OUT

Each training process is one rank (TP=PP=DP=1, NCCL), a GPT from ``megatron.core.models.gpt`` with
the local (non-Transformer-Engine) layer spec, bf16, Megatron's DistributedOptimizer, dropout on (so
Megatron's CUDA RNG tracker matters), saved by
``ckptguard.integrations.megatron.MegatronCheckpoint``. ``campaign`` runs a reference without kills,
then one chain of processes on one root, each SIGKILLed at another point: between saves, inside
Megatron's writer (a writer process killed the trainer after its first item, so the data file is
torn and ``.metadata`` absent), before Megatron's ``metadata.json``, and at ckptguard's
``commit.before_manifest`` / ``before_rename`` / ``before_tracker``. After every kill the next
process must restore the last committed step, with every Megatron shard bitwise equal to the
reference at that step, and replay the reference's losses bitwise; the last one runs to the end and
``ckptguard prove`` must say PROVEN. Needs CUDA and megatron-core 0.16.1.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ckptguard import StorageOptions
from ckptguard.memory.phases import PhaseKind, PhaseRecorder, RecorderConfig
from ckptguard.memory.process import list_tree, read_process

SEQ = 64


def _init_dist() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)


def build(size: dict[str, int], seed: int = 1234) -> tuple[Any, Any, Any]:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=size["layers"],
        hidden_size=size["hidden"],
        num_attention_heads=size["heads"],
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    gpt = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=size["vocab"],
        max_sequence_length=SEQ,
    ).cuda()
    gpt = Float16Module(cfg, gpt)  # as Megatron-LM: casts the embeddings' output to bf16
    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    model = DistributedDataParallel(config=cfg, ddp_config=ddp, module=gpt)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            min_lr=1e-4,
            bf16=True,
            use_distributed_optimizer=True,
            clip_grad=1.0,
            weight_decay=0.01,
        ),
        [model],
    )
    return model, opt, make_scheduler(opt)


def make_scheduler(opt: Any) -> Any:
    """A fresh scheduler: Megatron's ``OptimizerParamScheduler.load_state_dict`` adds the saved
    ``num_steps`` to its own (``step(increment=num_steps)``), so a restore into one that already
    stepped would double it."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1e-3,
        min_lr=1e-4,
        lr_warmup_steps=4,
        lr_decay_steps=200,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=200,
        wd_incr_style="constant",
    )


class Batches:
    """The data iterator: batch ``position`` is a pure function of the position (saved and
    restored)."""

    def __init__(self, vocab: int, batch: int) -> None:
        self.vocab, self.batch, self.position = vocab, batch, 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(10_000 + self.position)
        self.position += 1
        return torch.randint(0, self.vocab, (self.batch, SEQ + 1), generator=g).cuda()

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.position = int(sd["position"])


def train_step(model: Any, opt: Any, sched: Any, tokens: torch.Tensor) -> tuple[float, float]:
    x, y = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(SEQ, device=x.device).unsqueeze(0).expand_as(x)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device=x.device), 1)[None, None]
    model.zero_grad_buffer()
    opt.zero_grad()
    loss = model(x, pos, mask, labels=y).float().mean()
    loss.backward()
    model.finish_grad_sync()
    ok, norm, _ = opt.step()
    assert ok, "optimizer step skipped"
    sched.step(increment=1)
    return float(loss.item()), float(norm)


def state_digest(ckpt: Any) -> str:
    from ckptguard._disk.digest import digest

    return digest(ckpt.megatron.shard_digests())


def _log(path: Path, **rec: Any) -> None:
    with path.open("a") as f:
        f.write(json.dumps(rec) + "\n")


def _arm(kind: str) -> None:
    """SIGKILL this process at ``kind`` during the next save."""
    import ckptguard.testing as cgt

    if kind.startswith("fault:"):
        cgt.kill_at(kind.split(":", 1)[1])
        return
    me = os.getpid()
    if kind == "megatron_data":
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

        orig = fa._write_item

        # wraps: Megatron passes serialization_format only when inspect.signature(_write_item) names
        # it
        @functools.wraps(orig)
        def write_then_kill(*a: Any, **k: Any) -> Any:  # in Megatron's forked writer process
            out = orig(*a, **k)
            os.kill(me, signal.SIGKILL)
            os._exit(1)
            return out

        fa._write_item = write_then_kill
    elif kind == "megatron_config":
        from megatron.core.dist_checkpointing import serialization as ser

        def kill(
            *a: Any, **k: Any
        ) -> None:  # data and .metadata written; metadata.json (its marker) not
            os.kill(me, signal.SIGKILL)

        ser.save_config = kill
    else:
        raise SystemExit(f"unknown kill {kind}")


def child(args: argparse.Namespace) -> int:
    """One training process: restore, train to --steps saving every --save-every, die where told."""
    import ckptguard as cg
    from ckptguard.integrations.megatron import MegatronCheckpoint

    torch.use_deterministic_algorithms(True, warn_only=True)
    _init_dist()
    size = json.loads(args.size)
    model, opt, sched = build(size)
    data = Batches(size["vocab"], size["batch"])
    log = Path(args.log)
    cfg = cg.CheckpointConfig(
        storage=StorageOptions(dir_template="iter_{step:07d}"),
        retention=cg.KeepLast(3),
        proof=cg.ProofPlan(deterministic=True),
    )
    ckpt = MegatronCheckpoint(args.root, model, opt, config=cfg)
    state = {"scheduler": sched, "data": data}
    t0 = time.perf_counter()
    start = ckpt.restore(state)
    _log(
        log,
        run=args.tag,
        event="restore",
        step=start,
        seconds=time.perf_counter() - t0,
        state=state_digest(ckpt) if start else None,
        position=data.position,
    )
    kill_step, kill_kind = (
        (int(args.kill.split("@")[1]), args.kill.split("@")[0]) if args.kill else (None, None)
    )
    for step in range(start + 1, args.steps + 1):
        tokens = data.next()
        loss, norm = train_step(model, opt, sched, tokens)
        ckpt.manager.record_step(
            step, sample_ids=[data.position - 1], batch=tokens, loss=loss, grad_norm=norm
        )
        ckpt.manager.record_update(step, grad_norm=norm, params_changed=norm > 0)
        shards = ckpt.megatron.shard_digests()
        _log(
            log,
            run=args.tag,
            event="step",
            step=step,
            loss=loss.hex(),
            state=state_digest(ckpt),
            emb={k: v for k, v in shards.items() if k.startswith("embedding.")},
        )
        if kill_kind == "between" and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.async_save:
            pending = (
                ckpt.finalize()
            )  # a finished Megatron write: its commit starts in the background
            if pending is not None:
                _log(log, run=args.tag, event="finalized", step=step, saved=pending.step)
        if step % args.save_every == 0:
            if step == kill_step:
                _arm(kill_kind)
            t0 = time.perf_counter()
            if args.async_save:
                ckpt.save_async(step, state)
            else:
                ckpt.save(step, state)
            _log(log, run=args.tag, event="save", step=step, seconds=time.perf_counter() - t0)
    if args.async_save:
        ckpt.wait()
    torch.distributed.destroy_process_group()
    return 0


def _run_child(
    args: argparse.Namespace, root: Path, log: Path, tag: str, kill: str | None, steps: int
) -> int:
    cmd = [
        sys.executable,
        __file__,
        "child",
        "--root",
        str(root),
        "--log",
        str(log),
        "--tag",
        tag,
        "--steps",
        str(steps),
        "--save-every",
        str(args.save_every),
        "--size",
        args.size,
    ]
    if kill:
        cmd += ["--kill", kill]
    if args.async_save:
        cmd += ["--async"]
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), check=False).returncode
    print(f"[{tag}] kill={kill} rc={rc} {time.perf_counter() - t0:.1f}s", flush=True)
    return rc


KILLS = [
    "between@7",
    "megatron_data@10",
    "megatron_config@10",
    "fault:commit.before_manifest@10",
    "fault:commit.before_tracker@10",
    "between@12",
]


def campaign(args: argparse.Namespace) -> int:
    from ckptguard.integrations.megatron import check_files

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log = work / "log.jsonl"
    if _run_child(args, work / "ref", log, "ref", None, args.steps) != 0:
        print("CAMPAIGN FAIL: the reference run failed", flush=True)
        return 1
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    ref = {r["step"]: r for r in recs if r["run"] == "ref" and r["event"] == "step"}
    root = work / "root"
    results, torn = [], []
    kills = args.kills.split(",") if args.kills else KILLS
    for i, kill in enumerate([*kills, None]):
        tag = f"run{i}"
        rc = _run_child(args, root, log, tag, kill, args.steps)
        recs = [json.loads(x) for x in log.read_text().splitlines()]
        mine = [r for r in recs if r["run"] == tag]
        restore = next((r for r in mine if r["event"] == "restore"), None)
        if restore is None:
            print(f"CAMPAIGN FAIL: {tag} died before its restore finished (rc {rc})", flush=True)
            return 1
        steps = [r for r in mine if r["event"] == "step"]
        exact = restore["step"] == 0 or restore["state"] == ref[restore["step"]]["state"]
        replay = all(
            r["loss"] == ref[r["step"]]["loss"] and r["state"] == ref[r["step"]]["state"]
            for r in steps
        )
        for tmp in sorted(root.glob(".tmp-*")):  # what the kill left: never a resume target
            try:
                check_files(tmp / "megatron")
                verdict = "complete Megatron files (uncommitted: no manifest/rename/tracker)"
            except Exception as exc:
                verdict = f"{type(exc).__name__}: {str(exc)[:160]}"
            torn.append({"after": tag, "dir": tmp.name, "check_files": verdict})
        results.append(
            {
                "run": tag,
                "kill": kill,
                "rc": rc,
                "restored": restore["step"],
                "restore_s": round(restore["seconds"], 3),
                "restored_exact": exact,
                "replayed_steps": len(steps),
                "replay_bitwise": replay,
                "tracker": (root / "latest_checkpointed_iteration.txt").read_text().strip()
                if (root / "latest_checkpointed_iteration.txt").exists()
                else None,
            }
        )
        print(json.dumps(results[-1]), flush=True)
    final_ref = ref[args.steps]["state"]
    final = [r for r in recs if r["run"] == f"run{len(kills)}" and r["event"] == "step"]
    prove = subprocess.run(
        [sys.executable, "-m", "ckptguard.cli", "prove", str(root)],
        capture_output=True,
        text=True,
        check=False,
    )
    summary = {
        "kills": len(kills),
        "runs": results,
        "torn_dirs": torn,
        "final_equal_reference": bool(final) and final[-1]["state"] == final_ref,
        "prove_rc": prove.returncode,
        "prove": prove.stdout[-4000:] + prove.stderr[-2000:],
    }
    print(prove.stdout, prove.stderr, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "megatron_campaign.json").write_text(json.dumps(summary, indent=1))
    ok = (
        all(r["restored_exact"] and r["replay_bitwise"] for r in results)
        and summary["final_equal_reference"]
    )
    ok = (
        ok
        and prove.returncode == 0
        and all(r["rc"] == -9 for r in results[:-1])
        and results[-1]["rc"] == 0
    )
    print("CAMPAIGN", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


class TreePss:
    """The peak over time of this process tree's summed PSS (Megatron forks its writers), at ~10
    Hz."""

    def __init__(self) -> None:
        import threading

        self.peak, self.procs, self._stop = 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            snaps = [read_process(pid, with_fds=False) for pid in list_tree(os.getpid())]
            self.peak = max(self.peak, sum(s.pss or 0 for s in snaps if s is not None))
            self.procs = max(self.procs, sum(s is not None for s in snaps))
            self._stop.wait(0.1)

    def __enter__(self) -> TreePss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def save_peaks(path: Path) -> list[dict[str, Any]]:
    """Per save phase: the host's used memory at its start and its in-phase peak (20 Hz), the
    process's RSS."""
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    starts = {(r["policy_version"], r["step"]): r for r in recs if r["kind"] == "phase_start"}
    rows = []
    for r in recs:
        if r["kind"] != "phase_end":
            continue
        start = starts[(r["policy_version"], r["step"])]
        base = start["host"]["current"]
        peak = r["peak"]
        rows.append(
            {
                "writer": r["policy_version"],
                "step": r["step"],
                "seconds": round(r["duration_s"], 3),
                "host_before_gib": round(base / 2**30, 3),
                "host_peak_over_before_gib": round((peak["host_current"] - base) / 2**30, 3),
                "process_rss_peak_gib": round(peak["process_rss"] / 2**30, 3),
                "samples": peak["samples"],
            }
        )
    return rows


def _drop_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def bench(args: argparse.Namespace) -> int:
    """Megatron's writer through ckptguard against ckptguard's own writer, on the same tensors."""
    import ckptguard as cg
    from ckptguard.integrations import megatron as mg

    _init_dist()
    size = json.loads(args.size)
    model, opt, sched = build(size)
    data = Batches(size["vocab"], size["batch"])
    for _ in range(2):
        train_step(model, opt, sched, data.next())
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cfg = cg.CheckpointConfig(
        storage=StorageOptions(dir_template="iter_{step:07d}"), retention=cg.KeepLast(2)
    )
    ckpt = mg.MegatronCheckpoint(work / "megatron", model, opt, config=cfg)
    from megatron.core.dist_checkpointing.mapping import ShardedBase, apply_factories

    sd = ckpt.megatron.sharded_state_dict()
    apply_factories(sd)
    flat: dict[str, torch.Tensor] = {}

    def walk(node: Any) -> None:
        if isinstance(node, ShardedBase) and isinstance(node.data, torch.Tensor):
            flat[mg._shard_name(node).replace(".", "/")] = node.data
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk(sd)
    nbytes = sum(t.numel() * t.element_size() for t in flat.values())
    own = cg.CheckpointManager(work / "own", config=cfg)
    own_async = cg.CheckpointManager(work / "own_async", config=cfg)
    rows: list[dict[str, Any]] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # The save step's host memory, Megatron's writer (its forked writer processes included: the host
    # figure is the machine's, which runs nothing else) against ckptguard's own writer on the same
    # tensors.
    mem_path = out / "megatron_mem.jsonl"
    recorder = PhaseRecorder(RecorderConfig(path=mem_path, pss_every_s=0.0, sample_hz=20.0))
    trees: list[dict[str, Any]] = []
    torch.cuda.synchronize()
    for rep in range(args.reps):
        step = rep + 1
        t0 = time.perf_counter()
        with (
            recorder.phase(PhaseKind.SAVE, step=step, policy_version="megatron"),
            TreePss() as tree,
        ):
            ckpt.save(step, {"scheduler": sched})
        trees.append(
            {
                "writer": "megatron",
                "step": step,
                "tree_pss_peak_gib": round(tree.peak / 2**30, 3),
                "processes": tree.procs,
            }
        )
        total = time.perf_counter() - t0
        rows.append(
            {
                "path": "megatron (MegatronCheckpoint.save)",
                "rep": rep,
                "blocked_s": total,
                "megatron_write_s": ckpt.last_write_seconds,
                "ckptguard_commit_s": total - ckpt.last_write_seconds,
            }
        )
        t0 = time.perf_counter()
        with (
            recorder.phase(PhaseKind.SAVE, step=step, policy_version="ckptguard_sync"),
            TreePss() as tree,
        ):
            own.save(step, {"shards": flat, "scheduler": sched})
        trees.append(
            {
                "writer": "ckptguard_sync",
                "step": step,
                "tree_pss_peak_gib": round(tree.peak / 2**30, 3),
                "processes": tree.procs,
            }
        )
        total = time.perf_counter() - t0
        rows.append(
            {"path": "ckptguard own (CheckpointManager.save)", "rep": rep, "blocked_s": total}
        )
        t0 = time.perf_counter()
        with (
            recorder.phase(PhaseKind.SAVE, step=step, policy_version="ckptguard_async"),
            TreePss() as tree,
        ):
            pending = own_async.save_async(step, {"shards": flat, "scheduler": sched})
            blocked = time.perf_counter() - t0
            own_async.wait()
        trees.append(
            {
                "writer": "ckptguard_async",
                "step": step,
                "tree_pss_peak_gib": round(tree.peak / 2**30, 3),
                "processes": tree.procs,
            }
        )
        rows.append(
            {
                "path": "ckptguard own (save_async)",
                "rep": rep,
                "blocked_s": blocked,
                "commit_s": time.perf_counter() - t0,
                "pending": pending is not None,
            }
        )
    if args.async_save:
        for rep in range(args.reps):
            step = 100 + rep
            t0 = time.perf_counter()
            ckpt.save_async(step, {"scheduler": sched})
            blocked = time.perf_counter() - t0
            pending = None
            while pending is None:  # the training loop's step boundaries, every 10 ms
                time.sleep(0.01)
                pending = ckpt.finalize()
            finalized = time.perf_counter() - t0
            ckpt.wait()
            rows.append(
                {
                    "path": "megatron (MegatronCheckpoint.save_async)",
                    "rep": rep,
                    "blocked_s": blocked,
                    "megatron_write_done_s": finalized,
                    "commit_s": time.perf_counter() - t0,
                }
            )
    recorder.close()
    memory = [{**m, **t} for m, t in zip(save_peaks(mem_path), trees, strict=True)]
    for rep in range(args.reps):
        cold = _drop_cache()
        t0 = time.perf_counter()
        ckpt.restore({"scheduler": make_scheduler(opt)})
        rows.append(
            {
                "path": "megatron (MegatronCheckpoint.restore)",
                "rep": rep,
                "restore_s": time.perf_counter() - t0,
                "cold_cache": cold,
            }
        )
        cold = _drop_cache()
        t0 = time.perf_counter()
        own.restore({"shards": flat, "scheduler": make_scheduler(opt)})
        rows.append(
            {
                "path": "ckptguard own (CheckpointManager.restore)",
                "rep": rep,
                "restore_s": time.perf_counter() - t0,
                "cold_cache": cold,
            }
        )
    res = {
        "size": size,
        "state_bytes": nbytes,
        "tensors": len(flat),
        "rows": rows,
        "memory": memory,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
    }
    (out / "megatron_bench.json").write_text(json.dumps(res, indent=1))
    for r in [*rows, *memory]:
        print(json.dumps(r), flush=True)
    print(f"state {nbytes / 2**30:.3f} GiB in {len(flat)} tensors", flush=True)
    torch.distributed.destroy_process_group()
    return 0


def _globals_named(path: Path) -> list[str]:
    """Every global a pickle (or a torch zip's data.pkl) names; our own fresh file, on the
    device."""
    import io
    import pickle
    import zipfile

    seen: set[str] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add(f"{module}.{name}")
            return super().find_class(module, name)

        def persistent_load(self, pid: Any) -> Any:
            return None

    raw = path.read_bytes()
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            raw = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    Recording(io.BytesIO(raw)).load()
    return sorted(seen)


def fixture(args: argparse.Namespace) -> int:
    """Tiny committed roots for the CPU tests (model + DistributedOptimizer, steps 2 and 4; the
    model alone, step 4), plus what Megatron's pickled files name."""
    import ckptguard as cg
    from ckptguard.integrations.megatron import MegatronCheckpoint

    _init_dist()
    size = json.loads(args.size)
    model, opt, sched = build(size)
    data = Batches(size["vocab"], size["batch"])
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    root = work / "megatron_root"
    cfg = cg.CheckpointConfig(storage=StorageOptions(dir_template="iter_{step:07d}"))
    ckpt = MegatronCheckpoint(root, model, opt, config=cfg)
    state = {"scheduler": sched, "data": data}
    for step in (1, 2, 3, 4):
        train_step(model, opt, sched, data.next())
        if step % 2 == 0:
            ckpt.save(step, state)
    shards = ckpt.megatron.shard_digests()
    mdir = root / "iter_0000004" / "megatron"
    names = {f: _globals_named(mdir / f) for f in (".metadata", "common.pt")}
    plain = MegatronCheckpoint(
        work / "megatron_model_only", model, None, config=cfg
    )  # what a CPU test can rebuild
    plain.save(4, {"data": data})
    info = {
        "files": sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()),
        "globals": names,
        "shards": len(shards),
        "megatron": __import__("megatron.core").core.__version__,
    }
    (root.parent / "fixture_info.json").write_text(json.dumps(info, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.make_archive(str(out / "megatron_fixture"), "gztar", root_dir=work)
    print(json.dumps(info, indent=1), flush=True)
    torch.distributed.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["campaign", "bench", "fixture", "child"])
    p.add_argument("--work", default="/tmp/megatron-bench")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--root")
    p.add_argument("--log")
    p.add_argument("--tag", default="run")
    p.add_argument("--kill")
    p.add_argument("--kills", help="campaign: comma-separated KIND@STEP list (default: KILLS)")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--async",
        dest="async_save",
        action="store_true",
        help="campaign/child: MegatronCheckpoint.save_async (Megatron's "
        "async writer) and finalize() "
        "at every step; bench: adds its rows",
    )
    p.add_argument(
        "--size",
        default=json.dumps({"layers": 2, "hidden": 128, "heads": 4, "vocab": 512, "batch": 4}),
        help="JSON: layers, hidden, heads, vocab, batch",
    )
    args = p.parse_args(argv)
    return {"campaign": campaign, "bench": bench, "fixture": fixture, "child": child}[args.mode](
        args
    )


if __name__ == "__main__":
    sys.exit(main())
