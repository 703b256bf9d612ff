"""The pipeline DAG, run in-process (``ktflow-pipeline``) or dispatched to stage deployments.

download -> dequantize (when a stage reads BF16) -> sft -> convert-lora -> quantize-int8 (when
AMXINT8 weights are wanted) -> evaluate -> serve: the adapter is registered as version N
and judged as a candidate before it serves (ktflow.stages.promotion); only one that passes its gate
is promoted by the serve stage, and a rejected one leaves production untouched and fails the
run after its report is published. Stages the recipe does not need are skipped
and the summary says why. Every stage's engine publishes a manifest-described artifact, so a
rerun of an unchanged recipe is a cache hit stage by stage; a changed dataset re-runs SFT and
what follows it, never download or dequantize.

The DAG is written once (:func:`run_pipeline`) against a ``call(stage, **parameters)``
function. The embedded flow calls the stage's task in this process. The distributed flow
(``ktflow-dispatch``) runs each stage as a child run of the stage's deployment, on the work
pool that ``ktflow.host.pools`` routes it to, and passes paths plus manifest digests (never
tensors) over the shared store.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import INPUTS, RUN_ID
from prefect.context import TaskRunContext
from prefect.logging import get_run_logger
from prefect.runtime import flow_run as current_run
from pydantic import BaseModel

from flows.stages import STAGE_FLOWS, STAGE_TASKS, host_recipe_store, host_store
from ktflow.artifact_store import ArtifactRef
from ktflow.errors import CheckpointError, InvalidInputError, NoWorkerError, PromotionGateError, StageFailedError
from ktflow.formats.dataset import validate_dataset
from ktflow.host.hardware import HostInfo, probe_host
from ktflow.host.pools import WorkPoolSpec, pool_for_stage, pool_named, serving_pool
from ktflow.planning.stage_plan import StageName, StagePlan, StageSkipped, plan_stages, prepared_for_another_host
from ktflow.recipe import Recipe, int8_threadpool_count, load_recipe
from ktflow.stages.evaluate import refuse_contaminated_gate
from ktflow.stages.promotion import registry_of
from ktflow.stages.sft import check_hf_fits_gpus
from ktflow.stages.weights import bf16_dir_for, int8_dir_for, serving_weights, trains_on_source
from ktflow.store import HostStore, read_manifest
from tasks._common import retry_unless_invalid_input
from tasks.promote import emit_rejected, register_adapter_task
from tasks.report import publish_run_report

StageCall = Callable[..., Any]


def run_pipeline(recipe: Recipe, call: StageCall, hf_token_block: str | None = None,
                 host: HostInfo | None = None) -> dict[str, Any]:
    """Every stage ``recipe`` needs, in order; ``call(stage, **parameters)`` runs one stage.

    ``host``: the one host every stage runs on (the embedded run); a stage that only prepares
    an artifact for another host is then skipped up front when this host lacks its kernels, as
    ``ktflow doctor`` says. A distributed run (no ``host``) lets the stage's own host decide.

    The dataset (and the evaluation set) are validated first: a bad record fails the run in
    seconds, not after a download and a dequantize; so does an enforced promotion gate on an
    evaluation set that overlaps the training data (it could never promote).
    """
    validate_dataset(recipe.dataset)
    refuse_contaminated_gate(recipe)
    table = _StageTable({p.stage: p for p in plan_stages(recipe, host)})
    source = call("download", source=recipe.source, store_root=str(recipe.store.root), hf_token_block=hf_token_block)
    table.record("download", str(source.path) + (" (cached)" if source.cached else ""))
    if host is not None:  # the host that trains is known: a model its GPUs cannot hold is refused before dequantize
        check_hf_fits_gpus(recipe, host, source.path)
    bf16_dir = _dequantize(recipe, call, source, table)
    model_dir = source.path if trains_on_source(recipe) or bf16_dir is None else bf16_dir

    trained = call("sft", recipe=recipe, model_dir=str(model_dir))
    resumed = f", resumed from {trained.resumed_from}" if trained.resumed_from else ""
    table.record("sft", f"{trained.adapter_dir}" + (" (cached)" if trained.cached else f" ({trained.steps} steps{resumed})"))
    digest = trained.manifest_digest or read_manifest(trained.adapter_dir).digest()  # type: ignore[union-attr]
    handoff = None
    if recipe.store.artifacts:  # each host keeps its own store: the serving host makes its own base weights
        source, bf16_dir = _serving_host_weights(recipe, call, source, table, hf_token_block)
        model_dir = source.path if trains_on_source(recipe) or bf16_dir is None else bf16_dir
        handoff = ArtifactRef(url=recipe.store.artifacts, key=HostStore(recipe.store.root).key(trained.adapter_dir),
                              digest=digest)
    adapter = call("convert-lora", adapter_dir=str(trained.adapter_dir),
                   out_dir=str(recipe.store.layout.adapter(digest[:16])), base_dir=str(model_dir),
                   serve_python=str(recipe.toolchains.serve.python), **({"fetch": handoff} if handoff else {}))
    fetched = f"; fetched from {handoff.where()}, verified" if handoff else ""
    table.record("convert-lora", f"{adapter.path} ({adapter.kind}, rank {adapter.rank}){fetched}")
    _quantize_int8(recipe, call, bf16_dir or source.path, table)

    serve_model, kt_weights = serving_weights(recipe, source_dir=source.path, bf16_dir=bf16_dir)
    return _judge_and_promote(recipe, call, table, trained, adapter.path, model_dir=model_dir, serve_model=serve_model,
                              kt_weights=kt_weights)


def _serving_host_weights(recipe: Recipe, call: StageCall, trained_on: Any, table: _StageTable,
                          hf_token_block: str | None) -> tuple[Any, Path | None]:
    """The base weights the serving stages read, made by the serving host in its own store (the
    same pinned download and bit-exact dequantize as the training host's): ``(source, bf16_dir)``.

    Raises:
        CheckpointError: the serving host's checkpoint is not the one the adapter was trained on.
    """
    source = call("download", on="serve", source=recipe.source, store_root=str(recipe.store.root),
                  hf_token_block=hf_token_block)
    if trained_on.checkpoint_fingerprint and source.checkpoint_fingerprint != trained_on.checkpoint_fingerprint:
        raise CheckpointError(
            f"source {recipe.source.model_dump(exclude_none=True)} on the serving host",
            f"is checkpoint {str(source.checkpoint_fingerprint)[:12]} (content fingerprint), "
            f"the training host's is {trained_on.checkpoint_fingerprint[:12]}",
            "give both hosts the same source (a pinned hub revision, or the same files at source.local_path)")
    table.append("download", f"serving host: {source.path}" + (" (cached)" if source.cached else ""))
    bf16_dir = _dequantize(recipe, call, source, table, on="serve")
    return source, bf16_dir


def _judge_and_promote(recipe: Recipe, call: StageCall, table: _StageTable, trained: Any, adapter: Path, *,
                       model_dir: Path, serve_model: Path, kt_weights: Path | None) -> dict[str, Any]:
    """Register the adapter as version N, judge it as a candidate, and promote it only if it passed.

    The candidate is judged where it takes no production traffic (or, in swap mode, rolled back
    on a failed gate); the base model of the comparison is the one the adapter was trained on.
    A rejected candidate's report is published, then the run fails naming what stays in production.
    """
    # The registry lives in the serving host's store, where this parent runs when hosts keep their
    # own stores (its worker's --store-root): the paths it reads are mapped onto this host.
    store = host_store(recipe.store.root)
    here = host_recipe_store(recipe)
    version = register_adapter_task(here, str(store.to_host(adapter)), str(store.to_host(trained.adapter_dir)),
                                    str(store.to_host(model_dir)))
    outcome: dict[str, Any] = {"adapter": str(adapter), "version": version.version}
    weights = dict(kt_weight_dir=str(kt_weights) if kt_weights else None)
    judgement = None
    before = registry_of(here).production().version
    if table.plans["evaluate"].needed:
        judgement = call("evaluate", recipe=recipe, model_dir=str(model_dir), version=version.version,
                         serve_model_dir=str(serve_model), **weights)
        table.record("evaluate", evaluation_verdict(judgement))
        outcome["evaluation"] = str(judgement.evaluation.report_md)
    else:
        table.record("evaluate", "-")
    if judgement is not None and not judgement.accepted:
        table.record("serve", judgement.summary().split(": ", 1)[1],
                     skipped=StageSkipped(stage="serve", reason="the candidate did not pass its gate"))
        _report(recipe, table, trained, judgement, endpoint=None, promotion=judgement.summary())
        emit_rejected(recipe, judgement)  # here, not in the (cached) evaluate task: every rejected run says so
        raise PromotionGateError(judgement.rejection())
    why = judgement.summary() if judgement is not None else "promoted (the recipe does not evaluate)"
    endpoint = call("serve", recipe=recipe, model_dir=str(serve_model), adapter_dir=str(adapter),
                    version=version.version, base_dir=str(model_dir), why=why, **weights)
    table.record("serve", f"{endpoint.url} (v{version.version})")
    outcome["endpoint"] = endpoint.url
    promotion = f"v{version.version} serves (it did before this run)" if before == version.version else \
        f"promoted v{version.version}" + (f" (replaces v{before})" if before is not None else "")
    outcome["promotion"] = promotion
    _report(recipe, table, trained, judgement, endpoint, promotion=promotion)
    outcome["stages"] = table.rows
    return outcome


def _report(recipe: Recipe, table: _StageTable, trained: Any, judgement: Any, endpoint: Any, promotion: str) -> None:
    """The run's summary table and report artifacts (a rejected run's too)."""
    create_table_artifact(key="pipeline-summary", table=table.rows, description=f"ktflow pipeline: {recipe.name}")
    publish_run_report(recipe, table.rows, trained=trained, judgement=judgement, endpoint=endpoint, promotion=promotion)


class _StageTable:
    """The pipeline's stage table: each stage, whether it ran (and why), and what it made."""

    def __init__(self, plans: dict[str, StagePlan]) -> None:
        self.plans = plans
        self._rows: dict[str, dict[str, Any]] = {}

    def record(self, stage: str, result: str, skipped: StageSkipped | None = None) -> None:
        runs = self.plans[stage].needed and skipped is None
        self._rows[stage] = {"stage": stage, "runs": "yes" if runs else "skipped",
                             "why": skipped.reason if skipped else self.plans[stage].reason, "result": result}

    def append(self, stage: str, result: str) -> None:
        """More of what ``stage`` made (the serving host's own copy, where hosts keep their own stores)."""
        self._rows[stage]["result"] += f"; {result}"

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The recorded rows in the stages' order (a candidate is judged before it is served)."""
        return [self._rows[stage] for stage in self.plans if stage in self._rows]


