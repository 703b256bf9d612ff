"""What a stage needs of a host, and how a shortfall is worded: the vocabulary every layer shares.

- The stage names (:data:`StageName`, :data:`STAGE_ORDER`) and what a stage needs of a host's
  hardware (:class:`HostRequirement`, :func:`check_requirement`, :data:`INT8_KERNELS`).
- What one run needs (:class:`Resources`: disk, RAM, GPU memory and count, the toolchain), each
  shortfall in the words a user acts on (:func:`ram_shortfall`, :func:`gpu_shortfall`,
  :func:`shortfalls`), and :func:`preflight`, which refuses a run this host cannot finish.

The stage runner (:mod:`ktflow.runner`) checks these before a stage writes anything; the planner
(:mod:`ktflow.plan`) and the recipe model read them too, so a preflight and a plan never
disagree, and the recipe needs no part of the runner.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ktflow import store
from ktflow.errors import HostRequirementError, InvalidInputError
from ktflow.host import hardware
from ktflow.host.hardware import HostInfo, variant_at_least
from ktflow.units import GiB, gib

StageName = Literal["download", "dequantize", "sft", "convert-lora", "quantize-int8", "merge", "serve", "evaluate"]
STAGE_ORDER: tuple[StageName, ...] = (
    "download", "dequantize", "sft", "convert-lora", "quantize-int8", "serve", "evaluate",
)
# The names the artifact stages write into their manifests (``StageManifest.stage``): a module that checks what a
# directory holds names it from here, without importing the stage that made it.
DOWNLOAD_STAGE: StageName = "download"
DEQUANTIZE_STAGE: StageName = "dequantize"
CONVERT_LORA_STAGE: StageName = "convert-lora"
QUANTIZE_INT8_STAGE: StageName = "quantize-int8"
MERGE_STAGE: StageName = "merge"

"""``progress(done, total)`` in the stage's own unit (bytes, layers, steps)."""



# --------------------------------------------------------------------------- what a stage needs of a host


class HostRequirement(BaseModel):
    """What a stage needs of the host it runs on, with the reason for each need."""

    stage: StageName
    min_cpu_variant: str | None = None
    cpu_reason: str = ""
    min_gpus: int = 0
    max_threads: int | None = None  # a recipe thread count that must not exceed physical cores
    threads_field: str = ""


INT8_KERNELS = HostRequirement(
    stage="quantize-int8",
    # Checked with kt-kernel 0.7.2: its avx512_base build quantizes and runs AMXINT8 within the
    # verification bound (VNNI and AMX builds are faster); its avx2 build has no INT8 MoE class.
    min_cpu_variant="avx512_base",
    cpu_reason="kt-kernel's INT8 MoE kernels (AMXINT8) need AVX512F + AVX512BW; its avx2 build has none",
)
"""What running kt-kernel's INT8 MoE kernels (quantize-int8, AMXINT8 serving) needs of a host."""


def check_requirement(req: HostRequirement, host: HostInfo) -> list[str]:
    """What this host lacks for a stage, as sentences a user can act on (empty: runnable)."""
    missing: list[str] = []
    if req.min_cpu_variant and not variant_at_least(host.runnable_variant, req.min_cpu_variant):
        missing.append(
            f"{req.stage} needs a {req.min_cpu_variant} CPU or better ({req.cpu_reason}); "
            f"this CPU is {host.describe_cpu()}"
        )
    if req.min_gpus > len(host.gpus):
        missing.append(f"{req.stage} needs {req.min_gpus} GPU(s); this host has {len(host.gpus)}")
    if req.max_threads is not None and req.max_threads > host.physical_cores:
        missing.append(
            f"{req.threads_field} is {req.max_threads} but this host has {host.physical_cores} "
            "physical cores; lower it (threads beyond physical cores slow KT down)"
        )
    return missing


class DiskNeed(BaseModel):
    """Bytes a run still has to write on one filesystem."""

    model_config = ConfigDict(frozen=True)

    bytes: int
    what: str  # the subject of "... needs ~X more on this filesystem", e.g. "the BF16 output"
    files: int = 1
    at: Path | None = None  # a directory on that filesystem; None: the artifact's own
    overhead: float | None = None  # None: store.space_margin (1 % + a block per file); else bytes * overhead
    fix: str | None = None


