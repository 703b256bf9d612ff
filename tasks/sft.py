"""Prefect task of the SFT stage (engine: ktflow.stages.sft)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.logging import get_run_logger

from ktflow.errors import InvalidInputError
from ktflow.host.hardware import probe_host
from ktflow.recipe import Recipe
from ktflow.run_report import image_markdown
from ktflow.stages.sft import SftResult, TrainerProgress, locate_adapter, run_sft
from tasks._common import ProgressReporter, StageCachePolicy, published_artifact_key, retry_unless_invalid_input


def _cache_key(inputs: dict[str, Any]) -> str | None:
    # The published adapter of this exact run (base digest + data digest + settings name its
    # directory); the data digest is over file contents, so a changed record is a new key.
    try:
        adapter = locate_adapter(inputs["recipe"], Path(inputs["model_dir"]))
    except InvalidInputError:
        return None
    return published_artifact_key(adapter)


@task(
    name="sft",
    cache_policy=StageCachePolicy("sft", _cache_key),
    cache_result_in_memory=False,
    # A retry resumes from the last complete checkpoint (same run directory), never from step 0;
    # a completed run is a cache hit inside the engine (its published adapter manifest).
    retries=2,
    retry_delay_seconds=60,
    retry_condition_fn=retry_unless_invalid_input,
)
def sft_task(recipe: Recipe, model_dir: str) -> SftResult:
    """Train the recipe's adapter on ``model_dir`` in the training toolchain."""
    logger = get_run_logger()
    steps = ProgressReporter("sft-progress", f"{recipe.name}: SFT steps", unit="steps")

    def on_progress(record: TrainerProgress) -> None:
        steps(record.current_steps, record.total_steps)
        if record.loss is not None:
            logger.info(
                "step %d/%d loss %.4f lr %.2e%s eta %s", record.current_steps, record.total_steps, record.loss,
                record.lr or 0.0, f" {record.throughput:.0f} tok/s" if record.throughput else "",
                record.remaining_time or "?",
            )

    with steps:
        result = run_sft(recipe, model_dir=Path(model_dir), host=probe_host(recipe.store.root), progress=on_progress,
                         log=logger.info)
    if not result.cached:
        loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "-"
        create_markdown_artifact(
            key="sft-summary",
            markdown=(
                f"### SFT: {recipe.name} ({result.backend or recipe.sft.backend})\n\n"
                + (f"`sft.backend: auto` chose {result.backend_reason}\n\n" if result.backend_reason else "")
                + (f"{result.batch[0].upper()}{result.batch[1:]}\n\n" if result.batch else "")
                + (f"KT step {result.kt_step['measured_step_s']:.1f} s measured against "
                   f"{result.kt_step['predicted_step_s']:.1f} s predicted by the model as fitted: the next plan on "
                   f"`{result.kt_step['host']}` is calibrated by it\n\n" if result.kt_step else "")
                +
                "| steps | final loss | tokens/s | seconds | resumed from | adapter |\n|---|---|---|---|---|---|\n"
                f"| {result.steps} | {loss} | {result.tokens_per_second or '-'} | {result.seconds:.0f} | "
                f"{result.resumed_from or '-'} | `{result.adapter_dir}` |\n"
            ),
        )
        if result.loss_curve is not None:
            # Embedded in the artifact (a data URL): the UI is a web page, and a file:// link to
            # the store is something a user's browser cannot open.
            create_markdown_artifact(
                key="sft-loss-curve",
                markdown=image_markdown(result.loss_curve, f"Training loss: {recipe.name}", "training loss",
                                        caption=f"{result.steps} steps, final loss {loss} "
                                                f"(LlamaFactory plot_loss; file: `{result.loss_curve}`)"),
                description="training loss curve (LlamaFactory plot_loss)",
            )
    return result
