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

What a stage needs of a host, and the preflight that checks it, are :mod:`ktflow.resources`.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from ktflow import store
from ktflow.errors import InvalidInputError
from ktflow.host.hardware import HostInfo
from ktflow.resources import Resources, StageName, preflight
from ktflow.store import StageManifest

Progress = Callable[[int, int], None]


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
