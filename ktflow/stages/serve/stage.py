"""The serve stage: start the recipe's endpoint (validated, preflighted, health-gated, smoke-tested,
recorded), stop it, swap its adapter with a rollback, and what serving and a candidate cost a host."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from pydantic import BaseModel

from ktflow.errors import (
    AdapterError,
    CheckpointError,
    HostRequirementError,
    InvalidInputError,
    KtflowError,
    ServerStartError,
    SwapError,
)
from ktflow.host.process import (
    TERMINATE_GRACE_S,
    Guardian,
    terminate_tree,
)
from ktflow.planning.sizing import ModelSize, model_size
from ktflow.planning.stage_plan import host_requirements
from ktflow.recipe import Recipe
from ktflow.resources import GpuNeed, RamNeed, Resources, preflight
from ktflow.stages.serve.llamafactory import _llamafactory_launch, _train_python
from ktflow.stages.serve.process import _Launch, _reap_marked, smoke_test, start_server
from ktflow.stages.serve.records import (
    ENDPOINT_FILE,
    SERVER_LOG,
    SERVER_MARKER,
    AdapterRef,
    Endpoint,
    FailedSwap,
    _now,
    _process_of,
    _recipe_port,
    _write_endpoint,
    base_url,
    is_alive,
    port_is_free,
    read_endpoint,
    resolve_api_key,
)
from ktflow.stages.serve.sglang import _sglang_launch, serve_python
from ktflow.store import read_manifest
from ktflow.units import GiB


def _server_python(recipe: Recipe) -> Path:
    """The python the recipe's server runs in (raises HostRequirementError when it is missing)."""
    return serve_python(recipe) if recipe.serving.backend == "sglang" else _train_python(recipe)


def _check_model_dir(model_dir: Path) -> Path:
    model_dir = Path(model_dir).absolute()
    if not (model_dir / "config.json").is_file():
        raise CheckpointError(str(model_dir), "is not a model directory (no config.json)",
                              "pass the base model the adapter was trained on")
    return model_dir


def _check_adapter(adapter_dir: Path, model_dir: Path, validate: bool) -> Path:
    adapter_dir = Path(adapter_dir).absolute()
    if (adapter_dir / "fused_expert_lora.safetensors").is_file():
        raise AdapterError(str(adapter_dir), "is a KT fused-expert adapter, which LlamaFactory's HuggingFace "
                                             "backend cannot apply", "serve the convert-lora stage's output instead")
    if validate:
        from ktflow.stages.convert_lora import validate_adapter

        validate_adapter(adapter_dir, model_dir)
    elif not adapter_dir.is_dir():
        raise AdapterError(str(adapter_dir), "does not exist", "pass the SFT stage's adapter directory")
    return adapter_dir


class ServeSizes(BaseModel):
    """What the serve stage's needs are a function of."""

    model: ModelSize  # the checkpoint the server loads (sglang: its non-expert weights go to the GPUs)
    kt_weight_bytes: int = 0  # sglang: the CPU expert weights as ``serving.kt_method`` reads them


def measure_serve(model_dir: Path, kt_weight_dir: Path | None = None) -> ServeSizes:
    """The sizes :func:`serve_needs` reads, from headers only.

    Raises:
        CheckpointError: a config or header cannot be read.
    """
    kt_bytes = 0
    if kt_weight_dir is not None:
        kt = model_size(kt_weight_dir)
        kt_bytes = kt.expert_stored_bytes or kt.stored_bytes  # quantize-int8's output holds experts only
    return ServeSizes(model=model_size(model_dir), kt_weight_bytes=kt_bytes)


