"""The serve stage's lifecycle: start the recipe's endpoint (validated, preflighted, health-gated, smoke-tested,
recorded), stop it, swap its adapter with a rollback, a temporary server for the length of a block, and the dry
run (the launch the serve stage would start, with nothing made or started). The backend is picked here, once
(:func:`backend_for`); everything else is the same for both."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from ktflow.errors import (
    CheckpointError,
    HostRequirementError,
    InvalidInputError,
    KtflowError,
    ServerStartError,
    SwapError,
)
from ktflow.host import hardware
from ktflow.host.hardware import GpuInfo, HostInfo
from ktflow.host.process import (
    TERMINATE_GRACE_S,
    Guardian,
    terminate_tree,
)
from ktflow.recipe import Recipe
from ktflow.resources import preflight
from ktflow.stages.serve.backend import Backend, Launch, Log, ServeMode
from ktflow.stages.serve.levers import recipe_with_measured_levers, served_model
from ktflow.stages.serve.llamafactory import BACKEND as LLAMAFACTORY
from ktflow.stages.serve.needs import measure_serve, serve_needs
from ktflow.stages.serve.process import _reap_marked, smoke_test, start_server
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
    free_port,
    is_alive,
    port_is_free,
    read_endpoint,
    resolve_api_key,
)
from ktflow.stages.serve.sglang import BACKEND as SGLANG
from ktflow.store import existing_ancestor, read_manifest


def backend_for(recipe: Recipe) -> Backend:
    """The backend that serves ``recipe`` (``serving.backend``)."""
    return SGLANG if recipe.serving.backend == "sglang" else LLAMAFACTORY


def _check_model_dir(model_dir: Path) -> Path:
    model_dir = Path(model_dir).absolute()
    if not (model_dir / "config.json").is_file():
        raise CheckpointError(str(model_dir), "is not a model directory (no config.json)",
                              "pass the base model the adapter was trained on")
    return model_dir


def _start_endpoint(
    recipe: Recipe, *, model_dir: Path, adapter_dir: Path | None, record_dir: Path, api_key: str,
    key_file: Path | None, port: int, previous: AdapterRef | None, last_failed_swap: FailedSwap | None,
    log: Callable[[str], None] | None, die_with_parent: bool, kt_weight_dir: Path | None = None,
    host: HostInfo | None = None, mode: ServeMode = "lora", serving_settings: str | None = None,
) -> Endpoint:
    serving = recipe.serving
    if not port_is_free(serving.host, port):
        raise HostRequirementError(
            f"serving.port: {port}", f"{serving.host}:{port} is already in use",
            "stop what listens there (`ktflow serve --stop` if it is an earlier endpoint) or set serving.port",
        )
    child_env = {k: v for k, v in os.environ.items() if k != serving.api_key_env}
    launch = backend_for(recipe).launch(recipe, model_dir=model_dir, adapter_dir=adapter_dir,
                                        kt_weight_dir=kt_weight_dir, record_dir=record_dir, port=port, host=host,
                                        log=log, mode=mode)
    child_env.update(launch.env)
    child_env["PATH"] = f"{launch.python.parent}{os.pathsep}{child_env.get('PATH', '')}"
    manifest = read_manifest(adapter_dir) if adapter_dir is not None else None
    url = base_url(serving.host, port)
    endpoint = Endpoint(
        url=url, backend=serving.backend, served_model_name=serving.served_model_name,
        adapter_model_name=launch.model_name if adapter_dir is not None and launch.merged_dir is None else None, pid=0,
        log_path=record_dir / SERVER_LOG, adapter_dir=adapter_dir,
        adapter_manifest_digest=manifest.digest() if manifest is not None else None, started_at=_now(),
        state="starting", host=serving.host, port=port, run_id=uuid.uuid4().hex, infer_config=launch.infer_path,
        api_key_env=serving.api_key_env, api_key_file=key_file, previous=previous, last_failed_swap=last_failed_swap,
        merged_dir=launch.merged_dir, serving_settings=serving_settings,
    )
    if log:
        how = "merged into the weights" if launch.merged_dir is not None else "as a LoRA adapter"
        log(f"starting {launch.what} on {url} (model {launch.model_name}, adapter "
            f"{f'{adapter_dir}, {how}' if adapter_dir is not None else 'none'})")
    return _start_and_gate(endpoint, launch, child_env, api_key, record_dir=record_dir, log=log,
                           die_with_parent=die_with_parent, timeout_s=serving.ready_timeout_s)


def _start_and_gate(endpoint: Endpoint, launch: Launch, env: dict[str, str], api_key: str, *, record_dir: Path,
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


def _with_measured_levers(recipe: Recipe, model_dir: Path, host: HostInfo, mode: ServeMode,
                          log: Log) -> tuple[Recipe, str | None]:
    """``recipe`` with the serving settings ``ktflow tune-serving`` measured on this machine for this model and mode
    (where the recipe leaves them unset), and the line that says so (logged)."""
    recipe, line = recipe_with_measured_levers(recipe, host.machine, served_model(recipe, model_dir, mode))
    if line and log:
        log(line)
    return recipe, line


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
    host: HostInfo | None = None,
    mode: ServeMode | None = None,
    measured_settings: bool = True,
) -> Endpoint:
    """Start the recipe's endpoint and record it in ``record_dir/endpoint.json``.

    ``llamafactory`` (CPU): LlamaFactory's API with the adapter merged at load. ``sglang``: sglang-kt
    in the serving toolchain with the launch :func:`ktflow.stages.serve.sglang.launch.render_sglang_launch`
    renders (``kt_weight_dir`` holds the CPU expert weights for ``serving.kt_method``; ``host`` is
    the HostInfo to check it against, default this host's probe), ready on ``/health``; the model
    and the experts as sglang-kt reads them (:mod:`ktflow.stages.serve.sglang.inputs`: a view of a
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
        mode: ``merged`` (sglang): the adapter folded into the weights by the merge stage (made once, cached in
            the store) and served with no LoRA flags; ``lora``: the base weights with the adapter through KT's
            LoRA path. Default: the recipe's (``serving.mode``).
        measured_settings: apply the serving settings ``ktflow tune-serving`` kept for this machine, model and mode
            to the fields the recipe leaves unset (:mod:`ktflow.stages.serve.levers`); off while measuring them.

    Raises:
        KtflowError: the backend is not llamafactory, or an endpoint is already running here.
        AdapterError: the adapter does not fit the base (nothing was started).
        HostRequirementError: the port is taken, or the toolchain is missing.
        ServerStartError: the server failed to start, to become ready or its smoke test.
    """
    backend = backend_for(recipe)
    if backend is SGLANG and kt_weight_dir is None:
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
        adapter_dir = backend.check_adapter(adapter_dir, model_dir=model_dir, validate=validate)
    mode = mode or recipe.serving.resolved_mode
    settings = None
    if measured_settings and backend is SGLANG:
        # probed where the preflight below would probe it, and given to it: the host is read once
        host = host or hardware.probe_host(existing_ancestor(record_dir.parent))
        recipe, settings = _with_measured_levers(recipe, model_dir, host, mode, log)
    host = preflight("serve", serve_needs(recipe, measure_serve(model_dir, kt_weight_dir)), record_dir, host=host)
    key, key_file = resolve_api_key(recipe, record_dir, api_key)
    return _start_endpoint(
        recipe, model_dir=model_dir, adapter_dir=adapter_dir, record_dir=record_dir, api_key=key, key_file=key_file,
        port=port if port is not None else _recipe_port(recipe, log), previous=None, last_failed_swap=None, log=log,
        die_with_parent=die_with_parent, kt_weight_dir=kt_weight_dir, host=host, mode=mode,
        serving_settings=settings,
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
    backend = backend_for(recipe)
    settings = None
    if backend is SGLANG:
        recipe, settings = _with_measured_levers(recipe, model_dir, hardware.probe_host(recipe.store.root),
                                                 recipe.serving.resolved_mode, log)
    new_adapter_dir = backend.check_adapter(new_adapter_dir, model_dir=model_dir, validate=validate)
    key, key_file = resolve_api_key(recipe, record_dir, api_key)
    good, good_previous = _last_good(current, record_dir)
    port = current.port or _recipe_port(recipe, log)
    backend.python(recipe)  # a missing toolchain is refused while the old server still serves
    if kt_weight_dir is not None:
        # what the server is given (for sglang-kt: a model view, the AMXINT8 .kt layout) is made while the old
        # server still serves
        backend.prepare(recipe, model_dir=model_dir, adapter_dir=new_adapter_dir, kt_weight_dir=kt_weight_dir,
                        record_dir=record_dir, log=log, mode=recipe.serving.resolved_mode)
    if log:
        log(f"swapping {good.adapter_dir} -> {new_adapter_dir} on port {port}")
    stop(record_dir)
    common = dict(model_dir=model_dir, record_dir=record_dir, api_key=key, key_file=key_file, port=port, log=log,
                  die_with_parent=False, kt_weight_dir=kt_weight_dir, mode=recipe.serving.resolved_mode,
                  serving_settings=settings)
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


@contextlib.contextmanager
def temporary_server(recipe: Recipe, *, model_dir: Path, adapter_dir: Path | None, api_key: str, record_dir: Path,
                     what: str, log: Callable[[str], None] | None,
                     kt_weight_dir: Path | None = None, mode: ServeMode = "lora",
                     measured_settings: bool = True) -> Iterator[Endpoint]:
    """A server of ``model_dir`` (with ``adapter_dir``) on a free port for the length of the block:
    same key, bound like the recipe's endpoint, started with ``die_with_parent`` (it never outlives
    the block, even when we are killed), stopped on the way out. sglang: a second sglang-kt
    process (its own copy of the CPU experts from ``kt_weight_dir``) beside production's, through KT's LoRA path
    by default whatever ``serving.mode`` says: judging a candidate costs no merge. ``mode`` ``merged`` serves the
    merge stage's weights instead (measuring the engine's levers, :mod:`ktflow.stages.serve.lever_runs`);
    ``measured_settings``: as :func:`serve`'s."""
    try:
        port = free_port(recipe.serving.host)
        if log:
            log(f"starting a {what} server on port {port}")
        yield serve(recipe, model_dir=model_dir, adapter_dir=adapter_dir, record_dir=record_dir, api_key=api_key,
                    port=port, log=log, die_with_parent=True, kt_weight_dir=kt_weight_dir, mode=mode,
                    measured_settings=measured_settings)
    finally:
        stop(record_dir)


