"""``mem report --png``: the report's three charts as one PNG (needs matplotlib, an optional extra).

Contract: ``render_png(records, out)`` draws host memory stacked by anon / shmem / file without
shmem with phase bands and limit lines, per-process PSS floors with their verdict in the legend,
and GPU allocated / reserved (or a "not obtained" note). matplotlib is imported here only, with
the Agg backend, so the HTML report and the rest of the package never need it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .growth import analyze_growth

__all__ = ["render_png"]


def render_png(records: list[dict[str, Any]], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--png needs matplotlib: pip install 'ckptguard[report]' (or use --html)") from None
    t0 = records[0]["mono_ns"] / 1e9 if records else 0.0
    gib = float(1 << 30)
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 10), constrained_layout=True)
    hosts = [(r["mono_ns"] / 1e9 - t0, r["host"]) for r in records if (r.get("host") or {}).get("anon") is not None]
    if hosts:
        ts = [t for t, _ in hosts]
        anon = [h["anon"] / gib for _, h in hosts]
        shmem = [(h.get("shmem") or 0) / gib for _, h in hosts]
        file_ = [max(0, (h.get("file") or 0) - (h.get("shmem") or 0)) / gib for _, h in hosts]
        ax1.stackplot(ts, anon, shmem, file_, labels=["anon", "shmem", "file (no shmem)"], alpha=0.8)
    starts: dict[Any, float] = {}
    for r in records:
        key = (r.get("pid"), r.get("phase"))
        if r["kind"] == "phase_start":
            starts[key] = r["mono_ns"] / 1e9 - t0
        elif r["kind"] in ("phase_end", "phase_failure") and key in starts:
            ax1.axvspan(starts.pop(key), r["mono_ns"] / 1e9 - t0, color="grey", alpha=0.15)
    last = next((r for r in reversed(records) if r.get("host")), None)
    if last is not None:
        if last["host"].get("source") != "none" and last["host"].get("limit"):
            ax1.axhline(last["host"]["limit"] / gib, color="red", ls="--", label="memory.max")
        if (last.get("ray") or {}).get("threshold_bytes"):
            ax1.axhline(last["ray"]["threshold_bytes"] / gib, color="darkred", ls=":", label="Ray threshold")
    ax1.set(title="Host memory", xlabel="s", ylabel="GiB")
    ax1.legend(loc="upper left", fontsize=8)
    for p in analyze_growth(records).processes:
        if p.floors_per_interval:
            ax2.plot([t - t0 for t, _ in p.floors_per_interval], [v / gib for _, v in p.floors_per_interval],
                     label=f"{p.pid} {p.comm} ({'rising' if p.rising else 'flat'})")
    ax2.set(title="Per-process PSS floor", xlabel="s", ylabel="GiB")
    ax2.legend(loc="upper left", fontsize=8)
    gpu = [(r["mono_ns"] / 1e9 - t0, r["gpu"]) for r in records if (r.get("gpu") or {}).get("allocated") is not None]
    if gpu:
        ax3.plot([t for t, _ in gpu], [g["allocated"] / gib for _, g in gpu], label="allocated")
        ax3.plot([t for t, _ in gpu], [g["reserved"] / gib for _, g in gpu], label="reserved")
        ax3.legend(loc="upper left", fontsize=8)
    else:
        ax3.text(0.5, 0.5, "GPU figures not obtained", ha="center", va="center", transform=ax3.transAxes)
    ax3.set(title="GPU memory", xlabel="s", ylabel="GiB")
    fig.savefig(out, dpi=80)
    plt.close(fig)
