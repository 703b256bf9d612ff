"""Process hygiene: cancellation, timeouts and crashes of a stage or flow leave no process behind.

Every case starts the thing under test in a subprocess (a ``ktflow`` command, a Prefect flow, an
orchestrator script), waits until the tool it launched is running, records the process tree
under it (pid + start time) and the run markers (``KTFLOW_TOOL_RUN`` / ``KTFLOW_SERVER_RUN``)
those processes carry, then interrupts it: SIGTERM, SIGINT, SIGKILL (a crash), a timeout. It
then asserts that none of the recorded processes, and no process anywhere carrying one of the
recorded markers, is still alive. The stand-in tools build the worst tree a real tool makes: a
child, and a daemon that double-forked and called ``setsid`` (out of the tree and the process
group: only the marker finds it).

``ktflow sft`` runs real LlamaFactory on the tiny fixture. ``ktflow convert-lora`` and
``ktflow quantize-int8`` run with a stand-in serving python: the toolchain probes go to the real
``.venv-serve`` python, the converter / the kt-kernel driver are replaced by the stand-in tree
(the real ones finish in ~2 s on the tiny fixtures, too fast to interrupt reliably).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ktflow.errors import KtflowError, ToolTimeout
from ktflow.host.process import EMBEDDED_API_MARKER, TOOL_MARKER, run_tool
from ktflow.stages.serve import SERVER_MARKER, free_port, read_endpoint, stop

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
PY = sys.executable
TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"
SERVE_PYTHON = REPO / ".venv-serve" / "bin" / "python"
needs_train_env = pytest.mark.skipif(not TRAIN_PYTHON.exists(), reason="training toolchain not installed (make train-env)")
needs_serve_env = pytest.mark.skipif(not SERVE_PYTHON.exists(), reason="serving toolchain not installed (make serve-env)")
MARKERS = (TOOL_MARKER, SERVER_MARKER, EMBEDDED_API_MARKER)
KEY = "hygiene-test-key-0123456789"
GONE_WITHIN_S = 25.0  # the guardian's grace (5 s) plus its SIGKILL round, with room on a loaded box

# A tool that leaves the worst tree: itself, a child, and a daemon out of the tree and the
# process group. It writes "tool child daemon" pids to $HYGIENE_PIDFILE, then runs forever.
TREE_TOOL = r'''
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "hygiene-child"])
r, w = os.pipe()
first = os.fork()
if first == 0:
    os.setsid()
    if os.fork() == 0:
        os.close(r)
        os.write(w, str(os.getpid()).encode())
        os.close(w)
        time.sleep(600)
    os._exit(0)
os.close(w)
os.waitpid(first, 0)
daemon = int(os.read(r, 32))
pidfile = os.environ["HYGIENE_PIDFILE"]
with open(pidfile + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid} {daemon}")
os.replace(pidfile + ".tmp", pidfile)
print("stand-in tool running", flush=True)
time.sleep(600)
'''


# --------------------------------------------------------------------------- process-tree inspection


def _markers_of(proc: psutil.Process) -> set[str]:
    try:
        env = proc.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return set()
    return {env[m] for m in MARKERS if env.get(m)}


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Tree:
    """The processes under ``root`` (and the run markers they carry), as seen while it ran."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, psutil.Process] = {}  # psutil.Process remembers the start time: no pid reuse
        self.markers: set[str] = set()

    def add(self, pid: int) -> None:
        try:
            proc = psutil.Process(pid)
        except psutil.NoSuchProcess:
            return
        self.seen.setdefault(pid, proc)
        self.markers |= _markers_of(proc)

    def snapshot(self) -> Tree:
        try:
            children = psutil.Process(self.root).children(recursive=True)
        except psutil.NoSuchProcess:
            return self
        for proc in children:
            self.add(proc.pid)
        return self

    def survivors(self) -> list[psutil.Process]:
        left = {p.pid: p for p in self.seen.values() if _alive(p)}
        if self.markers:
            for proc in psutil.process_iter():
                if proc.pid not in left and proc.pid != os.getpid() and _markers_of(proc) & self.markers and _alive(proc):
                    left[proc.pid] = proc
        return list(left.values())

    def wait_gone(self, timeout: float = GONE_WITHIN_S) -> list[str]:
        """Descriptions of what is still alive after ``timeout`` (empty: all gone)."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.survivors()
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        out = []
        for proc in left:
            try:
                out.append(f"{proc.pid} (parent {proc.ppid()}): {' '.join(proc.cmdline())[:160]}")
            except psutil.Error:
                continue
        return out

    def kill_all(self) -> None:
        for proc in self.survivors():
            try:
                proc.kill()
            except psutil.Error:
                pass


@pytest.fixture
def trees() -> Iterator[list[Tree]]:
    """Trees a test watches; whatever a failing test left alive is killed afterwards."""
    watched: list[Tree] = []
    yield watched
    for tree in watched:
        tree.kill_all()


def _wait_for(predicate, what: str, proc: subprocess.Popen | None = None, timeout: float = 240.0, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            pytest.fail(f"the process exited ({proc.returncode}) before {what}\n{tail}")
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def _pids(pidfile: Path) -> list[int] | None:
    try:
        return [int(x) for x in pidfile.read_text().split()]
    except (OSError, ValueError):
        return None


def _interrupt(proc: subprocess.Popen, sig: signal.Signals, *, timeout: float = 90) -> int:
    os.kill(proc.pid, sig)  # the command's pid only: its children get nothing from us
    return proc.wait(timeout=timeout)


def _default_sigint() -> None:
    # A suite started in the background (`make test &`) inherits SIGINT ignored, and an ignored
    # signal stays ignored across exec: Python would then never raise KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _spawn(argv: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.Popen:
    # A session of its own: a terminal's or pytest's signals never reach it, only ours.
    return subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, start_new_session=True, preexec_fn=_default_sigint)


# --------------------------------------------------------------------------- run_tool itself (no toolchain)

_ORCHESTRATOR = """
import sys
from ktflow.host.process import run_tool
run_tool([sys.executable, sys.argv[1]], grace_s=5)
"""


@pytest.mark.parametrize("how", ["SIGKILL", "SIGKILL-group", "SIGTERM", "SIGINT"])
def test_a_dying_orchestrator_takes_the_whole_tool_tree_with_it(tmp_path: Path, trees: list[Tree], how: str) -> None:
    """The orchestrator (a python calling run_tool) dies, or is interrupted, mid-run: the tool, its
    child and its escaped daemon all go. SIGKILL-group is what a Prefect worker's cancellation
    does to a flow run's process group (the daemon is in a session of its own)."""
    tool = tmp_path / "tool.py"
    tool.write_text(TREE_TOOL)
    pidfile = tmp_path / "pids"
    proc = _spawn([PY, "-c", _ORCHESTRATOR, str(tool)], tmp_path / "out.log", {"HYGIENE_PIDFILE": str(pidfile)})
    tree = Tree(proc.pid)
    trees.append(tree)
    pids = _wait_for(lambda: _pids(pidfile), "the tool's tree", proc, timeout=60, log=tmp_path / "out.log")
    for pid in pids:
        tree.add(pid)
    tree.snapshot()
    assert len(tree.markers) == 1, "the tool's processes carry one run marker"
    if how == "SIGKILL-group":
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    else:
        _interrupt(proc, getattr(signal, how))
    assert tree.wait_gone() == []


