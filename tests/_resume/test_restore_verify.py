"""How a same-layout restore verifies tensor items: by the layout-free pass
alone, with no second xxh3 pass over every tensor byte, yet a changed byte, key or
hyperparameter is still caught and named."""

from __future__ import annotations

import json
import struct

import pytest
import torch

import ckptguard as cg
from ckptguard._disk.digest import digest, structure_digest
from ckptguard._records import manifest as _manifest
from ckptguard._records.proofreader import read_records
from ckptguard._resume import restore as _restore
from ckptguard._state import state as _state


def _job(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2)
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    return model, optim


def _hashed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The items the restore verifies through their full per-rank xxh3 digest."""
    seen: list[str] = []
    real = _state.check_restored

    def spy(item, saved, **kw):  # type: ignore[no-untyped-def]
        seen.append(item.name)
        return real(item, saved, **kw)

    monkeypatch.setattr(_state, "check_restored", spy)
    return seen


def test_tensor_items_are_verified_without_a_second_xxh3_pass(tmp_path, monkeypatch):
    model, optim = _job()
    cg.CheckpointManager(tmp_path).save(1, {"model": model, "optim": optim, "cursor": {"at": 3}})
    hashed = _hashed(monkeypatch)
    fresh, fresh_optim = _job(seed=1)
    assert (
        cg.CheckpointManager(tmp_path).restore(
            {"model": fresh, "optim": fresh_optim, "cursor": {"at": 0}}
        )
        == 1
    )
    assert hashed == ["cursor"]  # model and optim: skeleton here, tensors by the layout-free pass
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
    )
    record = [r for r in read_records(tmp_path)[0] if r["event"] == "restore"][-1]
    assert record["digests_match"] == {"model": True, "optim": True, "cursor": True, "rng": True}, (
        record
    )
    assert record["layout_free_match"] == {"model": True, "optim": True}, record


def test_a_flipped_tensor_byte_is_caught_by_the_layout_free_pass_and_names_the_file(
    tmp_path, monkeypatch
):
    model, optim = _job()
    cg.CheckpointManager(tmp_path).save(1, {"model": model, "optim": optim})
    state_dir = tmp_path / "step_00000001" / "state"
    infos = [
        i
        for k, i in cg.read_dcp_metadata(state_dir).storage_data.items()
        if k.fqn.startswith("optim.")
    ]
    info = max(infos, key=lambda i: i.length)
    shard = state_dir / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x10  # inside an optimizer moment's bytes
    shard.write_bytes(bytes(data))
    hashed = _hashed(monkeypatch)
    fresh, fresh_optim = _job(seed=1)
    with pytest.raises(cg.StateMismatchError) as caught:
        cg.CheckpointManager(tmp_path).restore({"model": fresh, "optim": fresh_optim})
    message = str(caught.value)
    assert hashed == [], hashed  # caught without the xxh3 pass
    assert "layout-free digests differ" in message and "'optim'" in message, message
    assert shard.name in message and "changed on disk" in message and "verify --deep" in message, (
        message
    )


class _ForgetfulAdamW(torch.optim.AdamW):
    """Loads the tensors but keeps its own learning rate: a load_state_dict bug ckptguard must
    catch."""

    def load_state_dict(self, state_dict):  # type: ignore[no-untyped-def]
        lrs = [g["lr"] for g in self.param_groups]
        super().load_state_dict(state_dict)
        for g, lr in zip(self.param_groups, lrs, strict=True):
            g["lr"] = lr


def test_a_hyperparameter_the_load_did_not_reproduce_is_caught(tmp_path, monkeypatch):
    model, optim = _job()
    cg.CheckpointManager(tmp_path).save(1, {"model": model, "optim": optim})
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2)
    )
    fresh_optim = _ForgetfulAdamW(fresh.parameters(), lr=5e-2)
    hashed = _hashed(monkeypatch)
    with pytest.raises(
        cg.StateMismatchError, match=r"'optim'.*differs after restore.*non-tensor value"
    ):
        cg.CheckpointManager(tmp_path).restore({"model": fresh, "optim": fresh_optim})
    assert hashed == []


def test_a_changed_extras_file_falls_back_to_the_full_digests(tmp_path, monkeypatch):
    """A hyperparameter changed in the extras file would be applied and then equal itself in the
    skeleton check: the file's xxh3 against the manifest sends every item to the full digest."""
    model, optim = _job()
    cg.CheckpointManager(tmp_path).save(1, {"model": model, "optim": optim})
    extras_path = tmp_path / "step_00000001" / "rank_00000.pt"
    data = extras_path.read_bytes()
    lr = b"G" + struct.pack(">d", 1e-3)  # pickle's BINFLOAT of the learning rate
    assert data.count(lr) == 1
    extras_path.write_bytes(
        data.replace(lr, b"G" + struct.pack(">d", 2e-3))
    )  # same size, still loads
    assert (
        torch.load(extras_path, weights_only=True)["items"]["optim"]["param_groups"][0]["lr"]
        == 2e-3
    )
    hashed = _hashed(monkeypatch)
    fresh, fresh_optim = _job(seed=1)
    with pytest.raises(cg.StateMismatchError, match=r"'optim'.*differs after restore"):
        cg.CheckpointManager(tmp_path).restore({"model": fresh, "optim": fresh_optim})
    assert sorted(hashed) == ["model", "optim"]


