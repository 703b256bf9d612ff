"""Prefect task of the download stage (engine: ktflow.stages.download)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.blocks.system import Secret
from prefect.tasks import exponential_backoff

from ktflow.recipe import SourceConfig
from ktflow.stages.download import DownloadResult, download_checkpoint
from tasks._common import ProgressReporter, retry_unless_invalid_input


def hf_token(block: str | None) -> str | None:
    """The HF token from a block; None falls back to HF_TOKEN in the worker's environment.

    ``block`` is ``ktflow-huggingface-credentials/NAME`` (blocks.HuggingFaceCredentials) or the
    name of a Prefect Secret block.
    """
    if not block:
        return None
    if block.startswith("ktflow-huggingface-credentials/"):
        from blocks import HuggingFaceCredentials

        return HuggingFaceCredentials.load(block.split("/", 1)[1]).token.get_secret_value()
    return Secret.load(block).get()


@task(
    name="download",
    # The engine already retries network errors with backoff; these retries cover a crashed
    # worker or a dropped mount. Its published manifest makes a repeat a cheap cache hit, so
    # no Prefect-level cache is needed (and the resolved revision must be re-checked anyway).
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=30),
    retry_condition_fn=retry_unless_invalid_input,
)
def download_task(source: SourceConfig, store_root: str, hf_token_block: str | None = None) -> DownloadResult:
    """Fetch and verify the recipe's source checkpoint into the store (or reference a local one)."""
    with ProgressReporter("download-progress",
                          f"download {source.repo_id or source.uri or source.local_path}") as progress:
        return download_checkpoint(source, Path(store_root), token=hf_token(hf_token_block), progress=progress)
