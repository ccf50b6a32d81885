"""Node and cgroup memory probe: cgroup v2, then v1, then /proc/meminfo.

Contract: ``HostProbe.read()`` returns a ``HostSnapshot`` whose byte figures are ints or ``None``;
every ``None`` has a reason in ``not_obtained``. The cgroup is the one the given process
(default: this one) belongs to, found through ``/proc/<pid>/cgroup``, so a probe inside a
container reads the container's limit, not the host's. Figures are per cgroup (or per node
without a cgroup), never per process.

Field meanings (same names whatever the source):
    current        bytes charged now, page cache included (v2 memory.current, v1 usage_in_bytes,
                   no cgroup: MemTotal - MemFree)
    peak           high-water mark (v2 memory.peak, 5.19+; v1 max_usage_in_bytes)
    limit          effective limit: the lowest memory.max on the path up (v2), the hierarchical
                   limit (v1); None when unlimited. Without a cgroup: MemTotal.
    anon/file/shmem, active_file/inactive_file from memory.stat (v2: shmem is inside file)
    reclaimable    active_file + inactive_file: the page cache the kernel can drop. Not ``file``:
                   that would also drop shmem, where pinned CUDA host memory and plasma live.
    oom/oom_kill   event counters (v2 memory.events; v1 oom_control has oom_kill only;
                   no cgroup: /proc/vmstat oom_kill, node-wide)
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ._files import read_int, read_keyed, read_text

__all__ = ["CgroupVersion", "HostProbe", "HostProbeConfig", "HostSnapshot"]

_BYTE_FIELDS = (
    "current",
    "peak",
    "limit",
    "anon",
    "file",
    "shmem",
    "active_file",
    "inactive_file",
    "mem_total",
    "mem_available",
    "mem_free",
)


class CgroupVersion(Enum):
    """Which source the host figures came from."""

    V2 = "v2"
    V1 = "v1"
    NONE = "none"


@dataclass(frozen=True, kw_only=True)
class HostProbeConfig:
    """Where to read from; the defaults are the live system."""

    proc_root: Path = Path("/proc")
    """Mount point of procfs (a fixture tree in tests)."""
    cgroup_root: Path = Path("/sys/fs/cgroup")
    """Mount point of the cgroup hierarchy (v2 unified, or the v1 tmpfs holding ``memory/``)."""
    pid: int | str = "self"
    """Whose cgroup to read: a PID, or "self"."""

    def __post_init__(self) -> None:
        if isinstance(self.pid, int) and self.pid <= 0:
            raise ConfigError(
                f"HostProbeConfig.pid must be a positive PID or 'self', got {self.pid}"
            )
        if isinstance(self.pid, str) and self.pid != "self":
            raise ConfigError(f"HostProbeConfig.pid must be an int or 'self', got {self.pid!r}")


@dataclass(frozen=True, kw_only=True)
class HostSnapshot:
    """Host memory figures at one instant, in bytes; None means not obtained (see
    ``not_obtained``)."""

    source: CgroupVersion
    cgroup_dir: str | None = None
    current: int | None = None
    peak: int | None = None
    limit: int | None = None
    anon: int | None = None
    file: int | None = None
    shmem: int | None = None
    active_file: int | None = None
    inactive_file: int | None = None
    oom: int | None = None
    oom_kill: int | None = None
    mem_total: int | None = None
    mem_available: int | None = None
    mem_free: int | None = None
    not_obtained: dict[str, str] = field(default_factory=dict)

    @property
    def reclaimable(self) -> int | None:
        if self.active_file is None or self.inactive_file is None:
            return None
        return self.active_file + self.inactive_file

    @property
    def budget_total(self) -> int | None:
        """The figure a limit applies to: the cgroup limit, else MemTotal."""
        return self.limit if self.limit is not None else self.mem_total

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["source"] = self.source.value
        out["reclaimable"] = self.reclaimable
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HostSnapshot:
        kwargs = {k: data.get(k) for k in (*_BYTE_FIELDS, "oom", "oom_kill", "cgroup_dir")}
        return cls(
            source=CgroupVersion(data.get("source", "none")),
            not_obtained=dict(data.get("not_obtained") or {}),
            **kwargs,
        )


class HostProbe:
    """Reads a ``HostSnapshot``; the cgroup directory is located once, at construction."""

    def __init__(self, config: HostProbeConfig | None = None) -> None:
        self.config = config or HostProbeConfig()
        self.version, self.cgroup_dir, self._locate_reason = _locate(self.config)

    def read(self) -> HostSnapshot:
        missing: dict[str, str] = {}
        values: dict[str, int | None] = {}
        meminfo, why = read_keyed(self.config.proc_root / "meminfo", unit_kib=True)
        if meminfo is None:
            meminfo = {}
            missing["meminfo"] = why or "unreadable"
        values["mem_total"] = meminfo.get("MemTotal")
        values["mem_available"] = meminfo.get("MemAvailable")
        values["mem_free"] = meminfo.get("MemFree")
        if self.version is CgroupVersion.V2:
            assert self.cgroup_dir is not None
            _read_v2(self.cgroup_dir, self.config.cgroup_root, values, missing)
        elif self.version is CgroupVersion.V1:
            assert self.cgroup_dir is not None
            _read_v1(self.cgroup_dir, values, missing)
        else:
            _read_meminfo(meminfo, self.config.proc_root, values, missing)
            missing.setdefault("cgroup", self._locate_reason or "no cgroup memory controller found")
        for name in (*_BYTE_FIELDS, "oom", "oom_kill"):
            if values.get(name) is None and name not in missing:
                missing[name] = "not reported by this source"
        return HostSnapshot(
            source=self.version,
            cgroup_dir=str(self.cgroup_dir) if self.cgroup_dir else None,
            not_obtained=missing,
            **values,
        )

    def read_current(self) -> int | None:
        """The one figure the sampler polls: cheaper than a full ``read()``."""
        if self.version is CgroupVersion.V2:
            return read_int(self.cgroup_dir / "memory.current")[0]  # type: ignore[operator]
        if self.version is CgroupVersion.V1:
            return read_int(self.cgroup_dir / "memory.usage_in_bytes")[0]  # type: ignore[operator]
        meminfo, _ = read_keyed(self.config.proc_root / "meminfo", unit_kib=True)
        if not meminfo or "MemTotal" not in meminfo or "MemFree" not in meminfo:
            return None
        return meminfo["MemTotal"] - meminfo["MemFree"]


def _locate(config: HostProbeConfig) -> tuple[CgroupVersion, Path | None, str | None]:
    text, why = read_text(config.proc_root / str(config.pid) / "cgroup")
    if text is None:
        return CgroupVersion.NONE, None, why
    v2_path: str | None = None
    v1_path: str | None = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    root = config.cgroup_root
    # A cgroup namespace shows "/" although the mount root is the container's own cgroup,
    # so the mount root itself is the fallback candidate in both versions.
    if v2_path is not None:
        for cand in (root / v2_path.lstrip("/"), root):
            if (cand / "memory.current").is_file():
                return CgroupVersion.V2, cand, None
    if v1_path is not None:
        for cand in (root / "memory" / v1_path.lstrip("/"), root / "memory"):
            if (cand / "memory.usage_in_bytes").is_file():
                return CgroupVersion.V1, cand, None
    return CgroupVersion.NONE, None, f"no memory controller files for this process under {root}"


def _read_v2(cg: Path, root: Path, values: dict[str, int | None], missing: dict[str, str]) -> None:
    for name, fname in (("current", "memory.current"), ("peak", "memory.peak")):
        values[name], why = read_int(cg / fname)
        if why:
            missing[name] = why + (" (memory.peak needs Linux 5.19+)" if name == "peak" else "")
    values["limit"], missing_limit = _v2_limit(cg, root)
    if missing_limit:
        missing["limit"] = missing_limit
    stat, why = read_keyed(cg / "memory.stat")
    if stat is None:
        missing["memory.stat"] = why or "unreadable"
    else:
        for name in ("anon", "file", "shmem", "active_file", "inactive_file"):
            values[name] = stat.get(name)
    events, why = read_keyed(cg / "memory.events")
    if events is None:
        missing["memory.events"] = why or "unreadable"
    else:
        values["oom"] = events.get("oom")
        values["oom_kill"] = events.get("oom_kill")


def _v2_limit(cg: Path, root: Path) -> tuple[int | None, str | None]:
    # A parent's memory.max binds a child whose own file says "max": walk up to the mount root.
    limits: list[int] = []
    node = cg
    while True:
        value, _ = read_int(node / "memory.max")
        if value is not None:
            limits.append(value)
        if node == root or root not in node.parents:
            break
        node = node.parent
    if limits:
        return min(limits), None
    return None, f"memory.max is 'max' from {cg} up to {root} (no limit set)"


def _read_v1(cg: Path, values: dict[str, int | None], missing: dict[str, str]) -> None:
    values["current"], why = read_int(cg / "memory.usage_in_bytes")
    if why:
        missing["current"] = why
    values["peak"], why = read_int(cg / "memory.max_usage_in_bytes")
    if why:
        missing["peak"] = why
    stat, why = read_keyed(cg / "memory.stat")
    if stat is None:
        missing["memory.stat"] = why or "unreadable"
        stat = {}
    limit, why = read_int(cg / "memory.limit_in_bytes")
    hier = stat.get("hierarchical_memory_limit")
    # The leaf is often unlimited while a parent is not; the kernel reports the binding one here.
    if hier is not None and hier < (limit if limit is not None else 1 << 62):
        limit = hier
    values["limit"] = limit
    if limit is None:
        missing["limit"] = (
            why or "memory.limit_in_bytes and hierarchical_memory_limit are unlimited"
        )
    # total_* are hierarchical (this cgroup and its children), matching usage_in_bytes.
    for name, key in (
        ("anon", "rss"),
        ("file", "cache"),
        ("shmem", "shmem"),
        ("active_file", "active_file"),
        ("inactive_file", "inactive_file"),
    ):
        values[name] = stat.get("total_" + key, stat.get(key))
    if values["shmem"] is None:
        missing["shmem"] = "this kernel's v1 memory.stat prints no shmem line"
    oom, why = read_keyed(cg / "memory.oom_control")
    values["oom_kill"] = oom.get("oom_kill") if oom else None
    if values["oom_kill"] is None:
        missing["oom_kill"] = why or "memory.oom_control has no oom_kill line (Linux < 4.13)"
    missing["oom"] = "cgroup v1 counts no oom events (failcnt counts limit hits, not OOMs)"


def _read_meminfo(
    meminfo: dict[str, int], proc_root: Path, values: dict[str, int | None], missing: dict[str, str]
) -> None:
    total, free = meminfo.get("MemTotal"), meminfo.get("MemFree")
    values["current"] = total - free if total is not None and free is not None else None
    values["limit"] = total
    values["anon"] = meminfo.get("AnonPages")
    cached, buffers = meminfo.get("Cached"), meminfo.get("Buffers")
    # meminfo's Cached includes tmpfs and shmem, like v2's "file": the same meaning either way.
    values["file"] = cached + (buffers or 0) if cached is not None else None
    values["shmem"] = meminfo.get("Shmem")
    values["active_file"] = meminfo.get("Active(file)")
    values["inactive_file"] = meminfo.get("Inactive(file)")
    missing["peak"] = (
        "no cgroup: the kernel keeps no node-wide high-water mark (the sampler's peak is recorded)"
    )
    missing["oom"] = "no cgroup: no oom event counter"
    vmstat, why = read_keyed(proc_root / "vmstat")
    values["oom_kill"] = vmstat.get("oom_kill") if vmstat else None
    if values["oom_kill"] is None:
        missing["oom_kill"] = why or "/proc/vmstat has no oom_kill line"


def hostname() -> str:
    """The node name used in records."""
    return os.uname().nodename
