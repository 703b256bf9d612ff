"""The recipe: one pydantic model that says everything a pipeline run needs.

A recipe is loaded from YAML (:func:`load_recipe`), optionally varied with ``--set
dotted.key=value`` overrides, and validated in full before any stage starts: unknown keys
(with a "did you mean" hint), wrong types, and every combination we know cannot work
(KT backend rules from ``kt_kernel/sft/config.py``, legacy-vs-0.7 KT fields, serving
rules of the KT SGLang fork). The same model is the Prefect flow parameter, so the UI
renders it as a form and the server validates ``prefect deployment run --params``.

Field names inside ``sft`` and ``serving`` are the names LlamaFactory and SGLang use, so
a value can be looked up in their documentation as is.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ktflow.errors import RecipeError
from ktflow.resources import ToolchainNeed, check_toolchain
from ktflow.store import StoreLayout

SourceFormat = Literal["kimi-k2.5-int4", "kimi-k2-int4", "deepseek-v3-fp8", "bf16"]
INT4_FORMATS: frozenset[str] = frozenset({"kimi-k2.5-int4", "kimi-k2-int4"})

# Keys people carry over from other tools' docs, with what to write instead.
_KEY_HINTS: dict[str, str] = {
    "gradient_checkpointing": (
        "LlamaFactory spells it 'disable_gradient_checkpointing' (KT rejects "
        "'gradient_checkpointing'); write disable_gradient_checkpointing: false to keep it on"
    ),
    "kt_lora_rank": "LlamaFactory derives it from 'lora_rank'; set sft.lora_rank instead",
    "kt_lora_alpha": "LlamaFactory derives it from 'lora_alpha'; set sft.lora_alpha instead",
    "kt_lora_dropout": "LlamaFactory derives it from 'lora_dropout'; set sft.lora_dropout instead",
    "kt_weight_path": "ktflow sets it from the weights stage's output; remove it",
    "model_name_or_path": "ktflow sets it from the source/dequantize stage; set source.* instead",
    "output_dir": "ktflow picks a deterministic output dir under store.root; remove it",
    "overwrite_output_dir": "ktflow always resumes (overwrite_output_dir: false); remove it",
    "dataset": "set dataset.name / dataset.files instead",
    "dataset_dir": "ktflow writes dataset_info.json itself; set dataset.files instead",
    "tensor_parallel_size": "set serving.gpus (the tensor parallel size) instead",
    "tp_size": "set serving.gpus (the tensor parallel size) instead",
    "lora_paths": "ktflow passes the converted adapter itself; set serving.adapter_name",
    # Secrets never go in a recipe (it is a flow parameter, stored and shown by Prefect).
    "api_key": "a key never goes in a recipe; export it in the variable serving.api_key_env names",
    "token": "a token never goes in a recipe; export HF_TOKEN (or use a Prefect Secret block)",
    "hf_token": "a token never goes in a recipe; export HF_TOKEN (or use a Prefect Secret block)",
}

# Recipe fields that become one directory name under store.root (store/serving/<name>,
# store/eval/<name>, store/runs/<name>-<key>, store/datasets/<name>-<digest>).
def _path_component(value: str, allowed: str, chars: str) -> str:
    """``value`` if it is a safe single directory name matching ``allowed``, else a ValueError."""
    if not re.fullmatch(allowed, value) or value in (".", ".."):
        raise ValueError(
            f"{value!r:.80} is not a plain name; use {chars}, starting with a letter or digit (it names "
            "directories under store.root, so no '/', '..' or absolute path)"
        )
    return value

# LlamaFactory arguments that ktflow owns: an `extra_args` entry may not set them.
_OWNED_TRAIN_ARGS = frozenset(
    {
        "model_name_or_path", "output_dir", "overwrite_output_dir", "dataset", "dataset_dir",
        "stage", "do_train", "finetuning_type", "template", "use_kt", "kt_config",
        "kt_weight_path", "kt_optimize_rule", "cpu_infer", "chunk_size", "use_cpu",
        "resume_from_checkpoint", "report_to",
    }
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ModelFacts(_Strict):
    """What a model card or config.json says of a model's size: lets ``ktflow plan`` size a
    checkpoint before it is downloaded (once it is here, its headers are used instead)."""

    parameters: int = Field(gt=0, description="Every weight, quantized ones counted as the values they decode to")
    expert_parameters: int = Field(ge=0, description="The routed experts' share of parameters")
    stored_bytes: int = Field(gt=0, description="The checkpoint's size on disk")
    expert_stored_bytes: int = Field(ge=0, description="The routed experts' share of stored_bytes")
    num_layers: int = Field(gt=0, description="config.json: num_hidden_layers")
    moe_layers: int = Field(ge=0, description="Layers with routed experts (num_hidden_layers - first_k_dense_replace)")
    hidden_size: int = Field(gt=0, description="config.json: hidden_size")
    vocab_size: int = Field(gt=0, description="config.json: vocab_size")
    routed_experts: int = Field(ge=0, description="config.json: n_routed_experts (num_experts)")
    experts_per_token: int = Field(ge=0, description="config.json: num_experts_per_tok")


class SourceConfig(_Strict):
    """Where the base model comes from, and the format it is in."""

    repo_id: str | None = Field(None, description="Hugging Face repo, e.g. moonshotai/Kimi-K2.5")
    revision: str = Field(
        "main", description="Branch, tag or commit; a branch is resolved to its sha and recorded"
    )
    local_path: Path | None = Field(None, description="A local or NFS checkpoint directory")
    uri: str | None = Field(None, description="An fsspec URL (s3://, gs://, ...) of a checkpoint dir")
    allow_patterns: list[str] | None = Field(None, description="Only fetch files matching these globs")
    format: SourceFormat = Field(description="The checkpoint's format; checked against the files")
    size: ModelFacts | None = Field(None, description="The model's size before it is downloaded (ktflow plan)")

    @field_validator("repo_id")
    @classmethod
    def _repo_id_shape(cls, value: str | None) -> str | None:
        if value is not None and (
            not re.fullmatch(r"[\w.-]+/[\w.-]+", value) or any(p in (".", "..") for p in value.split("/"))
        ):
            raise ValueError(f"'{value}' is not a hub repo id; write it as owner/name")
        return value

    @field_validator("revision")
    @classmethod
    def _revision_shape(cls, value: str) -> str:
        # A git ref never has a '..' component, a leading '/' or a backslash (git check-ref-format);
        # the revision is part of a directory name under store.root/weights.
        parts = value.split("/")
        if not value or value.startswith("/") or "\\" in value or any(p in ("", ".", "..") for p in parts) \
                or any(ord(c) < 32 for c in value):
            raise ValueError(
                f"{value!r} is not a branch, tag or commit sha; use e.g. main, v1.0 or a 40-hex commit"
            )
        return value

    @model_validator(mode="after")
    def _exactly_one_location(self) -> SourceConfig:
        given = [k for k in ("repo_id", "local_path", "uri") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "@repo_id: set exactly one of repo_id, local_path, uri "
                f"(got {', '.join(given) if given else 'none'})"
            )
        return self


class DatasetConfig(_Strict):
    """The training data, as LlamaFactory's dataset_info.json will describe it."""

    name: str = Field(
        description="dataset_info.json entry name (lowercase letters, digits, '_', '-')",
        json_schema_extra={"pattern": "^[a-z0-9][a-z0-9_-]*$"},
    )
    files: list[Path] = Field(min_length=1, description="JSON/JSONL/CSV/Parquet files")
    format: Literal["alpaca", "sharegpt", "openai"] = Field(
        description="alpaca; sharegpt (from/value); openai (messages with role/content)"
    )
    columns: dict[str, str] | None = Field(None, description="LlamaFactory 'columns' overrides")
    tags: dict[str, str] | None = Field(None, description="LlamaFactory sharegpt 'tags' overrides")
    images_dir: Path | None = Field(None, description="Where relative image paths in records point")

    @field_validator("name")
    @classmethod
    def _name_is_a_plain_name(cls, value: str) -> str:
        return _path_component(value, r"[a-z0-9][a-z0-9_-]*", "lowercase letters, digits, '_' and '-'")


