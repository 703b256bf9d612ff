"""The suite leaves nothing running: a pytest plugin (conftest.py loads it).

Every process a test starts inherits ``KTFLOW_TEST_SESSION=<token>`` from the process that runs
the tests (the one pytest process, or each pytest-xdist worker). Those processes set it in their
own ``os.environ`` after they started, so their own ``/proc/PID/environ`` lacks it while every
child has it: the marker finds exactly what the tests started, wherever it was re-parented, the
way the process-hygiene tests find a tool's tree (tests/test_hygiene.py).

When the session ends (in the controller, after every worker and fixture has finished), any
process still carrying the token is given ``GRACE_S`` to exit, then is named in the summary,
killed with its children, and the run fails.
"""

from __future__ import annotations

import os
import secrets
import time

import psutil
import pytest

MARKER = "KTFLOW_TEST_SESSION"
GRACE_S = 30.0  # a server's SIGTERM -> SIGKILL round (ktflow's own grace is 10 s) with room on a loaded box

_SURVIVORS_KEY = pytest.StashKey[list[str]]()
_TOKEN_KEY = pytest.StashKey[str]()


def _distributed(config: pytest.Config) -> bool:
    """This process is a pytest-xdist controller that hands the tests to workers."""
    return bool(getattr(config.option, "numprocesses", None)) and getattr(config.option, "dist", "no") != "no"


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # an xdist worker: the controller's token, and which worker
        token = f"{workerinput[MARKER]}/{workerinput['workerid']}"
    else:
        token = f"{os.getpid()}-{secrets.token_hex(8)}"
    config.stash[_TOKEN_KEY] = token
    if workerinput is not None or not _distributed(config):
        os.environ[MARKER] = token  # what this process starts inherits it; this process's /proc environ does not


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:  # pytest-xdist: a worker is about to start
    node.workerinput[MARKER] = node.config.stash[_TOKEN_KEY]


def started_here(proc: psutil.Process) -> bool:
    """``proc`` was started (directly or not) by this test process: under pytest-xdist, by this worker,
    not by the other worker's tests that run at the same time."""
    mine = os.environ.get(MARKER)
    try:
        return mine is not None and proc.environ().get(MARKER) == mine
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def session_processes(token: str) -> list[psutil.Process]:
    """Live processes that carry the session's token, from any worker (zombies are dead: they hold nothing)."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            value = proc.environ().get(MARKER, "")
            if (value == token or value.startswith(token + "/")) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _describe(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid} (parent {proc.ppid()}): {' '.join(proc.cmdline())[:300]}"
    except psutil.Error:
        return f"pid {proc.pid} (gone while being described)"


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if getattr(session.config, "workerinput", None) is not None:
        return  # each worker's processes are checked once, by the controller, after all workers are done
    token = session.config.stash[_TOKEN_KEY]
    deadline = time.monotonic() + GRACE_S
    while (left := session_processes(token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not left:
        return
    session.config.stash[_SURVIVORS_KEY] = [_describe(proc) for proc in left]
    for proc in left:
        try:
            for child in proc.children(recursive=True):
                child.kill()
            proc.kill()
        except psutil.Error:
            pass
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    survivors = config.stash.get(_SURVIVORS_KEY, None)
    if survivors:
        terminalreporter.section("processes the tests left running", sep="=", red=True, bold=True)
        terminalreporter.line(f"{len(survivors)} process(es) started by the tests were still running "
                              f"{GRACE_S:.0f} s after the session ended (killed now; the run fails):", red=True)
        for line in survivors:
            terminalreporter.line(f"  {line}")
