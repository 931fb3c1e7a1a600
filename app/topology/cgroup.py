"""The cgroup limits of this process: cpuset, CPU quota and memory, v1, v2 or a hybrid of both.

Mount points come from `proc/mounts` and this process's groups from `proc/self/cgroup` (or, for the
cpuset, `proc/self/cpuset`), the way the kernel reports them, rather than from an assumed layout.
A v1 cpuset mounted with `noprefix` (as the legacy cpuset file system is, e.g. Android's
/dev/cpuset) names its files `cpus` and `mems` instead of `cpuset.cpus` and `cpuset.mems`.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from app.topology.root import Root

UNLIMITED_V1 = 1 << 62  # v1 reports "no limit" as a page-rounded LONG_MAX


@dataclass(frozen=True)
class CgroupLimits:
    """What the cgroup allows this process; None where it sets no limit."""

    cpuset: tuple[int, ...] | None
    cpuset_source: str | None
    memory_max: int | None
    memory_source: str | None
    mems: tuple[int, ...] | None = None  # NUMA nodes memory may come from (cpuset.mems)
    cpu_quota: float | None = None  # CPU time it may use, in CPUs (quota / period): a pod's limit, `docker --cpus`
    cpu_quota_source: str | None = None


@dataclass(frozen=True)
class _Mount:
    point: str
    fstype: str
    options: frozenset[str]


def read_cgroup_limits(root: Root) -> CgroupLimits:
    mounts = _mounts(root)
    groups = _groups(root)
    cpuset_dir = _controller_dir(root, mounts, groups, "cpuset")
    memory_dir = _controller_dir(root, mounts, groups, "memory")
    cpuset, cpuset_source = _cpuset(root, cpuset_dir, ("cpuset.cpus.effective", "cpuset.cpus"),
                                    ("effective_cpus", "cpus"))
    mems, _ = _cpuset(root, cpuset_dir, ("cpuset.mems.effective", "cpuset.mems"), ("effective_mems", "mems"))
    memory_max, memory_source = _memory_max(root, memory_dir)
    cpu_quota, cpu_source = _cpu_quota(root, _controller_dir(root, mounts, groups, "cpu"))
    return CgroupLimits(cpuset, cpuset_source, memory_max, memory_source, mems, cpu_quota, cpu_source)


def _unescape(path: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def _mounts(root: Root) -> list[_Mount]:
    mounts = []
    for line in (root.text("proc/mounts") or "").splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        options = frozenset(fields[3].split(","))
        if fields[2] == "cpuset":  # the legacy cpuset file system: a v1 cpuset hierarchy without prefixes
            fields[2], options = "cgroup", options | {"cpuset", "noprefix"}
        if fields[2] in ("cgroup", "cgroup2"):
            mounts.append(_Mount(_unescape(fields[1]), fields[2], options))
    return mounts


def _groups(root: Root) -> dict[str, str]:
    """Controller name -> cgroup path; "" is the v2 unified hierarchy."""
    groups = {}
    for line in (root.text("proc/self/cgroup") or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            groups[""] = path
        for controller in filter(None, controllers.split(",")):
            groups[controller] = path
    return groups


@dataclass(frozen=True)
class _Dir:
    version: int
    mount: str
    path: str  # below the mount point
    prefix: str = ""  # v1 file names start with the controller's name and a dot, unless noprefix


def _controller_dir(root: Root, mounts: list[_Mount], groups: dict[str, str], name: str) -> _Dir | None:
    """Where `name`'s files for this process live; v1 wins where both mount the controller."""
    for mount in mounts:
        if mount.fstype == "cgroup" and name in mount.options:
            group = groups.get(name) or (_proc_self_cpuset(root) if name == "cpuset" else None)
            if group is not None:
                prefix = "" if "noprefix" in mount.options else f"{name}."
                return _Dir(1, mount.point, _inside(root, mount.point, group), prefix)
    for mount in mounts:
        if mount.fstype == "cgroup2" and "" in groups:
            controllers = (root.line(posixpath.join(mount.point, "cgroup.controllers")) or "").split()
            if name in controllers:
                return _Dir(2, mount.point, _inside(root, mount.point, groups[""]))
    return None


def _proc_self_cpuset(root: Root) -> str | None:
    """The cpuset's path relative to the cpuset mount, where proc/self/cgroup does not name it."""
    path = root.line("proc/self/cpuset")
    return path if path and path.startswith("/") else None


def _inside(root: Root, mount: str, group: str) -> str:
    """The group's path below the mount; with a cgroup namespace the mount already is the group."""
    return group if root.exists(posixpath.join(mount, group.lstrip("/"))) else "/"


