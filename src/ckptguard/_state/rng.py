"""The four RNG streams (CPU, CUDA, Python, NumPy) as tensors and plain values.

Contract: ``capture()`` returns a structure ``torch.load(weights_only=True)`` reads back
(NumPy's state object is split into a key tensor plus ints), and ``restore(capture())``
puts every stream back exactly. CUDA streams are captured for every device only once
CUDA is initialized, so a CPU-only process never creates a CUDA context.
``GeneratorState`` makes any other ``torch.Generator`` (a sampler's, a rollout's) a state item.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from .._types import StateDict
from ..errors import ConfigError, TopologyMismatchError

RNG_ITEM = "_rng"
"""The name of the four streams' item in a step's per-rank digests."""


def capture() -> StateDict:
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


def restore(saved: StateDict, *, where: str) -> None:
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
        (
            npd["kind"],
            npd["keys"].numpy().astype(np.uint32),
            npd["pos"],
            npd["has_gauss"],
            npd["gauss"],
        )
    )


class GeneratorState:
    """A ``torch.Generator`` as a state item: ``state["sampler_gen"] =
    GeneratorState(sampler.generator)``.

    The four global streams are saved by default; a generator a sampler or a rollout holds
    is not, and a resume then replays the order of its first epoch. This wraps one so that
    its state is saved per rank (in the extras) and put back into the same object on restore.
    """

    def __init__(self, generator: torch.Generator) -> None:
        if not isinstance(generator, torch.Generator):
            raise ConfigError(
                f"GeneratorState needs a torch.Generator, got {type(generator).__name__}"
            )
        self.generator = generator

    def state_dict(self) -> StateDict:
        return {"device": str(self.generator.device), "state": self.generator.get_state()}

    def load_state_dict(self, sd: StateDict) -> None:
        saved = sd["state"]
        now = self.generator.get_state()
        if (
            str(sd.get("device", now.device)) != str(self.generator.device)
            or saved.numel() != now.numel()
        ):
            raise ConfigError(
                f"GeneratorState: the saved state is of a {sd.get('device')} generator "
                f"with {saved.numel()} bytes; this one is a {self.generator.device} "
                f"generator with {now.numel()} bytes. Restore into a generator of the same "
                f"device as the one saved."
            )
        # A loaded tensor can be a view into a shared storage with an offset, and set_state on such
        # a view segfaults (torch 2.13): always hand it a fresh contiguous ByteTensor.
        fresh = torch.empty(saved.numel(), dtype=torch.uint8)
        fresh.copy_(saved.detach().reshape(-1).to("cpu", torch.uint8))
        self.generator.set_state(fresh)

    def __repr__(self) -> str:
        return f"GeneratorState({self.generator.device} generator)"
