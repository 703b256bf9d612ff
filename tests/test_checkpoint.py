"""``inspect_checkpoint`` recognizes every fixture by structure and refuses broken or
unsupported checkpoints with errors that name the file, tensor or config field."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from ktflow.errors import CheckpointError
from ktflow.formats.checkpoint import detect_format, inspect_checkpoint, load_config, text_config

INDEX = "model.safetensors.index.json"


def editable_copy(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / source.name))


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2))


@pytest.mark.parametrize(
    ("kind", "fmt", "layout", "prefix", "quantized"),
    [
        ("kimi-k2.5", "kimi-k2.5-int4", "nested", "language_model.", 48),
        ("kimi-k2", "kimi-k2-int4", "flat", "", 48),
        ("deepseek-v3", "deepseek-v3-fp8", "flat", "", 72),
        ("bf16", "bf16", "flat", "", 0),
    ],
)
def test_inspects_every_fixture_kind(fixture_dir, kind, fmt, layout, prefix, quantized) -> None:
    path = fixture_dir(kind)
    info = inspect_checkpoint(path)
    assert (info.format, info.layout, info.tensor_prefix) == (fmt, layout, prefix)
    assert (info.num_layers, info.first_k_dense, info.num_routed_experts, info.num_shared_experts) == (3, 1, 8, 1)
    assert (info.hidden_size, info.moe_intermediate_size, info.intermediate_size) == (256, 128, 384)
    assert info.quantized_tensors == quantized
    assert info.num_shards == len(info.shards) == 3
    index = read_json(path / INDEX)
    assert info.num_tensors == len(index["weight_map"]) == sum(info.dtypes.values())
    assert info.tensor_bytes == index["metadata"]["total_size"]
    assert info.dtypes["F32"] >= 2  # e_score_correction_bias stays float32
    assert info.path == str(path)
    assert info.architectures == read_json(path / "config.json")["architectures"]


def test_inspect_counts_the_spec_dimensions(fixture_dir) -> None:
    info = inspect_checkpoint(fixture_dir("kimi-k2.5", layers=2, experts=4, hidden=128, moe_intermediate=256))
    assert (info.num_layers, info.num_routed_experts, info.hidden_size, info.moe_intermediate_size) == (2, 4, 128, 256)
    assert info.num_shards == 2 and info.quantized_tensors == 1 * 4 * 3


def test_decoded_kimi_k25_is_nested_bf16(reference_bf16_dir) -> None:
    info = inspect_checkpoint(reference_bf16_dir("kimi-k2.5"))
    assert (info.format, info.layout, info.tensor_prefix) == ("bf16", "nested", "language_model.")
    assert info.quantized_tensors == 0 and "I32" not in info.dtypes


def test_single_file_without_index(fixture_dir, tmp_path: Path) -> None:
    source = fixture_dir("bf16")
    path = tmp_path / "single"
    path.mkdir()
    shutil.copyfile(source / "config.json", path / "config.json")
    tensors = {}
    for shard in sorted(source.glob("model-*.safetensors")):
        tensors.update(load_file(shard))
    save_file(tensors, path / "model.safetensors")
    info = inspect_checkpoint(path)
    assert info.format == "bf16" and info.shards == ["model.safetensors"] and info.num_tensors == len(tensors)


def test_config_helpers(fixture_dir, tmp_path: Path) -> None:
    nested = load_config(fixture_dir("kimi-k2.5"))
    assert text_config(nested) is nested["text_config"] and text_config(nested)["n_routed_experts"] == 8
    flat = load_config(fixture_dir("kimi-k2"))
    assert text_config(flat) is flat
    with pytest.raises(CheckpointError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: cannot be read as JSON"):
        load_config(tmp_path)


# ---- structure, not names: detect_format on configs and tensor names alone ----

def kimi_config(nested: bool) -> tuple[dict, list[str]]:
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                           "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                       "group_size": 32, "symmetric": True}}}}
    names = ["model.layers.1.mlp.experts.0.up_proj.weight_packed", "model.layers.1.mlp.experts.0.up_proj.weight_scale",
             "model.embed_tokens.weight", "lm_head.weight"]
    if nested:
        return ({"model_type": "anything", "text_config": {"quantization_config": quant}},
                ["language_model." + n for n in names] + ["vision_tower.patch_embed.proj.weight"])
    return {"model_type": "anything", "quantization_config": quant}, names


def test_detect_format_keys_on_structure() -> None:
    assert detect_format(*kimi_config(nested=True)) == ("kimi-k2.5-int4", "nested", "language_model.")
    assert detect_format(*kimi_config(nested=False)) == ("kimi-k2-int4", "flat", "")
    fp8 = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]}}
    fp8_names = ["model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.weight_scale_inv"]
    assert detect_format(fp8, fp8_names) == ("deepseek-v3-fp8", "flat", "")
    assert detect_format({"model_type": "kimi_k2"}, ["model.embed_tokens.weight"]) == ("bf16", "flat", "")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda w: w.update(group_size=64),
         "config.json: text_config.quantization_config.config_groups.group_0.weights.group_size is 64; "
         "ktflow supports group_size 32"),
        (lambda w: w.update(symmetric=False),
         "text_config.quantization_config.config_groups.group_0.weights.symmetric is false; "
         "ktflow supports symmetric true"),
        (lambda w: w.update(num_bits=8),
         "text_config.quantization_config.config_groups.group_0.weights.num_bits is 8"),
        (lambda w: w.update(type="float"),
         "text_config.quantization_config.config_groups.group_0.weights.type is \"float\""),
    ],
)
def test_rejects_unsupported_int4_schemes_naming_the_field(edit, message) -> None:
    config, names = kimi_config(nested=True)
    edit(config["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"])
    with pytest.raises(CheckpointError) as info:
        detect_format(config, names)
    assert message in str(info.value)


def test_rejects_other_unsupported_quantization() -> None:
    config, names = kimi_config(nested=False)
    activation = copy.deepcopy(config)
    activation["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8}
    with pytest.raises(CheckpointError, match=r"quantization_config\.config_groups\.group_0\.input_activations is"):
        detect_format(activation, names)
    fmt = copy.deepcopy(config)
    fmt["quantization_config"]["format"] = "int-quantized"
    with pytest.raises(CheckpointError, match=r"quantization_config\.format is \"int-quantized\""):
        detect_format(fmt, names)
    with pytest.raises(CheckpointError, match=r"quantization_config\.quant_method is 'awq'"):
        detect_format({"quantization_config": {"quant_method": "awq"}}, names)
    block = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}
    with pytest.raises(CheckpointError, match=r"quantization_config\.weight_block_size is \[64, 64\]"):
        detect_format(block, ["a.weight", "a.weight_scale_inv"])


def test_rejects_config_that_contradicts_the_tensors() -> None:
    nested, nested_names = kimi_config(nested=True)
    flat, flat_names = kimi_config(nested=False)
    with pytest.raises(CheckpointError, match="at the top level .* under 'language_model.'"):
        detect_format(flat, nested_names)  # K2 config with K2.5 tensors
    with pytest.raises(CheckpointError, match="is nested .* not under 'language_model.'"):
        detect_format(nested, flat_names)
    with pytest.raises(CheckpointError, match="no quantization_config, but tensor .*weight_packed"):
        detect_format({}, flat_names)
    with pytest.raises(CheckpointError, match="mix"):
        detect_format({}, ["language_model.model.layers.0.x.weight", "model.layers.0.x.weight"])


# ---- broken checkpoints on disk ----

def test_rejects_missing_shard(fixture_dir, tmp_path: Path) -> None:
    path = editable_copy(fixture_dir("kimi-k2.5"), tmp_path)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing shard") as info:
        inspect_checkpoint(path)
    assert str(info.value).startswith(f"{path / 'model-00002-of-00003.safetensors'}: ")


def test_rejects_truncated_shard(fixture_dir, tmp_path: Path) -> None:
    path = editable_copy(fixture_dir("deepseek-v3"), tmp_path)
    shard = path / "model-00003-of-00003.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="truncated") as info:
        inspect_checkpoint(path)
    assert str(shard) in str(info.value)


def test_rejects_index_naming_an_absent_tensor(fixture_dir, tmp_path: Path) -> None:
    path = editable_copy(fixture_dir("kimi-k2"), tmp_path)
    index = read_json(path / INDEX)
    index["weight_map"]["model.layers.1.mlp.experts.9.up_proj.weight_packed"] = "model-00002-of-00003.safetensors"
    write_json(path / INDEX, index)
    with pytest.raises(CheckpointError) as info:
        inspect_checkpoint(path)
    assert str(info.value).startswith(
        f"{path / 'model-00002-of-00003.safetensors'}: tensor 'model.layers.1.mlp.experts.9.up_proj.weight_packed': "
        "is named in model.safetensors.index.json but absent from this shard")


def test_rejects_tensor_missing_from_index(fixture_dir, tmp_path: Path) -> None:
    path = editable_copy(fixture_dir("bf16"), tmp_path)
    index = read_json(path / INDEX)
    del index["weight_map"]["model.norm.weight"]
    write_json(path / INDEX, index)
    with pytest.raises(CheckpointError, match="tensor 'model.norm.weight': is in this shard but"):
        inspect_checkpoint(path)


def test_rejects_unreadable_index(fixture_dir, tmp_path: Path) -> None:
    path = editable_copy(fixture_dir("bf16"), tmp_path)
    (path / INDEX).write_text('{"weight_map": {"a": ')
    with pytest.raises(CheckpointError, match=f"{INDEX}: cannot be read as JSON"):
        inspect_checkpoint(path)


def test_rejects_packed_weight_without_scale_in_any_shard(fixture_dir, tmp_path: Path) -> None:
    path = editable_copy(fixture_dir("kimi-k2.5"), tmp_path)
    index = read_json(path / INDEX)
    weight_map = index["weight_map"]
    # The deliberately split pair: the scale lives in another shard than its packed weight.
    packed = next(n for n in weight_map if n.endswith(".weight_packed")
                  and weight_map[n] != weight_map[n.replace("weight_packed", "weight_scale")])
    scale = packed.replace("weight_packed", "weight_scale")
    scale_shard = path / weight_map.pop(scale)
    tensors = load_file(scale_shard)
    del tensors[scale]
    save_file(tensors, scale_shard, metadata={"format": "pt"})
    write_json(path / INDEX, index)
    with pytest.raises(CheckpointError) as info:
        inspect_checkpoint(path)
    assert str(info.value).startswith(f"{path / weight_map[packed]}: tensor '{packed}': has no companion '{scale}'")


def test_inspect_reports_config_errors_with_the_config_path(fixture_dir, tmp_path: Path) -> None:
    path = editable_copy(fixture_dir("kimi-k2.5"), tmp_path)
    config = read_json(path / "config.json")
    config["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 128
    write_json(path / "config.json", config)
    with pytest.raises(CheckpointError) as info:
        inspect_checkpoint(path)
    assert str(info.value).startswith(
        f"{path / 'config.json'}: text_config.quantization_config.config_groups.group_0.weights.group_size is 128;")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        inspect_checkpoint(path)

