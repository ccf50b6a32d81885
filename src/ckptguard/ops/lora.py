"""What ``ckptguard prove`` shows of a LoRA step: the base model's identity and the adapter's
digests.

Contract: ``lora_gate(restores)`` reads the step the newest restore loaded (its ``path``); when that
step was saved by ``integrations.peft.LoraCheckpoint``, it returns one line of evidence: the base
folder, each weights file's xxh3, the number of base tensors, the adapter's r / alpha / target
modules and one digest over the adapter's layout-free digests (what the restore compared). Otherwise
None. Never raises on a step it cannot read (the gates that restore it already say so).

``merged_multiple(ref, first)``: for a first export after a restore that differs from the reference
run's, how many times the adapter's delta its LoRA-targeted weights hold, measured against the
reference run's base and delta (``integrations.peft.adapter_probe``'s sampled entries, or an
engine's delta count): the cause text ``the engine holds base + 2.00 x delta for [...]``, or ""
where nothing says a multiple.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from .._records import manifest as _manifest
from .._records.proofreader import ProofRecord
from ..errors import CheckpointError
from ..integrations.peft import ADAPTER_ITEM, PROBE_POINTS, read_binding

__all__ = ["lora_gate", "merged_multiple"]


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
    adapter = xxhash.xxh3_64(
        "|".join(f"{k}={v}" for k, v in sorted(table.items())).encode()
    ).hexdigest()
    return (
        f"step {step_dir.name}: base {base['dir']} ({files}; {len(base['tensors'])} tensors); "
        f"adapter r={config.get('r')} alpha={config.get('lora_alpha')} targets "
        f"{config.get('target_modules')}, {len(table)} tensors, digest {adapter}"
    )


def _floats(values: Any) -> list[float] | None:
    """A probe's list as read from a record file: at most PROBE_POINTS numbers, else None (never
    trusted)."""
    if not isinstance(values, list) or not 0 < len(values) <= PROBE_POINTS:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None  # a None stands for a NaN or inf entry: no multiple is read through it
    return [float(v) for v in values]


def _entry(probe: Any, name: str) -> tuple[list[float], list[float], float] | None:
    entry = probe.get(name) if isinstance(probe, Mapping) else None
    if not isinstance(entry, Mapping):
        return None
    base, delta, eps = _floats(entry.get("base")), _floats(entry.get("delta")), entry.get("eps")
    if (
        base is None
        or delta is None
        or len(base) != len(delta)
        or not isinstance(eps, (int, float))
    ):
        return None
    return base, delta, float(eps)


def _held(probe: Any, name: str, count: Any) -> list[float] | None:
    """What the weight held at the sampled entries: the exported values, else base + count x delta
    (an engine's count measured in its worker against this run's base)."""
    entry, own = probe.get(name) if isinstance(probe, Mapping) else None, _entry(probe, name)
    sent = _floats(entry.get("sent")) if isinstance(entry, Mapping) else None
    if sent is not None:
        return sent
    if own is None or not isinstance(count, (int, float)) or isinstance(count, bool):
        return None
    return [b + float(count) * d for b, d in zip(own[0], own[1], strict=True)]


def _fit(
    values: list[float], base: list[float], delta: list[float], eps: float
) -> tuple[float, float] | None:
    """The least-squares k of values = base + k x delta, and the bound on k that the weights'
    rounding leaves."""
    den = sum(d * d for d in delta)
    if den == 0.0 or len(values) != len(base):  # an untrained LoRA B: no multiple is observable
        return None
    k = sum((v - b) * d for v, b, d in zip(values, base, delta, strict=True)) / den
    bound = (
        sum(eps * (abs(v) + abs(b)) * abs(d) for v, b, d in zip(values, base, delta, strict=True))
        / den
    )
    return k, bound


def _close(a: list[float], b: list[float], eps: float) -> bool:
    """Equal within a few roundings of ``eps`` (the same adapter gives the same sampled entries)."""
    return len(a) == len(b) and all(
        abs(x - y) <= 4 * eps * max(abs(x), abs(y)) for x, y in zip(a, b, strict=True)
    )


def _is_multiple(
    values: list[float], base: list[float], delta: list[float], eps: float, k: float
) -> bool:
    """Whether ``values`` are ``base + k x delta`` at every entry, within the roundings of both
    sides: values of another form (another adapter, another base) are no multiple of the delta,
    whatever k the fit gives."""
    return all(
        abs(v - b - k * d) <= 4 * eps * (abs(v) + abs(b)) + 1e-3 * abs(k * d)
        for v, b, d in zip(values, base, delta, strict=True)
    )


def _multiples(
    ref: Mapping[str, Any], first: Mapping[str, Any], other_delta: list[str] | None = None
) -> list[tuple[str, float, float | None]]:
    """``[(weight, k, base shift)]`` of the weights whose held multiple of the delta is not 1; the
    weights whose own delta differs from the reference's go to ``other_delta`` (no multiple of the
    reference's delta)."""
    ref_probe, probe, counts = ref.get("adapter"), first.get("adapter"), first.get("lora")
    names = sorted(set(probe) if isinstance(probe, Mapping) else set())
    found: list[tuple[str, float, float | None]] = []
    for name in names:
        held = _held(probe, name, counts.get(name) if isinstance(counts, Mapping) else None)
        against = _entry(ref_probe, name)
        own = _entry(probe, name)
        if held is None or against is None:
            continue
        if own is not None and not _close(own[1], against[1], against[2]):
            if other_delta is not None:
                other_delta.append(name)
            continue
        fit = _fit(held, *against)
        if (
            fit is None
            or abs(fit[0] - 1.0) <= max(fit[1], 5e-3)
            or not _is_multiple(held, *against, fit[0])
        ):
            continue
        shift = _fit(own[0], against[0], against[1], against[2]) if own is not None else None
        found.append(
            (name, fit[0], shift[0] if shift and abs(shift[0]) > max(shift[1], 5e-3) else None)
        )
    if not found and isinstance(counts, Mapping) and not isinstance(ref_probe, Mapping):
        # no reference probe (an older record): the engine's own count, against the resumed run's
        # base
        found = [
            (str(n), float(c), None)
            for n, c in sorted(counts.items())
            if isinstance(c, (int, float)) and not isinstance(c, bool) and c != 1.0
        ]
    return found


def merged_multiple(ref: Mapping[str, Any], first: Mapping[str, Any]) -> str:
    """The cause text of a first export whose LoRA delta is held other than once (see the module
    doc), or ""."""
    other: list[str] = []
    found = _multiples(ref, first, other)
    more = " ..." if len(other) > 6 else ""
    delta = (
        f"; the adapter's delta differs from the reference run's at sampled entries of "
        f"{other[:6]}{more} (the adapter, or its scaling, not restored as saved)"
        if other
        else ""
    )
    if not found:
        return delta
    groups: dict[str, list[str]] = {}
    for name, k, _shift in found:
        groups.setdefault(f"{k:.2f}", []).append(name)
    held = "; ".join(
        f"base + {k} x delta for {names[:6]}{' ...' if len(names) > 6 else ''}"
        for k, names in sorted(groups.items())
    )
    shifted = sorted({f"{s:.2f}" for _n, _k, s in found if s is not None})
    why = (
        f" (its base already held {' / '.join(shifted)} x delta before the merge for the push: an "
        f"adapter merged into the base weights, e.g. a model rebuilt from a merged export)"
        if shifted
        else ""
    )
    return (
        f"; LoRA delta merged other than once: the engine holds {held}, against the reference "
        f"run's base and delta at sampled entries{why}{delta}"
    )
