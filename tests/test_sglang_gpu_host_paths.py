"""The GPU host's other two SGLang weight paths, checked without a GPU (served there:
benchmarks/data/sglang-serve), as the serve stage now prepares them itself
(ktflow.stages.serve.sglang.inputs; gpu_host/serve_check.py's served-model and int8-kt-layout steps before):
RAWINT4 (gpu_host/tiny-sglang-rawint4.yaml; the Kimi-K2.5 fixture's language model, the view sglang-kt loads)
and AMXINT8 (quantize-int8's output in the ``.kt`` layout kt-kernel's AMXINT8_SFT wrapper reads; kt-kernel
itself checks it in tests/test_quantize_int8.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from ktflow._drivers.kt_int8 import kt_file
from ktflow.errors import InvalidInputError, KtflowError
from ktflow.formats.checkpoint import NESTED_PREFIX
from ktflow.formats.kt_layout import expert_key, slice_sizes
from ktflow.recipe import load_recipe
from ktflow.stages.serve.sglang.inputs import (
    KT_LAYOUT_STAGE,
    MOONVIT_CONFIG_FIELDS,
    ROUTING_FIELDS,
    int8_kt_layout,
    kt_layout_dir_for,
    model_view_plan,
    sglang_kt_weights,
    sglang_model_view,
)
from ktflow.stages.serve.sglang.launch import render_sglang_launch
from ktflow.store import StageManifest, read_manifest

REPO = Path(__file__).resolve().parent.parent
GPU_HOST = REPO / "gpu_host"
SERVE_RECIPE = GPU_HOST / "tiny-sglang-rawint4.yaml"
TRAIN_RECIPE = GPU_HOST / "tiny-kt-rawint4.yaml"


def _adapter(path: Path, *, expert_lora: bool = False) -> Path:
    """A converted adapter; ``expert_lora``: with a routed expert's LoRA, as a KT SFT adapter converted has."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    names = ["base_model.model.model.layers.0.self_attn.q_a_proj.lora_A.weight"]
    if expert_lora:
        names.append("base_model.model.model.layers.1.mlp.experts.3.gate_proj.lora_A.weight")
    save_file({n: torch.zeros(2, 2) for n in names}, str(path / "adapter_model.safetensors"))
    return path


@pytest.mark.parametrize(("serve_recipe", "train_recipe"), [
    (SERVE_RECIPE, TRAIN_RECIPE), (GPU_HOST / "big-sglang-rawint4.yaml", GPU_HOST / "big-kt-rawint4.yaml"),
    (GPU_HOST / "slice-sglang-rawint4.yaml", GPU_HOST / "slice-kt-rawint4.yaml")])
def test_rawint4_serve_recipe_is_the_trained_recipe_plus_serving(serve_recipe: Path, train_recipe: Path) -> None:
    served, trained = (yaml.safe_load(p.read_text()) for p in (serve_recipe, train_recipe))
    serving = served.pop("serving")
    assert serving["backend"] == "sglang" and serving["kt_method"] == "RAWINT4"
    assert trained.pop("serving")["backend"] == "llamafactory"
    assert served.pop("toolchains")["train"] == trained.pop("toolchains")["train"]
    assert served == trained
    load_recipe(serve_recipe, ["serving.kt_method=AMXINT8"])  # the other path the load benchmark serves