def _flip_optimizer_byte(step_dir) -> None:  # type: ignore[no-untyped-def]
    state_dir = step_dir / "state"
    infos = [
        i
        for k, i in cg.read_dcp_metadata(state_dir).storage_data.items()
        if k.fqn.startswith("optim.")
    ]
    info = max(infos, key=lambda i: i.length)
    shard = state_dir / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x10
    shard.write_bytes(bytes(data))


def _edit_manifest(step_dir, edit) -> None:  # type: ignore[no-untyped-def]
    path = step_dir / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_the_save_records_structure_digests_for_tensor_items(tmp_path):
    """Format 3: a tensor item's per-rank digest covers its structure, not its bytes (those the
    layout-free digests cover); every other item's covers its bytes."""
    model, optim = _job()
    cg.CheckpointManager(tmp_path).save(1, {"model": model, "optim": optim, "cursor": {"at": 3}})
    data = json.loads((tmp_path / "step_00000001" / "manifest.json").read_text())
    assert data["format_version"] == 3
    assert data["digest_kind"] == {"model": "structure", "optim": "structure", "cursor": "bytes"}
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    flat: dict[str, torch.Tensor] = {}
    skeleton = _state.flatten(sd, "model", flat)
    assert data["digests"]["0"]["model"] == structure_digest(_state._unflatten(skeleton, flat))
    assert data["digests"]["0"]["model"] != digest(_state._unflatten(skeleton, flat))
    sd["0.weight"][0, 0] += (
        1  # a tensor byte changes nothing of the structure digest, the layout-free one only
    )
    assert structure_digest(_state._unflatten(skeleton, flat)) == data["digests"]["0"]["model"]


def test_the_fallback_catches_a_flipped_byte_through_the_layout_free_digests(tmp_path, monkeypatch):
    """The extras file no longer matching the manifest sends the items to the fallback; for format 3
    tensor items it compares their structure digest, and their bytes still by the layout-free
    pass."""
    model, optim = _job()
    cg.CheckpointManager(tmp_path).save(1, {"model": model, "optim": optim})
    step = tmp_path / "step_00000001"
    _flip_optimizer_byte(step)

    def forget_extras_xxh3(data):  # type: ignore[no-untyped-def]
        for f in data["files"]:
            if f["path"] == "rank_00000.pt":
                f["xxh3"] = "0" * 16

    _edit_manifest(step, forget_extras_xxh3)
    hashed = _hashed(monkeypatch)
    fresh, fresh_optim = _job(seed=1)
    with pytest.raises(cg.StateMismatchError, match=r"layout-free digests differ.*'optim'"):
        cg.CheckpointManager(tmp_path).restore({"model": fresh, "optim": fresh_optim})
    assert sorted(hashed) == [
        "model",
        "optim",
    ]  # the fallback ran, and its structure digests passed


