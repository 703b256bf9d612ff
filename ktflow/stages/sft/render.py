"""Rendering an SFT run: a recipe -> LlamaFactory's training YAML (plus an Accelerate FSDP2 config for
KT 0.7), the exact launch argv and its environment, for three backends: ``kt`` (KT 0.7:
``accelerate launch --config_file fsdp2.yaml --no_python llamafactory-cli train train.yaml``),
``kt-legacy`` (KT 0.4-0.6: ``USE_KT=1 llamafactory-cli train``) and ``hf`` (plain LlamaFactory;
``use_cpu`` when no GPU is given)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from ktflow.errors import InvalidInputError, KtflowError
from ktflow.recipe import Recipe

TRAIN_YAML = "train.yaml"
ACCELERATE_YAML = "accelerate.yaml"
TRAINER_LOG = "trainer_log.jsonl"
LF_OUTPUT = "output"  # LlamaFactory's output_dir inside the run directory
ADAPTER = "adapter"  # the published adapter inside the run directory
# A checkpoint is complete (resumable with optimizer state) only with all of these.
CHECKPOINT_FILES = ("trainer_state.json", "scheduler.pt")
# The optimizer's state, one of: optimizer.pt (one process), optimizer.bin (accelerate's FSDP with a full state
# dict over several processes), optimizer_0/.metadata (FSDP's sharded state dict; torch.distributed.checkpoint
# writes .metadata last); or KT's own (transformers-kt with FSDP over 2+ GPUs, seen on the 2-GPU host):
# optimizer_rank_NNNNN.pt per rank, then KT_OPTIMIZER_INDEX naming them, published last.
OPTIMIZER_STATES = ("optimizer.pt", "optimizer.bin", "optimizer_0/.metadata")
KT_OPTIMIZER_INDEX = "kt_optimizer.index.json"

# FSDP2 wraps one decoder layer per unit; the class name depends on the architecture.
_DECODER_LAYERS = {
    "deepseek_v3": "DeepseekV3DecoderLayer", "kimi_k2": "DeepseekV3DecoderLayer", "kimi_k25": "DeepseekV3DecoderLayer",
    "deepseek_v2": "DeepseekV2DecoderLayer", "qwen3_moe": "Qwen3MoeDecoderLayer", "qwen2_moe": "Qwen2MoeDecoderLayer",
}


class SftPlan(BaseModel):
    """Everything needed to launch training, as ``ktflow sft --dry-run --json`` prints it."""

    train_config: dict[str, Any]
    accelerate_config: dict[str, Any] | None
    launch: list[str]
    env: dict[str, str]


class TrainerProgress(BaseModel):
    """One line of LlamaFactory's ``trainer_log.jsonl``."""

    current_steps: int
    total_steps: int
    loss: float | None = None
    lr: float | None = None
    epoch: float | None = None
    percentage: float | None = None
    elapsed_time: str | None = None
    remaining_time: str | None = None
    throughput: float | None = None
    total_tokens: int | None = None


class SftResult(BaseModel):
    """What the SFT stage produced."""

    adapter_dir: Path
    run_dir: Path
    cached: bool
    resumed_from: str | None
    steps: int
    final_loss: float | None
    seconds: float
    tokens_per_second: float | None
    loss_curve: Path | None
    manifest_digest: str
    backend: str = ""  # the backend that trained it (``auto`` resolved)
    backend_reason: str | None = None  # why ``sft.backend: auto`` chose it
    batch_shape: str | None = None  # the KT micro-batch split trained (or a faster one it could have), and why
    batch: str | None = None  # the batch a step held and its split over the GPUs (GpuSplit.describe)
    # A KT run's steady step, measured and as the shipped model predicts it (ktflow.planning.host_speed's
    # KtStepRecord as JSON): what the next plan on this host is calibrated by. None: not KT, or too short.
    kt_step: dict[str, Any] | None = None
    # The loss curve as a PNG data URL, attached by the SFT flow: the run report is written on the
    # serving host, where the training host's file is not (hosts without a shared filesystem).
    loss_curve_png: str | None = None