def serve_needs(recipe: Recipe, sizes: ServeSizes) -> Resources:
    """What serving ``recipe`` needs of its host: the CPU experts in RAM and the rest on the GPUs
    (sglang-kt), or the whole model in RAM (LlamaFactory's CPU API); both in BF16 where not quantized.
    sglang's KV pool is counted where ``serving.max_total_tokens`` bounds it and the model's KV geometry is
    known (:func:`kv_pool_bytes`); otherwise it comes on top (sglang gives it what the GPU has left) and the
    GPU figure is a lower bound, said so in its ``why``.
    """
    serving = recipe.serving
    requirement = host_requirements(recipe)["serve"]
    if serving.backend == "llamafactory":
        return Resources(host=requirement, ram=RamNeed(
            bytes=2 * sizes.model.parameters, what="serve", why="the model in BF16 with the adapter merged"))
    gpus = max(serving.gpus, 1)
    pool = kv_pool_bytes(recipe, sizes.model)
    weights_why = "the non-expert weights in BF16, split over the tensor-parallel ranks"
    if pool is not None:
        kv_why = (f", and a KV pool of {serving.max_total_tokens:,} tokens x {sizes.model.kv_bytes_per_token:,} B "
                  f"({'an MLA latent, whole on each rank' if sizes.model.kv_latent else 'split over the ranks'})")
    elif serving.max_total_tokens is not None:
        kv_why = f"; the KV pool of {serving.max_total_tokens:,} tokens comes on top (the model's KV size is unknown)"
    else:
        kv_why = ("; the KV pool comes on top (sglang gives it the GPU memory left: set serving.max_total_tokens to "
                  "bound it and count it here)")
    return Resources(
        host=requirement,
        ram=RamNeed(bytes=sizes.kt_weight_bytes, what="serve", why=f"the CPU experts as {serving.kt_method}",
                    of="installed", numa_pools=serving.kt_threadpool_count),
        gpu=GpuNeed(bytes=2 * sizes.model.non_expert_parameters // gpus + (pool or 0), gpus=gpus,
                    field="serving.gpus", what="sglang-kt", why=weights_why + kv_why),
    )


def kv_pool_bytes(recipe: Recipe, model: ModelSize) -> int | None:
    """One GPU's share of sglang's KV pool when ``serving.max_total_tokens`` bounds it (None: unbounded, or the
    model's KV geometry unknown). An MLA latent is held whole on every tensor-parallel rank; per-head keys and
    values are split over the ranks by KV head.
    """
    tokens = recipe.serving.max_total_tokens
    if tokens is None or not model.kv_bytes_per_token:
        return None
    total = tokens * model.kv_bytes_per_token
    return total if model.kv_latent else total // max(recipe.serving.gpus, 1)


# How many servers judging a candidate starts beside production, per mode (the evaluation asks the base model
# through a server of its own: LlamaFactory's API serves one model per process, and sglang-kt refuses base
# requests on a server whose expert LoRA is loaded). beside with serving.dynamic_lora: none (see candidate_needs).
CANDIDATE_SERVERS = {"beside": 2, "offline": 0, "swap": 1}


def candidate_servers(recipe: Recipe, mode: str) -> int:
    """The servers judging a candidate in ``mode`` runs beside production's (or, ``swap``, beside the
    candidate serving in its place)."""
    if mode == "beside" and recipe.serving.backend == "sglang" and recipe.serving.dynamic_lora:
        return 0  # a second adapter name on production's server, which answers base requests too
    return CANDIDATE_SERVERS[mode]


def candidate_needs(recipe: Recipe, sizes: ServeSizes, mode: str) -> Resources:
    """What judging a candidate costs on top of production (``evaluation.candidate``).

    ``beside``: a second adapter name on the server where it loads adapters at run time (a few MB;
    plain SGLang's ``serving.dynamic_lora``), else a server for the candidate and one for the base
    model beside production (:func:`serve_needs` twice: for sglang-kt each holds its own copy of the
    CPU experts in RAM and its non-expert weights on the same GPUs). ``offline``: the training
    toolchain generating with the model in BF16 in RAM (LlamaFactory's chat engine on CPU).
    ``swap``: the candidate serves in production's place while it is judged; the base model is
    asked through a server of its own beside it (:func:`serve_needs` once).
    """
    if mode == "offline":
        return Resources(ram=RamNeed(bytes=2 * sizes.model.parameters, what="offline candidate generation",
                                     why="the model in BF16 in the training toolchain"))
    servers = candidate_servers(recipe, mode)
    if servers == 0:
        return Resources()
    one = serve_needs(recipe, sizes)
    what = "judging the candidate"
    each = {2: "two more servers, the candidate's and the base model's, each with ",
            1: "one more server, the base model's, beside the candidate serving in production's place, with "}[servers]
    ram = one.ram.model_copy(update={"bytes": servers * one.ram.bytes, "what": what,
                                     "why": f"{each}{one.ram.why}"}) if one.ram else None
    gpu = one.gpu.model_copy(update={"bytes": servers * one.gpu.bytes, "what": what,
                                     "why": f"{each}{one.gpu.why}"}
                             ) if one.gpu else None
    return Resources(ram=ram, gpu=gpu)


