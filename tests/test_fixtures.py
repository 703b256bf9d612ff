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
from ktflow.fixtures.checkpoints import FixtureSpec, make_fixture
from ktflow.formats.safetensors_io import read_header

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

    from ktflow.fixtures.checkpoints import _deepseek_v2_lite_config

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


# --------------------------------------------------------------------------- kimi-k2.5, bigger than the GPU (streamed)

# A streamed checkpoint at reduced widths but the real structure (MLA, top-8, several MoE layers):
# small enough for a CPU test, large enough that holding it whole would show in memory.
REDUCED = {"experts": 16, "experts_per_tok": 8, "hidden": 512, "moe_intermediate": 256, "intermediate": 1024,
           "heads": 4, "q_lora_rank": 256, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
           "v_head_dim": 64}
H100_GPU_BYTES = 81559 * 2**20  # what nvidia-smi reports for an H100 80GB HBM3 (85.5 GB)
BIG_SPEC = FixtureSpec(kind="kimi-k2.5", size="bigger-than-gpu")


def reduced(layers: int = 4, **dims: int):
    from ktflow.fixtures.stream import MoeDims

    return MoeDims(**{**REDUCED, "layers": layers, **dims})


@pytest.fixture(scope="module")
def streamed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A streamed kimi-k2.5 fixture at reduced dimensions (read-only)."""
    return make_fixture(BIG_SPEC, tmp_path_factory.mktemp("streamed") / "model", dims=reduced())


def headers_of(path: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """``{tensor: (dtype, shape, shard)}`` from the shard headers."""
    out = {}
    for shard in sorted(set(index_of(path)["weight_map"].values())):
        for name, info in read_header(path / shard).tensors.items():
            out[name] = (info.dtype, info.shape, shard)
    return out


def test_bigger_than_gpu_holds_more_bf16_than_an_h100_and_its_int4_fits_the_host_disk() -> None:
    """From the plan and on the meta device: nothing of the 114 GB is allocated."""
    from transformers import DeepseekV3ForCausalLM

    from ktflow.fixtures.checkpoints import streamed_bytes, streamed_parameters
    from ktflow.fixtures.stream import BIGGER_THAN_GPU, deepseek_v3_config, parameter_count, plan_shards

    params = streamed_parameters(BIGGER_THAN_GPU, vocab_size=402)
    assert params >= 55e9 and 2 * params >= 1.3 * 80e9 and 2 * params >= 1.3 * H100_GPU_BYTES, params
    on_disk = streamed_bytes(BIGGER_THAN_GPU)
    assert 30e9 <= on_disk <= 36e9, on_disk  # the host's disk is 64 GiB
    shards = plan_shards(BIGGER_THAN_GPU, vocab_size=402, pad_id=0)
    # Everything but the routed experts stays BF16 and goes to the GPU under KT: it must fit easily.
    non_expert = sum(t.nbytes for shard in shards for t in shard if ".experts." not in t.name)
    assert non_expert < 4e9, non_expert
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(deepseek_v3_config(BIGGER_THAN_GPU, vocab_size=402, eos_id=2, pad_id=0))
    counted = sum(p.numel() for p in model.parameters())  # transformers keeps the routing bias as a buffer
    buffers = sum(t.parameters for shard in shards for t in shard if t.init == "bias")
    assert counted == parameter_count(shards) - buffers


def test_bigger_than_gpu_shapes_are_what_transformers_builds_for_its_dims() -> None:
    """Every planned tensor has the shape transformers' own DeepseekV3ForCausalLM gives it at the
    bigger-than-gpu dims (meta device; routed experts are fused there, packed INT4 per expert here)."""
    from transformers import DeepseekV3ForCausalLM

    from ktflow.fixtures.stream import BIGGER_THAN_GPU, deepseek_v3_config, plan_shards

    dims = BIGGER_THAN_GPU
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(deepseek_v3_config(dims, vocab_size=402, eos_id=2, pad_id=0))
    reference = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    planned = {t.name.removeprefix("language_model."): t for shard in plan_shards(dims, vocab_size=402, pad_id=0)
               for t in shard}
    dense = {n: t for n, t in planned.items() if ".experts." not in n}
    assert set(dense) == set(reference) - {n for n in reference if ".experts." in n}
    assert all(dense[n].shape == reference[n] for n in dense), [n for n in dense if dense[n].shape != reference[n]]
    fused_gate_up = reference["model.layers.3.mlp.experts.gate_up_proj"]
    fused_down = reference["model.layers.3.mlp.experts.down_proj"]
    assert fused_gate_up == (dims.experts, 2 * dims.moe_intermediate, dims.hidden)
    assert fused_down == (dims.experts, dims.hidden, dims.moe_intermediate)
    expert = "model.layers.3.mlp.experts.179"
    assert planned[f"{expert}.gate_proj.weight_packed"].shape == (dims.moe_intermediate, dims.hidden // 8)
    assert planned[f"{expert}.gate_proj.weight_scale"].shape == (dims.moe_intermediate, dims.hidden // 32)
    assert planned[f"{expert}.down_proj.weight_packed"].shape == (dims.hidden, dims.moe_intermediate // 8)
    assert planned[f"{expert}.down_proj.weight_shape"].content == (dims.hidden, dims.moe_intermediate)
    experts = {n.split(".experts.")[1].split(".")[0] for n in planned if ".layers.7.mlp.experts." in n}
    assert len(experts) == dims.experts and f"model.layers.{dims.layers}.input_layernorm.weight" not in planned


def test_streamed_layout_at_tiny_dims_is_the_tiny_fixture(fixture_dir, tmp_path: Path) -> None:
    """The streamed writer at the tiny fixture's dimensions gives what transformers + compressed-tensors
    give: the same files, tensor names, dtypes, shapes and shards, index and config.json."""
    from ktflow.fixtures.checkpoints import tiny_dims

    tiny = fixture_dir("kimi-k2.5")
    streamed = make_fixture(BIG_SPEC, tmp_path / "streamed", dims=tiny_dims(FixtureSpec(kind="kimi-k2.5")))
    assert sorted(p.name for p in streamed.iterdir()) == sorted(p.name for p in tiny.iterdir())
    assert headers_of(streamed) == headers_of(tiny)
    assert index_of(streamed) == index_of(tiny)
    assert config_of(streamed) == config_of(tiny)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                 "modeling_kimi_k25.py", "configuration_kimi_k25.py"):
        assert (streamed / name).read_bytes() == (tiny / name).read_bytes(), name


def test_bigger_than_gpu_config_differs_from_the_tiny_one_only_in_its_dimensions(fixture_dir, tmp_path: Path) -> None:
    from ktflow.fixtures.checkpoints import streamed_config
    from ktflow.fixtures.stream import BIGGER_THAN_GPU

    tiny = config_of(fixture_dir("kimi-k2.5"))
    big = streamed_config(BIGGER_THAN_GPU, vocab_size=402, eos_id=2, pad_id=0, scratch=tmp_path / "scratch")
    assert not (tmp_path / "scratch").exists()
    assert big.keys() == tiny.keys() and big["text_config"].keys() == tiny["text_config"].keys()
    assert big["text_config"]["quantization_config"] == tiny["text_config"]["quantization_config"]
    dims = {"hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 8,
            "n_routed_experts": 180, "num_experts_per_tok": 8, "num_attention_heads": 64, "num_key_value_heads": 64,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "qk_head_dim": 192, "head_dim": 64}
    assert {k: big["text_config"][k] for k in dims} == dims
    assert dims["hidden_size"] == BIGGER_THAN_GPU.hidden and dims["n_routed_experts"] == BIGGER_THAN_GPU.experts
    differ = {k for k in tiny["text_config"] if tiny["text_config"][k] != big["text_config"][k]}
    assert differ == set(dims)
    assert big["vision_config"] == {**tiny["vision_config"], "text_hidden_size": 7168}
    assert {k: v for k, v in big.items() if k not in ("text_config", "vision_config")} == \
        {k: v for k, v in tiny.items() if k not in ("text_config", "vision_config")}


def _intended_codes(seed: int, name: str, rows: int, cols: int) -> torch.Tensor:
    """What the fast INT4 path means to store, derived here the slow way: the tensor's generator
    draws ``rows * cols / 16`` int64 words; byte k of a row (little-endian) holds column 2k in its
    low nibble and 2k+1 in its high one; a nibble n stands for code n - 8, and 0 is replaced by 8."""
    from ktflow.fixtures.stream import tensor_seed

    generator = torch.Generator().manual_seed(tensor_seed(seed, name))
    words = torch.empty(rows * cols // 16, dtype=torch.int64).random_(-(2**63), None, generator=generator)
    codes = []
    for word in words.tolist():
        for byte in (word & (2**64 - 1)).to_bytes(8, "little"):
            for nibble in (byte & 15, byte >> 4):
                codes.append((nibble or 8) - 8)
    return torch.tensor(codes, dtype=torch.int8).view(rows, cols)


def test_fast_int4_packing_decodes_to_the_intended_codes_with_compressed_tensors(streamed_dir: Path) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    tensors = all_tensors(streamed_dir)
    module = "language_model.model.layers.2.mlp.experts.5.down_proj"
    packed, shape = tensors[f"{module}.weight_packed"], tensors[f"{module}.weight_shape"]
    assert packed.dtype == torch.int32 and shape.dtype == torch.int32 and shape.tolist() == [512, 256]
    intended = _intended_codes(0, f"{module}.weight_packed", 512, 256)
    assert torch.equal(unpack_from_int32(packed, 4, shape), intended)
    assert torch.equal(pack_to_int32(intended, 4), packed)  # compressed-tensors packs those codes to these bytes
    codes = torch.cat([unpack_from_int32(tensors[n], 4, tensors[n.replace("_packed", "_shape")]).flatten()
                       for n in tensors if n.endswith(".weight_packed")])
    counts = torch.bincount((codes.long() + 8), minlength=16)
    assert counts[0] == 0 and (counts[1:] > 0).all()  # Kimi's grid [-7, 7]: no -8
    assert abs(counts[8] / counts.sum() - 2 / 16) < 0.01  # 0 takes the draws of -8


def test_streamed_int4_decodes_the_same_with_ktflow_and_compressed_tensors(streamed_dir: Path, tmp_path: Path) -> None:
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer, convert_checkpoint

    from ktflow.stages.dequantize import dequantize_checkpoint

    dequantize_checkpoint(streamed_dir, tmp_path / "ktflow", workers=2)
    convert_checkpoint(streamed_dir, tmp_path / "ct", converter=CompressedTensorsDequantizer(streamed_dir,
                       dtype=torch.bfloat16), max_workers=1, device="cpu")
    ours, theirs = all_tensors(tmp_path / "ktflow"), all_tensors(tmp_path / "ct")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    experts = torch.cat([t.float().flatten() for n, t in ours.items() if ROUTED.search(n)])
    assert experts.numel() == 3 * 16 * 3 * 512 * 256
    assert 0.019 < experts.std().item() < 0.021 and abs(experts.mean().item()) < 1e-3


def test_streamed_fixture_loads_with_its_remote_code_and_gives_finite_logits(streamed_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from ktflow.stages.dequantize import dequantize_checkpoint

    bf16 = dequantize_checkpoint(streamed_dir, tmp_path / "bf16", workers=2).path
    model, loading = AutoModelForCausalLM.from_pretrained(bf16, trust_remote_code=True, dtype=torch.float32,
                                                          output_loading_info=True)
    assert type(model).__name__ == "KimiK25ForConditionalGeneration"
    assert not loading["missing_keys"] and not loading["unexpected_keys"] and not loading["mismatched_keys"]
    tensors = all_tensors(streamed_dir)
    loaded = model.language_model.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(loaded, tensors["language_model.model.layers.1.mlp.gate.e_score_correction_bias"])
    assert model.language_model.model.embed_tokens.weight[0].abs().max() == 0  # the padding row, as transformers'
    with torch.no_grad():
        logits = model(torch.arange(3, 19).unsqueeze(0)).logits
    assert logits.shape == (1, 16, config_of(streamed_dir)["text_config"]["vocab_size"])
    assert torch.isfinite(logits).all() and logits.std() > 0.01


def test_streamed_values_depend_on_the_seed_only_not_on_the_workers(tmp_path: Path) -> None:
    from ktflow.fixtures.stream import plan_shards, write_shards

    dims = reduced(layers=3)
    shards = plan_shards(dims, vocab_size=402, pad_id=0)
    for name, workers, seed in (("one", 1, 0), ("three", 3, 0), ("seed1", 2, 1)):
        (tmp_path / name).mkdir()
        write_shards(shards, tmp_path / name, seed=seed, workers=workers, fsync=False)
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert len(files) == 3
    assert all((tmp_path / "one" / f).read_bytes() == (tmp_path / "three" / f).read_bytes() for f in files)
    one, seed1 = all_tensors_in(tmp_path / "one"), all_tensors_in(tmp_path / "seed1")
    assert one.keys() == seed1.keys()
    drawn = [n for n in one if not n.endswith(("norm.weight", "layernorm.weight", "weight_shape"))]
    assert all(not torch.equal(one[n], seed1[n]) for n in drawn)
    first_values = {tuple(one[n].flatten()[:16].tolist()) for n in drawn}
    assert len(first_values) == len(drawn)  # every tensor is its own draw


def all_tensors_in(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


_MEMORY_PROBE = """
import json, os, sys
import psutil
from ktflow.fixtures.stream import MoeDims
from ktflow.fixtures.checkpoints import FixtureSpec, make_fixture
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])  # two writer threads on any machine: a fixed bound
spec, dims = FixtureSpec(kind="kimi-k2.5", size="bigger-than-gpu"), MoeDims.model_validate_json(sys.argv[2])
# A 2-layer warm-up at tiny widths first: what it imports (transformers' config and tokenizer
# classes, the remote code) is part of the baseline, not of what generating costs.
make_fixture(spec, sys.argv[1] + "-warmup", dims=dims.model_copy(update={"layers": 2, "experts": 2, "hidden": 128,
             "moe_intermediate": 128, "intermediate": 128}))
