"""The GPU host's other two SGLang weight paths, checked without a GPU (served there:
docs/benchmarks/sglang-serve, calls 8-9): RAWINT4 (gpu_host/tiny-sglang-rawint4.yaml; the Kimi-K2.5 fixture's
language model as sglang-kt loads it, serve_check.py served-model) and AMXINT8 (quantize-int8's output in the
``.kt`` layout kt-kernel's AMXINT8_SFT wrapper reads, serve_check.py int8-kt-layout)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from ktflow._drivers.kt_int8 import expert_key, kt_file
from ktflow.recipe import load_recipe
from ktflow.stages.sglang_launch import render_sglang_launch

REPO = Path(__file__).resolve().parent.parent
GPU_HOST = REPO / "gpu_host"
sys.path.insert(0, str(GPU_HOST))

import serve_check  # noqa: E402

SERVE_RECIPE = GPU_HOST / "tiny-sglang-rawint4.yaml"
TRAIN_RECIPE = GPU_HOST / "tiny-kt-rawint4.yaml"


def _args(**kw):
    return type("A", (), kw)


def test_rawint4_serve_recipe_is_the_trained_recipe_plus_serving() -> None:
    served, trained = (yaml.safe_load(p.read_text()) for p in (SERVE_RECIPE, TRAIN_RECIPE))
    serving = served.pop("serving")
    assert serving["backend"] == "sglang" and serving["kt_method"] == "RAWINT4"
    assert trained.pop("serving")["backend"] == "llamafactory"
    assert served.pop("toolchains")["train"] == trained.pop("toolchains")["train"]
    assert served == trained


def test_served_model_of_a_kimi_stand_in_is_its_language_model(fixture_dir, tmp_path: Path, capsys) -> None:
    from test_sglang_launch import fake_host

    base = fixture_dir("kimi-k2.5")
    out = tmp_path / "served"
    assert serve_check.cmd_served_model(_args(base=str(base), out=str(out))) == 0
    assert Path(capsys.readouterr().out.strip()) == out
    config = json.loads((out / "config.json").read_text())
    original = json.loads((base / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["model_type"] == "deepseek_v3"
    assert config["quantization_config"] == original["text_config"]["quantization_config"]
    assert {k: config[k] for k in serve_check.DEEPSEEK_V3_CONFIG_FIELDS} == serve_check.DEEPSEEK_V3_CONFIG_FIELDS
    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    served_index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    text = {k: v for k, v in index.items() if not k.startswith(serve_check.VISION_PREFIXES)}
    assert len(text) < len(index)  # the stand-in's vision tensors are left out
    assert served_index == {k.removeprefix("language_model."): v for k, v in text.items()}
    for name, shard in text.items():  # the same bytes (the INT4 packed experts included), renamed
        with safe_open(base / shard, "pt") as a, safe_open(out / shard, "pt") as b:
            assert torch.equal(a.get_tensor(name), b.get_tensor(name.removeprefix("language_model.")))
    assert not list(out.glob("*.py")) and (out / "tokenizer.json").resolve() == (base / "tokenizer.json").resolve()

    # the launch: the text model on the GPU, the Kimi INT4 checkpoint itself as the RAWINT4 expert weights
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    launch = render_sglang_launch(load_recipe(SERVE_RECIPE), model_dir=out, kt_weight_dir=base, adapter_dir=adapter,
                                  serve_python=Path(sys.executable), host=fake_host(cores=16, gpus=1, numa=1))
    args = launch.launch_args
    assert args[args.index("--kt-method") + 1] == "RAWINT4" and args[args.index("--model-path") + 1] == str(out)


def test_int8_kt_layout_writes_back_what_kt_kernel_cpu_save_wrote(tmp_path: Path, capsys) -> None:
    """Each ``blk.L.ffn_P_exps.E.numa.N.{weight,scale}`` tensor becomes the ``.kt`` file quantize-int8 read it
    from (ktflow._drivers.kt_int8.kt_file), byte for byte; every other file is linked."""
    src = tmp_path / "int8"
    src.mkdir()
    gen = torch.Generator().manual_seed(0)
    tensors, expected = {}, {}
    for layer in (1, 2):
        for proj in ("gate", "up", "down"):
            for expert in range(2):
                for numa in range(2):
                    w = torch.randint(-128, 127, (96,), generator=gen, dtype=torch.int8)
                    s = torch.rand(12, generator=gen)
                    tensors[expert_key(layer, proj, expert, numa, "weight")] = w
                    tensors[expert_key(layer, proj, expert, numa, "scale")] = s
                    expected[kt_file(Path(), layer, numa, proj, expert, 96, "quant")] = w.numpy().tobytes()
                    expected[kt_file(Path(), layer, numa, proj, expert, 48, "scale")] = s.numpy().tobytes()
    save_file({k: v for k, v in tensors.items() if k.startswith("blk.1.")}, str(src / "model-00001-of-00003.safetensors"))
    save_file({k: v for k, v in tensors.items() if k.startswith("blk.2.")}, str(src / "model-00002-of-00003.safetensors"))
    save_file({"norm.weight": torch.ones(4)}, str(src / "model-00003-of-00003.safetensors"))
    (src / "manifest.json").write_text('{"stage": "quantize-int8"}')
    out = tmp_path / "kt"
    assert serve_check.cmd_int8_kt_layout(_args(int8_dir=str(src), out=str(out))) == 0
    assert Path(capsys.readouterr().out.strip()) == out
    written = {p.relative_to(out): p.read_bytes() for p in out.rglob("*.kt")}
    assert written == expected
    assert (out / "manifest.json").resolve() == (src / "manifest.json").resolve()
    assert json.loads((out / "ktflow-kt-layout.json").read_text())["layers"] == [1, 2]


def test_int8_kt_layout_refuses_a_folder_without_int8_experts(tmp_path: Path) -> None:
    src = tmp_path / "bf16"
    src.mkdir()
    save_file({"model.layers.1.mlp.experts.0.up_proj.weight": torch.ones(2, 2)}, str(src / "model.safetensors"))
    assert serve_check.cmd_int8_kt_layout(_args(int8_dir=str(src), out=str(tmp_path / "kt"))) == 1


@pytest.mark.parametrize("vision, stand_in", [
    ({"model_type": "kimi_k25_vision", "patch_size": 14, "hidden_size": 64}, True),
    ({"merge_kernel_size": [2, 2], "init_pos_emb_height": 64, "num_hidden_layers": 27, "vt_hidden_size": 1152}, False),
])
def test_only_the_vision_stand_in_is_served_as_text(vision: dict, stand_in: bool) -> None:
    config = {"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3"}, "vision_config": vision}
    assert serve_check._kimi_stand_in(config) is stand_in