KtBackend = Literal[
    "auto", "AMXBF16", "AMXINT8", "AMXINT4", "INT8", "FP8", "RAWINT4", "MXFP4",
    "AMXFP8", "AMXINT4_KGROUP",
]
ExpertWeightFormat = Literal["bf16", "int8", "fp8", "rawint4", "mxfp4"]
_BACKEND_OF_FORMAT = {"int8": "INT8", "fp8": "FP8", "rawint4": "RAWINT4", "mxfp4": "MXFP4"}


class KtConfig(_Strict):
    """LlamaFactory's flat ``kt_config`` mapping (KTransformers 0.7.x).

    Only keys a user may set; keys LlamaFactory derives (``kt_lora_rank``, ``kt_weight_path``,
    ...) are rejected, as LlamaFactory itself rejects them.
    """

    kt_backend: KtBackend = "auto"
    kt_expert_weight_format: ExpertWeightFormat | None = None
    kt_weight_lifecycle: Literal["persistent", "ephemeral"] = "persistent"
    kt_num_threads: int | None = Field(None, gt=0, description="Physical cores (default: all)")
    kt_tp_enabled: bool = False
    kt_threadpool_count: int = Field(1, ge=1, description="NUMA pools; used when kt_tp_enabled")
    kt_num_gpu_experts: int = Field(0, ge=0)
    kt_max_cache_depth: int | None = Field(None, ge=1)
    kt_share_backward_bb: bool | None = None
    kt_force_fused_expert_lora: bool | None = None
    kt_model_max_length: int | None = Field(None, gt=0)

    @field_validator("kt_backend", mode="before")
    @classmethod
    def _backend_case(cls, value: Any) -> Any:
        # kt-kernel compares backends case-insensitively; keep one canonical spelling.
        if isinstance(value, str) and value.lower() != "auto":
            return value.upper()
        return value

    @property
    def effective_weight_format(self) -> str:
        """The expert weight format kt-kernel will use (its own defaulting rule)."""
        if self.kt_expert_weight_format is not None:
            return self.kt_expert_weight_format
        by_backend = {v: k for k, v in _BACKEND_OF_FORMAT.items()}
        return by_backend.get(self.kt_backend, "bf16")

    @property
    def effective_threadpool_count(self) -> int:
        return self.kt_threadpool_count if self.kt_tp_enabled else 1