def _ancestors(cg: _Dir) -> list[str]:
    """The group's directory and each parent up to the mount point, nearest first."""
    dirs, path = [], cg.path
    while True:
        dirs.append(posixpath.join(cg.mount, path.lstrip("/")))
        if path in ("/", ""):
            return dirs
        path = posixpath.dirname(path.rstrip("/")) or "/"


def _cpuset(root: Root, cg: _Dir | None, v2_names: tuple[str, ...],
            v1_names: tuple[str, ...]) -> tuple[tuple[int, ...] | None, str | None]:
    """The first non-empty list among `names`, from the group up to the mount point."""
    if cg is None:
        return None, None
    names = v2_names if cg.version == 2 else tuple(cg.prefix + name for name in v1_names)
    for directory in _ancestors(cg):
        for name in names:
            file = posixpath.join(directory, name)
            cpus = root.cpulist(file)
            if cpus:
                return cpus, file
    return None, None


def _memory_max(root: Root, cg: _Dir | None) -> tuple[int | None, str | None]:
    """The tightest memory limit on the way up: a parent's limit binds its children too."""
    if cg is None:
        return None, None
    name = "memory.max" if cg.version == 2 else "memory.limit_in_bytes"
    best, source = None, None
    for directory in _ancestors(cg):
        file = posixpath.join(directory, name)
        value = root.line(file)
        if value and value.isdigit() and int(value) < UNLIMITED_V1 and (best is None or int(value) < best):
            best, source = int(value), file
    return best, source


@dataclass(frozen=True)
class MemoryGroup:
    """This process's memory controller group: its directory and each parent's up to the mount, nearest first."""

    version: int
    directories: tuple[str, ...]


def memory_group(root: Root) -> MemoryGroup | None:
    """Where memory_headroom reads; None where no memory controller is mounted for this process. Found once, read
    often: finding it reads proc/mounts and proc/self/cgroup."""
    cg = _controller_dir(root, _mounts(root), _groups(root), "memory")
    return None if cg is None else MemoryGroup(cg.version, tuple(_ancestors(cg)))


def memory_headroom(root: Root, group: MemoryGroup | None = None) -> int | None:
    """Bytes this process's cgroup (or `group`, from memory_group) may still take: the least of (limit - usage) from
    its group up, where the limit is v2's `memory.max` or `memory.high` (past which the group is throttled), v1's
    `memory.limit_in_bytes`, and the usage leaves out inactive page cache (the kernel reclaims it first); None where no
    group limits memory."""
    group = group or memory_group(root)
    if group is None:
        return None
    v2 = group.version == 2
    limits = ("memory.max", "memory.high") if v2 else ("memory.limit_in_bytes",)
    usage_name, inactive_name = ("memory.current", "inactive_file") if v2 else ("memory.usage_in_bytes",
                                                                                "total_inactive_file")
    best = None
    for directory in group.directories:
        values = [root.line(posixpath.join(directory, name)) or "" for name in limits]
        limit = min((int(v) for v in values if v.isdigit() and int(v) < UNLIMITED_V1), default=None)
        usage = root.line(posixpath.join(directory, usage_name)) or ""
        if limit is None or not usage.isdigit():
            continue
        stat = root.text(posixpath.join(directory, "memory.stat")) or ""
        inactive = next((int(n) for name, _, n in (line.partition(" ") for line in stat.splitlines())
                         if name == inactive_name and n.strip().isdigit()), 0)
        headroom = max(limit - max(int(usage) - inactive, 0), 0)
        best = headroom if best is None else min(best, headroom)
    return best


def _cpu_quota(root: Root, cg: _Dir | None) -> tuple[float | None, str | None]:
    """The tightest CPU bandwidth limit on the way up, in CPUs: v2's `cpu.max` ("max 100000": none), v1's
    `cpu.cfs_quota_us` (-1: none) over `cpu.cfs_period_us`."""
    if cg is None:
        return None, None
    best, source = None, None
    for directory in _ancestors(cg):
        if cg.version == 2:
            file = posixpath.join(directory, "cpu.max")
            quota, _, period = (root.line(file) or "").partition(" ")
        else:
            file = posixpath.join(directory, cg.prefix + "cfs_quota_us")
            period_file = posixpath.join(directory, cg.prefix + "cfs_period_us")
            quota, period = root.line(file) or "", root.line(period_file) or ""
        if quota.isdigit() and period.strip().isdigit() and int(quota) > 0 and int(period) > 0:
            cpus = int(quota) / int(period)
            if best is None or cpus < best:
                best, source = cpus, file
    return best, source
