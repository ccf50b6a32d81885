"""The nanoGPT example with its ranks as Ray actors, and a driver that restarts the group.

    python examples/train_gpt_ray.py --root /tmp/gpt-ray --world 2 --steps 40 --save-every 10 \\
        --kill-at 20

This is how verl, OpenRLHF and NeMo-RL run training: no ``torchrun``; each rank is a Ray actor.
Rank 0's actor opens the rendezvous (``ckptguard.integrations.ray.open_rendezvous``), every
actor joins the gloo group, and each runs ``train_gpt.train``, the same loop as the single-file
example: restore AUTO, proof records, a save every ``--save-every`` steps.

``--kill-at N`` makes rank 1 SIGKILL itself in the middle of the save of step N (as Ray's OOM
killer would). The driver sees the actor die, kills the group, starts new actors, and they resume
from the last committed step; without the driver, rank 0 would raise within ``--timeout`` seconds
instead of hanging.
At the end the driver prints ``ckptguard prove``'s gates. ``--address`` joins a running cluster.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import ray

from ckptguard.ops import prove as proof

HERE = Path(__file__).resolve().parent


@ray.remote(num_cpus=0, max_restarts=0)
class GPTRank:
    """One rank: joins the group, then runs the single-file example's training loop."""

    def __init__(self, rank: int, world: int) -> None:
        import torch

        torch.set_num_threads(1)
        self.rank, self.world = rank, world

    def open(self, timeout_s: float) -> str:
        from ckptguard.integrations.ray import open_rendezvous

        return open_rendezvous(timeout_s=timeout_s)

    def join(self, address: str, timeout_s: float) -> None:
        from ckptguard.integrations.ray import join_process_group

        join_process_group(
            rank=self.rank, world_size=self.world, address=address, timeout_s=timeout_s
        )

    def train(
        self, root: str, steps: int, save_every: int, kill_at: int | None, timeout_s: float
    ) -> str:
        import train_gpt

        return train_gpt.train(root, steps, save_every, kill_at, self.rank, self.world, timeout_s)


def start_group(world: int, timeout_s: float) -> list:
    actors = [GPTRank.remote(rank, world) for rank in range(world)]
    address = ray.get(actors[0].open.remote(timeout_s))
    ray.get([a.join.remote(address, timeout_s) for a in actors])
    return actors


def _first_failure_or_all(refs: list) -> list:
    """Every rank's result, or the error of the first rank that fails, as soon as it fails.

    ``ray.get(refs)`` would wait for rank 0 first, and rank 0 waits ``--timeout`` for the dead
    rank before it raises; the driver instead restarts the group the moment any rank dies."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)  # raises RayActorError for a dead rank's actor
    return ray.get(refs)


def run(args: argparse.Namespace) -> str:
    """Train to ``args.steps``, restarting the whole group after any rank dies."""
    for attempt in range(args.max_restarts + 1):
        actors = start_group(args.world, args.timeout)
        kill = [args.kill_at if attempt == 0 and rank == 1 else None for rank in range(args.world)]
        refs = [
            a.train.remote(args.root, args.steps, args.save_every, k, args.timeout)
            for a, k in zip(actors, kill, strict=True)
        ]
        t0 = time.monotonic()
        try:
            return _first_failure_or_all(refs)[0]
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            first = str(exc).strip().splitlines()[-1][:300]
            print(
                f"attempt {attempt}: the group failed after {time.monotonic() - t0:.1f} s "
                f"({first}); restarting every rank",
                flush=True,
            )
        finally:
            for a in actors:
                ray.kill(a)
    raise SystemExit(f"gave up after {args.max_restarts} restarts")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument(
        "--kill-at", type=int, default=None, help="rank 1 SIGKILLs itself mid-save of this step"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="CheckpointConfig.timeout_s: longest wait for a peer",
    )
    p.add_argument("--max-restarts", type=int, default=2)
    p.add_argument(
        "--address", default=None, help="a running Ray cluster (default: start a local one)"
    )
    args = p.parse_args(argv)
    path = os.pathsep.join(
        filter(None, [str(HERE), str(HERE.parent / "src"), os.environ.get("PYTHONPATH")])
    )
    runtime_env = {"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}}
    if args.address:
        ray.init(address=args.address, runtime_env=runtime_env)
    else:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=200 * 1024 * 1024,
            runtime_env=runtime_env,
        )
    try:
        final = run(args)
    finally:
        ray.shutdown()
    gates = proof.evaluate(Path(args.root))
    for g in gates:
        print(f"  {g.name:<42} {g.status.value:<8} {g.evidence}")
    print(proof.verdict(gates))
    print(f"final {args.steps} {final}", flush=True)
    return 0 if proof.passed(gates) else 1


if __name__ == "__main__":
    sys.exit(main())
