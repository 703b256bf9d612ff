"""Host probe: CPU ISA variant (kt-kernel's rule), cores, NUMA, RAM, GPUs, disk, /dev/shm.

No torch or Prefect import, so ``ktflow doctor`` stays fast. The parsers take text or a
directory, so tests can feed them samples.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal

import psutil
from pydantic import BaseModel

CpuVariant = Literal[
    "amx", "avx512_bf16", "avx512_vbmi", "avx512_vnni", "avx512_base", "avx2", "none"
]
VARIANT_ORDER: tuple[str, ...] = (
    "amx", "avx512_bf16", "avx512_vbmi", "avx512_vnni", "avx512_base", "avx2"
)
"""kt-kernel's build variants, best first (``"none"`` is ktflow's word for "below avx2")."""

CPU_VARIANT_ENV = "KT_KERNEL_CPU_VARIANT"
CPUINFO_ENV = "KTFLOW_CPUINFO"
"""A file read instead of ``/proc/cpuinfo``: probes a CPU this machine does not have (tests)."""

# Copied from kt-kernel 0.7.2 kt_kernel/_cpu_detect.py; first match wins.
_AVX512_BF16 = ("avx512f", "avx512bw", "avx512_vnni", "avx512_vbmi", "avx512_bf16")
_VARIANT_REQUIREMENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("amx", ("amx_tile", "amx_int8", "amx_bf16", *_AVX512_BF16)),
    ("avx512_bf16", _AVX512_BF16),
    ("avx512_vbmi", _AVX512_BF16[:4]),
    ("avx512_vnni", _AVX512_BF16[:3]),
    ("avx512_base", _AVX512_BF16[:2]),
    ("avx2", ("avx2",)),
)

_NVIDIA_SMI_ARGS = ["--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"]
_MIB = 1024 * 1024


class GpuInfo(BaseModel):
    """One GPU as ``nvidia-smi`` reports it."""

    index: int
    name: str
    vram_bytes: int


class NumaNode(BaseModel):
    """One NUMA node: its CPUs and memory (``MemFree``, not "available")."""

    id: int
    cpus: list[int]
    mem_total_bytes: int
    mem_free_bytes: int


class HostInfo(BaseModel):
    """Everything :func:`probe_host` found out about this machine."""

    hostname: str
    cpu_model: str
    cpu_flags: list[str]
    cpu_variant: CpuVariant
    cpu_variant_overridden: bool
    native_cpu_variant: CpuVariant | None = None
    """The variant the CPU's own flags give (None: not probed, taken as ``cpu_variant``)."""
    logical_cores: int
    physical_cores: int
    numa_nodes: int
    numa: list[NumaNode]
    ram_bytes: int
    ram_available_bytes: int
    gpus: list[GpuInfo]
    disk_path: str
    disk_free_bytes: int
    shm_bytes: int
    shm_free_bytes: int

    @property
    def runnable_variant(self) -> CpuVariant:
        """The best kt-kernel variant whose kernels really run here.

        ``cpu_variant`` is what kt-kernel loads (``KT_KERNEL_CPU_VARIANT`` wins) and what a worker
        advertises to the pools; an override above what the CPU's flags allow would make kt-kernel
        die on an illegal instruction, and one below them limits kt-kernel to that build. So the
        kernels that run are those of the lower of the two.
        """
        native = self.native_cpu_variant or self.cpu_variant
        return native if variant_at_least(self.cpu_variant, native) else self.cpu_variant

    @property
    def machine(self) -> str:
        """What a KT run's speed depends on of this machine: CPU model, physical cores, NUMA nodes. With the
        hostname it keys the host's calibration runs (planning.host_speed): machines made from one image often share
        a hostname (every GPU host lent so far, and this project's CI box, are "vm"). Not the RAM: a plan for this
        host as if it had more (``ktflow plan --host``) is still calibrated by its runs."""
        return f"{self.cpu_model}, {self.physical_cores} cores, {self.numa_nodes} NUMA node(s)"

    def describe_cpu(self) -> str:
        """``AMD EPYC, kt-kernel variant avx2``, with an override and the CPU's own variant if they differ."""
        text = f"{self.cpu_model}, kt-kernel variant {self.runnable_variant}"
        if self.cpu_variant_overridden and self.native_cpu_variant not in (None, self.cpu_variant):
            text += f" ({CPU_VARIANT_ENV}={self.cpu_variant}; its flags allow {self.native_cpu_variant})"
        return text