def candidate_gpu_shortfall(recipe: Recipe, sizes: ServeSizes, mode: str, host: Any) -> str | None:
    """Why the servers judging a candidate in ``mode`` do not fit on the GPUs production serves from
    (None: they do, or no GPU is involved).

    sglang sizes a server's static memory (weights and KV cache) as ``mem_fraction_static`` f of the
    GPU memory free when it starts: production takes f of each GPU, the next server f of what is
    left, and so on, so the n-th server beside production gets f (1 - f)^n of it, which must hold
    its non-expert weights. With f unset, sglang-kt gives production all of each GPU but its
    activation reserve: no second server fits.
    """
    serving = recipe.serving
    servers = candidate_servers(recipe, mode)
    gpus = host.gpus[: max(serving.gpus, 1)]
    if serving.backend != "sglang" or servers == 0 or not gpus:
        return None
    who = {2: "the candidate's and the base model's servers", 1: "the base model's server"}[servers]
    f = serving.mem_fraction_static
    if f is None:
        return (f"{who} would share the GPUs with production, but serving.mem_fraction_static is unset: sglang-kt "
                "then sizes production's weights and KV cache to all of each GPU but its activation reserve; set it "
                "(every server of the recipe takes that fraction of the GPU memory free when it starts)")
    weights = 2 * sizes.model.non_expert_parameters // max(serving.gpus, 1)
    for g in gpus:
        room = f * (1 - f) ** servers * g.vram_bytes
        if weights > room:
            return (f"{who} would share GPU {g.index} ({g.name}, {g.vram_bytes / GiB:.1f} GiB) with production: each "
                    f"sglang server takes mem_fraction_static {f} of the GPU memory free when it starts, which leaves "
                    f"the last one {room / GiB:.2f} GiB, less than its non-expert weights in BF16 "
                    f"({weights / GiB:.2f} GiB)")
    return None


def _start_endpoint(
    recipe: Recipe, *, model_dir: Path, adapter_dir: Path | None, record_dir: Path, api_key: str,
    key_file: Path | None, port: int, previous: AdapterRef | None, last_failed_swap: FailedSwap | None,
    log: Callable[[str], None] | None, die_with_parent: bool, kt_weight_dir: Path | None = None,
    host: Any = None,
) -> Endpoint:
    serving = recipe.serving
    if not port_is_free(serving.host, port):
        raise HostRequirementError(
            f"serving.port: {port}", f"{serving.host}:{port} is already in use",
            "stop what listens there (`ktflow serve --stop` if it is an earlier endpoint) or set serving.port",
        )
    child_env = {k: v for k, v in os.environ.items() if k != serving.api_key_env}
    if serving.backend == "sglang":
        launch = _sglang_launch(recipe, model_dir=model_dir, adapter_dir=adapter_dir, kt_weight_dir=kt_weight_dir,
                                record_dir=record_dir, port=port, host=host, log=log)
    else:
        launch = _llamafactory_launch(recipe, model_dir=model_dir, adapter_dir=adapter_dir, record_dir=record_dir,
                                      port=port)
    child_env.update(launch.env)
    child_env["PATH"] = f"{launch.python.parent}{os.pathsep}{child_env.get('PATH', '')}"
    manifest = read_manifest(adapter_dir) if adapter_dir is not None else None
    url = base_url(serving.host, port)
    endpoint = Endpoint(
        url=url, backend=serving.backend, served_model_name=serving.served_model_name,
        adapter_model_name=launch.model_name if adapter_dir is not None else None, pid=0,
        log_path=record_dir / SERVER_LOG, adapter_dir=adapter_dir,
        adapter_manifest_digest=manifest.digest() if manifest is not None else None, started_at=_now(),
        state="starting", host=serving.host, port=port, run_id=uuid.uuid4().hex, infer_config=launch.infer_path,
        api_key_env=serving.api_key_env, api_key_file=key_file, previous=previous, last_failed_swap=last_failed_swap,
    )
    if log:
        log(f"starting {launch.what} on {url} (model {launch.model_name}, adapter {adapter_dir or 'none'})")
    return _start_and_gate(endpoint, launch, child_env, api_key, record_dir=record_dir, log=log,
                           die_with_parent=die_with_parent, timeout_s=serving.ready_timeout_s)


