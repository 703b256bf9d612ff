"""A real Prefect server and ktflow workers on this machine, for the orchestration tests.

The server runs with its own PREFECT_HOME, on SQLite there or on PostgreSQL (``postgres_server``
starts a throwaway cluster: initdb into a temporary directory, its own port, a non-root role);
the deployments come from deployments/prefect.yaml, deployed from this checkout; each "host" is
a ``ktflow worker`` process with its own advertised name and pools. Nothing here is a stand-in:
the tests drive the cluster with the ``prefect`` CLI a user would type.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
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
    port: int = 0
    postgres: "Postgres | None" = None  # the server's database when it is PostgreSQL (else SQLite in home)

    def start_server(self) -> None:
        """Start ``prefect server start`` (API + UI) on the cluster's port; wait until it answers."""
        log = open(self.home / "server.log", "ab")
        self.server = subprocess.Popen([*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                                       cwd=self.home, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(self.api_url + "/health", timeout=2):
                    return
            except OSError:
                if self.server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("prefect server did not start:\n" + (self.home / "server.log").read_text()[-3000:])
                time.sleep(0.5)

    def stop_server(self) -> None:
        """Stop the server as its service manager does (SIGTERM, then SIGKILL after 30 s)."""
        _stop(self.server, signal.SIGTERM, 30)

    def restart_server(self) -> None:
        self.stop_server()
        self.start_server()

    def prefect(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*PREFECT, *args], cwd=REPO, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"prefect {' '.join(args)} -> {done.returncode}\n{done.stdout[-3000:]}\n"
                                 f"{done.stderr[-3000:]}")
        return done

    def ktflow(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([sys.executable, "-m", "ktflow.cli", *args], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"ktflow {' '.join(args)} -> {done.returncode}\n{done.stdout[-3000:]}\n"
                                 f"{done.stderr[-3000:]}")
        return done

    def start_worker(self, host: str, pools: list[str], extra_env: dict[str, str] | None = None,
                     toolchains: list[str] = (), *, checkout: Path = REPO, extra_args: list[str] = (),  # type: ignore[assignment]
                     wrap: list[str] = ()) -> subprocess.Popen[bytes]:  # type: ignore[assignment]
        """``ktflow worker`` as host ``host``; ``wrap``: a command line it runs under (a namespace)."""
        log = open(self.logs / f"worker-{host}.log", "ab")
        argv = [*wrap, sys.executable, "-m", "ktflow.cli", "worker", "--name", host, "--checkout", str(checkout),
                *extra_args]
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


DATABASE_ENV = "KTFLOW_TEST_DATABASE"
"""``postgres`` or ``sqlite`` forces the test server's database; unset: PostgreSQL where its server
binaries are installed (as on CI's machine image), else SQLite."""


def default_database() -> str:
    choice = os.environ.get(DATABASE_ENV, "").strip().lower()
    if choice in ("postgres", "postgresql"):
        return "postgres"
    if choice == "sqlite":
        return "sqlite"
    return "postgres" if postgres_skip_reason() is None else "sqlite"


@contextmanager
def prefect_cluster(home: Path, database: str | None = None) -> Iterator[Cluster]:
    """A Prefect server with ktflow's deployments; workers are started by the caller.

    ``database``: ``"postgres"`` (a throwaway cluster from ``postgres_server``, the production
    setup), ``"sqlite"`` (a file under ``home``), a ``postgresql+asyncpg://`` URL of a running
    database, or None for ``default_database()``.
    """
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
    env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
    database = database or default_database()
    with ExitStack() as stack:
        postgres = stack.enter_context(postgres_server()) if database == "postgres" else None
        url = postgres.url if postgres else (database if database.startswith("postgresql") else None)
        if url:
            env["PREFECT_API_DATABASE_CONNECTION_URL"] = url
        cluster = Cluster(home=home, api_url=api_url, env=env, server=None, logs=home, port=port,  # type: ignore[arg-type]
                          postgres=postgres)
        try:
            cluster.start_server()
            cluster.ktflow("worker", "--create-pools")
            cluster.prefect("--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml", timeout=300)
            yield cluster
        finally:
            for host in list(cluster.workers):
                cluster.stop_worker(host)
            if cluster.server is not None:
                cluster.stop_server()


# --------------------------------------------------------------------------- PostgreSQL

# Where Debian's postgresql-NN packages put the server binaries (newest first); KTFLOW_PG_BIN overrides.
_PG_BIN_GLOB = "/usr/lib/postgresql/*/bin"


def postgres_bin_dir() -> Path | None:
    """The directory of PostgreSQL's initdb and postgres, or None where the server is not installed."""
    candidates = [Path(os.environ["KTFLOW_PG_BIN"])] if os.environ.get("KTFLOW_PG_BIN") else sorted(
        Path("/").glob(_PG_BIN_GLOB.lstrip("/")), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        reverse=True)
    for bin_dir in candidates:
        if (bin_dir / "initdb").is_file() and (bin_dir / "postgres").is_file():
            return bin_dir
    return None


def postgres_skip_reason() -> str | None:
    """Why a PostgreSQL-backed test cannot run here (None: it can)."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        return "PostgreSQL server binaries not found (/usr/lib/postgresql/*/bin/initdb; apt-get install postgresql)"
    share = subprocess.run([str(bin_dir / "pg_config"), "--sharedir"], capture_output=True, text=True)
    if share.returncode == 0 and not list(Path(share.stdout.strip(), "extension").glob("pg_trgm.control")):
        return f"PostgreSQL's pg_trgm extension (which Prefect needs) is not installed under {share.stdout.strip()}"
    return None


@dataclass
class Postgres:
    """A running throwaway PostgreSQL cluster with a database for Prefect."""

    url: str          # postgresql+asyncpg://prefect:...@127.0.0.1:PORT/prefect, for PREFECT_API_DATABASE_CONNECTION_URL
    port: int
    root: Path        # data directory, unix socket and log live here
    role: str         # the non-superuser role that owns the database
    os_user: str      # the (non-root) OS user the server runs as
    proc: subprocess.Popen[bytes]

    def psql(self, sql: str, database: str = "prefect") -> str:
        done = subprocess.run([str(postgres_bin_dir() / "psql"), "-X", "-A", "-t", "-v", "ON_ERROR_STOP=1",
                               "-h", str(self.root), "-p", str(self.port), "-U", "postgres", "-d", database, "-c", sql],
                              capture_output=True, text=True, timeout=60, **_as_user(self.os_user))
        if done.returncode != 0:
            raise AssertionError(f"psql {sql!r} -> {done.returncode}: {done.stderr}")
        return done.stdout.strip()


def _as_user(os_user: str) -> dict:
    """Popen keywords that run a command as ``os_user`` (PostgreSQL refuses to run as root)."""
    if os.geteuid() != 0:
        return {}
    entry = pwd.getpwnam(os_user)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/", "LC_ALL": "C.UTF-8"}
    # the suite's session marker (tests/session_guard.py): a server left running is found and named
    env.update({k: v for k, v in os.environ.items() if k == "KTFLOW_TEST_SESSION"})
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": [], "env": env}


@contextmanager
def postgres_server(os_user: str = "nobody") -> Iterator[Postgres]:
    """A throwaway PostgreSQL cluster: ``initdb`` into a new temporary directory, its own port (TCP
    on 127.0.0.1, unix socket in that directory), a ``prefect`` role (login with a password, no
    superuser) owning database ``prefect`` with ``pg_trgm``. Run as ``os_user`` when we are root.
    Removed with everything in it on exit."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        raise RuntimeError(postgres_skip_reason())
    # Not under pytest's tmp_path: its parents are mode 0700, closed to the server's OS user.
    root = Path(tempfile.mkdtemp(prefix="ktflow-pg-"))
    if os.geteuid() == 0:
        entry = pwd.getpwnam(os_user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    port = free_port()
    password = secrets.token_hex(16)
    pwfile = root / "superuser.pw"
    pwfile.write_text(secrets.token_hex(16) + "\n")
    if os.geteuid() == 0:
        os.chown(pwfile, entry.pw_uid, entry.pw_gid)
    proc: subprocess.Popen[bytes] | None = None
    try:
        initdb = subprocess.run(
            [str(bin_dir / "initdb"), "-D", str(root / "data"), "-U", "postgres", "--pwfile", str(pwfile),
             "-E", "UTF8", "--locale", "C.UTF-8", "--no-sync",
             # the socket (in the 0700 directory, for psql here) is trusted; TCP needs the role's password
             "--auth-local", "trust", "--auth-host", "scram-sha-256"],
            capture_output=True, text=True, timeout=120, **_as_user(os_user))
        if initdb.returncode != 0:
            raise AssertionError(f"initdb failed ({initdb.returncode}):\n{initdb.stdout}\n{initdb.stderr}")
        log = open(root / "postgres.log", "ab")
        proc = subprocess.Popen(
            [str(bin_dir / "postgres"), "-D", str(root / "data"), "-p", str(port), "-k", str(root),
             "-c", "listen_addresses=127.0.0.1"],  # otherwise PostgreSQL's defaults, as documented
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **_as_user(os_user))
        server = Postgres(url=f"postgresql+asyncpg://prefect:{password}@127.0.0.1:{port}/prefect", port=port,
                          root=root, role="prefect", os_user=os_user, proc=proc)
        deadline = time.monotonic() + 60
        while subprocess.run([str(bin_dir / "pg_isready"), "-q", "-h", str(root), "-p", str(port)],
                             timeout=30).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("postgres did not start:\n" + (root / "postgres.log").read_text()[-3000:])
            time.sleep(0.2)
        server.psql(f"CREATE ROLE prefect LOGIN PASSWORD '{password}' NOSUPERUSER NOCREATEDB NOCREATEROLE",
                    database="postgres")
        server.psql("CREATE DATABASE prefect OWNER prefect", database="postgres")
        server.psql("CREATE EXTENSION IF NOT EXISTS pg_trgm")
        yield server
    finally:
        if proc is not None:
            _stop(proc, signal.SIGINT, 30)  # SIGINT: PostgreSQL's "fast" shutdown
        shutil.rmtree(root, ignore_errors=True)
