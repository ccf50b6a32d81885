"""The versions a step records (torch, ckptguard, Python) and the check of torch's before a read.

Kept apart from ``manifest`` (the records themselves, which need no torch) because these two read
torch's own version: the writers and ``restore`` import this; the operator commands that read
manifests (``ckptguard list``, ``gc``, ``resolve``) do not, and start without torch.
"""

from __future__ import annotations

import platform

import torch
from torch.torch_version import TorchVersion

from ..errors import VersionMismatchError
from .manifest import Manifest, ckptguard_version

__all__ = ["check_torch_version", "current_versions"]


def current_versions() -> dict[str, str]:
    return {
        "torch": torch.__version__,
        "ckptguard": ckptguard_version(),
        "python": platform.python_version(),
    }


def check_torch_version(manifest: Manifest, *, allow_newer: bool) -> None:
    """Refuse, before any read, a checkpoint written by a newer torch than ours."""
    written = manifest.versions.get("torch", "0")
    if allow_newer or TorchVersion(written.split("+")[0]) <= torch.__version__.split("+")[0]:
        return
    raise VersionMismatchError(
        f"{manifest.path.parent} was written by torch {written}; this process runs torch "
        f"{torch.__version__}. Newer torch can write formats an older one misreads (e.g. "
        "DTensor layouts). Restore with the image that wrote it, or pass "
        "CheckpointConfig(storage=StorageOptions(allow_newer_torch=True)) after checking it reads correctly."
    )
