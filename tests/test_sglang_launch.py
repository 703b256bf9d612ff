"""The sglang-kt launch: every rule ktflow refuses before a launch, the API key kept out of argv,
and (slow) every shipped sglang recipe's command line parsed by sglang-kt 0.7.2's own parser, in the serving
toolchain as `make serve-env` installs it (sglang-kt with every dependency of its server), or in the one
KTFLOW_SERVE_PYTHON names."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from ktflow.errors import AdapterError, HostRequirementError, InvalidInputError, RecipeError
from ktflow.host.hardware import GpuInfo, HostInfo, NumaNode
from ktflow.recipe import OWNED_FLAGS, Recipe, ServingMethod, load_recipe
from ktflow.stages.serve.sglang.launch import SglangLaunch, launcher_code, render_sglang_launch
from ktflow.store import StageManifest

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
SERVE_PYTHON = Path(os.environ.get("KTFLOW_SERVE_PYTHON") or REPO / ".venv-serve" / "bin" / "python")
SGLANG_RECIPES = [
    "kimi-k2.5-rawint4.yaml", "kimi-k2.5-bf16-int8.yaml", "deepseek-v3-fp8.yaml", "qwen3-30b-a3b-bf16.yaml",
    "deepseek-v2-lite-bf16.yaml",
]
SENTINEL = "--sk-SENTINEL-do-not-leak-7f3a9c"  # leading dashes: must still parse as one --api-key value


def fake_host(*, cores: int = 128, gpus: int = 8, numa: int = 2) -> HostInfo:
    per = cores // numa
    return HostInfo(
        hostname="serve-host", cpu_model="test", cpu_flags=[], cpu_variant="amx", cpu_variant_overridden=False,
        logical_cores=cores * 2, physical_cores=cores, numa_nodes=numa,
        numa=[NumaNode(id=i, cpus=list(range(i * per, (i + 1) * per)), mem_total_bytes=1 << 40,
                       mem_free_bytes=1 << 40) for i in range(numa)],
        ram_bytes=numa << 40, ram_available_bytes=numa << 40,
        gpus=[GpuInfo(index=i, name="H200", vram_bytes=141 << 30) for i in range(gpus)],
        disk_path="/", disk_free_bytes=1 << 42, shm_bytes=1 << 38, shm_free_bytes=1 << 38,
    )


def int8_dir(root: Path, t: int, *, method: str = "AMXINT8") -> Path:
    """A stand-in for a quantize-int8 output: what the renderer reads is its manifest."""
    out = root / f"int8-t{t}-{method}"
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    manifest = StageManifest(stage="quantize-int8", settings={"method": method, "threadpool_count": t,
                                                               "kt_kernel": "0.7.2"})
    (out / "manifest.json").write_text(manifest.model_dump_json())
    return out


@pytest.fixture
def adapter(tmp_path: Path) -> Path:
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (out / "adapter_model.safetensors").write_bytes(b"")
    return out


@pytest.fixture
def weights(fixture_dir: Callable[..., Path], tmp_path: Path) -> Callable[[Recipe], tuple[Path, Path]]:
    """(model_dir, kt_weight_dir) a recipe's serving method expects, from tiny fixtures."""

    def get(recipe: Recipe) -> tuple[Path, Path]:
        method = recipe.serving.kt_method
        if method == "RAWINT4":
            d = fixture_dir(recipe.source.format.removesuffix("-int4"))
            return d, d
        if method == "FP8":
            d = fixture_dir("deepseek-v3")
            return d, d
        if method == "AMXINT8":
            return fixture_dir("bf16"), int8_dir(tmp_path / "w", recipe.serving.kt_threadpool_count)
        return fixture_dir("bf16"), fixture_dir("bf16")

    return get


def render(recipe: Recipe, weights: Callable, adapter: Path, **kw) -> SglangLaunch:
    model_dir, kt_dir = weights(recipe)
    kw.setdefault("host", fake_host())
    kw.setdefault("serve_python", SERVE_PYTHON)
    kw.setdefault("model_dir", model_dir)
    kw.setdefault("kt_weight_dir", kt_dir)
    return render_sglang_launch(recipe, adapter_dir=adapter, **kw)


