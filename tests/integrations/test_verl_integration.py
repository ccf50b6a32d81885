"""ckptguard.integrations.verl: the mixin's behaviour with verl-shaped fakes, and the boundary
against the real, pinned verl package (run in its own venv, .venv-verl)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ckptguard as cg
from ckptguard._disk import layout as _layout
from ckptguard.integrations import verl as cv
from venvs import needs_venv

REPO = Path(__file__).resolve().parents[2]
VERL_PYTHON = Path(os.environ.get("CKPTGUARD_VERL_PYTHON", REPO / ".venv-verl" / "bin" / "python"))
VERL_PIN = "0.9.1"


class FakeWorkerGroup:
    """verl's worker-group API for checkpoints: writes per-rank shard files like its FSDP
    manager."""

    def __init__(self, world: int = 2, fail_at: int | None = None) -> None:
        self.world, self.fail_at = world, fail_at
        self.weights = torch.zeros(4)
        self.saved: list[tuple[str, int, object]] = []
        self.loaded: list[tuple[str, bool]] = []

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        self.saved.append((local_path, global_step, max_ckpt_to_keep))
        os.makedirs(local_path, exist_ok=True)
        for r in range(self.world):
            torch.save(
                {"w": self.weights + r},
                os.path.join(local_path, f"model_world_size_{self.world}_rank_{r}.pt"),
            )
        if global_step == self.fail_at:
            raise OSError(28, "No space left on device", local_path)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        self.loaded.append((local_path, del_local_after_load))
        self.weights = torch.load(
            os.path.join(local_path, f"model_world_size_{self.world}_rank_0.pt")
        )["w"]


class FakeLoader:
    def __init__(self, n: int = 10) -> None:
        self.n, self.cursor = n, 0

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "epoch_seed": 7}

    def load_state_dict(self, sd: dict) -> None:
        self.cursor = sd["cursor"]


class FakeRayPPOTrainer:
    """The attributes RayPPOTrainer's checkpoint hooks use, and nothing else."""

    def __init__(self, root: Path, **trainer) -> None:
        defaults = {
            "default_local_dir": str(root),
            "default_hdfs_dir": None,
            "resume_mode": "auto",
            "resume_from_path": None,
            "save_freq": 2,
            "max_actor_ckpt_to_keep": None,
            "max_critic_ckpt_to_keep": None,
            "del_local_ckpt_after_load": False,
        }
        self.config = SimpleNamespace(trainer={**defaults, **trainer})
        self.global_steps = 0
        self.train_dataloader = FakeLoader()
        self.actor_rollout_wg = FakeWorkerGroup()
        self.use_critic = True
        self.critic_wg = FakeWorkerGroup()

    def _save_checkpoint(self):  # what the mixin must replace
        raise AssertionError("verl's own _save_checkpoint ran")

    def _load_checkpoint(self):
        raise AssertionError("verl's own _load_checkpoint ran")


Trainer = cv.trainer_class(FakeRayPPOTrainer)


def _train(t, steps: int) -> None:
    for _ in range(steps):
        t.global_steps += 1
        t.train_dataloader.cursor += 1
        t.actor_rollout_wg.weights += 1
        if cv.should_save(t.config.trainer, t.global_steps, is_last_step=False):
            t._save_checkpoint()


def test_save_commits_verl_layout_and_verl_reads_it(tmp_path):
    root = tmp_path / "ckpts"
    t = Trainer(root, max_actor_ckpt_to_keep=2, max_critic_ckpt_to_keep=1)
    _train(t, 6)
    assert sorted(p.name for p in root.glob("global_step_*")) == ["global_step_4", "global_step_6"]
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    step = root / "global_step_6"
    assert (step / "actor" / "model_world_size_2_rank_1.pt").is_file()
    assert (step / "critic" / "model_world_size_2_rank_0.pt").is_file()
    listed = {f["path"] for f in json.loads((step / "manifest.json").read_text())["files"]}
    assert {"actor/model_world_size_2_rank_0.pt", "critic/model_world_size_2_rank_1.pt"} <= listed
    # verl's own rotation is off: ckptguard's runs from the disk
    assert {keep for _, _, keep in t.actor_rollout_wg.saved} == {None}