def _start_and_gate(endpoint: Endpoint, launch: _Launch, env: dict[str, str], api_key: str, *, record_dir: Path,
                    log: Callable[[str], None] | None, die_with_parent: bool, timeout_s: float) -> Endpoint:
    """Start the server, health-gate and smoke-test it, and record it (``starting``, then ``ready``)."""

    def record_start(proc: subprocess.Popen) -> None:
        nonlocal endpoint
        try:
            created = psutil.Process(proc.pid).create_time()
        except psutil.NoSuchProcess:
            created = None
        endpoint = endpoint.model_copy(update={"pid": proc.pid, "pid_create_time": created})
        _write_endpoint(record_dir, endpoint)

    # Armed until the ready record is written: a server whose orchestrator dies while it starts
    # (before the gate, or during the smoke test) is stopped, never left holding the port.
    guardian = Guardian(SERVER_MARKER, endpoint.run_id)
    try:
        try:
            proc = start_server(
                launch.argv, env, log_path=endpoint.log_path, ready_url=launch.ready_url, api_key=api_key,
                key_env=launch.key_env, timeout_s=timeout_s, expect_model=launch.expect_model,
                check_auth=launch.check_auth, run_id=endpoint.run_id, cwd=record_dir, on_line=log,
                on_started=record_start, die_with_parent=die_with_parent, guardian=guardian,
                label=f"{launch.what} on {endpoint.url}, model {launch.model_name}, adapter "
                      f"{endpoint.adapter_dir or 'none'}",
            )
        except BaseException:
            _forget(record_dir, endpoint)
            raise
        _smoke_or_stop(proc, endpoint, api_key, launch.model_name, record_dir, log)
        endpoint = endpoint.model_copy(update={"state": "ready", "started_at": _now()})
        _write_endpoint(record_dir, endpoint)
    finally:
        guardian.disarm()  # ready: the server is meant to outlive us now (or it was stopped above)
    return endpoint


def _smoke_or_stop(proc: subprocess.Popen, endpoint: Endpoint, api_key: str, model_name: str, record_dir: Path,
                   log: Callable[[str], None] | None) -> None:
    """Smoke-test a ready server; one that fails it is stopped and forgotten."""
    try:
        smoke = smoke_test(endpoint.url, api_key, model_name)
    except BaseException as exc:
        terminate_tree(proc.pid)
        _reap_marked(endpoint.run_id)
        _forget(record_dir, endpoint)
        if isinstance(exc, KtflowError):
            raise ServerStartError(f"the server on {endpoint.url} is up but failed its smoke test: {exc}",
                                   log_path=endpoint.log_path) from None
        raise
    if log:
        log(f"{endpoint.url} ready; smoke test answered in {smoke['seconds']} s")


def _forget(record_dir: Path, endpoint: Endpoint) -> None:
    """Remove the record if it still names ``endpoint``'s run (a failed start leaves none)."""
    current = read_endpoint(record_dir)
    if current is not None and current.run_id == endpoint.run_id:
        (Path(record_dir) / ENDPOINT_FILE).unlink(missing_ok=True)