def recipe(name: str, *overrides: str) -> Recipe:
    return load_recipe(RECIPES / name, overrides)


def test_sglang_recipe_list_is_every_shipped_sglang_recipe() -> None:
    shipped = sorted(p.name for p in RECIPES.glob("*.yaml")
                     if yaml.safe_load(p.read_text())["serving"]["backend"] == "sglang")
    assert shipped == sorted(SGLANG_RECIPES)


# --------------------------------------------------------------------------- the command line


def test_rawint4_command_line(weights, adapter: Path) -> None:
    r = recipe("kimi-k2.5-rawint4.yaml")
    model_dir, _ = weights(r)
    launch = render(r, weights, adapter)
    assert launch.argv[0] == str(SERVE_PYTHON) and launch.argv[1] == "-c"
    assert launch.argv[2] == launcher_code("KTFLOW_API_KEY")
    assert launch.launch_args == [
        "--model-path", str(model_dir), "--kt-weight-path", str(model_dir), "--kt-method", "RAWINT4",
        "--kt-cpuinfer", "126", "--kt-threadpool-count", "2", "--kt-num-gpu-experts", "0",
        "--tensor-parallel-size", "1", "--host", "127.0.0.1", "--port", "30000",
        "--served-model-name", "kimi-k2.5", "--enable-lora", "--lora-backend", "triton",
        "--lora-paths", f"tuned={adapter}", "--max-running-requests", "4", "--disable-cuda-graph",
        "--context-length", "2048", "--chunked-prefill-size", "256", "--mem-fraction-static", "0.75",
        "--attention-backend", "triton", "--dtype", "bfloat16", "--disable-radix-cache",
    ]
    assert launch.int8_threadpool_count is None
    assert launch.api_key_env == "KTFLOW_API_KEY"
    # sglang-kt reads the checkpoint's own config.json only with this (the rendered launch, so --dry-run shows it)
    assert launch.env == {"PYTHONUNBUFFERED": "1", "SGLANG_APPLY_CONFIG_BACKUP": "none"}


def test_amxbf16_is_served_as_bf16_by_a_server_without_an_expert_lora(weights, tmp_path: Path) -> None:
    """kt-kernel's inference wrapper (no expert LoRA: the base model's server, an adapter without its expert
    part) refuses AMXBF16 and takes BF16; with an expert LoRA sglang-kt maps either name to AMXBF16_SFT."""
    from safetensors.numpy import save_file

    r = recipe("qwen3-30b-a3b-bf16.yaml", "serving.kt_method=AMXBF16")

    def adapter_with(*names: str) -> Path:
        out = tmp_path / f"adapter-{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
        save_file({n: np.zeros((8, 16), np.float32) for n in names}, str(out / "adapter_model.safetensors"))
        return out

    def method(adapter_dir: Path | None) -> str:
        args = render(r, weights, adapter_dir).launch_args
        return args[args.index("--kt-method") + 1]

    expert = "base_model.model.model.layers.1.mlp.experts.0.gate_proj.lora_A.weight"
    attention = "base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"
    assert method(adapter_with(expert, attention)) == "AMXBF16"
    assert method(adapter_with(attention)) == "BF16"
    assert method(None) == "BF16"
    assert "--enable-lora" not in render(r, weights, None).launch_args
    dry_run = render(r, weights, tmp_path / "not-written-yet", check_files=False).launch_args
    assert dry_run[dry_run.index("--kt-method") + 1] == "AMXBF16"  # a KT SFT adapter carries its expert LoRA
    r = recipe("qwen3-30b-a3b-bf16.yaml")  # kt_method BF16: the name both paths take
    assert method(adapter_with(expert, attention)) == method(None) == "BF16"