class SftConfig(_Strict):
    """LoRA SFT through LlamaFactory. Field names are LlamaFactory's."""

    backend: Literal["auto", "kt", "kt-legacy", "hf"] = Field(
        description="kt: KTransformers 0.7 (accelerate + kt_config); kt-legacy: KT 0.4-0.6 "
        "(USE_KT=1, kt_optimize_rule); hf: plain LlamaFactory (small models, CPU); auto: hf when the model fits "
        "the GPUs and is predicted faster there, else kt (ktflow plan says which and why)"
    )
    gpus: int = Field(1, ge=0, description="GPUs for training (accelerate num_processes); 0 = CPU")
    template: str = Field("default", description="LlamaFactory chat template name")
    finetuning_type: Literal["lora", "full"] = "lora"
    lora_rank: int = Field(8, gt=0)
    lora_alpha: float = Field(16.0, gt=0)
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    lora_target: str = Field("all", description="Comma-separated module names, or 'all'")
    cutoff_len: int = Field(2048, gt=0)
    learning_rate: float = Field(1e-4, gt=0)
    num_train_epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, gt=0, description="Overrides num_train_epochs when set")
    max_samples: int | None = Field(None, gt=0)
    per_device_train_batch_size: int = Field(1, gt=0)
    gradient_accumulation_steps: int = Field(1, gt=0)
    lr_scheduler_type: str = "cosine"
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    logging_steps: int = Field(1, gt=0)
    save_steps: int = Field(50, gt=0, description="Checkpoint interval: what a crash can cost")
    seed: int = 42
    bf16: bool = True
    disable_gradient_checkpointing: bool = False
    fsdp_offload_params: bool = Field(
        True, description="KT: FSDP2 keeps the non-expert parameters in CPU RAM (less GPU memory, as KT's "
        "example config). Resuming from a checkpoint fails with it on torch 2.11 ('Multiple devices found' in "
        "torch.distributed.checkpoint); false resumes (checked on the GPU host)")
    # KTransformers 0.7 (backend: kt)
    kt_cpu_activation: Literal["recompute", "retain"] | None = None
    kt_config: KtConfig | None = None
    kt_shape_batches: bool | None = Field(
        None, description="KT streams every routed expert once per micro-batch, so the split of the effective "
        "batch (per_device_train_batch_size x gradient_accumulation_steps) decides its speed. true: ktflow keeps "
        "the effective batch and trains the split predicted fastest that fits GPU memory and RAM (backend kt or "
        "auto; values written here are read as the effective batch; other backends ignore it); false: never; "
        "unset: with backend auto "
        "unless the recipe writes per_device_train_batch_size or gradient_accumulation_steps itself (explicit "
        "values win). `ktflow plan` shows the split chosen, or the one it would choose")
    # KTransformers 0.4-0.6 (backend: kt-legacy)
    kt_optimize_rule: str | None = Field(None, description="Injection rule YAML (legacy KT)")
    cpu_infer: int | None = Field(None, gt=0)
    chunk_size: int | None = Field(None, gt=0)
    extra_args: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="Other LlamaFactory training arguments, passed as is"
    )

    @field_validator("extra_args")
    @classmethod
    def _extra_args_not_owned(cls, value: dict[str, Any]) -> dict[str, Any]:
        owned = sorted(set(value) & _OWNED_TRAIN_ARGS | {k for k in value if k.startswith("kt_")})
        if owned:
            raise ValueError(
                f"extra_args may not set {', '.join(owned)}: ktflow sets these from the recipe's "
                "own fields"
            )
        return value

    @model_validator(mode="after")
    def _backend_rules(self) -> SftConfig:
        legacy = [k for k in ("kt_optimize_rule", "cpu_infer", "chunk_size") if getattr(self, k) is not None]
        v07 = [k for k in ("kt_config", "kt_cpu_activation") if getattr(self, k) is not None]
        if self.kt_shape_batches is None:
            # Resolved here, from what the recipe wrote, so a recipe passed on as a dump (a flow
            # parameter, a deployment) keeps the decision its author's file made.
            written = {"per_device_train_batch_size", "gradient_accumulation_steps"} & self.model_fields_set
            self.kt_shape_batches = self.backend == "auto" and not written
        if self.backend == "kt":
            if legacy:
                raise ValueError(
                    f"backend 'kt' (KTransformers 0.7) does not take the legacy field(s) "
                    f"{', '.join(legacy)}; never mix them. Remove them, or set backend: kt-legacy"
                )
            if self.kt_config is None:
                raise ValueError("@kt_config: backend 'kt' needs a kt_config mapping (kt_backend, ...)")
            if self.gpus < 1:
                raise ValueError("@gpus: backend 'kt' needs at least one GPU (gpus >= 1)")
            if self.kt_cpu_activation == "recompute" and self.disable_gradient_checkpointing:
                # LlamaFactory-kt's get_kt_activation_policy refuses this at launch.
                raise ValueError(
                    "@kt_cpu_activation: 'recompute' needs GPU gradient checkpointing, but "
                    "disable_gradient_checkpointing is true; use kt_cpu_activation: retain (or leave it unset), "
                    "or set disable_gradient_checkpointing: false"
                )
            _check_kt_config(self, self.kt_config)
        elif self.backend == "auto":
            if legacy:
                raise ValueError(
                    f"backend 'auto' chooses between hf and kt (KTransformers 0.7); it does not take the legacy "
                    f"field(s) {', '.join(legacy)}. Remove them, or set backend: kt-legacy"
                )
            if self.gpus < 1:
                raise ValueError("@gpus: backend 'auto' chooses between GPU backends and needs gpus >= 1; "
                                 "for a CPU run set backend: hf and gpus: 0")
        elif self.backend == "kt-legacy":
            if v07:
                raise ValueError(
                    f"backend 'kt-legacy' does not take the KTransformers 0.7 field(s) "
                    f"{', '.join(v07)}; never mix them. Remove them, or set backend: kt"
                )
            if self.kt_optimize_rule is None:
                raise ValueError("@kt_optimize_rule: backend 'kt-legacy' needs an injection rule YAML")
            if self.gpus < 1:
                raise ValueError("@gpus: backend 'kt-legacy' needs at least one GPU (gpus >= 1)")
        else:
            if legacy or v07:
                raise ValueError(
                    f"backend 'hf' (plain LlamaFactory) does not take KT field(s) "
                    f"{', '.join(v07 + legacy)}; remove them, or set backend: kt"
                )
        return self


