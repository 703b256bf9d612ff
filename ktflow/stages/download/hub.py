"""The hub source: a snapshot of a repository at a pinned revision (a tag or branch resolved to its
commit), fetched with huggingface_hub, resumable, every file verified against the hub's listing."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import huggingface_hub
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import filter_repo_objects

from ktflow.errors import (
    ChecksumMismatchError,
    DownloadError,
    KtflowError,
    SourceAccessError,
)
from ktflow.runner import StageSpec
from ktflow.stages.download.common import (
    _SHA_RE,
    HF_BOOKKEEPING,
    STAGE,
    DownloadRequest,
    DownloadResult,
    DownloadSizes,
    _digest_json,
    _finalize_staging,
    _has_size,
    _hash_file,
    _IncompleteFetch,
    _Job,
    _lookup_copy,
    _measure_copy,
    _normalize_patterns,
    _parallel,
    _ProgressPoller,
    _published,
    _remove_stale_incomplete,
    _reraise_storage_error,
    _resolve_token,
    _translate_error,
    _with_retries,
    download_needs,
    log,
)
from ktflow.store import FileEntry, StageManifest, StoreLayout


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


