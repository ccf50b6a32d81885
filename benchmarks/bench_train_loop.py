"""What checkpointing costs a real training loop, per method, side by side, in one run.

A GPT-style transformer (fp32 parameters, bf16 autocast, fused AdamW; the default config is
~553M parameters, 6.2 GiB of model + optimizer) trains on random tokens and saves every K steps
with each method in turn:

    none, cg_sync, cg_async, cg_async_prepared, cg_async_wait, cg_async_gpu, cg_tiers, dcp_sync,
    dcp_async (DefaultStager: pinned, async staging, non-blocking copies), torch_save

Every method runs the loop a user writes: a new job (model and an optimizer with no state yet), the
manager's ``restore`` on a fresh root, then training from step 1 with a save every K steps, the
first save inside the timed loop like every later one. cg_async is ``save_async`` with the default
options (``OnBusy.SKIP``: a save requested while a commit runs is skipped, counted in
``skipped_steps``); cg_async_prepared the same after ``prepare_async`` (the optional hint);
cg_async_wait waits for the previous commit (``OnBusy.WAIT``); cg_async_gpu snapshots into spare GPU
memory; cg_tiers is a ``TieredCheckpoint`` with the fast tier in ``--fast-dir`` (``/dev/shm``) every
``--fast-every`` steps and the persistent tier every ``--persistent-every``, through ``save_async``.

Per method: the time each save blocked the loop (for the async methods also the wait of the next
optimizer step), p50/p95 step time while a background write runs against the steps without one, the
loop's total overhead against `none`, the host memory the method added (peak while the loop ran, and
what is left after its last save), each save's throughput and the restore's (cold page cache)
against this disk's own write+fsync and cold read of as many bytes, measured in the same run, and
whether the restore is bitwise exact. The copy of the state the bitwise check compares with, taken
at each save, is the benchmark's own instrument: its time is taken off the loop's
(``reference_copies_s_excluded``; figures committed before 2026-12-06 16:55 UTC counted it against
the saves).

    python benchmarks/bench_train_loop.py --out $OUT/train_loop.json --dir /tmp/cg-loop
    torchrun --nproc-per-node 2 benchmarks/bench_train_loop.py ...   # FSDP2, any rank count
    python benchmarks/bench_train_loop.py --tiny --out x.json  # CPU, seconds, correctness only
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import os
import shutil
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import ckptguard as cg
from ckptguard import AsyncOptions

METHODS = (
    "none",
    "none_again",
    "cg_sync",
    "cg_async",
    "cg_async_prepared",
    "cg_async_ready",
    "cg_async_wait",
    "cg_async_gpu",
    "cg_tiers",
    "dcp_sync",
    "dcp_async",
    "torch_save",
)
GiB = 1 << 30


# ---------------------------------------------------------------- the model


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.emb, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab, bias=False)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        x = self.emb(tok) + self.pos(torch.arange(tok.shape[1], device=tok.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


class Job:
    """Model, optimizer and batch on this rank; FSDP2 when more than one rank."""

    def __init__(self, a: argparse.Namespace, device: torch.device, seed: int) -> None:
        torch.manual_seed(seed)
        self.device, self.a = device, a
        self.model = GPT(a.vocab, a.d_model, a.layers, a.heads, a.seq).to(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            from torch.distributed.fsdp import fully_shard

            for blk in self.model.blocks:
                fully_shard(blk)
            fully_shard(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.type == "cuda")
        g = torch.Generator(device="cpu").manual_seed(1000 + rank())
        self.tok = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g).to(device)

    def step(self) -> float:
        self.opt.zero_grad(set_to_none=True)
        ctx = (
            torch.autocast("cuda", torch.bfloat16)
            if self.device.type == "cuda"
            else contextlib.nullcontext()
        )
        with ctx:
            logits = self.model(self.tok[:, :-1])
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), self.tok[:, 1:].reshape(-1)
        )
        loss.backward()
        self.opt.step()
        return float(loss.item())  # a real loop logs its loss: the step ends on the host

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.opt}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every saved tensor (local shards), keyed; for bitwise comparison."""
        out = {f"m.{k}": _local(v) for k, v in self.model.state_dict().items()}
        for i, s in self.opt.state_dict()["state"].items():
            out.update({f"o.{i}.{k}": _local(v) for k, v in s.items() if torch.is_tensor(v)})
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


