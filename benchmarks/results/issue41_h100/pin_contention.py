"""Does pinning 6 GiB in a background thread hold the training thread? torch's cudart binding vs
ctypes."""

import ctypes
import json
import mmap
import os
import threading
import time

import torch


def cudart_ctypes():
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart" in line:
                path = line.split()[-1]
                lib = ctypes.CDLL(path)
                lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
                lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
                return path, lib
    return None, None


CHUNK = 512 << 20
N = 13


def pin(how, lib, out):
    maps = []
    t = time.perf_counter()
    for _ in range(N):
        m = mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE)
        tens = torch.frombuffer(m, dtype=torch.uint8)
        ptr = tens.data_ptr()
        register = torch.cuda.cudart().cudaHostRegister if how == "torch" else lib.cudaHostRegister
        rc = register(ptr, CHUNK, 0)
        maps.append((m, tens, ptr))
    out["pin_s"] = time.perf_counter() - t
    out["rc"] = int(rc)
    for _m, _tens, ptr in maps:
        torch.cuda.cudart().cudaHostUnregister(ptr) if how == "torch" else lib.cudaHostUnregister(
            ptr
        )


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
path, lib = cudart_ctypes()
res = {"cudart": path}
for how in ("none", "torch", "ctypes", "torch", "ctypes"):
    out = {}
    th = None
    if how != "none":
        th = threading.Thread(target=pin, args=(how, lib, out))
    t0 = time.perf_counter()
    if th:
        th.start()
    times = loop(60, a)
    total = time.perf_counter() - t0
    if th:
        th.join()
    figures = {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}
    res.setdefault(how, []).append(
        {
            "loop_s": round(total, 3),
            "max_step_s": round(max(times), 3),
            "p50": round(sorted(times)[30], 4),
            **figures,
        }
    )
print(json.dumps(res))
with open(os.environ["OUT"] + "/pin_contention.json", "w") as f:
    json.dump(res, f, indent=1)
