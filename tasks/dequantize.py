"""Prefect task of the dequantize stage (engine: ktflow.stages.dequantize)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.tasks import exponential_backoff

from ktflow.formats.checkpoint import checkpoint_digest
from ktflow.stages.dequantize import DequantizeResult, dequantize_checkpoint
from tasks._common import ProgressReporter, StageCachePolicy, published_artifact_key, retry_unless_invalid_input


def _cache_key(inputs: dict[str, Any]) -> str | None:
    return published_artifact_key(Path(inputs["dst"]), checkpoint_digest(Path(inputs["src"])))


@task(
    name="dequantize",
    cache_policy=StageCachePolicy("dequantize", _cache_key),
    cache_result_in_memory=False,
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=10),
    retry_condition_fn=retry_unless_invalid_input,
)
def dequantize_task(src: str, dst: str, workers: int | None = None, fsync: bool = True) -> DequantizeResult:
    """INT4/FP8 -> BF16 (a BF16 source is passed through). Resumes a crashed attempt per shard."""
    with ProgressReporter("dequantize-progress", f"{src} -> BF16") as progress:
        result = dequantize_checkpoint(src, dst, workers=workers, fsync=fsync, progress=progress)
    if not result.reused_source and not result.cached:
        create_markdown_artifact(
            key="dequantize-summary",
            markdown=(
                f"### dequantize: {result.source_format} -> BF16\n\n"
                f"| output | tensors decoded | bytes | shards | seconds | GB/s |\n|---|---|---|---|---|---|\n"
                f"| `{result.path}` | {result.tensors_decoded} | {result.bytes_written} | {result.shards} | "
                f"{result.seconds:.1f} | {result.bytes_written / max(result.seconds, 1e-9) / 1e9:.2f} |\n"
            ),
        )
    return result
