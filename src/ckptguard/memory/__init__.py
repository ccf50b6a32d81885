"""ckptguard.memory: the Memory contract (what is alive together in each phase, the peak, and who
kills us).

Public surface::

    HostProbe(HostProbeConfig(...)).read() -> HostSnapshot      cgroup v2 / v1 / meminfo
    ray_figure(snapshot, RayConfig.from_env()) -> RayFigure      Ray's usage figure, both ways
    read_process(pid) -> ProcessSnapshot                        PSS, threads, FDs
    read_gpu() -> GpuSnapshot                                   allocator + pinned host stats
    PhaseRecorder(RecorderConfig(path=...)).phase(PhaseKind.SAVE, step=...)
    watch(cmd, WatchConfig(out=...)) -> exit status
    analyze_growth(records) -> GrowthReport                     floors, Theil-Sen slope, rising
    compute_plan(PlanInputs) -> Plan                            save-step peak vs the limit
    estimate_dir(path) -> Estimate                              dtype bytes from safetensors headers
    classify_failure(records, ray_log=...) -> KillVerdict       cgroup OOM / Ray / CUDA OOM
    parse_vllm_log(text), check_recipe(recipe)                  GPU colocation
    render_html(records) -> str                                 the one-page report
    pinned_empty(nbytes) -> PinnedBuffer                        exact-size pinned host memory
    host_budget(snapshot, ray) -> HostBudget                    bytes a save may stage
                                                                (limit x Ray threshold)

The CLI group ``mem`` lives in ``ckptguard.memory.cli``. Every figure is bytes as int, per
process, per cgroup or per device as named; an unreadable source is None with a reason.
"""

import importlib as _importlib
import typing as _typing

if (
    _typing.TYPE_CHECKING
):  # the names, for type checkers and the import graph; bound on first use below
    from .budget import HostBudget, host_budget
    from .colocation import Finding, VllmLogSummary, check_recipe, parse_vllm_log
    from .estimate import Estimate, estimate_dir, read_safetensors_header
    from .gpu import CudaOomInfo, GpuSnapshot, parse_cuda_oom, pinned_figures, read_gpu
    from .growth import GrowthConfig, GrowthReport, ProcessGrowth, analyze_growth, theil_sen
    from .host import CgroupVersion, HostProbe, HostProbeConfig, HostSnapshot
    from .killer import Killer, KillVerdict, classify_failure
    from .phases import PhaseKind, PhaseRecorder, RecorderConfig
    from .pinned import PinnedBuffer, PinnedMemoryUnavailableError, pinned_empty, pow2_ceil
    from .plan import (
        Plan,
        PlanInputs,
        PlanTerm,
        Verdict,
        compute_plan,
        load_plan_toml,
        plan_from_records,
    )
    from .process import ProcessSnapshot, list_tree, read_process
    from .ray import RayAccounting, RayConfig, RayFigure, parse_ray_kill_lines, ray_figure
    from .records import RecordFormatError, RecordKind, read_records
    from .report import render_html
    from .sampler import Sampler, SamplerConfig
    from .watch import WatchConfig, watch

# Each name is imported on first use (PEP 562): ``ckptguard status`` reads phase records
# (``records``) and must not pay for numpy (``growth``) or the report.
_WHERE = {
    "CgroupVersion": ".host",
    "CudaOomInfo": ".gpu",
    "Estimate": ".estimate",
    "Finding": ".colocation",
    "GpuSnapshot": ".gpu",
    "GrowthConfig": ".growth",
    "GrowthReport": ".growth",
    "HostBudget": ".budget",
    "HostProbe": ".host",
    "HostProbeConfig": ".host",
    "HostSnapshot": ".host",
    "KillVerdict": ".killer",
    "Killer": ".killer",
    "PhaseKind": ".phases",
    "PhaseRecorder": ".phases",
    "PinnedBuffer": ".pinned",
    "PinnedMemoryUnavailableError": ".pinned",
    "Plan": ".plan",
    "PlanInputs": ".plan",
    "PlanTerm": ".plan",
    "ProcessGrowth": ".growth",
    "ProcessSnapshot": ".process",
    "RayAccounting": ".ray",
    "RayConfig": ".ray",
    "RayFigure": ".ray",
    "RecordFormatError": ".records",
    "RecordKind": ".records",
    "RecorderConfig": ".phases",
    "Sampler": ".sampler",
    "SamplerConfig": ".sampler",
    "Verdict": ".plan",
    "VllmLogSummary": ".colocation",
    "WatchConfig": ".watch",
    "analyze_growth": ".growth",
    "check_recipe": ".colocation",
    "classify_failure": ".killer",
    "compute_plan": ".plan",
    "estimate_dir": ".estimate",
    "host_budget": ".budget",
    "list_tree": ".process",
    "load_plan_toml": ".plan",
    "parse_cuda_oom": ".gpu",
    "parse_ray_kill_lines": ".ray",
    "parse_vllm_log": ".colocation",
    "pinned_empty": ".pinned",
    "pinned_figures": ".gpu",
    "plan_from_records": ".plan",
    "pow2_ceil": ".pinned",
    "ray_figure": ".ray",
    "read_gpu": ".gpu",
    "read_process": ".process",
    "read_records": ".records",
    "read_safetensors_header": ".estimate",
    "render_html": ".report",
    "theil_sen": ".growth",
    "watch": ".watch",
}


def __getattr__(name: str) -> _typing.Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(_WHERE[name], __name__), name)  # lazy: PEP 562
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "CgroupVersion",
    "CudaOomInfo",
    "Estimate",
    "Finding",
    "GpuSnapshot",
    "GrowthConfig",
    "GrowthReport",
    "HostBudget",
    "HostProbe",
    "HostProbeConfig",
    "HostSnapshot",
    "KillVerdict",
    "Killer",
    "PhaseKind",
    "PhaseRecorder",
    "PinnedBuffer",
    "PinnedMemoryUnavailableError",
    "Plan",
    "PlanInputs",
    "PlanTerm",
    "ProcessGrowth",
    "ProcessSnapshot",
    "RayAccounting",
    "RayConfig",
    "RayFigure",
    "RecordFormatError",
    "RecordKind",
    "RecorderConfig",
    "Sampler",
    "SamplerConfig",
    "Verdict",
    "VllmLogSummary",
    "WatchConfig",
    "analyze_growth",
    "check_recipe",
    "classify_failure",
    "compute_plan",
    "estimate_dir",
    "host_budget",
    "list_tree",
    "load_plan_toml",
    "parse_cuda_oom",
    "parse_ray_kill_lines",
    "parse_vllm_log",
    "pinned_empty",
    "pinned_figures",
    "plan_from_records",
    "pow2_ceil",
    "ray_figure",
    "read_gpu",
    "read_process",
    "read_records",
    "read_safetensors_header",
    "render_html",
    "theil_sen",
    "watch",
]