def _variant_override(env: Mapping[str, str] | None) -> CpuVariant | None:
    """The ``KT_KERNEL_CPU_VARIANT`` value kt-kernel obeys, else None (it ignores others)."""
    value = (os.environ if env is None else env).get(CPU_VARIANT_ENV, "").lower()
    return value if value in VARIANT_ORDER else None  # type: ignore[return-value]


def detect_cpu_variant(
    flags: Iterable[str], env: Mapping[str, str] | None = None
) -> CpuVariant:
    """The kt-kernel build variant this CPU loads, by kt-kernel 0.7.2's own rule.

    Args:
        flags: CPU flags, e.g. the first ``flags`` line of ``/proc/cpuinfo`` split on spaces.
        env: environment to read ``KT_KERNEL_CPU_VARIANT`` from; defaults to ``os.environ``.
            A valid value (one of :data:`VARIANT_ORDER`, any case) wins, as in kt-kernel.

    Returns:
        One of :data:`VARIANT_ORDER`, or ``"none"`` below AVX2 (where kt-kernel would still
        load ``avx2`` and die on its first AVX2 instruction).
    """
    override = _variant_override(env)
    if override is not None:
        return override
    have = {flag.lower() for flag in flags}
    for variant, required in _VARIANT_REQUIREMENTS:
        # Linux prints "avx512vbmi" but "avx512_vnni": match either spelling, like kt-kernel.
        if all(flag in have or flag.replace("_", "") in have for flag in required):
            return variant  # type: ignore[return-value]
    return "none"


def variant_at_least(variant: str, minimum: str) -> bool:
    """Whether ``variant`` ranks at or above ``minimum`` in :data:`VARIANT_ORDER` (then "none").

    Raises:
        ValueError: either name is not a known variant (a typo must not read as "too old").
    """
    ranks = {name: rank for rank, name in enumerate((*VARIANT_ORDER, "none"))}
    for name in (variant, minimum):
        if name not in ranks:
            raise ValueError(f"unknown CPU variant {name!r}; expected one of {list(ranks)}")
    return ranks[variant] <= ranks[minimum]