def test_a_tool_past_its_timeout_is_stopped_with_its_whole_tree(tmp_path: Path, trees: list[Tree]) -> None:
    tool = tmp_path / "tool.py"
    tool.write_text(TREE_TOOL)
    pidfile = tmp_path / "pids"
    lines: list[str] = []
    began = time.monotonic()
    with pytest.raises(ToolTimeout) as caught:
        run_tool([PY, str(tool)], env={**os.environ, "HYGIENE_PIDFILE": str(pidfile)}, timeout_s=3, grace_s=3,
                 on_line=lines.append, log_path=tmp_path / "tool.log")
    elapsed = time.monotonic() - began
    assert isinstance(caught.value, KtflowError)
    assert str(caught.value).startswith("python") and "ran past its limit of 3 s and was stopped" in str(caught.value)
    assert str(tmp_path / "tool.log") in str(caught.value)
    assert lines == ["stand-in tool running"] and elapsed < 15
    tree = Tree(os.getpid())
    trees.append(tree)
    for pid in _pids(pidfile) or []:
        tree.add(pid)  # already gone when run_tool returned: nothing to add, nothing alive
    left = [pid for pid in _pids(pidfile) or [] if psutil.pid_exists(pid) and _alive(psutil.Process(pid))]
    assert left == []  # right when run_tool raised: no guardian needed, we are alive