def serve(
    recipe: Recipe,
    *,
    model_dir: Path,
    adapter_dir: Path | None,
    record_dir: Path,
    api_key: str | None = None,
    port: int | None = None,
    validate: bool = True,
    log: Callable[[str], None] | None = None,
    die_with_parent: bool = False,
    kt_weight_dir: Path | None = None,
    host: Any = None,
) -> Endpoint:
    """Start the recipe's endpoint and record it in ``record_dir/endpoint.json``.

    ``llamafactory`` (CPU): LlamaFactory's API with the adapter merged at load. ``sglang``: sglang-kt
    in the serving toolchain with the launch :func:`ktflow.stages.sglang_launch.render_sglang_launch`
    renders (``kt_weight_dir`` holds the CPU expert weights for ``serving.kt_method``; ``host`` is
    the HostInfo to check it against, default this host's probe), ready on ``/health``; the model
    and the experts as sglang-kt reads them (:mod:`ktflow.stages.serve.sglang_inputs`: a view of a
    checkpoint it cannot load as it is, the ``.kt`` layout of AMXINT8 experts served with an expert
    LoRA), made at the first start and said in ``log``.

    Args:
        adapter_dir: the LoRA adapter to serve (PEFT; merged at load), or None for the base model.
        record_dir: where ``endpoint.json``, ``server.log``, ``infer.yaml`` (and, for a generated
            key, ``api_key``) live; one endpoint per directory.
        api_key: the key to require (default: see :func:`resolve_api_key`).
        port: overrides ``serving.port`` (e.g. a second, temporary server).
        validate: check the adapter against the base before starting (headers only).
        log: receives progress and the server's output lines while it starts.

    Raises:
        KtflowError: the backend is not llamafactory, or an endpoint is already running here.
        AdapterError: the adapter does not fit the base (nothing was started).
        HostRequirementError: the port is taken, or the toolchain is missing.
        ServerStartError: the server failed to start, to become ready or its smoke test.
    """
    sglang = recipe.serving.backend == "sglang"
    if sglang and kt_weight_dir is None:
        raise InvalidInputError("kt_weight_dir", "the sglang backend needs the CPU expert weights",
                                "pass the weights for serving.kt_method")
    record_dir = Path(record_dir).absolute()
    record_dir.mkdir(parents=True, exist_ok=True)
    existing = read_endpoint(record_dir)
    if existing is not None:
        if is_alive(existing):
            raise KtflowError(f"an endpoint is already running from {record_dir} ({existing.url}, pid "
                              f"{existing.pid}); stop it first (ktflow serve --stop) or swap its adapter")
        stop(record_dir)  # a stale record (the server died): clean it and what it may have left
    model_dir = _check_model_dir(model_dir)
    if adapter_dir is not None:
        adapter_dir = Path(adapter_dir).absolute() if sglang else _check_adapter(adapter_dir, model_dir, validate)
    host = preflight("serve", serve_needs(recipe, measure_serve(model_dir, kt_weight_dir)), record_dir, host=host)
    key, key_file = resolve_api_key(recipe, record_dir, api_key)
    return _start_endpoint(
        recipe, model_dir=model_dir, adapter_dir=adapter_dir, record_dir=record_dir, api_key=key, key_file=key_file,
        port=port if port is not None else _recipe_port(recipe, log), previous=None, last_failed_swap=None, log=log,
        die_with_parent=die_with_parent, kt_weight_dir=kt_weight_dir, host=host,
    )


def stop(record_dir: Path, *, grace_s: float = TERMINATE_GRACE_S) -> bool:
    """Stop the endpoint recorded in ``record_dir`` (its whole process tree) and remove the record.

    SIGTERM first (uvicorn finishes the requests in flight), SIGKILL after ``grace_s``. The API
    key file stays, so a restart keeps the same key. Idempotent.

    Returns:
        True if a running server was stopped; False if there was none (a stale record is removed).
    """
    record_dir = Path(record_dir)
    endpoint = read_endpoint(record_dir)
    if endpoint is None:
        return False
    proc = _process_of(endpoint)
    if proc is not None:
        terminate_tree(proc.pid, grace_s)
    _reap_marked(endpoint.run_id)
    (record_dir / ENDPOINT_FILE).unlink(missing_ok=True)
    return proc is not None


