"""The TurnLedger's saved size and save cost per in-flight rollout, at agentic conversation lengths.

    python benchmarks/agent_ledger.py --rollouts 64 --turns 8 --tokens 512 --calls 2 \\
        --result-bytes 256

Builds ``--rollouts`` in-flight rollouts of ``--turns`` completed turns each (``--tokens`` model
tokens and ``--calls`` environment calls per turn, each answering ``--result-bytes`` of JSON text,
one answer token per call), against an in-memory idempotent environment, then times ``state_dict()``
plus ``torch.save`` (what a checkpoint's per-rank extras cost for this item) and
``torch.load(weights_only=True)`` plus ``load_state_dict``, best of ``--repeat``. Prints one JSON
line.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import time

import torch

import ckptguard as cg
from ckptguard.environments import Effect, EnvCall, EnvResult


class MemoryEnv:
    """Idempotent by call id, in memory: enough to build ledger state (not a measured
    environment)."""

    name = "tool"
    kind = cg.EnvKind.IDEMPOTENT

    def __init__(self, result_bytes: int) -> None:
        self.first: dict[str, EnvResult] = {}
        self.text = "x" * result_bytes

    def call(self, call: EnvCall) -> EnvResult:
        return self.first.setdefault(
            call.call_id, EnvResult(self.text, len(self.first) + 1, call.args_digest)
        )

    def revision(self, rollout: str) -> int:
        return len(self.first)

    def restore(self, rollout: str, revision: int) -> int:
        raise NotImplementedError

    def fence(self, rollout: str) -> int:
        raise NotImplementedError

    def effects(self) -> list[Effect]:
        return []


def build(a: argparse.Namespace) -> cg.TurnLedger:
    rng = random.Random(0)
    ledger = cg.TurnLedger([MemoryEnv(a.result_bytes)])
    for r in range(a.rollouts):
        rid = f"{r // 8}/{r % 8}"
        ledger.start(rid, r // 8, [rng.randrange(150_000) for _ in range(a.prompt)])
        for _ in range(a.turns):
            turn = ledger.next_turn(rid, step=1)
            ledger.model_call(turn, [rng.randrange(150_000) for _ in range(a.tokens)])
            for c in range(a.calls):
                ledger.env_call(turn, "tool", {"cmd": f"run {c}", "n": rng.randrange(1000)})
            ledger.end_turn(turn, [rng.randrange(150_000) for _ in range(a.calls)])
    return ledger


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=64)
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens per rollout")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512, help="model tokens per turn")
    p.add_argument("--calls", type=int, default=2, help="environment calls per turn")
    p.add_argument("--result-bytes", type=int, default=256)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    ledger = build(a)
    saves, loads, size = [], [], 0
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        buf = io.BytesIO()
        torch.save({"turns": ledger.state_dict()}, buf)
        saves.append(time.perf_counter() - t0)
        size = buf.tell()
        buf.seek(0)
        t0 = time.perf_counter()
        again = cg.TurnLedger([MemoryEnv(a.result_bytes)])
        again.load_state_dict(torch.load(buf, weights_only=True)["turns"])
        loads.append(time.perf_counter() - t0)
    tokens = a.rollouts * (a.prompt + a.turns * (a.tokens + a.calls))
    print(
        json.dumps(
            {
                **vars(a),
                "bytes": size,
                "bytes_per_rollout": size / a.rollouts,
                "bytes_per_token": size / tokens,
                "save_ms_per_rollout": 1e3 * min(saves) / a.rollouts,
                "load_ms_per_rollout": 1e3 * min(loads) / a.rollouts,
            }
        )
    )


if __name__ == "__main__":
    main()
