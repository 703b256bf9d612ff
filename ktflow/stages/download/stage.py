"""The download stage's entry point: the recipe's source, whichever kind, fetched (or referenced),
verified and published."""

from __future__ import annotations

from pathlib import Path

from ktflow.recipe import SourceConfig
from ktflow.runner import Progress, run_stage
from ktflow.stages.download.common import DownloadRequest, DownloadResult, _resolve_token
from ktflow.stages.download.hub import DOWNLOAD_HUB
from ktflow.stages.download.local import DOWNLOAD_LOCAL
from ktflow.stages.download.uri import DOWNLOAD_URI


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