def _dequantize(recipe: Recipe, call: StageCall, source: Any, table: _StageTable, on: str | None = None) -> Path | None:
    """The BF16 copy of the downloaded ``source``, when a stage reads BF16 (None: not made);
    ``on="serve"``: made by the serving host, in its own store."""
    if not table.plans["dequantize"].needed:
        if on is None:
            table.record("dequantize", "-")
        return None
    bf16 = call("dequantize", **({"on": on} if on else {}), src=str(source.path),
                dst=str(bf16_dir_for(recipe, source.path, source.checkpoint_digest)),
                workers=recipe.conversion.workers, fsync=recipe.conversion.fsync)
    made = f"{bf16.path}" + (" (cached)" if bf16.cached else f" ({bf16.tensors_decoded} tensors)")
    if on is None:
        table.record("dequantize", made)
    else:
        table.append("dequantize", f"serving host: {made}")
    return bf16.path


def _quantize_int8(recipe: Recipe, call: StageCall, base: Path, table: _StageTable) -> None:
    """kt-kernel's INT8 experts of ``base``, when the recipe wants them (here or for a later host)."""
    if not table.plans["quantize-int8"].needed:
        table.record("quantize-int8", "-")
        return
    t = int8_threadpool_count(recipe)
    int8 = call("quantize-int8", bf16_dir=str(base), out_dir=str(int8_dir_for(recipe, base)), threadpool_count=t,
                serve_python=str(recipe.toolchains.serve.python), workers=recipe.conversion.workers,
                skip_without_kernels="quantize-int8" in prepared_for_another_host(recipe))
    if isinstance(int8, StageSkipped):
        table.record("quantize-int8", "-", skipped=int8)
    else:
        table.record("quantize-int8", f"{int8.path} (T={t})" + (" (cached)" if int8.cached else ""))