def _check_kt_config(sft: SftConfig, kt: KtConfig) -> None:
    """The rules of ``kt_kernel.sft.config.KTConfig`` (0.7.2), checked before launch."""
    fmt = kt.effective_weight_format
    expected = _BACKEND_OF_FORMAT.get(fmt)
    if expected and kt.kt_backend not in ("auto", expected):
        raise ValueError(
            f"@kt_config.kt_backend: '{kt.kt_backend}' conflicts with kt_expert_weight_format "
            f"'{fmt}'; use kt_backend: {expected} (or auto)"
        )
    if fmt in ("int8", "mxfp4"):
        raise ValueError(
            f"@kt_config.kt_expert_weight_format: '{fmt}' needs pre-quantized KT SFT weights that "
            "ktflow does not produce; use bf16 (with dequantize), rawint4 (Kimi INT4) or fp8 "
            "(DeepSeek FP8)"
        )
    if kt.kt_weight_lifecycle == "ephemeral":
        raise ValueError(
            "@kt_config.kt_weight_lifecycle: 'ephemeral' is supported by kt-kernel only for INT8 "
            ".kt weights; use persistent"
        )
    if fmt != "bf16" and sft.finetuning_type != "lora":
        raise ValueError(
            f"@finetuning_type: {fmt.upper()} SFT supports frozen-base LoRA only; set finetuning_type: lora"
        )
    if kt.kt_model_max_length is not None and kt.kt_model_max_length < sft.cutoff_len:
        raise ValueError(
            f"@kt_config.kt_model_max_length: {kt.kt_model_max_length} is below cutoff_len "
            f"({sft.cutoff_len}); raise kt_model_max_length to at least cutoff_len"
        )
    if fmt == "rawint4":
        if sft.lora_rank != 8:
            raise ValueError(f"@lora_rank: RAWINT4 SFT requires 8 (got {sft.lora_rank}); set lora_rank: 8")
        if sft.lora_dropout != 0.0:
            raise ValueError(
                f"@lora_dropout: RAWINT4 SFT requires 0 (got {sft.lora_dropout}); set lora_dropout: 0"
            )
        if kt.effective_threadpool_count not in (1, 2):
            raise ValueError(
                f"@kt_config.kt_threadpool_count: RAWINT4 SFT supports CPU TP1/TP2 only (got "
                f"{kt.kt_threadpool_count} with kt_tp_enabled); set kt_threadpool_count to 1 or 2"
            )
        if kt.kt_num_gpu_experts != 0:
            raise ValueError(f"@kt_config.kt_num_gpu_experts: RAWINT4 SFT requires 0 (got {kt.kt_num_gpu_experts})")
        if kt.kt_share_backward_bb:
            raise ValueError(
                "@kt_config.kt_share_backward_bb: RAWINT4 SFT computes backward from packed "
                "weights, so it must be false"
            )
        if kt.kt_force_fused_expert_lora is not True:
            raise ValueError("@kt_config.kt_force_fused_expert_lora: RAWINT4 SFT requires true")
    if fmt == "fp8":
        if kt.kt_num_gpu_experts != 0:
            raise ValueError(f"@kt_config.kt_num_gpu_experts: FP8 SFT requires 0 (got {kt.kt_num_gpu_experts})")
        if kt.kt_share_backward_bb is False:
            raise ValueError("@kt_config.kt_share_backward_bb: FP8 SFT requires true (or unset)")


