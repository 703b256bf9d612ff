"""Running a tool (LlamaFactory, accelerate, kt-kernel's converters, a server) as a child process.

The child stays in our process group, so a Prefect worker that cancels the flow run (it kills
the run's process group) takes the tool down too; a child that called ``setsid`` would escape
it. On our own exit paths (error, timeout, interrupt, Prefect's ``TerminationSignal`` and task
timeouts, which are exceptions raised in the calling thread) the whole tree under the child is
terminated, then killed, and waited for: no orphan keeps a GPU or 500 GB of RAM.

When this process dies without running any of that (SIGKILL, the OOM killer, an unhandled
SIGTERM, a killed process group):

- the direct child gets SIGKILL from the kernel (Linux ``PR_SET_PDEATHSIG``, set between fork
  and exec). It fires when the *thread* that forked exits, which is safe here because
  :func:`run_tool` blocks its calling thread until the tool has ended;
- everything below the child (``accelerate``/``torchrun`` workers, data-loader processes,
  anything double-forked) is found and stopped by a :class:`Guardian`: a tiny watchdog process,
  in its own session so a process-group kill spares it, that holds the read end of a pipe from
  us. End-of-file on that pipe (or its parent pid changing) means we died: it SIGTERMs every
  process carrying the run's marker in its environment, and SIGKILLs what is left after a
  grace period. A normal return disarms it.

Arguments are always a list (never a shell string), and output is streamed line by line to a
log file and to a callback, so a stage's log shows the tool's progress as it happens.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import psutil

from ktflow.errors import KtflowError, ToolError, ToolTimeout

TERMINATE_GRACE_S = 30.0
DRAIN_S = 1.0  # output still arriving this long after the tool exited is a leftover's


def _load_prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Resolved once, here: loading a library between fork and exec (dlopen takes the loader's lock,
# which another thread may have held at the fork) could deadlock the child.
_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


# The guardian's program: standard library only, started with ``python -I -S`` (a few ms).
# argv: marker name, run id, pipe fd, parent pid, grace seconds.
_GUARDIAN_CODE = r"""
import os, select, signal, sys, time
name, run_id, fd, parent, grace = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
for s in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
    signal.signal(s, signal.SIG_IGN)
while True:
    readable, _, _ = select.select([fd], [], [], 1.0)
    if readable:
        if os.read(fd, 1):
            sys.exit(0)  # disarmed: our parent finished cleanly
        break  # end of file: every copy of the write end is closed, our parent is gone
    if os.getppid() != parent:
        break  # re-parented: our parent is gone (and a stray copy of the pipe survived it)
