"""What ``record_export`` and ``record_logprobs`` compute for a proof record: an export's
fingerprint (its bytes' digest, its scales', each tensor's by name) and the trainer-against-rollout
logprob comparison."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

import torch

from .._disk.digest import digest
from ..errors import ConfigError


class _Fingerprint(TypedDict):
    bytes: str  # digest of the exported payload (of its tensors' digests, for a mapping of tensors)
    scales: str  # digest of the quantization scales sent with it, "none" without


class ExportFingerprint(_Fingerprint, total=False):
    """What ``record_export`` records and returns: ``tensors`` only for a payload that maps names to
    tensors."""

    tensors: dict[str, str]  # each tensor's digest, by name


def export_fingerprint(payload: Any, scales: Any = None) -> ExportFingerprint:
    """Digests of exported bytes and of the quantization scales that go with them. A payload that is
    a mapping of tensors also keeps each tensor's digest (``tensors``), so ``prove`` names the
    tensors a first export after a restore differs in; its ``bytes`` is then the digest of those
    digests (each tensor read once)."""
    tensors = _tensor_digests(payload)
    whole = digest(sorted(tensors.items())) if tensors is not None else digest(payload)
    out = ExportFingerprint(bytes=whole, scales=digest(scales) if scales is not None else "none")
    if tensors is not None:
        out["tensors"] = tensors
    return out


def _tensor_digests(payload: Any) -> dict[str, str] | None:
    if not isinstance(payload, Mapping) or not payload:
        return None
    if not all(isinstance(v, torch.Tensor) for v in payload.values()):
        return None
    return {str(name): digest(t) for name, t in payload.items()}


def logprob_diff(trainer: torch.Tensor, rollout: torch.Tensor) -> dict[str, float]:
    """Max absolute difference of logprobs and of probabilities (probs_diff)."""
    a, b = trainer.detach().double().cpu(), rollout.detach().double().cpu()
    if a.shape != b.shape:
        raise ConfigError(
            f"record_logprobs: shapes differ, trainer {tuple(a.shape)} vs rollout {tuple(b.shape)}"
        )
    return {
        "max_abs_logprob_diff": float((a - b).abs().max()) if a.numel() else 0.0,
        "probs_diff": float((a.exp() - b.exp()).abs().max()) if a.numel() else 0.0,
        "tokens": int(a.numel()),
    }