MODEL_ARGS = {"d_model": 2048, "layers": 10, "heads": 16, "vocab": 12288, "seq": 1024, "batch": 16}
"""The 556M-param GPT of the issue (6.21 GiB of fp32 model + AdamW on one rank), and the batch it
trains on."""
TINY_MODEL = {"d_model": 32, "layers": 2, "heads": 2, "vocab": 64, "seq": 8, "batch": 2}


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """--d-model, --layers, --heads, --vocab, --seq, --batch: the Job's shape (every benchmark that
    trains it)."""
    for name, default in MODEL_ARGS.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)


def _plain(x: Any) -> Any:
    """Dicts (OrderedDicts and other subclasses too) as plain dicts, all the way down."""
    return {k: _plain(v) for k, v in x.items()} if isinstance(x, dict) else x


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# ---------------------------------------------------------------- measuring


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Sampler:
    """Peak RSS of this process, sampled every 10 ms in a thread."""

    def __init__(self) -> None:
        self.peak, self._stop = rss(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss())

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return max(self.peak, rss())


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def drop_cache(path: Path) -> None:
    """Drop the (synced) pages of every file under path: the next read is cold."""
    os.sync()
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_figures(where: Path, nbytes: int) -> dict[str, float]:
    """This disk's own write+fsync and cold sequential read of nbytes, in GiB/s."""
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"disk_probe_{rank()}.bin"
    block = os.urandom(64 << 20)
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[: min(left, len(block))])
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t
    drop_cache(where)
    buf = bytearray(64 << 20)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    read_s = time.perf_counter() - t
    path.unlink()
    return {
        "bytes": nbytes,
        "write_fsync_gib_s": nbytes / GiB / write_s,
        "cold_read_gib_s": nbytes / GiB / read_s,
    }


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


# ---------------------------------------------------------------- methods


