"""CheckpointConfig is composed of option groups; the flat keywords of earlier releases still work for
one release, each with a DeprecationWarning naming its new spelling, and build the same config."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

import ckptguard as cg
from ckptguard.config import _LEGACY, with_dir_template

# One non-default value per flat keyword, and where the group keeps it.
FLAT_VALUES = {
    "dir_template": "global_step_{step}",
    "stage_dir": Path("/tmp/stage"),
    "keep_failed": True,
    "publish_checksums": True,
    "allow_newer_torch": True,
    "stale_temp_age_s": 60.0,
    "lease_ttl_s": 120.0,
    "capture_rng": False,
    "restore_rng": False,
    "verify_restored": False,
    "async_gpu_bytes": 1 << 20,
    "async_host_bytes": 2 << 20,
    "async_pool_idle_s": None,
    "on_busy": cg.OnBusy.WAIT,
    "layout": cg.ParallelLayout(dp=2, tp=2),
    "rng_seed": 7,
    "replicated": ("sched",),
    "record_proof": False,
}


def test_every_flat_keyword_has_a_value_here():
    assert set(FLAT_VALUES) == set(_LEGACY)


@pytest.mark.parametrize("old", sorted(FLAT_VALUES))
def test_a_flat_keyword_warns_with_the_new_spelling_and_lands_in_its_group(old):
    group, name = _LEGACY[old]
    value = FLAT_VALUES[old]
    with pytest.warns(DeprecationWarning, match=rf"CheckpointConfig\({old}=\.\.\.\) is deprecated: write "
                                                rf"CheckpointConfig\({group}=\w+\({name}=\.\.\.\)\)"):
        flat = cg.CheckpointConfig(**{old: value})
    grouped_cls = type(getattr(cg.CheckpointConfig(), group))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grouped = cg.CheckpointConfig(**{group: grouped_cls(**{name: value})})
    assert flat == grouped
    assert getattr(getattr(flat, group), name) == value
    assert getattr(flat, old) == value  # the flat name still reads


def test_the_group_spelling_raises_no_warning_and_defaults_are_unchanged():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = cg.CheckpointConfig(
            timeout_s=30, storage=cg.StorageOptions(dir_template="iter_{step:07d}"),
            state=cg.StateOptions(capture_rng=False), async_save=cg.AsyncOptions(host_bytes=0),
            reshard=cg.ReshardOptions(rule=cg.ReshardRule.BY_ITEM, rng_seed=3),
            proof=cg.ProofPlan(record=False, rl=True), retention=None,
        )
    assert (config.dir_template, config.capture_rng, config.async_host_bytes, config.rng_seed) == (
        "iter_{step:07d}", False, 0, 3)
    assert config.reshard.rule is cg.ReshardRule.BY_ITEM and config.record_proof is False
    assert config.retention is None  # None keeps every step; the default is the default policy
    default = cg.CheckpointConfig()
    assert default.retention == cg.KeepLast(3) | cg.KeepEvery(20)
    assert (default.timeout_s, default.dir_template, default.on_busy) == (600.0, "step_{step:08d}", cg.OnBusy.SKIP)


def test_a_reshard_rule_in_place_of_the_group_still_works_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"reshard=ReshardOptions\(rule=ReshardRule.BY_ITEM\)"):
        config = cg.CheckpointConfig(reshard=cg.ReshardRule.BY_ITEM)
    assert config.reshard == cg.ReshardOptions(rule=cg.ReshardRule.BY_ITEM)


def test_a_flat_keyword_applies_over_the_group_given_beside_it():
    with pytest.warns(DeprecationWarning):
        config = cg.CheckpointConfig(storage=cg.StorageOptions(keep_failed=True), dir_template="x_{step}")
    assert config.storage == cg.StorageOptions(keep_failed=True, dir_template="x_{step}")


def test_an_unknown_keyword_is_a_type_error_listing_the_options():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'timeout'.*timeout_s"):
        cg.CheckpointConfig(timeout=5)


@pytest.mark.parametrize(("build", "match"), [
    (lambda: cg.StorageOptions(dir_template="no_field"), "dir_template"),
    (lambda: cg.StorageOptions(lease_ttl_s=0), r"StorageOptions.lease_ttl_s must be > 0"),
    (lambda: cg.StorageOptions(publish_checksums="yes"), r"StorageOptions.publish_checksums"),
    (lambda: cg.StateOptions(capture_rng="no"), r"StateOptions.capture_rng must be a bool"),
    (lambda: cg.AsyncOptions(host_bytes=-1), r"AsyncOptions.host_bytes must be an int >= 0"),
    (lambda: cg.AsyncOptions(on_busy="skip"), r"AsyncOptions.on_busy must be an OnBusy"),
    (lambda: cg.ReshardOptions(rule="by_item"), r"ReshardOptions.rule must be a ReshardRule"),
    (lambda: cg.ReshardOptions(replicated="sched"), r"ReshardOptions.replicated must be a tuple"),
    (lambda: cg.ReshardOptions(rng_seed=-1), r"ReshardOptions.rng_seed"),
    (lambda: cg.ProofPlan(record=1), r"ProofPlan.record must be a bool"),
    (lambda: cg.CheckpointConfig(timeout_s=0), r"CheckpointConfig.timeout_s must be > 0"),
    (lambda: cg.CheckpointConfig(storage=cg.StateOptions()), r"CheckpointConfig.storage must be a StorageOptions"),
])
def test_each_group_refuses_a_bad_value_naming_group_and_field(build, match):
    with pytest.raises(cg.ConfigError, match=match):
        build()


def test_replace_keeps_the_groups_and_the_config_is_hashable():
    config = cg.CheckpointConfig(storage=cg.StorageOptions(keep_failed=True))
    changed = dataclasses.replace(config, timeout_s=5)
    assert changed.storage.keep_failed and changed.timeout_s == 5
    assert hash(config) == hash(cg.CheckpointConfig(storage=cg.StorageOptions(keep_failed=True)))


def test_an_integration_keeps_its_directory_names_and_the_callers_storage():
    config = with_dir_template("checkpoint-{step}", {"storage": cg.StorageOptions(keep_failed=True), "timeout_s": 9})
    assert config.storage == cg.StorageOptions(dir_template="checkpoint-{step}", keep_failed=True)
    assert config.timeout_s == 9


def test_one_shot_actions_are_not_config():
    with pytest.warns(DeprecationWarning, match=r"Pass break_lease=True to the call that needs it"):
        cg.CheckpointConfig(break_lease=True)
    assert "break_lease" not in repr(cg.CheckpointConfig())
