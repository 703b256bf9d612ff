"""``ktflow worker``: join the work pools this host qualifies for, one Prefect worker each.

The host is probed (the same probe as ``ktflow doctor``), each pool of ``ktflow.host.pools`` is
checked against it, and a ``prefect worker start --type process`` is started for every pool
asked for (default: every pool the host qualifies for). A pool the host does not qualify for
is refused with the reason, before anything starts. The workers' environment names the host,
the pool and the checkout, and reaches every flow run they start (the stage flows record it).

With one pool the worker replaces this process (what a systemd unit wants: signals go
straight to Prefect's worker); with several, this process supervises them and stops them all
when it is stopped or when one of them exits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import BaseModel

from ktflow.errors import HostRequirementError, KtflowError
from ktflow.host.hardware import HostInfo
from ktflow.host.pools import WORK_POOLS, WorkPoolSpec, pool_named, pool_shortfalls

HOST_NAME_ENV = "KTFLOW_HOST_NAME"
POOL_ENV = "KTFLOW_POOL"
WORKER_ENV = "KTFLOW_WORKER"
CHECKOUT_ENV = "KTFLOW_CHECKOUT"


class PoolVerdict(BaseModel):
    """Whether this host may join a pool, and why not."""

    pool: str
    role: str
    stages: list[str]
    qualifies: bool
    missing: list[str]


class WorkerLaunch(BaseModel):
    """One Prefect worker to start: its pool, name, command line and extra environment."""

    pool: str
    name: str
    argv: list[str]
    env: dict[str, str]


def pool_verdicts(host: HostInfo) -> list[PoolVerdict]:
    """Every ktflow pool with whether ``host`` qualifies for it."""
    verdicts = []
    for pool in WORK_POOLS:
        missing = pool_shortfalls(pool, host)
        verdicts.append(PoolVerdict(pool=pool.name, role=pool.role, stages=list(pool.stages),
                                    qualifies=not missing, missing=missing))
    return verdicts


def choose_pools(host: HostInfo, requested: Sequence[str] = ()) -> list[WorkPoolSpec]:
    """The pools to join: ``requested`` (all must qualify) or every qualifying one.

    Raises:
        HostRequirementError: a requested pool is unknown or this host does not qualify for it,
            or (nothing requested) the host qualifies for no stage pool.
    """
    if requested:
        pools = [pool_named(name) for name in requested]
        refused = {pool.name: pool_shortfalls(pool, host) for pool in pools}
        refused = {name: why for name, why in refused.items() if why}
        if refused:
            name, why = next(iter(refused.items()))
            raise HostRequirementError(
                f"ktflow worker --pool {name}", "; ".join(why),
                "start this host's worker only on the pools `ktflow worker --list` marks as qualifying, "
                "or run it on a host that has the capability",
            )
        return pools
    pools = [pool for pool in WORK_POOLS if not pool_shortfalls(pool, host)]
    if not any(pool.stages for pool in pools):
        raise HostRequirementError(
            f"host {host.hostname}", f"qualifies for no stage pool (CPU {host.cpu_variant})",
            "see `ktflow worker --list` for what each pool needs",
        )
    return pools


STORE_ROOT_ENV = "KTFLOW_STORE_ROOT"
ARTIFACTS_BLOCK_ENV = "KTFLOW_ARTIFACTS_BLOCK"


def worker_launches(pools: Sequence[WorkPoolSpec], *, host_name: str, checkout: Path,
                    toolchain_blocks: dict[str, str] | None = None, store_root: Path | None = None,
                    artifacts_block: str | None = None, python: str = sys.executable) -> list[WorkerLaunch]:
    """The ``prefect worker start`` command line and environment for each pool.

    ``toolchain_blocks`` maps a role (train, serve) to this host's Toolchain block name; the
    stage flows the worker runs use those environments instead of the recipe's paths.
    ``store_root``: this host's own store (hosts without a shared one); the stage flows map the
    recipe's store paths onto it. ``artifacts_block``: this host's ArtifactStore block (the URL
    and credentials what crosses hosts travels through); else the host's environment holds them.
    """
    extra = {f"KTFLOW_TOOLCHAIN_{role.upper()}": block for role, block in (toolchain_blocks or {}).items()}
    if store_root is not None:
        extra[STORE_ROOT_ENV] = str(Path(store_root).absolute())
    if artifacts_block:
        extra[ARTIFACTS_BLOCK_ENV] = artifacts_block
    launches = []
    for pool in pools:
        name = f"{host_name}-{pool.name}"
        argv = [python, "-m", "prefect", "worker", "start", "--pool", pool.name, "--type", "process",
                "--name", name]
        if pool.concurrency_limit is not None:
            argv += ["--limit", str(pool.concurrency_limit)]
        env = {HOST_NAME_ENV: host_name, POOL_ENV: pool.name, WORKER_ENV: name, CHECKOUT_ENV: str(checkout), **extra}
        launches.append(WorkerLaunch(pool=pool.name, name=name, argv=argv, env=env))
    return launches


def run_workers(launches: Sequence[WorkerLaunch], *, log: Callable[[str], None] = print) -> int:
    """Start the workers and wait; return the exit code of the first one to stop.

    One launch replaces this process. Several are supervised: SIGTERM/SIGINT to this process
    is passed to every worker (Prefect's worker finishes its shutdown on SIGINT), and when one
    worker exits the others are stopped too, so a unit restarting ``ktflow worker`` restarts all.
    """
    if len(launches) == 1:
        launch = launches[0]
        log(f"worker {launch.name} on pool {launch.pool}")
        # Prefect's worker shuts down on SIGINT; one started from a background shell (`... &`)
        # inherits it ignored, and an ignored signal stays ignored across exec.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execvpe(launch.argv[0], launch.argv, {**os.environ, **launch.env})

    procs: list[subprocess.Popen[bytes]] = []
    stopping = False

    def stop_all(signum: int = signal.SIGINT, _frame: object = None) -> None:
        nonlocal stopping
        stopping = True
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)

    # Handled here (not ignored), so the workers start with SIGINT at its default, whatever we inherited.
    previous = {sig: signal.signal(sig, stop_all) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for launch in launches:
            log(f"worker {launch.name} on pool {launch.pool}")
            # Own process groups: a terminal Ctrl-C reaches this process only, which passes on one SIGINT.
            procs.append(subprocess.Popen(launch.argv, env={**os.environ, **launch.env}, process_group=0))
        while all(proc.poll() is None for proc in procs):
            time.sleep(0.5)
        code = next(proc.returncode for proc in procs if proc.poll() is not None)
        by_signal = stopping
        stop_all()
        deadline = time.monotonic() + 40
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return 0 if by_signal else code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def create_pools(*, python: str = sys.executable, log: Callable[[str], None] = print) -> list[str]:
    """Create every ktflow pool that the Prefect server (``PREFECT_API_URL``) lacks; return those created.

    Deployments can only be applied to existing pools, so this runs before ``prefect deploy``.
    """
    created = []
    for pool in WORK_POOLS:
        exists = subprocess.run([python, "-m", "prefect", "work-pool", "inspect", pool.name],
                                capture_output=True, text=True)
        if exists.returncode == 0:
            continue
        made = subprocess.run([python, "-m", "prefect", "work-pool", "create", pool.name, "--type", "process"],
                              capture_output=True, text=True)
        if made.returncode != 0:
            raise KtflowError(f"could not create work pool {pool.name}: {(made.stdout + made.stderr).strip()[-500:]}")
        log(f"created work pool {pool.name} ({pool.role})")
        created.append(pool.name)
    return created