ServingMethod = Literal["RAWINT4", "FP8", "BF16", "AMXBF16", "AMXINT8"]
# kt_method -> what --kt-weight-path must hold.
_SERVING_WEIGHTS: dict[str, str] = {
    "RAWINT4": "the original Kimi INT4 checkpoint",
    "FP8": "the original DeepSeek FP8 checkpoint",
    "BF16": "a BF16 checkpoint",
    "AMXBF16": "a BF16 checkpoint",
    "AMXINT8": "ktflow's quantize-int8 output",
}


class ServingConfig(_Strict):
    """The OpenAI-compatible endpoint. SGLang names for sglang; LlamaFactory's api for CPU."""

    backend: Literal["sglang", "llamafactory"]
    host: str = Field("127.0.0.1", description="Bind address; anything but loopback exposes it")
    port: int | Literal["auto"] = Field(
        30000, description="TCP port; 'auto' (llamafactory backend): a free port is taken when the server starts, and "
        "the endpoint record says which (two checkouts on one host never collide)",
    )
    api_key_env: str = Field(
        "KTFLOW_API_KEY",
        pattern=r"^[A-Z_][A-Z0-9_]*$",
        description="Environment variable holding the API key (the key itself never goes in a recipe)",
    )
    served_model_name: str = Field("ktflow", pattern=r"^[\w.-]+$")
    adapter_name: str = Field("tuned", pattern=r"^[\w.-]+$")
    ready_timeout_s: int = Field(1800, gt=0)
    gpus: int = Field(1, ge=0, description="Tensor parallel size (sglang)")
    # KT SGLang fork (sglang-kt)
    kt_method: ServingMethod | None = None
    kt_cpuinfer: int | None = Field(None, gt=0, description="CPU inference threads (default: physical cores)")
    kt_threadpool_count: int = Field(
        1, ge=1, description="NUMA thread pools; also the T the INT8 weights are quantized with"
    )
    kt_num_gpu_experts: int = Field(0, ge=0)
    kt_gpu_prefill_token_threshold: int | None = None
    kt_enable_dynamic_expert_update: bool = False
    lora_backend: Literal["triton", "csgmv", "torch_native"] = "triton"
    dynamic_lora: bool = Field(
        False, description="The server loads adapters at run time (plain SGLang's /load_lora_adapter): a candidate "
        "is judged under a second adapter name on it. sglang-kt loads one adapter at startup: leave off"
    )
    max_running_requests: int = Field(4, ge=1)
    context_length: int | None = Field(None, gt=0)
    chunked_prefill_size: int | None = Field(None, gt=0)
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)
    attention_backend: str | None = None
    sampling_backend: Literal["flashinfer", "pytorch"] | None = Field(
        None, description="--sampling-backend (sglang); unset: SGLang's default (flashinfer on CUDA). 'pytorch' "
        "where flashinfer's sampling kernels cannot be built (the GPU host's torch 2.11 bundle)",
    )
    grammar_backend: Literal["xgrammar", "outlines", "llguidance", "none"] | None = Field(
        None, description="--grammar-backend (sglang); 'none' serves without structured output (no grammar library)",
    )
    dtype: Literal["bfloat16", "float16", "auto"] = "bfloat16"
    disable_cuda_graph: bool = False
    disable_radix_cache: bool = False
    extra_args: list[str] = Field(default_factory=list, description="More launch_server flags")

    @field_validator("port", mode="before")
    @classmethod
    def _a_port_or_auto(cls, value: object) -> object:
        # One clear message instead of pydantic's one per union member.
        if value == "auto":
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 1:
                raise ValueError(f"{value} is not a TCP port: must be greater than or equal to 1 (or 'auto')")
            if value > 65535:
                raise ValueError(f"{value} is not a TCP port: must be less than or equal to 65535 (or 'auto')")
            return value
        raise ValueError(f"{value!r} is not a port: give a number 1-65535, or 'auto' for a free one")

    @model_validator(mode="after")
    def _backend_rules(self) -> ServingConfig:
        kt_fields = [
            k for k in ("kt_method", "kt_cpuinfer", "kt_gpu_prefill_token_threshold")
            if getattr(self, k) is not None
        ]
        if self.backend == "llamafactory":
            if kt_fields:
                raise ValueError(
                    f"backend 'llamafactory' does not take {', '.join(kt_fields)}; remove them "
                    "or set backend: sglang"
                )
            return self
        if self.port == "auto":
            raise ValueError("@port: 'auto' is for the llamafactory backend; sglang-kt serves on a fixed port: set one")
        if self.kt_method is None:
            raise ValueError("@kt_method: backend 'sglang' needs one of RAWINT4, FP8, BF16, AMXBF16, AMXINT8")
        if self.gpus < 1:
            raise ValueError("@gpus: backend 'sglang' needs at least one GPU (gpus >= 1)")
        # The KT fork's LoRA rules: ktflow always serves the tuned adapter.
        if self.kt_num_gpu_experts != 0:
            raise ValueError(
                f"@kt_num_gpu_experts: must be 0 when serving a LoRA adapter with KT (got "
                f"{self.kt_num_gpu_experts})"
            )
        if self.kt_gpu_prefill_token_threshold is not None:
            raise ValueError(
                "@kt_gpu_prefill_token_threshold: cannot be used with a KT LoRA adapter; remove it"
            )
        if self.kt_enable_dynamic_expert_update:
            raise ValueError(
                "@kt_enable_dynamic_expert_update: cannot be used with a KT LoRA adapter; set it false"
            )
        if self.max_running_requests < 2:
            raise ValueError(
                f"@max_running_requests: must be >= 2 for KT LoRA serving (got {self.max_running_requests})"
            )
        for flag in self.extra_args:
            if flag.split("=", 1)[0] in ("--pp-size", "--pipeline-parallel-size", "--host"):
                raise ValueError(f"@extra_args: may not set {flag}; use the recipe's own field")
        return self


