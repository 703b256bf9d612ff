"""Fine-tuning (``sft``): LlamaFactory's arguments, and KTransformers' ``kt_config`` with the rules
kt-kernel checks at launch."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from ktflow.recipe._base import _Strict
from ktflow.recipe.model import INT4_FORMATS

# LlamaFactory arguments that ktflow owns: an `extra_args` entry may not set them.
_OWNED_TRAIN_ARGS = frozenset(
    {
        "model_name_or_path", "output_dir", "overwrite_output_dir", "dataset", "dataset_dir",
        "stage", "do_train", "finetuning_type", "template", "use_kt", "kt_config",
        "kt_weight_path", "kt_optimize_rule", "cpu_infer", "chunk_size", "use_cpu",
        "resume_from_checkpoint", "report_to",
    }
)


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


class GpuSplit(BaseModel):
    """How an optimizer step's records are split over ``sft.gpus`` GPUs (what LlamaFactory is given).

    A recipe's batch is ``per_device_train_batch_size x gradient_accumulation_steps`` records a step,
    whatever ``sft.gpus`` is: changing the GPU count keeps it. Each GPU trains an equal share: the
    micro-batch as written where the share allows (the accumulation divided over the GPUs), else the
    largest micro-batch under it that divides the share (never a larger one: GPU memory is sized for it).
    """

    effective: int  # records an optimizer step holds
    gpus: int
    per_device_train_batch_size: int  # what each GPU trains at once
    gradient_accumulation_steps: int  # micro-batches each GPU accumulates a step

    @property
    def share(self) -> int:
        """Records each GPU trains a step."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    def describe(self) -> str:
        """``batch 8 records a step: 2 GPUs x 1 record x 4 micro-batches``."""
        b, g = self.per_device_train_batch_size, self.gradient_accumulation_steps
        each = f"{b} record{'s' if b > 1 else ''} x {g} micro-batch{'es' if g > 1 else ''}"
        if self.gpus <= 1:
            return f"batch {self.effective} records a step: {each}"
        return f"batch {self.effective} records a step: {self.gpus} GPUs x {each}"


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
    per_device_train_batch_size: int = Field(1, gt=0, description="Records a GPU trains at once (a micro-batch)")
    gradient_accumulation_steps: int = Field(
        1, gt=0, description="Micro-batches an optimizer step accumulates, over all GPUs: the batch is "
        "per_device_train_batch_size x gradient_accumulation_steps records a step whatever sft.gpus is "
        "(ktflow gives each GPU an equal share of it)")
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

    def gpu_split(self) -> GpuSplit:
        """Each GPU's share of the batch (see :class:`GpuSplit`); validation refused an uneven one."""
        gpus = max(self.gpus, 1)
        effective = self.per_device_train_batch_size * self.gradient_accumulation_steps
        share = effective // gpus
        per_device = max(b for b in range(1, min(self.per_device_train_batch_size, share) + 1) if share % b == 0)
        return GpuSplit(effective=effective, gpus=gpus, per_device_train_batch_size=per_device,
                        gradient_accumulation_steps=share // per_device)

    def _check_batch_splits_over_gpus(self) -> None:
        b, g, gpus = self.per_device_train_batch_size, self.gradient_accumulation_steps, self.gpus
        if (b * g) % gpus == 0:
            return
        fit = next(n for n in range(g + 1, g * gpus + 1) if (b * n) % gpus == 0)
        raise ValueError(
            f"@gpus: {gpus} GPUs cannot share the batch of per_device_train_batch_size {b} x "
            f"gradient_accumulation_steps {g} = {b * g} records a step evenly (each GPU trains an equal share, and "
            f"the batch stays what the recipe says whatever the GPU count); set gradient_accumulation_steps to "
            f"{fit} (or per_device_train_batch_size x gradient_accumulation_steps to any multiple of {gpus}), "
            f"or sft.gpus to a divisor of {b * g}")

    @model_validator(mode="before")
    @classmethod
    def _resolve_kt_shape_batches(cls, data: Any) -> Any:
        # Resolved from what the recipe wrote, so a recipe passed on as a dump (a flow parameter, a deployment)
        # keeps the decision its author's file made.
        if isinstance(data, dict) and data.get("kt_shape_batches") is None:
            written = {"per_device_train_batch_size", "gradient_accumulation_steps"} & data.keys()
            data = {**data, "kt_shape_batches": data.get("backend") == "auto" and not written}
        return data

    @model_validator(mode="after")
    def _backend_rules(self) -> SftConfig:
        legacy = [k for k in ("kt_optimize_rule", "cpu_infer", "chunk_size") if getattr(self, k) is not None]
        v07 = [k for k in ("kt_config", "kt_cpu_activation") if getattr(self, k) is not None]
        if self.gpus > 1:
            self._check_batch_splits_over_gpus()
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


def kt_config_for(fmt: str) -> KtConfig:
    """KT 0.7's expert settings for a source format, as KT's recipes set them: BF16 experts from a
    BF16 source, Kimi's INT4 experts as they are (RAWINT4), DeepSeek's FP8 as they are."""
    if fmt in INT4_FORMATS:
        return KtConfig(kt_backend="RAWINT4", kt_expert_weight_format="rawint4", kt_share_backward_bb=False)
    if fmt == "deepseek-v3-fp8":
        return KtConfig(kt_backend="FP8", kt_expert_weight_format="fp8")
    return KtConfig(kt_backend="AMXBF16", kt_expert_weight_format="bf16")
