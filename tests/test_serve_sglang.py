"""The sglang backend's lifecycle (start in the serving toolchain, key through the environment,
/health readiness, smoke test, stop) against a stand-in sglang package: sglang-kt itself needs GPUs."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import psutil
import pytest

from ktflow.host.hardware import GpuInfo, probe_host
from ktflow.recipe import load_recipe
from ktflow.stages.serve import api_key_for, serve, smoke_test, stop

REPO = Path(__file__).resolve().parent.parent
FAKE = Path(__file__).resolve().parent / "fake_sglang"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sglang_backend_starts_gates_and_stops(fixture_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = "sglang-test-key-" + "x" * 16
    monkeypatch.setenv("KTFLOW_API_KEY", key)
    port = free_port()
    recipe = load_recipe(REPO / "recipes" / "qwen3-30b-a3b-bf16.yaml", [
        f"serving.port={port}", f"store.root={tmp_path / 'store'}", f"toolchains.serve.python={sys.executable}",
        f"toolchains.serve.env.PYTHONPATH={FAKE}", "serving.ready_timeout_s=60",
    ])
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    host = probe_host().model_copy(update={"gpus": [GpuInfo(index=0, name="test", vram_bytes=1 << 37)]})
    model = fixture_dir("bf16")
    record = tmp_path / "serving"
    endpoint = serve(recipe, model_dir=model, adapter_dir=adapter, record_dir=record, kt_weight_dir=model, host=host)
    try:
        assert endpoint.backend == "sglang" and endpoint.state == "ready"
        assert api_key_for(endpoint) == key
        proc = psutil.Process(endpoint.pid)
        assert all(key not in part for part in proc.cmdline())  # never on a command line
        assert "--kt-method" in proc.cmdline() and "BF16" in proc.cmdline()
        assert smoke_test(endpoint.url, key, "qwen3-30b-a3b:tuned")["content"] == "hello"
        assert key not in (record / "endpoint.json").read_text()
    finally:
        assert stop(record)
    assert not psutil.pid_exists(endpoint.pid) or psutil.Process(endpoint.pid).status() == psutil.STATUS_ZOMBIE
