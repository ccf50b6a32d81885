"""Parsers of what a root holds refuse what ckptguard never writes: a tracker of "+3" or "0_3"
(Python's ``int`` takes both), and, in the restricted unpicklers, a refused ``torch.X`` global is
refused before anything is imported for it (``getattr(torch, X)`` imports torch's lazy submodules
first).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import ckptguard as cg
from ckptguard._disk import layout as _layout


@pytest.mark.parametrize("text", ["+3", "0_3", " 3 3", "3.0", "-0", "\u0663"])
def test_the_tracker_parser_refuses_what_ckptguard_never_writes(tmp_path, text):
    (tmp_path / _layout.TRACKER_NAME).write_bytes(text.encode())
    with pytest.raises(cg.CheckpointCorruptError, match="not a step number"):
        _layout.read_tracker(tmp_path)


def test_the_tracker_parser_reads_what_ckptguard_and_megatron_write(tmp_path):
    for text, step in (("3\n", 3), ("120", 120), ("0\n", 0)):
        (tmp_path / _layout.TRACKER_NAME).write_text(text)
        assert _layout.read_tracker(tmp_path) == step


_PROBE = r"""
import io, pickle, sys
import torch
from ckptguard.storage import unpickler
from ckptguard.storage import _format
lazy = [m for m in ("onnx", "_dynamo", "export", "_inductor") if f"torch.{m}" not in sys.modules]
assert lazy, "every lazy torch module is imported already"
name = lazy[0]
data = b"\x80\x02ctorch\n" + name.encode() + b"\nq\x00."
refused = []
for who in (
    lambda f: unpickler.SafeMetadataUnpickler(f),
    lambda f: _format._DescriptorUnpickler(f),
):
    try:
        who(io.BytesIO(data)).load()
    except Exception as exc:
        refused.append(type(exc).__name__)
print(name, f"torch.{name}" in sys.modules, refused)
"""


def test_a_refused_torch_global_is_refused_before_it_is_imported():
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    name, imported, refused = out.stdout.split(" ", 2)
    assert imported == "False", f"refusing torch.{name} imported it first"
    assert "UnpicklingError" in refused and "UnsafeCheckpointError" in refused, refused
