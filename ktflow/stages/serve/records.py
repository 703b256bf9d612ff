"""What a running endpoint is, as recorded in ``endpoint.json`` (never with its key), and the small
facts around it: its URL and port, the model names it lists, the API key it requires."""

from __future__ import annotations

import os
import secrets
import socket
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import psutil
from pydantic import BaseModel

from ktflow.errors import (
    InvalidInputError,
)
from ktflow.recipe import Recipe
from ktflow.store import atomic_write_json

ENDPOINT_FILE = "endpoint.json"
API_KEY_FILE = "api_key"
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
    merged_dir: Path | None = None  # the merge of adapter_dir it serves (serving.mode merged); None: the LoRA path
    serving_settings: str | None = None  # the measured settings applied at start (ktflow tune-serving), said

    @property
    def model(self) -> str:
        """The model name requests should use."""
        return self.adapter_model_name or self.served_model_name

    @property
    def root_url(self) -> str:
        return self.url.removesuffix("/v1")


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


def tuned_model_name(recipe: Recipe) -> str:
    """The model a client asks the recipe's production endpoint for: the served model itself where the adapter is
    merged into its weights (``serving.mode`` merged), else ``<served_model_name>:<adapter_name>``."""
    if recipe.serving.resolved_mode == "merged":
        return recipe.serving.served_model_name
    return adapter_model_name(recipe)


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


def label_endpoint_version(record_dir: Path, endpoint: Endpoint, version: int) -> Endpoint:
    """Record in ``endpoint.json`` which adapter version ``endpoint`` serves."""
    labelled = endpoint.model_copy(update={"adapter_version": version})
    _write_endpoint(record_dir, labelled)
    return labelled
