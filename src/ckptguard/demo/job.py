"""The embedded main job: a tiny RL loop that is killed mid-save, resumes, and is proven.

The loop has the shape of LLM RL post-training, on the CPU: a small transformer policy (FSDP2 over
gloo ranks), a rollout engine that receives exported weights quantized to FP8 with a per-tensor
scale cache, a toy reward and a policy-gradient update with Adam and a scheduler. The scale cache is
the derived state: as in the derived-state chain of docs/practices.md (5) it is built at start-up
from the initial weights, before the restore. With the fix (the default) the restore invalidates it
through ``DerivedState``; with ``--no-derived-fix`` it does not, and the first step after the
restore mismatches.

``run_demo`` launches the job with torchrun, kills it mid-save with SIGKILL, relaunches
it with ResumeMode.AUTO, and evaluates the proof gates (``ckptguard.ops.prove``).
"""

from __future__ import annotations

import math
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._disk.digest import digest
from .._state.derived import DerivedState
from ..config import StateOptions

VOCAB, SEQ, DIM, HEADS, BATCH = 12, 8, 32, 2, 16
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TARGET_TOKEN = 3


class Policy(torch.nn.Module):
    """A one-block causal transformer over a tiny vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.pos = torch.nn.Parameter(torch.zeros(SEQ, DIM))
        self.ln1 = torch.nn.LayerNorm(DIM)
        self.attn = torch.nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(DIM)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(DIM, 2 * DIM), torch.nn.GELU(), torch.nn.Linear(2 * DIM, DIM)
        )
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.emb(tokens) + self.pos[:t]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        out: torch.Tensor = self.head(x)
        return out


def sequence_logprobs(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of each generated token given its prefix, [B, T-1]."""
    logits = model(tokens[:, :-1])
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


# ---------------------------------------------------------------- FP8 export and its scale cache


def fresh_scales(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: (w.abs().amax().clamp(min=1e-12) / FP8_MAX).reshape(1) for n, w in weights.items()}


def quantize(
    weights: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    return {n: (w / scales[n]).clamp(-FP8_MAX, FP8_MAX).to(FP8) for n, w in weights.items()}


def dequantize(
    q: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.float32) * scales[n] for n, t in q.items()}


class ScaleCache:
    """Per-tensor FP8 scales, computed from the parameters: derived state."""

    NAME = "fp8_export_scales"

    def __init__(self, registry: DerivedState) -> None:
        self.registry = registry
        self.scales: dict[str, torch.Tensor] | None = None
        self.built_for = -1
        registry.register(self.NAME, self.invalidate)

    def invalidate(self) -> None:
        self.scales = None

    def get(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.scales is None:
            self.scales, self.built_for = fresh_scales(weights), self.registry.stamp()
        self.registry.check(self.NAME, self.built_for)
        return self.scales


class RolloutEngine:
    """Receives quantized weights, generates, and reports its own logprobs."""

    def __init__(self) -> None:
        self.model = Policy().eval()

    def load(self, q: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.model.load_state_dict(dequantize(q, scales), strict=True)

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = prompts
        for _ in range(SEQ - 1):
            probs = torch.softmax(self.model(tokens)[:, -1].float(), dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1)], dim=1)
        return tokens, sequence_logprobs(self.model, tokens)


# ---------------------------------------------------------------- the trainer (one rank)


