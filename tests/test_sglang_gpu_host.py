"""The GPU host's SGLang serving kit, checked without a GPU: the serve recipe (the trained recipe plus a
serving section whose launch sglang-kt's own parser accepts), the serving bundle builder's pins, trims and
patches, the serve stage's environment for sglang-kt, and the model view the serve stage gives sglang-kt where a
transformers-saved config lacks the DeepSeek fields it reads (done by hand with serve_check.py served-model before).
The serving itself runs on the GPU host (gpu_host/run.sh serve-setup serve-bf16; benchmarks/data/sglang-serve)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from ktflow.recipe import OWNED_FLAGS, load_recipe
from ktflow.stages.serve.sglang.inputs import ROUTING_FIELDS, model_view_plan, sglang_model_view
from ktflow.stages.serve.sglang.launch import SERVER_ENV_DEFAULTS, render_sglang_launch

REPO = Path(__file__).resolve().parent.parent
GPU_HOST = REPO / "gpu_host"
sys.path.insert(0, str(GPU_HOST))

import build_serve_bundle  # noqa: E402

SERVE_RECIPE = GPU_HOST / "tiny-sglang-bf16.yaml"
TRAIN_RECIPE = GPU_HOST / "tiny-kt-bf16.yaml"


def test_serve_recipe_is_the_trained_recipe_plus_serving() -> None:
    """Same name, source, data, sft and store: `ktflow serve` finds the adapter `ktflow sft` trained."""
    served, trained = (yaml.safe_load(p.read_text()) for p in (SERVE_RECIPE, TRAIN_RECIPE))
    assert served.pop("serving")["backend"] == "sglang" and trained.pop("serving")["backend"] == "llamafactory"
    assert served.pop("toolchains")["train"] == trained.pop("toolchains")["train"]
    assert served == trained


def test_serve_recipe_renders_the_gpu_host_flags(fixture_dir, tmp_path: Path) -> None:
    from test_sglang_launch import fake_host

    r = load_recipe(SERVE_RECIPE)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    model = fixture_dir("bf16")
    launch = render_sglang_launch(r, model_dir=model, kt_weight_dir=model, adapter_dir=adapter,
                                  serve_python=Path(sys.executable), host=fake_host(cores=16, gpus=1, numa=1))
    args = launch.launch_args
    flag = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--") and not args[i + 1].startswith("--")}
    assert flag["--attention-backend"] == "triton" and flag["--sampling-backend"] == "pytorch"
    assert flag["--grammar-backend"] == "none" and flag["--lora-backend"] == "triton"
    assert flag["--kt-method"] == "AMXBF16" and int(flag["--max-running-requests"]) >= 2
    assert "--disable-cuda-graph" in args and "--disable-radix-cache" in args


def test_new_backend_flags_are_owned_and_unset_by_default() -> None:
    for f in ("--sampling-backend", "--grammar-backend"):
        assert f in OWNED_FLAGS
    r = load_recipe(REPO / "recipes" / "kimi-k2.5-rawint4.yaml")
    assert r.serving.sampling_backend is None and r.serving.grammar_backend is None  # shipped argv unchanged


@pytest.mark.slow
@pytest.mark.parametrize(("recipe_name", "sets", "kt_method"), [
    ("tiny-sglang-bf16.yaml", [], "AMXBF16"), ("tiny-sglang-rawint4.yaml", [], "RAWINT4"),
    ("big-sglang-rawint4.yaml", [], "RAWINT4"), ("big-sglang-rawint4.yaml", ["serving.kt_method=AMXINT8"], "AMXINT8"),
    ("slice-sglang-rawint4.yaml", [], "RAWINT4")])
def test_serve_recipe_argv_parses_with_sglang_kt(recipe_name: str, sets: list[str], kt_method: str, sglang_kt,
                                                 fixture_dir, tmp_path: Path) -> None:
    from test_sglang_launch import fake_host, parse_with_sglang

    r = load_recipe(GPU_HOST / recipe_name, sets)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    model = fixture_dir("bf16")
    launch = render_sglang_launch(r, model_dir=model, kt_weight_dir=model, adapter_dir=adapter,
                                  serve_python=Path(sys.executable), host=fake_host(cores=16, gpus=1, numa=1),
                                  check_files=False)
    [result] = parse_with_sglang([launch.launch_args])["results"]
    assert result["ok"], result
    ns = result["ns"]
    assert (ns["attention_backend"], ns["sampling_backend"], ns["grammar_backend"]) == ("triton", "pytorch", "none")
    assert ns["disable_cuda_graph"] is True and ns["lora_backend"] == "triton" and ns["kt_method"] == kt_method
    assert ns["max_running_requests"] == r.serving.max_running_requests


@pytest.fixture(scope="module")
def sglang_kt():
    from test_sglang_launch import SERVE_PYTHON

    ok = SERVE_PYTHON.exists() and subprocess.run(
        [str(SERVE_PYTHON), "-c", "import sglang.srt.server_args"], capture_output=True, timeout=300).returncode == 0
    if not ok:
        pytest.skip("sglang-kt not importable in .venv-serve")


def test_serve_stage_gives_sglang_kt_the_checkpoints_own_config(monkeypatch, fixture_dir, tmp_path: Path) -> None:
    """sglang-kt 0.7.2 swaps a DeepSeek-family config.json for a packaged DeepSeek-V4 one unless told not to."""
    from test_sglang_launch import fake_host

    from ktflow.stages.serve.sglang import BACKEND

    assert SERVER_ENV_DEFAULTS == {"SGLANG_APPLY_CONFIG_BACKUP": "none"}
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    model = fixture_dir("bf16")
    monkeypatch.setenv("KTFLOW_API_KEY", "k" * 32)
    for overrides, expected in (([], "none"), (["toolchains.serve.env.SGLANG_APPLY_CONFIG_BACKUP=auto"], "auto")):
        r = load_recipe(SERVE_RECIPE, [f"toolchains.serve.python={sys.executable}", *overrides])
        launch = BACKEND.launch(r, model_dir=model, adapter_dir=adapter, kt_weight_dir=model, record_dir=tmp_path,
                                port=r.serving.port, host=fake_host(cores=16, gpus=1, numa=1))
        assert launch.env["SGLANG_APPLY_CONFIG_BACKUP"] == expected


# --------------------------------------------------------------------------- the serving bundle


def test_serve_bundle_pins_every_package_exactly() -> None:
    reqs = build_serve_bundle.requirements()
    names = [r.split("==")[0].lower() for r in reqs]
    assert len(names) == len(set(names))
    for must in ("sglang-kt==0.7.2", "sglang-kernel==0.4.4", "flashinfer-python==0.6.3", "apache-tvm-ffi==0.1.11",
                 "kt-kernel==0.7.2", "transformers-kt==5.6.0.post6"):
        assert must in reqs
    kt = {line.split("==")[0].lower(): line.split("==")[1] for line in (REPO / "constraints" / "kt-train.txt")
          .read_text().splitlines() if "==" in line and not line.startswith("#")}
    for req in reqs:  # the KT packages both bundles carry are the same versions
        name, version = req.split("==")
        if name.lower() in kt and name.lower() not in ("fastapi", "starlette"):
            assert kt[name.lower()] == version, req


@pytest.mark.parametrize("wheel, member, kept", [
    ("sglang_kt-0.7.2-py3-none-manylinux_2_35_x86_64.whl", "sglang_kt_sgl_kernel_payload/payload.part", False),
    ("sglang_kt-0.7.2-py3-none-manylinux_2_35_x86_64.whl", "sglang/multimodal_gen/runtime/x.py", False),
    ("sglang_kt-0.7.2-py3-none-manylinux_2_35_x86_64.whl", "sglang/srt/server_args.py", True),
    ("sglang_kernel-0.4.4-cp310-abi3-manylinux2014_x86_64.whl", "sgl_kernel/flash_ops.abi3.so", False),
    ("sglang_kernel-0.4.4-cp310-abi3-manylinux2014_x86_64.whl", "sgl_kernel/sm100/common_ops.abi3.so", False),
    ("sglang_kernel-0.4.4-cp310-abi3-manylinux2014_x86_64.whl", "sgl_kernel/flashmla_ops.abi3.so", False),
    ("sglang_kernel-0.4.4-cp310-abi3-manylinux2014_x86_64.whl", "sgl_kernel/sm90/common_ops.abi3.so", True),
    ("sglang_kernel-0.4.4-cp310-abi3-manylinux2014_x86_64.whl", "sgl_kernel/flash_attn.py", True),
    ("kt_kernel-0.7.2-cp312-cp312-manylinux_2_35_x86_64.whl", "sgl_kernel/__init__.py", False),
    ("kt_kernel-0.7.2-cp312-cp312-manylinux_2_35_x86_64.whl", "deep_gemm/__init__.py", False),
    ("kt_kernel-0.7.2-cp312-cp312-manylinux_2_35_x86_64.whl",
     "kt_kernel/_kt_kernel_ext_avx2.cpython-312-x86_64-linux-gnu.so", False),
    ("kt_kernel-0.7.2-cp312-cp312-manylinux_2_35_x86_64.whl",
     "kt_kernel/_kt_kernel_ext_amx.cpython-312-x86_64-linux-gnu.so", True),
    ("kt_kernel-0.7.2-cp312-cp312-manylinux_2_35_x86_64.whl", "kt_kernel-0.7.2.dist-info/METADATA", True),
    ("transformers_kt-5.6.0.post6-py3-none-manylinux_2_35_x86_64.whl", "transformers_kt_sgl_kernel_payload/p", False),
])
def test_serve_bundle_trims(wheel: str, member: str, kept: bool) -> None:
    assert build_serve_bundle.SERVE.keep(wheel, member) is kept


def test_serve_bundle_patches(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "sgl_kernel").mkdir(parents=True)
    (site / "sgl_kernel" / "__init__.py").write_text('__version__ = "0.4.4"\ndef rmsnorm(): pass\n')
    (site / "sgl_kernel" / "flash_attn.py").write_text(
        "import torch\n\n" + build_serve_bundle._FA3_IMPORT + "\n\ndef is_fa3_supported(device=None) -> bool:\n"
        "    return True\n\n\ndef flash_attn_varlen_func(*a):\n    return torch.ops.sgl_kernel.fwd(*a)\n")
    build_serve_bundle.patch(site)
    build_serve_bundle.patch(site)  # idempotent
    sys.path.insert(0, str(site))
    try:
        import sgl_kernel
        import sgl_kernel.flash_attn as fa3
        from IPython.display import HTML, display  # noqa: F401  (what sglang/utils.py imports)

        for name in build_serve_bundle.FP4_PLACEHOLDERS:
            with pytest.raises(NotImplementedError, match=name):
                getattr(sgl_kernel, name)()
        assert fa3.flash_ops is None and fa3.is_fa3_supported() is False
    finally:
        sys.path.remove(str(site))
        for mod in [m for m in sys.modules if m.split(".")[0] in ("sgl_kernel", "IPython")]:
            del sys.modules[mod]


# --------------------------------------------------------------------------- the model as sglang-kt reads it


def test_the_serve_stage_adds_the_deepseek_v3_fields_a_transformers_saved_config_lacks(fixture_dir,
                                                                                     tmp_path: Path) -> None:
    """sglang-kt reads moe_layer_freq, topk_method and scoring_func without a default (GPU host, call 4): the serve
    stage gives it a view of the checkpoint with them added, nothing else changed, made once in the record dir."""
    from test_sglang_launch import fake_host

    from ktflow.stages.serve.sglang import BACKEND

    base = fixture_dir("bf16")
    record = tmp_path / "serving"
    named = sglang_model_view(base, record, create=False)
    abandoned = record / f".{named.name}.tmp-999999999-deadbeef"  # a start killed mid-copy (no such pid)
    abandoned.mkdir(parents=True)
    plan = model_view_plan(base)
    assert plan is not None and plan.kind == "config" and plan.added == ROUTING_FIELDS["deepseek_v3"]
    said: list[str] = []
    served = sglang_model_view(base, record, log=said.append)
    assert served == named and served.name.startswith("model-view-") and "lacks" in said[0]
    config = json.loads((served / "config.json").read_text())
    assert {k: config[k] for k in ROUTING_FIELDS["deepseek_v3"]} == ROUTING_FIELDS["deepseek_v3"]
    original = json.loads((base / "config.json").read_text())
    assert {k: v for k, v in config.items() if k not in ROUTING_FIELDS["deepseek_v3"]} == original
    for f in base.iterdir():
        if f.name not in ("config.json", "manifest.json"):
            assert (served / f.name).resolve() == f.resolve()
    assert [p.name for p in record.iterdir()] == [served.name]  # no staging dir left behind
    stamp = (served / "config.json").stat().st_mtime_ns
    assert sglang_model_view(base, record) == served and (served / "config.json").stat().st_mtime_ns == stamp
    assert sglang_model_view(base, tmp_path / "elsewhere", create=False).parent == tmp_path / "elsewhere"
    assert not (tmp_path / "elsewhere").exists()  # create=False only names it
    # a config that has them (a published checkpoint's) is served as it is
    assert model_view_plan(served) is None and sglang_model_view(served, record) == served

    # the serve stage: the launch names the view, and the experts still come from the checkpoint itself
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    r = load_recipe(SERVE_RECIPE, [f"toolchains.serve.python={sys.executable}"])
    launch = BACKEND.launch(r, model_dir=base, adapter_dir=adapter, kt_weight_dir=base, record_dir=record,
                            port=r.serving.port, host=fake_host(cores=16, gpus=1, numa=1))
    args = launch.argv[3:]
    assert args[args.index("--model-path") + 1] == str(served)
    assert args[args.index("--kt-weight-path") + 1] == str(base)


@pytest.mark.parametrize(("config", "added"), [
    ({"model_type": "deepseek_v3", "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}, None),
    ({"model_type": "deepseek_v2", "topk_method": "greedy"}, {"moe_layer_freq": 1, "scoring_func": "softmax"}),
    ({"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}, ROUTING_FIELDS["deepseek_v3"]),
    ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}, None),  # not a DeepSeek: as it is
    ({"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3", "scoring_func": "sigmoid"},
      "vision_config": {"merge_kernel_size": [2, 2], "init_pos_emb_height": 64, "num_hidden_layers": 27,
                        "vt_hidden_size": 1152}}, {"moe_layer_freq": 1, "topk_method": "noaux_tc"}),
])
def test_which_configs_get_the_deepseek_fields(tmp_path: Path, config: dict, added: dict | None) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    plan = model_view_plan(tmp_path)
    assert (plan.added if plan else None) == added and (plan is None or plan.kind == "config")


def test_the_no_expert_candidate_of_the_promotion_check_is_a_published_ordinary_lora(tmp_path: Path) -> None:
    """serve_check.py promotion's v2: the converted adapter without its expert LoRA, a new artifact (its own
    digest, so its own version), naming only the modules it still carries, which sglang-kt serves as an ordinary
    LoRA (and ktflow with --kt-method BF16, the name kt-kernel's inference path takes)."""
    import serve_check
    from safetensors.numpy import load_file, save_file

    from ktflow.formats.adapter import has_expert_lora
    from ktflow.stages.serve.sglang.launch import served_kt_method
    from ktflow.store import StageManifest, publish_dir, read_manifest

    staging = tmp_path / "staging"
    staging.mkdir()
    expert = "base_model.model.model.layers.1.mlp.experts.3.down_proj.lora_B.weight"
    attention = "base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"
    save_file({expert: np.ones((4, 8), np.float32), attention: np.ones((8, 4), np.float32)},
              str(staging / "adapter_model.safetensors"))
    (staging / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["o_proj", "down_proj"]}))
    converted = tmp_path / "converted"
    publish_dir(staging, converted, StageManifest(stage="convert-lora", inputs={"base": "b" * 64}))

    out = serve_check.write_no_expert_adapter(converted, tmp_path / "converted-no-experts")
    assert set(load_file(str(out / "adapter_model.safetensors"))) == {attention}
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"] == ["o_proj"]
    manifest = read_manifest(out)
    assert manifest is not None and manifest.digest() != read_manifest(converted).digest()
    assert manifest.extra["dropped_tensors"] == 1 and manifest.inputs["variant-of"] == read_manifest(converted).digest()
    assert has_expert_lora(converted) and not has_expert_lora(out)
    assert served_kt_method("AMXBF16", converted) == "AMXBF16" and served_kt_method("AMXBF16", out) == "BF16"
    assert serve_check.write_no_expert_adapter(converted, out) == out  # published once


@pytest.mark.parametrize("key", ["-Mk3xQ", "--dashes", "plain_key"])
def test_the_load_benchmark_gets_the_key_whatever_it_starts_with(tmp_path: Path, key: str) -> None:
    """serve_check.py's serve_load command line: a random URL-safe key starts with '-' once in 64, which argparse
    read as a missing value (a load benchmark lost to it); the key travels as --api-key=KEY."""
    import argparse
    from types import SimpleNamespace

    import serve_check

    sys.path.insert(0, str(REPO / "benchmarks"))
    import serve_load

    recipe = load_recipe(SERVE_RECIPE)
    endpoint = SimpleNamespace(url="http://127.0.0.1:30000/v1", adapter_model_name=None, served_model_name="m", pid=1)
    args = argparse.Namespace(load_json=str(tmp_path / "load.json"), load_args="--concurrency 1")
    argv = serve_check.load_benchmark_argv(args, recipe, endpoint, key, tmp_path, 90.0)
    parsed = serve_load.build_parser().parse_args(argv)
    assert parsed.api_key == key and parsed.concurrency == [1] and parsed.server_pid == 1
