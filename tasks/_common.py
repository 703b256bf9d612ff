"""What every ktflow task adds around its engine call: cache keys, retry rules, progress."""

from __future__ import annotations

import contextvars
import hashlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext
from prefect.logging import get_run_logger

from ktflow import ENGINE_VERSION
from ktflow.errors import InvalidInputError, PromotionGateError
from ktflow.store import read_manifest


class StageCachePolicy(CachePolicy):
    """Cache key = stage name + ktflow.ENGINE_VERSION + a digest of the stage's real inputs.

    ``key_fn(inputs)`` returns the digest of what the stage reads (manifest hashes, cheap file
    identities) and settings, never of a path string alone, and never by hashing a 600 GB
    folder; None means "do not cache this call". Prefect's TASK_SOURCE would miss changes in
    engine helpers, hence the explicit engine version.
    """

    def __init__(self, stage: str, key_fn: Callable[[dict[str, Any]], str | None]) -> None:
        super().__init__()
        self.stage = stage
        self.key_fn = key_fn

    def compute_key(
        self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any
    ) -> str | None:
        digest = self.key_fn(inputs)
        if digest is None:
            return None
        payload = json.dumps([self.stage, ENGINE_VERSION, digest], sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()


def published_artifact_key(out_dir: Path, *identity: object) -> str | None:
    """The cache key part of a stage whose output ``out_dir`` is a published artifact.

    None (do not cache) while ``out_dir`` holds no manifest: a result cached before the artifact
    was deleted, or before it was ever made, must not be returned. The engine's own manifest
    check makes the first repeat cheap, and Prefect caches from there on. Else: the artifact's
    path and manifest digest, plus ``identity`` (the inputs' identities and settings).
    """
    out = Path(out_dir)
    manifest = read_manifest(out) if out.is_dir() else None
    if manifest is None:
        return None
    return ":".join([str(out.absolute()), manifest.digest(), *map(str, identity)])


def retry_unless_invalid_input(task: Any, task_run: Any, state: Any) -> bool:
    """Retry transient failures only: bad input (or a failed promotion gate) fails the same way every time."""
    try:
        state.result()
    except (InvalidInputError, PromotionGateError):
        return False
    except Exception:
        return True
    return False


class ProgressReporter:
    """A ``progress(done, total)`` callback feeding a Prefect progress artifact and the run log.

    Throttled (at most every ``interval`` seconds, and at the end) so the API and the log carry
    progress, not noise. The artifact is updated by a sender thread, newest value first: the work
    never waits on the API, and an update the API could not take (a server restart: Prefect's
    client gives up on a refused connection after its retries) is sent again until it is taken,
    so the artifact ends at the last value reported, outage or not. Use as a context manager (or
    call :meth:`close`): on exit the last value is delivered, waiting at most ``flush_s`` seconds.
    """

    def __init__(self, key: str, description: str, *, interval: float = 2.0, unit: str = "bytes",
                 retry_s: float = 2.0, flush_s: float = 120.0) -> None:
        self._artifact = create_progress_artifact(progress=0.0, key=key, description=description)
        self._logger = get_run_logger()
        self._interval = interval
        self._unit = unit
        self._retry_s = retry_s
        self._flush_s = flush_s
        self._last = 0.0
        self._started = time.monotonic()
        self._pending: float | None = None  # the newest value the API has not taken yet
        self._closed = False
        self._failures = 0
        self._wake = threading.Condition()
        # The sender runs in a copy of this context: the task's client and settings (an embedded
        # API's address among them), not a fresh client of its own.
        self._sender = threading.Thread(target=contextvars.copy_context().run, args=(self._send_loop,),
                                        name=f"progress-{key}", daemon=True)
        self._sender.start()

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        finished = total > 0 and done >= total
        if not finished and now - self._last < self._interval:
            return
        self._last = now
        percent = 100.0 * done / total if total else 0.0
        with self._wake:
            self._pending = percent
            self._wake.notify()
        elapsed = now - self._started
        if self._unit == "bytes":
            rate = done / elapsed / 1e9 if elapsed > 0 else 0.0
            self._logger.info("%.1f%% (%.2f of %.2f GB, %.2f GB/s)", percent, done / 1e9, total / 1e9, rate)
        else:
            self._logger.info("%.1f%% (%d of %d %s)", percent, done, total, self._unit)

    def close(self) -> None:
        """Deliver the last value (at most ``flush_s`` seconds) and stop the sender. Idempotent."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._sender.join(self._flush_s)
        if self._sender.is_alive() or self._pending is not None:
            self._logger.warning("the progress artifact could not be updated to %.1f%% within %.0f s (the API did "
                                 "not answer); the work itself is unaffected", self._pending or 0.0, self._flush_s)

    def _send_loop(self) -> None:
        deadline: float | None = None
        while True:
            with self._wake:
                while self._pending is None and not self._closed:
                    self._wake.wait()
                if self._pending is None:
                    return  # closed, everything delivered
                value, self._pending = self._pending, None
                if self._closed and deadline is None:
                    deadline = time.monotonic() + self._flush_s
            try:
                update_progress_artifact(self._artifact, progress=value)
                self._failures = 0
            except Exception as exc:  # noqa: BLE001 - a lost update is retried; it never fails the work
                with self._wake:
                    if self._pending is None:
                        self._pending = value  # nothing newer came meanwhile: this one is still owed
                    self._failures += 1
                    if self._failures == 1:
                        self._logger.warning("progress artifact update failed (%s); retrying every %.0f s",
                                             type(exc).__name__, self._retry_s)
                    if deadline is not None and time.monotonic() > deadline:
                        return
                    self._wake.wait(self._retry_s)