def test_kt_cpuinfer_set_in_the_recipe_and_extra_args_last(weights, adapter: Path, tmp_path: Path) -> None:
    r = recipe("qwen3-30b-a3b-bf16.yaml", "serving.kt_cpuinfer=48",
               "serving.extra_args=['--kt-numa-nodes', '0', '--log-level', 'debug']")
    launch = render(r, weights, adapter, lora_cache_dir=tmp_path / "lora-cache")
    args = launch.launch_args
    assert args[args.index("--kt-cpuinfer") + 1] == "48"
    assert args[-4:] == ["--kt-numa-nodes", "0", "--log-level", "debug"]
    assert "--disable-cuda-graph" in args  # KT's LoRA path, whatever the recipe says
    assert "--disable-radix-cache" not in args
    assert launch.env["SGLANG_KT_LORA_CACHE_DIR"] == str(tmp_path / "lora-cache")


def test_amxint8_result_carries_the_quantized_threadpool_count(weights, adapter: Path) -> None:
    launch = render(recipe("kimi-k2.5-bf16-int8.yaml"), weights, adapter)
    assert launch.int8_threadpool_count == 2
    args = launch.launch_args
    assert args[args.index("--kt-method") + 1] == "AMXINT8"
    assert args[args.index("--kt-threadpool-count") + 1] == "2"


# --------------------------------------------------------------------------- refusals


def test_amxint8_weights_quantized_with_another_threadpool_count(weights, adapter: Path, tmp_path: Path) -> None:
    r = recipe("kimi-k2.5-bf16-int8.yaml")  # serves with T=2
    with pytest.raises(InvalidInputError, match=r"serving\.kt_threadpool_count.*quantized with threadpool_count 1"):
        render(r, weights, adapter, kt_weight_dir=int8_dir(tmp_path, 1))


def test_amxint8_needs_a_quantize_int8_output(weights, adapter: Path, fixture_dir) -> None:
    with pytest.raises(InvalidInputError, match=r"kt_weight_dir .* is not a quantize-int8 output.*AMXINT8"):
        render(recipe("kimi-k2.5-bf16-int8.yaml"), weights, adapter, kt_weight_dir=fixture_dir("bf16"))


def test_amxint8_manifest_without_threadpool_count(weights, adapter: Path, tmp_path: Path) -> None:
    d = int8_dir(tmp_path, 2)
    manifest = StageManifest.model_validate_json((d / "manifest.json").read_text())
    manifest.settings.pop("threadpool_count")
    (d / "manifest.json").write_text(manifest.model_dump_json())
    with pytest.raises(InvalidInputError, match=r"settings\.threadpool_count"):
        render(recipe("kimi-k2.5-bf16-int8.yaml"), weights, adapter, kt_weight_dir=d)


def test_kt_cpuinfer_above_physical_cores(weights, adapter: Path) -> None:
    r = recipe("kimi-k2.5-rawint4.yaml", "serving.kt_cpuinfer=129")
    with pytest.raises(HostRequirementError, match=r"serving\.kt_cpuinfer: is 129.*128 physical cores"):
        render(r, weights, adapter)
    # unset, it is the host's physical cores less the 2 sglang's own processes keep (at least half), which always fits
    for cores, threads in ((96, "94"), (4, "2"), (2, "1"), (1, "1")):  # one pool: at least 1 thread
        r = recipe("kimi-k2.5-rawint4.yaml", "serving.kt_threadpool_count=1")
        launch = render(r, weights, adapter, host=fake_host(cores=cores))
        assert launch.launch_args[launch.launch_args.index("--kt-cpuinfer") + 1] == threads
    # two pools on a 2-core host: a thread each, not fewer
    launch = render(recipe("kimi-k2.5-rawint4.yaml", "serving.kt_threadpool_count=2"), weights, adapter,
                    host=fake_host(cores=2))
    assert launch.launch_args[launch.launch_args.index("--kt-cpuinfer") + 1] == "2"


def test_kt_cpuinfer_below_threadpool_count(weights, adapter: Path) -> None:
    with pytest.raises(InvalidInputError, match=r"serving\.kt_cpuinfer: is 1, below serving\.kt_threadpool_count 2"):
        render(recipe("kimi-k2.5-rawint4.yaml", "serving.kt_cpuinfer=1"), weights, adapter)


def test_tensor_parallel_larger_than_the_hosts_gpus(weights, adapter: Path) -> None:
    r = recipe("kimi-k2.5-rawint4.yaml", "serving.gpus=4")
    with pytest.raises(HostRequirementError, match=r"serving\.gpus: asks for tensor parallel size 4.*3 GPU"):
        render(r, weights, adapter, host=fake_host(gpus=3))


