"""What a GPU workstation needs before ``make gpu-env`` installs the KT toolchains, and the check after it.

Two halves, both pure where it matters:

- :func:`preflight` judges :class:`HostFacts` (glibc, Python, CPU, NVIDIA driver, GPUs, nvcc, g++, free disk)
  against what the pinned toolchains need, and says for each fact what the host lacks and how to get it.
  :func:`probe_facts` gathers the facts on this host; tests feed :func:`preflight` made-up ones.
- :func:`smoke_probes` is the check after the install: the Python snippets each toolchain must run (sglang's
  server, kt-kernel's extension for this CPU, LlamaFactory-kt's trainer; on a GPU, torch.cuda and sglang's GPU
  kernels for the card's architecture). :func:`run_smoke` runs them in the toolchains' own interpreters.

Why each requirement (the KT 0.7.2 wheels, on the package index):

- every KT wheel is ``manylinux_2_35`` x86-64, for CPython 3.11 and 3.12 only: glibc 2.35 or newer (Ubuntu 22.04,
  Debian 12; not RHEL/Rocky 9, whose glibc is 2.34);
- torch 2.9.1 as the index ships it is built for CUDA 12.8: an NVIDIA driver of the 570 series or newer;
- sglang-kt and flashinfer compile some kernels when the server first starts: ``nvcc`` of CUDA 12 and a g++ that
  speaks C++20 (11 or newer);
- KT's SFT kernels exist only in kt-kernel's ``amx`` and ``avx512_bf16`` builds; serving runs on less, slower.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from ktflow.host.hardware import CpuVariant, variant_at_least
from ktflow.units import GiB, human_bytes

Verdict = Literal["ok", "missing", "warn", "skipped"]

MIN_GLIBC = (2, 35)
PYTHONS = ((3, 11), (3, 12))
MIN_DRIVER = 570
CUDA_MAJOR = 12
MIN_GXX = 11
TRAIN_CPU_VARIANT: CpuVariant = "avx512_bf16"
INSTALL_DISK_BYTES = 30 * GiB
"""Free disk the install needs where the checkout is (uv's cache and the venvs share one filesystem, so the torch
stack is stored once): the two toolchains measured 11 GiB with their cache from an empty one (13 GiB after the
serving toolchain's first import on a CPU machine), plus ~4 GiB that sglang's GPU kernels are unpacked into at the
first start on a GPU other than sm90, plus room."""
KERNEL_UNPACK_BYTES = 4 * GiB


class HostFacts(BaseModel):
    """What the preflight judges: each fact as probed (None: not found)."""

    machine: str = Field(description="platform.machine(): x86_64 or another architecture")
    glibc: tuple[int, int] | None = Field(None, description="the C library's version (None: not glibc)")
    os_name: str = Field("", description="PRETTY_NAME of /etc/os-release")
    python: tuple[int, int] = Field(description="the Python that will make the toolchains' venvs")
    python_path: str = ""
    cpu_model: str = ""
    cpu_variant: CpuVariant = Field(description="kt-kernel's build for this CPU (its own detection rule)")
    driver: str | None = Field(None, description="the NVIDIA driver version nvidia-smi reports")
    gpus: list[str] = Field(default_factory=list, description="each GPU as 'name (sm NN)'")
    compute_caps: list[tuple[int, int]] = Field(default_factory=list, description="each GPU's compute capability")
    nvcc: tuple[int, int] | None = Field(None, description="CUDA release of nvcc on PATH or in CUDA_HOME")
    gxx: tuple[int, int] | None = Field(None, description="g++ version")
    disk_path: str = "."
    disk_free_bytes: int = 0


class Finding(BaseModel):
    """One requirement, what the host has, and what to do about it."""

    item: str
    need: str
    have: str
    verdict: Verdict
    fix: str = ""


class PreflightReport(BaseModel):
    """Every finding; ``ok`` when nothing is missing (warnings do not block the install)."""

    findings: list[Finding]
    gpu: bool = Field(description="whether the GPU requirements were checked")

    @property
    def missing(self) -> list[Finding]:
        return [f for f in self.findings if f.verdict == "missing"]

    @property
    def ok(self) -> bool:
        return not self.missing


def _version(v: tuple[int, int] | None) -> str:
    return "not found" if v is None else f"{v[0]}.{v[1]}"


def preflight(facts: HostFacts, *, gpu: bool = True, disk_needed: int = INSTALL_DISK_BYTES) -> PreflightReport:
    """Judge ``facts`` against what the KT training and serving toolchains need.

    Args:
        facts: the host, as :func:`probe_facts` found it (or made up, in tests).
        gpu: check the GPU side too (driver, GPUs, nvcc, g++); off on a CPU-only box that only installs.
        disk_needed: free bytes the install needs at ``facts.disk_path``.
    """
    found: list[Finding] = []

    def add(item: str, need: str, have: str, good: bool, fix: str, *, warn_only: bool = False) -> None:
        verdict: Verdict = "ok" if good else ("warn" if warn_only else "missing")
        found.append(Finding(item=item, need=need, have=have, verdict=verdict, fix="" if good else fix))

    add("architecture", "x86_64 (the KT wheels are built for it only)", facts.machine, facts.machine == "x86_64",
        "use an x86-64 host: kt-kernel, sglang-kt and the ktransformers wheel exist for no other architecture")
    add("glibc", f"{MIN_GLIBC[0]}.{MIN_GLIBC[1]} or newer (every KT wheel is manylinux_2_35)",
        f"{_version(facts.glibc)}" + (f" ({facts.os_name})" if facts.os_name else ""),
        facts.glibc is not None and facts.glibc >= MIN_GLIBC,
        "use Ubuntu 22.04 or newer, Debian 12 or newer, or another distribution with glibc 2.35+ "
        "(RHEL/Rocky/Alma 9 ship 2.34); or run in such a container")
    pythons = " or ".join(f"{a}.{b}" for a, b in PYTHONS)
    add("python", f"CPython {pythons} (kt-kernel has wheels for these only)",
        f"{_version(facts.python)}" + (f" ({facts.python_path})" if facts.python_path else ""),
        facts.python in PYTHONS,
        "install python3.12 (or 3.11) with its venv module, e.g. `sudo apt install python3.12 python3.12-venv`, "
        "and run `make gpu-env PYTHON=python3.12`")
    add("CPU", f"kt-kernel variant {TRAIN_CPU_VARIANT} or amx (KT SFT kernels exist only in these builds)",
        f"{facts.cpu_model or 'unknown CPU'}: {facts.cpu_variant}",
        variant_at_least(facts.cpu_variant, TRAIN_CPU_VARIANT),
        "KT SFT needs an Intel Xeon with AMX (Sapphire Rapids or newer) or a CPU with AVX512-BF16 (AMD Zen 4 "
        "or newer, Intel Cooper Lake); this CPU can still serve (INT8 experts need avx512_base)", warn_only=True)
    add("free disk", f"{human_bytes(disk_needed)} at {facts.disk_path} (uv's cache and the venvs, one torch)",
        human_bytes(facts.disk_free_bytes), facts.disk_free_bytes >= disk_needed,
        "free space on the checkout's filesystem, or clone ktflow onto a larger one (the cache, .cache/uv, "
        "must be on the same filesystem as the venvs for hardlinks)")
    if not gpu:
        for item in ("NVIDIA driver", "GPUs", "nvcc", "g++"):
            found.append(Finding(item=item, need="checked on a GPU host", have="not checked (--no-gpu)",
                                 verdict="skipped"))
        return PreflightReport(findings=found, gpu=False)
    driver_major = int(facts.driver.split(".")[0]) if facts.driver and facts.driver.split(".")[0].isdigit() else None
    add("NVIDIA driver", f"{MIN_DRIVER} or newer (torch 2.9.1 is built for CUDA 12.8)",
        facts.driver or "not found (no nvidia-smi)", driver_major is not None and driver_major >= MIN_DRIVER,
        "install NVIDIA's driver 570 or newer (e.g. `sudo apt install nvidia-driver-570-server` on Ubuntu, or "
        "NVIDIA's .run installer), then reboot; `nvidia-smi` must list the GPUs")
    add("GPUs", "at least one CUDA GPU", ", ".join(facts.gpus) or "none", bool(facts.gpus),
        "the training stage and the SGLang server need a CUDA GPU: check `nvidia-smi`")
    add("nvcc", f"CUDA {CUDA_MAJOR}.x nvcc: sglang-kt and flashinfer compile kernels at the server's first start, "
        "and torch 2.9.1 (CUDA 12.8) refuses to build with another CUDA major",
        _version(facts.nvcc), facts.nvcc is not None and facts.nvcc[0] == CUDA_MAJOR,
        "install CUDA toolkit 12.8 (`sudo apt install cuda-toolkit-12-8` from NVIDIA's repository) and put "
        "/usr/local/cuda-12.8/bin on PATH (or set CUDA_HOME=/usr/local/cuda-12.8)")
    add("g++", f"g++ {MIN_GXX} or newer (C++20, for the same kernel builds)", _version(facts.gxx),
        facts.gxx is not None and facts.gxx[0] >= MIN_GXX,
        "`sudo apt install g++` (Ubuntu 22.04 ships 11, Debian 12 ships 12)")
    other = sorted({f"sm{a}{b}" for a, b in facts.compute_caps if (a, b) != (9, 0)})
    if other:  # sm90's kernels ship built in the ktransformers wheel; the others are unpacked at the first start
        add("GPU kernels", f"{human_bytes(KERNEL_UNPACK_BYTES)} free at the first start to unpack sglang's "
            f"kernels for {', '.join(other)} (included in the free disk above)", human_bytes(facts.disk_free_bytes),
            facts.disk_free_bytes >= disk_needed,
            "keep 4 GiB free in the serving venv's site-packages, or point SGL_KERNEL_KT_CACHE_DIR at a disk with "
            "room", warn_only=True)
    return PreflightReport(findings=found, gpu=True)


# --- probing this host -------------------------------------------------------------------------------------

def _run(argv: Sequence[str], timeout: float = 20) -> str | None:
    exe = shutil.which(argv[0]) if not os.path.isabs(argv[0]) else argv[0]
    if exe is None or not os.access(exe, os.X_OK):
        return None
    try:
        done = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout + done.stderr if done.returncode == 0 else None


def parse_nvcc_version(text: str) -> tuple[int, int] | None:
    """``nvcc --version``'s "release 12.8, V12.8.93" -> (12, 8)."""
    match = re.search(r"release (\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def parse_dotted(text: str) -> tuple[int, int] | None:
    """The first ``MAJOR.MINOR`` in ``text`` (``g++ -dumpfullversion``'s "12.2.0", ldd's "2.36")."""
    match = re.search(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def parse_gpu_query(text: str) -> tuple[str | None, list[str], list[tuple[int, int]]]:
    """``nvidia-smi --query-gpu=driver_version,name,compute_cap --format=csv,noheader`` -> driver, GPUs, caps."""
    driver, gpus, caps = None, [], []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[0]:
            continue
        driver = parts[0]
        cap = parse_dotted(parts[-1])
        name = ", ".join(parts[1:-1])
        gpus.append(f"{name} (sm{cap[0]}{cap[1]})" if cap else name)
        if cap:
            caps.append(cap)
    return driver, gpus, caps


def _os_name() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return ""


def _nvcc() -> tuple[int, int] | None:
    candidates = ["nvcc"]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(str(Path(os.environ[var]) / "bin" / "nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    for exe in candidates:
        text = _run([exe, "--version"])
        if text:
            return parse_nvcc_version(text)
    return None


def _python_version(python: str) -> tuple[tuple[int, int], str]:
    if python == sys.executable:
        return (sys.version_info[0], sys.version_info[1]), python
    text = _run([python, "-c", "import sys; print(sys.version_info[0], sys.version_info[1]); print(sys.executable)"])
    if not text:
        return (0, 0), f"{python}: not found"
    lines = text.split("\n")
    major, minor = lines[0].split()
    return (int(major), int(minor)), lines[1].strip()


def probe_facts(python: str = "python3", disk_path: str | os.PathLike[str] = ".") -> HostFacts:
    """This host's facts (runs ``nvidia-smi``, ``nvcc``, ``g++``, ``python``; a few seconds at most)."""
    from ktflow.host.hardware import probe_host

    host = probe_host(disk_path)
    libc, libc_version = platform.libc_ver()
    py, py_path = _python_version(python)
    driver, gpus, caps = parse_gpu_query(_run(["nvidia-smi", "--query-gpu=driver_version,name,compute_cap",
                                               "--format=csv,noheader"]) or "")
    gxx = _run(["g++", "-dumpfullversion", "-dumpversion"])
    return HostFacts(
        machine=platform.machine(), glibc=parse_dotted(libc_version) if libc == "glibc" else None,
        os_name=_os_name(), python=py, python_path=py_path, cpu_model=host.cpu_model,
        cpu_variant=host.runnable_variant, driver=driver, gpus=gpus, compute_caps=caps, nvcc=_nvcc(),
        gxx=parse_dotted(gxx) if gxx else None, disk_path=host.disk_path, disk_free_bytes=host.disk_free_bytes,
    )


# --- the check after the install ----------------------------------------------------------------------------

class SmokeProbe(BaseModel):
    """One check run inside a toolchain's python: ``code`` prints one line of what it found, or raises."""

    toolchain: Literal["serve", "train"]
    name: str
    code: str
    gpu_only: bool = False


SMOKE_PROBES: tuple[SmokeProbe, ...] = (
    SmokeProbe(toolchain="serve", name="sglang's server arguments",
               code="import sglang.srt.server_args as a; "
                    "assert 'kt_method' in a.ServerArgs.__dataclass_fields__, 'not the KT fork of sglang: no kt_method'; "
                    "from importlib.metadata import version; print('sglang-kt', version('sglang-kt'))"),
    # The server's own modules load sglang's GPU kernels at import (CUDA's libcuda), so without a GPU the check
    # stops at what they stand on: the web stack, flashinfer, tvm-ffi, and the modules being there.
    SmokeProbe(toolchain="serve", name="sglang's server dependencies",
               code="import fastapi, uvicorn, flashinfer, tvm_ffi, importlib.util as u; "
                    "missing = [m for m in ('sglang.srt.entrypoints.http_server', 'sgl_kernel') if not u.find_spec(m)]; "
                    "assert not missing, f'missing: {missing}'; "
                    "print('fastapi', fastapi.__version__, 'flashinfer', flashinfer.__version__)"),
    SmokeProbe(toolchain="serve", name="sglang's server", gpu_only=True,
               code="import sglang.srt.entrypoints.http_server; print('sglang.srt.entrypoints.http_server imports')"),
    SmokeProbe(toolchain="serve", name="kt-kernel's extension",
               code="import kt_kernel; print('kt-kernel', kt_kernel.__version__, 'build', kt_kernel.__cpu_variant__)"),
    SmokeProbe(toolchain="serve", name="torch.cuda", gpu_only=True,
               code="import torch; assert torch.cuda.is_available(), 'torch sees no GPU'; "
                    "c = torch.cuda.get_device_capability(); "
                    "print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.device_count(), "
                    "'GPU(s),', torch.cuda.get_device_name(0), f'sm{c[0]}{c[1]}')"),
    SmokeProbe(toolchain="serve", name="sglang's GPU kernels", gpu_only=True,
               code="import torch, sgl_kernel; torch.ops.sgl_kernel; "
                    "print('sgl_kernel', getattr(sgl_kernel, '__version__', '?'), 'loaded for', "
                    "'sm%d%d' % torch.cuda.get_device_capability())"),
    SmokeProbe(toolchain="train", name="LlamaFactory-kt's trainer",
               code="import llamafactory.train.tuner, torch, torchaudio; "
                    "from importlib.metadata import version; "
                    "print('llamafactory-kt', version('llamafactory-kt'), 'torch', torch.__version__)"),
    SmokeProbe(toolchain="train", name="kt-kernel's SFT build",
               code="import kt_kernel; v = kt_kernel.__cpu_variant__; "
                    "print('kt-kernel build', v, '' if v in ('amx', 'avx512_bf16') else "
                    "'(no SFT kernels in this build: KT SFT needs amx or avx512_bf16)')"),
    SmokeProbe(toolchain="train", name="torch.cuda", gpu_only=True,
               code="import torch; assert torch.cuda.is_available(), 'torch sees no GPU'; "
                    "print('torch', torch.__version__, torch.cuda.device_count(), 'GPU(s)')"),
)


class SmokeResult(BaseModel):
    toolchain: str
    name: str
    verdict: Verdict
    detail: str


def smoke_probes(gpu: bool) -> list[SmokeProbe]:
    """The probes to run: all of them on a GPU host, the CPU ones elsewhere."""
    return [p for p in SMOKE_PROBES if gpu or not p.gpu_only]


Runner = Callable[[str, str], tuple[int, str]]


def _subprocess_runner(python: str, code: str) -> tuple[int, str]:
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=900, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return 1, str(exc)
    return done.returncode, (done.stdout.strip() if done.returncode == 0 else (done.stderr or done.stdout).strip())


def run_smoke(pythons: Mapping[str, str], *, gpu: bool, runner: Runner = _subprocess_runner) -> list[SmokeResult]:
    """Run :func:`smoke_probes` in each toolchain's python (``{"serve": path, "train": path}``).

    A toolchain whose python is missing fails each of its probes with that reason; ``runner`` is replaceable
    so tests can stand in for the interpreters.
    """
    results = []
    for probe in SMOKE_PROBES:
        if probe.gpu_only and not gpu:
            results.append(SmokeResult(toolchain=probe.toolchain, name=probe.name, verdict="skipped",
                                       detail="no GPU check asked (--no-gpu)"))
            continue
        python = pythons.get(probe.toolchain, "")
        if not python or not Path(python).exists():
            results.append(SmokeResult(toolchain=probe.toolchain, name=probe.name, verdict="missing",
                                       detail=f"{python or 'no python'} does not exist: `make gpu-env` makes it"))
            continue
        code, text = runner(python, probe.code)
        lines = [line for line in text.splitlines() if line.strip()]
        detail = (lines[-1] if lines else "") if code == 0 else (lines[-1] if lines else f"exit {code}")
        results.append(SmokeResult(toolchain=probe.toolchain, name=probe.name,
                                   verdict="ok" if code == 0 else "missing", detail=detail[:400]))
    return results
