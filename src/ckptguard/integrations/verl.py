"""verl: replace ``RayPPOTrainer._save_checkpoint``/``_load_checkpoint`` with committed, proven
ones.

Contract: ``CkptguardTrainerMixin`` goes before ``RayPPOTrainer`` (legacy) or the v1
``PPOTrainerSync`` in the bases (or use ``trainer_class(base)``); pinned and checked: verl
0.9.1. It keeps verl's layout and names, so unmodified verl readers still work:
``default_local_dir/global_step_{N}/actor/`` (and ``critic/``) written by verl's own workers,
``latest_checkpointed_iteration.txt`` as the tracker. What changes:

- the workers write into the in-flight ``.tmp-global_step_{N}-*`` directory; the driver's state
  (dataloader position, ``global_steps``) is saved by ckptguard; the manifest lists and
  checksums every file; one rename publishes the step, and the tracker moves last, atomically.
  A failed or killed save leaves the previous step as the resume target.
- retention runs after the commit, from the steps on disk (``KeepLast(max_actor_ckpt_to_keep)``;
  with both actor and critic limits the larger wins, since one step holds both); verl's own
  in-memory rotation is switched off (``max_ckpt_to_keep=None`` to the workers).
- ``resume_mode``: ``auto`` -> ``ResumeMode.AUTO`` (a root with steps but no tracker, or a tracker
  naming a missing step, raises instead of "Training from scratch"), ``disable`` -> ``NEVER``,
  ``resume_path`` -> ``path=resume_from_path``. A relative path is taken from the working
  directory, as verl does.
- ``_load_checkpoint`` leaves ``self.global_steps`` at the restored step (0 on a fresh start), so
  ``fit()``'s forced ``checkpoint_manager.update_weights(global_steps)`` still runs after it.
- ``del_local_ckpt_after_load`` is not honoured: a load never deletes a committed step.
- ``default_hdfs_dir`` is refused (verl's own load does not implement it either).
- the v1 trainer's ``checkpoint_callback.on_save`` runs after the commit, with the committed path.
- async trainer modes (TransferQueue state) are refused with ``ConfigError``.

``save_freq`` stays verl's: ``fit()`` decides when to call ``_save_checkpoint``
(``should_save`` mirrors that rule for loops of your own).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from .._records.retention import KeepLast
from ..config import CheckpointConfig, ResumeMode, with_dir_template
from ..errors import ConfigError
from ..manager import CheckpointManager
from ..storage.streaming import StreamingStorage
from .external import ExternalFiles

__all__ = [
    "CkptguardTrainerMixin",
    "checkpoint_config",
    "resume_args",
    "should_save",
    "trainer_class",
]

log = logging.getLogger("ckptguard")

DIR_TEMPLATE = "global_step_{step}"
_MODES = {"auto": ResumeMode.AUTO, "disable": ResumeMode.NEVER, "resume_path": ResumeMode.AUTO}


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg.key`` for OmegaConf, dataclasses and dicts alike."""
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    getter = getattr(cfg, "get", None)
    if callable(getter):
        return getter(key, default)
    return getattr(cfg, key, default)


def _keep(trainer_cfg: Any) -> int | None:
    if _get(trainer_cfg, "remove_previous_ckpt_in_save", False):
        return 1
    limits = [_get(trainer_cfg, k) for k in ("max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep")]
    limits = [n for n in limits if n is not None]
    for n in limits:
        if not isinstance(n, int) or n < 1:
            raise ConfigError(
                f"trainer.max_*_ckpt_to_keep={n!r}: give an int >= 1, or null "
                f"to keep every checkpoint"
            )
    return max(limits) if limits else None


def checkpoint_config(trainer_cfg: Any, **overrides: Any) -> CheckpointConfig:
    """verl's ``trainer`` section as a ``CheckpointConfig`` (verl's dir names, its retention)."""
    keep = _keep(trainer_cfg)
    return with_dir_template(
        DIR_TEMPLATE, {"retention": KeepLast(keep) if keep else None, **overrides}
    )