def physical_cores() -> int:
    """This machine's physical cores (its logical CPUs where psutil cannot tell): the default worker count of
    the CPU-bound stages, each worker one torch thread."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def parse_cpuinfo(text: str) -> tuple[str, list[str], int | None]:
    """Parse ``/proc/cpuinfo`` text into ``(model_name, flags, physical_cores)``.

    ``model_name`` is the first ``model name`` (``""`` if none); ``flags`` the first ``flags``
    line, lower-cased and split, as kt-kernel reads it; ``physical_cores`` the number of
    distinct ``(physical id, core id)`` pairs, or None when any processor lacks them (some
    VMs and non-x86 kernels omit them).
    """
    model, flags = "", None
    cores: set[tuple[str, str]] = set()
    topology_complete = True
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields.setdefault(key.strip().lower(), value.strip())
        if "processor" not in fields:
            continue
        if not model and fields.get("model name"):
            model = fields["model name"]
        if flags is None and "flags" in fields:
            flags = fields["flags"].lower().split()
        if "physical id" in fields and "core id" in fields:
            cores.add((fields["physical id"], fields["core id"]))
        else:
            topology_complete = False
    physical = len(cores) if cores and topology_complete else None
    return model, flags or [], physical


def parse_nvidia_smi(csv_text: str) -> list[GpuInfo]:
    """Parse ``nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits``.

    Raises:
        ValueError: a non-empty line is not ``index, name, MiB``.
    """
    gpus = []
    for line in csv_text.splitlines():
        if not line.strip():
            continue
        parts = [part.strip() for part in line.split(",")]
        if len(parts) < 3:
            raise ValueError(f"unexpected nvidia-smi line: {line!r}")
        # the name is everything between index and memory, in case it ever holds a comma
        name = ", ".join(parts[1:-1])
        gpus.append(GpuInfo(index=int(parts[0]), name=name, vram_bytes=int(parts[-1]) * _MIB))
    return gpus


def _parse_cpulist(text: str) -> list[int]:
    """``"0-15,32-47"`` -> ``[0, ..., 15, 32, ..., 47]``; empty for memory-only nodes."""
    cpus: list[int] = []
    for item in text.strip().split(","):
        if item:
            lo, _, hi = item.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def _node_meminfo(path: Path) -> dict[str, int]:
    """``Node 0 MemTotal:  263856536 kB`` lines -> ``{"MemTotal": bytes, ...}``."""
    values: dict[str, int] = {}
    for line in (path.read_text() if path.is_file() else "").splitlines():
        tokens = line.split()
        if len(tokens) >= 4 and tokens[0] == "Node":
            values[tokens[2].rstrip(":")] = int(tokens[3]) * (1024 if tokens[-1] == "kB" else 1)
    return values


def read_numa_nodes(
    sys_root: str | os.PathLike[str] = "/sys/devices/system/node",
) -> list[NumaNode]:
    """Read NUMA nodes from sysfs (``node*/cpulist`` and ``node*/meminfo``), sorted by id.

    Without that directory (non-Linux, some containers) the whole host is one node with
    all CPUs and psutil's memory totals.
    """
    root = Path(sys_root)
    dirs = [d for d in root.glob("node*") if d.name[4:].isdigit()] if root.is_dir() else []
    if not dirs:
        vm = psutil.virtual_memory()
        cpus = list(range(os.cpu_count() or 1))
        return [NumaNode(id=0, cpus=cpus, mem_total_bytes=vm.total, mem_free_bytes=vm.free)]
    nodes = []
    for d in sorted(dirs, key=lambda d: int(d.name[4:])):
        cpulist = d / "cpulist"
        cpus = _parse_cpulist(cpulist.read_text()) if cpulist.is_file() else []
        mem = _node_meminfo(d / "meminfo")
        total, free = mem.get("MemTotal", 0), mem.get("MemFree", 0)
        nodes.append(NumaNode(id=int(d.name[4:]), cpus=cpus, mem_total_bytes=total,
                              mem_free_bytes=free))
    return nodes


def _probe_gpus() -> list[GpuInfo]:
    """GPUs from nvidia-smi; any failure (absent, no driver, hang, odd output) means none."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        result = subprocess.run(
            [exe, *_NVIDIA_SMI_ARGS], capture_output=True, text=True, timeout=10, check=False
        )
        return parse_nvidia_smi(result.stdout) if result.returncode == 0 else []
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def _existing_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` or its nearest existing parent, so a store not yet created can be measured."""
    candidate = Path(path).expanduser().absolute()
    while not candidate.exists() and candidate != candidate.parent:
        candidate = candidate.parent
    return candidate


def probe_host(store_path: str | os.PathLike[str] | None = None) -> HostInfo:
    """Probe this host (runs nothing but ``nvidia-smi``; well under a second).

    Args:
        store_path: where ktflow will write; free space is measured at its nearest existing
            directory, which ``HostInfo.disk_path`` names. Defaults to the current directory.
    """
    try:
        cpuinfo = Path(os.environ.get(CPUINFO_ENV) or "/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        cpuinfo = ""
    model, flags, physical = parse_cpuinfo(cpuinfo)
    logical = os.cpu_count() or 1
    if physical is None:
        physical = psutil.cpu_count(logical=False) or logical
    numa = read_numa_nodes()
    vm = psutil.virtual_memory()
    disk_dir = _existing_dir(os.getcwd() if store_path is None else store_path)
    try:
        shm = shutil.disk_usage("/dev/shm")
        shm_total, shm_free = shm.total, shm.free
    except OSError:
        shm_total = shm_free = 0
    return HostInfo(
        hostname=socket.gethostname(),
        cpu_model=model or platform.processor() or "unknown",
        cpu_flags=flags,
        cpu_variant=detect_cpu_variant(flags),
        cpu_variant_overridden=_variant_override(None) is not None,
        native_cpu_variant=detect_cpu_variant(flags, env={}),
        logical_cores=logical,
        physical_cores=physical,
        numa_nodes=len(numa),
        numa=numa,
        ram_bytes=vm.total,
        ram_available_bytes=vm.available,
        gpus=_probe_gpus(),
        disk_path=str(disk_dir),
        disk_free_bytes=shutil.disk_usage(disk_dir).free,
        shm_bytes=shm_total,
        shm_free_bytes=shm_free,
    )
