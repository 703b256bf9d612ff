"""Helpers shared by the benchmark scripts: host description, per-child peak RSS, page-cache control.

The orchestrating process must stay small (never import torch there): on Linux a child's
``ru_maxrss`` is at least the RSS of the parent it was spawned from (fork/vfork then exec), so
the parent's own peak is a floor under every child figure; :func:`parent_peak_rss` reports it.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

RESULT_PREFIX = "BENCH-RESULT "
_CHUNK = 8 << 20


@dataclass
class ChildRun:
    """One child process: its exit code, peak RSS (bytes), wall time and the result it printed, plus
    ``others_busy``: how many CPUs other processes kept busy meanwhile, on average (the box may be shared)."""

    returncode: int
    peak_rss: int
    wall: float
    result: dict[str, Any]
    log: Path
    others_busy: float = 0.0


def host_info(packages: Sequence[str] = ()) -> dict[str, Any]:
    """CPU model, cores, memory, kernel and package versions, so figures are attributable."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
        mem_gb = psutil.virtual_memory().total / 1e9
    except ImportError:
        physical, mem_gb = None, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    versions = {}
    for name in packages:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"cpu": model, "logical_cores": os.cpu_count(), "physical_cores": physical,
            "memory_gb": round(mem_gb, 1), "kernel": platform.release(),
            "python": platform.python_version(), "packages": versions}


def run_child(argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> ChildRun:
    """Run ``python argv`` with output to ``log``; peak RSS from ``os.wait4`` of that child alone."""
    busy0 = _host_busy_seconds()
    with open(log, "wb") as out:
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here; keep Popen consistent
    result: dict[str, Any] = {}
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
    others = max(0.0, _host_busy_seconds() - busy0 - usage.ru_utime - usage.ru_stime) / wall if busy0 >= 0 else 0.0
    return ChildRun(proc.returncode, usage.ru_maxrss * 1024, wall, result, log, others_busy=others)


def _host_busy_seconds() -> float:
    """CPU seconds all CPUs of the host have spent busy since boot (``/proc/stat``); -1 if unknown."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return -1.0
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def report(result: dict[str, Any]) -> None:
    """In a child: hand ``result`` back to :func:`run_child`."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def parent_peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def files_under(paths: Iterable[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        out.extend(sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p] if p.is_file() else [])
    return out


def evict(paths: Iterable[Path]) -> None:
    """``sync`` (no dirty pages of an earlier run left to write back), then drop these files' cached pages.

    Unprivileged and local: ``posix_fadvise(DONTNEED)`` per file, never ``/proc/sys/vm/drop_caches``.
    """
    os.sync()
    for f in files_under(paths):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: Iterable[Path]) -> int:
    """Read every file once (into one reused buffer, so RSS stays flat): inputs start in the page cache."""
    buf = bytearray(_CHUNK)
    view, total = memoryview(buf), 0
    for f in files_under(paths):
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(view):
                total += n
    return total