def evaluation_verdict(judgement: Any) -> str:
    """The evaluate row of the stage table: adapter check, promotion, the train/eval overlap, and
    the candidate's verdict."""
    report = judgement.evaluation
    overlap = report.contamination
    reused = " (cached: it serves and was judged before)" if judgement.reused else ""
    return (f"adapter applied: {report.adapter_applied}, promoted: {report.promoted}, train/eval overlap: "
            f"{overlap.count}/{overlap.eval_prompts}; {judgement.summary()}{reused}")


def _call_task(stage: StageName, on: str | None = None, **parameters: Any) -> Any:
    # One host, one store: what the serving host makes for itself (``on``) is this host's cache hit,
    # and the adapter to fetch (``fetch``) is already here.
    accepted = inspect.signature(STAGE_TASKS[stage].fn).parameters
    return STAGE_TASKS[stage](**{name: value for name, value in parameters.items() if name in accepted})


@flow(name="ktflow-pipeline")
def pipeline(recipe: Recipe, hf_token_block: str | None = None) -> dict[str, Any]:
    """Fine-tune and serve ``recipe`` in this process: every stage it needs, in order."""
    return run_pipeline(recipe, _call_task, hf_token_block, host=probe_host(recipe.store.root))


# --------------------------------------------------------------------------- distributed