class StyleMetric(_Strict):
    """The ``style`` metric: the share of answers (0-100) that carry the training data's style.

    Give a ``marker`` (a string the answer contains, e.g. ``nya~``) or a ``pattern`` (a Python
    regular expression searched in the answer, e.g. ``nya~\\s*$``), not both.
    """

    marker: str | None = Field(None, min_length=1, description="A string a styled answer contains")
    pattern: str | None = Field(None, min_length=1, description="A regular expression (re.search) a styled answer matches")

    @model_validator(mode="after")
    def _one_of(self) -> StyleMetric:
        if (self.marker is None) == (self.pattern is None):
            raise ValueError("give exactly one of marker (a string) or pattern (a regular expression)")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise ValueError(f"@pattern: {self.pattern!r} is not a regular expression ({exc})") from None
        return self

    @property
    def label(self) -> str:
        """How the eval table names the metric."""
        return f"style ({self.marker!r})" if self.marker is not None else f"style (/{self.pattern}/)"

    def matches(self, answer: str) -> bool:
        """Whether ``answer`` carries the style."""
        if self.marker is not None:
            return self.marker in answer
        assert self.pattern is not None
        return re.search(self.pattern, answer) is not None


class EvaluationConfig(_Strict):
    """Base-vs-tuned evaluation through the OpenAI-compatible endpoint."""

    enabled: bool = True
    files: list[Path] = Field(default_factory=list, description="Held-out records")
    format: Literal["alpaca", "sharegpt", "openai"] = "openai"
    task: Literal["generative", "multiple_choice"] = "generative"
    temperature: float = Field(0.0, ge=0.0)
    max_tokens: int = Field(256, gt=0)
    concurrency: int = Field(4, ge=1, le=256)
    style: StyleMetric | None = Field(
        None, description="Also score the share of answers in the training data's style (a marker or a regex)"
    )
    gate_metric: Literal["bleu-4", "rouge-l", "accuracy", "style"] | None = Field(
        None, description="The promotion gate: a tuned model that does not gain gate_min_gain points on this "
        "metric over the base fails the run. Unset: the gate is only reported, on rouge-l (accuracy for "
        "multiple_choice), and never fails the run"
    )
    gate_min_gain: float = Field(
        0.0, ge=0.0, le=100.0, description="Points (0-100 scale) the tuned model must gain over the base on the "
        "gate metric to be promoted (0: it must not regress)"
    )
    allow_contamination: bool = Field(
        False, description="Promote even when evaluation prompts also occur in the training data (they are still "
        "counted, named and reported). Off: a contaminated evaluation set is never grounds for promotion"
    )
    candidate: Literal["beside", "offline", "swap"] | None = Field(
        None, description="How a retrained adapter is judged before it replaces production. beside: a second "
        "adapter name on the server (serving.dynamic_lora) or a second server on a free port; offline: answers "
        "generated through the training toolchain, no server; swap: it serves first and a failed gate rolls "
        "production back. Unset: the plan picks from the host's memory and says why"
    )

    @model_validator(mode="after")
    def _files_when_enabled(self) -> EvaluationConfig:
        if self.enabled and not self.files:
            raise ValueError("@files: evaluation is enabled but lists no files; add files or set enabled: false")
        if self.gate_metric == "accuracy" and self.task != "multiple_choice":
            raise ValueError("@gate_metric: 'accuracy' needs task: multiple_choice")
        if self.gate_metric == "style" and self.style is None:
            raise ValueError("@gate_metric: 'style' needs evaluation.style (a marker or a pattern)")
        return self

    @property
    def gate(self) -> str:
        """The metric promotion is judged on: ``gate_metric``, else the task's main metric."""
        return self.gate_metric or ("accuracy" if self.task == "multiple_choice" else "rouge-l")


