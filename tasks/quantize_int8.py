"""Prefect task of the quantize-int8 stage (engine: ktflow.quantize_int8)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact

from ktflow.quantize_int8 import QuantizeInt8Result, quantize_int8
from ktflow.checkpoint import checkpoint_digest
from tasks._common import ProgressReporter, StageCachePolicy, published_artifact_key, retry_unless_invalid_input


def _cache_key(inputs: dict[str, Any]) -> str | None:
    # out_dir is named by the BF16 input's identity and T.
    return published_artifact_key(Path(inputs["out_dir"]), checkpoint_digest(Path(inputs["bf16_dir"])),
                                  inputs["threadpool_count"])


@task(
    name="quantize-int8",
    cache_policy=StageCachePolicy("quantize-int8", _cache_key),
    cache_result_in_memory=False,
    # A retry resumes per layer: finished layers in the staging dir are reused.
    retries=2,
    retry_delay_seconds=30,
    retry_condition_fn=retry_unless_invalid_input,
)
def quantize_int8_task(bf16_dir: str, out_dir: str, threadpool_count: int, serve_python: str,
                       workers: int | None = None) -> QuantizeInt8Result:
    """BF16 routed experts -> kt-kernel AMXINT8 CPU weights, verified by kt-kernel's own forward."""
    progress = ProgressReporter("quantize-int8-progress", f"AMXINT8 T={threadpool_count}", unit="layers")
    result = quantize_int8(Path(bf16_dir), Path(out_dir), threadpool_count=threadpool_count,
                           serve_python=Path(serve_python), workers=workers, progress=progress)
    rows = [{"layer": layer, **{k: v for k, v in figures.items() if isinstance(v, (int, float, str))}}
            for layer, figures in result.verification.items() if isinstance(figures, dict)]
    if rows and not result.cached:
        create_table_artifact(key="quantize-int8-verification", table=rows,
                              description="kt-kernel AMXINT8 forward vs float64 MoE of the BF16 weights")
    return result
