"""A server as a managed process: started into its own log, gated on readiness (with the key, and
refused when it answers without it), smoke-tested through the OpenAI client, and everything it
forked found again by its marker."""

from __future__ import annotations

import contextlib
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ktflow.errors import (
    InvalidInputError,
    KtflowError,
    ServerStartError,
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
from ktflow.stages.serve.records import LLAMAFACTORY_KEY_ENV, SERVER_MARKER, SMOKE_PROMPT, _now


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