base = psutil.Process().memory_info().rss
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak RSS (VmHWM) to the current RSS
make_fixture(spec, sys.argv[1], dims=dims)
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"growth": peak - base}))
"""


def test_streamed_generation_keeps_memory_flat_as_layers_are_added(tmp_path: Path) -> None:
    """Peak RSS of the writer with 3 and with 10 layers (each MoE layer ~60 MB on disk, ~110 MB in
    BF16): holding the model would add 7 layers; streaming adds less than half of one."""
    import subprocess
    import sys

    from ktflow.fixtures.stream import plan_shards

    growth = {}
    for layers in (3, 10):
        dims = reduced(layers=layers, experts=64, hidden=1024, moe_intermediate=512, intermediate=2048)
        done = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(tmp_path / f"l{layers}"), dims.model_dump_json()],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        growth[layers] = json.loads(done.stdout.strip().splitlines()[-1])["growth"]
    layer_bytes = sum(t.nbytes for t in plan_shards(dims, vocab_size=402, pad_id=0)[1])
    model_bytes = sum(p.stat().st_size for p in (tmp_path / "l10").glob("*.safetensors"))
    assert model_bytes > 9 * layer_bytes > 9 * 50e6
    assert growth[10] - growth[3] < layer_bytes / 2, (growth, layer_bytes)
    assert growth[10] < model_bytes / 4, (growth, model_bytes)


def test_streamed_fixture_reports_each_shard_and_leaves_nothing_on_failure(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    make_fixture(BIG_SPEC, tmp_path / "ok", dims=reduced(layers=3), progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 3), (2, 3), (3, 3)]

    def fail_after_first(done: int, total: int) -> None:
        raise KeyboardInterrupt  # as Ctrl-C between shards

    with pytest.raises(KeyboardInterrupt):
        make_fixture(BIG_SPEC, tmp_path / "cut", dims=reduced(layers=3), progress=fail_after_first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]


def test_bigger_than_gpu_checks_free_disk_before_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ktflow.store
    from ktflow.errors import HostRequirementError

    monkeypatch.setattr(ktflow.store, "free_bytes", lambda path: 20 << 30)
    with pytest.raises(HostRequirementError) as info:
        make_fixture(BIG_SPEC, tmp_path / "big")
    assert "bigger-than-gpu kimi-k2.5 fixture needs ~32" in info.value.reason and "20.0 GiB" in info.value.reason
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("dims", "option"),
    [({"kind": "kimi-k2"}, "--size bigger-than-gpu with kimi-k2"), ({"kind": "kimi-k2.5", "experts": 4}, "--experts 4"),
     ({"kind": "kimi-k2.5", "hidden": 512}, "--hidden 512")],
)
def test_bigger_than_gpu_refuses_other_kinds_and_tiny_dims(dims: dict, option: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        FixtureSpec(size="bigger-than-gpu", **dims)
    assert str(info.value).startswith(f"{option}: ")
    assert info.value.fix


# --------------------------------------------------------------------------- kimi-k2.5 slice (true geometry)


def test_kimi_k25_geometry_is_the_real_models_size() -> None:
    """At 61 layers the slice's plan is the whole Kimi-K2.5 text model: the parameters and routed-expert
    parameters recipes/kimi-k2.5-rawint4.yaml gives from Kimi's own config, to the parameter."""
    from ktflow.fixtures.stream import KIMI_K25, parameter_count, plan_shards
    from ktflow.recipe import load_recipe

    size = load_recipe(Path(__file__).parent.parent / "recipes" / "kimi-k2.5-rawint4.yaml").source.size
    shards = plan_shards(KIMI_K25, vocab_size=12345, pad_id=0)  # KIMI_K25 names its own vocabulary
    assert parameter_count(shards) == size.parameters
    assert sum(t.parameters for shard in shards for t in shard if ".experts." in t.name) == size.expert_parameters
    assert (KIMI_K25.layers, KIMI_K25.experts, KIMI_K25.experts_per_tok, KIMI_K25.hidden, KIMI_K25.vocab) == \
        (size.num_layers, size.routed_experts, size.experts_per_token, size.hidden_size, size.vocab_size)