def test_a_format3_manifest_without_layout_free_digests_never_passes(tmp_path):
    model, optim = _job()
    cg.CheckpointManager(tmp_path).save(1, {"model": model, "optim": optim})
    step = tmp_path / "step_00000001"
    _edit_manifest(step, lambda d: d.pop("layout_free"))
    with pytest.raises(cg.CheckpointCorruptError, match="layout_free"):
        _manifest.read(step)
    _edit_manifest(
        step, lambda d: d.update(layout_free={})
    )  # present but emptied: every key differs
    fresh, fresh_optim = _job(seed=1)
    with pytest.raises(cg.StateMismatchError, match="layout-free digests differ"):
        cg.CheckpointManager(tmp_path).restore({"model": fresh, "optim": fresh_optim})
    _edit_manifest(step, lambda d: d.update(layout_free={"x": {}}, digest_kind={"model": "bytes"}))
    with pytest.raises(cg.CheckpointCorruptError, match="digest_kind"):
        _manifest.read(step)


@pytest.mark.parametrize(("item", "kind"), [("model", "bytes"), ("n", "structure")])
def test_an_edited_digest_kind_is_refused_alike_by_verify_and_restore(tmp_path, item, kind) -> None:
    # Before: with model's kind edited to "bytes", verify --deep --restore compared a bytes digest
    # with the saved structure digest (FAIL) while restore, which compares tensor items by their
    # layout-free digests, passed.
    from click.testing import CliRunner

    from ckptguard.cli import main

    model, _ = _job()
    cg.CheckpointManager(tmp_path, config=cg.CheckpointConfig(retention=None)).save(
        1, {"model": model, "n": 3}
    )
    step = tmp_path / "step_00000001"
    _edit_manifest(step, lambda d: d["digest_kind"].update({item: kind}))
    with pytest.raises(
        cg.CheckpointCorruptError,
        match=rf"'digest_kind' of \['{item}'\] disagrees with the item kind",
    ):
        _manifest.read(step)
    result = CliRunner().invoke(main, ["verify", str(step), "--deep", "--restore"])
    assert (
        result.exit_code == 1
        and "bad-manifest" in result.output
        and "disagrees with the item kind" in result.output
    )
    fresh, _ = _job(seed=1)
    with pytest.raises(cg.CheckpointError, match="disagrees with the item kind"):
        cg.CheckpointManager(tmp_path).restore({"model": fresh, "n": 0})


def test_the_restored_state_is_read_once_after_the_load(tmp_path, monkeypatch):
    """The checks after the load (item digests, the layout-free pass, replicas) compare one read of
    the live objects (``read_back``), not one read each (it was two per tensor item: the skeleton
    and the layout-free pass). Counted inside the restore of the step, from the load on (what the
    manager does after it is not counted)."""
    model, optim = _job()
    cg.CheckpointManager(tmp_path).save(1, {"model": model, "optim": optim, "cursor": {"at": 3}})
    after: dict[str, int] = {}
    loaded = [False]
    real_read, real_apply, real_restore = _state.current_state, _state.apply, _restore.restore

    def applying(*args, **kw):  # type: ignore[no-untyped-def]
        loaded[0] = True
        return real_apply(*args, **kw)

    def restoring(*args, **kw):  # type: ignore[no-untyped-def]
        try:
            return real_restore(*args, **kw)
        finally:
            loaded[0] = False

    def counted(name, *args, **kw):  # type: ignore[no-untyped-def]
        if loaded[0]:
            after[name] = after.get(name, 0) + 1
        return real_read(name, *args, **kw)

    monkeypatch.setattr(_state, "apply", applying)
    monkeypatch.setattr(_state, "current_state", counted)
    monkeypatch.setattr(_restore, "restore", restoring)
    fresh, fresh_optim = _job(seed=1)
    assert (
        cg.CheckpointManager(tmp_path).restore(
            {"model": fresh, "optim": fresh_optim, "cursor": {"at": 0}}
        )
        == 1
    )
    assert after == {"model": 1, "optim": 1, "cursor": 1}, after