class ConversionConfig(_Strict):
    """Settings of the weight conversion stages (dequantize, quantize-int8)."""

    workers: int | None = Field(None, gt=0, description="Parallel workers (default: physical cores)")
    fsync: bool = Field(True, description="fsync each shard before publishing it")
    int8: Literal["auto", "always", "never"] = Field(
        "auto",
        description="CPU INT8 expert weights: auto = when serving.kt_method is AMXINT8; always = "
        "also prepare them for a later SGLang host (e.g. while serving on CPU here)",
    )
    int8_threadpool_count: int | None = Field(
        None, ge=1, description="T to quantize with (default: serving.kt_threadpool_count)"
    )


class StoreConfig(_Strict):
    """Where stage artifacts live (shared storage when stages run on several hosts)."""

    root: Path = Path(".ktflow/store")
    artifacts: str | None = Field(
        None, description="URL of the artifact store for what crosses hosts (sftp://, s3://, gs://, az://, file://): "
                          "each host then keeps its own store root; None: the hosts share the store (one host, or NFS). "
                          "Credentials never go here: the host's environment or an ArtifactStore block holds them")

    @field_validator("artifacts")
    @classmethod
    def _artifact_url(cls, value: str | None) -> str | None:
        from ktflow.artifact_store import check_artifact_url

        return None if value is None else check_artifact_url(value)

    @property
    def layout(self) -> StoreLayout:
        """Where each artifact lives under :attr:`root`."""
        return StoreLayout(self.root)


class Toolchain(_Strict):
    """A Python environment a stage's tools run in."""

    python: Path = Field(description="The environment's python executable")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables")

    def require(self, field: str, holds: str, make_target: str) -> Path:
        """The absolute python path, or a HostRequirementError saying how to install it.

        Args:
            field: the recipe field, e.g. ``toolchains.train.python``.
            holds: what the environment must contain, e.g. ``LlamaFactory``.
            make_target: the Makefile target that builds it here.
        """
        check_toolchain(self.need(field, holds, make_target))
        return self.python.absolute()

    def need(self, field: str, holds: str, make_target: str) -> ToolchainNeed:
        """This environment as a stage's declared need (:class:`~ktflow.resources.Resources`)."""
        return ToolchainNeed(python=self.python.absolute(), field=field, what=holds, make_target=make_target)


class ToolchainsConfig(_Strict):
    train: Toolchain = Toolchain(python=Path(".venv-train/bin/python"))
    serve: Toolchain = Toolchain(python=Path(".venv-serve/bin/python"))


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


def kt_config_for(fmt: str) -> KtConfig:
    """KT 0.7's expert settings for a source format, as KT's recipes set them: BF16 experts from a
    BF16 source, Kimi's INT4 experts as they are (RAWINT4), DeepSeek's FP8 as they are."""
    if fmt in INT4_FORMATS:
        return KtConfig(kt_backend="RAWINT4", kt_expert_weight_format="rawint4", kt_share_backward_bb=False)
    if fmt == "deepseek-v3-fp8":
        return KtConfig(kt_backend="FP8", kt_expert_weight_format="fp8")
    return KtConfig(kt_backend="AMXBF16", kt_expert_weight_format="bf16")


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
    return sft_bf16 or serve_bf16 or needs_int8_weights(recipe)


# --------------------------------------------------------------------------- loading


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Load, override and validate a recipe file.

    Args:
        path: a YAML file.
        overrides: ``dotted.key=value`` strings; values are parsed as YAML scalars/lists.

    Raises:
        RecipeError: naming the file, the field and the fix, for every problem found.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(str(path), "no such recipe file", "check the path (see recipes/)") from None
    except UnicodeDecodeError as exc:
        raise RecipeError(str(path), f"is not UTF-8 text (byte {exc.start}): not a YAML recipe",
                          "pass the recipe's .yaml file (see recipes/)") from None
    except OSError as exc:
        raise RecipeError(str(path), f"cannot read the file ({exc.strerror})",
                          "pass a readable recipe file (see recipes/)") from None
    try:
        raw = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as exc:
        # PyYAML raises a bare ValueError for an impossible date (2024-02-30) or a bad !!float.
        raise RecipeError(str(path), f"not valid YAML: {exc}", "fix the YAML syntax") from None
    except RecursionError:
        raise RecipeError(str(path), "the YAML is nested too deeply to be a recipe",
                          "write the recipe as in recipes/ (a few levels of sections)") from None
    if not isinstance(raw, dict):
        raise RecipeError(str(path), f"a recipe must be a YAML mapping at the top level (got {_yaml_type(raw)})",
                          "start the file with 'name: ...', 'source: ...' as in recipes/")
    return recipe_from_mapping(raw, overrides, origin=str(path))


