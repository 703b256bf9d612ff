"""The serve stage on the CPU backend: LlamaFactory's OpenAI-compatible API as a managed process.

Lifecycle, in one record directory (``record_dir``):

- :func:`serve` validates the adapter against the base (headers only), renders LlamaFactory's
  inference YAML, starts ``llamafactory-cli api`` bound to ``serving.host`` (loopback by
  default), waits until ``GET /v1/models`` answers *with the key* and lists the expected model
  (and refuses a server that answers *without* it), then smoke-tests one chat completion
  through the ``openai`` client. The endpoint is recorded atomically in ``endpoint.json``.
- :func:`stop` stops the recorded server's whole process tree and removes the record;
  idempotent.
- :func:`swap_adapter` replaces the served adapter, KT style (one adapter per server, loaded at
  start): validate the new adapter first (a bad one is refused while the old server keeps
  serving), then **stop the old server and start the new one on the same port** (the recipe's
  port is the endpoint clients know; a blue/green swap would need a proxy or twice the serving
  RAM), health-gate and smoke-test it; if either fails, restart the previous adapter on the
  same port, gate it again and raise :class:`SwapError`. Clients see a refused connection for
  the few seconds between stop and ready. ``endpoint.json`` always names the adapter being
  served and, under ``previous``, the last good adapter before it.

The API key is always required. It comes from the environment variable named by
``serving.api_key_env``, else from ``record_dir/api_key`` (created once, mode 0600, random).
It reaches the server through its environment (LlamaFactory reads ``API_KEY``), never through
argv, a log line or ``endpoint.json``. An empty ``API_KEY`` would switch LlamaFactory's check off,
so an empty key is refused, and every start checks that a request *without* the key is refused.

LlamaFactory's api serves exactly one model: ``API_MODEL_NAME`` is the only id ``/v1/models``
lists, and the ``model`` field of a request is echoed, not used to route. ktflow names the
tuned server's model ``<served_model_name>:<adapter_name>`` (SGLang's per-adapter naming) and a
base server's ``<served_model_name>``; comparing base and tuned therefore takes two servers
(see :mod:`ktflow.stages.evaluate`). With the HuggingFace backend the adapter is merged at load.

Process ownership: the server is started in the caller's process group, without
``PR_SET_PDEATHSIG`` (unless asked), and writes its output straight into ``server.log`` (not
through a pipe), so it outlives a ``ktflow serve`` command that returns, while a Prefect
cancellation (which kills the flow run's process group) takes it down. A marker variable in
its environment (``KTFLOW_SERVER_RUN``) lets :func:`stop` also find anything it forked. A record
with ``state: starting`` is written as soon as the process exists, so a crash of the
orchestrator during the start never leaves an unrecorded server holding the port. Until the
server is ready (health gate and smoke test passed, ``state: ready`` recorded) a
:class:`ktflow.host.process.Guardian` watches the orchestrator: if it dies during the start (SIGKILL
included), the half-started server and everything carrying its marker are stopped, and the next
:func:`serve` finds the stale ``starting`` record and clears it. Only a ready server outlives us.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import psutil
import yaml
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
    EMBEDDED_API_MARKER,
    TERMINATE_GRACE_S,
    Guardian,
    LogFollower,
    _die_with_parent,
    reap_marked,
    terminate_tree,
)
from ktflow.planning.sizing import ModelSize, model_size
from ktflow.planning.stage_plan import host_requirements
from ktflow.recipe import Recipe
from ktflow.resources import GpuNeed, RamNeed, Resources, preflight
from ktflow.store import atomic_write_bytes, atomic_write_json, read_manifest

ENDPOINT_FILE = "endpoint.json"
API_KEY_FILE = "api_key"
INFER_YAML = "infer.yaml"
SERVER_LOG = "server.log"
SERVER_MARKER = "KTFLOW_SERVER_RUN"
LLAMAFACTORY_KEY_ENV = "API_KEY"  # what `llamafactory-cli api` reads its bearer key from
MIN_KEY_LENGTH = 16
SMOKE_PROMPT = "Say hello."
_WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class AdapterRef(BaseModel):
    """An adapter that served (or failed to) at this endpoint."""

    adapter_dir: Path | None
    adapter_manifest_digest: str | None
    adapter_model_name: str | None


class FailedSwap(BaseModel):
    adapter_dir: Path
    error: str
    at: str


class Endpoint(BaseModel):
    """A running (or starting) server, as recorded in ``record_dir/endpoint.json``. Never holds the key."""

    url: str  # the OpenAI base URL, ".../v1"
    backend: str
    served_model_name: str
    adapter_model_name: str | None
    pid: int
    log_path: Path
    adapter_dir: Path | None
    adapter_manifest_digest: str | None
    started_at: str
    # Beyond the contract: what stop() and swap_adapter() need.
    state: Literal["starting", "ready"] = "ready"
    host: str = "127.0.0.1"
    port: int = 0
    pid_create_time: float | None = None
    run_id: str | None = None
    infer_config: Path | None = None
    api_key_env: str | None = None
    api_key_file: Path | None = None  # where the key is when it came from no environment variable
    previous: AdapterRef | None = None  # the last good adapter before this one
    last_failed_swap: FailedSwap | None = None
    adapter_version: int | None = None  # the recipe's adapter version it serves (ktflow.registry), once promoted

    @property
    def model(self) -> str:
        """The model name requests should use."""
        return self.adapter_model_name or self.served_model_name

    @property
    def root_url(self) -> str:
        return self.url.removesuffix("/v1")


# --------------------------------------------------------------------------- small helpers


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def client_host(host: str) -> str:
    """The address a local client connects to for a server bound to ``host``."""
    return _WILDCARD_HOSTS.get(host, host)


def base_url(host: str, port: int) -> str:
    """The OpenAI base URL (``http://host:port/v1``) of a server bound to ``host:port``."""
    h = client_host(host)
    if ":" in h:
        h = f"[{h}]"
    return f"http://{h}:{port}/v1"


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could bind ``host:port`` now (SO_REUSEADDR, as uvicorn binds)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def port_is_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether something accepts connections on ``host:port``."""
    h = client_host(host)
    try:
        with socket.create_connection((h, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's pick)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _recipe_port(recipe: Recipe, log: Callable[[str], None] | None) -> int:
    """``serving.port``, or for ``auto`` a port nothing listens on now (the endpoint record keeps it)."""
    serving = recipe.serving
    if isinstance(serving.port, int):
        return serving.port
    port = free_port(serving.host)
    if log:
        log(f"serving.port is auto: serving on free port {port}")
    return port


def adapter_model_name(recipe: Recipe) -> str:
    """The model id a tuned server lists: ``<served_model_name>:<adapter_name>`` (SGLang's naming)."""
    return f"{recipe.serving.served_model_name}:{recipe.serving.adapter_name}"


def resolve_api_key(recipe: Recipe, record_dir: Path, api_key: str | None = None) -> tuple[str, Path | None]:
    """The key the endpoint requires, and the file it is kept in (None when it came from elsewhere).

    Order: ``api_key`` as given; the environment variable ``serving.api_key_env``; the 0600 file
    ``record_dir/api_key``, created with a random key the first time (kept across restarts and
    swaps, so clients that read it keep working).

    Raises:
        InvalidInputError: the key given or in the environment is shorter than 16 characters, or
            the key file is readable by others.
    """
    env_name = recipe.serving.api_key_env
    source = "the api_key argument"
    if api_key is None and os.environ.get(env_name):
        api_key, source = os.environ[env_name], f"${env_name}"
    if api_key is not None:
        if len(api_key) < MIN_KEY_LENGTH or any(c.isspace() for c in api_key):
            raise InvalidInputError(
                source, f"an API key must be at least {MIN_KEY_LENGTH} characters without whitespace",
                f"set a longer key, or unset {env_name} to have ktflow generate one",
            )
        return api_key, None
    path = Path(record_dir) / API_KEY_FILE
    if path.exists():
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise InvalidInputError(str(path), f"is readable by others (mode {mode:o})", f"chmod 600 {path}")
        key = path.read_text(encoding="utf-8").strip()
        if len(key) >= MIN_KEY_LENGTH:
            return key, path
    Path(record_dir).mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{API_KEY_FILE}.{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (key + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return key, path


def _train_python(recipe: Recipe) -> Path:
    # LlamaFactory's API (the CPU serving backend) comes with the training toolchain.
    return recipe.toolchains.train.require("toolchains.train.python", "LlamaFactory", "train-env")


def _server_python(recipe: Recipe) -> Path:
    """The python the recipe's server runs in (raises HostRequirementError when it is missing)."""
    if recipe.serving.backend == "sglang":
        return recipe.toolchains.serve.require("toolchains.serve.python", "sglang-kt and kt-kernel", "serve-env")
    return _train_python(recipe)


# --------------------------------------------------------------------------- rendering


def render_llamafactory_api(
    recipe: Recipe, *, model_dir: Path, adapter_dir: Path | None, train_python: Path, config_dir: Path,
    port: int | None = None,
) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """``llamafactory-cli api`` for the recipe: ``(argv, env, infer_yaml)``.

    ``env`` holds only what ktflow sets on top of the inherited environment; the API key is
    *not* in it (it is added at start, see :func:`start_server`). ``argv`` names
    ``config_dir/infer.yaml``, which the caller writes from ``infer_yaml``.

    The chat template: the recipe's ``sft.template``, except ``empty`` (training data rendered
    with the model's own chat template), for which no template is set so LlamaFactory parses
    the tokenizer's chat template and plain chat requests are formatted as in training.
    """
    serving = recipe.serving
    cfg: dict[str, Any] = {
        "model_name_or_path": str(Path(model_dir).absolute()),
        "trust_remote_code": True,
        "infer_backend": "huggingface",
    }
    if adapter_dir is not None:
        cfg.update(adapter_name_or_path=str(Path(adapter_dir).absolute()), finetuning_type="lora")
    if recipe.sft.template != "empty":
        cfg["template"] = recipe.sft.template
    argv = [str(Path(train_python).parent / "llamafactory-cli"), "api", str(Path(config_dir) / INFER_YAML)]
    env = {
        "API_HOST": serving.host,
        "API_PORT": str(port if port is not None else serving.port),
        "API_MODEL_NAME": adapter_model_name(recipe) if adapter_dir is not None else serving.served_model_name,
        "API_VERBOSE": "0",  # LlamaFactory logs every request body at INFO otherwise
        "HF_HUB_OFFLINE": "1",  # the base and adapter are local: never reach for a hub
        **recipe.toolchains.train.env,
    }
    return argv, env, cfg


# --------------------------------------------------------------------------- the process


def _probe(url: str, api_key: str | None, timeout_s: float = 5.0) -> tuple[int | None, Any]:
    """GET ``url`` (with the bearer key if given): (status, json or None); (None, error) when unreachable."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
    try:
        response = httpx.get(url, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return None, exc
    try:
        body = response.json()
    except ValueError:
        body = None
    return response.status_code, body


def start_server(
    argv: Sequence[str], env: Mapping[str, str], *, log_path: Path, ready_url: str, api_key: str, timeout_s: float,
    key_env: str = LLAMAFACTORY_KEY_ENV, expect_model: str | None = None, check_auth: bool = True,
    run_id: str | None = None, cwd: Path | None = None, on_line: Callable[[str], None] | None = None,
    on_started: Callable[[subprocess.Popen], None] | None = None, die_with_parent: bool = False,
    label: str | None = None, poll_s: float = 0.5, grace_s: float = TERMINATE_GRACE_S, guardian: Guardian | None = None,
) -> subprocess.Popen:
    """Start a long-lived server and return once it is ready; it is not waited on.

    The child writes its stdout/stderr straight into ``log_path`` (appended), so it keeps
    running, and logging, after this process exits; a thread follows the file while the server
    starts, forwarding lines to ``on_line`` and keeping a tail for error messages. The key goes
    into the child's environment as ``key_env``, with ``SERVER_MARKER=run_id``.

    Ready means: ``GET ready_url`` with the bearer key answers 200 (and, with ``expect_model``,
    its ``data`` lists that id, so a stranger's server on the port is never taken for ours);
    with ``check_auth``, the same request without the key must then be refused (401/403).

    Args:
        env: the complete environment of the child.
        on_started: called with the process right after it exists (to record its pid).
        die_with_parent: SIGKILL the server when the thread that started it exits (for servers
            scoped to one call; never for an endpoint meant to outlive the command).
        label: what the banner line written into the log before the start names.
        guardian: a :class:`~ktflow.host.process.Guardian` for ``SERVER_MARKER=run_id`` that the
            caller keeps armed past the return (until its own readiness steps are done) and
            disarms. Without one, a guardian of our own covers the start (if this process dies
            before the server is ready, the server is stopped) and is disarmed on return.

    Raises:
        ServerStartError: the process exited, the time ran out, or the auth check failed; the
            process tree is stopped first and the message has the log's last lines.
    """
    if not api_key:
        raise InvalidInputError("api_key", "is empty; the server would accept every request", "pass a key")
    # A ready server outlives us: it must not carry the marker of this process's lifetime.
    child_env = {**{k: v for k, v in env.items() if k != EMBEDDED_API_MARKER}, key_env: api_key,
                 SERVER_MARKER: run_id or uuid.uuid4().hex}
    own_guardian = guardian is None
    guardian = Guardian(SERVER_MARKER, child_env[SERVER_MARKER]) if guardian is None else guardian
    try:
        proc, offset = _spawn(argv, child_env, Path(log_path), label=label, cwd=cwd, die_with_parent=die_with_parent)
        gate = _ReadyGate(ready_url, api_key, expect_model, check_auth, timeout_s, poll_s)
        with LogFollower(Path(log_path), on_line, offset=offset) as follower:
            try:
                if on_started is not None:
                    on_started(proc)
                gate.wait(proc, follower, Path(argv[0]).name, Path(log_path))
            except BaseException:
                terminate_tree(proc.pid, grace_s)
                _reap_marked(child_env[SERVER_MARKER])
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
                raise
    finally:
        if own_guardian:
            guardian.disarm()  # ready (it may outlive us now), or stopped above
    return proc


def _spawn(argv: Sequence[str], env: Mapping[str, str], log_path: Path, *, label: str | None, cwd: Path | None,
           die_with_parent: bool) -> tuple[subprocess.Popen, int]:
    """Start the server writing into ``log_path`` after a banner line; return it and where its output starts."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"=== ktflow: starting {label or Path(argv[0]).name} at {_now()} ===\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(
                list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=dict(env),
                cwd=cwd, preexec_fn=_die_with_parent if die_with_parent else None,
            )
        except OSError as exc:
            raise KtflowError(f"cannot start {argv[0]}: {exc.strerror}") from None
        return proc, log.tell()


@dataclass(frozen=True)
class _ReadyGate:
    """When a starting server counts as ready (see :func:`start_server`)."""

    url: str
    api_key: str
    expect_model: str | None
    check_auth: bool
    timeout_s: float
    poll_s: float

    def wait(self, proc: subprocess.Popen, follower: LogFollower, name: str, log_path: Path) -> None:
        """Return once ready; raise :class:`ServerStartError` when the process exits or the time runs out."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            code = proc.poll()
            if code is not None:
                follower.close()
                raise ServerStartError(f"{name} exited with status {code} before it was ready", follower.tail, log_path)
            last = self._not_ready()
            if last is None:
                break
            if time.monotonic() >= deadline:
                raise ServerStartError(f"the server was not ready within {self.timeout_s:.0f} s ({last})",
                                       follower.tail, log_path)
            time.sleep(self.poll_s)
        if self.check_auth:
            status, _ = _probe(self.url, None)
            if status not in (401, 403):
                raise ServerStartError(
                    f"the server answers {self.url} without the API key (HTTP {status}); refusing to serve "
                    "an endpoint that does not check the key", follower.tail, log_path)

    def _not_ready(self) -> str | None:
        """Why the server is not ready yet (None: it is)."""
        status, body = _probe(self.url, self.api_key, timeout_s=min(5.0, max(self.poll_s, 1.0)))
        if status != 200:
            return f"{self.url}: {body if status is None else f'HTTP {status}'}"
        ids = [m.get("id") for m in body.get("data", []) if isinstance(m, dict)] if isinstance(body, dict) else []
        if self.expect_model is None or self.expect_model in ids:
            return None
        return f"{self.url} lists {ids}, not {self.expect_model!r}"


def _reap_marked(run_id: str | None) -> None:
    """Stop every process that inherited the server's marker (what it forked, wherever it is now)."""
    if run_id:
        reap_marked(run_id, SERVER_MARKER)


# --------------------------------------------------------------------------- smoke test


def smoke_test(url: str, api_key: str, model: str, *, timeout_s: float = 120.0) -> dict[str, Any]:
    """One chat completion through the ``openai`` client; what came back.

    Raises:
        KtflowError: the request failed, or the answer is not a chat completion.
    """
    import openai

    client = openai.OpenAI(base_url=url, api_key=api_key, timeout=timeout_s, max_retries=0)
    started = time.perf_counter()
    try:
        response = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": SMOKE_PROMPT}], max_tokens=8, temperature=0,
        )
    except openai.OpenAIError as exc:
        raise KtflowError(f"smoke test against {url} failed: {type(exc).__name__}: {exc}") from None
    finally:
        client.close()
    if not response.choices or response.choices[0].message is None:
        raise KtflowError(f"smoke test against {url}: the answer has no choices")
    content = response.choices[0].message.content
    if not isinstance(content, str):
        raise KtflowError(f"smoke test against {url}: the answer has no text content")
    return {"model": response.model, "content": content, "finish_reason": response.choices[0].finish_reason,
            "seconds": round(time.perf_counter() - started, 3)}


# --------------------------------------------------------------------------- records


def read_endpoint(record_dir: Path) -> Endpoint | None:
    """The endpoint recorded in ``record_dir``, or None."""
    path = Path(record_dir) / ENDPOINT_FILE
    if not path.is_file():
        return None
    return Endpoint.model_validate_json(path.read_text(encoding="utf-8"))


def _write_endpoint(record_dir: Path, endpoint: Endpoint) -> None:
    atomic_write_json(Path(record_dir) / ENDPOINT_FILE, endpoint.model_dump(mode="json"))


def _process_of(endpoint: Endpoint) -> psutil.Process | None:
    """The recorded server process, if it still runs (a reused pid is not taken for it)."""
    try:
        proc = psutil.Process(endpoint.pid)
        if endpoint.pid_create_time is not None and abs(proc.create_time() - endpoint.pid_create_time) > 0.05:
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.NoSuchProcess:
        return None


def is_alive(endpoint: Endpoint) -> bool:
    return _process_of(endpoint) is not None


def api_key_for(endpoint: Endpoint) -> str | None:
    """The key of a recorded endpoint, from where it was taken (its env var, or its key file)."""
    if endpoint.api_key_env and os.environ.get(endpoint.api_key_env):
        return os.environ[endpoint.api_key_env]
    if endpoint.api_key_file and Path(endpoint.api_key_file).is_file():
        return Path(endpoint.api_key_file).read_text(encoding="utf-8").strip()
    return None


# --------------------------------------------------------------------------- the stage


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
    The KV cache comes on top (sglang sizes it from ``mem_fraction_static``), so these are lower bounds.
    """
    serving = recipe.serving
    requirement = host_requirements(recipe)["serve"]
    if serving.backend == "llamafactory":
        return Resources(host=requirement, ram=RamNeed(
            bytes=2 * sizes.model.parameters, what="serve", why="the model in BF16 with the adapter merged"))
    gpus = max(serving.gpus, 1)
    return Resources(
        host=requirement,
        ram=RamNeed(bytes=sizes.kt_weight_bytes, what="serve", why=f"the CPU experts as {serving.kt_method}",
                    of="installed", numa_pools=serving.kt_threadpool_count),
        gpu=GpuNeed(bytes=2 * sizes.model.non_expert_parameters // gpus, gpus=gpus, field="serving.gpus",
                    what="sglang-kt", why="the non-expert weights in BF16, split over the tensor-parallel ranks; "
                                          "the KV cache comes on top"),
    )


def candidate_needs(recipe: Recipe, sizes: ServeSizes, mode: str) -> Resources:
    """What judging a candidate costs on top of production (``evaluation.candidate``).

    ``beside``: a second adapter on the server where it loads adapters at run time (a few MB), else a
    second server (:func:`serve_needs` again: the whole model once more). ``offline``: the training
    toolchain generating with the model in BF16 in RAM (LlamaFactory's chat engine on CPU). ``swap``:
    nothing more; the candidate serves in production's place while it is judged.
    """
    serving = recipe.serving
    if mode == "swap" or (mode == "beside" and serving.backend == "sglang" and serving.dynamic_lora):
        return Resources()
    if mode == "offline":
        return Resources(ram=RamNeed(bytes=2 * sizes.model.parameters, what="offline candidate generation",
                                     why="the model in BF16 in the training toolchain"))
    second = serve_needs(recipe, sizes)
    ram = second.ram.model_copy(update={"what": "a second server for the candidate",
                                        "why": f"a second server: {second.ram.why}"}) if second.ram else None
    return Resources(ram=ram, gpu=second.gpu)


def label_endpoint_version(record_dir: Path, endpoint: Endpoint, version: int) -> Endpoint:
    """Record in ``endpoint.json`` which adapter version ``endpoint`` serves."""
    labelled = endpoint.model_copy(update={"adapter_version": version})
    _write_endpoint(record_dir, labelled)
    return labelled


@dataclass(frozen=True)
class _Launch:
    """How one backend's server is started, and how to tell that it is ready."""

    what: str  # for the log
    python: Path  # the toolchain's python: its bin/ goes first on PATH
    argv: list[str]
    env: dict[str, str]
    key_env: str  # the variable the server reads its API key from
    model_name: str  # the model a client asks for (the adapter's, when one is served)
    ready_url: str
    expect_model: str | None
    check_auth: bool
    infer_path: Path | None = None


def _sglang_launch(recipe: Recipe, *, model_dir: Path, adapter_dir: Path | None, kt_weight_dir: Path | None,
                   record_dir: Path, port: int, host: Any) -> _Launch:
    """sglang-kt in the serving toolchain; the key reaches it through its environment (the launcher
    hands it to the parser in-process), readiness is /health."""
    from ktflow.host.hardware import probe_host as probe_hardware
    from ktflow.stages.sglang_launch import render_sglang_launch

    serving = recipe.serving
    if port != serving.port:
        raise KtflowError("the sglang backend serves on serving.port only")
    python = _server_python(recipe)
    assert adapter_dir is not None and kt_weight_dir is not None
    launch = render_sglang_launch(recipe, model_dir=model_dir, kt_weight_dir=kt_weight_dir, adapter_dir=adapter_dir,
                                  serve_python=python, host=host or probe_hardware(record_dir))
    return _Launch(what="sglang-kt", python=python, argv=launch.argv, env=dict(launch.env),
                   key_env=launch.api_key_env or serving.api_key_env, model_name=adapter_model_name(recipe),
                   ready_url=f"{base_url(serving.host, port).removesuffix('/v1')}/health", expect_model=None,
                   check_auth=False)


def _llamafactory_launch(recipe: Recipe, *, model_dir: Path, adapter_dir: Path | None, record_dir: Path,
                         port: int) -> _Launch:
    """LlamaFactory's API in the training toolchain; readiness is /v1/models listing the model."""
    python = _train_python(recipe)
    argv, env, infer = render_llamafactory_api(recipe, model_dir=model_dir, adapter_dir=adapter_dir,
                                               train_python=python, config_dir=record_dir, port=port)
    atomic_write_bytes(record_dir / INFER_YAML, yaml.safe_dump(infer, sort_keys=False).encode())
    model_name = env["API_MODEL_NAME"]
    return _Launch(what="llamafactory-cli api", python=python, argv=argv, env=env, key_env=LLAMAFACTORY_KEY_ENV,
                   model_name=model_name, ready_url=f"{base_url(recipe.serving.host, port)}/models",
                   expect_model=model_name, check_auth=True, infer_path=record_dir / INFER_YAML)


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
                                record_dir=record_dir, port=port, host=host)
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
    the HostInfo to check it against, default this host's probe), ready on ``/health``.

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
    if sglang and (kt_weight_dir is None or adapter_dir is None):
        raise InvalidInputError("kt_weight_dir", "the sglang backend needs the CPU expert weights and the adapter",
                                "pass the weights for serving.kt_method and the convert-lora output")
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


def dump_infer_yaml(infer: Mapping[str, Any]) -> str:
    return yaml.safe_dump(dict(infer), sort_keys=False)


__all__ = [
    "AdapterRef", "Endpoint", "FailedSwap", "ServerStartError", "SwapError", "adapter_model_name", "api_key_for",
    "base_url", "candidate_needs", "dump_infer_yaml", "label_endpoint_version", "free_port", "is_alive", "port_is_free",
    "port_is_open", "read_endpoint",
    "render_llamafactory_api", "resolve_api_key", "serve", "smoke_test", "start_server", "stop", "swap_adapter",
]


# --------------------------------------------------------------------------- plain SGLang: swap without downtime


class LoadedAdapter(BaseModel):
    """An adapter loaded into a plain SGLang server under a versioned name."""

    name: str
    path: Path
    version: int


class SglangAdapters(BaseModel):
    """What ``record_dir/sglang-adapters.json`` says a plain SGLang server is serving."""

    url: str
    current: LoadedAdapter | None = None
    previous: LoadedAdapter | None = None


def _post_json(url: str, api_key: str, payload: dict[str, Any], timeout_s: float = 600.0) -> tuple[int, str]:
    import httpx

    response = httpx.post(url, json=payload, headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout_s)
    return response.status_code, response.text[:2000]


def swap_sglang_adapter(
    root_url: str,
    api_key: str,
    *,
    served_model_name: str,
    adapter_name: str,
    new_adapter_dir: Path,
    record_dir: Path,
) -> SglangAdapters:
    """Serve a retrained adapter on a running plain SGLang server with no downtime.

    Loads it under the next versioned name (``<adapter_name>-v<N+1>``: SGLang refuses a name that
    is already loaded), smoke-tests it through the OpenAI API (``model=<served>:<name>``), and only
    then unloads the old version; clients move by switching the model name. If loading or the
    smoke test fails, the new version is unloaded and the old one keeps serving. The KT fork loads
    one composite adapter at startup and cannot do this: use :func:`swap_adapter` (restart) there.

    Raises:
        SwapError: the new adapter failed (``rolled_back`` is True: the old one still serves).
    """
    record_dir = Path(record_dir)
    record_path = record_dir / "sglang-adapters.json"
    state = (SglangAdapters.model_validate_json(record_path.read_text()) if record_path.exists()
             else SglangAdapters(url=root_url))
    version = (state.current.version + 1) if state.current else 1
    new = LoadedAdapter(name=f"{adapter_name}-v{version}", path=Path(new_adapter_dir).absolute(), version=version)
    status, body = _post_json(f"{root_url}/load_lora_adapter",
                              api_key, {"lora_name": new.name, "lora_path": str(new.path), "pinned": False})
    if status != 200:
        raise SwapError(f"SGLang refused to load {new.path} as {new.name} (HTTP {status}: {body}); "
                        f"{state.current.name if state.current else 'the base model'} keeps serving", rolled_back=True)
    try:
        smoke_test(f"{root_url}/v1", api_key, f"{served_model_name}:{new.name}")
    except KtflowError as exc:
        _post_json(f"{root_url}/unload_lora_adapter", api_key, {"lora_name": new.name})
        raise SwapError(f"the new adapter {new.name} failed its smoke test ({exc}); it was unloaded and "
                        f"{state.current.name if state.current else 'the base model'} keeps serving",
                        rolled_back=True) from None
    if state.current is not None:
        _post_json(f"{root_url}/unload_lora_adapter", api_key, {"lora_name": state.current.name})
    state = SglangAdapters(url=root_url, current=new, previous=state.current)
    record_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(record_path, state.model_dump(mode="json"))
    return state
