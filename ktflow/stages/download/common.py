"""What every download source shares: the request and result, the stage's needs, the published
artifact's lookup, retries with backoff, and hub and network errors translated into ours."""

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
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from pydantic import BaseModel, ConfigDict

from ktflow.errors import (
    DownloadError,
    HostRequirementError,
    KtflowError,
    SourceAccessError,
)
from ktflow.recipe import SourceConfig
from ktflow.resources import DOWNLOAD_STAGE, DiskNeed, Resources
from ktflow.runner import Job, Progress, damaged_files, find_published
from ktflow.store import FileEntry, StageManifest
from ktflow.units import human_bytes

log = logging.getLogger(__name__)
STAGE = DOWNLOAD_STAGE
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
    # Filled by the host that holds it when another host needs them (hosts without a shared store):
    # its cache-key digest, which names the BF16 copy, and its content fingerprint, equal on every
    # host that holds the same bytes (formats.checkpoint).
    checkpoint_digest: str | None = None
    checkpoint_fingerprint: str | None = None


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


def _measure_copy(job: _Job, resumed: Path | None) -> DownloadSizes:
    sizes = job.sizes()
    done = sum(size for rel, size in sizes.items() if resumed is not None and _has_size(resumed / rel, size))
    return DownloadSizes(bytes=sum(sizes.values()), done_bytes=done)


def _published(job: _Job, manifest: StageManifest) -> DownloadResult:
    total = sum(e.size for e in manifest.files)
    job.report(total, total)
    log.info("published %s (%d files, %s)", job.target, len(manifest.files), human_bytes(total))
    return DownloadResult(path=job.target, revision=job.revision, files=len(manifest.files), bytes=total,
                          manifest_digest=manifest.digest(), cached=False)


"""The download stage for a hub source (``source.repo_id``), declared for the runner."""
"""The download stage for a local or NFS source (``source.local_path``): a reference artifact."""
"""The download stage for an fsspec source (``source.uri``), declared for the runner."""


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


class _IncompleteFetch(Exception):
    """snapshot_download returned while files were still missing (retryable)."""

    def __init__(self, missing: list[str]) -> None:
        self.missing = missing
        shown = ", ".join(missing[:5]) + (f", ... ({len(missing) - 5} more)" if len(missing) > 5 else "")
        super().__init__(f"{len(missing)} file(s) still missing after the transfer: {shown}")
