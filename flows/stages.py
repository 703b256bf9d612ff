"""One flow per stage: what a stage deployment runs on the work pool that can run it.

Each stage flow checks that the host which picked the run up can run this recipe's stage
(``ktflow.stages.host_requirements``: fails in seconds, not hours in), records where it ran
(host, pool, worker) as an artifact, and calls the stage's task: the task's cache policy,
retries and artifacts are the same as in the embedded pipeline. Results are persisted so
the parent on another host reads them back: set ``PREFECT_LOCAL_STORAGE_PATH`` to a folder
on the shared store on every host (deployments/README.md).

The parameters of a stage flow are the parameters of its task, so the parent dispatches
the same call to a local task or to a deployment (flows/pipeline.py).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger
from prefect.runtime import flow_run as current_run

from ktflow.convert_lora import ConvertLoraResult
from ktflow.dequantize import DequantizeResult
from ktflow.download import DownloadResult
from ktflow.errors import HostRequirementError
from ktflow.evaluate import EvaluationResult
from ktflow.hardware import probe_host
from ktflow.quantize_int8 import QuantizeInt8Result
from ktflow.recipe import Recipe, SourceConfig
from ktflow.serve import Endpoint
from ktflow.sft import SftResult
from ktflow.stages import StageName, check_requirement, host_requirements
from ktflow.worker import HOST_NAME_ENV, POOL_ENV, WORKER_ENV
from tasks.convert_lora import convert_lora_task
from tasks.dequantize import dequantize_task
from tasks.download import download_task
from tasks.quantize_int8 import quantize_int8_task
from tasks.serve import evaluate_task, serve_task
from tasks.sft import sft_task



def where_this_runs() -> dict[str, Any]:
    """Host, pool and worker of the current flow run (the pool as the API recorded it)."""
    pool = None
    run_id = current_run.id
    if run_id:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            pool = client.read_flow_run(run_id).work_pool_name
    return {
        "host": os.environ.get(HOST_NAME_ENV) or socket.gethostname(),
        "pool": pool,
        "worker": os.environ.get(WORKER_ENV),
        "worker_pool": os.environ.get(POOL_ENV),
        "pid": os.getpid(),
        "flow_run": str(run_id) if run_id else None,
    }


def _enter_stage(stage: StageName, recipe: Recipe | None) -> None:
    """Fail fast when this host cannot run the recipe's stage; record where it runs."""
    where = where_this_runs()
    get_run_logger().info("%s on host %s (pool %s, worker %s)", stage, where["host"], where["pool"], where["worker"])
    create_table_artifact(key=f"stage-host-{stage}", table=[{"stage": stage, **where}],
                          description=f"where the {stage} stage ran")
    if recipe is None:
        return
    missing = check_requirement(host_requirements(recipe)[stage], probe_host(recipe.store.root))
    if missing:
        raise HostRequirementError(
            f"host {where['host']} (pool {where['pool']})", "; ".join(missing),
            "run this stage's deployment on a pool whose hosts qualify (`ktflow worker --list`), or change the recipe",
        )


@flow(name="ktflow-download", persist_result=True)
def download_stage(source: SourceConfig, store_root: str, hf_token_block: str | None = None) -> DownloadResult:
    _enter_stage("download", None)
    return download_task(source, store_root, hf_token_block)


@flow(name="ktflow-dequantize", persist_result=True)
def dequantize_stage(src: str, dst: str, workers: int | None = None, fsync: bool = True) -> DequantizeResult:
    _enter_stage("dequantize", None)
    return dequantize_task(src, dst, workers, fsync)


@flow(name="ktflow-sft", persist_result=True)
def sft_stage(recipe: Recipe, model_dir: str) -> SftResult:
    _enter_stage("sft", recipe)
    return sft_task(recipe, model_dir)


@flow(name="ktflow-convert-lora", persist_result=True)
def convert_lora_stage(adapter_dir: str, out_dir: str, base_dir: str, serve_python: str) -> ConvertLoraResult:
    _enter_stage("convert-lora", None)
    return convert_lora_task(adapter_dir, out_dir, base_dir, serve_python)


@flow(name="ktflow-quantize-int8", persist_result=True)
def quantize_int8_stage(bf16_dir: str, out_dir: str, threadpool_count: int, serve_python: str,
                        workers: int | None = None) -> QuantizeInt8Result:
    _enter_stage("quantize-int8", None)
    return quantize_int8_task(bf16_dir, out_dir, threadpool_count, serve_python, workers)


@flow(name="ktflow-serve", persist_result=True)
def serve_stage(recipe: Recipe, model_dir: str, adapter_dir: str, kt_weight_dir: str | None = None) -> Endpoint:
    _enter_stage("serve", recipe)
    return serve_task(recipe, model_dir, adapter_dir, kt_weight_dir)


@flow(name="ktflow-evaluate", persist_result=True)
def evaluate_stage(recipe: Recipe, model_dir: str, endpoint: Endpoint) -> EvaluationResult:
    _enter_stage("evaluate", recipe)
    return evaluate_task(recipe, model_dir, endpoint)


STAGE_FLOWS = {
    "download": download_stage,
    "dequantize": dequantize_stage,
    "sft": sft_stage,
    "convert-lora": convert_lora_stage,
    "quantize-int8": quantize_int8_stage,
    "serve": serve_stage,
    "evaluate": evaluate_stage,
}

STAGE_TASKS = {
    "download": download_task,
    "dequantize": dequantize_task,
    "sft": sft_task,
    "convert-lora": convert_lora_task,
    "quantize-int8": quantize_int8_task,
    "serve": serve_task,
    "evaluate": evaluate_task,
}


def stage_flow_entrypoint(stage: StageName) -> str:
    """The ``prefect.yaml`` entrypoint of a stage's flow."""
    return f"flows/stages.py:{STAGE_FLOWS[stage].fn.__name__}"