class Method:
    """One way to save and restore; ``save`` returns the seconds the loop was held."""

    name = "?"

    def __init__(self, root: Path, job: Job) -> None:
        self.root, self.job = root, job
        self.last_dir: Path | None = None
        self.write_seconds: list[float] = []
        self._began = 0.0

    def save(self, step: int) -> float:
        raise NotImplementedError

    def writing(self) -> bool:
        return False

    def before_step(self) -> float:
        return 0.0

    def finish(self) -> None:
        pass

    def restore(self, job: Job) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class CgMethod(Method):
    """ckptguard as a user's loop calls it: ``restore`` first (a fresh root), then
    ``save``/``save_async``."""

    def __init__(self, root: Path, job: Job, *, mode: str, a: argparse.Namespace) -> None:
        super().__init__(root, job)
        self.mode = mode
        gpu = (1 << 40) if mode == "gpu" else 0
        on_busy = cg.OnBusy.WAIT if mode == "wait" else cg.OnBusy.SKIP
        config = cg.CheckpointConfig(
            async_save=AsyncOptions(gpu_bytes=gpu, on_busy=on_busy), retention=None
        )
        self.mgr: Any
        if mode == "tiers":
            fast = a.fast_dir / root.name
            shutil.rmtree(fast, ignore_errors=True)
            self.mgr = cg.TieredCheckpoint(
                fast,
                persistent=root,
                fast_every=a.fast_every,
                persistent_every=a.persistent_every,
                config=config,
            )
        else:
            self.mgr = cg.CheckpointManager(root, config=config)
        self.skipped: list[int] = []
        self.mgr.restore(
            job.state()
        )  # the documented start: a fresh root, the optimizer without state
        self.prepared = (
            self.mgr.prepare_async(job.state()) if mode in ("prepared", "ready") else None
        )
        if (
            mode == "ready"
        ):  # the hint, waited for before the loop: the saves' cost without the pinning's
            self.prepared.result(timeout=600)
        self.pending: Any = None
        self.fence_waits: list[float] = []
        self.staged: list[float] = []
        self.costs: list[dict[str, Any]] = []

    def save(self, step: int) -> float:
        if self.mode == "sync":
            t = time.perf_counter()
            self.last_dir = self.mgr.save(step, self.job.state())
            self.write_seconds.append(time.perf_counter() - t)
            return time.perf_counter() - t
        if self.mode == "wait":
            self.finish()
        return self._save_or_skip(step)

    def _save_or_skip(self, step: int) -> float:
        """The save as the loop calls it; a request while a commit runs is skipped (OnBusy.SKIP, on
        every rank)."""
        if self.pending is not None and self.pending.done():
            self.finish()
        t = time.perf_counter()
        pending = self.mgr.save_async(step, self.job.state())
        blocked = time.perf_counter() - t
        if pending is None:
            self.skipped.append(step)
        else:
            self.finish()  # the previous one is published (the save started): collect its figures
            self.pending, self._began = pending, t
        return blocked

    def writing(self) -> bool:
        if self.pending is not None and self.pending.done():
            self.finish()
        return self.pending is not None

    def finish(self) -> None:
        if self.pending is not None:
            p, self.pending = self.pending, None
            done = p.wait()
            self.last_dir = _newest(done) if isinstance(done, dict) else done
            self.write_seconds.append(time.perf_counter() - self._began)
            self.fence_waits.append(
                p.mutation_wait_seconds if hasattr(p, "mutation_wait_seconds") else 0.0
            )
            if getattr(p, "staged_seconds", None) is not None:
                self.staged.append(p.staged_seconds)
            if rank() == 0 and self.last_dir is not None:
                cost = json.loads((self.last_dir / "manifest.json").read_text()).get("cost") or {}
                self.costs.append(
                    {
                        k: cost.get(k)
                        for k in (
                            "live_bytes",
                            "staged_host_bytes",
                            "staged_gpu_bytes",
                            "host_pool_bytes",
                        )
                    }
                )

    def preparing(self) -> bool:
        """A staging pool is being mapped (and, under CUDA, pinned) in the background."""
        managers = [self.mgr.fast, self.mgr.persistent] if self.mode == "tiers" else [self.mgr]
        return any(
            m is not None and m._staging.pool is not None and m._staging.pool.growing
            for m in managers
        )

    def skipped_total(self) -> int:
        return int(self.mgr.busy.skipped_total)

    def pool_bytes(self) -> int:
        managers = [self.mgr.fast, self.mgr.persistent] if self.mode == "tiers" else [self.mgr]
        return sum(
            m._staging.pool.held_bytes
            for m in managers
            if m is not None and m._staging.pool is not None
        )

    def restore(self, job: Job) -> None:
        self.mgr.restore(job.state())

    def close(self) -> None:
        self.mgr.close()


def _newest(paths: dict[Any, Path]) -> Path | None:
    """A tiered save's persistent directory where it wrote one (what a restore after losing the node
    reads)."""
    by_name = {getattr(k, "name", str(k)).lower(): v for k, v in paths.items()}
    return by_name.get("persistent") or by_name.get("fast")