class RamNeed(BaseModel):
    """RAM a run needs while it works."""

    model_config = ConfigDict(frozen=True)

    bytes: int
    what: str  # the subject of "... needs ~X GiB of RAM", e.g. "one MoE layer"
    why: str = ""  # the breakdown, shown in parentheses
    # "available": a short run that needs the memory free now; "installed": a run held for hours
    # (the page cache and other jobs come and go, so what is free at the start says little).
    of: Literal["available", "installed"] = "available"
    numa_pools: int = 1  # split evenly over this many NUMA nodes, each of which must hold its share


class GpuNeed(BaseModel):
    """GPU memory a run needs, on each GPU it uses or summed over them."""

    model_config = ConfigDict(frozen=True)

    bytes: int
    gpus: int = 1  # how many GPUs the run uses
    summed: bool = False  # True: ``bytes`` is spread over the GPUs (their memory is added up)
    fraction: float = 1.0  # the share of each GPU's memory the run may take (sglang's mem_fraction_static)
    what: str = ""  # the sentence's start, e.g. "plain LoRA SFT puts the whole model on the GPU in BF16: ..., so it"
    why: str = ""  # the breakdown, shown in parentheses
    field: str = ""  # the recipe field that sets ``gpus``, e.g. "sft.gpus"
    subject: str | None = None  # the error's subject (default: the stage)
    fix: str | None = None


class ToolchainNeed(BaseModel):
    """A separate Python environment the stage runs a tool in (checked last: installing one is easy)."""

    model_config = ConfigDict(frozen=True)

    python: Path
    field: str  # the recipe field naming it, e.g. "toolchains.train.python"
    what: str  # what it must hold, e.g. "LlamaFactory"
    make_target: str  # what makes it, e.g. "train-env"


class Resources(BaseModel):
    """What one run of a stage needs of its host: the preflight checks it, a planner reads it."""

    model_config = ConfigDict(frozen=True)

    host: HostRequirement | None = None  # CPU ISA, GPU count, thread counts
    gpu: GpuNeed | None = None
    ram: RamNeed | None = None
    disk: tuple[DiskNeed, ...] = ()
    toolchain: ToolchainNeed | None = None
    artifact_bytes: int | None = None  # the artifact's size when complete (what the store grows by)

    @property
    def probes_host(self) -> bool:
        """Whether checking these needs takes a host probe (disk alone does not)."""
        return self.host is not None or self.ram is not None or self.gpu is not None




def ram_shortfall(stage: StageName, ram: RamNeed, host: HostInfo) -> str | None:
    """Why ``host`` cannot give a run ``ram`` (None: it can): free memory now, or installed memory
    and each NUMA node's share."""
    why = f" ({ram.why})" if ram.why else ""
    if ram.of == "available":
        if host.ram_available_bytes >= ram.bytes:
            return None
        return f"{ram.what} needs ~{gib(ram.bytes)} GiB of RAM{why}; {gib(host.ram_available_bytes)} GiB is available"
    problems = []
    nodes = sorted(host.numa, key=lambda n: n.mem_total_bytes)
    share = ram.bytes / max(ram.numa_pools, 1)
    if ram.numa_pools > 1 and len(nodes) >= ram.numa_pools and nodes[0].mem_total_bytes < share:
        problems.append(f"{ram.what} needs ~{gib(share)} GiB per NUMA node for its share{why} "
                        f"({gib(ram.bytes)} GiB over {ram.numa_pools} pools); node {nodes[0].id} has "
                        f"{gib(nodes[0].mem_total_bytes)} GiB")
    if host.ram_bytes < ram.bytes:
        problems.append(f"{ram.what} needs ~{gib(ram.bytes)} GiB of RAM{why}; this host has {gib(host.ram_bytes)} GiB")
    return "; ".join(problems) or None


_RAM_FIX = "free memory, or use a larger host (`ktflow plan` says what each stage needs)"


