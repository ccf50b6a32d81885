"""ckptguard.integrations.openrlhf on 2 real gloo ranks, with a DeepSpeed-shaped engine, and the
method signatures of the pinned OpenRLHF (0.11.2) it must keep."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ckptguard as cg
from ckptguard._records import retention
from ckptguard.integrations import openrlhf as co
from ckptguard.testing import run_ranks, values


class FakeEngine:
    """DeepSpeedEngine's checkpoint calls: per-rank ZeRO shards, rank 0 the module states."""

    def __init__(self, rank: int) -> None:
        self.rank, self.w = rank, torch.zeros(3)

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True):
        path = os.path.join(save_dir, tag)
        os.makedirs(path, exist_ok=True)
        torch.save(
            {"w": self.w},
            os.path.join(path, f"zero_pp_rank_{self.rank}_mp_rank_00_optim_states.pt"),
        )
        if self.rank == 0:
            torch.save(
                {"client_state": client_state}, os.path.join(path, "mp_rank_00_model_states.pt")
            )
        if dist.is_initialized():
            dist.barrier()

    def load_checkpoint(self, load_dir, tag=None, **kw):
        path = os.path.join(load_dir, tag)
        self.w = torch.load(
            os.path.join(path, f"zero_pp_rank_{self.rank}_mp_rank_00_optim_states.pt")
        )["w"]
        return path, {}


class FakeDeepspeedStrategy:
    def save_ckpt(self, *a, **k):
        raise AssertionError("OpenRLHF's own save_ckpt ran")

    def load_ckpt(self, *a, **k):
        raise AssertionError("OpenRLHF's own load_ckpt ran")


Strategy = co.strategy_class(FakeDeepspeedStrategy)


def _save_run(rank: int, world: int, root: str) -> dict:
    s, engine = Strategy(), FakeEngine(rank)
    for step in (2, 4, 6):
        engine.w += 1
        tag = "best_global_step4" if step == 4 else f"global_step{step}"
        s.save_ckpt(
            engine,
            root,
            tag,
            2,
            float("inf"),
            {"global_step": step, "consumed": 10 * step + rank},
            metric_value=0.9,
            metric_key="eval_reward",
        )
    return {"next_rand": torch.rand(2).tolist()}


def _load_run(rank: int, world: int, root: str, tag: str | None) -> dict:
    s, engine = Strategy(), FakeEngine(rank)
    path, states = s.load_ckpt(engine, root, tag)
    return {
        "path": path,
        "states": states,
        "w": engine.w.tolist(),
        "next_rand": torch.rand(2).tolist(),
    }


def test_save_rotate_hold_best_and_resume_on_two_ranks(tmp_path):
    root = str(tmp_path / "_actor")
    saved = values(run_ranks(_save_run, 2, root, timeout=120))
    names = sorted(p.name for p in Path(root).glob("global_step*"))
    assert names == [
        "global_step4",
        "global_step6",
    ]  # KeepLast(2) after the commit; 4 is also held as best
    assert (Path(root) / "latest").read_text() == "global_step6/deepspeed"
    assert (Path(root) / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    loaded = values(run_ranks(_load_run, 2, root, None, timeout=120))
    for rank, (out, before) in enumerate(zip(loaded, saved, strict=True)):
        assert out["path"] == str(Path(root) / "global_step6" / "deepspeed")
        assert out["states"] == {"global_step": 6, "consumed": 60 + rank}  # per-rank client state
        assert out["w"] == [3.0, 3.0, 3.0]
        assert (
            out["next_rand"] == before["next_rand"]
        )  # RNG streams restored (DeepSpeed saves none)
    held = retention.holds(Path(root))
    assert list(held) == [4] and held[4].startswith("best eval_reward=0.9")


def _one_process(rank: int, world: int, root: str) -> tuple[dict, dict]:
    fresh = _load_run(rank, world, root, None)
    _save_run(rank, world, root)
    return fresh, _load_run(rank, world, root, "best_global_step4")


def test_fresh_start_then_resume_from_an_explicit_tag_and_bad_tag_is_refused(tmp_path):
    fresh, best = values(run_ranks(_one_process, 1, str(tmp_path / "_actor"), distributed=False))[0]
    assert fresh["path"] is None and fresh["states"] == {}  # OpenRLHF's "no checkpoint" answer
    assert best["states"]["global_step"] == 4 and best["w"] == [2.0, 2.0, 2.0]
    with pytest.raises(cg.ConfigError, match="global_step"):
        co.step_of("epoch3")
    assert co.step_of("best_global_step12") == (12, True) and co.step_of("global_step7") == (
        7,
        False,
    )


# Copied from openrlhf 0.11.2, openrlhf/utils/deepspeed/deepspeed.py (DeepspeedStrategy).
PINNED = {
    "save_ckpt": "(self, model, save_dir, tag=None, max_num=3, max_mem=1000, "
    "client_state=None, save_latest=True, "
    "metric_value=None, metric_key=None)",
    "load_ckpt": "(self, model, load_dir, tag=None, load_module_strict=True, "
    "load_optimizer_states=True, "
    "load_lr_scheduler_states=True, load_module_only=False)",
}


def test_signatures_match_pinned_openrlhf():
    for name, sig in PINNED.items():
        assert str(inspect.signature(getattr(co.CkptguardStrategyMixin, name))) == sig
    try:
        from openrlhf.utils.deepspeed import DeepspeedStrategy
    except ImportError:
        # not installable here (deepspeed, flash-attn pins); the copied signatures above stand in
        return
    for name, sig in PINNED.items():
        assert str(inspect.signature(getattr(DeepspeedStrategy, name))) == sig