DEFAULT_PICKUP_TIMEOUT_S = 600.0
"""How long a dispatched stage waits for a live worker of its pool (Prefect marks a worker
offline 3 missed heartbeats, 90 s by default, after it dies)."""


def stage_deployment(stage: StageName, pool: str | None = None) -> str:
    """``flow-name/deployment-name`` of a stage on ``pool`` (default: its own): a deployment is named
    after its pool."""
    return f"{STAGE_FLOWS[stage].name}/{pool or pool_for_stage(stage).name}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, Path):
        return str(value)
    return value


@task(
    name="dispatch",
    task_run_name="{stage}",
    # Within one parent run a completed stage is not dispatched twice (a parent retry reuses it).
    cache_policy=INPUTS + RUN_ID,
    cache_result_in_memory=False,
    retries=1,
    retry_delay_seconds=5,
    # A stage that failed on bad input fails the same way again; a crash (killed worker,
    # lost host) is retried, and the stage's engine resumes what the crashed attempt finished.
    retry_condition_fn=retry_unless_invalid_input,
)
def dispatch_stage(stage: StageName, parameters: dict[str, Any],
                   pickup_timeout_s: float = DEFAULT_PICKUP_TIMEOUT_S, pool: str | None = None) -> Any:
    """Run ``stage`` as a child run of its deployment (on ``pool``, default its own) and return the child's result.

    Raises:
        NoWorkerError: no live worker served the stage's pool for ``pickup_timeout_s`` while
            the child waited to start (the child is cancelled).
    """
    from prefect.deployments import run_deployment

    attempt = TaskRunContext.get().task_run.run_count  # type: ignore[union-attr]
    # The same key returns the existing run even when it failed: a retry needs a new one.
    key = f"{current_run.id}:{stage}:{pool or ''}:{current_run.run_count}:{attempt}"
    child = run_deployment(stage_deployment(stage, pool), parameters=parameters, idempotency_key=key, as_subflow=True,
                           timeout=0)  # created, not awaited: we wait below, so we can cancel it
    try:
        child = _wait_until_final(child.id, stage, pickup_timeout_s, pool)
    except BaseException as exc:
        # The parent is being cancelled (the worker's SIGTERM arrives as an exception), timed
        # out or crashed, or no worker came: the child must not start (or train on) unobserved.
        why = str(exc) if isinstance(exc, NoWorkerError) else f"the parent pipeline run {current_run.id} stopped"
        _cancel(child.id, why)
        raise
    state = child.state
    if state is None or not state.is_completed():
        error = _child_exception(state)
        if isinstance(error, InvalidInputError):
            raise error
        kind = state.type.value if state else "UNKNOWN"
        raise StageFailedError(f"stage {stage} (run {child.name}, pool {child.work_pool_name}) ended {kind}: "
                               f"{state.message if state else 'no state'}")
    return state.result()


def _wait_until_final(run_id: Any, stage: StageName, pickup_timeout_s: float, pool_name: str | None = None,
                      poll_s: float = 1.0) -> Any:
    """The child run once it ends. While it waits to be picked up, a pool that no live worker
    has served for ``pickup_timeout_s`` ends the wait: a run never stays Scheduled forever."""
    from prefect.client.orchestration import get_client

    pool = pool_named(pool_name) if pool_name else pool_for_stage(stage)
    last_served = time.monotonic()
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(run_id)
            if run.state is not None and run.state.is_final():
                return run
            if run.state is None or run.state.is_scheduled():
                now = time.monotonic()
                if _live_workers(client, pool.name):
                    last_served = now  # busy workers: the run waits its turn
                elif now - last_served > pickup_timeout_s:
                    raise NoWorkerError(
                        f"stage {stage} (run {run.name}) on work pool {pool.name}",
                        f"no live worker served the pool for {pickup_timeout_s:g} s, so the run was never picked up.",
                        f"start one on a host that qualifies ({_pool_needs(pool)}): `ktflow worker --pool {pool.name}` "
                        "with PREFECT_API_URL pointing at this server (`ktflow worker --list` says whether a host "
                        "qualifies); or raise the pipeline's pickup_timeout_s",
                    )
            time.sleep(poll_s)


