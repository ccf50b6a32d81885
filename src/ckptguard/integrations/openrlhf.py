"""OpenRLHF: ``DeepspeedStrategy.save_ckpt``/``load_ckpt`` with committed, proven checkpoints.

Contract: ``CkptguardStrategyMixin`` goes before ``DeepspeedStrategy`` in the bases (or use
``strategy_class(DeepspeedStrategy)``); both methods keep OpenRLHF's signatures (pinned:
openrlhf 0.11.2), so ``PPOTrainer``, ``PolicyModelActor`` and the SFT/DPO/RM trainers call them
unchanged. Every rank calls them together, as OpenRLHF already does. What changes:

- ``save_ckpt(model, save_dir, tag="global_step{N}", ...)``: DeepSpeed's own
  ``save_checkpoint`` writes into the in-flight step directory (``<tag>/deepspeed/``); the
  ``client_state`` (step, consumed prompts, dataloader position) and every rank's RNG streams
  (DeepSpeed saves none) are saved by ckptguard; the manifest checksums every file; one
  rename publishes ``save_dir/<tag>/``. Then the tracker moves, and last DeepSpeed's ``latest``
  is replaced atomically (``<tag>/deepspeed``) so an unmodified ``load_checkpoint`` still works.
- rotation runs after the commit, never before (OpenRLHF deletes before saving, so
  ``--ckpt.max_num 1`` has a window with no checkpoint): ``KeepLast(max_num)``. A ``best*`` tag
  is saved as step N and held (``ckptguard hold``) until the next best replaces it, instead of
  being kept outside rotation by its name. ``max_mem`` is not applied (a rule by bytes is not
  a function of the step list); it is logged once when finite.
- ``load_ckpt(model, load_dir, tag=None, ...)``: ``tag=None`` resumes the tracker's step
  (``ResumeMode.AUTO``: a root with steps but no tracker raises instead of skipping the load);
  a tag resumes that step (``path=``; ``best_global_step{N}`` is step N). It returns
  ``(load_path, client_state)`` as OpenRLHF expects, ``(None, {})`` on a declared fresh start.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from .._disk import layout as _layout
from .._records.retention import KeepLast
from .._state.state import PerRank
from ..config import ResumeMode, with_dir_template
from ..errors import ConfigError
from ..manager import CheckpointManager
from ..storage.streaming import StreamingStorage
from .external import ExternalFiles

__all__ = ["DIR_TEMPLATE", "DS_SUBDIR", "CkptguardStrategyMixin", "step_of", "strategy_class"]

log = logging.getLogger("ckptguard")

DIR_TEMPLATE = "global_step{step}"
DS_SUBDIR = "deepspeed"
_TAG = re.compile(r"^(?P<best>best_?)?global_step(?P<step>\d+)$")


def step_of(tag: str) -> tuple[int, bool]:
    """(step, is_best) of an OpenRLHF tag: ``global_step{N}`` or ``best_global_step{N}``."""
    m = _TAG.match(tag or "")
    if m is None or int(m["step"]) < 1:
        raise ConfigError(
            f"save_ckpt(tag={tag!r}): ckptguard needs OpenRLHF's tag 'global_step{{N}}' (or "
            f"'best_global_step{{N}}') with N >= 1, the step it commits"
        )
    return int(m["step"]), bool(m["best"])


class CkptguardStrategyMixin:
    """Overrides the two checkpoint methods of OpenRLHF's ``DeepspeedStrategy``.

    ``ckptguard_config_overrides`` (``CheckpointConfig`` fields, e.g. ``timeout_s``,
    ``contract``) applies on top of what the call's arguments imply.
    """

    ckptguard_config_overrides: dict[str, Any] = {}

    # OpenRLHF's exact signatures, unannotated: test_signatures_match_pinned_openrlhf compares them.
    def save_ckpt(  # type: ignore[no-untyped-def]
        self,
        model,
        save_dir,
        tag=None,
        max_num=3,
        max_mem=1000,
        client_state=None,
        save_latest=True,
        metric_value=None,
        metric_key=None,
    ):
        step, best = step_of(tag)
        if (
            max_mem is not None
            and max_mem != float("inf")
            and not getattr(self, "_ckptguard_warned_mem", False)
        ):
            log.warning(
                "ckptguard: --ckpt.max_mem=%s is not applied; retention keeps the last %s steps",
                max_mem,
                max_num,
            )
            self._ckptguard_warned_mem = True

        def write(directory: Path) -> None:
            model.save_checkpoint(
                str(directory.parent),
                tag=directory.name,
                client_state=client_state or {},
                save_latest=False,
            )

        mgr = self._ckptguard_manager(save_dir, max_num, write)
        path = mgr.save(step, {"client_state": PerRank(dict(client_state or {}))})
        if (
            path is None
        ):  # an unhealthy step (CheckpointConfig.health): not committed, logged as an error
            return None
        if mgr.rank == 0:
            if best:
                self._ckptguard_hold_best(mgr, step, metric_key, metric_value)
            if save_latest:
                _layout.atomic_write_bytes(
                    Path(save_dir) / "latest", f"{path.name}/{DS_SUBDIR}".encode()
                )
        return path

    def load_ckpt(  # type: ignore[no-untyped-def]  # OpenRLHF's signature, see save_ckpt
        self,
        model,
        load_dir,
        tag=None,
        load_module_strict=True,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_only=False,
    ):
        mgr = self._ckptguard_manager(load_dir, None, None)
        path = None if tag is None else Path(load_dir) / DIR_TEMPLATE.format(step=step_of(tag)[0])
        state = {"client_state": PerRank({})}
        step = mgr.restore(state, mode=ResumeMode.AUTO, path=path)
        if step == 0:
            return None, {}
        step_dir = mgr.resolve(mode=ResumeMode.AUTO, path=path).path
        load_path, _ = model.load_checkpoint(
            str(step_dir),
            DS_SUBDIR,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )
        return load_path, state["client_state"].value

    # ------------------------------------------------------------ pieces

    def _ckptguard_manager(self, root: Any, max_num: int | None, write: Any) -> CheckpointManager:
        """One manager per root; the DeepSpeed writer is swapped in for each save."""
        managers: dict[str, CheckpointManager] = self.__dict__.setdefault("_ckptguard_managers", {})
        key = os.path.abspath(str(root))
        if key not in managers:
            storage = ExternalFiles(StreamingStorage(), {DS_SUBDIR: self._ckptguard_write})
            keep = KeepLast(max_num) if max_num else None
            cfg = with_dir_template(
                DIR_TEMPLATE, {"retention": keep, **self.ckptguard_config_overrides}
            )
            managers[key] = CheckpointManager(key, config=cfg, storage=storage)
        self._ckptguard_writer = write
        return managers[key]

    def _ckptguard_write(self, directory: Path) -> None:
        self._ckptguard_writer(directory)

    @staticmethod
    def _ckptguard_hold_best(mgr: CheckpointManager, step: int, key: Any, value: Any) -> None:
        from .._records import retention

        for old, reason in retention.holds(mgr.root).items():
            if old != step and reason.startswith("best "):
                mgr.release(old)
        mgr.hold(step, f"best {key}={value} (OpenRLHF best checkpoint)")


def strategy_class(base: type) -> type:
    """``class CkptguardDeepspeedStrategy(CkptguardStrategyMixin, base)``, named after ``base``."""
    return type(
        f"Ckptguard{base.__name__}", (CkptguardStrategyMixin, base), {"__module__": __name__}
    )