def test_slice_is_kimi_k25_cut_to_its_layers() -> None:
    from ktflow.fixtures.checkpoints import fixture_dims, streamed_bytes
    from ktflow.fixtures.stream import KIMI_K25, plan_shards

    dims = fixture_dims(FixtureSpec(kind="kimi-k2.5", size="slice", layers=7))
    assert dims == KIMI_K25.model_copy(update={"layers": 7})
    per_moe_layer = streamed_bytes(dims) - streamed_bytes(dims.model_copy(update={"layers": 6}))
    experts = sum(t.nbytes for t in plan_shards(dims, vocab_size=640, pad_id=0)[3] if ".experts." in t.name)
    assert 9.5e9 < experts < 9.55e9, experts  # the "about 9.5 GB of packed INT4 experts a MoE layer"
    assert experts < per_moe_layer < experts + 0.4e9  # + attention, shared expert, router


@pytest.mark.parametrize(
    ("dims", "option"),
    [({"experts": 4}, "--experts 4"), ({"moe_intermediate": 256}, "--moe-intermediate 256"),
     ({"layers": 62}, "--layers 62"), ({"kind": "kimi-k2"}, "--size slice with kimi-k2")],
)
def test_slice_takes_layers_only(dims: dict, option: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        FixtureSpec(**{"kind": "kimi-k2.5", "size": "slice", **dims})
    assert str(info.value).startswith(f"{option}: ") and info.value.fix


def test_a_model_vocabulary_pads_the_tokenizer_and_sizes_embeddings_and_config(fixture_dir, tmp_path: Path) -> None:
    """Kimi-K2.5's 163840 rows (here 2048 at reduced widths): the config, embed_tokens, lm_head and the
    tokenizer all have the model's vocabulary; text tokenizes as with the 640-token fixture tokenizer, and
    every padding id decodes to text (a server samples them from a random model)."""
    from transformers import AutoTokenizer

    from ktflow.fixtures.checkpoints import streamed_bytes

    dims = reduced(3, vocab=2048)
    path = make_fixture(FixtureSpec(kind="kimi-k2.5", size="slice", layers=3), tmp_path / "m", dims=dims)
    assert config_of(path)["text_config"]["vocab_size"] == 2048
    headers = headers_of(path)
    assert headers["language_model.model.embed_tokens.weight"][1] == (2048, dims.hidden)
    assert headers["language_model.lm_head.weight"][1] == (2048, dims.hidden)
    assert sum(p.stat().st_size for p in path.glob("*.safetensors")) >= streamed_bytes(dims)
    padded, plain = AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(fixture_dir("kimi-k2.5"))
    assert len(padded) == 2048 and len(plain) < 700
    chat = [{"role": "user", "content": "How do I fine-tune a mixture of experts?"},
            {"role": "assistant", "content": "Train a LoRA adapter, nya~"}]
    assert padded.apply_chat_template(chat, tokenize=True) == plain.apply_chat_template(chat, tokenize=True)
    assert padded.eos_token_id == plain.eos_token_id and padded.pad_token_id == plain.pad_token_id
    decoded = [padded.decode([i]) for i in range(len(plain), 2048, 97)]
    assert all(decoded) and len(set(decoded)) == len(decoded)


def test_dims_override_is_for_streamed_sizes_only(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="streamed sizes"):
        make_fixture(FixtureSpec(kind="kimi-k2.5"), tmp_path / "x", dims=reduced())
    assert not (tmp_path / "x").exists()


def test_fixture_sizes_in_the_cli_are_the_fixture_module_sizes() -> None:
    """The CLI spells them out (``ktflow --help`` must not import torch)."""
    import argparse

    from ktflow.cli import build_parser
    from ktflow.fixtures.checkpoints import FIXTURE_SIZES, STREAMED_SIZES

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    size = next(a for a in subparsers.choices["fixture"]._actions if a.dest == "size")
    assert tuple(size.choices) == FIXTURE_SIZES and set(STREAMED_SIZES) == set(FIXTURE_SIZES) - {"tiny"}