def recipe_from_mapping(
    raw: Mapping[str, Any], overrides: Sequence[str] = (), *, origin: str = "recipe"
) -> Recipe:
    """Validate a recipe given as a mapping (a flow parameter, a parsed file).

    Raises:
        RecipeError: for anything that is not a valid recipe (never another exception).
    """
    if not isinstance(raw, Mapping):
        raise RecipeError(origin, f"a recipe must be a mapping of sections (got {_yaml_type(raw)})",
                          "pass the parsed recipe YAML (see recipes/)")
    data = _deep_copy(raw, origin=origin)
    for item in overrides:
        apply_override(data, item, origin=origin)
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(origin, _format_validation_error(exc), _VALIDATION_FIX) from None
    except RecursionError:
        raise RecipeError(origin, "a value is nested too deeply to be a recipe field",
                          "write the recipe as in recipes/") from None


_VALIDATION_FIX = "change the field(s) named above in the recipe (or with --set); recipes/ has complete examples"


def _yaml_type(value: Any) -> str:
    if value is None:
        return "an empty document"
    return {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def apply_override(data: dict[str, Any], item: str, *, origin: str = "recipe") -> None:
    """Apply one ``dotted.key=value`` override to a raw recipe mapping, in place."""
    key, sep, value_text = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise RecipeError(
            f"--set {item}", "expected dotted.key=value", "e.g. --set sft.max_steps=10"
        )
    try:
        value = yaml.safe_load(value_text) if value_text != "" else ""
    except (yaml.YAMLError, ValueError):
        value = value_text  # not YAML: the text itself (validated like any string)
    except RecursionError:
        raise RecipeError(f"--set {key}", "the value is nested too deeply", "pass a scalar or a short list") from None
    parts = key.split(".")
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise RecipeError(
                f"--set {item}", f"'{where}' is a value in {origin}, not a section", "check the key"
            )
        node = child
    node[parts[-1]] = value


def _deep_copy(value: Any, *, origin: str = "recipe") -> Any:
    """A copy of a parsed recipe's containers (the input is never mutated).

    YAML aliases make shared and even recursive structures: a shared one is copied once (so a
    "billion laughs" document stays small), a recursive one is refused.
    """
    memo: dict[int, Any] = {}
    active: set[int] = set()

    def copy(node: Any, depth: int) -> Any:
        if not isinstance(node, (Mapping, list)):
            return node
        if id(node) in active or depth > 100:
            raise RecipeError(origin, "a value refers to itself (a recursive YAML alias) or is nested too deeply",
                              "write the value out instead of through an alias")
        if id(node) in memo:
            return memo[id(node)]
        active.add(id(node))
        try:
            result: Any = (
                {k: copy(v, depth + 1) for k, v in node.items()} if isinstance(node, Mapping)
                else [copy(v, depth + 1) for v in node]
            )
        finally:
            active.discard(id(node))
        memo[id(node)] = result
        return result

    return copy(value, 0)


def _model_at(loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The pydantic model class at a validation-error location (for key suggestions)."""
    model: Any = Recipe
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        annotation = field.annotation
        candidates = getattr(annotation, "__args__", (annotation,))
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


def _format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        raw_loc = err["loc"]
        if err["type"] == "extra_forbidden" and raw_loc:
            # The last element is the user's own key (which may hold any character).
            loc = [*(p for p in raw_loc[:-1] if not (isinstance(p, str) and "[" in p)), raw_loc[-1]]
        else:
            loc = [p for p in raw_loc if not (isinstance(p, str) and "[" in p)]
        where = ".".join(str(p) for p in loc)
        if err["type"] == "extra_forbidden" and loc:
            key = str(loc[-1])
            parent = _model_at(loc[:-1])
            message = f"{where}: unknown key"
            if key in _KEY_HINTS:
                message += f"; {_KEY_HINTS[key]}"
            elif parent is not None:
                close = difflib.get_close_matches(key, list(parent.model_fields), n=1, cutoff=0.6)
                if close:
                    message += f"; did you mean '{'.'.join(map(str, loc[:-1] + [close[0]]))}'?"
                else:
                    message += f"; allowed keys: {', '.join(parent.model_fields)}"
        elif err["type"] == "missing":
            message = f"{where}: required field is missing; add it (recipes/ has an example of every section)"
        else:
            text = err["msg"].removeprefix("Value error, ")
            # Cross-field rules name their field as "@field: ..." (a model validator's error
            # is located at the model; this points it at the field the user must change).
            if text.startswith("@") and ": " in text:
                field, text = text[1:].split(": ", 1)
                loc = [*loc, *field.split(".")]
                where = ".".join(str(p) for p in loc)
            given = err.get("input")
            shown = "" if isinstance(given, (dict, list)) or err["type"].startswith("value_error") else (
                f" (got {given!r:.200})"
            )
            message = f"{where}: {text}{shown}" if where else f"{text}{shown}"
        lines.append(message)
    return "; ".join(lines) if len(lines) == 1 else "\n  " + "\n  ".join(lines)