def gpu_shortfall(stage: StageName, gpu: GpuNeed, host: HostInfo) -> str | None:
    """Why ``host``'s GPUs cannot hold ``gpu`` (None: they can, or it has no GPU: a capability)."""
    used = host.gpus[: max(gpu.gpus, 1)]
    if not used:
        return None  # no GPU at all is a capability (HostRequirement.min_gpus), not a capacity
    what = gpu.what or f"{stage}"
    why = f" ({gpu.why})" if gpu.why else ""
    field = f"{gpu.field}: {gpu.gpus}; " if gpu.field else ""
    if gpu.summed:
        have = sum(g.vram_bytes for g in used)
        if gpu.bytes <= have:
            return None
        names = ", ".join(sorted({g.name for g in used}))
        return (f"{what} needs ~{gpu.bytes / GiB:.0f} GiB of GPU memory{why}; the {len(used)} GPU(s) it uses "
                f"({field}{names}) have {have / GiB:.1f} GiB.")
    for g in used:
        if g.vram_bytes * gpu.fraction < gpu.bytes:
            share = (f", of which {gpu.fraction:g} is {g.vram_bytes * gpu.fraction / GiB:.1f} GiB"
                     if gpu.fraction < 1 else "")
            return (f"{what} needs ~{gpu.bytes / GiB:.1f} GiB on each of {len(used)} GPU(s){why}; "
                    f"GPU {g.index} ({g.name}) has {g.vram_bytes / GiB:.1f} GiB{share}")
    return None


def shortfalls(stage: StageName, resources: Resources, target: Path, host: HostInfo | None) -> list[InvalidInputError]:
    """What this host lacks of ``resources`` in capacity (RAM, GPU memory, disk), one error each.

    ``host`` may be None when ``resources`` do not :attr:`~Resources.probes_host`.
    """
    found: list[InvalidInputError] = []
    if resources.ram is not None and host is not None:
        short = ram_shortfall(stage, resources.ram, host)
        if short:
            found.append(HostRequirementError(stage, short, _RAM_FIX))
    if resources.gpu is not None and host is not None:
        short = gpu_shortfall(stage, resources.gpu, host)
        if short:
            found.append(HostRequirementError(resources.gpu.subject or stage, short, resources.gpu.fix))
    for disk in resources.disk:
        at = disk.at if disk.at is not None else Path(target).parent
        short = store.free_space_shortfall(at, disk.bytes, what=disk.what, files=disk.files, overhead=disk.overhead,
                                           subject=str(target) if disk.at is None else str(disk.at), fix=disk.fix)
        if short is not None:
            found.append(short)
    return found


def check_toolchain(need: ToolchainNeed) -> None:
    """Refuse a missing toolchain environment, naming the recipe field and the make target.

    Raises:
        HostRequirementError: ``need.python`` does not exist.
    """
    if not Path(need.python).exists():
        raise HostRequirementError(
            f"{need.field}: {need.python}", f"no environment with {need.what} is installed there",
            f"run `make {need.make_target}`, or point {need.field} at the python of an environment that has {need.what}",
        )


def preflight(stage: StageName, resources: Resources, target: Path, *, host: HostInfo | None = None,
              fix: str | None = None) -> HostInfo | None:
    """Refuse to start a run this host cannot finish; return the host checked (None: no probe needed).

    Capabilities first (CPU ISA, GPU count, threads: nothing but another host helps), then
    capacity (RAM, GPU memory, free disk), every shortfall of a kind in one message, then the
    toolchain (one ``make`` target away).

    Args:
        stage: the stage, named in the messages.
        resources: what the run needs (:meth:`StageSpec.needs`).
        target: the artifact's final directory (free disk is measured on its filesystem).
        host: the host to check; probed (at ``target``) when None and the needs call for it.
        fix: what to do when a capability is missing.

    Raises:
        HostRequirementError: a missing capability, or too little RAM, GPU memory or disk;
            :class:`~ktflow.store.InsufficientDiskError` when one filesystem is all that is short.
    """
    if host is None and resources.probes_host:
        host = hardware.probe_host(store.existing_ancestor(Path(target).parent))
    missing = check_requirement(resources.host, host) if resources.host is not None and host is not None else []
    if missing:
        raise HostRequirementError(stage, "; ".join(missing) + ".",
                                   fix or "run this stage on a host that has them (`ktflow doctor` says what this "
                                          "host can run)")
    short = shortfalls(stage, resources, target, host)
    if len(short) == 1:
        raise short[0]
    if short:
        raise HostRequirementError(stage, "; ".join(e.reason for e in short), "free memory or disk, or run on a larger host")
    if resources.toolchain is not None:
        check_toolchain(resources.toolchain)
    return host
