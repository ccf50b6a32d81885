"""Resharded resumes are proven item by item through the layout-free digest (FSDP2 on gloo).

2 -> 1 and 1 -> 2 ranks: the save records, per tensor item and key, a digest no sharding
changes; the restore onto the other world size recomputes it from the pieces every rank now
holds. A byte flipped in one rank's shard file (its checksum is not read on restore) is
caught after a resharded restore and named.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

import ckptguard as cg
from ckptguard.demo.toyjob import build_job
from ckptguard.ops.prove import Status, evaluate
from ckptguard.testing import run_ranks, values

CFG = {
    "reshard": cg.ReshardOptions(
        rule=cg.ReshardRule.BY_ITEM, rng_seed=7, replicated=("sched", "loader")
    ),
    "proof": cg.ProofPlan(deterministic=False),
}


def _step(mgr: cg.CheckpointManager, job, step: int) -> None:
    x, y = job.loader.next_batch()
    loss = torch.nn.functional.mse_loss(job.model(x), y)
    job.optim.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(job.model.parameters(), 1e9)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    job.optim.step()
    job.sched.step()
    mgr.record_step(step, batch=x, loss=loss, grad_norm=norm)


def _train(rank: int, world: int, root: str) -> bytes:
    """Steps 1-2, save 2, then step 3 recorded and no save: the segment a kill leaves."""
    job = build_job(rank=rank, world=world)
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(**CFG))
    assert mgr.restore(job.state()) == 0
    for step in (1, 2):
        _step(mgr, job, step)
    mgr.save(2, job.state())
    weight = job.model[0].weight
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    saved = (
        local.detach().numpy().tobytes()[:32]
    )  # this rank's piece of one parameter, to find in its file
    _step(mgr, job, 3)
    return saved


def _resume(rank: int, world: int, roots: list[str], then_train: str | None = None) -> list[str]:
    out = []
    for root in roots:
        job = build_job(rank=rank, world=world)
        mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(**CFG))
        try:
            assert mgr.restore(job.state()) == 2
        except cg.StateMismatchError as exc:
            out.append(str(exc))
            continue
        _step(mgr, job, 3)
        mgr.save(3, job.state())
        out.append("resumed")
    if then_train:  # one process less: the next run of this root is in new processes anyway
        _train(rank, world, then_train)
    return out


def _flip_in_shard(step_dir: Path, needle: bytes) -> Path:
    for path in sorted((step_dir / "state").glob("*.distcp")):
        data = bytearray(path.read_bytes())
        at = data.find(needle)
        if at >= 0:
            data[at + 5] ^= 0x10
            path.write_bytes(bytes(data))
            return path
    raise AssertionError(f"no shard under {step_dir} holds the parameter bytes")


def _gate(root: Path, name: str):
    return next(g for g in evaluate(root) if g.name == name)


def test_resharded_resumes_are_proven_and_a_flipped_byte_is_caught(tmp_path):
    two, one, flipped = tmp_path / "saved_on_2", tmp_path / "saved_on_1", tmp_path / "flipped"
    pieces = values(run_ranks(_train, 2, str(two)))
    shutil.copytree(two, flipped)
    shard = _flip_in_shard(flipped / "step_00000002", pieces[1])
    assert shard.name.startswith("__1_")  # rank 1's shard
    resumed, caught = values(
        run_ranks(_resume, 1, [str(two), str(flipped)], str(one), distributed=False)
    )[0]
    assert resumed == "resumed"
    assert (
        "onto 1 ranks from 2" in caught
        and "layout-free digests differ" in caught
        and "'model'" in caught
    )
    on_two = values(run_ranks(_resume, 2, [str(one)]))
    assert on_two == [["resumed"], ["resumed"]]

    for root, how in ((two, "resharded 2 -> 1 ranks"), (one, "resharded 1 -> 2 ranks")):
        gates = evaluate(root)
        # The toy job records no sample ids: exactly-once over the union of ranks is unchecked
        # (test_elastic.py).
        data = _gate(root, "data order identical")
        assert data.status is Status.MISSING and "sample_ids" in data.evidence
        others = [g for g in gates if g.required and g.name != data.name]
        assert all(g.status is Status.PASS for g in others), [
            (g.name, g.status.value, g.evidence) for g in gates
        ]
        digests = _gate(root, "digests equal, item by item")
        assert digests.evidence.startswith(
            f"{how}: model, optim equal the save's layout-free digests"
        )
        assert "loader, rng, sched equal what their reshard rules give" in digests.evidence
    bad = _gate(flipped, "digests equal, item by item")
    assert (
        bad.status is Status.FAIL
        and "'model (layout-free)'" in bad.evidence
        and "optim" not in bad.evidence
    )
    confirmed = _gate(flipped, "restored step confirmed before training")
    assert confirmed.status is Status.FAIL and "raised StateMismatchError" in confirmed.evidence


def test_layout_free_digest_ignores_the_sharding_and_sees_every_byte():
    import itertools

    from ckptguard._disk import boxsum as d
    from ckptguard._state.state import capture, digests_and_layout_free

    torch.manual_seed(0)
    for t in (
        torch.randn(7, 5),
        torch.randn(5, 3).to(torch.bfloat16),
        torch.arange(4097, dtype=torch.int64),
    ):
        shape, whole = tuple(t.shape), d.box_sum(t, (0,) * t.dim(), tuple(t.shape))
        for dim, cut in itertools.product(
            range(t.dim()), (1, shape[-1] // 2)
        ):  # two shards on any dimension
            a, b = (
                t.narrow(dim, 0, cut).contiguous(),
                t.narrow(dim, cut, shape[dim] - cut).contiguous(),
            )
            at = tuple(cut if i == dim else 0 for i in range(t.dim()))
            assert (
                d.box_sum(a, (0,) * t.dim(), shape) + d.box_sum(b, at, shape)
            ) & d._MASK == whole
        flipped = t.clone()
        flipped.view(-1).view(torch.uint8)[7] ^= 1
        moved = t.flip(0)
        assert whole not in (
            d.box_sum(flipped, (0,) * t.dim(), shape),
            d.box_sum(moved, (0,) * t.dim(), shape),
        )
    # the save's pass: tensor items get their structure digest (no byte read) and the layout-free
    # partials
    big = {"w": torch.randn(3 << 20), "v": torch.randn(9, 7)[1:, 2:], "tied": [torch.ones(3)] * 2}
    items = capture({"model": torch.nn.Linear(8, 4), "t": big})
    assert digests_and_layout_free(items) == (
        {n: c.structure_digest() for n, c in items.items()},
        d.layout_free_partials({n: c.tensors for n, c in items.items()}),
    )
