"""The recipe: one pydantic model that says everything a pipeline run needs.

A recipe is loaded from YAML (:func:`load_recipe`), optionally varied with ``--set
dotted.key=value`` overrides, and validated in full before any stage starts: unknown keys
(with a "did you mean" hint), wrong types, and every combination we know cannot work
(KT backend rules from ``kt_kernel/sft/config.py``, legacy-vs-0.7 KT fields, serving
rules of the KT SGLang fork). The same model is the Prefect flow parameter, so the UI
renders it as a form and the server validates ``prefect deployment run --params``.

Field names inside ``sft`` and ``serving`` are the names LlamaFactory and SGLang use, so
a value can be looked up in their documentation as is.

The sections, one module each, in the order a recipe lists them: ``model`` (source), ``data``
(dataset), ``finetuning`` (sft), ``serving``, ``evaluation``, ``runtime`` (conversion, store,
toolchains); ``recipe`` puts them together in :class:`Recipe`, ``loading`` reads YAML and overrides,
and ``_base`` holds what the sections share. Every name is importable from ``ktflow.recipe``.
"""

from __future__ import annotations

from ktflow.recipe._base import _path_component, _Strict
from ktflow.recipe.data import DatasetConfig
from ktflow.recipe.evaluation import EvaluationConfig, StyleMetric
from ktflow.recipe.finetuning import (
    _BACKEND_OF_FORMAT,
    _OWNED_TRAIN_ARGS,
    ExpertWeightFormat,
    GpuSplit,
    KtBackend,
    KtConfig,
    SftConfig,
    _check_kt_config,
    kt_config_for,
)
from ktflow.recipe.loading import (
    _KEY_HINTS,
    _VALIDATION_FIX,
    _deep_copy,
    _format_validation_error,
    _model_at,
    _yaml_type,
    apply_override,
    load_recipe,
    project_dir_of,
    recipe_from_mapping,
    with_absolute_paths,
)
from ktflow.recipe.model import INT4_FORMATS, ModelFacts, SourceConfig, SourceFormat
from ktflow.recipe.recipe import (
    Recipe,
    as_weights_reader,
    int8_threadpool_count,
    needs_bf16_weights,
    needs_int8_weights,
    with_sft_backend,
)
from ktflow.recipe.runtime import ConversionConfig, StoreConfig, Toolchain, ToolchainsConfig
from ktflow.recipe.serving import _SERVING_WEIGHTS, OWNED_FLAGS, ServingConfig, ServingMethod

# Every name of the recipe module as it was one file, helpers included.
__all__ = [
    "_BACKEND_OF_FORMAT",
    "_check_kt_config",
    "_deep_copy",
    "_format_validation_error",
    "_KEY_HINTS",
    "_model_at",
    "_OWNED_TRAIN_ARGS",
    "_path_component",
    "_SERVING_WEIGHTS",
    "_Strict",
    "_VALIDATION_FIX",
    "_yaml_type",
    "apply_override",
    "as_weights_reader",
    "ConversionConfig",
    "DatasetConfig",
    "EvaluationConfig",
    "ExpertWeightFormat",
    "INT4_FORMATS",
    "int8_threadpool_count",
    "kt_config_for",
    "KtBackend",
    "KtConfig",
    "load_recipe",
    "project_dir_of",
    "with_absolute_paths",
    "ModelFacts",
    "needs_bf16_weights",
    "needs_int8_weights",
    "OWNED_FLAGS",
    "Recipe",
    "recipe_from_mapping",
    "ServingConfig",
    "ServingMethod",
    "GpuSplit",
    "SftConfig",
    "SourceConfig",
    "SourceFormat",
    "StoreConfig",
    "StyleMetric",
    "Toolchain",
    "ToolchainsConfig",
    "with_sft_backend",
]