# --------------------------------------------------------------------------- rendering


def decoder_layer_class(recipe: Recipe, model_config: dict[str, Any] | None) -> str:
    """The decoder layer class FSDP2 wraps: from the model's config, else the source's family."""
    if model_config is not None:
        for cfg in (model_config.get("text_config") or {}, model_config):
            if cfg.get("model_type") in _DECODER_LAYERS:
                return _DECODER_LAYERS[cfg["model_type"]]
    repo = (recipe.source.repo_id or "").lower()
    if recipe.source.format != "bf16" or "kimi" in repo or "deepseek-v3" in repo or "deepseek-r1" in repo:
        return "DeepseekV3DecoderLayer"
    if "deepseek-v2" in repo:
        return "DeepseekV2DecoderLayer"
    if "qwen3" in repo:
        return "Qwen3MoeDecoderLayer"
    raise KtflowError(
        "cannot tell which decoder layer class FSDP2 should wrap for this model; its config.json has "
        f"model_type {model_config.get('model_type') if model_config else None!r}"
    )


def check_kt_model(recipe: Recipe, model_config: dict[str, Any] | None, config_path: Path) -> None:
    """Refuse, before anything launches, a model class the KT 0.7 backend is known not to train.

    kt-kernel 0.7.2 routes DeepSeek-V2 tokens by calling the MoE gate and expecting
    ``(topk_ids, topk_weights)``; transformers' ``DeepseekV2ForCausalLM`` (what transformers-kt
    loads for ``model_type: deepseek_v2``) has a plain Linear gate, so training stops at its first
    step with "DeepSeek gate must return (topk_ids, topk_weights)" (seen on the GPU host with
    benchmarks/kt_vs_hf.py --arch v2). DeepSeek's own remote code returns three values.

    Raises:
        InvalidInputError: ``sft.backend: kt`` with a DeepSeek-V2 model.
    """
    if recipe.sft.backend != "kt" or model_config is None:
        return
    for cfg in (model_config, model_config.get("text_config") or {}):
        found = "model_type deepseek_v2" if cfg.get("model_type") == "deepseek_v2" else next(
            (f"architecture {a}" for a in cfg.get("architectures") or [] if "DeepseekV2" in a), None)
        if found:
            raise InvalidInputError(
                f"{config_path}: {found} with sft.backend kt",
                "kt-kernel 0.7.2 cannot train DeepSeek-V2 models: its MoE wrapper expects the gate to return "
                "(topk_ids, topk_weights), and DeepSeek-V2's gate does not, so training would stop at its first step",
                "train DeepSeek-V2 with sft.backend: kt-legacy (recipes/deepseek-v2-lite-bf16.yaml) or hf",
            )


def render_sft(
    recipe: Recipe,
    *,
    model_dir: Path,
    dataset_dir: Path,
    output_dir: Path,
    config_dir: Path,
    train_python: Path,
    physical_cores: int,
    model_config: dict[str, Any] | None = None,
) -> SftPlan:
    """Render the LlamaFactory YAML, Accelerate config, launch argv and environment.

    Args:
        model_dir: the base weights LlamaFactory loads (and KT's ``kt_weight_path``).
        dataset_dir: the prepared dataset directory (holds dataset_info.json).
        output_dir: LlamaFactory's output_dir (checkpoints, trainer_log.jsonl, the adapter).
        config_dir: where the rendered YAML files are saved (named in the argv).
        train_python: the training toolchain's python; its bin/ holds the launchers.
        physical_cores: the default for ``kt_num_threads``.
        model_config: the base model's config.json, when available (FSDP2 wrap class).
    """
    sft = recipe.sft
    cfg = _train_config(recipe, model_dir=model_dir, dataset_dir=dataset_dir, output_dir=output_dir)
    bin_dir, train_yaml = train_python.parent, config_dir / TRAIN_YAML
    env: dict[str, str] = {}
    accelerate_config: dict[str, Any] | None = None
    if sft.backend == "kt":
        assert sft.kt_config is not None  # the recipe validator guarantees it
        kt = sft.kt_config.model_dump(exclude_none=True)
        kt.setdefault("kt_num_threads", physical_cores)
        cfg.update(use_kt=True, kt_weight_path=str(model_dir))
        if sft.kt_cpu_activation is not None:
            cfg["kt_cpu_activation"] = sft.kt_cpu_activation
        cfg["kt_config"] = kt
        accelerate_config = _fsdp2_config(recipe, model_config)
        launch = [
            str(bin_dir / "accelerate"), "launch", "--config_file", str(config_dir / ACCELERATE_YAML),
            "--no_python", str(bin_dir / "llamafactory-cli"), "train", str(train_yaml),
        ]
    else:
        if sft.backend == "kt-legacy":
            cfg.update(use_kt=True, kt_optimize_rule=sft.kt_optimize_rule,
                       cpu_infer=sft.cpu_infer or physical_cores, chunk_size=sft.chunk_size or 8192)
            env["USE_KT"] = "1"
        elif sft.gpus == 0:
            cfg["use_cpu"] = True
        if sft.gpus > 0:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(sft.gpus))
        launch = [str(bin_dir / "llamafactory-cli"), "train", str(train_yaml)]
    cfg.update(sft.extra_args)
    env.update(recipe.toolchains.train.env)
    return SftPlan(train_config=cfg, accelerate_config=accelerate_config, launch=launch, env=env)