class DcpMethod(Method):
    def __init__(self, root: Path, job: Job, *, use_async: bool) -> None:
        super().__init__(root, job)
        self.use_async = use_async
        self.response: Any = None
        self.stager: Any = None
        self.staging_waits: list[float] = []
        self.reuse_stager = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13)
        self.pg = None
        if dist.is_initialized():
            self.pg = dist.new_group(backend="gloo", timeout=_dt.timedelta(seconds=1800))

    def _sd(self, job: Job) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        m, o = get_state_dict(job.model, job.opt)
        # The tensors only, in plain dicts: torch 2.11's DefaultStager deep-copies the state and
        # fails on any object it must rebuild from a class (KeyError: <class 'type'>); the
        # hyperparameters are the run's own.
        return _plain({"model": m, "optim": {"state": o["state"]}})

    def save(self, step: int) -> float:
        import torch.distributed.checkpoint as dcp

        self.finish()
        path = self.root / f"step_{step:08d}"
        t = time.perf_counter()
        self._began = t
        single = not dist.is_initialized()
        if not self.use_async:
            dcp.save(
                self._sd(self.job), checkpoint_id=str(path), process_group=self.pg, no_dist=single
            )
            self.last_dir = path
            self.write_seconds.append(time.perf_counter() - t)
            return time.perf_counter() - t
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self.stager is None or not self.reuse_stager:
            # One stager, whose pinned buffers every save reuses, where torch allows: 2.11's fails
            # on its second save (KeyError: <class 'type'> in its deep copy), so there each save
            # gets a new one and pins its buffers anew (what a 2.11 user of DefaultStager gets).
            if self.stager is not None:
                self.stager.close()
            cuda = torch.cuda.is_available()
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=cuda,
                )
            )
        self.response = dcp.async_save(
            self._sd(self.job),
            checkpoint_id=str(path),
            process_group=self.pg,
            async_stager=self.stager,
            no_dist=single,
        )
        self.last_dir = path
        return time.perf_counter() - t

    def _upload(self) -> Any:
        r = self.response
        return getattr(r, "upload_completion", r)

    def before_step(self) -> float:
        # DCP's contract with async staging: the state must not change before staging completed.
        staging = getattr(self.response, "staging_completion", None)
        if staging is None or staging.done():
            return 0.0
        t = time.perf_counter()
        staging.result()
        waited = time.perf_counter() - t
        self.staging_waits.append(waited)
        return waited

    def writing(self) -> bool:
        if self.response is not None and self._upload().done():
            self.finish()
        return self.response is not None

    def finish(self) -> None:
        if self.response is not None:
            self.before_step()
            self._upload().result()
            self.response = None
            self.write_seconds.append(time.perf_counter() - self._began)

    def restore(self, job: Job) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        sd = self._sd(job)
        dcp.load(
            sd,
            checkpoint_id=str(self.last_dir),
            process_group=self.pg,
            no_dist=not dist.is_initialized(),
        )
        groups = get_state_dict(job.model, job.opt)[1]["param_groups"]
        set_state_dict(
            job.model,
            job.opt,
            model_state_dict=sd["model"],
            optim_state_dict={"state": sd["optim"]["state"], "param_groups": groups},
        )

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


class TorchSave(Method):
    def save(self, step: int) -> float:
        path = self.root / f"step_{step:08d}"
        path.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        with open(path / f"rank_{rank()}.pt", "wb") as f:
            torch.save(
                {"model": self.job.model.state_dict(), "optim": self.job.opt.state_dict()}, f
            )
            f.flush()
            os.fsync(f.fileno())
        self.last_dir = path
        self.write_seconds.append(time.perf_counter() - t)
        return time.perf_counter() - t

    def restore(self, job: Job) -> None:
        # weights_only: a checkpoint is never unpickled unrestricted (DTensor shards load too).
        sd = torch.load(
            self.last_dir / f"rank_{rank()}.pt", map_location=job.device, weights_only=True
        )
        job.model.load_state_dict(sd["model"])
        job.opt.load_state_dict(sd["optim"])


CG_MODES = {
    "cg_sync": "sync",
    "cg_async": "skip",
    "cg_async_prepared": "prepared",
    "cg_async_ready": "ready",
    "cg_async_wait": "wait",
    "cg_async_gpu": "gpu",
    "cg_tiers": "tiers",
}


def make(name: str, root: Path, job: Job, a: argparse.Namespace) -> Method | None:
    if name in ("none", "none_again"):
        return None
    if name.startswith("cg_"):
        return CgMethod(root, job, mode=CG_MODES[name], a=a)
    if name.startswith("dcp_"):
        return DcpMethod(root, job, use_async=name == "dcp_async")
    return TorchSave(root, job)


# ---------------------------------------------------------------- the loop