@pytest.mark.parametrize("kind", ["bf16", "deepseek-v3", "kimi-k2"])
def test_rawint4_needs_the_original_int4_checkpoint(weights, adapter: Path, fixture_dir, kind: str) -> None:
    # kimi-k2 is INT4 too, but not the recipe's kimi-k2.5 source
    with pytest.raises(InvalidInputError, match=r"kt_weight_dir .* checkpoint, but serving\.kt_method RAWINT4 reads "
                                                r"kimi-k2\.5-int4"):
        render(recipe("kimi-k2.5-rawint4.yaml"), weights, adapter, kt_weight_dir=fixture_dir(kind))


def test_fp8_needs_the_original_fp8_checkpoint(weights, adapter: Path, fixture_dir) -> None:
    with pytest.raises(InvalidInputError, match=r"is a bf16 checkpoint, but serving\.kt_method FP8"):
        render(recipe("deepseek-v3-fp8.yaml"), weights, adapter, kt_weight_dir=fixture_dir("bf16"))


def test_bf16_method_refuses_int8_weights(weights, adapter: Path, tmp_path: Path) -> None:
    # inspect_checkpoint alone would call an INT8 output "bf16" (no quantization_config): the manifest decides
    with pytest.raises(InvalidInputError, match=r"is a quantize-int8 output, but serving\.kt_method BF16"):
        render(recipe("qwen3-30b-a3b-bf16.yaml"), weights, adapter, kt_weight_dir=int8_dir(tmp_path, 1))


def test_bf16_method_refuses_a_quantized_checkpoint(weights, adapter: Path, fixture_dir) -> None:
    with pytest.raises(InvalidInputError, match=r"is a kimi-k2\.5-int4 checkpoint, but serving\.kt_method BF16"):
        render(recipe("qwen3-30b-a3b-bf16.yaml"), weights, adapter, kt_weight_dir=fixture_dir("kimi-k2.5"))


def test_int8_output_as_the_model_dir(weights, adapter: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match=r"model_dir .* is a quantize-int8 output"):
        render(recipe("kimi-k2.5-bf16-int8.yaml"), weights, adapter, model_dir=int8_dir(tmp_path, 2))


def test_raw_kt_training_adapter_is_refused(weights, adapter: Path) -> None:
    (adapter / "fused_expert_lora.safetensors").write_bytes(b"")
    with pytest.raises(AdapterError, match=r"raw KT training adapter.*convert-lora"):
        render(recipe("kimi-k2.5-rawint4.yaml"), weights, adapter)


def test_a_recipe_changed_after_loading_keeps_the_kt_lora_rules() -> None:
    """The launch relies on the recipe's rules: a recipe cannot be changed around them after it was loaded."""
    r = recipe("kimi-k2.5-rawint4.yaml", "serving.mode=lora")
    with pytest.raises(ValidationError, match="frozen"):
        r.serving.max_running_requests = 1
    with pytest.raises(ValidationError, match=r"max_running_requests: must be >= 2 for KT LoRA serving"):
        r.model_copy(update={"serving": r.serving.model_copy(update={"max_running_requests": 4})
                             .model_copy(update={"max_running_requests": 1})})
    with pytest.raises(ValidationError, match=r"kt_num_gpu_experts: must be 0"):
        r.serving.model_copy(update={"kt_num_gpu_experts": 2})


