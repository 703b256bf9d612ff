"""The local (or NFS) source: a checkpoint directory referenced in place, identified by its files'
sizes, mtimes and sampled hashes, never copied."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub.utils import filter_repo_objects

from ktflow.errors import (
    CheckpointError,
    DownloadError,
    SourceAccessError,
)
from ktflow.recipe import SourceConfig
from ktflow.runner import StageSpec, find_published
from ktflow.stages.download.common import (
    _NOT_CHECKPOINT_DIRS,
    HASH_CHUNK,
    SAMPLE_BYTES,
    STAGE,
    DownloadRequest,
    DownloadResult,
    DownloadSizes,
    _digest_json,
    _Job,
    _normalize_patterns,
    _parallel,
    download_needs,
)
from ktflow.store import FileEntry, StageManifest, StoreLayout


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