def run_method(
    name: str, a: argparse.Namespace, device: torch.device, disk: dict[str, float]
) -> dict:
    """The user's loop for one method: a new job, the method's start (a restore on a fresh root),
    then ``every * (saves + 1)`` steps saving every ``every`` steps from the first interval on, all
    timed."""
    root = a.dir / name
    if rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    barrier()
    job = Job(a, device, seed=0)
    every = a.fast_every if name == "cg_tiers" else a.every
    if device.type == "cuda":
        torch.cuda.synchronize()
    gc.collect()
    base_rss = rss()
    sampler = Sampler()
    method = make(name, root, job, a)
    steps, saves = a.every * (a.saves + 1), []
    step_times: list[tuple[float, bool]] = []
    preparing: list[int] = []
    reference: dict[str, torch.Tensor] | None = None
    instrument_s = 0.0
    t_loop = time.perf_counter()
    last = t_loop
    for i in range(1, steps + 1):
        held = method.before_step() if method else 0.0
        busy = bool(method and method.writing())
        if isinstance(method, CgMethod) and method.preparing():
            preparing.append(i)
        job.step()
        now = time.perf_counter()
        step_times.append((now - last, busy))
        last = now
        if method is not None and i % every == 0 and i < steps:
            kept = reference
            # The bitwise check's instrument: its time is not the loop's.
            reference, took = _reference(job)
            instrument_s += took
            blocked = method.save(i)
            if isinstance(method, CgMethod) and method.skipped and method.skipped[-1] == i:
                reference = kept  # skipped: the restore loads the last save that was taken
            saves.append({"step": i, "blocked_s": round(blocked, 4), "next_step_wait_s": 0.0})
            last = time.perf_counter()
            step_times[-1] = (step_times[-1][0] + (last - now) - took, busy)
        if held and saves:
            saves[-1]["next_step_wait_s"] = round(saves[-1]["next_step_wait_s"] + held, 4)
    loop_s = time.perf_counter() - t_loop - instrument_s
    t = time.perf_counter()
    if method is not None:
        method.finish()
    tail_s = time.perf_counter() - t
    gc.collect()
    peak = sampler.stop()
    left = rss()
    out: dict[str, Any] = {
        "loop_s": round(loop_s, 3),
        "tail_wait_s": round(tail_s, 3),
        "steps": steps,
        "save_every": every,
        "host_extra_peak_bytes": peak - base_rss,
        "host_extra_left_bytes": left - base_rss,
        "saves": saves,
        "reference_copies_s_excluded": round(instrument_s, 4),
    }
    _step_figures(out, step_times)
    out["step_s"] = [round(t, 4) for t, _ in step_times]
    out["steps_while_preparing"] = preparing
    if method is None:
        del job
        _free(device)
        return out
    if isinstance(method, CgMethod):
        for save, wait in zip(
            (s for s in saves if s["step"] not in method.skipped), method.fence_waits, strict=False
        ):
            save["next_step_wait_s"] = round(max(save["next_step_wait_s"], wait), 4)
        out["skipped_steps"] = method.skipped
        out["skipped_by_manager"] = method.skipped_total()
        if method.prepared is not None:
            out["prepare_async_bytes"] = method.prepared.result(timeout=600)
        out["next_step_fence_wait_s"] = [round(x, 4) for x in method.fence_waits]
        out["staged_s"] = [round(x, 4) for x in method.staged]
        out["save_costs"] = method.costs
        out["pool_held_bytes_before_close"] = method.pool_bytes()
        manifest = json.loads((method.last_dir / "manifest.json").read_text())
        out["manifest_cost"] = manifest.get("cost")
    barrier()
    nbytes = dir_bytes(method.last_dir) if rank() == 0 and method.last_dir is not None else 0
    out["checkpoint_bytes"] = nbytes
    out["write_s"] = [round(x, 3) for x in method.write_seconds]
    if nbytes and method.write_seconds:
        best = min(method.write_seconds)
        out["save_gib_s"] = round(nbytes / GiB / best, 3)
        out["save_vs_disk_write"] = round(nbytes / GiB / best / disk["write_fsync_gib_s"], 3)
    method.close()
    if isinstance(method, CgMethod):
        out["pool_held_bytes_after_close"] = method.pool_bytes()
        out["host_extra_after_close_bytes"] = rss() - base_rss
    del job
    _free(device)
    out.update(restore(method, a, device, reference, nbytes, disk))
    if rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
        if name == "cg_tiers":
            shutil.rmtree(a.fast_dir / name, ignore_errors=True)
    return out


def _reference(job: Job) -> tuple[dict[str, torch.Tensor], float]:
    """A copy of every saved tensor for the bitwise check of the restore, and the seconds it took.
    The loop's step has just ended on the host (``loss.item()``), so the device is idle before it;
    it is synchronized after, and the time is taken off the loop's: the loop without saves takes no
    such copy."""
    t = time.perf_counter()
    ref = {k: v.detach().clone() for k, v in job.tensors().items()}
    if job.device.type == "cuda":
        torch.cuda.synchronize(job.device)
    return ref, time.perf_counter() - t


