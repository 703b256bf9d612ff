"""The serve stage (CPU backend): LlamaFactory's api as a managed process.

Fast tests drive :func:`start_server` with a scripted fake server. The slow ones are real: the
tiny bf16 fixture, a real LoRA adapter from the SFT stage (trained once for the module),
``llamafactory-cli api`` on 127.0.0.1 at free ports, requests through the ``openai`` client
and plain httpx. The real servers are module-scoped (each takes ~10 s to load) and the tests
that use them run in file order: ready and recorded, auth, soak, base-vs-tuned evaluation,
adapter swap with rollback, and stop (which takes the tuned server down).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml
from session_guard import started_here

from ktflow.errors import AdapterError, HostRequirementError, InvalidInputError, ServerStartError, SwapError
from ktflow.recipe import load_recipe
from ktflow.stages.serve import (
    ENDPOINT_FILE,
    SERVER_MARKER,
    Endpoint,
    api_key_for,
    free_port,
    port_is_open,
    read_endpoint,
    render_llamafactory_api,
    resolve_api_key,
    serve,
    smoke_test,
    start_server,
    stop,
    swap_adapter,
)

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"
needs_train_env = pytest.mark.skipif(not TRAIN_PYTHON.exists(), reason="training toolchain not installed (make train-env)")
KEY = "fast-test-key-0123456789"


def _recipe(root: Path, model: Path, *overrides: str):
    data = root / "data"
    if not (data / "train.jsonl").exists():
        from ktflow.demo import write_demo_dataset

        write_demo_dataset(data)
    return load_recipe(RECIPES / "tiny-demo.yaml", [
        f"source.local_path={model}", "source.format=bf16", f"dataset.files=[{data / 'train.jsonl'}]",
        f"evaluation.files=[{data / 'eval.jsonl'}]", f"store.root={root / 'store'}",
        f"toolchains.train.python={TRAIN_PYTHON}", "serving.ready_timeout_s=240", *overrides,
    ])


def _marked_processes() -> dict[int, str]:
    """Every process ktflow.stages.serve started for this test process (it carries the marker; the
    other pytest-xdist worker's servers, started meanwhile, are not this test's): pid -> marker."""
    found = {}
    for proc in psutil.process_iter():
        try:
            marker = proc.environ().get(SERVER_MARKER)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if marker and started_here(proc):
            found[proc.pid] = marker
    return found


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# --------------------------------------------------------------------------- rendering and keys


def test_render_binds_loopback_and_keeps_the_key_out(tmp_path: Path) -> None:
    recipe = load_recipe(RECIPES / "tiny-demo.yaml", ["serving.port=18001"])
    argv, env, infer = render_llamafactory_api(recipe, model_dir=tmp_path / "m", adapter_dir=tmp_path / "a",
                                               train_python=tmp_path / "env/bin/python", config_dir=tmp_path / "rec")
    assert argv == [str(tmp_path / "env/bin/llamafactory-cli"), "api", str(tmp_path / "rec/infer.yaml")]
    assert env["API_HOST"] == "127.0.0.1" and env["API_PORT"] == "18001"
    assert env["API_MODEL_NAME"] == "tiny-demo:tuned"
    assert "API_KEY" not in env and not any("key" in a.lower() for a in argv)
    assert infer == {"model_name_or_path": str(tmp_path / "m"), "trust_remote_code": True,
                     "infer_backend": "huggingface", "adapter_name_or_path": str(tmp_path / "a"),
                     "finetuning_type": "lora"}  # template 'empty' -> the tokenizer's own chat template

    named = load_recipe(RECIPES / "tiny-demo.yaml", ["sft.template=qwen"])
    _, env, infer = render_llamafactory_api(named, model_dir=tmp_path / "m", adapter_dir=None,
                                            train_python=tmp_path / "python", config_dir=tmp_path)
    assert infer["template"] == "qwen" and "adapter_name_or_path" not in infer and "finetuning_type" not in infer
    assert env["API_MODEL_NAME"] == "tiny-demo"  # the base model's name


def test_api_key_is_generated_once_0600_or_taken_from_the_env(tmp_path: Path, monkeypatch) -> None:
    recipe = load_recipe(RECIPES / "tiny-demo.yaml")
    monkeypatch.delenv("KTFLOW_API_KEY", raising=False)
    key, path = resolve_api_key(recipe, tmp_path)
    assert path == tmp_path / "api_key" and len(key) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert resolve_api_key(recipe, tmp_path) == (key, path)  # kept across restarts

    monkeypatch.setenv("KTFLOW_API_KEY", "from-the-environment-123")
    assert resolve_api_key(recipe, tmp_path / "other") == ("from-the-environment-123", None)
    assert not (tmp_path / "other" / "api_key").exists()

    monkeypatch.setenv("KTFLOW_API_KEY", "short")
    with pytest.raises(InvalidInputError, match="at least 16 characters"):
        resolve_api_key(recipe, tmp_path)
    monkeypatch.delenv("KTFLOW_API_KEY")
    path.chmod(0o644)
    with pytest.raises(InvalidInputError, match="readable by others"):
        resolve_api_key(recipe, tmp_path)


# --------------------------------------------------------------------------- start_server (fake server)

FAKE_SERVER = r'''
import http.server, json, os, subprocess, sys, time
if os.environ.get("FAKE_CHILD_PIDFILE"):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    open(os.environ["FAKE_CHILD_PIDFILE"], "w").write(str(child.pid))
print("fake server starting", flush=True)
if os.environ.get("FAKE_EXIT"):
    print("boom: cannot load the adapter", flush=True)
    sys.exit(3)
time.sleep(float(os.environ.get("FAKE_DELAY", "0")))
key = os.environ.get("API_KEY")
check = os.environ.get("FAKE_CHECK_AUTH", "1") == "1"
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if check and self.headers.get("Authorization") != f"Bearer {key}":
            self.send_response(401); self.end_headers(); return
        body = json.dumps({"data": [{"id": os.environ.get("API_MODEL_NAME", "m")}]}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(os.environ["API_PORT"])), H).serve_forever()
'''


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[dict[str, Any]]:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    port = free_port()
    env = {**os.environ, "API_PORT": str(port), "API_MODEL_NAME": "m"}
    started: list[int] = []
    yield {"argv": [sys.executable, str(script)], "env": env, "port": port, "started": started,
           "ready_url": f"http://127.0.0.1:{port}/v1/models", "log": tmp_path / "server.log", "tmp": tmp_path}
    for pid in started:  # whatever a failing test left
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


def _start(fake: dict[str, Any], timeout_s: float = 20, **kwargs: Any) -> subprocess.Popen:
    return start_server(fake["argv"], fake["env"], log_path=fake["log"], ready_url=fake["ready_url"], api_key=KEY,
                        timeout_s=timeout_s, on_started=lambda p: fake["started"].append(p.pid), **kwargs)


def test_start_server_waits_for_readiness_with_the_key(fake: dict[str, Any]) -> None:
    fake["env"]["FAKE_DELAY"] = "1.5"
    lines: list[str] = []
    began = time.monotonic()
    proc = _start(fake, expect_model="m", on_line=lines.append)
    try:
        assert time.monotonic() - began >= 1.5
        assert httpx.get(fake["ready_url"], headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert "fake server starting" in lines
        assert KEY not in fake["log"].read_text() and KEY not in " ".join(psutil.Process(proc.pid).cmdline())
    finally:
        proc.terminate()
        proc.wait()


def test_start_server_reports_an_early_exit_with_the_log_tail(fake: dict[str, Any]) -> None:
    fake["env"]["FAKE_EXIT"] = "1"
    with pytest.raises(ServerStartError, match=r"(?s)exited with status 3.*boom: cannot load the adapter"):
        _start(fake)
    assert all(_gone(pid) for pid in fake["started"])


def test_start_server_timeout_kills_the_whole_tree(fake: dict[str, Any]) -> None:
    pidfile = fake["tmp"] / "child.pid"
    fake["env"].update(FAKE_DELAY="60", FAKE_CHILD_PIDFILE=str(pidfile))
    with pytest.raises(ServerStartError, match="not ready within 3 s"):
        _start(fake, timeout_s=3, grace_s=5)
    child = int(pidfile.read_text())
    assert _gone(fake["started"][0]) and _gone(child)


def test_a_server_that_ignores_the_key_is_refused(fake: dict[str, Any]) -> None:
    fake["env"]["FAKE_CHECK_AUTH"] = "0"
    with pytest.raises(ServerStartError, match="without the API key"):
        _start(fake)
    assert _gone(fake["started"][0]) and not port_is_open("127.0.0.1", fake["port"])


def test_a_strangers_server_on_the_port_is_not_taken_for_ours(fake: dict[str, Any]) -> None:
    with pytest.raises(ServerStartError, match=r"lists \['m'\], not 'tiny-demo:tuned'"):
        _start(fake, timeout_s=3, expect_model="tiny-demo:tuned")


def test_killing_the_orchestrators_process_group_takes_the_server_down(fake: dict[str, Any]) -> None:
    """What a Prefect cancellation does: the server stays in the flow run's process group."""
    orchestrator = fake["tmp"] / "orchestrator.py"
    orchestrator.write_text(
        "import sys, time\nfrom pathlib import Path\nfrom ktflow.stages.serve import start_server\n"
        f"p = start_server({fake['argv']!r}, dict(__import__('os').environ), log_path=Path({str(fake['log'])!r}), "
        f"ready_url={fake['ready_url']!r}, api_key={KEY!r}, timeout_s=20)\n"
        "print(p.pid, flush=True)\ntime.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, str(orchestrator)], env=fake["env"], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        server_pid = int(proc.stdout.readline())
        fake["started"].append(server_pid)
        assert psutil.Process(server_pid).is_running()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not _gone(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(server_pid)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_refuses_a_busy_port_before_starting_anything(tmp_path: Path, fixture_dir) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        recipe = _recipe(tmp_path, fixture_dir("bf16"), f"serving.port={port}")
        before = set(_marked_processes())
        with pytest.raises(HostRequirementError, match=f"127.0.0.1:{port} is already in use"):
            serve(recipe, model_dir=fixture_dir("bf16"), adapter_dir=None, record_dir=tmp_path / "rec", api_key=KEY)
        assert set(_marked_processes()) == before
        assert not (tmp_path / "rec" / ENDPOINT_FILE).exists()


# --------------------------------------------------------------------------- real LlamaFactory servers


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, fixture_dir) -> Iterator[dict[str, Any]]:
    """A real adapter (SFT on the tiny bf16 fixture), the recipe, and a clean key environment."""
    if not TRAIN_PYTHON.exists():
        pytest.skip("training toolchain not installed (make train-env)")
    from ktflow.host.hardware import probe_host
    from ktflow.stages.sft import run_sft

    saved = os.environ.pop("KTFLOW_API_KEY", None)  # the tuned server generates its key
    root = tmp_path_factory.mktemp("serve")
    # The demo's learnable lm_head and its 400 steps: the tuned model answers differently from the base.
    model = fixture_dir("bf16", lm_head_std=0.2)
    recipe = _recipe(root, model, f"serving.port={free_port()}")
    adapter = run_sft(recipe, model_dir=model, host=probe_host()).adapter_dir
    yield {"root": root, "model": model, "recipe": recipe, "adapter": adapter, "record": root / "tuned"}
    if saved is not None:
        os.environ["KTFLOW_API_KEY"] = saved


@pytest.fixture(scope="module")
def tuned(stack: dict[str, Any]) -> Iterator[Endpoint]:
    endpoint = serve(stack["recipe"], model_dir=stack["model"], adapter_dir=stack["adapter"],
                     record_dir=stack["record"])
    yield endpoint
    stop(stack["record"])


@pytest.fixture(scope="module")
def base(stack: dict[str, Any], tuned: Endpoint) -> Iterator[Endpoint]:
    record = stack["root"] / "base"
    endpoint = serve(stack["recipe"], model_dir=stack["model"], adapter_dir=None, record_dir=record,
                     api_key=api_key_for(tuned), port=free_port())
    yield endpoint
    stop(record)


@needs_train_env
@pytest.mark.slow
def test_tuned_endpoint_is_ready_recorded_and_answers(stack: dict[str, Any], tuned: Endpoint) -> None:
    import openai

    record = stack["record"]
    key = (record / "api_key").read_text().strip()
    assert stat.S_IMODE((record / "api_key").stat().st_mode) == 0o600
    doc = json.loads((record / ENDPOINT_FILE).read_text())
    assert doc["state"] == "ready" and doc["pid"] == tuned.pid and doc["backend"] == "llamafactory"
    assert doc["url"] == f"http://127.0.0.1:{stack['recipe'].serving.port}/v1"
    assert doc["adapter_dir"] == str(stack["adapter"]) and doc["adapter_model_name"] == "tiny-demo:tuned"
    manifest = json.loads((stack["adapter"] / "manifest.json").read_text())
    assert manifest["stage"] == "sft" and len(doc["adapter_manifest_digest"]) == 64
    assert doc["previous"] is None
    # The key is in none of: the record, the log, the argv, the rendered config.
    for path in (record / ENDPOINT_FILE, record / "server.log", record / "infer.yaml"):
        assert key not in path.read_text(), path
    assert key not in " ".join(psutil.Process(tuned.pid).cmdline())
    infer = yaml.safe_load((record / "infer.yaml").read_text())
    assert infer["adapter_name_or_path"] == str(stack["adapter"])
    assert "Loaded adapter(s)" in (record / "server.log").read_text()  # merged at load

    client = openai.OpenAI(base_url=tuned.url, api_key=key, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-demo:tuned"]
    answer = client.chat.completions.create(model=tuned.model, messages=[{"role": "user", "content": "What is a shard?"}],
                                            temperature=0, max_tokens=8)
    assert answer.choices[0].message.role == "assistant" and isinstance(answer.choices[0].message.content, str)
    assert answer.usage.completion_tokens > 0
    assert smoke_test(tuned.url, key, tuned.model)["model"] == "tiny-demo:tuned"


@needs_train_env
@pytest.mark.slow
def test_a_second_checkout_with_port_auto_serves_beside_a_running_endpoint(stack: dict[str, Any],
                                                                           tuned: Endpoint) -> None:
    """Two checkouts of the demo on one host: the second one's endpoint takes a free port and
    records it, where a fixed port would collide; an explicit port keeps the clear refusal."""
    root = stack["root"]
    busy = int(tuned.url.rsplit(":", 1)[1].split("/")[0])
    fixed = _recipe(root, stack["model"], f"serving.port={busy}")
    with pytest.raises(HostRequirementError, match=f"127.0.0.1:{busy} is already in use"):
        serve(fixed, model_dir=stack["model"], adapter_dir=stack["adapter"], record_dir=root / "second-fixed",
              api_key=KEY)
    auto = _recipe(root, stack["model"], "serving.port=auto")
    lines: list[str] = []
    second = serve(auto, model_dir=stack["model"], adapter_dir=stack["adapter"], record_dir=root / "second",
                   api_key=KEY, log=lines.append)
    try:
        port = json.loads((root / "second" / ENDPOINT_FILE).read_text())["port"]
        assert port != busy and second.url == f"http://127.0.0.1:{port}/v1"
        assert f"serving.port is auto: serving on free port {port}" in lines
        assert smoke_test(second.url, KEY, second.model)["model"] == "tiny-demo:tuned"
        assert psutil.Process(tuned.pid).is_running()  # the first endpoint is untouched
    finally:
        stop(root / "second")


@needs_train_env
@pytest.mark.slow
def test_requests_without_or_with_a_wrong_key_are_refused(tuned: Endpoint) -> None:
    key = api_key_for(tuned)
    root = tuned.root_url
    chat = {"model": tuned.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789"}, {"Authorization": f"Basic {key}"},
                    {"Authorization": f"Bearer {key}x"}):
        assert httpx.get(f"{root}/v1/models", headers=headers).status_code == 401, headers
        assert httpx.post(f"{root}/v1/chat/completions", json=chat, headers=headers).status_code == 401, headers
    good = {"Authorization": f"Bearer {key}"}
    assert httpx.get(f"{root}/v1/models", headers=good).status_code == 200
    assert httpx.post(f"{root}/v1/chat/completions", json=chat, headers=good, timeout=60).status_code == 200


@needs_train_env
@pytest.mark.slow
def test_soak_lite_40_requests_4_at_a_time(tuned: Endpoint, capsys) -> None:
    import openai

    client = openai.OpenAI(base_url=tuned.url, api_key=api_key_for(tuned), max_retries=0, timeout=60)
    prompts = ["What is a shard?", "What does LoRA train?", "Why quantize experts to INT8?", "What is a router?"]

    def one(i: int) -> float:
        began = time.perf_counter()
        response = client.chat.completions.create(
            model=tuned.model, messages=[{"role": "user", "content": f"{prompts[i % 4]} ({i})"}], temperature=0,
            max_tokens=8)
        assert response.choices and isinstance(response.choices[0].message.content, str)
        return time.perf_counter() - began

    began = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        latencies = sorted(pool.map(one, range(40)))  # any error propagates here
    wall = time.perf_counter() - began
    p50, p95 = latencies[19], latencies[37]
    with capsys.disabled():
        print(f"\n[soak-lite] 40 requests, 4 concurrent, max_tokens 8: p50 {p50 * 1000:.0f} ms, "
              f"p95 {p95 * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms, {40 / wall:.1f} req/s")
    assert len(latencies) == 40 and p95 < 30
    assert tuned.pid == read_endpoint(Path(tuned.log_path).parent).pid and psutil.Process(tuned.pid).is_running()


@needs_train_env
@pytest.mark.slow
def test_base_vs_tuned_evaluation_and_the_adapter_check(stack: dict[str, Any], tuned: Endpoint,
                                                        base: Endpoint) -> None:
    from rouge_score import rouge_scorer
    from sacrebleu.metrics import BLEU

    from ktflow.stages.evaluate import evaluate_base_vs_tuned

    recipe, key = stack["recipe"], api_key_for(tuned)
    result = evaluate_base_vs_tuned(recipe, model_dir=stack["model"], tuned_url=tuned.url, tuned_model=tuned.model,
                                    api_key=key, out_dir=stack["root"] / "eval", base_url=base.url,
                                    base_model=base.model)
    assert result.adapter_applied is True
    # Promotion follows the recipe's rule on the reported figures (the demo's: +50 points of
    # "nya~" answers on prompts the training data does not hold), whatever the model scored.
    assert result.contamination.clean and result.contamination.eval_prompts == 8
    gain = result.tuned.metrics["style"] - result.base.metrics["style"]
    assert result.gate_metric == "style" and result.promoted is (gain >= 50)
    assert result.tuned.metrics["style"] == 100 * sum("nya~" in p["prediction"] for p in result.tuned.predictions) / 8
    assert any(p["differs"] for p in result.probes) and len(result.probes) == 8
    assert result.table.splitlines()[0] == "| metric | base | tuned | delta |"
    assert {line.split(" | ")[0].strip("| ") for line in result.table.splitlines()[2:]} == {
        "bleu-1", "bleu-2", "bleu-3", "bleu-4", "rouge-1", "rouge-2", "rouge-l", "style ('nya~')"}
    assert result.tuned.n == result.base.n == 8 and result.tuned.model == "tiny-demo:tuned"
    assert "Adapter applied: **yes**" in result.report_md.read_text()
    assert json.loads(result.report_json.read_text())["adapter_applied"] is True
    # The metrics are those sacrebleu / rouge-score give on the same predictions.
    hyps = [p["prediction"].strip() for p in result.tuned.predictions]
    refs = [p["reference"] for p in result.tuned.predictions]
    assert result.tuned.metrics["bleu-4"] == pytest.approx(BLEU().corpus_score(hyps, [refs]).score)
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    assert result.tuned.metrics["rouge-l"] == pytest.approx(
        100 * sum(scorer.score(r, h)["rougeL"].fmeasure for h, r in zip(hyps, refs)) / len(refs))

    # Adapter withheld: the "tuned" endpoint is a base server. The check must fail, and the
    # stage's own temporary base server (a second process) must be gone afterwards.
    before = set(_marked_processes())
    withheld = evaluate_base_vs_tuned(recipe, model_dir=stack["model"], tuned_url=base.url, tuned_model=base.model,
                                      api_key=key, out_dir=stack["root"] / "eval-withheld")
    assert withheld.adapter_applied is False and withheld.promoted is False
    assert not any(p["differs"] for p in withheld.probes)
    assert withheld.base.url != base.url  # it really was another server
    assert set(_marked_processes()) == before
    port = int(withheld.base.url.rsplit(":", 1)[1].split("/")[0])
    assert not port_is_open("127.0.0.1", port)
    assert "Adapter applied: **NO**" in withheld.report_md.read_text()


def _variant(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "manifest.json").unlink()
    return dst


@needs_train_env
@pytest.mark.slow
def test_swap_adapter_and_roll_back_a_broken_one(stack: dict[str, Any], tuned: Endpoint) -> None:
    from safetensors.torch import load_file, save_file

    recipe, model, record = stack["recipe"], stack["model"], stack["record"]
    key = api_key_for(tuned)
    first = read_endpoint(record)
    assert first is not None and first.adapter_dir == stack["adapter"]

    # A good second adapter: the same LoRA with B scaled (a different, valid adapter).
    second = _variant(stack["adapter"], stack["root"] / "adapter-v2")
    tensors = load_file(second / "adapter_model.safetensors")
    save_file({k: (v * 3 if "lora_B" in k else v).contiguous() for k, v in tensors.items()},
              second / "adapter_model.safetensors")
    swapped = swap_adapter(recipe, model_dir=model, new_adapter_dir=second, record_dir=record)
    assert swapped.adapter_dir == second and swapped.pid != first.pid and _gone(first.pid)
    assert swapped.previous is not None and swapped.previous.adapter_dir == stack["adapter"]
    assert read_endpoint(record) == swapped
    assert swapped.url == first.url  # same port: clients need no change
    smoke_test(swapped.url, key, swapped.model)

    # Wrong rank in adapter_config.json: refused by validation; the serving process is untouched.
    wrong_rank = _variant(stack["adapter"], stack["root"] / "adapter-wrong-rank")
    config = json.loads((wrong_rank / "adapter_config.json").read_text())
    (wrong_rank / "adapter_config.json").write_text(json.dumps({**config, "r": config["r"] // 2}))
    with pytest.raises(AdapterError, match=rf"rank {config['r']}, but adapter_config.json says r={config['r'] // 2}"):
        swap_adapter(recipe, model_dir=model, new_adapter_dir=wrong_rank, record_dir=record)
    assert read_endpoint(record) == swapped and psutil.Process(swapped.pid).is_running()

    # Truncated weights, validation skipped: the server fails to load them, and the previous
    # adapter is restarted on the same port and serves again.
    truncated = _variant(stack["adapter"], stack["root"] / "adapter-truncated")
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(AdapterError, match="truncated"):
        swap_adapter(recipe, model_dir=model, new_adapter_dir=truncated, record_dir=record)
    assert read_endpoint(record) == swapped
    markers_before = set(_marked_processes())
    with pytest.raises(SwapError, match=r"(?s)rolled back.*incomplete metadata") as caught:
        swap_adapter(recipe, model_dir=model, new_adapter_dir=truncated, record_dir=record, validate=False)
    assert caught.value.rolled_back is True
    restored = read_endpoint(record)
    assert restored is not None and restored.state == "ready"
    assert restored.adapter_dir == second and restored.pid != swapped.pid and _gone(swapped.pid)
    assert restored.previous is not None and restored.previous.adapter_dir == stack["adapter"]
    assert restored.last_failed_swap is not None and restored.last_failed_swap.adapter_dir == truncated
    assert restored.url == swapped.url
    assert smoke_test(restored.url, key, restored.model)["model"] == "tiny-demo:tuned"
    # The failed server left nothing: the only new marked process is the restored server.
    assert set(_marked_processes()) - markers_before == {restored.pid}
    log = (record / "server.log").read_text()
    assert f"adapter {truncated} at" in log and "SafetensorError" in log


@needs_train_env
@pytest.mark.slow
def test_stop_leaves_no_process_behind(stack: dict[str, Any], tuned: Endpoint) -> None:
    record = stack["record"]
    endpoint = read_endpoint(record)
    assert endpoint is not None and psutil.Process(endpoint.pid).is_running()
    port = endpoint.port
    me = psutil.Process(os.getpid())
    assert endpoint.pid in {c.pid for c in me.children(recursive=True)}

    assert stop(record) is True
    assert _gone(endpoint.pid) and not psutil.pid_exists(endpoint.pid)
    assert endpoint.pid not in {c.pid for c in me.children(recursive=True)}
    assert endpoint.run_id not in _marked_processes().values()
    assert not port_is_open("127.0.0.1", port)
    assert not (record / ENDPOINT_FILE).exists() and (record / "api_key").exists()
    assert stop(record) is False  # idempotent