@pytest.mark.parametrize("extra, owned", [
    (["--api-key", "secret"], "--api-key"),
    (["--api-key=secret"], "--api-key"),
    (["--port", "1"], "--port"),
    (["--kt-thread", "4"], "--kt-threadpool-count"),  # argparse would take the prefix
    (["--tp", "8"], "--tp-size"),
    (["--lora-paths", "other=/x"], "--lora-paths"),
    (["--kt-gpu-experts-ratio", "0.1"], "--kt-gpu-experts-ratio"),
    (["--config", "/tmp/x.yaml"], "--config"),
    (["--max-total-tokens", "8192"], "--max-total-tokens"),
    (["-h"], "-h"),
])
def test_extra_args_may_not_set_owned_flags(extra: list[str], owned: str) -> None:
    with pytest.raises(RecipeError, match=rf"serving\.extra_args: {re.escape(extra[0])}") as info:
        recipe("kimi-k2.5-rawint4.yaml", f"serving.extra_args={json.dumps(extra)}")
    assert OWNED_FLAGS[owned] in str(info.value)
    assert owned == extra[0].split("=")[0] or f"abbreviates {owned}" in str(info.value)
    r = recipe("kimi-k2.5-rawint4.yaml")
    with pytest.raises(ValidationError, match="a flag ktflow sets or refuses"):  # a change after loading too
        r.serving.model_copy(update={"extra_args": extra})


# --------------------------------------------------------------------------- the API key


def test_api_key_is_never_in_argv_env_or_repr(weights, adapter: Path, monkeypatch) -> None:
    monkeypatch.setenv("KTFLOW_API_KEY", SENTINEL)
    for name in SGLANG_RECIPES:
        launch = render(recipe(name), weights, adapter)
        for text in (" ".join(launch.argv), repr(launch), str(launch), launch.model_dump_json(),
                     json.dumps(launch.env)):
            assert SENTINEL not in text and "sk-SENTINEL" not in text
        assert "--api-key" not in launch.launch_args
        assert launch.api_key_env == "KTFLOW_API_KEY"  # the variable's name is all the launch holds


def test_api_key_variable_name_follows_the_recipe(weights, adapter: Path) -> None:
    launch = render(recipe("kimi-k2.5-rawint4.yaml", "serving.api_key_env=MY_SERVE_KEY"), weights, adapter)
    assert "os.environ.pop('MY_SERVE_KEY'" in launch.argv[2]
    assert launch.api_key_env == "MY_SERVE_KEY"


def test_no_key_on_a_network_address_is_refused(weights, adapter: Path) -> None:
    r = recipe("kimi-k2.5-rawint4.yaml", "serving.host=0.0.0.0")
    with pytest.raises(HostRequirementError, match=r"serving\.api_key_env \(KTFLOW_API_KEY\).*0\.0\.0\.0"):
        render(r, weights, adapter, api_key_env_present=False)


def test_no_key_on_loopback_serves_without_one(weights, adapter: Path) -> None:
    launch = render(recipe("kimi-k2.5-rawint4.yaml"), weights, adapter, api_key_env_present=False)
    assert launch.argv[1:3] == ["-m", "sglang.launch_server"]
    assert launch.api_key_env is None


def test_key_variable_in_the_recipes_toolchain_env_is_refused(weights, adapter: Path) -> None:
    r = recipe("kimi-k2.5-rawint4.yaml", "toolchains.serve.env.KTFLOW_API_KEY=oops")
    with pytest.raises(InvalidInputError, match=r"toolchains\.serve\.env\.KTFLOW_API_KEY"):
        render(r, weights, adapter)


# --------------------------------------------------------------------------- sglang-kt's own parser (slow)

# Runs in the serving toolchain: parse each argv with sglang-kt's ServerArgs parser, exactly as
# prepare_server_args does (minus ServerArgs(...), whose __post_init__ needs a GPU).
_PARSE = r"""
import argparse, contextlib, io, json, sys
from sglang.srt.server_args import ServerArgs
def parser():
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return p
results = []
for argv in json.loads(sys.stdin.read()):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser().parse_args(argv)
        results.append({"ok": True, "ns": vars(ns)})
    except SystemExit as exc:
        results.append({"ok": False, "code": exc.code, "stderr": err.getvalue()[-1500:]})
options = sorted({s for a in parser()._actions for s in a.option_strings})
print("RESULTS " + json.dumps({"results": results, "options": options}, default=str))
"""


@pytest.fixture(scope="module")
def sglang_kt() -> None:
    """Skip unless sglang-kt imports in the serving toolchain (checked once, lazily: ~5 s)."""
    ok = SERVE_PYTHON.exists() and subprocess.run(
        [str(SERVE_PYTHON), "-c", "import sglang.srt.server_args"], capture_output=True, timeout=300).returncode == 0
    if not ok:
        pytest.skip(f"sglang-kt not importable in {SERVE_PYTHON} (make serve-env)")


