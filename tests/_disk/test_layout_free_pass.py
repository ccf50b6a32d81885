"""The layout-free pass shared by the caller and the pool: both sum, an error in either reaches the
caller, and no worker is left waiting (the next pass runs)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ckptguard._disk import boxsum as d
from ckptguard._disk import digest as dg
from ckptguard._state.state import capture, digests_and_layout_free


def _serial(tensors: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """The partials with every piece summed in this thread (no pool), the definition's reference."""
    out = {}
    for key, t in tensors.items():
        header, offset, _ = d.layout_free_partial(t)
        flat = dg.tensor_bytes_view(t)
        out[f"{key}@{offset}"] = ["m", key, header, f"{d._bytes_sum(flat, 0, parallel=False):016x}"]
    return out


def test_the_caller_and_the_pool_both_sum_and_agree_with_one_thread(monkeypatch):
    torch.manual_seed(0)
    tensors = {
        "a": torch.randn(9 << 20),
        "b": torch.randn(3, 5),
        "c": torch.randn(5 << 20).to(torch.bfloat16),
    }
    expected, expected_a = _serial(tensors), _serial({"a": tensors["a"]})
    who: set[str] = set()
    real = d._words_sum_serial
    pool_in, waited = threading.Event(), []

    def slow(words, j0):
        name = threading.current_thread().name
        who.add(name)
        if name.startswith("ckptguard-layout-free"):
            pool_in.set()
        elif (
            not waited
        ):  # the caller's first piece waits until the pool took one: both sum, on any machine
            waited.append(pool_in.wait(30))
        time.sleep(0.01)
        return real(words, j0)

    monkeypatch.setattr(d, "_words_sum_serial", slow)
    assert d.layout_free_partials({"m": {"a": tensors["a"]}}) == expected_a
    # one tensor's pieces, summed by this thread and the pool's (before, this thread only waited)
    assert threading.current_thread().name in who and any(
        n.startswith("ckptguard-layout-free") for n in who
    ), who
    assert d.layout_free_partials({"m": tensors}) == expected
    who.clear()
    pool_in.clear()
    waited.clear()
    items = capture({"m": tensors})
    digests, partials = digests_and_layout_free(
        items
    )  # the save's pass: structure digest, the sums shared
    assert digests == {"m": items["m"].structure_digest()}
    assert partials == d.layout_free_partials({"m": items["m"].tensors})
    assert any(n.startswith("ckptguard-layout-free") for n in who), who


def test_an_error_in_a_piece_reaches_the_caller_and_the_next_pass_runs(monkeypatch):
    tensors = {"a": torch.randn(9 << 20)}
    real = d._words_sum_serial
    calls = []

    def failing(words, j0):
        calls.append(j0)
        if len(calls) == 2:
            raise MemoryError("piece 2")
        time.sleep(0.01)
        return real(words, j0)

    monkeypatch.setattr(d, "_words_sum_serial", failing)
    with pytest.raises(MemoryError, match="piece 2"):
        d.layout_free_partials({"m": tensors})
    monkeypatch.setattr(d, "_words_sum_serial", real)
    done = []
    runner = threading.Thread(
        target=lambda: done.append(d.layout_free_partials({"m": tensors})), daemon=True
    )
    runner.start()
    runner.join(
        60
    )  # a worker still waiting on the failed pass's queue would hold the pool's thread
    assert done and done[0] == _serial(tensors)
