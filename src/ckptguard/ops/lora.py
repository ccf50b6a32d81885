"""What ``ckptguard prove`` shows of a LoRA step: the base model's identity and the adapter's digests.

Contract: ``lora_gate(restores)`` reads the step the newest restore loaded (its ``path``); when that step
was saved by ``integrations.peft.LoraCheckpoint``, it returns one line of evidence: the base folder, each
weights file's xxh3, the number of base tensors, the adapter's r / alpha / target modules and one digest
over the adapter's layout-free digests (what the restore compared). Otherwise None. Never raises on a
step it cannot read (the gates that restore it already say so).
"""

from __future__ import annotations

from pathlib import Path

import xxhash

from .._records import manifest as _manifest
from .._records.proofreader import ProofRecord
from ..errors import CheckpointError
from ..integrations.peft import ADAPTER_ITEM, read_binding

__all__ = ["lora_gate"]


def lora_gate(restores: list[ProofRecord]) -> str | None:
    paths = sorted({str(r["path"]) for r in restores if r.get("path")})
    if not paths:
        return None
    step_dir = Path(paths[-1])
    try:
        binding = read_binding(step_dir)
        table = (_manifest.read(step_dir).layout_free or {}).get(ADAPTER_ITEM, {})
    except (CheckpointError, OSError, RuntimeError, ValueError):
        return None
    if binding is None:
        return None
    base, config = binding["base"], binding["adapter_config"]
    files = ", ".join(f"{name} {entry[1]}" for name, entry in sorted(base["files"].items()))
    adapter = xxhash.xxh3_64("|".join(f"{k}={v}" for k, v in sorted(table.items())).encode()).hexdigest()
    return (f"step {step_dir.name}: base {base['dir']} ({files}; {len(base['tensors'])} tensors); adapter "
            f"r={config.get('r')} alpha={config.get('lora_alpha')} targets {config.get('target_modules')}, "
            f"{len(table)} tensors, digest {adapter}")