def resume_args(trainer_cfg: Any, cwd: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """``trainer.resume_mode``/``resume_from_path`` as ``restore(mode=..., path=...)`` arguments."""
    mode = str(_get(trainer_cfg, "resume_mode", "auto"))
    if mode not in _MODES:
        raise ConfigError(
            f"trainer.resume_mode={mode!r}: verl knows 'auto', 'disable' and 'resume_path'"
        )
    if mode != "resume_path":
        return {"mode": _MODES[mode], "path": None}
    path = _get(trainer_cfg, "resume_from_path")
    if not isinstance(path, str) or "global_step_" not in path:
        raise ConfigError(
            f"trainer.resume_from_path={path!r}: with resume_mode=resume_path give the step "
            f"directory, e.g. checkpoints/run/global_step_120"
        )
    p = Path(path)
    return {"mode": ResumeMode.AUTO, "path": p if p.is_absolute() else Path(cwd or os.getcwd()) / p}


def should_save(trainer_cfg: Any, step: int, *, is_last_step: bool) -> bool:
    """verl's ``save_freq`` rule: every ``save_freq`` steps and at the last step; never if <= 0."""
    freq = int(_get(trainer_cfg, "save_freq", -1))
    return freq > 0 and (is_last_step or step % freq == 0)


def _critic_dir() -> str:
    try:
        # optional, often absent
        from verl.trainer.ppo.utils import Role  # type: ignore[import-not-found]

        return str(Role.Critic)
    except ImportError:
        return "critic"


class CkptguardTrainerMixin:
    """Overrides verl's two checkpoint hooks; put it before ``RayPPOTrainer`` in the bases.

    Uses from the trainer only what ``RayPPOTrainer`` has: ``config.trainer``,
    ``global_steps``, ``train_dataloader``, ``actor_rollout_wg``, ``use_critic``, ``critic_wg``.
    ``ckptguard_config_overrides`` (a dict of ``CheckpointConfig`` fields, e.g. ``contract``,
    ``timeout_s``) is applied on top of what verl's config implies.
    """

    ckptguard_config_overrides: dict[str, Any] = {}
    # The trainer's own attributes (declared only, no value): verl ships no type stubs.
    config: Any
    actor_rollout_wg: Any
    critic_wg: Any
    train_dataloader: Any

    # ------------------------------------------------------------ verl's hooks

    def _save_checkpoint(self) -> None:
        self._ckptguard_check_mode()
        step = int(self.global_steps)
        mgr = self._ckptguard_manager(step)
        path = mgr.save(step, self._ckptguard_state())
        if (
            path is None
        ):  # an unhealthy step (CheckpointConfig.health): not committed, logged as an error
            return
        log.info("ckptguard: verl step %d committed at %s", step, path)
        callback = getattr(
            self, "checkpoint_callback", None
        )  # v1 trainer's on_save hook, after the commit
        if callback is not None:
            callback.on_save(
                trainer=self, global_step=step, checkpoint_dir=str(path), async_save=False
            )

    def _load_checkpoint(self) -> int:
        self._ckptguard_check_mode()
        trainer_cfg = self.config.trainer
        if _get(trainer_cfg, "default_hdfs_dir") is not None:
            raise ConfigError(
                "trainer.default_hdfs_dir is set: ckptguard (like verl's own load) resumes from "
                "default_local_dir only; mount the storage and point default_local_dir at it"
            )
        if _get(trainer_cfg, "del_local_ckpt_after_load", False):
            log.warning(
                "ckptguard: trainer.del_local_ckpt_after_load is ignored; a "
                "load never deletes a step"
            )
        args = resume_args(trainer_cfg)
        state = self._ckptguard_state()
        step = self._ckptguard_manager(None).restore(state, **args)
        self.global_steps = step
        if step == 0:
            return 0
        step_dir = self._ckptguard_manager(None).resolve(**args).path
        assert step_dir is not None  # restore returned a step: resolve found its directory
        self.actor_rollout_wg.load_checkpoint(str(step_dir / "actor"), del_local_after_load=False)
        if getattr(self, "use_critic", False):
            self.critic_wg.load_checkpoint(
                str(step_dir / _critic_dir()), del_local_after_load=False
            )
        self._ckptguard_apply_dataloader(state["dataloader"], step)
        return step

    # ------------------------------------------------------------ pieces

    def _ckptguard_check_mode(self) -> None:
        mode = getattr(self, "trainer_mode", "sync")
        if mode != "sync":
            raise ConfigError(
                f"trainer_mode={mode!r}: the ckptguard mixin covers verl's sync trainers "
                f"(RayPPOTrainer, PPOTrainerSync); the async modes also save TransferQueue state, "
                f"which it does not commit yet. Use the sync trainer or verl's own checkpointing"
            )

    def _ckptguard_root(self) -> Path:
        root = Path(str(_get(self.config.trainer, "default_local_dir")))
        return root if root.is_absolute() else Path.cwd() / root

    def _ckptguard_manager(self, step: int | None) -> CheckpointManager:
        """One manager per trainer; the workers' writers see the step being saved."""
        mgr = getattr(self, "_ckptguard_mgr", None)
        if mgr is None:
            cfg = checkpoint_config(self.config.trainer, **self.ckptguard_config_overrides)
            storage = ExternalFiles(StreamingStorage(), self._ckptguard_writers())
            mgr = CheckpointManager(self._ckptguard_root(), config=cfg, storage=storage)
            self._ckptguard_mgr = mgr
        if step is not None:
            self._ckptguard_step = step
        return mgr

    def _ckptguard_writers(self) -> dict[str, Any]:
        def actor(directory: Path) -> None:
            self.actor_rollout_wg.save_checkpoint(
                str(directory), None, self._ckptguard_step, max_ckpt_to_keep=None
            )

        def critic(directory: Path) -> None:
            self.critic_wg.save_checkpoint(
                str(directory), None, self._ckptguard_step, max_ckpt_to_keep=None
            )

        writers: dict[str, Any] = {"actor": actor}
        if getattr(self, "use_critic", False):
            writers[_critic_dir()] = critic
        return writers

    def _ckptguard_state(self) -> dict[str, Any]:
        return {
            "dataloader": self.train_dataloader.state_dict(),
            "global_steps": int(self.global_steps),
        }

    def _ckptguard_apply_dataloader(self, saved: Any, step: int) -> None:
        # verl PR #5725: at an exact epoch boundary the saved loader is exhausted; restoring it
        # would end training with zero steps, so the next epoch starts from the beginning.
        per_epoch = len(self.train_dataloader)
        if per_epoch > 0 and step % per_epoch == 0:
            log.info(
                "ckptguard: step %d is at an epoch boundary; the dataloader starts the next epoch",
                step,
            )
            return
        self.train_dataloader.load_state_dict(saved)


def trainer_class(base: type) -> type:
    """``class CkptguardRayPPOTrainer(CkptguardTrainerMixin, base)``, named after ``base``."""
    return type(
        f"Ckptguard{base.__name__}", (CkptguardTrainerMixin, base), {"__module__": __name__}
    )