def parse_with_sglang(argvs: list[list[str]]) -> dict:
    done = subprocess.run([str(SERVE_PYTHON), "-c", _PARSE], input=json.dumps(argvs), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


@pytest.fixture(scope="module")
def parsed(sglang_kt, fixture_dir, tmp_path_factory) -> dict:
    """Every shipped sglang recipe rendered and parsed in one sglang-kt process (its import takes ~5 s)."""
    root = tmp_path_factory.mktemp("sglang-parse")
    adapter_dir = root / "adapter"
    adapter_dir.mkdir()
    (adapter_dir / "adapter_config.json").write_text("{}")
    (adapter_dir / "adapter_model.safetensors").write_bytes(b"")
    launches, expected = {}, {}
    for name in SGLANG_RECIPES:
        r = recipe(name)
        method = r.serving.kt_method
        if method == "RAWINT4":
            model_dir = kt_dir = fixture_dir("kimi-k2.5")
        elif method == "FP8":
            model_dir = kt_dir = fixture_dir("deepseek-v3")
        elif method == "AMXINT8":
            model_dir, kt_dir = fixture_dir("bf16"), int8_dir(root / name, r.serving.kt_threadpool_count)
        else:
            model_dir = kt_dir = fixture_dir("bf16")
        launches[name] = render_sglang_launch(r, model_dir=model_dir, kt_weight_dir=kt_dir, adapter_dir=adapter_dir,
                                              serve_python=SERVE_PYTHON, host=fake_host())
        expected[name] = (r, model_dir, kt_dir, adapter_dir)
    base = launches["kimi-k2.5-rawint4.yaml"].launch_args
    bounded = render_sglang_launch(recipe("kimi-k2.5-rawint4.yaml", "serving.max_total_tokens=65536"),
                                   model_dir=fixture_dir("kimi-k2.5"), kt_weight_dir=fixture_dir("kimi-k2.5"),
                                   adapter_dir=adapter_dir, serve_python=SERVE_PYTHON, host=fake_host()).launch_args
    argvs = [launches[n].launch_args for n in SGLANG_RECIPES]
    argvs.append(base + ["--kt-no-such-flag", "1"])  # must fail: proves the check can fail
    argvs.append(base + ["--kt-thread", "4"])  # argparse abbreviations: why extra_args are checked
    argvs.append(bounded)
    out = parse_with_sglang(argvs)
    return {"launches": launches, "expected": expected, "results": dict(zip(SGLANG_RECIPES, out["results"])),
            "unknown": out["results"][-3], "abbrev": out["results"][-2], "bounded": out["results"][-1],
            "options": out["options"]}


@pytest.mark.slow
@pytest.mark.parametrize("name", SGLANG_RECIPES)
def test_shipped_recipe_parses_with_sglang_kt(parsed: dict, name: str) -> None:
    result = parsed["results"][name]
    assert result["ok"], result
    ns = result["ns"]
    r, model_dir, kt_dir, adapter_dir = parsed["expected"][name]
    s = r.serving
    assert ns["model_path"] == str(model_dir)
    assert ns["kt_method"] == s.kt_method
    assert ns["kt_weight_path"] == str(kt_dir)
    assert ns["kt_cpuinfer"] == 126  # the 128 physical cores less the 2 sglang keeps
    assert ns["kt_threadpool_count"] == s.kt_threadpool_count
    assert ns["kt_num_gpu_experts"] == 0
    assert ns["enable_lora"] is True
    assert ns["lora_backend"] == s.lora_backend
    assert ns["lora_paths"] == [f"{s.adapter_name}={adapter_dir}"]
    assert ns["max_running_requests"] == s.max_running_requests >= 2
    assert ns["tensor_parallel_size"] == s.gpus  # ServerArgs.from_cli_args: tp_size = tensor_parallel_size
    assert ns["pipeline_parallel_size"] == 1
    assert ns["host"] == s.host and ns["port"] == s.port
    assert ns["served_model_name"] == s.served_model_name
    assert ns["dtype"] == s.dtype
    assert ns["context_length"] == s.context_length
    assert ns["chunked_prefill_size"] == s.chunked_prefill_size
    assert ns["mem_fraction_static"] == s.mem_fraction_static
    assert ns["max_total_tokens"] == s.max_total_tokens
    assert ns["disable_cuda_graph"] is True  # KT's LoRA path runs without CUDA graphs
    assert ns["disable_radix_cache"] is s.disable_radix_cache
    if s.attention_backend is not None:
        assert ns["attention_backend"] == s.attention_backend
    assert ns["kt_enable_dynamic_expert_update"] is False
    assert ns["kt_gpu_prefill_token_threshold"] is None
    assert ns["kt_expert_lora_path"] is None and ns["kt_lora_path"] is None
    assert ns["api_key"] is None  # not in argv: the launcher adds it inside the server process
    assert parsed["launches"][name].int8_threadpool_count == (2 if s.kt_method == "AMXINT8" else None)


@pytest.mark.slow
def test_max_total_tokens_reaches_sglang_kt(parsed: dict) -> None:
    assert parsed["bounded"]["ok"], parsed["bounded"]
    assert parsed["bounded"]["ns"]["max_total_tokens"] == 65536


@pytest.mark.slow
def test_unknown_flag_makes_sglang_kt_exit_2(parsed: dict) -> None:
    assert parsed["unknown"]["ok"] is False
    assert parsed["unknown"]["code"] == 2
    assert "unrecognized arguments: --kt-no-such-flag" in parsed["unknown"]["stderr"]


@pytest.mark.slow
def test_sglang_kt_takes_abbreviations_so_extra_args_are_checked_for_them(parsed: dict) -> None:
    # The real parser silently turns --kt-thread into --kt-threadpool-count (last one wins).
    assert parsed["abbrev"]["ok"] is True
    assert parsed["abbrev"]["ns"]["kt_threadpool_count"] == 4


@pytest.mark.slow
def test_owned_flags_are_sglang_kt_flags_and_refusing_prefixes_refuses_no_other_flag(parsed: dict) -> None:
    options = set(parsed["options"])
    assert set(OWNED_FLAGS) <= options
    # a real flag that is a strict prefix of an owned one would be refused by the prefix rule by mistake
    assert [o for o in options - set(OWNED_FLAGS) if any(f.startswith(o) for f in OWNED_FLAGS)] == []


_REQUIREMENTS = r"""
import json
from importlib.metadata import PackageNotFoundError, distribution, version
from packaging.requirements import Requirement
missing = []
for text in distribution("sglang-kt").requires or ():
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra's, or another platform's
    try:
        if not req.specifier.contains(version(req.name), prereleases=True):
            missing.append(f"{req} (installed {version(req.name)})")
    except PackageNotFoundError:
        missing.append(str(req))
print("MISSING " + json.dumps(missing))
"""


@pytest.mark.slow
def test_the_parser_is_the_whole_servers(sglang_kt) -> None:
    """The recipes are parsed by an sglang-kt installed with every dependency of its server (flashinfer, the
    KT builds of its kernels, the web stack), as a GPU host runs it, not by a parser-only install."""
    done = subprocess.run([str(SERVE_PYTHON), "-c", _REQUIREMENTS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    missing = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("MISSING ")).split(" ", 1)[1])
    assert missing == [], f"sglang-kt's requirements not installed in {SERVE_PYTHON}: {missing}"


@pytest.mark.slow
def test_every_serving_method_has_a_kt_lora_path_in_sglang_kt(sglang_kt) -> None:
    done = subprocess.run([str(SERVE_PYTHON), "-c", "import importlib.util as u; "
                           "print(u.find_spec('sglang').submodule_search_locations[0])"],
                          capture_output=True, text=True, check=True)
    source = Path(done.stdout.strip(), "srt", "layers", "moe", "kt_ep_wrapper.py").read_text()
    table = next(node.value for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", "") == "_KT_SFT_METHOD_BY_INFERENCE_METHOD" for t in node.targets))
    assert set(get_args(ServingMethod)) <= set(ast.literal_eval(table))


_PROBE = r"""
import argparse, hashlib, json, os, sys
from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser()
ServerArgs.add_cli_args(p)
ns = p.parse_args(sys.argv[1:])  # what sglang.launch_server's prepare_server_args parses
print(f"server_args={ns!r}", flush=True)  # sglang-kt logs its ServerArgs like this at INFO
print(f"server_args={ns!r}", file=sys.stderr, flush=True)
cmdline = open("/proc/self/cmdline", "rb").read()
print("PROBE " + json.dumps({
    "key_sha256": hashlib.sha256((ns.api_key or "").encode()).hexdigest(),
    "key_in_cmdline": (ns.api_key or "").encode() in cmdline,
    "key_env_left": os.environ.get(%r),
    "name": __name__, "argv0": sys.argv[0], "kt_method": ns.kt_method, "lora_paths": ns.lora_paths,
}), flush=True)
"""


@pytest.mark.slow
def test_launcher_passes_the_key_inside_the_server_only(sglang_kt, weights, adapter: Path, tmp_path: Path) -> None:
    """Run the rendered launcher for real, with the launch module swapped for a probe that parses its
    arguments with sglang-kt's parser: the key reaches ServerArgs.api_key, yet is absent from the
    process's cmdline, from the environment it leaves to children, and from what it prints."""
    launch = render(recipe("kimi-k2.5-rawint4.yaml", "serving.api_key_env=KTFLOW_TEST_KEY"), weights, adapter)
    (tmp_path / "probe_launch.py").write_text(_PROBE % "KTFLOW_TEST_KEY")
    argv = [launch.argv[0], "-c", launcher_code("KTFLOW_TEST_KEY", module="probe_launch"), *launch.launch_args]
    env = {**os.environ, **launch.env, "PYTHONPATH": str(tmp_path), "KTFLOW_TEST_KEY": SENTINEL}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("PROBE ")).removeprefix("PROBE "))
    assert probe["key_sha256"] == hashlib.sha256(SENTINEL.encode()).hexdigest()
    assert probe["key_in_cmdline"] is False
    assert probe["key_env_left"] is None
    assert probe["name"] == "__main__" and probe["argv0"].endswith("probe_launch.py")  # as `python -m`
    assert probe["kt_method"] == "RAWINT4" and probe["lora_paths"] == [f"tuned={adapter}"]
    assert SENTINEL not in done.stdout and SENTINEL not in done.stderr
    assert "api_key='***'" in done.stdout and "api_key='***'" in done.stderr

    # without the variable the launcher stops before sglang starts
    env.pop("KTFLOW_TEST_KEY")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1
    assert "KTFLOW_TEST_KEY is unset or empty" in done.stderr


