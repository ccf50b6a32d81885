"""Errors that cross ranks keep their class and fields."""

from __future__ import annotations

import errno

import pytest

from ckptguard import errors as E
from ckptguard.errors import error_payload, rebuild
from ckptguard.testing import run_ranks, values

FAILURE = E.WriteFailure(
    rank=1,
    phase="write",
    exc_type="OSError",
    message="No space left",
    errno=errno.ENOSPC,
    path="/ckpt/x",
    offset=4096,
    requested_bytes=100,
    returned_bytes=3,
    time_ns=7,
)
LEAVES = [
    E.CollectiveTimeoutError("rank 0 waited", phase="save.written", missing_ranks=[1, 3]),
    E.CheckpointWriteError("save of step 9 failed", step=9, failures=[FAILURE]),
    E.SaveStillRunningError("still running", step=12),
    E.StorageStallError(errno.ETIMEDOUT, "no buffer came free"),
    E.StateMismatchError("item 'model' differs"),
]


def _fields(exc: E.CheckpointError) -> dict:
    return {name: getattr(exc, name) for name in type(exc).fields}


@pytest.mark.parametrize("exc", LEAVES, ids=lambda e: type(e).__name__)
def test_rebuild_carries_class_message_and_fields(exc):
    back = rebuild(error_payload(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert _fields(back) == _fields(exc)
    if isinstance(exc, E.CheckpointWriteError):
        assert back.first == FAILURE and back.errno == errno.ENOSPC
    if isinstance(exc, E.StorageStallError):
        assert back.errno == errno.ETIMEDOUT


def test_every_error_class_lives_in_the_tree():
    import ckptguard
    from ckptguard.memory.pinned import PinnedMemoryUnavailableError
    from ckptguard.memory.records import RecordFormatError
    from ckptguard.ops.rehearse import RehearsalError

    for cls in (
        PinnedMemoryUnavailableError,
        RecordFormatError,
        RehearsalError,
        ckptguard.StaleDerivedStateError,
    ):
        assert cls.__module__ == "ckptguard.errors", cls
        assert cls.__name__ in E.__all__


def test_foreign_error_is_named():
    back = rebuild(error_payload(KeyError("tokens")))
    assert type(back) is E.CheckpointError and "KeyError" in str(back)


def _rank0_decides_an_error(rank: int, world: int, kind: str) -> dict:
    from ckptguard._agree import Wire, gather_decide, on_every_rank
    from ckptguard._dist import StoreAgreement

    class Ping(Wire):
        def to_json(self) -> dict:
            return {}

        @classmethod
        def from_json(cls, data: dict) -> Ping:
            return cls()

    agreement = StoreAgreement(None, timeout_s=20, namespace="wire-test")

    def decide(_views: list) -> Ping:
        if kind == "timeout":
            raise E.CollectiveTimeoutError(
                "rank 0 gave up", phase="save.written", missing_ranks=[2]
            )
        raise E.CheckpointWriteError("save of step 5 failed", step=5, failures=[FAILURE])

    out: dict = {}
    for how in ("gather_decide", "on_every_rank"):
        try:
            if how == "gather_decide":
                gather_decide(agreement, f"t.{how}", Ping(), decide, decision=Ping)
            else:
                on_every_rank(agreement, f"t.{how}", lambda: decide([]) if rank == 0 else None)
        except E.CheckpointError as exc:
            out[how] = {
                "type": type(exc).__name__,
                **{n: _json(getattr(exc, n)) for n in type(exc).fields},
            }
    return out


def _json(value):
    return (
        [f.to_json() for f in value]
        if isinstance(value, list) and value and hasattr(value[0], "to_json")
        else value
    )


@pytest.mark.parametrize("kind", ["timeout", "write"])
def test_rebuilt_on_other_ranks_with_every_field(kind):
    results = values(run_ranks(_rank0_decides_an_error, 2, kind, timeout=120))
    for rank_out in results:
        for how in ("gather_decide", "on_every_rank"):
            got = rank_out[how]
            if kind == "timeout":
                assert got == {
                    "type": "CollectiveTimeoutError",
                    "phase": "save.written",
                    "missing_ranks": [2],
                }
            else:
                assert got["type"] == "CheckpointWriteError" and got["step"] == 5
                assert got["failures"] == [FAILURE.to_json()]