def test_the_guardian_is_gone_after_a_normal_run_and_leaves_no_session_behind() -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    run_tool([PY, "-c", "print('ok')"])
    after = {p.pid for p in psutil.Process().children(recursive=True) if _alive(p)}
    assert after - before == set()


# --------------------------------------------------------------------------- the ktflow commands


def _sft_argv(root: Path, model: Path) -> list[str]:
    from ktflow.demo import write_demo_dataset

    train, evaluation = write_demo_dataset(root / "data")
    argv = [PY, "-m", "ktflow.cli", "sft", str(RECIPES / "tiny-demo.yaml")]
    for override in (f"source.local_path={model}", "source.format=bf16", f"dataset.files=[{train}]",
                     f"evaluation.files=[{evaluation}]", f"store.root={root / 'store'}",
                     f"toolchains.train.python={TRAIN_PYTHON}", "sft.max_steps=2000", "sft.save_steps=5000"):
        argv += ["--set", override]
    return argv


@needs_train_env
@pytest.mark.slow
# SIGINT is covered by the run_tool and stage-command cases (same cleanup path); each real SFT case costs ~40 s.
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_ktflow_sft_interrupted_or_killed_mid_training_leaves_nothing(tmp_path: Path, fixture_dir, trees: list[Tree],
                                                                        sig: str) -> None:
    """Real LlamaFactory on the tiny fixture, interrupted once its training loop logs steps."""
    log = tmp_path / "sft.log"
    proc = _spawn(_sft_argv(tmp_path, fixture_dir("bf16")), log)
    tree = Tree(proc.pid)
    trees.append(tree)
    _wait_for(lambda: list((tmp_path / "store" / "runs").glob("*/output/trainer_log.jsonl")) and tree.snapshot().markers,
              "LlamaFactory's first training step", proc, log=log)
    tree.snapshot()
    trainers = [p for p in tree.seen.values() if any("llamafactory-cli" in a for a in p.cmdline())]
    assert trainers and all(_markers_of(p) == tree.markers for p in trainers)
    code = _interrupt(proc, getattr(signal, sig))
    if sig == "SIGINT":
        assert code == 130 and "interrupted" in log.read_text()
    elif sig == "SIGTERM":  # the CLI turns SIGTERM into an orderly exit through the same cleanup
        assert code == 143 and "terminated" in log.read_text()
    else:
        assert code == -getattr(signal, sig)
    assert tree.wait_gone() == []


@needs_train_env
@pytest.mark.slow
def test_ktflow_run_killed_mid_pipeline_leaves_no_prefect_api_server(tmp_path: Path, fixture_dir,
                                                                     trees: list[Tree]) -> None:
    """`ktflow run` on Prefect's ephemeral API, SIGKILLed during SFT: Prefect's own API server (a
    uvicorn subprocess it stops only at a clean exit) goes too, with LlamaFactory's tree."""
    log = tmp_path / "run.log"
    argv = _sft_argv(tmp_path, fixture_dir("bf16"))
    argv[argv.index("sft")] = "run"
    proc = _spawn(argv, log, {"PREFECT_HOME": str(tmp_path / "prefect")})
    tree = Tree(proc.pid)
    trees.append(tree)
    _wait_for(lambda: list((tmp_path / "store" / "runs").glob("*/output/trainer_log.jsonl")),
              "LlamaFactory's first training step", proc, log=log)
    tree.snapshot()
    servers = [p for p in tree.seen.values() if "uvicorn" in " ".join(p.cmdline())]
    assert servers, f"no ephemeral API server under `ktflow run`: {[p.cmdline() for p in tree.seen.values()]}"
    assert all(EMBEDDED_API_MARKER in p.environ() for p in servers)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert tree.wait_gone() == []


