"""Prefect task of the convert-lora stage (engine: ktflow.stages.convert_lora)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.logging import get_run_logger

from ktflow.host.process import ThrottledLines
from ktflow.stages.convert_lora import ConvertLoraResult, convert_lora
from ktflow.store import read_manifest
from tasks._common import StageCachePolicy, published_artifact_key, retry_unless_invalid_input


def _cache_key(inputs: dict[str, Any]) -> str | None:
    # out_dir is named by the trained adapter's manifest digest; its own manifest names what it holds.
    source = read_manifest(Path(inputs["adapter_dir"]))
    if source is None:
        return None
    return published_artifact_key(Path(inputs["out_dir"]), source.digest(), inputs["base_dir"])


@task(name="convert-lora", retries=1, retry_delay_seconds=10, retry_condition_fn=retry_unless_invalid_input,
      cache_policy=StageCachePolicy("convert-lora", _cache_key), cache_result_in_memory=False)
def convert_lora_task(adapter_dir: str, out_dir: str, base_dir: str, serve_python: str) -> ConvertLoraResult:
    """Convert a KT fused adapter for SGLang (or validate a PEFT one) and publish it; cached by inputs."""
    logger = get_run_logger()
    result = convert_lora(Path(adapter_dir), Path(out_dir), base_dir=Path(base_dir), serve_python=Path(serve_python),
                          on_line=ThrottledLines(logger.info))
    logger.info("%s adapter, rank %d, %d tensors -> %s%s", result.kind, result.rank, result.tensors, result.path,
                " (cache hit)" if result.cached else "")
    return result