def swap_adapter(
    recipe: Recipe,
    *,
    model_dir: Path,
    new_adapter_dir: Path,
    record_dir: Path,
    api_key: str | None = None,
    validate: bool = True,
    log: Callable[[str], None] | None = None,
    kt_weight_dir: Path | None = None,
) -> Endpoint:
    """Serve ``new_adapter_dir`` in place of the recorded endpoint's adapter; roll back on failure.

    Same port, one server at a time (see the module docstring): validate the new adapter (a
    bad one is refused here and the old server is never touched), stop the old server, start
    the new one, health-gate and smoke-test it. On failure the previous adapter is restarted on
    the same port and gated again, ``endpoint.json`` names it (with ``last_failed_swap``), and
    :class:`SwapError` is raised with ``rolled_back=True``.

    Raises:
        KtflowError: nothing is recorded in ``record_dir`` to swap.
        AdapterError: the new adapter does not fit the base (the old server still serves).
        SwapError: the new adapter failed to serve (``rolled_back`` says whether the old serves again).
    """
    record_dir = Path(record_dir).absolute()
    current = read_endpoint(record_dir)
    if current is None:
        raise KtflowError(f"no endpoint is recorded in {record_dir}; start one with serve() first")
    model_dir = _check_model_dir(model_dir)
    sglang = recipe.serving.backend == "sglang"  # its adapter is converted for SGLang: serve() does not validate it
    new_adapter_dir = Path(new_adapter_dir).absolute() if sglang else _check_adapter(new_adapter_dir, model_dir,
                                                                                       validate)
    key, key_file = resolve_api_key(recipe, record_dir, api_key)
    good, good_previous = _last_good(current, record_dir)
    port = current.port or _recipe_port(recipe, log)
    _server_python(recipe)  # a missing toolchain is refused while the old server still serves
    if sglang and kt_weight_dir is not None:
        # what sglang-kt is given (a model view, the AMXINT8 .kt layout) is made while the old server still serves
        from ktflow.stages.serve.sglang_inputs import sglang_inputs

        sglang_inputs(recipe, model_dir=model_dir, kt_weight_dir=kt_weight_dir, adapter_dir=new_adapter_dir,
                      record_dir=record_dir, log=log)
    if log:
        log(f"swapping {good.adapter_dir} -> {new_adapter_dir} on port {port}")
    stop(record_dir)
    common = dict(model_dir=model_dir, record_dir=record_dir, api_key=key, key_file=key_file, port=port, log=log,
                  die_with_parent=False, kt_weight_dir=kt_weight_dir)
    try:
        return _start_endpoint(recipe, adapter_dir=new_adapter_dir, previous=good, last_failed_swap=None, **common)
    except (KtflowError, OSError) as exc:
        failure = FailedSwap(adapter_dir=new_adapter_dir, error=str(exc)[:4000], at=_now())
        if log:
            log(f"the new adapter failed ({type(exc).__name__}); rolling back to {good.adapter_dir}")
        try:
            _start_endpoint(recipe, adapter_dir=good.adapter_dir, previous=good_previous, last_failed_swap=failure,
                            **common)
        except (KtflowError, OSError) as again:
            raise SwapError(
                f"the new adapter {new_adapter_dir} failed to serve ({exc}), and restarting the previous adapter "
                f"{good.adapter_dir} failed too ({again}); nothing is serving from {record_dir}", rolled_back=False,
            ) from exc
        raise SwapError(
            f"the new adapter {new_adapter_dir} failed to serve and was rolled back; {good.adapter_dir} serves "
            f"again at {base_url(recipe.serving.host, port)}. Cause: {exc}", rolled_back=True,
        ) from exc


def _last_good(current: Endpoint, record_dir: Path) -> tuple[AdapterRef, AdapterRef | None]:
    """The adapter to return to if a swap fails, and the one before it.

    The adapter serving now is the good one; a record left "starting" by a crash is not proven
    good, so its own "previous" is.
    """
    if current.state == "ready":
        good = AdapterRef(adapter_dir=current.adapter_dir, adapter_manifest_digest=current.adapter_manifest_digest,
                          adapter_model_name=current.adapter_model_name)
        return good, current.previous
    if current.previous is not None:
        return current.previous, None
    raise KtflowError(f"the endpoint in {record_dir} never became ready and names no previous adapter; "
                      "stop it and serve() again")