def test_resume_auto_restores_workers_loader_and_global_steps(tmp_path):
    root = tmp_path / "ckpts"
    _train(Trainer(root), 5)  # saves 2 and 4; step 5 is lost
    t = Trainer(root, del_local_ckpt_after_load=True)
    assert t._load_checkpoint() == 4
    assert t.global_steps == 4 and t.train_dataloader.cursor == 4
    assert t.actor_rollout_wg.loaded == [(str(root / "global_step_4" / "actor"), False)]
    assert t.critic_wg.loaded == [(str(root / "global_step_4" / "critic"), False)]
    assert torch.equal(t.actor_rollout_wg.weights, torch.full((4,), 4.0))
    assert (root / "global_step_4" / "actor").is_dir()  # del_local_ckpt_after_load never deletes


def test_resume_path_and_disable(tmp_path, monkeypatch):
    root = tmp_path / "ckpts"
    _train(Trainer(root), 4)
    monkeypatch.chdir(tmp_path)
    t = Trainer(root, resume_mode="resume_path", resume_from_path="ckpts/global_step_2")
    assert t._load_checkpoint() == 2 and t.global_steps == 2
    t = Trainer(root, resume_mode="disable")
    assert t._load_checkpoint() == 0 and t.global_steps == 0 and t.actor_rollout_wg.loaded == []
    with pytest.raises(cg.ConfigError, match="resume_from_path"):
        Trainer(root, resume_mode="resume_path", resume_from_path=None)._load_checkpoint()
    with pytest.raises(cg.ConfigError, match="auto', 'disable' and 'resume_path"):
        Trainer(root, resume_mode="latest")._load_checkpoint()


def test_epoch_boundary_does_not_restore_an_exhausted_loader(tmp_path):
    root = tmp_path / "ckpts"
    t = Trainer(root)
    t.train_dataloader.n = 4
    _train(t, 4)
    t2 = Trainer(root)
    t2.train_dataloader.n = 4
    assert t2._load_checkpoint() == 4 and t2.train_dataloader.cursor == 0


def test_tracker_pointing_at_missing_step_raises_instead_of_training_from_scratch(tmp_path):
    root = tmp_path / "ckpts"
    _train(Trainer(root), 4)
    _layout.remove_step_dir(root / "global_step_4")
    with pytest.raises(cg.CheckpointError):
        Trainer(root)._load_checkpoint()


def test_failed_worker_save_leaves_previous_step_as_resume_target(tmp_path):
    root = tmp_path / "ckpts"
    t = Trainer(root)
    t.critic_wg.fail_at = 4
    with pytest.raises(cg.CheckpointWriteError, match="No space left"):
        _train(t, 4)
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (root / "global_step_4").exists()
    assert Trainer(root)._load_checkpoint() == 2


def test_async_trainer_mode_is_refused_and_v1_callback_runs_after_commit(tmp_path):
    t = Trainer(tmp_path / "ckpts")
    calls = []
    t.checkpoint_callback = SimpleNamespace(on_save=lambda **kw: calls.append(kw))
    _train(t, 2)
    assert calls[0]["global_step"] == 2 and calls[0]["checkpoint_dir"] == str(
        tmp_path / "ckpts" / "global_step_2"
    )
    assert (tmp_path / "ckpts" / "global_step_2" / "manifest.json").is_file()
    t.trainer_mode = "colocate_async"
    with pytest.raises(cg.ConfigError, match="TransferQueue"):
        t._save_checkpoint()


def test_config_mapping_is_refused_with_the_field_named(tmp_path):
    with pytest.raises(cg.ConfigError, match="max_\\*_ckpt_to_keep"):
        cv.checkpoint_config({"max_actor_ckpt_to_keep": 0})
    assert cv.checkpoint_config({"remove_previous_ckpt_in_save": True}).retention == cg.KeepLast(1)
    assert cv.checkpoint_config({}).retention is None
    assert cv.should_save({"save_freq": -1}, 10, is_last_step=True) is False
    assert cv.should_save({"save_freq": 3}, 7, is_last_step=True) is True
    with pytest.raises(cg.ConfigError, match="default_hdfs_dir"):
        Trainer(tmp_path, default_hdfs_dir="hdfs://x")._load_checkpoint()


