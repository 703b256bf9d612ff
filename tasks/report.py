"""The run report: the story of a pipeline run on its own page in the Prefect UI.

One markdown artifact (key ``pipeline-report``) on the pipeline's flow run: the stage table
(what ran, what was skipped and why, what was a cache hit, and the host, pool and worker each
stage ran on), the training loss curve embedded in the page (a ``data:`` URL: a browser cannot
open a ``file://`` path to the store), the evaluation table base vs tuned, and the endpoint.
Rendering is ktflow.run_report's; this module only gathers where the stages ran and publishes.
"""

from __future__ import annotations

import json
from typing import Any
from uuid import UUID

from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run as current_run

from ktflow.run_report import render_run_report

REPORT_KEY = "pipeline-report"


def stage_hosts(parent_run_id: Any) -> dict[str, dict]:
    """``stage -> {host, pool, worker, flow_run}`` from the ``stage-host-<stage>`` artifacts of the
    child runs of ``parent_run_id`` (the dispatched stages); for a stage run more than once (a
    crashed attempt, then a retry) the latest record wins. Empty when nothing was dispatched."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[UUID(str(parent_run_id))])))
        if not children:
            return {}
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id for run in children]),
                                           key=ArtifactFilterKey(like_="stage-host-")),
            sort=ArtifactSort.CREATED_DESC)
    where: dict[str, dict] = {}
    for artifact in reversed(artifacts):  # oldest first: a later attempt's record replaces an earlier one
        data = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
        for row in data or []:
            if isinstance(row, dict) and "stage" in row:
                where[row["stage"]] = row
    return where


def _this_host(rows: list[dict]) -> dict[str, dict]:
    """Embedded runs: every stage that ran, ran here."""
    import os
    import socket

    from ktflow.host.worker import HOST_NAME_ENV, POOL_ENV, WORKER_ENV

    here = {"host": os.environ.get(HOST_NAME_ENV) or socket.gethostname(),
            "pool": os.environ.get(POOL_ENV) or "(in process)",
            "worker": os.environ.get(WORKER_ENV) or "-"}
    return {row["stage"]: here for row in rows if row.get("runs") != "skipped"}


def publish_run_report(recipe: Any, rows: list[dict], *, trained: Any = None, judgement: Any = None,
                       endpoint: Any = None, promotion: str = "") -> str:
    """Create the run's ``pipeline-report`` artifact; returns the markdown.

    ``rows``: the pipeline's stage rows; ``trained``: the SftResult (its loss curve on the store);
    ``judgement``: the candidate's :class:`~ktflow.stages.promotion.Judgement`, if the recipe evaluates;
    ``endpoint``: the Endpoint serving now (None: the candidate was rejected); ``promotion``: the
    candidate's fate in one line, shown first.
    Best effort about where stages ran: a server that cannot be asked leaves those cells empty.
    """
    try:
        where = stage_hosts(current_run.id) if current_run.id else {}
    except Exception:  # the report must never fail a finished pipeline
        where = {}
    if not where:
        where = _this_host(rows)
    loss_caption = ""
    if trained is not None:
        loss = f"{trained.final_loss:.4f}" if getattr(trained, "final_loss", None) is not None else "-"
        loss_caption = f"{getattr(trained, 'steps', '-')} steps, final loss {loss}"
    verdict = ""
    evaluation = judgement.evaluation if judgement is not None else None
    if evaluation is not None:
        verdict = (f"adapter applied: **{evaluation.adapter_applied}**, promoted: **{evaluation.promoted}**; "
                   f"{evaluation.contamination.summary()}")
    models = ""
    if endpoint is not None:
        models = ", ".join(m for m in (endpoint.served_model_name, endpoint.adapter_model_name) if m)
        models = f"models: {models}; backend {endpoint.backend}"
    markdown = render_run_report(
        recipe.name, rows, where,
        loss_curve=getattr(trained, "loss_curve", None), loss_curve_png=getattr(trained, "loss_curve_png", None),
        loss_caption=loss_caption,
        evaluation_table=evaluation.table if evaluation is not None else None, evaluation_verdict=verdict,
        endpoint_url=endpoint.url if endpoint is not None else None, endpoint_models=models, promotion=promotion,
    )
    create_markdown_artifact(key=REPORT_KEY, markdown=markdown, description=f"ktflow run report: {recipe.name}")
    return markdown
