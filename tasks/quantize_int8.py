"""Prefect task of the quantize-int8 stage (engine: ktflow.stages.quantize_int8)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact

from ktflow.formats.checkpoint import checkpoint_digest
from ktflow.host.hardware import probe_host
from ktflow.planning.stage_plan import INT8_KERNELS, StageSkipped, check_requirement, deferral_reason
from ktflow.stages.quantize_int8 import QuantizeInt8Result, quantize_int8
from tasks._common import ProgressReporter, StageCachePolicy, published_artifact_key, retry_unless_invalid_input


def _cache_key(inputs: dict[str, Any]) -> str | None:
    # out_dir is named by the BF16 input's identity and T.
    return published_artifact_key(Path(inputs["out_dir"]), checkpoint_digest(Path(inputs["bf16_dir"])),
                                  inputs["threadpool_count"])


# A retry resumes per layer: finished layers in the staging dir are reused.
@task(name="quantize-int8", cache_policy=StageCachePolicy("quantize-int8", _cache_key), cache_result_in_memory=False,
      retries=2, retry_delay_seconds=30, retry_condition_fn=retry_unless_invalid_input)
def quantize_int8_task(bf16_dir: str, out_dir: str, threadpool_count: int, serve_python: str,
                       workers: int | None = None, skip_without_kernels: bool = False
                       ) -> QuantizeInt8Result | StageSkipped:
    """BF16 routed experts -> kt-kernel AMXINT8 CPU weights, verified by kt-kernel's own forward.

    ``skip_without_kernels``: no later stage of the run reads the weights (they are made for a
    later SGLang host), so a host without kt-kernel's INT8 kernels skips the stage with the
    reason instead of failing the run.
    """
    if skip_without_kernels:
        missing = check_requirement(INT8_KERNELS, probe_host(Path(out_dir).parent))
        if missing:
            return StageSkipped(stage="quantize-int8", reason=deferral_reason("quantize-int8", missing))
    with ProgressReporter("quantize-int8-progress", f"AMXINT8 T={threadpool_count}", unit="layers") as progress:
        result = quantize_int8(Path(bf16_dir), Path(out_dir), threadpool_count=threadpool_count,
                               serve_python=Path(serve_python), workers=workers, progress=progress)
    rows = [{"layer": layer, **{k: v for k, v in figures.items() if isinstance(v, (int, float, str))}}
            for layer, figures in result.verification.items() if isinstance(figures, dict)]
    if rows and not result.cached:
        create_table_artifact(key="quantize-int8-verification", table=rows,
                              description="kt-kernel AMXINT8 forward vs float64 MoE of the BF16 weights")
    return result