# ---------------------------------------------------------------- the boundary with real verl

_BOUNDARY = r"""
import inspect, json, os, sys, tempfile, warnings
warnings.filterwarnings("ignore")
import verl
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.utils import Role
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
from ckptguard.integrations.verl import CkptguardTrainerMixin, trainer_class
cls = trainer_class(RayPPOTrainer)
out = {
    "version": verl.__version__,
    "subclass": issubclass(cls, RayPPOTrainer),
    "ours_first": cls._save_checkpoint is CkptguardTrainerMixin._save_checkpoint
                  and cls._load_checkpoint is CkptguardTrainerMixin._load_checkpoint,
    "save_sig": str(inspect.signature(RayPPOTrainer._save_checkpoint)),
    "load_sig": str(inspect.signature(RayPPOTrainer._load_checkpoint)),
    "critic_dir": str(Role.Critic),
    "fit_calls": [n for n in ("_load_checkpoint()", "_save_checkpoint()",
                              "update_weights(self.global_steps)")
                  if n in inspect.getsource(RayPPOTrainer.fit)],
    "their_save_reads": [k for k in ("default_local_dir", "max_actor_ckpt_to_keep",
                                     "max_critic_ckpt_to_keep")
                         if k in inspect.getsource(RayPPOTrainer._save_checkpoint)],
    "their_load_reads": [k for k in ("resume_mode", "resume_from_path", "del_local_ckpt_after_load")
                         if k in inspect.getsource(RayPPOTrainer._load_checkpoint)],
}
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
v1 = trainer_class(PPOTrainerSync)
out["v1_subclass"] = (issubclass(v1, PPOTrainerSync)
                     and v1._save_checkpoint is CkptguardTrainerMixin._save_checkpoint)
out["v1_sigs"] = [str(inspect.signature(getattr(PPOTrainer, n)))
                  for n in ("_save_checkpoint", "_load_checkpoint")]
src = inspect.getsource(PPOTrainer)
wanted = ("self._load_checkpoint()", "self._save_checkpoint()", "trainer_mode",
          "checkpoint_callback.on_save(")
out["v1_calls"] = [n for n in wanted if n in src]
out["v1_sync_weights"] = "update_weights(self.global_steps)" in inspect.getsource(PPOTrainerSync)
# verl's own reader finds what ckptguard committed (a compatible tracker and directory name)
root = sys.argv[1]
out["verl_finds"] = find_latest_ckpt_path(root)
print("BOUNDARY" + json.dumps(out))
"""


@needs_venv(
    VERL_PYTHON,
    reason=f"verl venv not found at {VERL_PYTHON}: run the Makefile's "
    f"verl-venv step (pip install verl=={VERL_PIN} --no-deps plus its import deps)",
)
def test_boundary_with_pinned_verl(tmp_path):
    root = tmp_path / "ckpts"
    _train(Trainer(root), 4)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.run(
        [str(VERL_PYTHON), "-c", _BOUNDARY, str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BOUNDARY")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(line[len("BOUNDARY") :])
    assert out["version"] == VERL_PIN
    assert out["subclass"] and out["ours_first"]
    assert out["save_sig"] == "(self)" and out["load_sig"] == "(self)"
    assert out["critic_dir"] == "critic"
    assert out["fit_calls"] == [
        "_load_checkpoint()",
        "_save_checkpoint()",
        "update_weights(self.global_steps)",
    ]
    assert out["their_save_reads"] == [
        "default_local_dir",
        "max_actor_ckpt_to_keep",
        "max_critic_ckpt_to_keep",
    ]
    assert out["their_load_reads"] == [
        "resume_mode",
        "resume_from_path",
        "del_local_ckpt_after_load",
    ]
    assert out["verl_finds"] == str(root / "global_step_4")
    assert out["v1_subclass"] and out["v1_sigs"] == ["(self)", "(self)"] and out["v1_sync_weights"]
    assert out["v1_calls"] == [
        "self._load_checkpoint()",
        "self._save_checkpoint()",
        "trainer_mode",
        "checkpoint_callback.on_save(",
    ]


def test_this_interpreter_is_not_the_verl_one():
    # The verl venv must never replace the main venv's torch.
    assert torch.__version__.startswith("2.13.0"), sys.executable
