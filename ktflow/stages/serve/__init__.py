"""The serve stage: a recipe's OpenAI-compatible endpoint as a managed process (LlamaFactory's API on
CPU, sglang-kt on a GPU host).

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

The package, by what each part is for:

- ``lifecycle.py``: :func:`serve`, :func:`stop`, :func:`swap_adapter` (with rollback), :func:`temporary_server`
  and :func:`dry_run`; the backend is picked here, once (:func:`backend_for`).
- ``needs.py``: what serving needs of a host (:func:`serve_needs`), and what judging a candidate costs in each
  mode, priced on a host, with the mode chosen from those prices (:func:`choose_candidate_mode`).
- ``levers.py``: the engine's settings chosen by measurement, per machine: the levers to try on a host, the choice
  of the fastest correct configuration, the record kept in the store and applied at start (``ktflow tune-serving``).
- ``lever_runs.py``: the serve stage's own measurement of a lever: a temporary server, timed at concurrency 1.
- ``records.py``: the endpoint record (``endpoint.json``), ports and the API key.
- ``process.py``: start a server into its log, the readiness gate, the smoke test.
- ``backend.py``: what a backend gives the lifecycle (:class:`Launch`) and the methods it has (:class:`Backend`).
- ``llamafactory/``: the CPU backend (``llamafactory-cli api`` and its ``infer.yaml``).
- ``sglang/``: the GPU backend: sglang-kt's launch command and its checks (``launch.py``), what it is given to
  load (``inputs.py``: a view of the checkpoint, kt-kernel's ``.kt`` layout), and one client for SGLang's
  adapter API (``adapters.py``: plain SGLang's no-downtime swap, a candidate beside production).

Imports go one way: the backends import ``backend``, ``records`` and ``process``; ``lifecycle`` imports the
backends, ``needs`` and ``levers``; nothing here imports ``lifecycle`` but ``lever_runs`` (which starts its servers)
and this ``__init__``, which re-exports the names callers use.
"""

from ktflow.stages.serve.backend import Backend, Launch
from ktflow.stages.serve.lever_runs import server_measurement
from ktflow.stages.serve.levers import (
    LeverCandidate,
    LeverMeasurement,
    ServingLevers,
    apply_measured_levers,
    keep_levers,
    kept_levers,
    lever_candidates,
    measure_levers,
)
from ktflow.stages.serve.lifecycle import backend_for, dry_run, serve, stop, swap_adapter, temporary_server
from ktflow.stages.serve.llamafactory import INFER_YAML, render_llamafactory_api
from ktflow.stages.serve.needs import (
    CandidateChoice,
    CandidatePrice,
    ServeSizes,
    candidate_needs,
    candidate_prices,
    choose_candidate_mode,
    measure_serve,
    serve_needs,
)
from ktflow.stages.serve.process import smoke_test, start_server
from ktflow.stages.serve.records import (
    API_KEY_FILE,
    ENDPOINT_FILE,
    LLAMAFACTORY_KEY_ENV,
    MIN_KEY_LENGTH,
    SERVER_LOG,
    SERVER_MARKER,
    SMOKE_PROMPT,
    AdapterRef,
    Endpoint,
    FailedSwap,
    adapter_model_name,
    api_key_for,
    base_url,
    client_host,
    free_port,
    is_alive,
    label_endpoint_version,
    port_is_free,
    port_is_open,
    read_endpoint,
    resolve_api_key,
    tuned_model_name,
)
from ktflow.stages.serve.sglang.adapters import LoadedAdapter, SglangAdapters, dynamic_adapter, swap_sglang_adapter

__all__ = [
    "API_KEY_FILE", "AdapterRef", "Backend", "CandidateChoice", "CandidatePrice", "ENDPOINT_FILE", "Endpoint",
    "FailedSwap", "INFER_YAML", "LLAMAFACTORY_KEY_ENV", "Launch", "LeverCandidate", "LeverMeasurement",
    "LoadedAdapter", "MIN_KEY_LENGTH", "SERVER_LOG",
    "SERVER_MARKER", "SMOKE_PROMPT", "ServeSizes", "ServingLevers", "SglangAdapters", "adapter_model_name",
    "api_key_for", "apply_measured_levers", "keep_levers", "kept_levers", "lever_candidates", "measure_levers",
    "server_measurement",
    "backend_for", "base_url", "candidate_needs", "candidate_prices", "choose_candidate_mode", "client_host",
    "dry_run", "dynamic_adapter", "free_port", "is_alive", "label_endpoint_version", "measure_serve",
    "port_is_free", "port_is_open", "read_endpoint", "render_llamafactory_api", "resolve_api_key", "serve",
    "serve_needs", "smoke_test", "start_server", "stop", "swap_adapter", "swap_sglang_adapter", "temporary_server",
    "tuned_model_name",
]
