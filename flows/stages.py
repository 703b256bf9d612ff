"""One flow per stage: what a stage deployment runs on the work pool that can run it.

Each stage flow checks that the host which picked the run up can run this recipe's stage
(``ktflow.planning.stage_plan.host_requirements``: fails in seconds, not hours in), records where it ran
(host, pool, worker) as an artifact, and calls the stage's task: the task's cache policy,
retries and artifacts are the same as in the embedded pipeline. Results are persisted so
the parent on another host reads them back: set ``PREFECT_LOCAL_STORAGE_PATH`` to a folder
on the shared store on every host (deployments/README.md).

The parameters of a stage flow are the parameters of its task, so the parent dispatches
the same call to a local task or to a deployment (flows/pipeline.py).

Each host keeps its own store when the recipe names an artifact store (``store.artifacts``): a
worker started with ``ktflow worker --store-root DIR`` has ``KTFLOW_STORE_ROOT`` set, and every
stage flow maps the store paths it is handed from the recipe's root onto that root, and the
paths in its result back (``ktflow.store.HostStore``). What crosses hosts, the SFT adapter, the
sft flow publishes to the artifact store and the convert-lora flow fetches, verified, into its
own store at the same store-relative path.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger
from prefect.runtime import flow_run as current_run

from ktflow.artifact_store import ArtifactRef, ArtifactStore
from ktflow.errors import HostRequirementError
from ktflow.formats.checkpoint import checkpoint_digest, checkpoint_fingerprint
from ktflow.host.hardware import probe_host
from ktflow.host.worker import ARTIFACTS_BLOCK_ENV, HOST_NAME_ENV, POOL_ENV, STORE_ROOT_ENV, WORKER_ENV
from ktflow.planning.stage_plan import StageName, StageSkipped, check_requirement, host_requirements
from ktflow.recipe import Recipe, SourceConfig
from ktflow.run_report import png_data_url
from ktflow.stages.convert_lora import ConvertLoraResult
from ktflow.stages.dequantize import DequantizeResult
from ktflow.stages.download import DownloadResult
from ktflow.stages.promotion import Judgement
from ktflow.stages.quantize_int8 import QuantizeInt8Result
from ktflow.stages.serve import Endpoint
from ktflow.stages.sft import SftResult, run_adapter_dir
from ktflow.store import HostStore
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


TOOLCHAIN_BLOCK_ENV = {"train": "KTFLOW_TOOLCHAIN_TRAIN", "serve": "KTFLOW_TOOLCHAIN_SERVE"}
"""Set by ``ktflow worker --toolchain ROLE=BLOCK``: this host's Toolchain block per role."""




def host_store(declared: str | Path | None) -> HostStore:
    """The store root ``declared`` by the recipe, and where this host keeps its store (None: the
    caller did not say which root its paths are under; they are used as given)."""
    here = os.environ.get(STORE_ROOT_ENV)
    if declared is None:
        return HostStore(None)
    return HostStore(Path(declared), Path(here) if here else None)


def host_artifact_store(url: str | None) -> ArtifactStore | None:
    """The artifact store at ``url`` with this host's credentials (its ArtifactStore block, else the
    environment: SSH keys or agent, ``AWS_*``, ...); None when the hosts share one store (no URL)."""
    if not url:
        return None
    if os.environ.get(ARTIFACTS_BLOCK_ENV):
        from blocks import ArtifactStore as ArtifactStoreBlock

        return ArtifactStoreBlock.load(os.environ[ARTIFACTS_BLOCK_ENV]).store()
    return ArtifactStore(url)


def host_recipe_store(recipe: Recipe) -> Recipe:
    """``recipe`` with this host's store root (the worker's ``--store-root``), if it has its own."""
    here = os.environ.get(STORE_ROOT_ENV)
    if not here:
        return recipe
    return recipe.model_copy(update={"store": recipe.store.model_copy(update={"root": Path(here)})})


def host_recipe(recipe: Recipe) -> Recipe:
    """``recipe`` with this host's store root and toolchains (the worker's Toolchain blocks), if it names any."""
    from blocks import Toolchain

    recipe = host_recipe_store(recipe)

    for role, env in TOOLCHAIN_BLOCK_ENV.items():
        if os.environ.get(env):
            block = Toolchain.load(os.environ[env])
            if block.role != role:
                raise HostRequirementError(f"{env}={os.environ[env]}", f"is a {block.role} toolchain, not {role}",
                                           f"point {env} at a Toolchain block whose role is {role}")
            recipe = block.apply(recipe)
    return recipe


def host_serve_python(serve_python: str) -> str:
    """The serving toolchain's python on this host: the worker's Toolchain block, else the given one."""
    if os.environ.get(TOOLCHAIN_BLOCK_ENV["serve"]):
        from blocks import Toolchain

        return Toolchain.load(os.environ[TOOLCHAIN_BLOCK_ENV["serve"]]).python
    return serve_python


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
    store = host_store(store_root)
    result = download_task(source, str(store.here), hf_token_block)
    # The parent names the BF16 copy after this digest without reading the checkpoint on its own host.
    result = result.model_copy(update={"checkpoint_digest": checkpoint_digest(result.path),
                                       "checkpoint_fingerprint": checkpoint_fingerprint(result.path)})
    return store.to_declared(result)


