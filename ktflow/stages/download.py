"""The download stage: fetch the base checkpoint, verify every byte, publish it atomically.

Three kinds of source (``SourceConfig`` sets exactly one):

* **Hub** (``repo_id``): the revision is resolved to a commit sha first, and everything after
  that is pinned to the sha, so a branch that moves mid-download cannot mix two commits. The
  file listing (sizes, LFS sha256, git blob ids) drives a free-disk preflight and the final
  verification; ``huggingface_hub.snapshot_download`` does the transfer into the stage's
  deterministic staging directory, so a rerun after a crash skips every file that finished.
  Output: ``store_root/weights/<owner>--<name>@<sha>/`` (plus ``+<patterns-digest>`` when
  ``allow_patterns`` selects a subset, so two subsets of one commit never overwrite each other).
* **Local / NFS path** (``local_path``): nothing is copied. The directory's identity is every
  file's size plus a sampled sha256 (first, middle and last MiB), and a small reference
  artifact ``weights/local-<digest>/manifest.json`` points back at the source.
* **fsspec URI** (``uri``: ``s3://``, ``gs://``, ``file://``, ``memory://``, ...): copied with
  fsspec into staging (resuming partial files), sizes verified, sha256 recorded, published
  as ``weights/uri-<digest>/``.

Secrets: the hub token comes from the ``token`` argument or ``HF_TOKEN``. It is passed to
huggingface_hub and nowhere else: it is not logged, not written to the manifest, not in
:class:`DownloadResult`, and scrubbed from every message this module builds.

This module never imports Prefect; the Prefect task around it adds caching and artifacts.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import json
import logging
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path
from typing import Any, TypeVar

import huggingface_hub
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import filter_repo_objects
from pydantic import BaseModel, ConfigDict

from ktflow.errors import (
    CheckpointError,
    ChecksumMismatchError,
    DownloadError,
    HostRequirementError,
    InsufficientDiskError,
    KtflowError,
    SourceAccessError,
)
from ktflow.recipe import SourceConfig
from ktflow.resources import DiskNeed, Resources
from ktflow.runner import Job, Progress, StageSpec, damaged_files, find_published, run_stage
from ktflow.store import FileEntry, StageManifest, StoreLayout
from ktflow.units import human_bytes

__all__ = [
    "DOWNLOAD_HUB",
    "DOWNLOAD_LOCAL",
    "DOWNLOAD_URI",
    "ChecksumMismatchError",
    "DownloadError",
    "DownloadRequest",
    "DownloadResult",
    "DownloadSizes",
    "InsufficientDiskError",
    "SourceAccessError",
    "download_checkpoint",
    "download_needs",
    "resolve_revision",
]

log = logging.getLogger(__name__)

STAGE = "download"
# huggingface_hub's per-local_dir bookkeeping (download metadata, locks, tree listing cache,
# orphaned .incomplete files). Needed to resume; removed before publishing, see _finalize_staging.
HF_BOOKKEEPING = Path(".cache") / "huggingface"
# Top-level folders of a source directory that are not part of a checkpoint.
_NOT_CHECKPOINT_DIRS = frozenset({".cache", ".git"})

# Retries: exponential backoff with jitter, capped. Module-level so tests can shrink them.
RETRY_BASE_DELAY_S = 2.0
RETRY_MAX_DELAY_S = 120.0
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_sleep = time.sleep

SAMPLE_BYTES = 1 << 20  # local identity: sha256 of the first, middle and last MiB
HASH_CHUNK = 8 << 20
PROGRESS_INTERVAL_S = 2.0
# huggingface_hub 2.4 names temp files <etag>.<random>.incomplete and deletes them on failure,
# so one left behind belongs to a killed process and is never reused; older ones are removed.
STALE_INCOMPLETE_S = 600.0
_COPY_PART_SUFFIX = ".ktflow-part"

_SHA_RE = re.compile(r"^[0-9a-f]{40}$")

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# Errors and result
# ---------------------------------------------------------------------------------------------


class DownloadResult(BaseModel):
    """Where the checkpoint is and what it is.

    ``revision`` is the hub commit sha, or ``local-<digest>`` / ``uri-<digest>`` for other
    sources. ``manifest_digest`` is the artifact's cache key for the stages downstream.
    """

    model_config = ConfigDict(frozen=True)

    path: Path
    revision: str
    files: int
    bytes: int
    manifest_digest: str
    cached: bool


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def resolve_revision(repo_id: str, revision: str, *, token: str | None = None, endpoint: str | None = None,
                     max_retries: int = 5) -> str:
    """Resolve a branch, tag or (short) sha of a hub model repo to its full 40-hex commit sha.

    A full sha is passed through after the hub confirms it exists in the repo. Network errors
    (connection, timeout, 5xx, 429) are retried; an unknown repo/revision or a refused token
    raises :class:`SourceAccessError` at once.

    Deliberately not ``HfApi.resolve_revision``: that one falls back to a ref cached under
    ``~/.cache/huggingface`` when the hub is unreachable, which could silently pin a stale commit.
    """
    token = _resolve_token(token)
    api = HfApi(endpoint=endpoint)

    def call() -> str | None:
        return api.model_info(repo_id, revision=revision, token=token).sha

    try:
        sha = _with_retries(call, what=f"resolving {repo_id}@{revision}", max_retries=max_retries, token=token)
    except KtflowError:
        raise
    except Exception as exc:
        raise _translate_error(exc, repo_id=repo_id, revision=revision, token=token, max_retries=max_retries) from exc
    if not sha or not _SHA_RE.match(sha):
        raise DownloadError(f"the hub answered for {repo_id}@{revision} without a commit sha (got {sha!r})")
    if _SHA_RE.match(revision.lower()) and sha != revision.lower():
        raise DownloadError(f"asked the hub for commit {revision} of {repo_id} and it answered {sha}")
    if sha != revision:
        log.info("resolved %s@%s to commit %s", repo_id, revision, sha)
    return sha


def download_checkpoint(
    source: SourceConfig,
    store_root: Path,
    *,
    token: str | None = None,
    endpoint: str | None = None,
    max_workers: int = 8,
    max_retries: int = 5,
    progress: Progress | None = None,
) -> DownloadResult:
    """Fetch (or reference) the recipe's source checkpoint, verify it, and publish it.

    Args:
        source: the recipe's ``source`` section.
        store_root: the artifact store; output goes under ``store_root/weights/``.
        token: hub token; defaults to ``HF_TOKEN`` (then huggingface_hub's saved login).
        endpoint: hub endpoint (a mirror, or a test server); defaults to ``HF_ENDPOINT``.
        max_workers: parallel file transfers and hash computations.
        max_retries: retries of a network failure, with exponential backoff and jitter.
        progress: ``progress(done_bytes, total_bytes)``, called as files complete. For hub
            sources it is called from a helper thread while the transfer runs.

    Returns:
        :class:`DownloadResult`; ``cached=True`` when an identical artifact was already published.

    Raises:
        SourceAccessError, CheckpointError, InsufficientDiskError: bad input (exit code 2).
        ChecksumMismatchError, DownloadError: the transfer failed (exit code 1).
    """
    spec = DOWNLOAD_HUB if source.repo_id is not None else DOWNLOAD_LOCAL if source.local_path is not None else DOWNLOAD_URI
    request = DownloadRequest(source=source, store_root=Path(store_root), token=_resolve_token(token), endpoint=endpoint,
                              max_workers=max_workers, max_retries=max_retries)
    return run_stage(spec, request, progress=progress)


# ---------------------------------------------------------------------------------------------
# The stage: what every source shares
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DownloadRequest:
    """The download stage's arguments (see :func:`download_checkpoint`). The token is left out of its repr."""

    source: SourceConfig
    store_root: Path
    token: str | None = field(default=None, repr=False)
    endpoint: str | None = None
    max_workers: int = 8
    max_retries: int = 5


class DownloadSizes(BaseModel):
    """What the download's disk need is a function of."""

    bytes: int  # the selected files of the source
    done_bytes: int = 0  # complete files an interrupted attempt left in staging
    copied: bool = True  # False: a local source is referenced where it is, nothing is copied


_DISK_FIX = "free space there, or point store.root at a larger filesystem, or narrow source.allow_patterns."


def download_needs(request: DownloadRequest, sizes: DownloadSizes) -> Resources:
    """Disk only, exactly what is still missing (a checkpoint's files are few and large)."""
    if not sizes.copied:
        return Resources()
    return Resources(disk=(DiskNeed(bytes=sizes.bytes - sizes.done_bytes, overhead=1.0, what="the download still",
                                    fix=_DISK_FIX),),
                     artifact_bytes=sizes.bytes)


@dataclass(kw_only=True)
class _Job(Job[DownloadRequest]):
    revision: str  # the commit sha, or local-<digest> / uri-<digest>
    settings: dict[str, Any]
    entries: list[FileEntry] = field(default_factory=list)  # the verified files, for the manifest


def _lookup_copy(job: _Job) -> DownloadResult | None:
    """A hub or URI download already published: its manifest, and every file at its size."""
    hit = _cache_hit(job.target, job.settings)
    return None if hit is None else _report_hit(hit, job)


def _measure_copy(job: _HubJob | _UriJob, resumed: Path | None) -> DownloadSizes:
    sizes = job.sizes()
    done = sum(size for rel, size in sizes.items() if resumed is not None and _has_size(resumed / rel, size))
    return DownloadSizes(bytes=sum(sizes.values()), done_bytes=done)


def _published(job: _Job, manifest: StageManifest) -> DownloadResult:
    total = sum(e.size for e in manifest.files)
    job.report(total, total)
    log.info("published %s (%d files, %s)", job.target, len(manifest.files), human_bytes(total))
    return DownloadResult(path=job.target, revision=job.revision, files=len(manifest.files), bytes=total,
                          manifest_digest=manifest.digest(), cached=False)


# ---------------------------------------------------------------------------------------------
# Hub source
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _HubFile:
    """One file of the pinned commit, as the hub lists it."""

    path: str
    size: int
    blob_id: str  # git blob sha1 of the content for regular files (of the pointer for LFS)
    lfs_sha256: str | None


@dataclass(kw_only=True)
class _HubJob(_Job):
    repo_id: str
    patterns: list[str] | None

    @cached_property
    def selected(self) -> list[_HubFile]:
        """The commit's files the patterns select (one listing, on the first use only)."""
        request, sha = self.request, self.revision
        api = HfApi(endpoint=request.endpoint)
        try:
            listing = _with_retries(
                lambda: _list_hub_files(api, self.repo_id, sha, request.token),
                what=f"listing {self.repo_id}@{sha}", max_retries=request.max_retries, token=request.token,
            )  # fmt: skip
        except KtflowError:
            raise
        except Exception as exc:
            raise _translate_error(exc, repo_id=self.repo_id, revision=sha, token=request.token,
                                   max_retries=request.max_retries) from exc
        # filter_repo_objects is what snapshot_download filters with: both select the same files.
        selected = list(filter_repo_objects(listing, allow_patterns=self.patterns, key=lambda f: f.path))
        if not selected:
            raise _nothing_selected(self.repo_id, sha, self.patterns, len(listing))
        return selected

    def sizes(self) -> dict[str, int]:
        return {f.path: f.size for f in self.selected}


def _nothing_selected(repo_id: str, sha: str, patterns: list[str] | None, listed: int) -> SourceAccessError:
    if patterns:
        return SourceAccessError(
            "source.allow_patterns", f"no file of {repo_id}@{sha} matches {patterns} ({listed} files in the repo)",
            fix="fix the patterns (globs relative to the repo root, e.g. '*.safetensors', 'config.json').")
    return SourceAccessError(f"source.repo_id: {repo_id}", f"{repo_id}@{sha} holds no files",
                             fix="check the repo id and revision.")


def _prepare_hub(request: DownloadRequest) -> _HubJob:
    repo_id = request.source.repo_id
    assert repo_id is not None
    # Resolve first: everything below, the directory name included, is pinned to the sha.
    sha = resolve_revision(repo_id, request.source.revision, token=request.token, endpoint=request.endpoint,
                           max_retries=request.max_retries)
    patterns = _normalize_patterns(request.source.allow_patterns)
    final = StoreLayout(request.store_root).weights(_hub_dir_name(repo_id, sha, patterns))
    return _HubJob(request=request, target=final, revision=sha, repo_id=repo_id, patterns=patterns,
                   settings={"repo_id": repo_id, "revision": sha, "allow_patterns": patterns})


def _fetch_hub(job: _HubJob, staging: Path) -> None:
    request, selected = job.request, job.selected
    _remove_stale_incomplete(staging)
    # Only complete files from an earlier attempt count as done (hf renames a file into place once
    # all of it arrived); they are still hashed afterwards like the rest.
    total = sum(f.size for f in selected)
    job.report(sum(f.size for f in selected if _has_size(staging / f.path, f.size)), total)

    def fetch() -> None:
        snapshot_download(job.repo_id, revision=job.revision, local_dir=staging, allow_patterns=job.patterns,
                          token=request.token, endpoint=request.endpoint, max_workers=request.max_workers)
        # snapshot_download returns an existing non-empty local_dir, with only a warning, when
        # the hub cannot be reached for the listing: a partial staging dir is not success.
        missing = [f.path for f in selected if not (staging / f.path).is_file()]
        if missing:
            raise _IncompleteFetch(missing)

    with _ProgressPoller(job.progress, [(staging / f.path, f.size) for f in selected], total):
        try:
            _with_retries(fetch, what=f"downloading {job.repo_id}@{job.revision}", max_retries=request.max_retries,
                          token=request.token)
        except KtflowError:
            raise
        except Exception as exc:
            _reraise_storage_error(exc)
            raise _translate_error(exc, repo_id=job.repo_id, revision=job.revision, token=request.token,
                                   max_retries=request.max_retries) from exc


def _verify_hub(job: _HubJob, staging: Path) -> None:
    job.entries = _verify_hub_files(staging, job.selected, max_workers=job.request.max_workers)
    _finalize_staging(staging, {f.path for f in job.selected})


def _hub_manifest(job: _HubJob) -> StageManifest:
    return StageManifest(
        stage=STAGE,
        inputs={"source": f"hf://{job.repo_id}@{job.revision}"},
        settings=job.settings,
        tools={"huggingface_hub": huggingface_hub.__version__},
        files=job.entries,
        # The requested ref ("main") is deliberately not recorded: pinning the same commit by
        # name or by sha must give the same manifest digest, or every downstream stage of a
        # 600 GB model would recompute. The resolution is logged instead.
        extra={"source": "hub", "repo_id": job.repo_id, "revision": job.revision,
               "total_bytes": sum(f.size for f in job.selected)},
    )


DOWNLOAD_HUB: StageSpec[DownloadRequest, _HubJob, DownloadSizes, DownloadResult] = StageSpec(
    name=STAGE, prepare=_prepare_hub, lookup=_lookup_copy, measure=_measure_copy, needs=download_needs,
    work=_fetch_hub, verify=_verify_hub, manifest=_hub_manifest, result=_published,
    resume=True,  # the staging directory is named by the commit: finished files are kept
)
"""The download stage for a hub source (``source.repo_id``), declared for the runner."""


def _list_hub_files(api: HfApi, repo_id: str, sha: str, token: str | None) -> list[_HubFile]:
    """Every file of the commit with its size and hashes.

    ``list_repo_tree(recursive=True)`` carries ``lfs`` (sha256, size) without ``expand=True``;
    expand only adds last-commit and security-scan data and cuts the page size from 1000 to 50.
    """
    files = []
    for item in api.list_repo_tree(repo_id, recursive=True, revision=sha, token=token):
        if isinstance(item, RepoFile):
            lfs_sha = item.lfs.sha256 if item.lfs is not None else None
            size = item.lfs.size if item.lfs is not None else item.size
            files.append(_HubFile(path=item.path, size=size, blob_id=item.blob_id, lfs_sha256=lfs_sha))
    return files


def _verify_hub_files(staging: Path, files: list[_HubFile], *, max_workers: int) -> list[FileEntry]:
    """Check each file's size and hash against the listing; delete the ones that differ.

    LFS files are checked by sha256, regular files by their git blob sha1 (the listing's
    ``oid``); the sha256 of every file goes into the manifest either way.
    """

    def check(f: _HubFile) -> tuple[FileEntry | None, tuple[str, str, str, str] | None]:
        path = staging / f.path
        size = path.stat().st_size
        if size != f.size:
            return None, (f.path, "size", str(f.size), str(size))
        sha256, blob = _hash_file(path, git_blob=f.lfs_sha256 is None)
        if f.lfs_sha256 is not None and sha256 != f.lfs_sha256:
            return None, (f.path, "sha256", f.lfs_sha256, sha256)
        if f.lfs_sha256 is None and blob != f.blob_id:
            return None, (f.path, "git blob sha1", f.blob_id, str(blob))
        return FileEntry(path=f.path, size=size, sha256=sha256), None

    results = _parallel(check, files, max_workers)
    bad = [m for _, m in results if m is not None]
    if bad:
        for path, *_ in bad:
            _delete_hub_file(staging, path)
        raise ChecksumMismatchError(bad)
    return sorted((e for e, _ in results if e is not None), key=lambda e: e.path)


def _delete_hub_file(staging: Path, rel: str) -> None:
    """Remove a bad file and huggingface_hub's record of it, so the next run refetches it."""
    (staging / rel).unlink(missing_ok=True)
    (staging / HF_BOOKKEEPING / "download" / f"{rel}.metadata").unlink(missing_ok=True)


def _hub_dir_name(repo_id: str, sha: str, patterns: list[str] | None) -> str:
    name = f"{repo_id.replace('/', '--')}@{sha}"
    if patterns is not None:
        # A subset of a commit is a different artifact: never let it replace the full one.
        name += "+" + _digest_json(patterns)[:12]
    return name


class _IncompleteFetch(Exception):
    """snapshot_download returned while files were still missing (retryable)."""

    def __init__(self, missing: list[str]) -> None:
        self.missing = missing
        shown = ", ".join(missing[:5]) + (f", ... ({len(missing) - 5} more)" if len(missing) > 5 else "")
        super().__init__(f"{len(missing)} file(s) still missing after the transfer: {shown}")


# ---------------------------------------------------------------------------------------------
# Local / NFS source
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class _LocalJob(_Job):
    src: Path
    identity: str
    sizes: dict[str, int]
    extra: dict[str, Any]


def _local_files(source: SourceConfig, src: Path) -> list[str]:
    """The checkpoint's files the patterns select, refusing a directory that is not a checkpoint."""
    if not src.is_dir():
        raise CheckpointError(
            str(src), "does not exist or is not a directory",
            fix="set source.local_path to the checkpoint directory (the one holding config.json).",
        )  # fmt: skip
    if not (src / "config.json").is_file():
        raise CheckpointError(
            str(src / "config.json"), "is missing: a checkpoint directory holds the model's config.json",
            fix="point source.local_path at the directory that holds config.json and the weight files.",
        )  # fmt: skip
    patterns = _normalize_patterns(source.allow_patterns)
    rels = list(filter_repo_objects(_walk_checkpoint(src), allow_patterns=patterns))
    if not rels:  # only possible with patterns: config.json exists
        raise SourceAccessError(
            "source.allow_patterns", f"no file of {src} matches {patterns}",
            fix="fix the patterns (globs relative to the checkpoint directory).",
        )  # fmt: skip
    return rels


def _prepare_local(request: DownloadRequest) -> _LocalJob:
    """Identify a local checkpoint (sizes and sampled hashes); nothing is copied."""
    assert request.source.local_path is not None
    src = Path(request.source.local_path).expanduser().absolute()
    rels = _local_files(request.source, src)
    stats = {rel: _size_mtime(src / rel) for rel in rels}
    sizes = {rel: st[0] for rel, st in stats.items()}
    sampled = dict(zip(rels, _parallel(lambda rel: _sampled_hash(src / rel, sizes[rel]), rels, request.max_workers)))
    changed = [rel for rel in rels if _size_mtime(src / rel) != stats[rel]]
    if changed:  # an identity half from the old files, half from the new ones would name neither
        raise DownloadError(f"{src}: {', '.join(changed[:5])} changed while the checkpoint was being identified; "
                            "nothing was published. Rerun once the source is stable.")
    patterns = _normalize_patterns(request.source.allow_patterns)
    identity = _digest_json(
        {"allow_patterns": patterns, "sample_bytes": SAMPLE_BYTES, "files": [[r, sizes[r], sampled[r]] for r in rels]}
    )
    revision = f"local-{identity[:16]}"
    extra: dict[str, Any] = {
        "source": "local",
        # The files listed in this manifest live here, not in the artifact's directory.
        "source_path": str(src),
        "sampled_hashes": sampled,
        "sample_bytes": SAMPLE_BYTES,
        "total_bytes": sum(sizes.values()),
    }
    return _LocalJob(request=request, target=StoreLayout(request.store_root).weights(revision), revision=revision,
                     settings={"identity": identity, "allow_patterns": patterns}, src=src, identity=identity,
                     sizes=sizes, extra=extra)


def _local_result(job: _LocalJob, manifest: StageManifest, *, cached: bool) -> DownloadResult:
    total = sum(job.sizes.values())
    job.report(total, total)
    return DownloadResult(path=job.src, revision=job.revision, files=len(job.sizes), bytes=total,
                          manifest_digest=manifest.digest(), cached=cached)


def _lookup_local(job: _LocalJob) -> DownloadResult | None:
    existing = find_published(job.target, STAGE, settings=job.settings)
    # Same content at another path is republished so source_path always points at this copy.
    if existing is None or existing.extra.get("source_path") != str(job.src):
        return None
    return _local_result(job, existing, cached=True)


def _local_manifest(job: _LocalJob) -> StageManifest:
    return StageManifest(
        stage=STAGE,
        inputs={"source": f"local://{job.identity}"},
        settings=job.settings,
        files=[FileEntry(path=r, size=size) for r, size in job.sizes.items()],
        extra=job.extra,
    )


DOWNLOAD_LOCAL: StageSpec[DownloadRequest, _LocalJob, DownloadSizes, DownloadResult] = StageSpec(
    name=STAGE, prepare=_prepare_local, lookup=_lookup_local, needs=download_needs, manifest=_local_manifest,
    measure=lambda job, resumed: DownloadSizes(bytes=sum(job.sizes.values()), copied=False),
    work=lambda job, staging: None,  # a reference: the manifest is the whole artifact
    result=lambda job, manifest: _local_result(job, manifest, cached=False),
)
"""The download stage for a local or NFS source (``source.local_path``): a reference artifact."""


def _size_mtime(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _sampled_hash(path: Path, size: int) -> str:
    """sha256 of the size and the first, middle and last MiB (the whole file if <= 3 MiB).

    Cheap on a 600 GB NFS checkpoint (3 MiB per file), and it catches what actually happens
    to checkpoints: a different or truncated file (size), a re-quantized or re-saved shard
    (the safetensors header at the start, data in the middle and end). A change confined to
    bytes outside the samples goes unnoticed; that is the price of not reading 600 GB.
    """
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= 3 * SAMPLE_BYTES:
            for chunk in iter(lambda: f.read(HASH_CHUNK), b""):
                h.update(chunk)
        else:
            for offset in (0, size // 2 - SAMPLE_BYTES // 2, size - SAMPLE_BYTES):
                f.seek(offset)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def _walk_checkpoint(root: Path) -> list[str]:
    """Relative posix paths of the regular files below ``root`` (symlinks to files followed,
    as in a hub cache snapshot), without huggingface_hub/git bookkeeping folders."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here == root:
            dirnames[:] = [d for d in dirnames if d not in _NOT_CHECKPOINT_DIRS]
        dirnames.sort()
        for name in sorted(filenames):
            path = here / name
            if path.is_file():
                out.append(path.relative_to(root).as_posix())
    return sorted(out)


# ---------------------------------------------------------------------------------------------
# fsspec URI source
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class _UriJob(_Job):
    uri: str
    fs: Any
    root: str
    rels: list[str]
    listing: dict[str, tuple[int, str]]  # relative path -> (size, version token)
    hashes: dict[str, str] = field(default_factory=dict)

    def sizes(self) -> dict[str, int]:
        return {r: self.listing[r][0] for r in self.rels}

    def relist(self) -> dict[str, tuple[int, str]]:
        """The source's listing now (``listing`` is the one the identity was made from)."""
        return _list_source(self.fs, self.root, self.uri, self.request.max_retries, first=False)


def _list_source(fs: Any, root: str, uri: str, max_retries: int, *, first: bool) -> dict[str, tuple[int, str]]:
    try:
        return _with_retries(lambda: _list_uri(fs, root), what=f"listing {uri}", max_retries=max_retries, token=None)
    except FileNotFoundError as exc:
        if first:
            raise SourceAccessError("source.uri", f"{uri} does not exist", fix="fix the URL.") from exc
        raise DownloadError(f"listing {uri} failed: {type(exc).__name__}: {exc}") from exc
    except KtflowError:
        raise
    except Exception as exc:
        raise DownloadError(f"listing {uri} failed: {type(exc).__name__}: {exc}") from exc


def _prepare_uri(request: DownloadRequest) -> _UriJob:
    """List the source (one listing: sizes and version tokens) and name the artifact by it."""
    import fsspec  # only this source needs it

    uri = request.source.uri
    assert uri is not None
    try:
        fs, root = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as exc:
        raise SourceAccessError(
            "source.uri", f"cannot open {uri!r}: {exc}", fix="install the fsspec backend for this scheme, or fix the URL."
        ) from exc
    root = root.rstrip("/")
    patterns = _normalize_patterns(request.source.allow_patterns)
    listing = _list_source(fs, root, uri, request.max_retries, first=True)
    rels = list(filter_repo_objects(sorted(listing), allow_patterns=patterns))
    rels = [r for r in rels if r.split("/", 1)[0] not in _NOT_CHECKPOINT_DIRS]
    if not rels:
        raise SourceAccessError(
            "source.uri", f"{uri} holds no files" + (f" matching {patterns}" if patterns else ""),
            fix="point source.uri at the checkpoint directory, or fix source.allow_patterns.",
        )  # fmt: skip
    # Identity before copying, from what the listing says (sizes + the backend's version token:
    # ETag, md5, generation or mtime), so a cache check costs one listing, not a copy.
    identity = _digest_json({"uri": uri, "allow_patterns": patterns, "files": [[r, *listing[r]] for r in rels]})
    revision = f"uri-{identity[:16]}"
    return _UriJob(request=request, target=StoreLayout(request.store_root).weights(revision), revision=revision,
                   settings={"uri": uri, "allow_patterns": patterns, "identity": identity}, uri=uri, fs=fs, root=root,
                   rels=rels, listing=listing)


def _copy_uri(job: _UriJob, staging: Path) -> None:
    """Copy every selected file into staging (resuming partial copies), hashing as it goes."""
    request, sizes = job.request, job.sizes()
    done_files = {r for r in job.rels if _has_size(staging / r, sizes[r])}
    lock, total = threading.Lock(), sum(sizes.values())
    done = sum(sizes[r] for r in done_files)
    job.report(done, total)

    def fetch(rel: str) -> tuple[str, str]:
        nonlocal done
        dest = staging / rel
        if rel in done_files:
            return rel, _hash_file(dest, git_blob=False)[0]
        digest = _with_retries(
            lambda: _copy_resumable(job.fs, f"{job.root}/{rel}", dest, sizes[rel]),
            what=f"copying {job.uri}/{rel}", max_retries=request.max_retries, token=None,
        )  # fmt: skip
        with lock:
            done += sizes[rel]
            job.report(done, total)
        return rel, digest

    try:
        job.hashes = dict(_parallel(fetch, job.rels, request.max_workers))
    except KtflowError:
        raise
    except Exception as exc:
        _reraise_storage_error(exc)
        raise DownloadError(f"copying {job.uri} failed: {type(exc).__name__}: {exc}") from exc


def _verify_uri(job: _UriJob, staging: Path) -> None:
    """The copies must all be of the listed versions: a file rewritten meanwhile would mix two."""
    relisted = job.relist()
    changed = [r for r in job.rels if relisted.get(r) != job.listing[r]]
    if changed:  # this staging dir belongs to a version that no longer exists: nothing to resume
        shutil.rmtree(staging, ignore_errors=True)
        raise DownloadError(f"{job.uri}: {', '.join(changed[:5])} changed while being copied; nothing was "
                            "published. Rerun once the source is stable.")
    _finalize_staging(staging, set(job.rels))


def _uri_manifest(job: _UriJob) -> StageManifest:
    import fsspec

    sizes = job.sizes()
    return StageManifest(
        stage=STAGE,
        inputs={"source": f"{job.uri}#{job.settings['identity']}"},
        settings=job.settings,
        tools={"fsspec": fsspec.__version__},
        files=[FileEntry(path=r, size=sizes[r], sha256=job.hashes[r]) for r in job.rels],
        extra={"source": "uri", "uri": job.uri, "total_bytes": sum(sizes.values())},
    )


DOWNLOAD_URI: StageSpec[DownloadRequest, _UriJob, DownloadSizes, DownloadResult] = StageSpec(
    name=STAGE, prepare=_prepare_uri, lookup=_lookup_copy, measure=_measure_copy, needs=download_needs,
    work=_copy_uri, verify=_verify_uri, manifest=_uri_manifest, result=_published,
    resume=True,  # the staging directory is named by the listing's identity: finished files are kept
)
"""The download stage for an fsspec source (``source.uri``), declared for the runner."""


# Listing fields that change when an object changes, by backend (s3, gcs, local, memory, ...).
_VERSION_KEYS = (
    "ETag", "etag", "md5Hash", "generation", "version_id", "VersionId",
    "mtime", "LastModified", "last_modified", "created",
)  # fmt: skip


def _list_uri(fs: Any, root: str) -> dict[str, tuple[int, str]]:
    """relative path -> (size, version token) for every file below ``root``."""
    if not fs.isdir(root):
        raise FileNotFoundError(root)
    found = fs.find(root, detail=True, withdirs=False)
    out: dict[str, tuple[int, str]] = {}
    for path, info in found.items():
        rel = path.rstrip("/")[len(root) :].lstrip("/") if path.startswith(root) else path
        version = next((str(info[k]) for k in _VERSION_KEYS if info.get(k) is not None), "")
        out[rel] = (int(info["size"]), version)
    return out


def _copy_resumable(fs: Any, remote: str, dest: Path, size: int) -> str:
    """Copy one file, appending to a partial copy left by an interrupted attempt; return its sha256."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + _COPY_PART_SUFFIX)
    h = hashlib.sha256()
    have = part.stat().st_size if part.exists() else 0
    if have > size:
        part.unlink()
        have = 0
    if have:
        with open(part, "rb") as f:
            for chunk in iter(lambda: f.read(HASH_CHUNK), b""):
                h.update(chunk)
    with fs.open(remote, "rb") as src, open(part, "ab") as out:
        if have:
            src.seek(have)
        for chunk in iter(lambda: src.read(HASH_CHUNK), b""):
            out.write(chunk)
            h.update(chunk)
    got = part.stat().st_size
    if got != size:
        # Not a network error (the stream ended cleanly): the source changed or lies. Deleting
        # the partial copy makes a rerun start this file over rather than append to it.
        part.unlink()
        raise ChecksumMismatchError([(remote, "size", str(size), str(got))])
    os.replace(part, dest)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------


def _resolve_token(token: str | None) -> str | None:
    # None lets huggingface_hub fall back to its saved login (`hf auth login`).
    return token or os.environ.get("HF_TOKEN") or None


def _scrub(text: str, token: str | None) -> str:
    """Remove the token from a message we are about to log or raise (defence in depth)."""
    return text.replace(token, "***") if token else text


def _normalize_patterns(patterns: list[str] | None) -> list[str] | None:
    """Sorted, de-duplicated: the same set of globs is the same artifact, whatever the order."""
    return sorted(set(patterns)) if patterns else None


def _digest_json(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.is_file() and path.stat().st_size == size
    except OSError:
        return False


def _cache_hit(final: Path, settings: dict[str, Any]) -> StageManifest | None:
    """The published manifest if ``final`` holds this exact artifact, complete.

    A hit costs a manifest read and one stat per file: a large folder is never re-hashed
    on a cache check (the hashes were verified when it was published).
    """
    manifest = find_published(final, STAGE, settings=settings)
    if manifest is None:
        return None
    damaged = damaged_files(final, manifest)
    if damaged:
        log.warning(
            "%s is published but %d file(s) are missing or resized (%s); fetching it again", final, len(damaged), damaged[:3]
        )
        return None
    return manifest


def _report_hit(manifest: StageManifest, job: _Job) -> DownloadResult:
    total = sum(e.size for e in manifest.files)
    job.report(total, total)
    log.info("cache hit: %s", job.target)
    return DownloadResult(
        path=job.target, revision=job.revision, files=len(manifest.files), bytes=total,
        manifest_digest=manifest.digest(), cached=True,
    )  # fmt: skip


def _finalize_staging(staging: Path, keep: set[str]) -> None:
    """Leave only the checkpoint's files in staging before it is published.

    huggingface_hub's ``.cache/huggingface`` folder (download metadata, locks, the tree listing
    cache) is removed rather than excluded from the manifest: it only serves resuming, and a
    published artifact is never resumed. Stray files (partial copies, leftovers of an earlier
    attempt) go too, so the directory holds exactly what the manifest lists.
    """
    shutil.rmtree(staging / HF_BOOKKEEPING, ignore_errors=True)
    for path in sorted(staging.rglob("*"), reverse=True):
        rel = path.relative_to(staging).as_posix()
        if path.is_dir() and not path.is_symlink():
            if not any(path.iterdir()):
                path.rmdir()
        elif rel not in keep:
            log.info("removing %s from staging: not part of the checkpoint", rel)
            path.unlink()


def _remove_stale_incomplete(staging: Path) -> None:
    """Delete temp files of killed downloads: hf never reuses them and they hold disk space."""
    download_dir = staging / HF_BOOKKEEPING / "download"
    if not download_dir.is_dir():
        return
    now = time.time()
    for path in download_dir.rglob("*.incomplete"):
        try:
            if now - path.stat().st_mtime > STALE_INCOMPLETE_S:
                path.unlink()
        except OSError:
            pass


def _hash_file(path: Path, *, git_blob: bool) -> tuple[str, str | None]:
    """sha256 of the file and, if asked, its git blob sha1, in one read."""
    size = path.stat().st_size
    sha256 = hashlib.sha256()
    sha1 = hashlib.sha1(b"blob %d\0" % size) if git_blob else None
    with open(path, "rb") as f:
        # hashlib releases the GIL on large buffers, so a thread pool hashes files in parallel.
        for chunk in iter(lambda: f.read(HASH_CHUNK), b""):
            sha256.update(chunk)
            if sha1 is not None:
                sha1.update(chunk)
    return sha256.hexdigest(), sha1.hexdigest() if sha1 is not None else None


R = TypeVar("R")


def _parallel(fn: Callable[[T], R], items: Iterable[T], max_workers: int) -> list[R]:
    items = list(items)
    if len(items) <= 1 or max_workers <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items)), thread_name_prefix="ktflow-download") as pool:
        return list(pool.map(fn, items))


class _ProgressPoller:
    """Report completed bytes while snapshot_download runs (it offers no per-file callback).

    A file counts once it sits at its final path with its listed size: huggingface_hub
    downloads into a temp file and renames it only when complete.
    """

    def __init__(self, progress: Progress | None, files: list[tuple[Path, int]], total: int) -> None:
        self.progress, self.files, self.total = progress, files, total
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last = -1

    def __enter__(self) -> _ProgressPoller:
        if self.progress is not None:
            self._thread = threading.Thread(target=self._run, name="ktflow-download-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(PROGRESS_INTERVAL_S):
            done = sum(size for path, size in self.files if _has_size(path, size))
            if done != self._last:
                self._last = done
                try:
                    assert self.progress is not None
                    self.progress(done, self.total)
                except Exception:  # a broken progress sink must not break the download
                    log.debug("progress callback failed", exc_info=True)


# --- retries and error translation -----------------------------------------------------------


@cache
def _network_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(retryable transport errors, proxy errors that are not) of whichever HTTP stacks exist.

    huggingface_hub 2.x uses httpx2, 1.x httpx, 0.x requests; fsspec backends use aiohttp.
    """
    retry: list[type[BaseException]] = [ConnectionError, TimeoutError]
    never: list[type[BaseException]] = []
    for module, names, proxy in (
        ("httpx2", ("TransportError",), "ProxyError"),
        ("httpx", ("TransportError",), "ProxyError"),
        ("requests", ("ConnectionError", "Timeout", "ChunkedEncodingError"), "ProxyError"),
        ("aiohttp", ("ClientConnectionError", "ClientPayloadError"), None),
    ):
        try:
            mod = importlib.import_module(module)
        except Exception:
            continue
        retry.extend(getattr(mod, n) for n in names if hasattr(mod, n))
        if proxy and hasattr(mod, proxy):
            never.append(getattr(mod, proxy))
    return tuple(retry), tuple(never)


def _chain(exc: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _http_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _is_retryable(exc: BaseException) -> bool:
    """Network trouble only: connection reset/refused, timeouts, HTTP 5xx/408/429.

    Never 401/403/404, never a hash mismatch, never our own errors. huggingface_hub often
    wraps the real cause (LocalEntryNotFoundError from a failed HEAD, IncompleteSnapshotError),
    so the cause chain decides; the first HTTP status found is authoritative.
    """
    retry, never = _network_errors()
    for e in _chain(exc):
        if isinstance(e, _IncompleteFetch):
            return True
        # A ConnectionError subclass, but a setting (HF_HUB_OFFLINE), not a network failure.
        if isinstance(e, (KtflowError, OfflineModeIsEnabled)):
            return False
        if isinstance(e, HfHubHTTPError) or _http_status(e) is not None:
            return _http_status(e) in _RETRY_STATUS
        if never and isinstance(e, never):
            return False
        if isinstance(e, retry):
            return True
        # http_get's size check after a stream ended short: a network symptom.
        if isinstance(e, OSError) and "Consistency check failed" in str(e):
            return True
    return False


def _backoff_delay(attempt: int) -> float:
    """Exponential backoff with jitter (50-100 % of the step) so parallel workers desynchronise."""
    step = min(RETRY_MAX_DELAY_S, RETRY_BASE_DELAY_S * (2**attempt))
    return step * (0.5 + random.random() / 2)


def _with_retries(fn: Callable[[], T], *, what: str, max_retries: int, token: str | None) -> T:
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if attempt >= max_retries or not _is_retryable(exc):
                raise
            delay = _backoff_delay(attempt)
            attempt += 1
            log.warning(
                "%s failed (%s); retry %d/%d in %.1f s",
                what, _scrub(_one_line(exc), token), attempt, max_retries, delay,
            )  # fmt: skip
            _sleep(delay)


def _reraise_storage_error(exc: BaseException) -> None:
    """Raise the full-disk / read-only OSError behind ``exc``, if any, for storage_errors to name."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
            raise e


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _translate_error(exc: Exception, *, repo_id: str, revision: str, token: str | None, max_retries: int) -> KtflowError:
    """Turn a huggingface_hub/network failure into ktflow's error with a subject and a fix."""
    subject = f"source.repo_id: {repo_id}"
    for e in _chain(exc):
        if isinstance(e, OfflineModeIsEnabled):
            return HostRequirementError(
                "HF_HUB_OFFLINE", f"huggingface_hub is in offline mode, so {repo_id} cannot be fetched",
                fix="unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) for the download stage, "
                "or use a source.local_path checkpoint.",
            )  # fmt: skip
        if isinstance(e, RevisionNotFoundError):
            return SourceAccessError(
                f"source.revision: {revision}", f"{repo_id} has no revision '{revision}'",
                fix="use a branch, tag or full commit sha that exists in the repo.",
            )  # fmt: skip
        if isinstance(e, GatedRepoError):
            return SourceAccessError(
                subject, "the repo is gated and this token has not been granted access",
                fix="accept the model's terms on its hub page with the account whose token HF_TOKEN holds.",
            )  # fmt: skip
        if isinstance(e, RepositoryNotFoundError):
            status = _http_status(e)
            return SourceAccessError(
                subject, f"the hub answered {status}: the repo does not exist, or it is private and no valid token was sent",
                fix="check the repo id; for a private or gated repo set HF_TOKEN (or the credentials block) "
                "to a token with read access.",
            )  # fmt: skip
        if isinstance(e, RemoteEntryNotFoundError) or (isinstance(e, HfHubHTTPError) and _http_status(e) == 404):
            url = getattr(getattr(e, "response", None), "url", "")
            return SourceAccessError(
                subject, f"the hub answered 404 for {url} (revision {revision})",
                fix="check the repo id and revision; if a listed file is missing, narrow source.allow_patterns.",
            )  # fmt: skip
        if isinstance(e, HfHubHTTPError) and _http_status(e) in (401, 403):
            return SourceAccessError(
                subject, f"the hub refused the request ({_http_status(e)}): the token is invalid or lacks read access",
                fix="set HF_TOKEN (or the credentials block) to a valid token with read access to this repo.",
            )  # fmt: skip
    if isinstance(exc, _IncompleteFetch):
        return DownloadError(
            f"{repo_id}@{revision}: {exc} (the hub could not be reached; gave up after {max_retries} retries). "
            "Rerun the stage: finished files are kept."
        )
    retried = f" after {max_retries} retries" if _is_retryable(exc) else ""
    return DownloadError(_scrub(f"downloading {repo_id}@{revision} failed{retried}: {_one_line(exc)}", token))