def dry_run(recipe: Recipe, *, model_dir: Path, adapter_dir: Path | None, kt_weight_dir: Path | None,
            record_dir: Path, host: HostInfo | None = None) -> Launch:
    """The :class:`Launch` :func:`serve` would start, made by the same backend call with nothing checked that
    needs the files, nothing made, written or started (``ktflow serve --dry-run``).

    ``host``: the serving host to render for; default this host as the recipe's server sees it: with the GPUs
    and cores the recipe asks for where this host lacks them (the command is for the serving host, which
    ``serve`` checks at launch).
    """
    if host is None:
        here = hardware.probe_host(recipe.store.root)
        host = here.model_copy(update={
            "gpus": here.gpus or [GpuInfo(index=i, name="serving-host GPU", vram_bytes=0)
                                  for i in range(recipe.serving.gpus)],
            "physical_cores": max(here.physical_cores, recipe.serving.kt_cpuinfer or 0),
        })
    settings = None
    if recipe.serving.backend == "sglang":
        recipe, settings = _with_measured_levers(recipe, Path(model_dir), host, recipe.serving.resolved_mode, None)
    launch = backend_for(recipe).launch(recipe, model_dir=Path(model_dir).absolute(), adapter_dir=adapter_dir,
                                        kt_weight_dir=kt_weight_dir, record_dir=Path(record_dir).absolute(),
                                        port=recipe.serving.port, host=host, log=None, dry_run=True,
                                        mode=recipe.serving.resolved_mode)
    if settings:
        launch.details["serving_settings"] = settings
    return launch
