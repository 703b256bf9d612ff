"""The sglang backend's lifecycle (start in the serving toolchain, key through the environment,
/health readiness, smoke test, stop) against a stand-in sglang package: sglang-kt itself needs GPUs."""

from __future__ import annotations

import json
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
        assert smoke_test(endpoint.url, key, "qwen3-30b-a3b:tuned")["content"] == "hello (adapter) nya~"
        assert key not in (record / "endpoint.json").read_text()
    finally:
        assert stop(record)
    assert not psutil.pid_exists(endpoint.pid) or psutil.Process(endpoint.pid).status() == psutil.STATUS_ZOMBIE


def _adapter(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path


def _server_argv(log: Path) -> list[str]:
    line = next(x for x in log.read_text().splitlines() if x.startswith("fake sglang argv: "))
    return json.loads(line.removeprefix("fake sglang argv: "))


def test_a_candidate_is_judged_beside_an_sglang_kt_production_in_servers_of_its_own(
        fixture_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sglang-kt loads one adapter at start-up: ``beside`` starts a second sglang-kt process for the candidate
    on a free port, and one without an adapter for the base model (sglang-kt refuses base requests on a server
    whose KT expert LoRA is loaded); production's process keeps serving, untouched, and both are stopped after."""
    import ktflow.resources
    from ktflow.demo import write_demo_dataset
    from ktflow.stages.evaluate import Candidate, evaluate_candidate

    key = "sglang-test-key-" + "x" * 16
    monkeypatch.setenv("KTFLOW_API_KEY", key)
    host = probe_host().model_copy(update={"gpus": [GpuInfo(index=0, name="test", vram_bytes=1 << 37)]})
    monkeypatch.setattr(ktflow.resources.hardware, "probe_host", lambda *a, **k: host)  # the servers' preflights
    write_demo_dataset(tmp_path / "data")
    port = free_port()
    recipe = load_recipe(REPO / "recipes" / "qwen3-30b-a3b-bf16.yaml", [
        f"serving.port={port}", f"store.root={tmp_path / 'store'}", f"toolchains.serve.python={sys.executable}",
        f"toolchains.serve.env.PYTHONPATH={FAKE}", "serving.ready_timeout_s=60", "serving.mem_fraction_static=0.3",
        f"dataset.files=[{tmp_path / 'data/train.jsonl'}]", "dataset.format=openai",
        f"evaluation.files=[{tmp_path / 'data/eval.jsonl'}]", "evaluation.format=openai",
        "evaluation.style={marker: 'nya~'}", "evaluation.gate_metric=style", "evaluation.gate_min_gain=50",
        "evaluation.candidate=beside"])
    model = fixture_dir("bf16")
    production_adapter, candidate_adapter = _adapter(tmp_path / "v1"), _adapter(tmp_path / "v2")
    record = tmp_path / "serving"
    production = serve(recipe, model_dir=model, adapter_dir=production_adapter, record_dir=record, kt_weight_dir=model,
                       host=host)
    out = tmp_path / "eval"
    try:
        result = evaluate_candidate(recipe, mode="beside", model_dir=model, serve_model_dir=model,
                                    candidate=Candidate(version=2, adapter_dir=candidate_adapter),
                                    production=production, production_version=1, api_key=key, out_dir=out,
                                    kt_weight_dir=model)
        assert psutil.Process(production.pid).is_running()  # the same process serves production throughout
        assert smoke_test(production.url, key, "qwen3-30b-a3b:tuned")["content"] == "hello (v1) nya~"
    finally:
        stop(record)
    assert result.candidate_mode == "beside" and result.candidate_version == 2 and result.production_version == 1
    assert result.tuned.model == "qwen3-30b-a3b:tuned" and result.tuned.url != production.url
    assert {p["prediction"] for p in result.tuned.predictions} == {"hello (v2) nya~"}
    assert {p["prediction"] for p in result.base.predictions} == {"hello"}
    assert {p["prediction"] for p in result.production.predictions} == {"hello (v1) nya~"}
    assert result.adapter_applied and result.promoted  # style 100 vs 0
    candidate_argv = _server_argv(out / "candidate-endpoint" / "server.log")
    base_argv = _server_argv(out / "base-endpoint" / "server.log")
    ports = {int(argv[argv.index("--port") + 1]) for argv in (candidate_argv, base_argv)} | {port}
    assert len(ports) == 3  # three servers, three ports
    assert candidate_argv[candidate_argv.index("--lora-paths") + 1] == f"tuned={candidate_adapter}"
    assert "--lora-paths" not in base_argv and "--enable-lora" not in base_argv  # the base model alone
    for argv in (candidate_argv, base_argv):  # each its own copy of the CPU experts, the same model as production
        assert argv[argv.index("--kt-weight-path") + 1] == str(model)
    for d in (out / "candidate-endpoint", out / "base-endpoint"):
        assert not (d / "endpoint.json").exists()  # stopped on the way out


def test_merged_mode_serves_the_merge_with_no_lora_flags_and_the_engines_levers(
        fixture_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``serving.mode: merged``: the serve stage merges the converted adapter into the weights first (the merge
    stage, cached in the store), starts the server on them with no LoRA flags and with the levers KT's LoRA path
    refuses (GPU experts, deferral), records the merge, and a swap merges the next adapter before the old server
    stops; a candidate's temporary server still takes KT's LoRA path."""
    from test_merge import make_converted_adapter

    import ktflow.resources
    from ktflow.stages.serve import read_endpoint, swap_adapter, temporary_server
    from ktflow.store import read_manifest

    key = "sglang-test-key-" + "x" * 16
    monkeypatch.setenv("KTFLOW_API_KEY", key)
    host = probe_host().model_copy(update={"gpus": [GpuInfo(index=0, name="test", vram_bytes=1 << 37)]})
    monkeypatch.setattr(ktflow.resources.hardware, "probe_host", lambda *a, **k: host)  # swap's and the candidate's
    recipe = load_recipe(REPO / "recipes" / "qwen3-30b-a3b-bf16.yaml", [
        f"serving.port={free_port()}", f"store.root={tmp_path / 'store'}", f"toolchains.serve.python={sys.executable}",
        f"toolchains.serve.env.PYTHONPATH={FAKE}", "serving.ready_timeout_s=60", "serving.mode=merged",
        "serving.kt_num_gpu_experts=2", "serving.kt_max_deferred_experts_per_token=1",
        "serving.disable_cuda_graph=false"])
    model = fixture_dir("bf16")
    first = make_converted_adapter(model, tmp_path / "v1", seed=1)
    second = make_converted_adapter(model, tmp_path / "v2", seed=2)
    record = tmp_path / "serving"
    endpoint = serve(recipe, model_dir=model, adapter_dir=first, record_dir=record, kt_weight_dir=model, host=host)
    try:
        argv = _server_argv(record / "server.log")
        merged = endpoint.merged_dir
        assert merged is not None and merged.parent == (tmp_path / "store" / "merged").absolute()
        assert read_manifest(merged).stage == "merge" and read_manifest(merged).settings["method"] == "BF16"
        assert argv[argv.index("--kt-weight-path") + 1] == str(merged)
        view = Path(argv[argv.index("--model-path") + 1])  # the fixture's transformers-saved config needs a view
        assert json.loads((view / "ktflow-model-view.json").read_text())["source"] == str(merged)
        assert "--enable-lora" not in argv and "--lora-paths" not in argv and "--disable-cuda-graph" not in argv
        assert argv[argv.index("--kt-num-gpu-experts") + 1] == "2"
        assert argv[argv.index("--kt-max-deferred-experts-per-token") + 1] == "1"
        # the merged model is the tuned one: clients ask for the served name, and the record names the adapter
        assert endpoint.model == "qwen3-30b-a3b" and endpoint.adapter_dir == first.absolute()
        assert smoke_test(endpoint.url, key, endpoint.model)["content"] == "hello"

        swapped = swap_adapter(recipe, model_dir=model, new_adapter_dir=second, record_dir=record, kt_weight_dir=model)
        assert swapped.merged_dir is not None and swapped.merged_dir != merged and merged.is_dir()
        assert swapped.previous is not None and swapped.previous.adapter_dir == first.absolute()
        assert read_endpoint(record) == swapped

        with temporary_server(recipe, model_dir=model, adapter_dir=second, api_key=key, record_dir=tmp_path / "cand",
                              what="candidate", log=None, kt_weight_dir=model) as candidate:
            cand_argv = _server_argv(tmp_path / "cand" / "server.log")
            assert candidate.merged_dir is None and candidate.model == "qwen3-30b-a3b:tuned"
            assert cand_argv[cand_argv.index("--lora-paths") + 1] == f"tuned={second.absolute()}"
            assert cand_argv[cand_argv.index("--kt-num-gpu-experts") + 1] == "0"
            assert "--kt-max-deferred-experts-per-token" not in cand_argv
    finally:
        stop(record)