needle = (name + "=" + run_id).encode()
me = os.getpid()
def marked():
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            try:
                with open("/proc/" + entry + "/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):  # a zombie's environ reads empty
                        found.append(int(entry))
            except OSError:
                pass
    return found
def send(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
termed = set()
deadline = time.monotonic() + grace
while time.monotonic() < deadline:
    pids = marked()
    if not pids:
        sys.exit(0)
    send([p for p in pids if p not in termed], signal.SIGTERM)
    termed.update(pids)
    time.sleep(0.1)
for _ in range(50):
    pids = marked()
    if not pids:
        break
    send(pids, signal.SIGKILL)
    time.sleep(0.1)
"""


class Guardian:
    """A watchdog that stops every process marked ``marker_name=run_id`` if this process dies.

    Armed from construction until :meth:`disarm`. While armed, a watchdog process (the
    orchestrator's own python, standard library only, in a new session so it survives a kill of
    our process group, ignoring SIGINT/SIGHUP) waits on a pipe whose write end only this process
    holds (close-on-exec, so tools never inherit it). If this process dies, however it dies, the
    watchdog SIGTERMs every process whose environment has ``marker_name=run_id`` (found through
    ``/proc/*/environ``, so descendants that were re-parented or called ``setsid`` are found
    too), waits ``grace_s``, SIGKILLs the rest and exits. :meth:`disarm` makes it exit doing
    nothing. Starting it is best effort: if it cannot start, the run goes on unguarded.

    Used by :func:`run_tool` for the whole of every tool run and by :mod:`ktflow.stages.serve` while a
    server starts (a server that became ready is meant to outlive us; one that did not is not).
    """

    def __init__(self, marker_name: str, run_id: str, *, grace_s: float = 5.0) -> None:
        self._write: int | None = None
        self._proc: subprocess.Popen | None = None
        read, write = os.pipe()  # both close-on-exec (PEP 446); pass_fds hands the guardian its end
        keep = {k: os.environ[k] for k in ("PATH", "LD_LIBRARY_PATH") if k in os.environ}
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _GUARDIAN_CODE, marker_name, run_id, str(read), str(os.getpid()),
                 repr(float(grace_s))],
                pass_fds=(read,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, env=keep,
            )
        except OSError:
            os.close(write)
        else:
            self._write = write
        finally:
            os.close(read)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def armed(self) -> bool:
        return self._write is not None

    def disarm(self) -> None:
        """Tell the watchdog to exit without touching anything; idempotent."""
        if self._write is None:
            return
        write, self._write = self._write, None
        try:
            os.write(write, b"x")
        except OSError:
            pass
        finally:
            os.close(write)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def terminate_tree(pid: int, grace_s: float = TERMINATE_GRACE_S) -> None:
    """SIGTERM a process and all its descendants, wait up to ``grace_s``, then SIGKILL the rest."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def run_tool(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    log_path: Path | None = None,
    on_line: Callable[[str], None] | None = None,
    timeout_s: float | None = None,
    grace_s: float = TERMINATE_GRACE_S,
) -> None:
    """Run ``argv`` to completion, streaming its merged stdout/stderr.

    Args:
        argv: the command; ``argv[0]`` should be an absolute path into a toolchain.
        env: the complete environment of the child (default: ours).
        log_path: every output line is appended here (the file is created if missing).
        on_line: called with each output line (without the newline), e.g. to forward it to a log.
        timeout_s: stop the tool (its whole tree) after this many seconds.

    Raises:
        ToolError: the tool exited non-zero.
        ToolTimeout: the time limit passed.
    """
    run_id = uuid.uuid4().hex
    child_env = {**(dict(env) if env is not None else os.environ), TOOL_MARKER: run_id}
    output = _ToolOutput(log_path, on_line)
    guardian = Guardian(TOOL_MARKER, run_id)
    try:
        proc = _popen_tool(argv, child_env, cwd)
    except KtflowError:
        guardian.disarm()
        output.close()
        raise
    timer, timed_out = _deadline(proc, timeout_s, grace_s)
    lines, reader = _read_lines(proc)
    try:
        _pump(proc, lines, output.emit)
        returncode = proc.wait()
    except BaseException:
        terminate_tree(proc.pid, grace_s)
        raise
    finally:
        if timer:
            timer.cancel()
        if proc.poll() is None:
            terminate_tree(proc.pid, grace_s)
        reap_marked(run_id)
        guardian.disarm()  # nothing of the run is left to guard
        reader.join(timeout=5)
        output.close()
    if timed_out.is_set():
        raise ToolTimeout(f"{Path(argv[0]).name} ran past its limit of {timeout_s:g} s and was stopped, with every "
                          f"process it started" + (f" (log: {log_path})" if log_path else ""))
    if returncode != 0:
        raise ToolError(argv, returncode, list(output.tail), log_path)


def _popen_tool(argv: Sequence[str], env: dict[str, str], cwd: Path | None) -> subprocess.Popen:
    try:
        return subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            bufsize=0,
            preexec_fn=_die_with_parent,
        )
    except OSError as exc:
        raise KtflowError(f"cannot start {argv[0]}: {exc.strerror}") from None


def _deadline(proc: subprocess.Popen, timeout_s: float | None,
              grace_s: float) -> tuple[threading.Timer | None, threading.Event]:
    """A timer that stops the tool's tree after ``timeout_s`` (None: never), and the event it sets."""
    timed_out = threading.Event()
    if timeout_s is None:
        return None, timed_out

    def expire() -> None:
        timed_out.set()
        terminate_tree(proc.pid, grace_s)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    return timer, timed_out


def _read_lines(proc: subprocess.Popen) -> tuple[queue.Queue[bytes | None], threading.Thread]:
    """A thread putting the tool's output lines on a queue, then None at end of output."""
    lines: queue.Queue[bytes | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:  # bytes, split on \n only (text mode would split on \r too)
            lines.put(raw)
        lines.put(None)

    reader = threading.Thread(target=read, name="tool-output", daemon=True)
    reader.start()
    return lines, reader


def _pump(proc: subprocess.Popen, lines: queue.Queue[bytes | None], emit: Callable[[bytes], None]) -> None:
    """Hand each output line to ``emit`` until the output ends (or shortly after the tool exited)."""
    exited_at: float | None = None
    while True:
        try:
            raw = lines.get(timeout=0.2)
        except queue.Empty:
            # A daemon the tool left behind may hold the pipe open after the tool exited:
            # stop waiting for end-of-output shortly after the exit.
            if proc.poll() is not None:
                exited_at = exited_at or time.monotonic()
                if time.monotonic() - exited_at > DRAIN_S:
                    return
            continue
        if raw is None:
            return
        emit(raw)


class _ToolOutput:
    """Where a tool's output lines go: a tail for the error message, the log file, ``on_line``."""

    def __init__(self, log_path: Path | None, on_line: Callable[[str], None] | None) -> None:
        self.tail: deque[str] = deque(maxlen=50)
        self.on_line = on_line
        self.log = open(log_path, "a", encoding="utf-8", errors="replace") if log_path else None

    def emit(self, raw: bytes) -> None:
        # tqdm redraws with carriage returns: keep the last state of each line.
        line = raw.decode("utf-8", "replace").rstrip("\n").rsplit("\r", 1)[-1]
        self.tail.append(line)
        if self.log:
            self.log.write(line + "\n")
            self.log.flush()
        if self.on_line:
            self.on_line(line)

    def close(self) -> None:
        if self.log:
            self.log.close()


TOOL_MARKER = "KTFLOW_TOOL_RUN"
# Set in our own environment while ktflow runs flows on Prefect's ephemeral API: every process
# started from then on inherits it (Prefect's API server among them). See guard_descendants.
EMBEDDED_API_MARKER = "KTFLOW_EMBEDDED_API"


def reap_marked(run_id: str, marker_name: str = TOOL_MARKER) -> None:
    """Stop every process whose environment has ``marker_name=run_id``, with its tree.

    Daemons a tool spawns (dataloader workers, a server it forked) outlive it as orphans; the
    environment marker each inherited identifies them exactly, whoever their parent is now.
    """
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(marker_name) == run_id:
                terminate_tree(proc.pid, 5)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue


def guard_descendants(marker_name: str) -> Guardian:
    """Stop, when this process exits however it exits, every process it starts from now on.

    Puts ``marker_name=<new id>`` in our environment, so every later child inherits it (whoever
    starts it: Prefect starts its ephemeral API server, a uvicorn subprocess, itself and stops it
    only at a clean exit), and arms a :class:`Guardian` for that marker that is never disarmed.
    A process meant to outlive us (a serving endpoint) must be started without the marker.
    """
    run_id = uuid.uuid4().hex
    os.environ[marker_name] = run_id
    return Guardian(marker_name, run_id)


class ThrottledLines:
    """Forward at most one line per ``interval`` seconds (plus every line matching ``keep``)."""

    def __init__(self, emit: Callable[[str], None], interval: float = 2.0,
                 keep: Callable[[str], bool] | None = None) -> None:
        self._emit = emit
        self._interval = interval
        self._keep = keep
        self._last = 0.0

    def __call__(self, line: str) -> None:
        now = time.monotonic()
        if (self._keep and self._keep(line)) or now - self._last >= self._interval:
            self._last = now
            self._emit(line[:10_000])  # the Prefect log API caps a line; tqdm bars are long


class LogFollower:
    """Follow a file another process appends to, from ``offset``, in a thread: each complete line
    goes to ``on_line`` (decoded as UTF-8, a tqdm redraw reduced to its last state) and into
    :attr:`tail`. A half-written line waits for the rest; a file rewritten from scratch is read
    again from its start. Use as a context manager: on exit everything written so far is read,
    and an unfinished last line is kept in the tail (it is often the error).
    """

    def __init__(self, path: Path, on_line: Callable[[str], None] | None = None, *, offset: int | None = None,
                 poll_s: float = 0.2, keep: int = 60) -> None:
        """``offset`` None: from the file's current end (what is new from now on)."""
        self.path, self.on_line, self.poll_s = Path(path), on_line, poll_s
        if offset is None:
            offset = self.path.stat().st_size if self.path.exists() else 0
        self.offset = offset
        self.tail: deque[str] = deque(maxlen=keep)
        self._stop = threading.Event()
        self._partial = b""
        self._thread = threading.Thread(target=self._run, name=f"follow-{self.path.name}", daemon=True)

    def __enter__(self) -> LogFollower:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop following and read what is left (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._read()
        if self._partial:
            self.tail.append(self._partial.decode("utf-8", errors="replace").rsplit("\r", 1)[-1])
            self._partial = b""

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._read()

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:  # rewritten from scratch
                    self.offset, self._partial = 0, b""
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        if not chunk:
            return
        self.offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # an unfinished line (or character) waits for the rest
        for raw in lines:
            line = raw.decode("utf-8", errors="replace").rsplit("\r", 1)[-1]
            self.tail.append(line)
            if self.on_line is not None:
                try:
                    self.on_line(line[:10_000])
                except Exception:  # noqa: BLE001 - a logging or progress callback must not break the run
                    pass


@contextlib.contextmanager
def ktflow_pythonpath() -> Iterator[str]:
    """A directory holding only the ``ktflow`` package (a symlink), for a toolchain's ``PYTHONPATH``.

    The toolchain finds ktflow without installing it, and nothing else of the orchestrator's
    environment leaks in. Removed on exit.
    """
    import ktflow

    with tempfile.TemporaryDirectory(prefix="ktflow-pkg-") as pkg_dir:
        os.symlink(Path(ktflow.__file__).resolve().parent, Path(pkg_dir) / "ktflow")
        yield pkg_dir


def tool_versions(python: Path, packages: Sequence[str]) -> dict[str, str]:
    """Versions of ``packages`` installed in the toolchain whose python is ``python`` (absent ones,
    or a toolchain that cannot be asked, are left out): what a stage's manifest records."""
    code = (
        "import json, importlib.metadata as m\n"
        "out = {}\n"
        f"for p in {list(packages)!r}:\n"
        "    try: out[p] = m.version(p)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))"
    )
    try:
        done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(done.stdout) if done.returncode == 0 else {}
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}


@contextlib.contextmanager
def single_thread_torch() -> Iterator[None]:
    """Run torch single-threaded inside the block (restored after).

    Callers parallelize across tensors with a thread pool; torch's own intra-op threads would oversubscribe
    the cores.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