def test_the_language_model_of_a_kimi_stand_in_is_what_sglang_kt_is_given(fixture_dir, tmp_path: Path) -> None:
    from test_sglang_launch import fake_host

    base = fixture_dir("kimi-k2.5")
    record = tmp_path / "serving"
    plan = model_view_plan(base)
    assert plan is not None and plan.kind == "language-model" and "not MoonViT's" in plan.reason
    said: list[str] = []
    out = sglang_model_view(base, record, log=said.append)
    assert out.parent == record and "vision tower" in said[0]
    config = json.loads((out / "config.json").read_text())
    original = json.loads((base / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["model_type"] == "deepseek_v3"
    assert config["quantization_config"] == original["text_config"]["quantization_config"]
    assert {k: config[k] for k in ROUTING_FIELDS["deepseek_v3"]} == ROUTING_FIELDS["deepseek_v3"]
    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    served_index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    text = {k: v for k, v in index.items() if k.startswith(NESTED_PREFIX)}
    assert len(text) < len(index)  # the stand-in's vision tensors are left out
    assert served_index == {k.removeprefix(NESTED_PREFIX): v for k, v in text.items()}
    for name, shard in text.items():  # the same bytes (the INT4 packed experts included), renamed
        with safe_open(base / shard, "pt") as a, safe_open(out / shard, "pt") as b:
            assert torch.equal(a.get_tensor(name), b.get_tensor(name.removeprefix(NESTED_PREFIX)))
    assert not list(out.glob("*.py")) and (out / "tokenizer.json").resolve() == (base / "tokenizer.json").resolve()
    assert model_view_plan(out) is None  # the view itself is loaded as it is
    assert [p.name for p in record.iterdir()] == [out.name]  # made in place atomically: no staging left

    # the launch: the text model on the GPU, the Kimi INT4 checkpoint itself as the RAWINT4 expert weights
    adapter = _adapter(tmp_path / "adapter")
    launch = render_sglang_launch(load_recipe(SERVE_RECIPE), model_dir=out, kt_weight_dir=base, adapter_dir=adapter,
                                  serve_python=Path(sys.executable), host=fake_host(cores=16, gpus=1, numa=1))
    args = launch.launch_args
    assert args[args.index("--kt-method") + 1] == "RAWINT4" and args[args.index("--model-path") + 1] == str(out)


def _int8_output(root: Path, *, t: int = 2, experts: int = 2, hidden: int = 8, inter: int = 8,
                 layers: tuple[int, ...] = (1, 2)) -> tuple[Path, dict[Path, bytes]]:
    """A stand-in quantize-int8 output (random packed bytes at kt-kernel's slice sizes) and the .kt files it
    was packed from (ktflow._drivers.kt_int8.kt_file, relative)."""
    src = root / "int8"
    src.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    tensors, expected = {}, {}
    for layer in layers:
        for proj in ("gate", "up", "down"):
            nbytes, scales = slice_sizes(proj, hidden, inter, t)
            for expert in range(experts):
                for numa in range(t):
                    w = torch.randint(-128, 127, (nbytes,), generator=gen, dtype=torch.int8)
                    s = torch.rand(scales, generator=gen)
                    tensors[expert_key(layer, proj, expert, numa, "weight")] = w
                    tensors[expert_key(layer, proj, expert, numa, "scale")] = s
                    expected[kt_file(Path(), layer, numa, proj, expert, nbytes, "quant")] = w.numpy().tobytes()
                    expected[kt_file(Path(), layer, numa, proj, expert, 4 * scales, "scale")] = s.numpy().tobytes()
    n = len(layers) + 1
    for k, layer in enumerate(layers, start=1):
        save_file({k: v for k, v in tensors.items() if k.startswith(f"blk.{layer}.")},
                  str(src / f"model-{k:05d}-of-{n:05d}.safetensors"))
    save_file({"norm.weight": torch.ones(4)}, str(src / f"model-{n:05d}-of-{n:05d}.safetensors"))
    (src / "config.json").write_text("{}")
    manifest = StageManifest(stage="quantize-int8", settings={"method": "AMXINT8", "threadpool_count": t,
                                                              "kt_kernel": "0.7.2"},
                             extra={"layers": list(layers), "experts": experts, "hidden": hidden,
                                    "moe_intermediate": inter})
    (src / "manifest.json").write_text(manifest.model_dump_json())
    return src, expected


def test_int8_kt_layout_writes_back_what_kt_kernel_cpu_save_wrote(tmp_path: Path) -> None:
    """Each ``blk.L.ffn_P_exps.E.numa.N.{weight,scale}`` tensor becomes the ``.kt`` file quantize-int8 read it
    from (ktflow._drivers.kt_int8.kt_file), byte for byte; every other file is linked; the layout is published
    with a manifest of its own that repeats the INT8 settings the launch checks."""
    src, expected = _int8_output(tmp_path)
    out = tmp_path / "kt"
    said: list[str] = []
    assert int8_kt_layout(src, out, log=said.append) == out
    written = {p.relative_to(out): p.read_bytes() for p in out.rglob("*.kt")}
    assert written == expected
    assert (out / "config.json").resolve() == (src / "config.json").resolve()
    manifest = read_manifest(out)
    assert manifest.stage == KT_LAYOUT_STAGE and manifest.inputs == {"int8": read_manifest(src).digest()}
    assert manifest.settings["threadpool_count"] == 2 and manifest.settings["method"] == "AMXINT8"
    assert manifest.extra["layers"] == [1, 2] and manifest.extra["kt_files"] == len(expected)
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())
    stamp = (out / "manifest.json").stat().st_mtime_ns
    assert int8_kt_layout(src, out) == out and (out / "manifest.json").stat().st_mtime_ns == stamp  # a cache hit


def test_int8_kt_layout_refuses_what_is_not_a_complete_quantize_int8_output(tmp_path: Path) -> None:
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    save_file({"model.layers.1.mlp.experts.0.up_proj.weight": torch.ones(2, 2)}, str(bf16 / "model.safetensors"))
    with pytest.raises(KtflowError, match="not a quantize-int8 output"):
        int8_kt_layout(bf16, tmp_path / "kt")
    src, _ = _int8_output(tmp_path / "short", layers=(1, 2))
    manifest = read_manifest(src).model_copy(update={"extra": {**read_manifest(src).extra, "layers": [1, 2, 3]}})
    (src / "manifest.json").write_text(manifest.model_dump_json())
    with pytest.raises(KtflowError, match=r"missing \['_layer_3/"):
        int8_kt_layout(src, tmp_path / "kt")
    assert not (tmp_path / "kt").exists()


def test_the_serve_stage_serves_amxint8_with_an_expert_lora_from_the_kt_layout(tmp_path: Path) -> None:
    """Only where it is needed: AMXINT8, an adapter with an expert LoRA, weights without .kt files; and the
    launch refuses the plain safetensors with such an adapter (kt-kernel's AMXINT8_SFT would refuse them)."""
    from test_sglang_launch import fake_host

    src, _ = _int8_output(tmp_path, t=1)
    recipe = load_recipe(GPU_HOST / "tiny-sglang-bf16.yaml", ["serving.kt_method=AMXINT8",
                                                               f"store.root={tmp_path / 'store'}"])
    with_experts, plain = _adapter(tmp_path / "kt-adapter", expert_lora=True), _adapter(tmp_path / "hf-adapter")
    assert sglang_kt_weights(recipe, src, plain) == src  # no expert LoRA: kt-kernel's inference wrapper reads src
    assert sglang_kt_weights(load_recipe(GPU_HOST / "tiny-sglang-bf16.yaml"), src, with_experts) == src  # AMXBF16
    named = sglang_kt_weights(recipe, src, with_experts, create=False)
    assert named == kt_layout_dir_for(recipe, src) and not named.exists()
    assert named.parent == tmp_path / "store" / "int8"
    said: list[str] = []
    made = sglang_kt_weights(recipe, src, with_experts, log=said.append)
    assert made == named and read_manifest(made).stage == KT_LAYOUT_STAGE and "AMXINT8_SFT" in said[-1]
    assert sglang_kt_weights(recipe, made, with_experts) == made  # already in that layout

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    kw = dict(model_dir=model, serve_python=Path(sys.executable), host=fake_host(cores=16, gpus=1, numa=1))
    launch = render_sglang_launch(recipe, kt_weight_dir=made, adapter_dir=with_experts, **kw)
    assert launch.int8_threadpool_count == 1  # the layout's manifest carries quantize-int8's T
    assert launch.launch_args[launch.launch_args.index("--kt-weight-path") + 1] == str(made)
    render_sglang_launch(recipe, kt_weight_dir=src, adapter_dir=plain, **kw)  # the safetensors, without expert LoRA
    with pytest.raises(InvalidInputError, match=r"holds no _layer_L/_numa_N/\*\.kt files.*AMXINT8_SFT"):
        render_sglang_launch(recipe, kt_weight_dir=src, adapter_dir=with_experts, **kw)
    with pytest.raises(InvalidInputError, match="threadpool_count"):  # its T is still checked
        render_sglang_launch(load_recipe(GPU_HOST / "tiny-sglang-bf16.yaml", [
            "serving.kt_method=AMXINT8", "serving.kt_threadpool_count=2"]), kt_weight_dir=made,
            adapter_dir=with_experts, **kw)


@pytest.mark.parametrize("vision, stand_in", [
    ({"model_type": "kimi_k25_vision", "patch_size": 14, "hidden_size": 64}, True),
    (dict.fromkeys(MOONVIT_CONFIG_FIELDS, 1), False),
])
def test_only_the_vision_stand_in_is_served_as_text(tmp_path: Path, vision: dict, stand_in: bool) -> None:
    config = {"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3", **ROUTING_FIELDS["deepseek_v3"]},
              "vision_config": vision}
    (tmp_path / "config.json").write_text(json.dumps(config))
    plan = model_view_plan(tmp_path)
    assert (plan is not None and plan.kind == "language-model") is stand_in
    assert plan is None or plan.added == {}
