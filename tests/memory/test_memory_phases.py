"""PhaseRecorder records, failure records, who-killed-it classification, and exact-size pinned
buffers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptguard.errors import ConfigError
from ckptguard.memory import (
    HostProbe,
    HostProbeConfig,
    Killer,
    PhaseKind,
    PhaseRecorder,
    PinnedMemoryUnavailableError,
    RecorderConfig,
    RecordFormatError,
    classify_failure,
    pinned_empty,
    pow2_ceil,
    read_records,
)
from ckptguard.memory.cli import mem

FIX = Path(__file__).parents[1] / "fixtures" / "memory"
GiB = 1 << 30
OOM = (
    "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 139.81 GiB of "
    "which 3.50 GiB is free. Process 77 has 136.30 GiB memory in use. Of the allocated memory "
    "120.00 GiB is allocated by PyTorch, and 12.00 GiB is reserved by PyTorch but unallocated."
)


class FakeOOM(RuntimeError):
    pass


def _allocate_kv_cache():
    raise FakeOOM(OOM)


def test_phase_records_have_every_field(tmp_path):
    path = tmp_path / "mem.jsonl"
    with PhaseRecorder(RecorderConfig(path=path, rank=3, node="n7")) as rec:
        with rec.phase(PhaseKind.LOAD, step=0):
            pass
        with rec.phase("generate", step=1, policy_version=5):
            with rec.phase(PhaseKind.WAKE, step=1, policy_version=5):
                keep = b"\x01" * (32 << 20)  # touched: raises the process RSS inside the phase
            del keep
    recs = read_records([path])
    assert [(r["kind"], r["phase"]) for r in recs] == [
        ("phase_start", "load"),
        ("phase_end", "load"),
        ("phase_start", "generate"),
        ("phase_start", "wake"),
        ("phase_end", "wake"),
        ("phase_end", "generate"),
    ]
    for r in recs:
        assert r["node"] == "n7" and r["rank"] == 3 and r["pid"] == os.getpid() and r["v"] == 1
        assert (
            r["host"]["mem_total"] > 0 and r["process"]["rss"] > 0 and r["process"]["rss_anon"] > 0
        )
        assert r["ray"]["threshold_bytes"] > 0
        assert r["gpu"]["allocated"] is None and "allocated" in r["gpu"]["not_obtained"]
    # PSS (a page-table walk) is read at the first boundary, then at most every pss_every_s.
    assert recs[0]["process"]["pss"] > 0
    assert (
        recs[1]["process"]["pss"] is None
        and "pss_every_s" in recs[1]["process"]["not_obtained"]["pss"]
    )
    wake_end = recs[4]
    assert wake_end["policy_version"] == 5 and wake_end["duration_s"] >= 0
    assert wake_end["peak"]["process_rss"] >= recs[3]["process"]["rss"] + (16 << 20)
    assert wake_end["peak"]["gpu_allocated"] is None
    # The nested phase's boundary readings count for the enclosing phase's peak as well.
    assert recs[5]["peak"]["process_rss"] >= wake_end["process"]["rss"]
    assert recs[5]["process"]["rss"] < wake_end["process"]["rss"] - (16 << 20)
    assert recs[0]["mono_ns"] < recs[1]["mono_ns"]


def test_pss_every_boundary_when_asked(tmp_path):
    with PhaseRecorder(RecorderConfig(path=tmp_path / "m.jsonl", pss_every_s=0)) as rec:
        for step in range(3):
            with rec.phase(PhaseKind.UPDATE, step=step):
                pass
    assert all(r["process"]["pss"] > 0 for r in read_records([tmp_path / "m.jsonl"]))


def test_failure_record_names_call_request_and_last_phase(tmp_path):
    path = tmp_path / "mem.jsonl"
    rec = PhaseRecorder(RecorderConfig(path=path))
    with rec.phase(PhaseKind.LOAD, step=10):
        pass
    with rec.phase(PhaseKind.UPDATE, step=10):
        pass
    with pytest.raises(FakeOOM), rec.phase(PhaseKind.WAKE, step=11):
        _allocate_kv_cache()
    rec.close()
    fail = read_records([path])[-1]
    assert fail["kind"] == "phase_failure" and fail["phase"] == "wake" and fail["step"] == 11
    assert "_allocate_kv_cache()" in fail["error"]["failing_call"]
    assert "in _allocate_kv_cache" in fail["error"]["raised_at"]
    assert fail["error"]["type"].endswith("FakeOOM")
    assert fail["requested_bytes"] == 20 * GiB
    assert fail["allocated"] == 120 * GiB  # from the message: the GPU probe had nothing here
    assert fail["device_free"] == round(3.5 * GiB)
    assert fail["reserved"] is None and "reserved" in fail["not_obtained"]
    assert fail["last_completed"]["phase"] == "update" and fail["last_completed"]["step"] == 10
    assert fail["load_peak"]["step"] == 10 and fail["load_peak"]["host_current"] > 0
    assert fail["host"]["mem_total"] > 0

    verdict = classify_failure(read_records([path]))
    assert verdict.killer is Killer.CUDA_OOM
    assert verdict.phase == "wake" and "20.00 GiB" in verdict.evidence[0]
    assert verdict.load_peak["step"] == 10


def test_failure_without_oom_has_no_requested_bytes(tmp_path):
    rec = PhaseRecorder(RecorderConfig(path=tmp_path / "m.jsonl"))
    with pytest.raises(KeyError), rec.phase(PhaseKind.EXPORT):
        {}["missing"]
    rec.close()
    fail = read_records([tmp_path / "m.jsonl"])[-1]
    assert (
        fail["requested_bytes"] is None
        and "not a CUDA OOM" in fail["not_obtained"]["requested_bytes"]
    )
    assert fail["last_completed"] is None and "last_completed" in fail["not_obtained"]
    assert classify_failure(read_records([tmp_path / "m.jsonl"])).killer is Killer.UNKNOWN


def test_unknown_phase_and_bad_config_are_refused(tmp_path):
    rec = PhaseRecorder(RecorderConfig(path=tmp_path / "m.jsonl"))
    with pytest.raises(ConfigError, match="unknown phase 'sav'"):
        rec.phase("sav")
    rec.close()
    with pytest.raises(ConfigError, match="hz"):
        RecorderConfig(path=tmp_path / "x", sample_hz=2)
    with pytest.raises(ConfigError, match="rank"):
        RecorderConfig(path=tmp_path / "x", rank=-1)


_CHILD = textwrap.dedent(
    """
    import importlib.util, sys, types
    from pathlib import Path
    spec = importlib.util.find_spec("ckptguard")
    pkg = types.ModuleType("ckptguard"); pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["ckptguard"] = pkg  # skip ckptguard/__init__ (torch): not needed here
    from ckptguard.memory import HostProbe, HostProbeConfig, PhaseRecorder, RecorderConfig
    tree, out, phase = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    probe = HostProbe(HostProbeConfig(proc_root=tree / "proc", cgroup_root=tree / "sys/fs/cgroup"))
    rec = PhaseRecorder(RecorderConfig(path=out, probe_gpu=False), host_probe=probe)
    with rec.phase(phase, step=60):
        if phase == "save":
            print("in", flush=True)
            sys.stdin.read()
    """
)


def test_cgroup_oom_kill_classified_from_the_records(tmp_path):
    shutil.copytree(FIX / "cgroup_v2", tmp_path / "tree")
    out = tmp_path / "mem.jsonl"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path / "tree"), str(out), "save"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert child.stdout.readline() == b"in\n"
    events = tmp_path / "tree/sys/fs/cgroup/job.slice/run1/memory.events"
    events.write_text(events.read_text().replace("oom_kill 1", "oom_kill 2"))
    child.send_signal(
        signal.SIGKILL
    )  # what the kernel's OOM killer does: no Python stack, no end record
    child.wait()
    # The resumed job's first record (its load phase) sees the raised counter.
    subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "tree"), str(out), "load"], check=True
    )
    recs = read_records([out])
    assert [r["kind"] for r in recs] == ["phase_start", "phase_start", "phase_end"]
    verdict = classify_failure(recs)
    assert verdict.killer is Killer.CGROUP_OOM
    assert verdict.phase == "save" and verdict.step == 60
    assert "oom_kill count rose 1 -> 2" in verdict.evidence[0]
    # With Ray's own log line as well, Ray is named first and the cgroup kill is kept as "also".
    both = classify_failure(recs, ray_log=(FIX / "ray_oom.log").read_text())
    assert both.killer is Killer.RAY and Killer.CGROUP_OOM in both.also
    r = CliRunner().invoke(mem, ["killer", "--json", str(out)])
    assert r.exit_code == 1 and json.loads(r.output)["killer"] == "cgroup_oom_kill"
    r = CliRunner().invoke(mem, ["killer", str(out), "--ray-log", str(FIX / "ray_oom.log")])
    assert "killer: ray_memory_monitor in phase 'save' (step 60)" in r.output


def _rec(kind, t, **kw):
    return {"v": 1, "kind": kind, "mono_ns": t, "node": "n", "pid": 1, **kw}


def test_ray_figure_over_threshold_is_a_ray_kill_and_a_clean_run_is_none():
    over = {
        "used": 480 * GiB,
        "threshold_bytes": 478 * GiB,
        "over_threshold": True,
        "reported": "excludes_page_cache",
    }
    recs = [_rec("phase_start", 1, phase="save", step=3, ray=over)]
    v = classify_failure(recs)
    assert v.killer is Killer.RAY and "480.00 GiB" in v.evidence[0] and v.phase == "save"
    clean = [_rec("phase_start", 1, phase="save"), _rec("phase_end", 2, phase="save")]
    assert classify_failure(clean).killer is Killer.NONE
    retry = [_rec("phase_end", 2, phase="update", gpu={"num_alloc_retries": 3})]
    assert "not a terminal OOM" in classify_failure(retry).notes[0]


def test_records_reader_tolerates_only_a_truncated_last_line(tmp_path):
    good = json.dumps(_rec("phase_start", 5, phase="save"))
    p = tmp_path / "a.jsonl"
    p.write_text(good + "\n" + good[:30])
    assert len(read_records([p])) == 1
    p.write_text(good[:30] + "\n" + good + "\n")
    with pytest.raises(RecordFormatError, match=r"a.jsonl:1"):
        read_records([p])
    p.write_text(json.dumps(_rec("phase_start", 5, v=9)) + "\n")
    with pytest.raises(RecordFormatError, match="newer"):
        read_records([p])


class FakeRegistrar:
    def __init__(self):
        self.calls = []
        self.buffer = None

    def register(self, ptr, nbytes):
        self.calls.append(("register", ptr, nbytes))

    def unregister(self, ptr):
        # The bytes must still be alive when the range is unregistered (pytorch PR #131270).
        assert self.buffer is not None and not self.buffer.closed
        self.calls.append(("unregister", ptr))


def test_pinned_empty_registers_exact_size_and_frees_deterministically():
    fake = FakeRegistrar()
    nbytes = int(1.1 * GiB) // 1024 + 13  # odd size: no rounding anywhere
    with pinned_empty(nbytes, registrar=fake) as buf:
        fake.buffer = buf
        assert buf.tensor.numel() == nbytes and buf.tensor.dtype == torch.uint8
        assert fake.calls == [("register", buf.tensor.data_ptr(), nbytes)]
        ptr = buf.tensor.data_ptr()
        assert buf.view(torch.uint8).data_ptr() == ptr
    assert fake.calls[-1] == ("unregister", ptr)
    assert buf.closed
    buf.close()  # idempotent
    assert len(fake.calls) == 2
    with pytest.raises(PinnedMemoryUnavailableError, match="closed"):
        buf.tensor  # noqa: B018


def test_pinned_empty_without_cuda_and_bad_sizes():
    with pytest.raises(ConfigError, match="nbytes"):
        pinned_empty(0)
    if not torch.cuda.is_available():
        with pytest.raises(PinnedMemoryUnavailableError, match="needs CUDA"):
            pinned_empty(4096)
        assert not torch.cuda.is_initialized()


def test_pow2_ceil_matches_the_caching_allocator():
    assert pow2_ceil(int(1.1 * GiB)) == 2 * GiB  # +82% for a 1.1 GiB request
    assert pow2_ceil(GiB) == GiB and pow2_ceil(GiB + 1) == 2 * GiB and pow2_ceil(1) == 1


def test_probe_config_validation():
    with pytest.raises(ConfigError, match="pid"):
        HostProbeConfig(pid=0)
    assert HostProbe(HostProbeConfig(pid=os.getpid())).read().mem_total > 0