@dataclass
class Trainer:
    model: torch.nn.Module
    optim: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    registry: DerivedState
    cache: ScaleCache
    engine: RolloutEngine
    world: int

    def full_weights(self) -> dict[str, torch.Tensor]:
        out = {}
        for n, p in self.model.named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[n] = t.detach().clone()
        return out

    def export(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        weights = self.full_weights()
        scales = self.cache.get(weights)
        return quantize(weights, scales), scales

    @torch.no_grad()
    def old_logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """The trainer's recompute, with the same quantized weights built with a fresh scale."""
        weights = self.full_weights()
        scales = fresh_scales(weights)
        shadow = Policy().eval()
        shadow.load_state_dict(dequantize(quantize(weights, scales), scales), strict=True)
        return sequence_logprobs(shadow, tokens)

    def update(self, tokens: torch.Tensor) -> tuple[float, bool, float]:
        reward = (tokens[:, 1:] == TARGET_TOKEN).float().mean(dim=1)
        advantage = reward - reward.mean()
        logp = sequence_logprobs(self.model, tokens).sum(dim=1)
        loss = -(advantage * logp).mean()
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        before = digest([p for p in self.model.parameters()])
        norm = self._grad_norm()
        self.optim.step()
        self.sched.step()
        self.registry.mark_updated()
        return norm, digest([p for p in self.model.parameters()]) != before, float(loss.item())

    def _grad_norm(self) -> float:
        local = sum(
            float(
                (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).double().pow(2).sum()
            )
            for p in self.model.parameters()
            if p.grad is not None
        )
        if self.world > 1:
            import torch.distributed as dist

            t = torch.tensor([local], dtype=torch.float64)
            dist.all_reduce(t)
            local = float(t.item())
        return math.sqrt(local)

    def state(self) -> dict[str, Any]:
        return {"policy": self.model, "optim": self.optim, "sched": self.sched}


def build_trainer(*, rank: int, world: int) -> Trainer:
    torch.manual_seed(0)
    model = Policy()
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 4))
    registry = DerivedState()
    trainer = Trainer(model, optim, sched, registry, ScaleCache(registry), RolloutEngine(), world)
    # DS4's order: the scale cache is built from the initial weights, before restore
    trainer.export()
    torch.manual_seed(1000 + rank)
    return trainer


def worker(
    *,
    root: str,
    steps: int,
    save_every: int,
    kill_at: int | None,
    derived_fix: bool,
    restore_rng: bool = True,
) -> None:
    """One rank of the RL job: resume (AUTO), then rollout, old-logprob, update, save."""
    import logging

    import torch.distributed as dist

    from .. import CheckpointConfig, CheckpointManager, ProofPlan, ResumeMode, _faults
    from .._records import retention

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    logging.basicConfig(
        level=logging.WARNING if rank else logging.INFO, format=f"  [rank {rank}] %(message)s"
    )
    # ckptguard sets its own logger to INFO (the resume lines must be seen); rank 1 stays quiet.
    logging.getLogger("ckptguard").setLevel(logging.WARNING if rank else logging.INFO)
    say = logging.getLogger("ckptguard.demo").info
    trainer = build_trainer(rank=rank, world=world)
    # An RL job whose resume is bitwise on the CPU: the RL gates apply and replayed steps must match
    # exactly.
    plan = ProofPlan(rl=True, deterministic=True)
    cfg = CheckpointConfig(
        retention=retention.KeepLast(2), state=StateOptions(restore_rng=restore_rng), proof=plan
    )
    mgr = CheckpointManager(root, config=cfg, derived=trainer.registry if derived_fix else None)
    start = mgr.restore(trainer.state(), mode=ResumeMode.AUTO)
    for step in range(start + 1, steps + 1):
        q, scales = trainer.export()
        mgr.record_export(step - 1, {n: t.view(torch.uint8) for n, t in q.items()}, scales=scales)
        trainer.engine.load(q, scales)
        prompts = torch.randint(0, VOCAB, (BATCH, 1))  # from the restored CPU RNG
        tokens, rollout_lp = trainer.engine.generate(prompts)
        diff = mgr.record_logprobs(step, trainer.old_logprobs(tokens), rollout_lp)
        norm, changed, loss = trainer.update(tokens)
        mgr.record_update(step, grad_norm=norm, params_changed=changed)
        reward = float((tokens[:, 1:] == TARGET_TOKEN).float().mean())
        mgr.record_step(step, batch=prompts, loss=loss, grad_norm=norm, reward=reward)
        say(
            f"step {step:>2}: reward {reward:.3f}  grad_norm {norm:.4f}  probs_diff "
            f"{diff['probs_diff']:.3g}"
        )
        if step % save_every == 0:
            if step == kill_at:
                _faults.set_hook(
                    "storage.data_written", lambda: os.kill(os.getpid(), signal.SIGKILL)
                )
                say(f"step {step:>2}: saving... (this save will be SIGKILLed mid-write)")
            mgr.save(step, trainer.state())


# ---------------------------------------------------------------- the orchestrator


_SIGKILLED = re.compile(r"exitcode\s*:?\s*-9\b|Signal 9 \(SIGKILL\)")


def describe_exit(code: int, output: list[str]) -> str:
    """How a launch ended, as a person needs it: a rank SIGKILLed is said so, also under torchrun,
    which itself exits 1 when a worker died of a signal (its log names the signal)."""
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code != 0 and any(_SIGKILLED.search(line) for line in output):
        return f"a rank was killed by SIGKILL; torchrun exited {code}"
    return f"exit {code}"


