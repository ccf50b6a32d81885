"""The benchmark scripts' CPU-safe parts: the GPU script skips cleanly without CUDA, its helpers
measure."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GPU_SCRIPT = ROOT / "benchmarks" / "memory" / "gpu_memory.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_memory", GPU_SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_script_skips_cleanly_without_cuda(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, str(GPU_SCRIPT)], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "gpu_memory.json").read_text())
    assert result["skipped"] == "CUDA is not available on this machine"
    assert not (tmp_path / "phases_oom.jsonl").exists()


def test_gpu_script_footprint_helpers_measure_a_real_allocation():
    mod = _load()
    before = mod.status_bytes()
    assert {"VmRSS", "RssAnon", "RssShmem", "node_Shmem"} <= set(before)
    buf = b"\x01" * (64 << 20)
    d = mod.delta(before, mod.status_bytes())
    assert 0.95 <= mod.footprint_ratio(d, 64 << 20) <= 1.10
    del buf


def test_gpu_script_needs_an_output_dir():
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    r = subprocess.run(
        [sys.executable, str(GPU_SCRIPT)], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and "--out" in r.stderr


def test_gpu_script_imports_the_memory_package_without_the_checkpoint_deps(tmp_path):
    code = (
        f"import runpy, sys; sys.path.insert(0, {str(ROOT / 'src')!r}); "
        f"m = runpy.run_path({str(GPU_SCRIPT)!r}); mem = m['_import_memory'](); "
        "assert 'ckptguard.manager' not in sys.modules; print(mem.pow2_ceil(3))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "4", r.stderr