def _stand_in_serve_python(tmp_path: Path) -> Path:
    """A 'serving python': toolchain probes go to the real one, the tool itself is TREE_TOOL."""
    tool = tmp_path / "tree_tool.py"
    tool.write_text(TREE_TOOL)
    bin_dir = tmp_path / "serve-env" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        for arg in "$@"; do
            case "$arg" in
                kt_kernel.sft.convert_kt_to_sglang_adapter|ktflow._drivers.kt_int8) exec {PY} {tool} "$arg" ;;
            esac
        done
        exec {SERVE_PYTHON} "$@"
        """))
    python.chmod(0o755)
    return python


@needs_serve_env
@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGKILL"])
@pytest.mark.parametrize("command", ["convert-lora", pytest.param("quantize-int8", marks=pytest.mark.int8_kernels)])
def test_ktflow_stage_commands_interrupted_or_killed_mid_tool_leave_nothing(
        tmp_path: Path, fixture_dir, trees: list[Tree], command: str, sig: str) -> None:
    base = fixture_dir("bf16")
    python = _stand_in_serve_python(tmp_path)
    if command == "convert-lora":
        sys.path.insert(0, str(Path(__file__).parent))
        try:
            from test_convert_lora import make_kt_adapter
        finally:
            sys.path.pop(0)
        adapter = make_kt_adapter(base, tmp_path / "adapter")
        argv = [PY, "-m", "ktflow.cli", "convert-lora", str(adapter), str(tmp_path / "out"), "--base", str(base),
                "--serve-python", str(python)]
    else:
        argv = [PY, "-m", "ktflow.cli", "quantize-int8", str(base), str(tmp_path / "out"), "--threadpool-count", "2",
                "--serve-python", str(python)]
    pidfile, log = tmp_path / "pids", tmp_path / "cli.log"
    proc = _spawn(argv, log, {"HYGIENE_PIDFILE": str(pidfile)})
    tree = Tree(proc.pid)
    trees.append(tree)
    pids = _wait_for(lambda: _pids(pidfile), f"{command}'s tool", proc, timeout=120, log=log)
    for pid in pids:
        tree.add(pid)
    tree.snapshot()
    assert len(tree.markers) == 1
    code = _interrupt(proc, getattr(signal, sig))
    if sig == "SIGINT":
        assert code == 130, log.read_text()[-2000:]
    assert tree.wait_gone() == []
    assert not (tmp_path / "out").exists()  # nothing published


@needs_train_env
@pytest.mark.slow
def test_sft_past_its_timeout_stops_llamafactory_and_raises_ours(tmp_path: Path, fixture_dir, trees: list[Tree]) -> None:
    from ktflow.demo import write_demo_dataset
    from ktflow.host.hardware import probe_host
    from ktflow.recipe import load_recipe
    from ktflow.stages.sft import run_sft

    model = fixture_dir("bf16")
    train, evaluation = write_demo_dataset(tmp_path / "data")
    recipe = load_recipe(RECIPES / "tiny-demo.yaml", [
        f"source.local_path={model}", "source.format=bf16", f"dataset.files=[{train}]",
        f"evaluation.files=[{evaluation}]", f"store.root={tmp_path / 'store'}",
        f"toolchains.train.python={TRAIN_PYTHON}", "sft.max_steps=2000", "sft.save_steps=5000"])
    tree = Tree(os.getpid())
    trees.append(tree)
    done = threading.Event()

    def watch() -> None:  # record LlamaFactory's tree (the marked children of this process) while it runs
        while not done.wait(0.1):
            for proc in psutil.Process().children(recursive=True):
                if _markers_of(proc):
                    tree.add(proc.pid)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    began = time.monotonic()
    try:
        with pytest.raises(ToolTimeout, match=r"llamafactory-cli ran past its limit of 8 s and was stopped"):
            run_sft(recipe, model_dir=model, host=probe_host(), timeout_s=8)
    finally:
        done.set()
        watcher.join()
    assert time.monotonic() - began < 90
    assert tree.markers, "LlamaFactory was never seen running"
    assert tree.wait_gone(timeout=0.5) == []  # gone when run_sft raised


# --------------------------------------------------------------------------- serving: detached only once ready

FAKE_LLAMAFACTORY = r'''#!{python}
# A stand-in `llamafactory-cli api`: /v1/models with the key; a child process; chat
# completions answered, or hung (FAKE_HANG_POST) to hold the start in its smoke test.
import http.server, json, os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "fake-server-child"])
print("fake server starting", flush=True)
time.sleep(float(os.environ.get("FAKE_DELAY", "0")))
key, model = os.environ["API_KEY"], os.environ["API_MODEL_NAME"]
class H(http.server.BaseHTTPRequestHandler):
    def _authorized(self):
        if self.headers.get("Authorization") != f"Bearer {{key}}":
            self.send_response(401); self.end_headers(); return False
        return True
    def _json(self, doc):
        body = json.dumps(doc).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        if self._authorized():
            self._json({{"object": "list", "data": [{{"id": model, "object": "model", "created": 0, "owned_by": "x"}}]}})
    def do_POST(self):
        if not self._authorized():
            return
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        print("smoke request received", flush=True)
        if os.environ.get("FAKE_HANG_POST"):
            time.sleep(600)
        self._json({{"id": "c", "object": "chat.completion", "created": 0, "model": model, "choices": [
            {{"index": 0, "message": {{"role": "assistant", "content": "hello"}}, "finish_reason": "stop"}}]}})
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer((os.environ["API_HOST"], int(os.environ["API_PORT"])), H).serve_forever()
'''

_SERVE_ORCHESTRATOR = """
import json, sys, time
from pathlib import Path
from ktflow.recipe import load_recipe
from ktflow.stages.serve import serve
recipe = load_recipe(Path(sys.argv[1]), json.loads(sys.argv[2]))
endpoint = serve(recipe, model_dir=Path(sys.argv[3]), adapter_dir=None, record_dir=Path(sys.argv[4]), api_key=sys.argv[5])
print("READY", endpoint.pid, flush=True)
time.sleep(600)
"""


def _serve_orchestrator(tmp_path: Path, model: Path, env: dict[str, str]) -> tuple[subprocess.Popen, Path, Path, int]:
    from ktflow.demo import write_demo_dataset

    bin_dir = tmp_path / "train-env" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(PY)
    cli = bin_dir / "llamafactory-cli"
    cli.write_text(FAKE_LLAMAFACTORY.format(python=PY))
    cli.chmod(0o755)
    train, evaluation = write_demo_dataset(tmp_path / "data")
    port = free_port()
    overrides = [f"source.local_path={model}", "source.format=bf16", f"dataset.files=[{train}]",
                 f"evaluation.files=[{evaluation}]", f"store.root={tmp_path / 'store'}",
                 f"toolchains.train.python={bin_dir / 'python'}", f"serving.port={port}", "serving.ready_timeout_s=600"]
    record, out = tmp_path / "record", tmp_path / "orchestrator.log"
    proc = _spawn([PY, "-c", _SERVE_ORCHESTRATOR, str(RECIPES / "tiny-demo.yaml"), json.dumps(overrides), str(model),
                   str(record), KEY], out, env)
    return proc, record, out, port


def _server_tree(record: Path, orchestrator: int) -> Tree:
    endpoint = read_endpoint(record)
    assert endpoint is not None and endpoint.pid and endpoint.run_id
    tree = Tree(orchestrator).snapshot()
    tree.add(endpoint.pid)
    tree.markers.add(endpoint.run_id)
    return tree


@pytest.mark.parametrize("phase", ["health-gate", "smoke-test"])
def test_a_server_whose_orchestrator_dies_before_it_is_ready_is_stopped(tmp_path: Path, fixture_dir,
                                                                         trees: list[Tree], phase: str) -> None:
    env = {"FAKE_DELAY": "600"} if phase == "health-gate" else {"FAKE_HANG_POST": "1"}
    proc, record, out, port = _serve_orchestrator(tmp_path, fixture_dir("bf16"), env)
    expected = "fake server starting" if phase == "health-gate" else "smoke request received"
    _wait_for(lambda: expected in ((record / "server.log").read_text() if (record / "server.log").exists() else ""),
              f"the server's {phase}", proc, timeout=120, log=out)
    tree = _server_tree(record, proc.pid)
    trees.append(tree)
    assert read_endpoint(record).state == "starting"
    assert len([p for p in tree.seen.values() if "fake-server-child" in p.cmdline()]) == 1
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert tree.wait_gone() == []
    from ktflow.stages.serve import port_is_free

    assert port_is_free("127.0.0.1", port)
    assert stop(record) is False  # the stale "starting" record is cleared, nothing was running


def test_a_ready_server_outlives_its_killed_orchestrator_until_stopped(tmp_path: Path, fixture_dir,
                                                                      trees: list[Tree]) -> None:
    import httpx

    proc, record, out, port = _serve_orchestrator(tmp_path, fixture_dir("bf16"), {})
    _wait_for(lambda: "READY" in out.read_text(), "the server to be ready", proc, timeout=120, log=out)
    tree = _server_tree(record, proc.pid)
    trees.append(tree)
    endpoint = read_endpoint(record)
    assert endpoint.state == "ready"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    time.sleep(3)  # the start's guardian was disarmed: nothing comes for the server
    assert psutil.Process(endpoint.pid).is_running()
    assert httpx.get(f"{endpoint.url}/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert stop(record, grace_s=5) is True
    assert tree.wait_gone() == []


# --------------------------------------------------------------------------- a Prefect flow

_FLOW = """
import os, sys, time
from prefect import flow, task
from ktflow.host.process import run_tool