def _train_config(recipe: Recipe, *, model_dir: Path, dataset_dir: Path, output_dir: Path) -> dict[str, Any]:
    """LlamaFactory's training keys every backend shares."""
    sft = recipe.sft
    split = sft.gpu_split()
    cfg: dict[str, Any] = {
        "model_name_or_path": str(model_dir),
        "trust_remote_code": True,
        "stage": "sft",
        "do_train": True,
        "finetuning_type": sft.finetuning_type,
    }
    if sft.finetuning_type == "lora":
        cfg.update(lora_rank=sft.lora_rank, lora_alpha=sft.lora_alpha, lora_dropout=sft.lora_dropout,
                   lora_target=sft.lora_target)
    cfg.update(
        dataset=recipe.dataset.name,
        dataset_dir=str(dataset_dir),
        template=sft.template,
        cutoff_len=sft.cutoff_len,
        output_dir=str(output_dir),
        # Never true: it deletes trainer_log.jsonl and restarts from step 0 (KT's examples ship it).
        overwrite_output_dir=False,
        save_only_model=False,  # optimizer/scheduler/RNG state make a resumed run exact
        logging_steps=sft.logging_steps,
        save_steps=sft.save_steps,
        plot_loss=True,
        report_to="none",
        # the recipe's batch over all GPUs: each GPU's share (LlamaFactory multiplies by the GPU count)
        per_device_train_batch_size=split.per_device_train_batch_size,
        gradient_accumulation_steps=split.gradient_accumulation_steps,
        learning_rate=sft.learning_rate,
        num_train_epochs=sft.num_train_epochs,
        lr_scheduler_type=sft.lr_scheduler_type,
        bf16=sft.bf16,
        seed=sft.seed,
        data_seed=sft.seed,
    )
    optional = {"warmup_ratio": sft.warmup_ratio or None, "max_steps": sft.max_steps, "max_samples": sft.max_samples,
                "disable_gradient_checkpointing": sft.disable_gradient_checkpointing or None}
    cfg.update({key: value for key, value in optional.items() if value is not None})
    return cfg


def _fsdp2_config(recipe: Recipe, model_config: dict[str, Any] | None) -> dict[str, Any]:
    """Accelerate's FSDP2 config for KT 0.7 (one decoder layer per unit, as KT's examples)."""
    sft = recipe.sft
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": decoder_layer_class(recipe, model_config),
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_offload_params": sft.fsdp_offload_params,
            "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_sync_module_states": True,
        },
        "machine_rank": 0,
        "mixed_precision": "bf16" if sft.bf16 else "no",
        "num_machines": 1,
        "num_processes": sft.gpus,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }


def dump_yaml(mapping: dict[str, Any]) -> str:
    return yaml.safe_dump(mapping, sort_keys=False, default_flow_style=False)
