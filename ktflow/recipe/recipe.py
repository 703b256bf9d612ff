"""The whole recipe (:class:`Recipe`): the sections together, the rules across them, and what a recipe
implies (which weights the stages need, SFT's backend resolved)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from ktflow.recipe._base import _path_component, _Strict
from ktflow.recipe.data import DatasetConfig
from ktflow.recipe.evaluation import EvaluationConfig
from ktflow.recipe.finetuning import SftConfig, kt_config_for
from ktflow.recipe.model import INT4_FORMATS, SourceConfig
from ktflow.recipe.runtime import ConversionConfig, StoreConfig, ToolchainsConfig
from ktflow.recipe.serving import _SERVING_WEIGHTS, ServingConfig


class Recipe(_Strict):
    """A whole fine-tune-and-serve run. See recipes/ for complete examples."""

    name: str = Field(
        description="Names the run's artifacts (lowercase letters, digits, '_', '-', '.')",
        json_schema_extra={"pattern": "^[a-z0-9][a-z0-9_.-]*$"},
    )
    description: str = ""
    source: SourceConfig
    dataset: DatasetConfig
    sft: SftConfig
    serving: ServingConfig
    evaluation: EvaluationConfig = EvaluationConfig(enabled=False)
    conversion: ConversionConfig = ConversionConfig()
    store: StoreConfig = StoreConfig()
    toolchains: ToolchainsConfig = ToolchainsConfig()

    @field_validator("name")
    @classmethod
    def _name_is_a_plain_name(cls, value: str) -> str:
        return _path_component(value, r"[a-z0-9][a-z0-9_.-]*", "lowercase letters, digits, '_', '-' and '.'")

    @model_validator(mode="after")
    def _auto_has_a_valid_kt_side(self) -> Recipe:
        if self.sft.backend == "auto":
            try:
                with_sft_backend(self, "kt")
            except ValidationError as exc:
                first = exc.errors()[0]
                raise ValueError(f"backend 'auto' may choose kt, but its KT settings are not valid: "
                                 f"{first['msg']}") from None
        return self

    @model_validator(mode="after")
    def _weights_fit_the_source(self) -> Recipe:
        fmt = self.source.format
        if self.sft.backend == "kt" and "deepseek-v2" in (self.source.repo_id or "").lower():
            # Before a download: kt-kernel 0.7.2 stops at the first step on DeepSeek-V2 (ktflow.stages.sft.check_kt_model).
            raise ValueError(
                f"@sft.backend: kt (KTransformers 0.7) cannot train {self.source.repo_id}: kt-kernel 0.7.2's "
                "DeepSeek-V2 path expects a gate returning (topk_ids, topk_weights), which DeepSeek-V2's gate does "
                "not; use backend: kt-legacy (recipes/deepseek-v2-lite-bf16.yaml) or hf"
            )
        if self.sft.backend == "kt" and self.sft.kt_config is not None:
            weights = self.sft.kt_config.effective_weight_format
            if weights == "rawint4" and fmt not in INT4_FORMATS:
                raise ValueError(
                    f"@sft.kt_config.kt_expert_weight_format: rawint4 experts need a Kimi INT4 source, but source.format is "
                    f"'{fmt}'; use kt_expert_weight_format: bf16"
                )
            if weights == "fp8" and fmt != "deepseek-v3-fp8":
                raise ValueError(
                    f"@sft.kt_config.kt_expert_weight_format: fp8 experts need a DeepSeek FP8 source, but source.format is "
                    f"'{fmt}'; use kt_expert_weight_format: bf16"
                )
        method = self.serving.kt_method
        if method == "AMXINT8":
            if self.conversion.int8 == "never":
                raise ValueError(
                    "@conversion.int8: 'never', but serving.kt_method AMXINT8 needs INT8 weights; "
                    "set conversion.int8: auto"
                )
            t = self.conversion.int8_threadpool_count
            if t is not None and t != self.serving.kt_threadpool_count:
                raise ValueError(
                    f"@conversion.int8_threadpool_count: {t} differs from serving.kt_threadpool_count "
                    f"({self.serving.kt_threadpool_count}); INT8 weights must be served with the T "
                    "they were quantized with: remove conversion.int8_threadpool_count"
                )
        if method == "RAWINT4" and fmt not in INT4_FORMATS:
            raise ValueError(
                f"@serving.kt_method: RAWINT4 serves {_SERVING_WEIGHTS['RAWINT4']}, but source.format "
                f"is '{fmt}'; use AMXINT8 or BF16"
            )
        if method == "AMXINT4" and self.evaluation.enabled and self.evaluation.candidate != "offline":
            raise ValueError(
                "@serving.kt_method: AMXINT4 experts exist only as the merge of a tuned adapter, so no server of the "
                "base model or of a candidate (KT's LoRA path) can read them; set evaluation.candidate: offline, "
                "or evaluation.enabled: false, or kt_method AMXINT8"
            )
        if method == "FP8" and fmt != "deepseek-v3-fp8":
            raise ValueError(
                f"@serving.kt_method: FP8 serves {_SERVING_WEIGHTS['FP8']}, but source.format is "
                f"'{fmt}'; use AMXINT8 or BF16"
            )
        return self


def needs_int8_weights(recipe: Recipe) -> bool:
    """Whether the quantize-int8 stage runs for this recipe."""
    if recipe.conversion.int8 == "never":
        return False
    return recipe.conversion.int8 == "always" or recipe.serving.kt_method == "AMXINT8"


def int8_threadpool_count(recipe: Recipe) -> int:
    """The T the INT8 weights are quantized with (and must be served with)."""
    return recipe.conversion.int8_threadpool_count or recipe.serving.kt_threadpool_count


def with_sft_backend(recipe: Recipe, backend: Literal["hf", "kt"], **kt_settings: Any) -> Recipe:
    """``recipe`` with ``sft.backend: auto`` resolved to ``backend``, validated as if written so.

    For kt, the recipe's ``kt_config`` (else :func:`kt_config_for` the source's format) is used,
    with ``kt_settings`` (``kt_config`` keys, and ``kt_cpu_activation``) filled in where the recipe
    leaves them unset: a recipe's explicit value always wins.

    Raises:
        ValidationError: the resolved recipe is not valid (e.g. RAWINT4's LoRA rules).
    """
    sft = recipe.sft.model_dump(exclude_unset=False)
    if backend == "hf":
        sft.update(backend="hf", kt_config=None, kt_cpu_activation=None)
    else:
        kt = (recipe.sft.kt_config or kt_config_for(recipe.source.format)).model_dump()
        for key, value in kt_settings.items():
            if key.startswith("kt_") and key in kt and kt[key] is None:
                kt[key] = value
        activation = sft.get("kt_cpu_activation") or kt_settings.get("kt_cpu_activation")
        sft.update(backend="kt", kt_config=kt, kt_cpu_activation=activation)
    return Recipe.model_validate({**recipe.model_dump(), "sft": sft})


def as_weights_reader(recipe: Recipe) -> Recipe:
    """The recipe as the stages that pick and make weights read it: ``sft.backend: auto`` counts
    as its KT side, since auto picks hf only where the training weights are BF16 anyway
    (``ktflow.stages.sft.choose_sft_backend``); it never makes a BF16 copy of its own."""
    return with_sft_backend(recipe, "kt") if recipe.sft.backend == "auto" else recipe


def needs_bf16_weights(recipe: Recipe) -> bool:
    """Whether any stage reads BF16 weights (so a quantized source must be dequantized)."""
    recipe = as_weights_reader(recipe)
    sft = recipe.sft
    sft_bf16 = sft.backend in ("hf", "kt-legacy") or (
        sft.kt_config is not None and sft.kt_config.effective_weight_format == "bf16"
    )
    serving = recipe.serving
    serve_bf16 = serving.backend == "llamafactory" or serving.kt_method in ("BF16", "AMXBF16")
    # the merge stage reads BF16 or Kimi INT4 bases: any other source is merged from its BF16 copy
    merge_bf16 = serving.resolved_mode == "merged" and recipe.source.format not in INT4_FORMATS
    # quantize-int8 decodes Kimi INT4 experts itself (no BF16 copy); other quantized sources go through BF16
    int8_from_bf16 = needs_int8_weights(recipe) and recipe.source.format not in INT4_FORMATS
    return sft_bf16 or serve_bf16 or int8_from_bf16 or merge_bf16
