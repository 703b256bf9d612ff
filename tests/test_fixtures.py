"""The generated checkpoints are faithful: real names, dtypes, layouts, and bytes that the
reference library (compressed-tensors) decodes back to the BF16 fixture of the same seed."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ktflow.errors import InvalidInputError
from ktflow.fixtures import FixtureSpec, make_fixture
from ktflow.safetensors_io import read_header

KIMI_KINDS = ["kimi-k2.5", "kimi-k2"]
ROUTED = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.")


def index_of(path: Path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())


def all_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index_of(path)["weight_map"].values())):
        tensors.update(load_file(path / shard))
    return tensors


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize(
    ("option", "dims"),
    [
        ("--hidden 96", {"hidden": 96}),
        ("--moe-intermediate 64", {"moe_intermediate": 64}),
        ("--layers 1", {"layers": 1}),
        ("--experts 1", {"experts": 1}),
        ("--kind llama", {"kind": "llama"}),
    ],
)
def test_spec_rejects_bad_dims_naming_the_option(option: str, dims: dict) -> None:
    with pytest.raises(InvalidInputError) as info:
        FixtureSpec(**{"kind": "bf16", **dims})
    assert str(info.value).startswith(f"{option}: ")
    assert info.value.fix


def test_refuses_non_empty_out_dir_and_leaves_nothing_behind(fixture_dir, tmp_path: Path) -> None:
    existing = tmp_path / "taken"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(InvalidInputError, match="not an empty directory") as info:
        make_fixture(FixtureSpec(kind="bf16"), existing)
    assert str(existing) in str(info.value)
    assert (existing / "keep.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (make_fixture(FixtureSpec(kind="bf16", layers=2, experts=2), empty) / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "taken"]  # no .partial-* left


def test_same_spec_gives_identical_bytes_and_seed_changes_weights(fixture_dir, tmp_path: Path) -> None:
    again = make_fixture(FixtureSpec(kind="kimi-k2.5"), tmp_path / "again")
    first = fixture_dir("kimi-k2.5")
    files = sorted(p.name for p in first.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    seed0, seed1 = all_tensors(fixture_dir("bf16")), all_tensors(fixture_dir("bf16", seed=1))
    assert seed0.keys() == seed1.keys()
    name = "model.layers.1.self_attn.o_proj.weight"
    assert not torch.equal(seed0[name], seed1[name])


@pytest.mark.parametrize("kind", ["bf16", "kimi-k2.5", "kimi-k2", "deepseek-v3"])
def test_index_matches_shards(fixture_dir, kind: str) -> None:
    path = fixture_dir(kind)
    index = index_of(path)
    headers = {shard: read_header(path / shard) for shard in set(index["weight_map"].values())}
    assert len(headers) >= 2
    assert index["metadata"]["total_size"] == sum(t.nbytes for h in headers.values() for t in h.tensors.values())
    assert {name: shard for shard, h in headers.items() for name in h.tensors} == index["weight_map"]
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(headers):05d}\.safetensors", s) for s in headers)


@pytest.mark.parametrize("kind", ["bf16", "deepseek-v3", "kimi-k2"])
def test_flat_kinds_use_real_deepseek_names(fixture_dir, kind: str) -> None:
    names = set(index_of(fixture_dir(kind))["weight_map"])
    weight = "weight_packed" if kind == "kimi-k2" else "weight"
    for expert in range(8):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.2.mlp.experts.{expert}.{proj}.{weight}" in names
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate.weight",
            "model.layers.1.mlp.shared_experts.down_proj.weight",
            "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"} <= names
    assert not any("experts.gate_up_proj" in n or n.startswith("language_model.") for n in names)


def test_kimi_k25_layout(fixture_dir) -> None:
    path = fixture_dir("kimi-k2.5")
    config, weight_map = config_of(path), index_of(path)["weight_map"]
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["model_type"] == "kimi_k25"
    assert "quantization_config" not in config
    quant = config["text_config"]["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["format"] == "pack-quantized"
    weights = quant["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["type"], weights["strategy"], weights["group_size"], weights["symmetric"]) \
        == (4, "int", "group", 32, True)
    assert quant["config_groups"]["group_0"]["input_activations"] is None
    for module in config["auto_map"].values():
        assert (path / (module.split(".")[0] + ".py")).is_file()
    assert all(n.startswith(("language_model.", "vision_tower.", "mm_projector.")) for n in weight_map)
    vision = [n for n in weight_map if n.startswith(("vision_tower.", "mm_projector."))]
    assert any(n.startswith("vision_tower.") for n in vision) and any(n.startswith("mm_projector.") for n in vision)

    split = [n for n in weight_map if n.endswith(".weight_packed")
             and weight_map[n] != weight_map[n.replace("weight_packed", "weight_scale")]]
    assert split, "no weight_scale lives in another shard than its weight_packed"

    tensors = all_tensors(path)
    assert all(tensors[n].dtype == torch.bfloat16 for n in vision)
    packed = "language_model.model.layers.1.mlp.experts.3.down_proj"
    assert tensors[f"{packed}.weight_packed"].dtype == torch.int32
    assert tuple(tensors[f"{packed}.weight_packed"].shape) == (256, 128 // 8)
    assert tensors[f"{packed}.weight_scale"].dtype == torch.bfloat16
    assert tuple(tensors[f"{packed}.weight_scale"].shape) == (256, 128 // 32)
    assert tensors[f"{packed}.weight_shape"].dtype == torch.int32
    assert tensors[f"{packed}.weight_shape"].tolist() == [256, 128]
    bias = tensors["language_model.model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().max() > 0
    quantized_modules = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".weight_packed")}
    assert len(quantized_modules) == 2 * 8 * 3 and all(ROUTED.search(m + ".") for m in quantized_modules)
    assert "language_model.model.layers.1.mlp.shared_experts.gate_proj.weight" in tensors


def test_kimi_k2_layout(fixture_dir) -> None:
    path = fixture_dir("kimi-k2")
    config = config_of(path)
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["model_type"] == "kimi_k2"
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert "text_config" not in config
    for module in config["auto_map"].values():
        assert (path / (module.split(".")[0] + ".py")).is_file()
    tensors = all_tensors(path)
    assert tensors["model.layers.2.mlp.experts.7.gate_proj.weight_shape"].dtype == torch.int32
    assert tensors["model.layers.2.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_deepseek_v3_layout(fixture_dir) -> None:
    path = fixture_dir("deepseek-v3")
    config = config_of(path)
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    tensors = all_tensors(path)
    fp8 = {n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn}
    assert fp8 == {n.replace("_scale_inv", "") for n in tensors if n.endswith(".weight_scale_inv")}
    assert len(fp8) == 5 * 3 + 3 + 2 * (3 + 8 * 3)  # attention, dense MLP, shared + routed experts
    for name in fp8:
        scale = tensors[name + "_scale_inv"]
        rows, cols = tensors[name].shape
        assert scale.dtype == torch.float32
        assert tuple(scale.shape) == (math.ceil(rows / 128), math.ceil(cols / 128))
    assert any(tensors[n].shape[0] % 128 for n in fp8), "no partial edge block"
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.1.self_attn.q_a_layernorm.weight"):
        assert tensors[name].dtype == torch.bfloat16
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


@pytest.mark.parametrize("kind", KIMI_KINDS)
def test_int4_decoded_by_compressed_tensors_matches_bf16(fixture_dir, reference_bf16_dir, kind: str) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    quantized, decoded = all_tensors(fixture_dir(kind)), all_tensors(reference_bf16_dir(kind))
    prefix = "language_model." if kind == "kimi-k2.5" else ""
    bf16 = {prefix + n: t for n, t in all_tensors(fixture_dir("bf16")).items()}
    assert {n for n in decoded if not n.startswith(("vision_tower.", "mm_projector."))} == set(bf16)
    experts = 0
    for name, original in bf16.items():
        if not ROUTED.search(name):
            assert decoded[name].dtype == original.dtype and torch.equal(decoded[name], original), name
            continue
        experts += 1
        module = name.removesuffix(".weight")
        scale = quantized[f"{module}.weight_scale"].float().repeat_interleave(32, dim=1)
        codes = unpack_from_int32(quantized[f"{module}.weight_packed"], 4, quantized[f"{module}.weight_shape"])
        assert codes.min() >= -7 and codes.max() <= 7 and codes.abs().max() == 7  # Kimi's grid
        w, w_hat = original.float(), decoded[name].float()
        assert decoded[name].dtype == torch.bfloat16
        assert torch.all((w - w_hat).abs() <= scale / 2 + w_hat.abs() * 2**-8 + 1e-12), name
    assert experts == 2 * 8 * 3


def test_fp8_decoded_by_compressed_tensors_matches_bf16(fixture_dir, reference_bf16_dir) -> None:
    quantized, decoded = all_tensors(fixture_dir("deepseek-v3")), all_tensors(reference_bf16_dir("deepseek-v3"))
    bf16 = all_tensors(fixture_dir("bf16"))
    assert set(decoded) == set(bf16)
    for name, original in bf16.items():
        if f"{name}_scale_inv" not in quantized:
            assert torch.equal(decoded[name], original), name
            continue
        block_scale = quantized[f"{name}_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
        block_scale = block_scale[: original.shape[0], : original.shape[1]]
        w, w_hat = original.float(), decoded[name].float()
        # e4m3: half an ulp is 2^-4 relative for normals, 2^-10 * scale for subnormals; then BF16 rounding.
        assert torch.all((w - w_hat).abs() <= w.abs() * 2**-4 + block_scale * 2**-10 + w_hat.abs() * 2**-8), name


def test_bf16_fixture_loads_natively_and_gives_finite_logits(fixture_dir) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fixture_dir("bf16"), dtype=torch.float32)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().max() > 0  # loaded, not re-initialized
    logits = model(torch.arange(3, 19).unsqueeze(0)).logits
    assert logits.shape == (1, 16, model.config.vocab_size) and torch.isfinite(logits).all()
    assert logits.std() > 0.01


@pytest.mark.parametrize("kind", KIMI_KINDS)
def test_kimi_remote_code_loads_decoded_copy_close_to_bf16(fixture_dir, reference_bf16_dir, kind: str) -> None:
    from transformers import AutoModelForCausalLM

    input_ids = torch.arange(3, 19).unsqueeze(0)
    reference = AutoModelForCausalLM.from_pretrained(fixture_dir("bf16"), dtype=torch.float32)
    model, loading = AutoModelForCausalLM.from_pretrained(
        reference_bf16_dir(kind), trust_remote_code=True, dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == {"kimi-k2.5": "KimiK25ForConditionalGeneration",
                                    "kimi-k2": "DeepseekV3ForCausalLM"}[kind]
    assert type(model).__module__.startswith("transformers_modules.")
    assert not loading["missing_keys"] and not loading["unexpected_keys"] and not loading["mismatched_keys"]
    with torch.no_grad():
        expected, got = reference(input_ids).logits, model(input_ids).logits
    assert torch.isfinite(got).all()
    # Only the routed experts differ (INT4); that moves logits a little, never wholesale.
    assert torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0) > 0.99
    assert (got - expected).abs().max() < 0.25 * expected.abs().max()


def test_tokenizer_loads_offline_and_applies_chatml(fixture_dir) -> None:
    from transformers import AutoTokenizer

    path = fixture_dir("bf16")
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == config_of(path)["vocab_size"]
    assert 300 <= len(tokenizer) <= 1000
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tokenizer(text)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    assert tokenizer.decode(ids) == text
    sample = "Fine-tune 1T experts: ü, 中文, emoji 🙂."
    assert tokenizer.decode(tokenizer(sample)["input_ids"]) == sample  # byte-level: no unknowns
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id
    for kind in ("kimi-k2.5", "kimi-k2", "deepseek-v3"):
        assert (fixture_dir(kind) / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()


def test_the_demo_model_is_made_once_and_replaced_when_made_from_another_spec(tmp_path: Path) -> None:
    from ktflow.demo import DEMO_MODEL, ensure_demo_model

    model = tmp_path / "demo-model"
    assert ensure_demo_model(model) is True
    record = tmp_path / "demo-model.fixture.json"
    assert record.read_text() == DEMO_MODEL.model_dump_json()
    assert ensure_demo_model(model) is False  # kept: the same spec
    # An older ktflow's demo checkpoint (made before the spec was recorded) is replaced.
    record.unlink()
    stale = model / "stale-marker"
    stale.write_text("x")
    assert ensure_demo_model(model) is True
    assert not stale.exists() and (model / "config.json").exists() and record.is_file()


# --------------------------------------------------------------------------- deepseek-v2-lite


@pytest.mark.parametrize("architecture", ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
def test_deepseek_v2_lite_streamed_layers_match_what_transformers_saves(fixture_dir, tmp_path: Path,
                                                                        architecture: str) -> None:
    """Layers past the 2-layer template are generated, not saved by transformers: their names,
    shapes and dtypes must be exactly what save_pretrained of the whole model writes, and their
    values must be transformers' constants where it uses one and independent draws elsewhere."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = fixture_dir("deepseek-v2-lite", layers=4, architecture=architecture)
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == [architecture] and config.num_hidden_layers == 4
    assert (config.q_lora_rank, config.n_shared_experts, config.num_experts_per_tok) == (None, 2, 6)
    with torch.random.fork_rng(devices=[]):
        AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "whole")
    whole = {}
    for shard in (tmp_path / "whole").glob("*.safetensors"):
        whole.update(load_file(shard))
    tensors = all_tensors(path)
    assert {n: (t.shape, t.dtype) for n, t in tensors.items()} == {n: (t.shape, t.dtype) for n, t in whole.items()}
    constant = [n for n, t in whole.items() if bool((t == t.flatten()[0]).all())]
    assert any(n.endswith("input_layernorm.weight") for n in constant)
    if architecture == "DeepseekV3ForCausalLM":
        assert "model.layers.3.mlp.gate.e_score_correction_bias" in constant
    for name in constant:
        assert torch.equal(tensors[name], whole[name]), name
    generated = {n: t for n, t in tensors.items() if re.search(r"\.layers\.[23]\.", n) and n not in constant}
    assert abs(generated["model.layers.3.mlp.experts.5.up_proj.weight"].float().std().item() - 0.02) < 0.002
    first_values = {tuple(t.flatten()[:16].tolist()) for t in generated.values()}
    assert len(first_values) == len(generated)  # every generated tensor is its own draw