timeout = float(os.environ["HYGIENE_TASK_TIMEOUT"]) if os.environ.get("HYGIENE_TASK_TIMEOUT") else None

@task(timeout_seconds=timeout)
def tool_task():
    run_tool([sys.executable, sys.argv[1]], grace_s=5, on_line=print)

@flow
def hygiene_flow():
    tool_task()

try:
    hygiene_flow()
except BaseException as exc:
    print("FLOW RAISED", type(exc).__name__, exc, flush=True)
    if not isinstance(exc, Exception):
        raise
print("FLOW DONE", flush=True)
time.sleep(600)  # alive: what the test then sees was cleaned in-process, not by our exit
"""


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prefect-home")  # shared: the ephemeral API's database is made once


@pytest.mark.slow
@pytest.mark.parametrize("how", ["task-timeout", "SIGTERM", "SIGKILL"])
def test_a_prefect_flow_timed_out_terminated_or_killed_leaves_no_tool_process(
        tmp_path: Path, prefect_home: Path, trees: list[Tree], how: str) -> None:
    """A flow on the ephemeral API runs a task that runs a tool tree (TREE_TOOL) through run_tool.
    task-timeout: the task's ``timeout_seconds`` passes; the tree must be gone while the flow's
    process lives on. SIGTERM: Prefect turns it into TerminationSignal in the flow. SIGKILL: a
    crash. Prefect's own processes (its temporary API server) are not ours to judge, but are
    killed at the end whatever happens."""
    script, tool, pidfile, log = tmp_path / "flow.py", tmp_path / "tool.py", tmp_path / "pids", tmp_path / "flow.log"
    script.write_text(_FLOW)
    tool.write_text(TREE_TOOL)
    env = {"PREFECT_HOME": str(prefect_home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_LOGGING_LEVEL": "WARNING", "HYGIENE_PIDFILE": str(pidfile), "PYTHONPATH": str(REPO)}
    if how == "task-timeout":
        env["HYGIENE_TASK_TIMEOUT"] = "6"  # from the task's start; the tool starts within a second
    proc = _spawn([PY, str(script), str(tool)], log, env)
    prefect = Tree(proc.pid)  # the flow's process and Prefect's own (its temporary API server)
    trees.append(prefect)
    try:
        pids = _wait_for(lambda: _pids(pidfile), "the flow's tool", proc, timeout=180, log=log)
        tool_tree = Tree(pids[0])  # the tool run: the tool, what it started, what carries its marker
        trees.append(tool_tree)
        for pid in pids:
            tool_tree.add(pid)
        tool_tree.snapshot()
        prefect.snapshot()
        assert len(tool_tree.markers) == 1
        if how == "task-timeout":
            _wait_for(lambda: "FLOW DONE" in log.read_text(), "the task to time out", proc, timeout=90, log=log)
            text = log.read_text()
            assert "FLOW RAISED" in text and "TimeoutError" in text, text[-3000:]
            assert proc.poll() is None  # still alive: the cleanup was run_tool's own
            assert tool_tree.wait_gone(timeout=1) == []
        else:
            code = _interrupt(proc, getattr(signal, how))
            assert code != 0
            if how == "SIGTERM":  # Prefect's SIGTERM bridge: the task and the flow run crash, in-process
                assert "Execution was aborted by a termination signal" in log.read_text(), log.read_text()[-3000:]
            assert tool_tree.wait_gone() == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
