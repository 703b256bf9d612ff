"""Prefect tasks of the serve and evaluate stages (engines: ktflow.stages.promotion, ktflow.stages.serve,
ktflow.stages.evaluate).

evaluate judges a candidate version (beside production, offline, or by swap); serve promotes a
version (a health-gated swap of production) and emits ``ktflow.adapter.promoted``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.logging import get_run_logger

from ktflow.host.process import ThrottledLines
from ktflow.recipe import Recipe
from ktflow.stages.promotion import Judgement, evaluation_digest, judge_candidate, promote_version, registry_of
from ktflow.stages.promotion import serving_dir as serving_dir  # re-exported: where the endpoint is recorded
from ktflow.stages.serve import Endpoint, is_alive, read_endpoint, serve, stop
from tasks._common import StageCachePolicy, retry_unless_invalid_input
from tasks.promote import emit_moved


@task(name="serve", retries=1, retry_delay_seconds=10)
def serve_task(recipe: Recipe, model_dir: str, adapter_dir: str, kt_weight_dir: str | None = None,
               version: int | None = None, base_dir: str | None = None, why: str = "promoted") -> Endpoint:
    """Serve version ``version`` as production (health-gated, smoke-tested swap; idempotent), or,
    without a version, (re)start the endpoint with ``adapter_dir``."""
    logger = get_run_logger()
    log = ThrottledLines(logger.info)
    if version is None:
        endpoint = _serve_unversioned(recipe, model_dir, adapter_dir, kt_weight_dir, log)
    else:
        moved = promote_version(recipe, version, model_dir=Path(model_dir),
                                kt_weight_dir=Path(kt_weight_dir) if kt_weight_dir else None,
                                base_dir=Path(base_dir) if base_dir else None, why=why, log=log)
        endpoint = moved.endpoint
        logger.info("%s: %s", recipe.name, moved.summary())
        emit_moved(recipe, moved, why)
    create_link_artifact(key="endpoint", link=endpoint.url, link_text=f"{recipe.name} ({endpoint.model})",
                         description=f"pid {endpoint.pid}, log {endpoint.log_path}, adapter {endpoint.adapter_dir}"
                         + (f" (v{endpoint.adapter_version})" if endpoint.adapter_version else ""))
    return endpoint


def _serve_unversioned(recipe: Recipe, model_dir: str, adapter_dir: str, kt_weight_dir: str | None,
                       log: ThrottledLines) -> Endpoint:
    record_dir = serving_dir(recipe)
    running = read_endpoint(record_dir)
    if running is not None and running.adapter_dir == Path(adapter_dir) and running.state == "ready" and is_alive(running):
        log(f"endpoint {running.url} already serves this adapter: not restarted")
        return running
    stop(record_dir)
    return serve(recipe, model_dir=Path(model_dir), adapter_dir=Path(adapter_dir), record_dir=record_dir,
                 kt_weight_dir=Path(kt_weight_dir) if kt_weight_dir else None, log=log)


def _judgement_key(inputs: dict[str, Any]) -> str | None:
    # The same candidate judged against the same production server (same process, same adapter) on
    # the same held-out data gives the same verdict. Swap mode moves production: never cached.
    recipe: Recipe = inputs["recipe"]
    if recipe.evaluation.candidate == "swap":
        return None
    registry = registry_of(recipe)
    candidate = registry.get(inputs["version"])
    production = read_endpoint(serving_dir(recipe))
    if production is not None and not is_alive(production):
        return None
    served = [production.pid, production.started_at, production.adapter_manifest_digest] if production else None
    return json.dumps([evaluation_digest(recipe, Path(inputs["model_dir"])), candidate.adapter_digest, served])


@task(name="evaluate", retries=1, retry_delay_seconds=10, retry_condition_fn=retry_unless_invalid_input,
      cache_policy=StageCachePolicy("evaluate", _judgement_key), cache_result_in_memory=False)
def evaluate_task(recipe: Recipe, model_dir: str, version: int, serve_model_dir: str,
                  kt_weight_dir: str | None = None) -> Judgement:
    """Judge candidate ``version``: base vs candidate vs production, through the OpenAI API or offline.

    A rejected candidate is returned, not raised: the pipeline reports it, emits
    ``ktflow.adapter.rejected`` and fails the run.
    """
    logger = get_run_logger()
    judgement = judge_candidate(recipe, version, model_dir=Path(model_dir), serve_model_dir=Path(serve_model_dir),
                                kt_weight_dir=Path(kt_weight_dir) if kt_weight_dir else None,
                                log=ThrottledLines(logger.info))
    result = judgement.evaluation
    logger.info("%s", judgement.summary())
    create_markdown_artifact(key="evaluation", markdown=f"### {recipe.name}: {judgement.summary()}\n\n"
                             f"judged {judgement.choice.mode} ({judgement.choice.reason})\n\n{result.table}\n\n"
                             f"adapter applied: **{result.adapter_applied}**, promoted: **{result.promoted}**\n\n"
                             f"{result.contamination.summary()}")
    return judgement