def test_serve_dry_run_shows_the_server_environment_and_the_model_view(monkeypatch, capsys, fixture_dir,
                                                                        tmp_path: Path) -> None:
    """`ktflow serve --dry-run` renders what the serve stage starts: SGLANG_APPLY_CONFIG_BACKUP=none in the env,
    and, for a checkpoint sglang-kt cannot load as it is, the view the serve stage will make (named, not made)."""
    from ktflow.cli import main

    monkeypatch.chdir(tmp_path)  # the command works in the recipe's project directory; this brings us back
    base = fixture_dir("bf16")  # a transformers-saved DeepSeek-V3 config: no moe_layer_freq & co.
    recipe_file = REPO / "gpu_host" / "tiny-sglang-bf16.yaml"
    assert main(["serve", str(recipe_file), "--dry-run", "--json", "--set", f"source.local_path={base}",
                 "--set", f"store.root={tmp_path / 'store'}"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["env"]["SGLANG_APPLY_CONFIG_BACKUP"] == "none"
    model_path = Path(doc["argv"][doc["argv"].index("--model-path") + 1])
    assert model_path.parent == tmp_path / "store" / "serving" / "tiny-kt-bf16"
    assert model_path.name.startswith("model-view-") and not model_path.exists()
    assert "lacks" in doc["notes"][0] and doc["argv"][doc["argv"].index("--kt-weight-path") + 1] == str(base)
