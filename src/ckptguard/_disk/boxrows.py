"""The runs of a box split on an inner dimension (TP ``Shard(1)``, a 2-D mesh), for the
layout-free digest (``boxsum``): where each run of the global row-major order starts, and the
sum of runs of whole words taken many rows at once.

``boxsum.box_sum`` comes here only for such a box: a whole tensor (every tensor of a one-rank
save) or a box split on its first dimension alone is one run, summed at its place without this.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

_ROWS_WORDS = 1 << 18  # words per vectorised batch of rows (2 MiB), bounding the weight table


def box_runs(
    lshape: tuple[int, ...], offset: tuple[int, ...], gshape: tuple[int, ...], last: int
) -> tuple[int, np.ndarray]:
    """(elements of one run, every run's first element in the global order, rows in C order) of
    the box ``lshape`` at ``offset`` in a tensor of shape ``gshape``, split last on dim ``last``."""
    gstride = [1] * len(gshape)
    for d in range(len(gshape) - 2, -1, -1):
        gstride[d] = gstride[d + 1] * gshape[d + 1]
    run = lshape[last] * gstride[last]  # elements of one run: the dims after ``last`` are whole
    starts = np.full((), offset[last] * gstride[last], dtype=np.int64)
    for d in range(last):
        starts = np.add.outer(
            starts, (np.arange(lshape[d], dtype=np.int64) + offset[d]) * gstride[d]
        )
    return run, starts.reshape(-1)


def rows_sum(
    flat: torch.Tensor,
    run_bytes: int,
    starts: np.ndarray,
    weights: Callable[[np.ndarray], np.ndarray],
) -> int:
    """sum over rows r and i of words[r, i] * weights(starts[r] + i), not yet reduced modulo
    2**64: ``flat`` (uint8) cut in runs of ``run_bytes``, a whole number of words, ``starts`` each
    run's first global word, ``weights`` the weight of every global word index (``boxsum``'s)."""
    words = flat.view(-1, run_bytes).view(torch.int64)
    if words.data_ptr() % 8:
        words = words.clone()
    rows, width = words.shape
    step = max(1, _ROWS_WORDS // max(1, width))
    cols = np.arange(width, dtype=np.uint64)
    total = 0
    for r in range(0, rows, step):
        w = weights(starts[r : r + step, None].astype(np.uint64) + cols)
        part = words[r : r + step]
        if part.device.type == "cpu":
            total += int(np.einsum("ij,ij->", part.numpy().view(np.uint64), w))
        else:
            total += int((part * torch.from_numpy(w.view(np.int64)).to(part.device)).sum().item())
    return total
