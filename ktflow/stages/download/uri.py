"""The fsspec URI source (``s3://``, ``gs://``, ``sftp://``, ...): copied into the store resumably, each
file checked against the listing's size and version."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub.utils import filter_repo_objects

from ktflow.errors import (
    ChecksumMismatchError,
    DownloadError,
    KtflowError,
    SourceAccessError,
)
from ktflow.runner import StageSpec
from ktflow.stages.download.common import (
    _COPY_PART_SUFFIX,
    _NOT_CHECKPOINT_DIRS,
    HASH_CHUNK,
    STAGE,
    DownloadRequest,
    DownloadResult,
    DownloadSizes,
    _digest_json,
    _finalize_staging,
    _has_size,
    _hash_file,
    _Job,
    _lookup_copy,
    _measure_copy,
    _normalize_patterns,
    _parallel,
    _published,
    _reraise_storage_error,
    _with_retries,
    download_needs,
)
from ktflow.store import FileEntry, StageManifest, StoreLayout


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
