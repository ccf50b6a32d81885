"""Probes: cgroup v2 / v1 / no-cgroup fixture trees, this machine's real files, Ray's figure,
processes, GPU guard."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ckptguard.errors import ConfigError
from ckptguard.memory import (
    CgroupVersion,
    HostProbe,
    HostProbeConfig,
    RayAccounting,
    RayConfig,
    Sampler,
    SamplerConfig,
    list_tree,
    parse_cuda_oom,
    parse_ray_kill_lines,
    pinned_figures,
    ray_figure,
    read_gpu,
    read_process,
)

FIX = Path(__file__).parents[1] / "fixtures" / "memory"
GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10


def probe(tree: str, root: Path = FIX) -> HostProbe:
    base = root / tree
    return HostProbe(
        HostProbeConfig(proc_root=base / "proc", cgroup_root=base / "sys" / "fs" / "cgroup")
    )


def test_v2_tree_reads_every_field_and_the_parent_limit():
    snap = probe("cgroup_v2").read()
    assert snap.source is CgroupVersion.V2
    assert snap.cgroup_dir.endswith("job.slice/run1")
    assert (snap.current, snap.peak) == (6 * GiB, 7 * GiB)
    # The leaf's memory.max is "max"; the parent's 8 GiB binds.
    assert snap.limit == 8 * GiB
    assert (snap.anon, snap.file, snap.shmem) == (3 * GiB, 2 * GiB + 512 * MiB, 1 * GiB)
    # Reclaimable is the file LRU, not "file" (which holds shmem, i.e. pinned memory).
    assert snap.reclaimable == 1 * GiB + 512 * MiB
    assert (snap.oom, snap.oom_kill) == (2, 1)
    assert snap.mem_total == 32768000 * KiB
    assert "limit" not in snap.not_obtained


def test_v1_tree_uses_hierarchical_limit_and_says_what_v1_lacks():
    snap = probe("cgroup_v1").read()
    assert snap.source is CgroupVersion.V1
    assert (snap.current, snap.peak) == (5 * GiB, 9 * GiB)
    assert snap.limit == 16 * GiB  # leaf unlimited, hierarchical_memory_limit binds
    assert snap.anon == 2 * GiB + 256 * MiB and snap.file == 2 * GiB  # total_* (hierarchical) keys
    assert snap.reclaimable == 1 * GiB + 256 * MiB
    assert snap.oom_kill == 4
    assert snap.shmem is None and "no shmem line" in snap.not_obtained["shmem"]
    assert snap.oom is None and "v1" in snap.not_obtained["oom"]


def test_no_cgroup_falls_back_to_meminfo_and_vmstat():
    snap = probe("no_cgroup").read()
    assert snap.source is CgroupVersion.NONE
    assert snap.current == (32768000 - 4096000) * KiB
    assert snap.limit == snap.mem_total == 32768000 * KiB
    assert snap.shmem == 2048000 * KiB
    assert snap.file == (16384000 + 65536) * KiB
    assert snap.oom_kill == 3  # node-wide /proc/vmstat
    assert snap.peak is None and "high-water" in snap.not_obtained["peak"]
    assert "cgroup" in snap.not_obtained


def test_unreadable_sources_are_not_obtained_never_zero(tmp_path):
    shutil.copytree(FIX / "cgroup_v2", tmp_path / "t")
    cg = tmp_path / "t" / "sys" / "fs" / "cgroup" / "job.slice" / "run1"
    (cg / "memory.peak").unlink()  # kernel < 5.19
    (cg / "memory.stat").unlink()
    (tmp_path / "t" / "proc" / "meminfo").unlink()
    snap = probe("t", tmp_path).read()
    assert snap.current == 6 * GiB
    for name in ("peak", "anon", "file", "shmem", "mem_total"):
        assert getattr(snap, name) is None, name
        assert name in snap.not_obtained, name
    assert "5.19" in snap.not_obtained["peak"]
    fig = ray_figure(snap)
    assert fig.excluding_page_cache is None and fig.excluding_page_cache != 0
    assert "excluding_page_cache" in fig.not_obtained


def test_this_machine_real_files():
    snap = HostProbe().read()
    meminfo = Path("/proc/meminfo").read_text()
    total_kb = int(
        next(line.split()[1] for line in meminfo.splitlines() if line.startswith("MemTotal:"))
    )
    assert snap.mem_total == total_kb * KiB
    assert snap.current is not None and snap.current > 0
    if snap.source is CgroupVersion.V1:
        expect = int(Path(snap.cgroup_dir, "memory.usage_in_bytes").read_text())
        assert abs(snap.current - expect) < 512 * MiB
    elif snap.source is CgroupVersion.V2:
        assert (
            abs(snap.current - int(Path(snap.cgroup_dir, "memory.current").read_text())) < 512 * MiB
        )
    # Everything missing has a reason; nothing missing reads as 0 by accident.
    for name, value in snap.to_json().items():
        if value is None:
            assert name in snap.not_obtained or name == "cgroup_dir", name


def test_ray_figure_on_v2_uses_cgroup_and_computes_both_figures():
    snap = probe("cgroup_v2").read()
    fig = ray_figure(snap, RayConfig(threshold=0.95))
    assert fig.uses_cgroup  # 8 GiB limit < MemTotal
    assert fig.total == 8 * GiB
    assert fig.excluding_page_cache == 6 * GiB - (1 * GiB + 512 * MiB)
    assert fig.including_page_cache == 6 * GiB
    assert fig.threshold_bytes == int(8 * GiB * 0.95)
    assert (
        fig.reported is RayAccounting.EXCLUDES_PAGE_CACHE and fig.used == fig.excluding_page_cache
    )
    assert "file LRU" in fig.why
    old = ray_figure(snap, RayConfig(accounting=RayAccounting.INCLUDES_PAGE_CACHE))
    assert old.used == 6 * GiB and "page cache counted" in old.why
    free = ray_figure(snap, RayConfig(threshold=0.95, min_memory_free_bytes=256 * MiB))
    assert free.threshold_bytes == 8 * GiB - 256 * MiB  # max(total x thr, total - min_free)


def test_ray_figure_without_cgroup_limit_uses_meminfo():
    fig = ray_figure(probe("no_cgroup").read())
    assert not fig.uses_cgroup
    assert fig.excluding_page_cache == (32768000 - 20480000) * KiB
    assert fig.including_page_cache == (32768000 - 4096000) * KiB


def test_ray_config_from_env_and_validation():
    cfg = RayConfig.from_env(
        {"RAY_memory_usage_threshold": "0.9", "RAY_min_memory_free_bytes": "-1"}
    )
    assert cfg.threshold == 0.9 and cfg.min_memory_free_bytes is None
    assert RayConfig.from_env({}).threshold == 0.95
    with pytest.raises(ConfigError, match="RAY_memory_usage_threshold"):
        RayConfig.from_env({"RAY_memory_usage_threshold": "high"})
    with pytest.raises(ConfigError, match="threshold"):
        RayConfig(threshold=1.5)


def test_ray_kill_lines():
    lines = parse_ray_kill_lines((FIX / "ray_oom.log").read_text())
    assert [x.line_no for x in lines] == [1, 2, 3]
    assert lines[2].used_fraction == pytest.approx(0.958038) and lines[2].threshold == 0.95
    assert parse_ray_kill_lines("INFO worker started\nall good") == []


def test_process_snapshot_of_self_and_a_tree():
    me = read_process("self")
    assert me.pid == os.getpid() and me.pss and me.pss > 0 and me.threads >= 1 and me.fds >= 3
    assert me.pss_anon is not None  # Linux >= 5.3 here
    child = subprocess.Popen(
        [sys.executable, "-c", "import time,sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        tree = list_tree(os.getpid())
        assert tree[0] == os.getpid() and child.pid in tree
        snap = read_process(child.pid)
        assert snap.ppid == os.getpid() and snap.argv0.startswith("python")
    finally:
        child.stdin.close()
        child.wait()
    assert read_process(child.pid) is None  # gone: None, not a zero snapshot
    assert list_tree(child.pid) == []


def test_gpu_probe_never_touches_cuda_here():
    import torch

    snap = read_gpu()
    assert snap.allocated is None and snap.device_free is None
    reason = snap.not_obtained["allocated"]
    assert ("not available" in reason) or ("not initialized" in reason)
    if not torch.cuda.is_available():
        assert not torch.cuda.is_initialized()


@pytest.mark.parametrize(
    ("stats", "schema", "cached"),
    [
        (
            {
                "allocations.current": 3,
                "allocated_bytes.current": 4 * GiB,
                "active_bytes.current": 3 * GiB,
            },
            "new",
            GiB,
        ),
        (
            {
                "segment.current": 2,
                "reserved_bytes.current": 4 * GiB,
                "allocated_bytes.current": 3 * GiB,
            },
            "old",
            GiB,
        ),
    ],
)
def test_pinned_stats_both_schemas(stats, schema, cached):
    fig = pinned_figures(stats)
    assert fig["pinned_schema"] == schema
    assert fig["pinned_allocated"] == 4 * GiB and fig["pinned_cached"] == cached


def test_pinned_stats_unknown_schema_is_not_obtained():
    fig = pinned_figures({})
    assert fig["pinned_allocated"] is None and "pinned_allocated" in fig["not_obtained"]


def test_cuda_oom_message_parsed():
    msg = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB "
        "of which 1.25 GiB is free. Including non-PyTorch memory, this process has 138.54 GiB "
        "memory in use. Of the allocated memory 130.00 GiB is allocated by PyTorch, and 6.50 GiB "
        "is reserved by PyTorch but unallocated."
    )
    info = parse_cuda_oom(msg)
    assert info.requested == 2 * GiB and info.device == 0
    assert info.device_free == round(1.25 * GiB) and info.allocated == 130 * GiB
    assert info.reserved_unallocated == round(6.5 * GiB)
    assert parse_cuda_oom("ValueError: shapes differ") is None


def test_sampler_catches_a_spike_between_boundaries():
    value = {"v": 10}
    seen, reads = threading.Event(), []

    def read():
        if value["v"] == 99:
            reads.append(1)
            if len(reads) >= 2:  # the sampler folded the first read of the spike before this one
                seen.set()
        return value["v"]

    with Sampler({"x": read, "missing": lambda: None}, SamplerConfig(hz=200)) as s:
        token = s.open_window()
        value["v"] = 99  # a spike that is gone before the phase ends
        assert seen.wait(5.0)
        value["v"] = 20
        peak = s.close_window(token)
    assert peak.peaks["x"] == 99
    assert peak.peaks["missing"] is None  # never obtained stays None, not 0
    assert peak.samples >= 3


def test_sampler_rejects_slow_rates():
    with pytest.raises(ConfigError, match="hz"):
        SamplerConfig(hz=1.0)
