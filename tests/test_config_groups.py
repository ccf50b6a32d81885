"""CheckpointConfig is composed of option groups, one spelling per setting: the flat keywords and
names of the unreleased 0.1.0 drafts, the one-shot actions as config fields and a bare ReshardRule
in place of its group are refused, not translated."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

import ckptguard as cg
from ckptguard.config import with_dir_template

# The flat keywords of the drafts (each now a field of one group) and the one-shot actions, now
# arguments of the call that does them (save(..., overwrite=True), save/restore(...,
# break_lease=True)).
REMOVED = (
    "dir_template",
    "stage_dir",
    "keep_failed",
    "publish_checksums",
    "allow_newer_torch",
    "stale_temp_age_s",
    "lease_ttl_s",
    "capture_rng",
    "restore_rng",
    "verify_restored",
    "async_gpu_bytes",
    "async_host_bytes",
    "async_pool_idle_s",
    "on_busy",
    "layout",
    "rng_seed",
    "replicated",
    "record_proof",
    "overwrite",
    "break_lease",
)


@pytest.mark.parametrize("old", REMOVED)
def test_a_removed_flat_keyword_is_refused_and_its_name_does_not_read(old):
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{old}'"):
        cg.CheckpointConfig(**{old: None})
    assert not hasattr(cg.CheckpointConfig(), old)


def test_the_group_spelling_raises_no_warning_and_defaults_are_unchanged():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = cg.CheckpointConfig(
            timeout_s=30,
            storage=cg.StorageOptions(dir_template="iter_{step:07d}"),
            state=cg.StateOptions(capture_rng=False),
            async_save=cg.AsyncOptions(host_bytes=0),
            reshard=cg.ReshardOptions(rule=cg.ReshardRule.BY_ITEM, rng_seed=3),
            proof=cg.ProofPlan(record=False, rl=True),
            retention=None,
        )
    got = (
        config.storage.dir_template,
        config.state.capture_rng,
        config.async_save.host_bytes,
        config.reshard.rng_seed,
    )
    assert got == ("iter_{step:07d}", False, 0, 3)
    assert config.reshard.rule is cg.ReshardRule.BY_ITEM and config.proof.record is False
    assert config.retention is None  # None keeps every step; the default is the default policy
    default = cg.CheckpointConfig()
    assert default.retention == cg.KeepLast(3) | cg.KeepEvery(20)
    assert (default.timeout_s, default.storage.dir_template, default.async_save.on_busy) == (
        600.0,
        "step_{step:08d}",
        cg.OnBusy.SKIP,
    )


def test_a_reshard_rule_in_place_of_its_group_is_refused_naming_the_group():
    with pytest.raises(cg.ConfigError, match=r"CheckpointConfig.reshard must be a ReshardOptions"):
        cg.CheckpointConfig(reshard=cg.ReshardRule.BY_ITEM)


def test_the_reshard_rules_are_refuse_and_by_item():
    assert [r.name for r in cg.ReshardRule] == ["REFUSE", "BY_ITEM"]


def test_a_removed_tiered_keyword_is_refused(tmp_path):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'fast'"):
        cg.TieredCheckpoint(tmp_path / "a", fast=tmp_path / "b")


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: cg.StorageOptions(dir_template="no_field"), "dir_template"),
        (lambda: cg.StorageOptions(lease_ttl_s=0), r"StorageOptions.lease_ttl_s must be > 0"),
        (lambda: cg.StorageOptions(publish_checksums="yes"), r"StorageOptions.publish_checksums"),
        (lambda: cg.StateOptions(capture_rng="no"), r"StateOptions.capture_rng must be a bool"),
        (lambda: cg.AsyncOptions(host_bytes=-1), r"AsyncOptions.host_bytes must be an int >= 0"),
        (lambda: cg.AsyncOptions(on_busy="skip"), r"AsyncOptions.on_busy must be an OnBusy"),
        (lambda: cg.ReshardOptions(rule="by_item"), r"ReshardOptions.rule must be a ReshardRule"),
        (
            lambda: cg.ReshardOptions(replicated="sched"),
            r"ReshardOptions.replicated must be a tuple",
        ),
        (lambda: cg.ReshardOptions(rng_seed=-1), r"ReshardOptions.rng_seed"),
        (lambda: cg.ProofPlan(record=1), r"ProofPlan.record must be a bool"),
        (lambda: cg.CheckpointConfig(timeout_s=0), r"CheckpointConfig.timeout_s must be > 0"),
        (
            lambda: cg.CheckpointConfig(storage=cg.StateOptions()),
            r"CheckpointConfig.storage must be a StorageOptions",
        ),
        (
            lambda: cg.CheckpointConfig(health=None),
            r"CheckpointConfig.health must be a HealthPolicy",
        ),
        (
            lambda: cg.CheckpointConfig(blocking=0.5),
            r"CheckpointConfig.blocking must be a BlockingBudget",
        ),
    ],
)
def test_each_group_refuses_a_bad_value_naming_group_and_field(build, match):
    with pytest.raises(cg.ConfigError, match=match):
        build()


def test_replace_keeps_the_groups_and_the_config_is_hashable():
    config = cg.CheckpointConfig(storage=cg.StorageOptions(keep_failed=True))
    changed = dataclasses.replace(config, timeout_s=5)
    assert changed.storage.keep_failed and changed.timeout_s == 5
    assert hash(config) == hash(cg.CheckpointConfig(storage=cg.StorageOptions(keep_failed=True)))


def test_an_integration_keeps_its_directory_names_and_the_callers_storage():
    config = with_dir_template(
        "checkpoint-{step}", {"storage": cg.StorageOptions(keep_failed=True), "timeout_s": 9}
    )
    assert config.storage == cg.StorageOptions(dir_template="checkpoint-{step}", keep_failed=True)
    assert config.timeout_s == 9