@flow(name="ktflow-dequantize", persist_result=True)
def dequantize_stage(src: str, dst: str, workers: int | None = None, fsync: bool = True,
                     store_root: str | None = None) -> DequantizeResult:
    _enter_stage("dequantize", None)
    store = host_store(store_root)
    return store.to_declared(dequantize_task(str(store.to_host(src)), str(store.to_host(dst)), workers, fsync))


@flow(name="ktflow-sft", persist_result=True)
def sft_stage(recipe: Recipe, model_dir: str) -> SftResult:
    store = host_store(recipe.store.root)
    artifacts = host_artifact_store(recipe.store.artifacts)
    recipe = host_recipe(recipe)
    _enter_stage("sft", recipe)
    model = store.to_host(model_dir)
    if artifacts is not None:
        _fetch_published_adapter(recipe, model, store, artifacts)
    result = sft_task(recipe, str(model))
    if result.loss_curve is not None:  # travels with the result to the report, wherever that is written
        result = result.model_copy(update={"loss_curve_png": png_data_url(result.loss_curve)})
    if artifacts is not None:
        ref = artifacts.publish(Path(result.adapter_dir), store.key(result.adapter_dir))
        get_run_logger().info("adapter published to the artifact store: %s (%d files, %d bytes)", ref.where(),
                              ref.files, ref.bytes)
    return store.to_declared(result)


def _fetch_published_adapter(recipe: Recipe, model_dir: Path, store: HostStore, artifacts: ArtifactStore) -> None:
    """A rerun on a host whose store lost the run finds the adapter published under its key and
    fetches it (the SFT engine then finds its published adapter: no training)."""
    adapter = run_adapter_dir(recipe, model_dir)
    if adapter.is_dir():
        return
    transfer = artifacts.transfer_manifest(store.key(adapter))
    if transfer is not None:
        artifacts.fetch(ArtifactRef(url=artifacts.url, key=transfer.key, digest=transfer.digest), adapter)
        get_run_logger().info("adapter %s fetched from the artifact store (published by an earlier run)", transfer.key)


@flow(name="ktflow-convert-lora", persist_result=True)
def convert_lora_stage(adapter_dir: str, out_dir: str, base_dir: str, serve_python: str,
                       store_root: str | None = None, fetch: ArtifactRef | None = None) -> ConvertLoraResult:
    """``fetch``: the trained adapter as the training host published it (hosts without a shared
    store); it is fetched, verified, to ``adapter_dir`` in this host's store first."""
    _enter_stage("convert-lora", None)
    store = host_store(store_root)
    adapter = store.to_host(adapter_dir)
    if fetch is not None:
        artifacts = host_artifact_store(fetch.url)
        assert artifacts is not None  # a URL was given
        artifacts.fetch(fetch, adapter)
        get_run_logger().info("adapter %s fetched and verified (%d files, %d bytes)", fetch.where(), fetch.files,
                              fetch.bytes)
    return store.to_declared(convert_lora_task(str(adapter), str(store.to_host(out_dir)), str(store.to_host(base_dir)),
                                               host_serve_python(serve_python)))


@flow(name="ktflow-quantize-int8", persist_result=True)
def quantize_int8_stage(bf16_dir: str, out_dir: str, threadpool_count: int, serve_python: str,
                        workers: int | None = None, skip_without_kernels: bool = False,
                        store_root: str | None = None) -> QuantizeInt8Result | StageSkipped:
    _enter_stage("quantize-int8", None)
    store = host_store(store_root)
    return store.to_declared(quantize_int8_task(str(store.to_host(bf16_dir)), str(store.to_host(out_dir)),
                                                threadpool_count, host_serve_python(serve_python), workers,
                                                skip_without_kernels))


@flow(name="ktflow-serve", persist_result=True)
def serve_stage(recipe: Recipe, model_dir: str, adapter_dir: str, kt_weight_dir: str | None = None,
                version: int | None = None, base_dir: str | None = None, why: str = "promoted") -> Endpoint:
    store = host_store(recipe.store.root)
    recipe = host_recipe(recipe)
    _enter_stage("serve", recipe)
    here = store.to_host
    endpoint = serve_task(recipe, str(here(model_dir)), str(here(adapter_dir)),
                          str(here(kt_weight_dir)) if kt_weight_dir else None, version,
                          str(here(base_dir)) if base_dir else None, why)
    from blocks import ServingEndpoint

    # A block for clients and dashboards; the key stays on the serving host, in its env var.
    ServingEndpoint(url=endpoint.url, base_model=endpoint.served_model_name,
                    tuned_model=endpoint.adapter_model_name or endpoint.served_model_name,
                    api_key_env=endpoint.api_key_env or "", adapter_dir=str(endpoint.adapter_dir or "")
                    ).save(endpoint_block_name(recipe), overwrite=True)
    return store.to_declared(endpoint)


@flow(name="ktflow-evaluate", persist_result=True)
def evaluate_stage(recipe: Recipe, model_dir: str, version: int, serve_model_dir: str,
                   kt_weight_dir: str | None = None) -> Judgement:
    store = host_store(recipe.store.root)
    recipe = host_recipe(recipe)
    _enter_stage("evaluate", recipe)
    here = store.to_host
    return store.to_declared(evaluate_task(recipe, str(here(model_dir)), version, str(here(serve_model_dir)),
                                           str(here(kt_weight_dir)) if kt_weight_dir else None))


def endpoint_block_name(recipe: Recipe) -> str:
    """The ServingEndpoint block a recipe's serve stage saves (block names: lowercase, digits, dashes)."""
    return re.sub(r"[^a-z0-9-]+", "-", recipe.name.lower()) + "-endpoint"


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

