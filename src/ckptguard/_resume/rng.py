"""The four RNG streams (CPU, CUDA, Python, NumPy) as tensors and plain values.

Contract: ``capture()`` returns a structure ``torch.load(weights_only=True)`` reads back
(NumPy's state object is split into a key tensor plus ints), and ``restore(capture())``
puts every stream back exactly. CUDA streams are captured for every device only once
CUDA is initialized, so a CPU-only process never creates a CUDA context.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ..errors import TopologyMismatchError


def capture() -> dict[str, Any]:
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    cuda = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return {
        "cpu": torch.get_rng_state(),
        "cuda": cuda,
        "python": {
            "version": int(py_version),
            "state": torch.tensor(py_state, dtype=torch.int64),
            "gauss": py_gauss,
        },
        "numpy": {
            "kind": str(np_kind),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
    }


def restore(saved: dict[str, Any], *, where: str) -> None:
    torch.set_rng_state(saved["cpu"])
    if saved["cuda"]:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count != len(saved["cuda"]):
            raise TopologyMismatchError(
                f"{where}: the checkpoint holds CUDA RNG state for {len(saved['cuda'])} devices "
                f"and this process sees {count}; run with the same visible devices "
                "(CUDA_VISIBLE_DEVICES) or restore with restore_rng=False and accept that "
                "the continuation is not bitwise"
            )
        torch.cuda.set_rng_state_all(saved["cuda"])
    py = saved["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npd = saved["numpy"]
    np.random.set_state(
        (npd["kind"], npd["keys"].numpy().astype(np.uint32), npd["pos"], npd["has_gauss"], npd["gauss"])
    )
