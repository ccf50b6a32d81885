"""A toy training job for the goodput test: restore, then steps of a fixed time, a save every 5
steps (sync: the kill steps then know what is committed).

argv: ROOT LAST_STEP HANG_AT (0: never). At HANG_AT it prints the step and waits to be killed, so
the test kills it at a step boundary it knows. Every line it prints carries its wall-clock time; a
step's line also the times just before and just after ``record_step``."""

import sys
import time

import torch

import ckptguard as cg

root, last, hang_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=None))
state = {"w": torch.zeros(1000), "step": 0}
start = mgr.restore(state)
print(f"restored {start} {time.time():.6f}", flush=True)
for step in range(start + 1, last + 1):
    time.sleep(0.05)  # the step's compute
    state["w"] += 1.0
    state["step"] = step
    t_before = time.time()
    mgr.record_step(step, loss=float(step))
    t_after = time.time()  # the step record's time lies between the two
    print(f"step {step} {time.time():.6f} {t_before!r} {t_after!r}", flush=True)
    if step == hang_at:
        time.sleep(600)  # killed here
    if step % 5 == 0:
        mgr.save(step, state)
mgr.close()
print("done", flush=True)
