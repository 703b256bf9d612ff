"""Recipe loading and validation: every shipped recipe loads, and every rule we encode
rejects a bad value with a message that names the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ktflow.errors import RecipeError
from ktflow.recipe import (
    Recipe,
    int8_threadpool_count,
    load_recipe,
    needs_bf16_weights,
    needs_int8_weights,
    recipe_from_mapping,
)

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
SHIPPED = [
    "tiny-demo.yaml",
    "kimi-k2.5-rawint4.yaml",
    "kimi-k2.5-bf16-int8.yaml",
    "deepseek-v3-fp8.yaml",
    "qwen3-30b-a3b-bf16.yaml",
    "deepseek-v2-lite-bf16.yaml",
]


def raw(name: str) -> dict:
    return yaml.safe_load((RECIPES / name).read_text())


def rejected(name: str, *overrides: str) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(RECIPES / name, overrides)
    return str(info.value)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipes_load(name: str) -> None:
    recipe = load_recipe(RECIPES / name)
    assert isinstance(recipe, Recipe)
    assert recipe.name == name.removesuffix(".yaml")


def test_recipe_set_is_exactly_the_shipped_one() -> None:
    assert sorted(p.name for p in RECIPES.glob("*.yaml")) == sorted(SHIPPED)


def test_weight_plans_of_shipped_recipes() -> None:
    plans = {
        name: (needs_bf16_weights(r := load_recipe(RECIPES / name)), needs_int8_weights(r))
        for name in SHIPPED
    }
    assert plans == {
        "tiny-demo.yaml": (True, True),
        "kimi-k2.5-rawint4.yaml": (False, False),  # native INT4 all the way: no 2 TB copy
        "kimi-k2.5-bf16-int8.yaml": (True, True),
        "deepseek-v3-fp8.yaml": (False, False),
        "qwen3-30b-a3b-bf16.yaml": (True, False),
        "deepseek-v2-lite-bf16.yaml": (True, False),
    }
    assert int8_threadpool_count(load_recipe(RECIPES / "kimi-k2.5-bf16-int8.yaml")) == 2


# ---------------------------------------------------------------- structure and types


def test_missing_file() -> None:
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe(RECIPES / "nope.yaml")


def test_invalid_yaml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)


def test_top_level_must_be_mapping(tmp_path: Path) -> None:
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="mapping at the top level"):
        load_recipe(bad)


def test_unknown_key_suggests_the_close_one() -> None:
    message = rejected("tiny-demo.yaml", "sft.lora_rnak=4")
    assert "sft.lora_rnak: unknown key; did you mean 'sft.lora_rank'?" in message
    assert "tiny-demo.yaml" in message


def test_unknown_nested_key_suggests_within_its_section() -> None:
    message = rejected("kimi-k2.5-rawint4.yaml", "sft.kt_config.kt_bakend=FP8")
    assert "did you mean 'sft.kt_config.kt_backend'?" in message


def test_unknown_key_without_close_match_lists_allowed_keys() -> None:
    message = rejected("tiny-demo.yaml", "store.zzz=1")
    assert "store.zzz: unknown key; allowed keys: root" in message


def test_gradient_checkpointing_spelling_hint() -> None:
    message = rejected("tiny-demo.yaml", "sft.gradient_checkpointing=true")
    assert "disable_gradient_checkpointing" in message


def test_derived_kt_key_is_refused_with_hint() -> None:
    message = rejected("kimi-k2.5-rawint4.yaml", "sft.kt_config.kt_lora_rank=8")
    assert "sft.kt_config.kt_lora_rank: unknown key" in message
    assert "set sft.lora_rank instead" in message


def test_wrong_type_names_field_and_value() -> None:
    message = rejected("tiny-demo.yaml", "sft.lora_rank=abc")
    assert "sft.lora_rank" in message and "'abc'" in message


def test_out_of_range_port() -> None:
    assert "serving.port" in rejected("tiny-demo.yaml", "serving.port=99999")


def test_port_auto_is_for_the_llamafactory_backend() -> None:
    assert load_recipe(RECIPES / "tiny-demo.yaml").serving.port == "auto"
    assert load_recipe(RECIPES / "tiny-demo.yaml", ["serving.port=8000"]).serving.port == 8000
    for value, says in (("0", "must be greater than or equal to 1"), ("true", "True is not a port"),
                        ("nine", "'nine' is not a port: give a number 1-65535, or 'auto'")):
        message = rejected("tiny-demo.yaml", f"serving.port={value}")
        assert "serving.port: " in message and says in message, message
    message = rejected("kimi-k2.5-rawint4.yaml", "serving.port=auto")
    assert "serving.port: 'auto' is for the llamafactory backend" in message, message


def test_missing_required_section() -> None:
    data = raw("tiny-demo.yaml")
    del data["dataset"]
    with pytest.raises(RecipeError, match="dataset: required field is missing"):
        recipe_from_mapping(data)


def test_several_errors_are_all_reported() -> None:
    message = rejected("tiny-demo.yaml", "sft.lora_rank=abc", "serving.port=0")
    assert "sft.lora_rank" in message and "serving.port" in message


def test_source_needs_exactly_one_location() -> None:
    message = rejected("kimi-k2.5-rawint4.yaml", "source.local_path=/models/kimi")
    assert "source.repo_id: set exactly one of repo_id, local_path, uri (got repo_id, local_path)" in message


def test_repo_id_shape() -> None:
    assert "is not a hub repo id" in rejected("kimi-k2.5-rawint4.yaml", "source.repo_id=kimi")


def test_dataset_name_pattern() -> None:
    assert "dataset.name" in rejected("tiny-demo.yaml", "dataset.name=Bad Name")


def test_unknown_source_format() -> None:
    assert "source.format" in rejected("tiny-demo.yaml", "source.format=gguf")


# ---------------------------------------------------------------- overrides


def test_override_parses_yaml_values() -> None:
    recipe = load_recipe(RECIPES / "tiny-demo.yaml", ["sft.max_steps=3", "sft.bf16=true", "serving.port=9000"])
    assert recipe.sft.max_steps == 3 and recipe.sft.bf16 is True and recipe.serving.port == 9000


def test_override_creates_missing_sections() -> None:
    recipe = load_recipe(RECIPES / "tiny-demo.yaml", ["sft.extra_args.weight_decay=0.01"])
    assert recipe.sft.extra_args == {"weight_decay": 0.01}


def test_override_syntax_error() -> None:
    assert "expected dotted.key=value" in rejected("tiny-demo.yaml", "sft.max_steps")


def test_override_into_a_value_is_refused() -> None:
    assert "'sft.max_steps' is a value" in rejected("tiny-demo.yaml", "sft.max_steps.x=1")


def test_overrides_are_validated_like_the_file() -> None:
    assert "unknown key" in rejected("tiny-demo.yaml", "nonsense=1")


def test_mapping_input_is_not_mutated() -> None:
    data = raw("tiny-demo.yaml")
    recipe_from_mapping(data, ["sft.max_steps=1"])
    assert data == raw("tiny-demo.yaml") and data["sft"]["max_steps"] != 1


# ---------------------------------------------------------------- KT 0.7 SFT rules (kt_kernel.sft.config)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("sft.lora_rank=16", "sft.lora_rank: RAWINT4 SFT requires 8 (got 16)"),
        ("sft.lora_dropout=0.1", "sft.lora_dropout: RAWINT4 SFT requires 0 (got 0.1)"),
        ("sft.kt_config.kt_threadpool_count=4", "sft.kt_config.kt_threadpool_count: RAWINT4 SFT supports CPU TP1/TP2 only"),
        ("sft.kt_config.kt_num_gpu_experts=2", "sft.kt_config.kt_num_gpu_experts: RAWINT4 SFT requires 0 (got 2)"),
        ("sft.kt_config.kt_share_backward_bb=true", "sft.kt_config.kt_share_backward_bb: RAWINT4 SFT computes backward"),
        ("sft.kt_config.kt_force_fused_expert_lora=false",
         "sft.kt_config.kt_force_fused_expert_lora: RAWINT4 SFT requires true"),
        ("sft.finetuning_type=full", "sft.finetuning_type: RAWINT4 SFT supports frozen-base LoRA only"),
        ("sft.kt_config.kt_backend=FP8", "sft.kt_config.kt_backend: 'FP8' conflicts with kt_expert_weight_format 'rawint4'"),
        ("sft.kt_config.kt_weight_lifecycle=ephemeral", "sft.kt_config.kt_weight_lifecycle: 'ephemeral'"),
        ("sft.kt_config.kt_model_max_length=1024", "sft.kt_config.kt_model_max_length: 1024 is below cutoff_len (4096)"),
    ],
)
def test_rawint4_rules(override: str, expected: str) -> None:
    assert expected in rejected("kimi-k2.5-rawint4.yaml", override)


def test_rawint4_threadpool_only_counts_with_tp_enabled() -> None:
    recipe = load_recipe(
        RECIPES / "kimi-k2.5-rawint4.yaml",
        ["sft.kt_config.kt_tp_enabled=false", "sft.kt_config.kt_threadpool_count=4"],
    )
    assert recipe.sft.kt_config is not None and recipe.sft.kt_config.effective_threadpool_count == 1


def test_backend_case_is_normalized() -> None:
    recipe = load_recipe(RECIPES / "kimi-k2.5-rawint4.yaml", ["sft.kt_config.kt_backend=rawint4"])
    assert recipe.sft.kt_config is not None and recipe.sft.kt_config.kt_backend == "RAWINT4"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("sft.kt_config.kt_num_gpu_experts=1", "sft.kt_config.kt_num_gpu_experts: FP8 SFT requires 0"),
        ("sft.kt_config.kt_share_backward_bb=false", "sft.kt_config.kt_share_backward_bb: FP8 SFT requires true"),
    ],
)
def test_fp8_rules(override: str, expected: str) -> None:
    assert expected in rejected("deepseek-v3-fp8.yaml", override)


@pytest.mark.parametrize("fmt", ["int8", "mxfp4"])
def test_weight_formats_ktflow_cannot_feed_are_refused(fmt: str) -> None:
    message = rejected(
        "kimi-k2.5-bf16-int8.yaml", f"sft.kt_config.kt_expert_weight_format={fmt}", "sft.kt_config.kt_backend=auto"
    )
    assert f"sft.kt_config.kt_expert_weight_format: '{fmt}' needs pre-quantized KT SFT weights" in message


def test_rawint4_needs_an_int4_source() -> None:
    message = rejected("kimi-k2.5-rawint4.yaml", "source.format=bf16", "serving.kt_method=BF16")
    assert "sft.kt_config.kt_expert_weight_format: rawint4 experts need a Kimi INT4 source" in message


def test_fp8_needs_an_fp8_source() -> None:
    message = rejected("deepseek-v3-fp8.yaml", "source.format=bf16", "serving.kt_method=BF16")
    assert "fp8 experts need a DeepSeek FP8 source" in message


def test_kt_needs_kt_config() -> None:
    data = raw("kimi-k2.5-bf16-int8.yaml")
    del data["sft"]["kt_config"]
    with pytest.raises(RecipeError, match="sft.kt_config: backend 'kt' needs a kt_config mapping"):
        recipe_from_mapping(data)


def test_kt_needs_a_gpu() -> None:
    assert "sft.gpus: backend 'kt' needs at least one GPU" in rejected("kimi-k2.5-bf16-int8.yaml", "sft.gpus=0")


# ---------------------------------------------------------------- legacy vs 0.7 never mixed


def test_legacy_fields_refused_with_kt_07() -> None:
    message = rejected("kimi-k2.5-rawint4.yaml", "sft.cpu_infer=32")
    assert "backend 'kt' (KTransformers 0.7) does not take the legacy field(s) cpu_infer; never mix them" in message


def test_kt_07_fields_refused_with_legacy() -> None:
    message = rejected("deepseek-v2-lite-bf16.yaml", "sft.kt_cpu_activation=recompute")
    assert "backend 'kt-legacy' does not take the KTransformers 0.7 field(s) kt_cpu_activation" in message


def test_legacy_needs_its_rule() -> None:
    data = raw("deepseek-v2-lite-bf16.yaml")
    del data["sft"]["kt_optimize_rule"]
    with pytest.raises(RecipeError, match="sft.kt_optimize_rule: backend 'kt-legacy' needs an injection rule"):
        recipe_from_mapping(data)


def test_hf_backend_takes_no_kt_fields() -> None:
    assert "backend 'hf' (plain LlamaFactory) does not take KT field(s) chunk_size" in rejected(
        "tiny-demo.yaml", "sft.chunk_size=8192"
    )


def test_extra_args_cannot_override_owned_arguments() -> None:
    message = rejected("tiny-demo.yaml", "sft.extra_args.output_dir=/tmp/x")
    assert "extra_args may not set output_dir" in message
    assert "kt_num_threads" in rejected("tiny-demo.yaml", "sft.extra_args.kt_num_threads=4")


# ---------------------------------------------------------------- serving rules (sglang-kt LoRA)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("serving.kt_num_gpu_experts=4", "serving.kt_num_gpu_experts: must be 0 when serving a LoRA adapter"),
        ("serving.kt_gpu_prefill_token_threshold=1024", "serving.kt_gpu_prefill_token_threshold: cannot be used"),
        ("serving.kt_enable_dynamic_expert_update=true", "serving.kt_enable_dynamic_expert_update: cannot be used"),
        ("serving.max_running_requests=1", "serving.max_running_requests: must be >= 2 for KT LoRA serving (got 1)"),
        ("serving.gpus=0", "serving.gpus: backend 'sglang' needs at least one GPU"),
        ("serving.kt_method=AMXINT4", "serving.kt_method"),
        ("serving.extra_args=[--pp-size=2]", "serving.extra_args: --pp-size=2 is a flag ktflow sets or refuses"),
        ("serving.api_key_env=my key", "serving.api_key_env"),
    ],
)
def test_sglang_rules(override: str, expected: str) -> None:
    """KT's LoRA path's rules, on the Kimi recipe served through it (it ships merged)."""
    assert expected in rejected("kimi-k2.5-rawint4.yaml", "serving.mode=lora", override)


def test_the_kimi_recipe_serves_merged_and_the_lora_path_turns_graphs_off() -> None:
    merged = load_recipe(RECIPES / "kimi-k2.5-rawint4.yaml")
    assert merged.serving.resolved_mode == "merged" and merged.serving.disable_cuda_graph is False
    assert load_recipe(RECIPES / "kimi-k2.5-rawint4.yaml", ["serving.mode=merged", "serving.kt_num_gpu_experts=4"])


def test_sglang_needs_a_method() -> None:
    data = raw("qwen3-30b-a3b-bf16.yaml")
    del data["serving"]["kt_method"]
    with pytest.raises(RecipeError, match="serving.kt_method: backend 'sglang' needs one of"):
        recipe_from_mapping(data)


def test_llamafactory_serving_takes_no_kt_fields() -> None:
    assert "backend 'llamafactory' does not take kt_method" in rejected("tiny-demo.yaml", "serving.kt_method=BF16")


def test_rawint4_serving_needs_int4_source() -> None:
    message = rejected("qwen3-30b-a3b-bf16.yaml", "serving.kt_method=RAWINT4")
    assert "serving.kt_method: RAWINT4 serves the original Kimi INT4 checkpoint, but source.format is 'bf16'" in message


def test_fp8_serving_needs_fp8_source() -> None:
    assert "serving.kt_method: FP8 serves" in rejected("qwen3-30b-a3b-bf16.yaml", "serving.kt_method=FP8")


def test_int8_threadpool_must_match_serving() -> None:
    message = rejected("kimi-k2.5-bf16-int8.yaml", "conversion.int8_threadpool_count=4")
    assert "conversion.int8_threadpool_count: 4 differs from serving.kt_threadpool_count (2)" in message


def test_int8_never_conflicts_with_amxint8() -> None:
    assert "conversion.int8: 'never', but serving.kt_method AMXINT8" in rejected(
        "kimi-k2.5-bf16-int8.yaml", "conversion.int8=never"
    )


# ---------------------------------------------------------------- evaluation


def test_enabled_evaluation_needs_files() -> None:
    assert "evaluation.files: evaluation is enabled but lists no files" in rejected(
        "tiny-demo.yaml", "evaluation.files=[]"
    )


def test_accuracy_gate_needs_multiple_choice() -> None:
    assert "evaluation.gate_metric: 'accuracy' needs task: multiple_choice" in rejected(
        "tiny-demo.yaml", "evaluation.gate_metric=accuracy"
    )


def test_recipe_is_a_json_schema_for_the_ui() -> None:
    schema = Recipe.model_json_schema()
    assert {"source", "dataset", "sft", "serving"} <= set(schema["required"])
    assert schema["$defs"]["SftConfig"]["additionalProperties"] is False


def test_cpu_activation_recompute_needs_gpu_gradient_checkpointing() -> None:
    # LlamaFactory-kt refuses it at launch (get_kt_activation_policy); found on the GPU host.
    message = rejected("qwen3-30b-a3b-bf16.yaml", "sft.kt_cpu_activation=recompute",
                       "sft.disable_gradient_checkpointing=true")
    assert "sft.kt_cpu_activation: 'recompute' needs GPU gradient checkpointing" in message
    assert "use kt_cpu_activation: retain" in message
    for ok in (["sft.kt_cpu_activation=retain", "sft.disable_gradient_checkpointing=true"],
               ["sft.kt_cpu_activation=null", "sft.disable_gradient_checkpointing=true"]):  # unset: follows the GPU side
        load_recipe(RECIPES / "qwen3-30b-a3b-bf16.yaml", ok)


def test_kt_backend_on_a_deepseek_v2_hub_model_is_refused_before_any_download() -> None:
    from ktflow.recipe import load_recipe

    with pytest.raises(RecipeError) as info:
        load_recipe(RECIPES / "deepseek-v2-lite-bf16.yaml",
                    ["sft.backend=kt", "sft.kt_optimize_rule=null", "sft.cpu_infer=null", "sft.chunk_size=null",
                     "sft.kt_config={kt_backend: AMXBF16}"])
    assert "cannot train deepseek-ai/DeepSeek-V2-Lite-Chat" in str(info.value) and "kt-legacy" in str(info.value)


def test_max_total_tokens_must_hold_one_full_context_and_is_sglang_only() -> None:
    with pytest.raises(RecipeError, match=r"max_total_tokens.*1024 tokens of KV pool.*context_length 2048"):
        load_recipe(RECIPES / "kimi-k2.5-rawint4.yaml", ["serving.max_total_tokens=1024"])
    assert load_recipe(RECIPES / "kimi-k2.5-rawint4.yaml",
                       ["serving.max_total_tokens=8192"]).serving.max_total_tokens == 8192
    with pytest.raises(RecipeError, match=r"backend 'llamafactory' does not take max_total_tokens"):
        load_recipe(RECIPES / "tiny-demo.yaml", ["serving.max_total_tokens=8192"])
