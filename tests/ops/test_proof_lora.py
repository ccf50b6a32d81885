"""LoRA merged twice is named with the tensors and the multiple of the delta: a 1-process job saves
at step 2 and exports the merged weights after every step (``record_export(...,
adapter=adapter_probe(...))``); a second process restores step 2 with the adapter's delta already
merged into the base (a model rebuilt from a merged export) and exports base + delta again.
``prove``'s "first export byte-identical" must FAIL saying the engine holds base + 2.00 x delta for
the targeted weight only, for a peft adapter and for one declared by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_hf_integration import HF_PYTHON, REPO, _env

import ckptguard as cg
from ckptguard.integrations.peft import PROBE_POINTS, adapter_probe
from ckptguard.ops.lora import merged_multiple
from ckptguard.ops.prove import Outcome, Status, evaluate, outcome

JOB = REPO / "tests" / "proof_lora_job.py"
PYTHON = {"peft": HF_PYTHON, "hand": Path(sys.executable)}  # peft is installed in .venv-hf only


def _launch(python: Path, root: Path, flavour: str, defect: bool) -> int:
    proc = subprocess.run(
        [str(python), str(JOB), str(root), flavour, "1" if defect else "0"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    return int(line.split()[1])


def _export_gate(tmp_path: Path, flavour: str, defect: bool):
    if not PYTHON[flavour].exists():
        pytest.skip(f"HF venv not found at {HF_PYTHON}: run `make hf-venv` (peft)")
    root = tmp_path / "ck"
    assert _launch(PYTHON[flavour], root, flavour, defect) == 0
    assert _launch(PYTHON[flavour], root, flavour, defect) == 2
    gates = evaluate(root)
    return next(g for g in gates if g.name == "first export byte-identical"), gates


@pytest.mark.parametrize("flavour,name", [("peft", "q.weight"), ("hand", "weight")])
def test_lora_merged_twice_is_named_with_the_tensor_and_the_multiple(tmp_path, flavour, name):
    gate, gates = _export_gate(tmp_path, flavour, True)
    assert gate.status is Status.FAIL and outcome(gates) is Outcome.DIVERGED, gate.evidence
    assert f"tensors ['{name}']" in gate.evidence, gate.evidence
    assert f"the engine holds base + 2.00 x delta for ['{name}']" in gate.evidence, gate.evidence
    assert "its base already held 1.00 x delta" in gate.evidence, gate.evidence
    assert "head.weight" not in gate.evidence and "v.weight" not in gate.evidence


def test_the_same_job_without_the_defect_passes_the_export_gate(tmp_path):
    gate, _gates = _export_gate(tmp_path, "hand", False)
    assert gate.status is Status.PASS, gate.evidence


def test_the_probe_is_small_and_the_engines_count_is_read_without_a_reference_probe():
    w, d = torch.randn(64, 64), torch.randn(64, 64) * 1e-2
    probe = adapter_probe({"w": w + d}, {"w": (w, d)})
    assert (
        set(probe["w"]) == {"base", "delta", "sent", "eps"}
        and len(probe["w"]["sent"]) == PROBE_POINTS
    )
    assert adapter_probe({"w": w + d}, {"w": (w, d)}) == probe  # the same entries in every run
    twice = {"adapter": adapter_probe({"w": w + 3 * d}, {"w": (w, d)})}
    assert "base + 3.00 x delta for ['w']" in merged_multiple({"adapter": probe}, twice)
    assert merged_multiple({"adapter": probe}, {"adapter": probe}) == ""
    # another delta (the adapter not restored) is named as such, never as a multiple of the
    # reference's
    other = {"adapter": adapter_probe({"w": w + d.flip(0)}, {"w": (w, d.flip(0))})}
    assert merged_multiple({"adapter": probe}, other) == (
        "; the adapter's delta differs from the reference run's at sampled entries of ['w'] (the "
        "adapter, or its scaling, not restored as saved)"
    )
    # values that are not base + k x delta (another base, the same delta) are no multiple either
    noise = {"adapter": adapter_probe({"w": w + d + torch.randn(64, 64)}, {"w": (w, d)})}
    assert "x delta" not in merged_multiple({"adapter": probe}, noise)
    # an engine's record (no exported values): base + count x delta; an older reference without a
    # probe
    assert "base + 2.00 x delta for ['w']" in merged_multiple({}, {"lora": {"w": 2.0, "u": 1.0}})
    # a damaged record never raises: lists too long or not numbers are not read
    assert (
        merged_multiple({"adapter": {"w": {"base": ["x"], "delta": [1.0], "eps": 0.0}}}, twice)
        == ""
    )
    with pytest.raises(cg.ConfigError, match="must map to"):
        adapter_probe({}, {"w": (w, d[:3])})
