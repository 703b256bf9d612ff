"""Prefect side of promotion (engine: ktflow.stages.promotion, ktflow.registry): registering a version
with what started the run, and the ``ktflow.adapter.promoted`` / ``.rejected`` events users hang
notifications on (deployments/automations/)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.logging import get_run_logger
from prefect.runtime import flow_run as current_run

from ktflow.recipe import Recipe
from ktflow.registry import AdapterVersion, Trigger
from ktflow.stages.promotion import Judgement, MoveResult, register_adapter

PROMOTED_EVENT = "ktflow.adapter.promoted"
REJECTED_EVENT = "ktflow.adapter.rejected"


def current_trigger() -> Trigger:
    """What started this flow run (the pipeline's, for a dispatched stage): ``cli`` (an embedded
    ``ktflow run``/``demo``), ``schedule``, a ``dataset-event`` (a deployment trigger, as the retrain
    deployment's on ``dataset.version.published``), else ``deployment`` (the Prefect UI or
    ``prefect deployment run``: the OSS server records no difference)."""
    run_id = current_run.id
    if not run_id:
        return Trigger(kind="unknown")
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(run_id)
            root = run
            while root.parent_task_run_id is not None:  # a dispatched stage: the pipeline's run decides
                parent = client.read_task_run(root.parent_task_run_id).flow_run_id
                root = client.read_flow_run(parent)
    except Exception:  # the trigger is lineage, never a reason to fail a run
        return Trigger(kind="unknown", detail=f"flow run {run_id}")
    detail = f"flow run {root.name} ({root.id})"
    if root.deployment_id is None:
        return Trigger(kind="cli", detail=f"embedded run: {detail}")
    if root.auto_scheduled:
        return Trigger(kind="schedule", detail=detail)
    # A deployment trigger's run-deployment action keys the runs it creates "automation <id>, action
    # <n>, invocation <id>" (prefect.server.events.schemas.automations.TriggeredAction.idempotency_key).
    if (root.idempotency_key or "").startswith("automation "):
        return Trigger(kind="dataset-event", detail=f"{detail}, {root.idempotency_key.split(',')[0]}")
    return Trigger(kind="deployment", detail=detail)


@task(name="register-adapter")
def register_adapter_task(recipe: Recipe, adapter_dir: str, sft_adapter_dir: str, base_dir: str) -> AdapterVersion:
    """The converted adapter as version N of the recipe, with its lineage and trigger."""
    version = register_adapter(recipe, adapter_dir=Path(adapter_dir), sft_adapter_dir=Path(sft_adapter_dir),
                               base_dir=Path(base_dir), trigger=current_trigger())
    get_run_logger().info("%s: adapter %s is v%d (trained on base %s, dataset %s)", recipe.name, adapter_dir,
                          version.version, version.lineage.base_digest[:12], version.lineage.dataset_digest[:12])
    return version


def emit_adapter_event(event: str, recipe: Recipe, version: int, payload: dict[str, Any]) -> None:
    """``ktflow.adapter.promoted`` / ``.rejected`` on the resource ``ktflow.adapter.<recipe>``."""
    from prefect.events import emit_event

    emit_event(event, resource={"prefect.resource.id": f"ktflow.adapter.{recipe.name}",
                                "prefect.resource.name": recipe.name, "ktflow.version": str(version)},
               payload={"recipe": recipe.name, "version": version, **payload})


def emit_rejected(recipe: Recipe, judgement: Judgement) -> None:
    """``ktflow.adapter.rejected`` for a candidate that did not pass: what stays, the gate, the mode."""
    result = judgement.evaluation
    emit_adapter_event(REJECTED_EVENT, recipe, judgement.version, {
        "production": judgement.production_version, "gate": result.gate_brief(), "mode": judgement.choice.mode,
        "report": str(result.report_md), "served_window": list(judgement.window) if judgement.window else None})


def emit_moved(recipe: Recipe, moved: MoveResult, why: str) -> None:
    """``ktflow.adapter.promoted`` for a move of production (a promotion, a rollback)."""
    if moved.moved:
        emit_adapter_event(PROMOTED_EVENT, recipe, moved.version, {"replaces": moved.replaced, "why": why,
                                                                   "url": moved.endpoint.url})
