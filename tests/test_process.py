"""The tool runner: streamed output, clear failures, and no process left behind on any exit path."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
import pytest

from ktflow.errors import ToolError, ToolTimeout
from ktflow.host.process import run_tool

PY = sys.executable


def processes_running(token: str) -> list[psutil.Process]:
    """Processes (of this test) whose command line holds ``token``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if any(token in part for part in proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_streams_lines_to_callback_and_log(tmp_path: Path) -> None:
    lines: list[str] = []
    log = tmp_path / "tool.log"
    run_tool([PY, "-c", "import sys\nfor i in range(3): print(f'line {i}', flush=True)\nprint('bar 10%\\rbar 100%')"],
             log_path=log, on_line=lines.append)
    assert lines == ["line 0", "line 1", "line 2", "bar 100%"]  # carriage-return redraws collapse
    assert log.read_text().splitlines() == lines


def test_failure_carries_the_exit_code_and_last_lines(tmp_path: Path) -> None:
    with pytest.raises(ToolError) as info:
        run_tool([PY, "-c", "print('loading'); print('CUDA out of memory'); raise SystemExit(3)"],
                 log_path=tmp_path / "t.log")
    assert info.value.returncode == 3
    assert "CUDA out of memory" in str(info.value) and str(tmp_path / "t.log") in str(info.value)


def test_timeout_stops_the_whole_tree() -> None:
    # The tool starts a grandchild that would outlive it; both must be gone after the timeout.
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60.0101)'])\n"
        "time.sleep(60.0102)\n"
    )
    started = time.monotonic()
    with pytest.raises(ToolTimeout):
        run_tool([PY, "-c", code], timeout_s=2, grace_s=2)
    assert time.monotonic() - started < 20
    assert processes_running("60.010") == []


def test_daemons_left_by_a_finished_tool_are_stopped() -> None:
    # A double fork re-parents the daemon away from the tool; the environment marker still finds it.
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60.0201)\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"
    )
    run_tool([PY, "-c", code])
    time.sleep(0.2)
    assert processes_running("60.0201") == []


def test_an_exception_in_the_caller_stops_the_tool() -> None:
    def boom(line: str) -> None:
        raise RuntimeError("caller failed")

    with pytest.raises(RuntimeError, match="caller failed"):
        run_tool([PY, "-c", "import time\nprint('go', flush=True)\ntime.sleep(60.0301)"], on_line=boom, grace_s=2)
    assert processes_running("60.0301") == []


def test_a_missing_program_is_a_clear_error() -> None:
    with pytest.raises(Exception, match="cannot start"):
        run_tool(["/nonexistent/llamafactory-cli", "train"])


def test_no_shell_is_involved(tmp_path: Path) -> None:
    # An argument that a shell would interpret reaches the program verbatim.
    lines: list[str] = []
    run_tool([PY, "-c", "import sys; print(sys.argv[1])", "$(touch pwned); `id`"], cwd=tmp_path, on_line=lines.append)
    assert lines == ["$(touch pwned); `id`"] and not (tmp_path / "pwned").exists()
