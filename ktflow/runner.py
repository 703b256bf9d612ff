"""One runner for every stage: each stage declares itself once, and the skeleton lives here.

A stage module declares a :class:`StageSpec`: how a request is accepted or refused and which
artifact it names (``prepare``), how that artifact is recognised as already published
(``lookup``), what a run needs of its host (``needs``: a pure function of the request and the
input sizes, so a planner can ask without running anything), the work, its verification, the
manifest and the result. :func:`run_stage` owns every step the stages share, in this order:

1. **refuse**: ``prepare`` validates the request (bad input raises, nothing is written);
2. **cache**: ``lookup`` finds the published artifact (a manifest read and a few stats, never a
   re-hash of a large folder); a target that exists but is not an artifact of ours is refused;
3. **lock**: :func:`~ktflow.store.artifact_lock` serializes writers of one artifact; inside it the
   cache is looked up again, since a concurrent run may have published it meanwhile;
4. **preflight**: ``needs(request, measure(job, resumable staging))`` is checked against this host
   (CPU ISA, GPU count and memory, RAM, free disk) before anything is written: :func:`preflight`;
5. **staging**: the directory beside the target is resumed (a resuming stage whose journal
   matches) or started afresh;
6. **work** and 7. **verify**: nothing is published when either raises; a full or read-only
   filesystem becomes a :class:`~ktflow.errors.StorageError` naming the path;
8. **publish**: ``manifest.json`` last, then the rename (:func:`~ktflow.store.publish_dir`);
9. **progress**: the caller's ``progress(done, total)`` rides on the job (:meth:`Job.report`); the
   stage reports in its own unit (bytes, layers, steps).

The stage keeps only its format and tool logic. A minimal declaration::

    SPEC = StageSpec(
        name="dequantize",
        prepare=_prepare,      # request -> Job (refuse, identify, name the target)
        lookup=_lookup,        # Job -> result of the published artifact, or None
        measure=_measure,      # (Job, resumable staging or None) -> Sizes of what is left
        needs=_needs,          # (request, Sizes) -> Resources: what the planner reads too
        work=_work,            # (Job, staging) -> None: writes into staging, job.report(done, total)
        verify=_verify,        # (Job, staging) -> None: raises when the result is wrong
        manifest=_manifest,    # Job -> StageManifest (files are listed by the runner)
        result=_result,        # (Job, published manifest) -> result
        resume=True, journal=".ktflow-dequantize.json",
    )

    def dequantize_checkpoint(src, dst, *, workers=None, fsync=True, progress=None):
        return run_stage(SPEC, DequantizeRequest(src=src, dst=dst, ...), progress=progress)

This module also holds the stage vocabulary every layer above shares: :data:`StageName`,
:data:`STAGE_ORDER`, and what a stage needs of a host's hardware (:class:`HostRequirement`,
:func:`check_requirement`, :data:`INT8_KERNELS`).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict

from ktflow import hardware, store
from ktflow.errors import HostRequirementError, InvalidInputError
from ktflow.hardware import HostInfo, variant_at_least
from ktflow.store import StageManifest
from ktflow.units import GiB, gib

StageName = Literal["download", "dequantize", "sft", "convert-lora", "quantize-int8", "serve", "evaluate"]
STAGE_ORDER: tuple[StageName, ...] = (
    "download", "dequantize", "sft", "convert-lora", "quantize-int8", "serve", "evaluate",
)

Progress = Callable[[int, int], None]
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
        if g.vram_bytes < gpu.bytes:
            return (f"{what} needs ~{gpu.bytes / GiB:.1f} GiB on each of {len(used)} GPU(s){why}; "
                    f"GPU {g.index} ({g.name}) has {g.vram_bytes / GiB:.1f} GiB")
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


# --------------------------------------------------------------------------- the declaration


RequestT = TypeVar("RequestT")
JobT = TypeVar("JobT", bound="Job[Any]")
SizesT = TypeVar("SizesT")
ResultT = TypeVar("ResultT")


@dataclass(kw_only=True)
class Job(Generic[RequestT]):
    """One run of a stage: the request ``prepare`` accepted and what the runner needs of it.

    A stage subclasses it with what its steps share (identities, plans, what the work made).
    """

    request: RequestT
    target: Path  # the artifact's final directory
    lock_dir: Path | None = None  # what the lock serializes; None: ``target``
    journal: dict[str, Any] | None = None  # a resuming stage resumes only a staging dir started with this
    fsync: bool = True
    host: HostInfo | None = None  # the host the preflight checked (None: none was needed)
    progress: Progress | None = None  # the caller's progress sink (set by the runner)
    started: float = field(default_factory=time.perf_counter)

    def seconds(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.started

    def report(self, done: int, total: int) -> None:
        """Report progress (``done`` of ``total``, in the stage's unit) to the caller, if it listens."""
        if self.progress is not None:
            self.progress(done, total)


def _nothing_to_verify(job: Any, staging: Path) -> None:
    return None


@dataclass(frozen=True, kw_only=True)
class StageSpec(Generic[RequestT, JobT, SizesT, ResultT]):
    """A stage, declared once: its inputs, cache key, resource needs, work and verification.

    Attributes:
        name: the stage's name (:data:`STAGE_ORDER`).
        prepare: ``request -> Job``: refuse bad input (raise), identify the inputs (the manifest's
            ``inputs`` and ``settings`` are the cache key) and name the target. Writes nothing.
        lookup: ``Job -> result | None``: the published artifact's result, when the target holds
            this exact artifact (or when there is nothing to make, e.g. a BF16 source).
        measure: ``(Job, staging or None) -> sizes``: the input sizes :attr:`needs` is a function
            of, counting only what is left when a resumable staging directory is given.
        needs: ``(request, sizes) -> Resources``: pure; the preflight and a planner both read it.
        work: ``(Job, staging) -> None``: write the artifact into ``staging`` (reporting progress
            through :meth:`Job.report`).
        verify: ``(Job, staging) -> None``: raise when what was made is wrong (nothing is published).
        manifest: ``Job -> StageManifest``: what the artifact is; its file list is filled in.
        result: ``(Job, published manifest) -> result``.
        resume: keep what an earlier attempt left in staging (else staging starts empty).
        journal: with ``resume``, a file in staging holding ``Job.journal``: a staging directory
            started from other inputs is discarded.
        bookkeeping: other files of the work in staging that are not part of the artifact.
        discard_on: exceptions of work/verify after which staging is removed (nothing to resume).
        host_fix: what to do when the host lacks a capability the stage needs.
    """

    name: StageName
    prepare: Callable[[RequestT], JobT]
    lookup: Callable[[JobT], ResultT | None]
    measure: Callable[[JobT, Path | None], SizesT]
    needs: Callable[[RequestT, SizesT], Resources]
    work: Callable[[JobT, Path], None]
    manifest: Callable[[JobT], StageManifest]
    result: Callable[[JobT, StageManifest], ResultT]
    verify: Callable[[JobT, Path], None] = _nothing_to_verify
    resume: bool = False
    journal: str | None = None
    bookkeeping: tuple[str, ...] = ()
    discard_on: tuple[type[BaseException], ...] = ()
    host_fix: str | None = None


# --------------------------------------------------------------------------- the runner


def run_stage(spec: StageSpec[RequestT, JobT, Any, ResultT], request: RequestT, *, progress: Progress | None = None,
              host: HostInfo | None = None) -> ResultT:
    """Run one stage: refuse, cache, lock, preflight, staging, work, verify, publish.

    Args:
        spec: the stage's declaration.
        request: the stage's typed arguments.
        progress: ``progress(done, total)``, reported by the stage (:meth:`Job.report`).
        host: the host to check the stage's needs against (default: probed when needed).

    Returns:
        The stage's result; a cache hit when the target already holds this artifact.

    Raises:
        InvalidInputError: bad input (from ``prepare``) or a target that is not a ktflow artifact.
        HostRequirementError: the host lacks what the stage needs, or the target's directory is
            not writable (before any work).
        StorageError: the filesystem filled up or became read-only mid-run; nothing published.
    """
    started = time.perf_counter()
    job = spec.prepare(request)
    job.started, job.progress = started, progress
    found = spec.lookup(job)
    if found is not None:
        return found
    refuse_foreign_target(job.target)
    with store.artifact_lock(job.lock_dir or job.target):
        found = spec.lookup(job)  # a run that held the lock may have published it
        if found is not None:
            return found
        return _make(spec, job, host)


def refuse_foreign_target(target: Path) -> None:
    """Refuse to write over something that is not a ktflow artifact (an empty directory is fine).

    Raises:
        InvalidInputError: naming the target.
    """
    target = Path(target)
    if not target.exists():
        return
    if target.is_dir() and (store.read_manifest(target) is not None or not any(target.iterdir())):
        return
    raise InvalidInputError(str(target), "exists and is not a ktflow artifact; refusing to replace it.",
                            "choose a new output directory, or remove this one.")


def _make(spec: StageSpec[Any, JobT, Any, ResultT], job: JobT, host: HostInfo | None) -> ResultT:
    staging = store.staging_dir_for(job.target)
    resumable = _resumable(spec, job, staging)
    resources = spec.needs(job.request, spec.measure(job, staging if resumable else None))
    with store.storage_errors(job.target, need=resources.artifact_bytes):
        job.host = preflight(spec.name, resources, job.target, host=host, fix=spec.host_fix)
        _open_staging(spec, job, staging, resumable)
        try:
            spec.work(job, staging)
            spec.verify(job, staging)
            manifest = spec.manifest(job)
            for name in (spec.journal, *spec.bookkeeping):
                if name:
                    (staging / name).unlink(missing_ok=True)
            _remove_placeholder(job.target)
            published = store.publish_dir(staging, job.target, manifest, fsync=job.fsync)
        except spec.discard_on:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return spec.result(job, published)


def _resumable(spec: StageSpec[Any, Any, Any, Any], job: Job[Any], staging: Path) -> bool:
    """Whether ``staging`` holds an earlier attempt at this very artifact, to be resumed."""
    if not spec.resume or not staging.is_dir():
        return False
    if spec.journal is None:
        return True
    try:
        return json.loads((staging / spec.journal).read_text()) == job.journal
    except (OSError, ValueError):
        return False


def _open_staging(spec: StageSpec[Any, Any, Any, Any], job: Job[Any], staging: Path, resumable: bool) -> None:
    if staging.exists() and not resumable:
        shutil.rmtree(staging)
    staging.mkdir(parents=True, exist_ok=True)
    if spec.journal is not None and not (staging / spec.journal).exists():
        store.atomic_write_json(staging / spec.journal, job.journal, fsync=job.fsync)


def _remove_placeholder(target: Path) -> None:
    """An empty directory where the artifact goes (made by a user beforehand) gives way to it."""
    if target.is_dir() and store.read_manifest(target) is None and not any(target.iterdir()):
        target.rmdir()


def find_published(target: Path, stage: StageName, *, inputs: dict[str, str] | None = None,
                   settings: dict[str, Any] | None = None, tools: dict[str, str] | None = None,
                   intact: bool = False) -> StageManifest | None:
    """The manifest at ``target`` when it is this stage's artifact with these identities, else None.

    Args:
        inputs, settings, tools: compared when given (a cache key is what a stage compares).
        intact: also require every listed file at its listed size (a stat per file, no hashing).
    """
    manifest = store.read_manifest(target) if Path(target).is_dir() else None
    if manifest is None or manifest.stage != stage:
        return None
    for wanted, have in ((inputs, manifest.inputs), (settings, manifest.settings), (tools, manifest.tools)):
        if wanted is not None and wanted != have:
            return None
    if intact and damaged_files(target, manifest):
        return None
    return manifest


def damaged_files(target: Path, manifest: StageManifest) -> list[str]:
    """The files of a published artifact that are missing or not at their listed size."""
    damaged = []
    for entry in manifest.files:
        path = Path(target) / entry.path
        try:
            if not path.is_file() or path.stat().st_size != entry.size:
                damaged.append(entry.path)
        except OSError:
            damaged.append(entry.path)
    return damaged
