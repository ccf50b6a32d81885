"""A fake asynchronous RL loop for the SIGKILL tests of tests/test_rollout_ledger.py.

A producer thread issues prompt ids 0..N-1 (a few at a time, "generates" them and completes
them into the buffer, running ahead of the trainer up to a cap); the trainer takes groups of
completed rollouts, trains on them (the policy is a count per prompt: the witness of what was
trained, kept in the policy role's DCP state), advances the policy version and commits the
policy and the driver as one RunCheckpoint step every few steps.

``python tests/rollout_job.py zygote WARM_ROOT`` imports torch and ckptguard once and then forks one
job per ``run ROOT MODE`` line on stdin (a relaunch costs milliseconds, not an interpreter start),
prints ``pid N`` and then ``exit STATUS`` once the job ended; the test SIGKILLs the pid at seeded
random moments. MODE ``ledger`` saves the RolloutLedger with the models; ``position`` saves only how
many prompts were drawn (the dataloader's position), not the ledger: the bug. ``<mode>-die``
SIGKILLs itself right after its first commit (a kill at a known point).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch

import ckptguard as cg
from ckptguard import ProofPlan

N_PROMPTS = 64
GROUP = 4
SAVE_EVERY = 2
AHEAD = 8  # prompts in flight or buffered at most: the producer runs ahead of the trainer
ISSUE_AT_ONCE = 3
MAX_STALENESS = 2


def job(root: str, mode: str) -> None:
    mode, _, die = mode.partition("-")  # "<mode>-die": SIGKILL itself right after its first commit
    torch.manual_seed(0)
    policy = torch.nn.Module()
    policy.counts = torch.nn.Parameter(
        torch.zeros(N_PROMPTS), requires_grad=False
    )  # trained-on counts
    run = cg.RunCheckpoint(
        root,
        [cg.Role("policy"), cg.Role("driver")],
        config=cg.CheckpointConfig(
            retention=cg.KeepLast(2), timeout_s=30.0, proof=ProofPlan(record=False)
        ),
    )
    if mode == "ledger":
        ledger = cg.RolloutLedger(range(N_PROMPTS), max_staleness=MAX_STALENESS)
        driver: dict = {"ledger": ledger}
        start = run.restore({"policy": {"policy": policy}, "driver": driver})
    else:  # the dataloader's position only: buffered and in-flight prompts are not in the commit
        driver = {"drawn": 0}
        start = run.restore({"policy": {"policy": policy}, "driver": driver})
        ledger = cg.RolloutLedger(range(driver["drawn"], N_PROMPTS), max_staleness=MAX_STALENESS)
    if start and mode == "ledger":
        # in-flight prompts of the killed run are re-issued; stale buffered ones too
        ledger.resume()
    base = driver.get("drawn", 0)
    cond = threading.Condition()
    exhausted, done = threading.Event(), threading.Event()

    def count(name: str) -> int:
        return int(ledger.counters()[name])

    def produce() -> None:
        while True:
            with cond:
                cond.wait_for(lambda: count("in_flight") + count("buffered") < AHEAD)
            batch = [
                p for p in (ledger.next_prompt() for _ in range(ISSUE_AT_ONCE)) if p is not None
            ]
            if not batch:
                exhausted.set()
                with cond:
                    if not count("buffered") and not ledger.pending_reissue:
                        break
                    cond.wait(0.02)  # a rollout dropped as stale comes back for re-issue
                continue
            time.sleep(0.002)  # generation
            for pid in batch:
                ledger.completed(pid, {"prompt": pid, "reward": float(pid % 5)})
                with cond:
                    cond.notify_all()
        done.set()
        with cond:
            cond.notify_all()

    def save(step: int) -> None:
        if mode != "ledger":
            driver["drawn"] = base + count("drawn")
        run.save(step, {"policy": {"policy": policy}, "driver": driver})
        if die:
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=produce, daemon=True).start()
    step = saved = start
    while True:
        with cond:
            cond.wait_for(lambda: count("buffered") >= GROUP or exhausted.is_set(), timeout=0.05)
        batch = ledger.take(GROUP)
        with cond:
            cond.notify_all()
        if not batch:
            if done.is_set():
                break
            continue
        ids = [r.prompt_id for r in batch]
        with torch.no_grad():
            policy.counts[torch.tensor(ids)] += (
                1.0  # the policy update: one count per trained prompt
            )
        step += 1
        ledger.trained(ids, step)
        if step % SAVE_EVERY == 0:
            save(step)
            saved = step
    if saved != step:
        save(step)


def zygote(warm_root: str) -> None:
    torch.set_num_threads(1)
    # One whole job first: every lazy import and cache of the save and restore paths is warm in
    # the forked children. Its threads have ended (a fork copies only the calling thread).
    job(warm_root, "ledger")
    job(warm_root, "ledger")  # and the restore path

    # The digest pool of ckptguard is keyed by pid (a child makes its own); nothing else may live
    # on.
    def others() -> list[threading.Thread]:
        return [
            t
            for t in threading.enumerate()
            if t is not threading.main_thread() and not t.name.startswith("ckptguard-layout-free")
        ]

    for _ in range(200):
        if not others():
            break
        time.sleep(0.01)
    assert not others(), others()
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, root, mode = line.split()
        assert cmd == "run"
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                job(root, mode)
            except BaseException as exc:  # reported through the exit status; the test prints stderr
                print(f"job failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                code = 3
            os._exit(code)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "zygote":
        zygote(sys.argv[2])
    else:
        job(sys.argv[1], sys.argv[2])
