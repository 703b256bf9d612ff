"""Prefect tasks of the serve and evaluate stages (engines: ktflow.serve, ktflow.evaluate)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.logging import get_run_logger

from ktflow.errors import PromotionGateError
from ktflow.evaluate import EvaluationResult, evaluate_base_vs_tuned
from ktflow.process import ThrottledLines
from ktflow.recipe import Recipe
from tasks._common import StageCachePolicy, retry_unless_invalid_input
from ktflow.serve import Endpoint, adapter_model_name, api_key_for, is_alive, read_endpoint, serve, stop


def serving_dir(recipe: Recipe) -> Path:
    return (recipe.store.root / "serving" / recipe.name).absolute()


@task(name="serve", retries=1, retry_delay_seconds=10)
def serve_task(recipe: Recipe, model_dir: str, adapter_dir: str, kt_weight_dir: str | None = None) -> Endpoint:
    """Start (or restart with this adapter) the recipe's endpoint; health-gated and smoke-tested."""
    logger = get_run_logger()
    record_dir = serving_dir(recipe)
    running = read_endpoint(record_dir)
    if running is not None and running.adapter_dir == Path(adapter_dir) and running.state == "ready" and is_alive(running):
        logger.info("endpoint %s already serves this adapter: not restarted", running.url)
        return running
    stop(record_dir)
    endpoint = serve(recipe, model_dir=Path(model_dir), adapter_dir=Path(adapter_dir), record_dir=record_dir,
                     kt_weight_dir=Path(kt_weight_dir) if kt_weight_dir else None, log=ThrottledLines(logger.info))
    create_link_artifact(key="endpoint", link=endpoint.url, link_text=f"{recipe.name} ({adapter_model_name(recipe)})",
                         description=f"pid {endpoint.pid}, log {endpoint.log_path}, adapter {endpoint.adapter_dir}")
    return endpoint


def _evaluation_key(inputs: dict[str, Any]) -> str | None:
    # The same held-out data and settings against the same live server process (same adapter)
    # give the same report: a rerun of an unchanged pipeline does not evaluate again. A restarted
    # server (new pid and start time) means evaluate again.
    recipe: Recipe = inputs["recipe"]
    endpoint: Endpoint = inputs["endpoint"]
    if not is_alive(endpoint):
        return None
    files = [hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in recipe.evaluation.files]
    return json.dumps([recipe.evaluation.model_dump(mode="json"), files, inputs["model_dir"], endpoint.url,
                       endpoint.pid, endpoint.started_at, endpoint.adapter_manifest_digest], sort_keys=True)


@task(name="evaluate", retries=1, retry_delay_seconds=10, retry_condition_fn=retry_unless_invalid_input,
      cache_policy=StageCachePolicy("evaluate", _evaluation_key), cache_result_in_memory=False)
def evaluate_task(recipe: Recipe, model_dir: str, endpoint: Endpoint) -> EvaluationResult:
    """Base vs tuned through the OpenAI API; fails if the adapter is not applied."""
    logger = get_run_logger()
    key = api_key_for(endpoint)
    assert key is not None, "the endpoint record names its key's source"
    result = evaluate_base_vs_tuned(recipe, model_dir=Path(model_dir), tuned_url=endpoint.url,
                                    tuned_model=adapter_model_name(recipe), api_key=key,
                                    out_dir=(recipe.store.root / "eval" / recipe.name).absolute(),
                                    log=ThrottledLines(logger.info))
    create_markdown_artifact(key="evaluation", markdown=f"### {recipe.name}: base vs tuned\n\n{result.table}\n\n"
                             f"adapter applied: **{result.adapter_applied}**, promoted: **{result.promoted}**\n\n"
                             f"{result.contamination.summary()}")
    if not result.adapter_applied:
        from ktflow.errors import KtflowError

        raise KtflowError("the tuned endpoint answers exactly like the base model: the adapter is not applied")
    failure = result.gate_failure()
    if failure:
        raise PromotionGateError(f"{failure}; report: {result.report_md}")
    return result