def test_deepseek_v2_lite_trains_natively(fixture_dir) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = fixture_dir("deepseek-v2-lite", layers=4)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(path)("The checkpoint has shards and an index.", return_tensors="pt").input_ids
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert math.isfinite(loss.item())
    assert model.model.layers[3].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_deepseek_v2_lite_full_size_has_the_real_model_dimensions() -> None:
    """Checked on the meta device: the full-size checkpoint (31 GB) is written only on the GPU host."""
    from transformers import DeepseekV2ForCausalLM

    from ktflow.fixtures import _deepseek_v2_lite_config

    spec = FixtureSpec(kind="deepseek-v2-lite", full_size=True)
    config = _deepseek_v2_lite_config(spec, vocab_size=402, eos_id=2, pad_id=0)
    assert (config.hidden_size, config.num_hidden_layers, config.n_routed_experts, config.n_shared_experts,
            config.num_experts_per_tok, config.moe_intermediate_size, config.kv_lora_rank, config.vocab_size,
            config.first_k_dense_replace) == (2048, 27, 64, 2, 6, 1408, 512, 102400, 1)
    with torch.device("meta"):
        model = DeepseekV2ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    assert 15.6e9 < params < 15.8e9, params  # DeepSeek-V2-Lite: 15.7B


@pytest.mark.parametrize(
    ("dims", "option"),
    [({"kind": "bf16"}, "--full-size with bf16"), ({"kind": "deepseek-v2-lite", "layers": 4}, "--layers 4")],
)
def test_full_size_refuses_other_kinds_and_tiny_dims(dims: dict, option: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        FixtureSpec(full_size=True, **dims)
    assert str(info.value).startswith(f"{option}: ")
    assert info.value.fix