def _launch(
    *,
    world: int,
    root: Path,
    steps: int,
    save_every: int,
    kill_at: int | None,
    derived_fix: bool,
    echo: Any,
) -> tuple[int, list[str]]:
    import socket
    import subprocess
    import sys

    args = [
        "-m",
        "ckptguard.demo",
        "--root",
        str(root),
        "--steps",
        str(steps),
        "--save-every",
        str(save_every),
    ]
    args += ["--kill-at", str(kill_at)] if kill_at else []
    args += [] if derived_fix else ["--no-derived-fix"]
    if world == 1:
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
            str(world),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            *args,
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    other: list[str] = []
    for line in proc.stdout:
        (echo if line.startswith("  [rank") else other.append)(line.rstrip())
    code = proc.wait()
    if code != 0 and kill_at is None:
        echo("\n".join(other[-30:]))
    return code, other


WORKDIR_MARKER = ".ckptguard-demo"


def prepare_workdir(workdir: str | Path) -> Path:
    """Create or empty the demo's working directory and mark it as the demo's.

    The demo wipes its working directory at each run, so a non-empty directory without
    the marker (``--workdir ~`` or ``.``) is refused, never wiped."""
    import shutil

    from ..errors import ConfigError

    base = Path(workdir).absolute()
    if base.is_symlink() or (base.exists() and not base.is_dir()):
        raise ConfigError(
            f"demo --workdir {base}: not a directory (or a symlink); give a new or empty directory"
        )
    if base.exists() and any(base.iterdir()):
        if not (base / WORKDIR_MARKER).is_file():
            raise ConfigError(
                f"demo --workdir {base}: the directory is not empty and was not created by "
                f"`ckptguard demo` (no {WORKDIR_MARKER} in it); the demo wipes its working "
                f"directory, so give it a new or empty one"
            )
        shutil.rmtree(base)
    base.mkdir(parents=True, exist_ok=True)
    (base / WORKDIR_MARKER).write_text(
        "made by `ckptguard demo`; the next demo with this --workdir wipes it\n"
    )
    return base


def run_demo(
    workdir: str,
    *,
    world: int = 2,
    steps: int = 12,
    save_every: int = 3,
    kill_at: int = 9,
    derived_fix: bool = True,
    echo: Any = print,
) -> tuple[list[Any], Path]:
    """Run, kill mid-save, resume, and return the proof gates and the checkpoint root.

    ``workdir`` is emptied first (see ``prepare_workdir``, which refuses a foreign one)."""
    from ..ops.prove import evaluate

    base = prepare_workdir(workdir)
    root = base / "ckpt"
    common = {
        "world": world,
        "root": root,
        "steps": steps,
        "save_every": save_every,
        "derived_fix": derived_fix,
        "echo": echo,
    }
    fsdp = " (FSDP2 over gloo)" if world > 1 else ""
    echo(
        f"[1/3] RL job on {world} CPU rank(s){fsdp}: FP8 rollout export, saves every {save_every} "
        f"steps; the save of step {kill_at} is SIGKILLed mid-write"
    )
    code, output = _launch(kill_at=kill_at, **common)
    echo(
        f"      the job died ({describe_exit(code, output)}); the tracker still points "
        f"at the last committed step"
    )
    fix = (
        "restore invalidates the FP8 scale cache"
        if derived_fix
        else "NO derived-state fix: scales stay stale"
    )
    echo(f"[2/3] relaunching the same command with ResumeMode.AUTO ({fix})")
    code, _ = _launch(kill_at=None, **common)
    echo(f"[3/3] ckptguard prove {root}")
    if code != 0:
        echo(f"      the resumed run failed (exit {code})")
    return evaluate(root), root


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m ckptguard.demo", description="one rank of the demo RL job"
    )
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--no-derived-fix", action="store_true")
    p.add_argument(
        "--no-rng-restore", action="store_true", help="negative control for `ckptguard rehearse`"
    )
    a = p.parse_args()
    worker(
        root=a.root,
        steps=a.steps,
        save_every=a.save_every,
        kill_at=a.kill_at,
        derived_fix=not a.no_derived_fix,
        restore_rng=not a.no_rng_restore,
    )


if __name__ == "__main__":
    main()