def _live_workers(client: Any, pool: str) -> list[Any]:
    from prefect.client.schemas.objects import WorkerStatus

    try:
        workers = client.read_workers_for_work_pool(pool)
    except Exception:  # the pool does not exist (yet): nobody serves it
        return []
    return [w for w in workers if w.status == WorkerStatus.ONLINE]


def _pool_needs(pool: WorkPoolSpec) -> str:
    if pool.min_cpu_variant is None:
        return "any CPU"
    return f"kt-kernel variant {pool.min_cpu_variant} or better: {pool.cpu_reason}"


def _cancel(run_id: Any, why: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(run_id)
            if run.state is None or not run.state.is_final():
                # Cancelling: the child's worker stops its process group (and ktflow's tool guard its tools).
                client.set_flow_run_state(run_id, Cancelling(message=why), force=True)
    except Exception:  # best effort: the server's own cleanup cancels orphaned children later
        pass


def _child_exception(state: Any) -> BaseException | None:
    if state is None or not state.is_failed():
        return None
    try:
        value = state.result(raise_on_failure=False)
    except Exception:  # result not persisted or unreadable: fall back to the message
        return None
    return value if isinstance(value, BaseException) else None


def _dispatcher(recipe: Recipe, pickup_timeout_s: float) -> StageCall:
    """Dispatch a stage to its pool (``on="serve"``: to the serving host's, for what it makes in its
    own store), telling a stage flow that takes paths which store root they are under."""

    def dispatch(stage: StageName, on: str | None = None, **parameters: Any) -> Any:
        if "store_root" in inspect.signature(STAGE_FLOWS[stage].fn).parameters:
            parameters.setdefault("store_root", str(recipe.store.root))
        pool = serving_pool().name if on == "serve" else None
        return dispatch_stage(stage, {name: _jsonable(value) for name, value in parameters.items()}, pickup_timeout_s,
                              pool)

    return dispatch


def _with_store(recipe: Recipe, store_block: str | None) -> Recipe:
    if not store_block:
        return recipe
    from blocks import ModelStore

    return ModelStore.load(store_block).apply(recipe)


@flow(name="ktflow-dispatch")
def pipeline_distributed(recipe: Recipe, hf_token_block: str | None = None,
                         store_block: str | None = None,
                         pickup_timeout_s: float = DEFAULT_PICKUP_TIMEOUT_S) -> dict[str, Any]:
    """Fine-tune and serve ``recipe`` with every stage on the work pool that can run it.

    ``hf_token_block``: a ``ktflow-huggingface-credentials/NAME`` block or a Secret block's name.
    ``store_block``: a ModelStore block whose root replaces the recipe's store root.
    ``pickup_timeout_s``: how long a stage may wait for a live worker of its pool before the run fails.
    """
    recipe = _with_store(recipe, store_block)
    get_run_logger().info("dispatching %s: %s", recipe.name,
                          ", ".join(f"{p.stage} -> {pool_for_stage(p.stage).name}" for p in plan_stages(recipe)
                                    if p.needed))
    return run_pipeline(recipe, _dispatcher(recipe, pickup_timeout_s), hf_token_block)


@flow(name="ktflow-retrain")
def retrain(recipe_file: str, dataset_file: str | None = None, hf_token_block: str | None = None,
            store_block: str | None = None, pickup_timeout_s: float = DEFAULT_PICKUP_TIMEOUT_S) -> dict[str, Any]:
    """Retrain a recipe (a file on the shared checkout), optionally on a newly published dataset.

    Started by the schedule and by ``dataset.version.published`` events (``ktflow dataset
    publish``). An unchanged dataset is a cache hit end to end and leaves the server running.
    """
    overrides = [f"dataset.files={json.dumps([dataset_file])}"] if dataset_file else []
    recipe = _with_store(load_recipe(recipe_file, overrides), store_block)
    get_run_logger().info("retraining %s on %s", recipe.name, ", ".join(map(str, recipe.dataset.files)))
    return run_pipeline(recipe, _dispatcher(recipe, pickup_timeout_s), hf_token_block)