def _step_figures(out: dict[str, Any], step_times: list[tuple[float, bool]]) -> None:
    busy_t = [t for t, b in step_times[1:] if b]
    idle_t = [
        t
        for t, b in step_times[1:]
        if not b and t < 10 * statistics.median([x for x, _ in step_times])
    ]
    every = [t for t, _ in step_times[1:]]
    out["step_p50_s"], out["step_p95_s"] = pct(every, 0.5), pct(every, 0.95)
    out["steps_during_write"] = len(busy_t)
    out["during_write_p50_s"], out["during_write_p95_s"] = pct(busy_t, 0.5), pct(busy_t, 0.95)
    out["without_write_p50_s"], out["without_write_p95_s"] = pct(idle_t, 0.5), pct(idle_t, 0.95)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def restore(
    method: Method,
    a: argparse.Namespace,
    device: torch.device,
    reference: dict | None,
    nbytes: int,
    disk: dict[str, float],
) -> dict[str, Any]:
    fresh = Job(a, device, seed=7)
    fresh.step()  # the optimizer has state to load into
    if rank() == 0:
        drop_cache(method.last_dir)
    barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    extra: dict[str, Any] = {}
    t = time.perf_counter()
    if isinstance(method, CgMethod):
        extra["read"] = cg_restore(
            method.last_dir.parent if method.last_dir else method.root, fresh, a.read_threads
        )
    else:
        method.restore(fresh)
    if device.type == "cuda":
        torch.cuda.synchronize()
    restore_s = time.perf_counter() - t
    if isinstance(method, CgMethod):
        # What the restore spends outside the read (precheck, plan, apply, verification).
        extra["restore_outside_read_s"] = round(
            restore_s - float(extra["read"].get("seconds", 0.0)), 3
        )
    settings = [x for x in a.alt_read.split(",") if x.strip()]  # --alt-read '': none
    for setting in settings if isinstance(method, CgMethod) and method.mode == "sync" else []:
        # The same restore with other read settings (threads:buffer MiB:pool MiB): what they are
        # worth on this disk.
        alt = [int(x) for x in setting.split(":")]
        if rank() == 0:
            drop_cache(method.last_dir)
        barrier()
        t = time.perf_counter()
        got_alt = {"setting": setting, **cg_restore(method.root, fresh, *alt[:3])}
        if device.type == "cuda":
            torch.cuda.synchronize()
        got_alt["restore_s"] = round(time.perf_counter() - t, 3)
        if nbytes:
            got_alt["restore_vs_cold_read"] = round(
                nbytes / GiB / got_alt["restore_s"] / disk["cold_read_gib_s"], 3
            )
        extra.setdefault("read_alt", []).append(got_alt)
    if isinstance(method, CgMethod) and method.last_dir is not None and nbytes:
        # The acceptance's yardstick: a cold sequential read of the same files, right after the
        # restore; and the restore until the state is loaded (the close that releases the staging
        # restore prepared, apart).
        same = same_files_read(method.last_dir)
        ready_s = restore_s - float(extra["read"].get("close_s", 0.0))
        extra.update(
            same_files=same,
            restore_ready_s=round(ready_s, 3),
            restore_vs_same_files_read=round(same["seconds"] / restore_s, 3),
            restore_ready_vs_same_files_read=round(same["seconds"] / ready_s, 3),
        )
    got = fresh.tensors()
    exact = (
        reference is not None
        and set(got) == set(reference)
        and all(torch.equal(got[k], reference[k]) for k in reference)
    )
    out = {"restore_s": round(restore_s, 3), "restore_bitwise_exact": bool(exact), **extra}
    if nbytes:
        out["restore_gib_s"] = round(nbytes / GiB / restore_s, 3)
        out["restore_vs_cold_read"] = round(nbytes / GiB / restore_s / disk["cold_read_gib_s"], 3)
    del fresh, got
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def cg_restore(
    root: Path, job: Job, threads: int, buffer_mib: int = 0, pool_mib: int = 0
) -> dict[str, Any]:
    """Restore through a new manager (as a new process would: no cache of the saving one); the
    read's figures."""
    from ckptguard.storage.streaming import StreamingConfig, StreamingStorage

    sizes = (
        {"buffer_bytes": buffer_mib << 20, "pool_bytes": pool_mib << 20}
        if buffer_mib and pool_mib
        else {}
    )
    threads_kw = {"read_threads": threads} if threads else {}
    storage = StreamingStorage(StreamingConfig(**threads_kw, **sizes))
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=None), storage=storage)
    mgr.restore(job.state())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    mgr.close()  # the staging it prepared for a save_async that never comes
    close_s = time.perf_counter() - t
    stats = storage.last_stats
    out = (
        {k: round(v, 3) if isinstance(v, float) else v for k, v in vars(stats).items()}
        if stats
        else {}
    )
    return {**out, "close_s": round(close_s, 3)}


