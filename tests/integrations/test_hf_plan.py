"""The HF/TRL mixin's proof plan is the plan of the job it runs (issue 39: a TRL GRPO job with its
colocated vLLM engine synced through ckptguard showed ``proof plan rl=False`` and then evaluated the
RL gates)."""

from __future__ import annotations

from types import SimpleNamespace

import ckptguard as cg
from ckptguard.integrations.hf import CkptguardHFMixin


def _manager(tmp_path, *, rl: bool, overrides: dict | None = None) -> cg.CheckpointManager:
    trainer = CkptguardHFMixin.__new__(
        CkptguardHFMixin
    )  # the mixin's own state, no transformers Trainer
    trainer.args = SimpleNamespace(output_dir=str(tmp_path), save_total_limit=None)
    trainer.ckptguard_config_overrides = dict(overrides or {})
    trainer._ckptguard_mgr = None
    if rl:
        trainer._ckptguard_rl = (
            True  # what _ckptguard_vllm sets once it installed the engine's sync
        )
    return trainer._ckptguard_manager()


def test_an_rl_trainer_with_the_engine_synced_declares_the_rl_plan(tmp_path):
    mgr = _manager(tmp_path, rl=True)
    assert mgr.config.proof.rl is True and mgr.config.proof.deterministic is True
    mgr.close()


def test_a_plain_trainer_keeps_the_default_plan_and_a_declared_plan_wins(tmp_path):
    plain = _manager(tmp_path / "a", rl=False)
    assert plain.config.proof.rl is False
    plain.close()
    declared = _manager(
        tmp_path / "b", rl=True, overrides={"proof": cg.ProofPlan(rl=True, deterministic=False)}
    )
    assert declared.config.proof.deterministic is False
    declared.close()
