"""Which way of pinning 6.5 GiB in a background thread holds the training thread least?"""

import json
import mmap
import os
import threading
import time

import torch

TOTAL = 13 * (512 << 20)


def pin(chunk, populate, pause, out):
    maps = []
    t = time.perf_counter()
    flags = (
        mmap.MAP_PRIVATE
        | mmap.MAP_ANONYMOUS
        | (getattr(mmap, "MAP_POPULATE", 0x8000) if populate else 0)
    )
    for _ in range(TOTAL // chunk):
        m = mmap.mmap(-1, chunk, flags=flags)
        m.madvise(mmap.MADV_HUGEPAGE)
        tens = torch.frombuffer(m, dtype=torch.uint8)
        t1 = time.perf_counter()
        torch.cuda.cudart().cudaHostRegister(tens.data_ptr(), chunk, 0)
        out["reg_s"] = out.get("reg_s", 0) + time.perf_counter() - t1
        maps.append((m, tens))
        if pause:
            time.sleep(pause)
    out["pin_s"] = time.perf_counter() - t
    for _m, tens in maps:
        torch.cuda.cudart().cudaHostUnregister(tens.data_ptr())


def loop(steps, a):
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        for _ in range(20):
            b = a @ a
        float(b[0, 0].item())
        times.append(time.perf_counter() - t)
    return times


a = torch.randn(4096, 4096, device="cuda")
loop(20, a)
res = {}
variants = {
    "none": None,
    "512M": (512 << 20, False, 0),
    "512M_populate": (512 << 20, True, 0),
    "64M_pause2ms": (64 << 20, False, 0.002),
    "64M_populate_pause2ms": (64 << 20, True, 0.002),
    "16M_populate_pause1ms": (16 << 20, True, 0.001),
}
for name, v in variants.items():
    out = {}
    th = threading.Thread(target=pin, args=(*v, out)) if v else None
    t0 = time.perf_counter()
    if th:
        th.start()
    times = loop(80, a)
    total = time.perf_counter() - t0
    if th:
        th.join()
    res[name] = {
        "loop_s": round(total, 3),
        "max_step_s": round(max(times), 3),
        "p50": round(sorted(times)[40], 4),
        **{k: round(x, 3) for k, x in out.items()},
    }
    print(name, res[name], flush=True)
with open(os.environ["OUT"] + "/pin_contention2.json", "w") as f:
    json.dump(res, f, indent=1)