def same_files_read(step_dir: Path) -> dict[str, Any]:
    """A cold sequential read (64 MiB reads, one stream, file after file) of every file of the
    step."""
    if rank() == 0:
        drop_cache(step_dir)
    barrier()
    buf, n = bytearray(64 << 20), 0
    t = time.perf_counter()
    for p in sorted(step_dir.rglob("*")):
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while got := f.readinto(buf):
                    n += got
    seconds = time.perf_counter() - t
    return {"bytes": n, "seconds": round(seconds, 3), "gib_s": round(n / GiB / seconds, 3)}


def write(path: Path, res: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def summary(res: dict) -> dict[str, Any]:
    """Per method, the figures the issue's goals name."""
    base = res["methods"].get("none", {})
    out = {}
    for name, m in res["methods"].items():
        if name == "none":
            continue
        blocked = [s["blocked_s"] + s["next_step_wait_s"] for s in m["saves"]]
        row = {
            "blocked_first_s": round(blocked[0], 4) if blocked else None,
            "blocked_later_max_s": round(max(blocked[1:]), 4) if blocked[1:] else None,
            "loop_overhead": round(m["loop_s"] / base["loop_s"] - 1, 4) if base else None,
            "during_write_p50_slowdown": None,
            "during_write_p95_slowdown": None,
            "host_extra_peak_gib": round(m["host_extra_peak_bytes"] / GiB, 3),
            "host_extra_left_gib": round(m["host_extra_left_bytes"] / GiB, 3),
            "save_vs_disk_write": m.get("save_vs_disk_write"),
            "restore_vs_cold_read": m.get("restore_vs_cold_read"),
            "restore_vs_same_files_read": m.get("restore_vs_same_files_read"),
            "restore_ready_vs_same_files_read": m.get("restore_ready_vs_same_files_read"),
            "restore_bitwise_exact": m.get("restore_bitwise_exact"),
            "first_next_step_wait_s": m["saves"][0]["next_step_wait_s"] if m["saves"] else None,
            "skipped_saves": len(m["skipped_steps"]) if "skipped_steps" in m else None,
            "host_peak_x_state": round(m["host_extra_peak_bytes"] / res["state_bytes"], 3),
            "steps_while_preparing": len(m.get("steps_while_preparing", [])),
            "extra_s_while_preparing": None,
        }
        if base.get("step_p50_s") and m.get("steps_while_preparing"):
            row["extra_s_while_preparing"] = round(
                sum(m["step_s"][i - 1] - base["step_p50_s"] for i in m["steps_while_preparing"]), 4
            )
        if m.get("during_write_p50_s") and base.get("step_p50_s"):
            row["during_write_p50_slowdown"] = round(
                m["during_write_p50_s"] / base["step_p50_s"] - 1, 4
            )
            row["during_write_p95_slowdown"] = round(
                m["during_write_p95_s"] / base["step_p95_s"] - 1, 4
            )
        out[name] = row
    return out


def markdown(res: dict) -> str:
    cols = [
        "blocked_first_s",
        "blocked_later_max_s",
        "loop_overhead",
        "during_write_p50_slowdown",
        "during_write_p95_slowdown",
        "host_extra_peak_gib",
        "host_extra_left_gib",
        "save_vs_disk_write",
        "restore_vs_cold_read",
        "restore_vs_same_files_read",
        "restore_ready_vs_same_files_read",
        "restore_bitwise_exact",
        "first_next_step_wait_s",
        "skipped_saves",
        "host_peak_x_state",
        "steps_while_preparing",
        "extra_s_while_preparing",
    ]
    lines = [
        f"# bench_train_loop: {res['device']}, {res['params'] / 1e6:.0f}M params, "
        f"{res['state_bytes'] / GiB:.2f} GiB state per rank, {res['world_size']} rank(s), save "
        f"every {res['config']['every']} steps (cg_tiers: fast every "
        f"{res['config']['fast_every']}, persistent every {res['config']['persistent_every']}), "
        f"the first save inside the loop, {res['config']['saves']} saves",
        "",
        f"disk: write+fsync {res['disk']['write_fsync_gib_s']:.2f} GiB/s, cold read "
        f"{res['disk']['cold_read_gib_s']:.2f} GiB/s; step p50 without saves "
        f"{res['methods']['none']['step_p50_s']:.3f} s",
        "",
        "| method | " + " | ".join(cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for name, row in res["summary"].items():
        lines.append(
            f"| {name} | " + " | ".join("-" if row[c] is None else str(row[c]) for c in cols) + " |"
        )
    for name, err in res.get("errors", {}).items():
        lines.append(f"\n{name} failed: {err[:300]}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ckptguard-train-loop"))
    ap.add_argument("--methods", default=",".join(METHODS))
    add_model_args(ap)
    ap.add_argument("--every", type=int, default=45, help="steps between saves")
    ap.add_argument("--saves", type=int, default=3, help="saves per method")
    ap.add_argument(
        "--fast-every", type=int, default=10, help="cg_tiers: steps between fast-tier saves"
    )
    ap.add_argument(
        "--persistent-every", type=int, default=30, help="cg_tiers: steps between persistent saves"
    )
    ap.add_argument(
        "--fast-dir",
        type=Path,
        default=Path("/dev/shm/ckptguard-train-loop"),
        help="cg_tiers: the fast tier's parent folder",
    )
    ap.add_argument(
        "--read-threads",
        type=int,
        default=0,
        help="StreamingConfig.read_threads of ckptguard's restores (0: the library's default)",
    )
    ap.add_argument(
        "--alt-read",
        default="1:32:256",
        help="cg_sync also restores with each of these read settings, comma-separated "
        "threads:buffer MiB:pool MiB ('': none)",
    )
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny sizes: correctness only")
    a = ap.parse_args()
    if a.tiny:
        vars(a).update(TINY_MODEL)
        a.every, a.saves, a.fast_every, a.persistent_every = 3, 2, 2, 4
        a.fast_dir = a.dir / "fast"
    os.environ.setdefault("CKPTGUARD_QUIET", "1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() and not a.tiny
    if world > 1:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    methods = [m for m in a.methods.split(",") if m]
    if not cuda:
        methods = [m for m in methods if m != "cg_async_gpu"]  # no spare GPU memory on a CPU
    job = Job(a, device, seed=0)
    job.step()  # the optimizer's state exists from the first step on: its size
    state_bytes = job.nbytes()
    params = sum(p.numel() for p in job.model.parameters()) * (world if world > 1 else 1)
    del job
    _free(device)
    disk = disk_figures(a.dir, state_bytes if not a.tiny else 8 << 20)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "world_size": world,
        "params": params,
        "state_bytes": state_bytes,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "disk": disk,
        "methods": {},
    }
    if "none" not in methods:
        methods.insert(0, "none")
    failed = []
    for name in methods:
        try:
            res["methods"][name] = run_method(name, a, device, disk)
        except Exception as exc:  # one method's failure is reported; the others still run
            if a.tiny:
                raise
            failed.append(name)
            res.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:2000]
            res.setdefault("tracebacks", {})[name] = traceback.format_exc()[-6000:]
            traceback.print_exc()
            shutil.rmtree(a.dir / name, ignore_errors=True)
        if rank() == 0:
            print(
                f"{name}: "
                f"{json.dumps(res['methods'].get(name, res.get('errors', {}).get(name)))[:600]}",
                flush=True,
            )
            write(a.out, res)  # after every method: a later crash keeps what was measured
    res["summary"] = summary(res)
    if rank() == 0:
        write(a.out, res)
        a.out.with_suffix(".md").write_text(markdown(res))
        print(markdown(res), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
