"""A real Prefect server and ktflow workers on this machine, for the orchestration tests.

The server runs with its own PREFECT_HOME (SQLite); the deployments come from
deployments/prefect.yaml, deployed from this checkout; each "host" is a ``ktflow worker``
process with its own advertised name and pools. Nothing here is a stand-in: the tests drive
the cluster with the ``prefect`` CLI a user would type.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PREFECT = [sys.executable, "-m", "prefect"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    home: Path
    api_url: str
    env: dict[str, str]
    server: subprocess.Popen[bytes]
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: Path = Path()

    def prefect(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*PREFECT, *args], cwd=REPO, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"prefect {' '.join(args)} -> {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def ktflow(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([sys.executable, "-m", "ktflow.cli", *args], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"ktflow {' '.join(args)} -> {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def start_worker(self, host: str, pools: list[str], extra_env: dict[str, str] | None = None,
                     toolchains: list[str] = ()) -> subprocess.Popen[bytes]:  # type: ignore[assignment]
        log = open(self.logs / f"worker-{host}.log", "ab")
        argv = [sys.executable, "-m", "ktflow.cli", "worker", "--name", host, "--checkout", str(REPO)]
        for pool in pools:
            argv += ["--pool", pool]
        for item in toolchains:
            argv += ["--toolchain", item]
        proc = subprocess.Popen(argv, cwd=REPO, env={**self.env, **(extra_env or {})}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                # SIGINT stops it; a suite run in the background has it ignored.
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.workers[host] = proc
        return proc

    def stop_worker(self, host: str) -> None:
        proc = self.workers.pop(host)
        _stop(proc, signal.SIGINT, 45)

    def api(self, method: str, path: str, body: dict | None = None) -> object:
        request = urllib.request.Request(self.api_url + path, method=method,
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"null")


def _stop(proc: subprocess.Popen[bytes], sig: int, wait: float) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def prefect_cluster(home: Path) -> Iterator[Cluster]:
    """A Prefect server with ktflow's deployments; workers are started by the caller."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOCAL_STORAGE_PATH": str(home / "results"),  # the "shared store" of results
        "PREFECT_LOGGING_LEVEL": "INFO",
        # Stage runs are picked up within 2 s instead of Prefect's default 10 s poll.
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "KTFLOW_CHECKOUT": str(REPO),
        "COLUMNS": "250",  # the prefect CLI's tables, unabridged
    }
    env.pop("PREFECT_PROFILE", None)
    log = open(home / "server.log", "ab")
    server = subprocess.Popen([*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    cluster = Cluster(home=home, api_url=api_url, env=env, server=server, logs=home)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(api_url + "/health", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("prefect server did not start:\n" + (home / "server.log").read_text()[-3000:])
                time.sleep(0.5)
        cluster.ktflow("worker", "--create-pools")
        cluster.prefect("--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml", timeout=300)
        yield cluster
    finally:
        for host in list(cluster.workers):
            cluster.stop_worker(host)
        _stop(server, signal.SIGTERM, 30)
