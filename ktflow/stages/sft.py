"""The SFT stage: LoRA (or full) fine-tuning through LlamaFactory, with or without KTransformers.

- :func:`render_sft` turns a recipe into LlamaFactory's training YAML (plus an Accelerate FSDP2
  config for KT 0.7), the exact launch argv and its environment, for three backends:
  ``kt`` (KT 0.7: ``accelerate launch --config_file fsdp2.yaml --no_python llamafactory-cli
  train train.yaml``), ``kt-legacy`` (KT 0.4-0.6: ``USE_KT=1 llamafactory-cli train``) and ``hf``
  (plain LlamaFactory; ``use_cpu`` when no GPU is given).
- :func:`run_sft` validates the data, checks the host, and runs training in the training
  toolchain inside a deterministic run directory (one per base model, data and settings), so a
  retry or a rerun after a crash resumes from the last complete checkpoint: never from step 0,
  never from an adapter. The finished adapter is published atomically with its manifest; a
  completed run is a cache hit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel

from ktflow import ENGINE_VERSION
from ktflow.errors import HostRequirementError, InvalidInputError, KtflowError
from ktflow.formats.checkpoint import checkpoint_digest
from ktflow.formats.dataset import dataset_digest, prepare_dataset, validate_dataset
from ktflow.formats.safetensors_io import read_header
from ktflow.host.hardware import HostInfo
from ktflow.host.process import LogFollower, ThrottledLines, run_tool
from ktflow.planning.sizing import (
    HF_DOES_NOT_FIT_FIX,
    ModelSize,
    estimate_hf_sft_gpu_memory,
    estimate_kt_sft_memory,
    hf_sft_gpu_need,
    kt_sft_needs,
    model_size,
    sft_gpu_memory_problem,
)
from ktflow.planning.stage_plan import host_requirements
from ktflow.recipe import Recipe, with_sft_backend
from ktflow.resources import DiskNeed, GpuNeed, RamNeed, Resources, ToolchainNeed, check_requirement
from ktflow.runner import Job, StageSpec, find_published, run_stage
from ktflow.store import StageManifest, atomic_write_bytes, read_manifest
from ktflow.units import GiB

TRAIN_YAML = "train.yaml"
ACCELERATE_YAML = "accelerate.yaml"
TRAINER_LOG = "trainer_log.jsonl"
LF_OUTPUT = "output"  # LlamaFactory's output_dir inside the run directory
ADAPTER = "adapter"  # the published adapter inside the run directory
# What an adapter directory holds (LlamaFactory/PEFT; KT's fused expert LoRA and its manifest).
ADAPTER_FILES = (
    "adapter_model.safetensors", "adapter_config.json", "fused_expert_lora.safetensors", "kt_adapter_manifest.json",
)
# A checkpoint is complete (resumable with optimizer state) only with all of these.
CHECKPOINT_FILES = ("trainer_state.json", "optimizer.pt", "scheduler.pt")

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
        per_device_train_batch_size=sft.per_device_train_batch_size,
        gradient_accumulation_steps=sft.gradient_accumulation_steps,
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


# --------------------------------------------------------------------------- run directory and resume


def run_key(recipe: Recipe, *, base_digest: str, data_digest: str) -> str:
    """The run's identity: base model, data, every training setting and the engine version.

    The store root and toolchain paths are left out (they move between hosts; the result doesn't).
    """
    settings = recipe.sft.model_dump(mode="json")
    payload = json.dumps(
        {"base": base_digest, "data": data_digest, "sft": settings, "dataset": recipe.dataset.name,
         "engine": ENGINE_VERSION},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def run_dir_for(recipe: Recipe, key: str) -> Path:
    return recipe.store.layout.run(f"{recipe.name}-{key[:12]}")


def _checkpoint_step(path: Path) -> int:
    try:
        return int(path.name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def last_complete_checkpoint(output_dir: Path) -> Path | None:
    """The newest ``checkpoint-N`` that holds everything a resume needs; newer, incomplete ones
    (a kill during a save) are moved aside so LlamaFactory can't pick them up either."""
    candidates = sorted((p for p in output_dir.glob("checkpoint-*") if p.is_dir()), key=_checkpoint_step, reverse=True)
    for ckpt in candidates:
        if _checkpoint_is_complete(ckpt):
            return ckpt
        aside = ckpt.with_name(f".incomplete-{ckpt.name}-{int(time.time())}")
        os.replace(ckpt, aside)
    return None


def _checkpoint_is_complete(ckpt: Path) -> bool:
    if not all((ckpt / name).is_file() for name in CHECKPOINT_FILES):
        return False
    weights = [ckpt / n for n in ("adapter_model.safetensors", "model.safetensors") if (ckpt / n).is_file()]
    weights += sorted(ckpt.glob("model-*.safetensors"))
    if not weights:
        return False
    try:
        json.loads((ckpt / "trainer_state.json").read_text())
        for w in weights:
            read_header(w)
    except (ValueError, OSError, KtflowError):
        return False
    return True


def _is_final_checkpoint(ckpt: Path) -> bool:
    """Whether ``ckpt`` was saved at the run's last step (its trainer state says so)."""
    state = json.loads((ckpt / "trainer_state.json").read_text())
    return 0 < int(state.get("max_steps") or 0) <= int(state.get("global_step") or 0)


def _adapter_from_checkpoint(ckpt: Path, output_dir: Path) -> None:
    """Put the final checkpoint's adapter where LlamaFactory's final save would have, unless a
    complete one is there already (the kill came after that save)."""
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        target = output_dir / name
        try:
            if name.endswith(".safetensors"):
                read_header(target)
            else:
                json.loads(target.read_text())
            continue
        except (OSError, ValueError, KtflowError):
            pass
        partial = target.with_name(f".{name}.partial")
        shutil.copyfile(ckpt / name, partial)
        os.replace(partial, target)


def _trainer_records(callback: Callable[[TrainerProgress], None]) -> Callable[[str], None]:
    """A :class:`~ktflow.host.process.LogFollower` callback: each ``trainer_log.jsonl`` record to ``callback``."""

    def on_line(line: str) -> None:
        try:
            record = TrainerProgress.model_validate(json.loads(line))
        except ValueError:
            return
        callback(record)

    return on_line


# --------------------------------------------------------------------------- the stage


def _train_toolchain(recipe: Recipe) -> ToolchainNeed:
    return recipe.toolchains.train.need(
        "toolchains.train.python", "LlamaFactory (for KT: ktransformers[sft])",
        "kt-train-env" if recipe.sft.backend == "kt" else "train-env",
    )


def tool_versions(python: Path, packages: tuple[str, ...]) -> dict[str, str]:
    """Versions of ``packages`` installed in a toolchain (absent ones are left out)."""
    code = (
        "import json, importlib.metadata as m\n"
        "out = {}\n"
        f"for p in {list(packages)!r}:\n"
        "    try: out[p] = m.version(p)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    return json.loads(done.stdout) if done.returncode == 0 else {}


# A plain CPU run holds the model in fp32 (twice BF16) plus activations and the LoRA state.
_CPU_RAM_FACTOR = 2.5


def measure_sft(model_dir: Path) -> ModelSize:
    """The size :func:`sft_needs` reads, from ``model_dir``'s config and headers (nothing is loaded).

    Raises:
        CheckpointError: the config or a header cannot be read.
    """
    return model_size(model_dir)


def sft_needs(recipe: Recipe, size: ModelSize) -> Resources:
    """What one SFT run of ``recipe`` on a model of ``size`` needs of its host.

    KT keeps the routed experts in CPU RAM (:func:`~ktflow.planning.sizing.estimate_kt_sft_memory`), split
    over ``kt_threadpool_count`` NUMA pools when ``kt_tp_enabled``: one node running out kills
    rank 0 hours in ("Gloo connection closes"), so each node is checked. Plain GPU training holds
    the whole model on the GPUs (:func:`~ktflow.planning.sizing.hf_sft_gpu_need`); a CPU run holds it in
    fp32. Full fine-tuning's checkpoints hold the weights and Adam's two moments. ``ktflow plan``
    reads the same declaration.
    """
    sft = recipe.sft
    gpu: GpuNeed | None = None
    ram: RamNeed | None = None
    if sft.backend in ("kt", "kt-legacy"):
        gpu, ram = kt_sft_needs(size, sft)
    elif sft.gpus == 0:
        ram = RamNeed(bytes=int(size.stored_bytes * _CPU_RAM_FACTOR), what="CPU training",
                      why="the model in fp32 and its activations", of="installed")
    else:
        gpu = hf_sft_gpu_need(size, sft)
    checkpoints = (3 * size.stored_bytes if sft.finetuning_type == "full" else 0) + GiB
    return Resources(
        host=host_requirements(recipe)["sft"], gpu=gpu, ram=ram, toolchain=_train_toolchain(recipe),
        disk=(DiskNeed(bytes=checkpoints, what="sft's checkpoints", fix="free disk at the store, or set store.root"),),
    )


class SftChoice(BaseModel):
    """What ``sft.backend: auto`` resolved to on a host, and why."""

    recipe: Recipe  # the recipe with the chosen backend and KT settings, validated
    backend: Literal["hf", "kt"]
    reason: str
    hf_step_s: float | None = None  # predicted seconds a step (None: hf cannot run here)
    kt_step_s: float | None = None


# Plain SFT is chosen only with this much of the GPUs' memory to spare (the estimate is within a few
# percent on the H100 host; fragmentation and a longer sample than the mean need room).
_HF_GPU_MARGIN = 0.9
# The tuned KT settings (a second BF16 copy of the experts) only where the predicted RSS leaves this
# share of the host's RAM for the page cache and the rest of the system.
_KT_RSS_SHARE = 0.85


def _kt_side(recipe: Recipe, size: ModelSize, host: HostInfo) -> Recipe:
    """auto's KT candidate with the host's settings: a threadpool per NUMA node, and no shared
    backward buffers + retained CPU activations (1.4x faster on the H100 host) where RAM allows."""
    settings: dict[str, Any] = {}
    given = recipe.sft.kt_config.model_fields_set if recipe.sft.kt_config else set()
    if host.numa_nodes > 1 and not given & {"kt_tp_enabled", "kt_threadpool_count"}:
        settings.update(kt_tp_enabled=True, kt_threadpool_count=host.numa_nodes)
    tuned = with_sft_backend(recipe, "kt", kt_share_backward_bb=False, kt_cpu_activation="retain", **settings)
    if estimate_kt_sft_memory(size, tuned.sft).rss_bytes <= _KT_RSS_SHARE * host.ram_bytes:
        return tuned
    return with_sft_backend(recipe, "kt", **settings)


def choose_sft_backend(recipe: Recipe, size: ModelSize, host: HostInfo,
                       model_config: dict[str, Any] | None = None) -> SftChoice:
    """Resolve ``sft.backend: auto`` for ``size`` on ``host``.

    hf when the model, its LoRA state and activations fit the GPUs with a margin, the weights are
    BF16 already, and it is predicted faster (:mod:`ktflow.planning.costs`); kt otherwise, with the host's
    KT settings (:func:`_kt_side`). A recipe's explicit values always win.

    Raises:
        HostRequirementError: neither backend can run here (both reasons named).
    """
    from ktflow.planning.costs import hf_step_seconds, kt_step_seconds

    sft = recipe.sft
    used = host.gpus[: sft.gpus]
    hf_recipe = with_sft_backend(recipe, "hf")
    hf_need = estimate_hf_sft_gpu_memory(size, hf_recipe.sft).total_bytes
    have = sum(g.vram_bytes for g in used)
    hf_problems = []
    if len(used) < sft.gpus:
        hf_problems.append(f"this host has {len(host.gpus)} GPU(s), sft.gpus is {sft.gpus}")
    elif hf_need > _HF_GPU_MARGIN * have:
        hf_problems.append(f"plain SFT needs ~{hf_need / GiB:.1f} GiB of GPU memory, more than "
                           f"{_HF_GPU_MARGIN:.0%} of the {have / GiB:.1f} GiB its {len(used)} GPU(s) have")
    if recipe.source.format != "bf16":
        hf_problems.append(f"the source is {recipe.source.format}: plain SFT would need a BF16 copy first")
    kt_recipe = _kt_side(recipe, size, host)
    kt_problems = check_requirement(host_requirements(kt_recipe)["sft"], host)
    try:
        check_kt_model(kt_recipe, model_config, Path(size.path) / "config.json")
    except InvalidInputError as exc:
        kt_problems.append(exc.reason)
    threads = (kt_recipe.sft.kt_config.kt_num_threads if kt_recipe.sft.kt_config else None) or host.physical_cores
    t_kt = None if kt_problems else kt_step_seconds(size, kt_recipe.sft, threads)
    t_hf = None if hf_problems else hf_step_seconds(size, hf_recipe.sft)
    if t_hf is not None and (t_kt is None or t_hf <= t_kt):
        vs = f", KT {t_kt:.1f} s" if t_kt is not None else f" (KT cannot run: {'; '.join(kt_problems)})"
        reason = (f"hf: the model fits the GPUs (~{hf_need / GiB:.1f} of {have / GiB:.1f} GiB) and a step is "
                  f"predicted at {t_hf:.1f} s{vs}")
        return SftChoice(recipe=hf_recipe, backend="hf", reason=reason, hf_step_s=t_hf, kt_step_s=t_kt)
    if t_kt is not None:
        kt = kt_recipe.sft.kt_config
        assert kt is not None
        tuned = kt.kt_share_backward_bb is False and kt_recipe.sft.kt_cpu_activation == "retain"
        why = "; ".join(hf_problems) or f"KT is predicted faster ({t_kt:.1f} s a step against {t_hf:.1f} s)"
        tuning = ", tuned: no shared backward buffers, activations retained" if tuned else ""
        reason = f"kt ({kt.kt_backend}, {threads} threads{tuning}): {why}; a step is predicted at {t_kt:.1f} s"
        return SftChoice(recipe=kt_recipe, backend="kt", reason=reason, hf_step_s=t_hf, kt_step_s=t_kt)
    raise HostRequirementError("sft.backend: auto", f"neither backend can run here: hf: {'; '.join(hf_problems)}; "
                                                   f"kt: {'; '.join(kt_problems)}.",
                               "run on a host with more GPU memory or a KT-capable CPU (ktflow plan says what each needs)")


def check_hf_fits_gpus(recipe: Recipe, host: HostInfo, model_dir: Path) -> None:
    """Refuse, before anything is loaded (or dequantized), a plain SFT whose model cannot fit the GPUs.

    ``sft.backend: hf`` puts every weight on the GPU in BF16, so a MoE bigger than the GPUs it
    uses stops with CUDA out of memory only after minutes of loading. ``model_dir`` may be the
    quantized source or its BF16 copy: parameters are counted as the values they decode to. It is
    the GPU part of the stage's own preflight (:func:`sft_needs`); other backends and CPU runs pass.

    Raises:
        HostRequirementError: the model, its LoRA state and activations need more GPU memory than
            the ``sft.gpus`` GPUs of this host have; names both figures and ``backend: kt`` as the fix.
        CheckpointError: ``model_dir``'s config or headers cannot be read.
    """
    problem = sft_gpu_memory_problem(recipe, host, model_dir)
    if problem:
        raise HostRequirementError("sft.backend: hf", problem, HF_DOES_NOT_FIT_FIX)


def locate_adapter(recipe: Recipe, model_dir: Path) -> Path:
    """The published adapter of this recipe's run on ``model_dir`` (same data and settings).

    Raises:
        InvalidInputError: the run has not completed (train it first with ``ktflow sft``).
    """
    model_dir = model_dir.absolute()
    template_model = model_dir if recipe.sft.template == "empty" else None
    data = dataset_digest(recipe.dataset, template=recipe.sft.template, model_dir=template_model)
    key = run_key(recipe, base_digest=checkpoint_digest(model_dir), data_digest=data)
    adapter = (run_dir_for(recipe, key) / ADAPTER).absolute()
    if read_manifest(adapter) is None:
        raise InvalidInputError(
            f"recipe '{recipe.name}'", f"has no trained adapter for this base and data (looked in {adapter})",
            "train it first: ktflow sft RECIPE (or ktflow run RECIPE)",
        )
    return adapter


@dataclass(frozen=True, kw_only=True)
class SftRequest:
    """One SFT run: ``recipe``'s training on ``model_dir``, checked against ``host``."""

    recipe: Recipe
    model_dir: Path
    host: HostInfo
    on_record: Callable[[TrainerProgress], None] | None = None
    log: Callable[[str], None] | None = None
    timeout_s: float | None = None
    backend_reason: str | None = None  # why ``sft.backend: auto`` chose this backend


@dataclass(kw_only=True)
class _Job(Job[SftRequest]):
    model_dir: Path
    model_config: dict[str, Any] | None
    base_digest: str
    data_digest: str
    key: str
    run_dir: Path
    resumed_from: Path | None = None
    python: Path | None = None  # the training toolchain's (set by the work)

    @property
    def output_dir(self) -> Path:
        return self.run_dir / LF_OUTPUT


def _prepare(request: SftRequest) -> _Job:
    recipe = request.recipe
    model_dir = request.model_dir.absolute()
    config_path = model_dir / "config.json"
    model_config = json.loads(config_path.read_text()) if config_path.exists() else None
    check_kt_model(recipe, model_config, config_path)
    validate_dataset(recipe.dataset)  # every record, before anything heavy (all bad ones listed)
    template_model = model_dir if recipe.sft.template == "empty" else None
    data_digest = dataset_digest(recipe.dataset, template=recipe.sft.template, model_dir=template_model)
    base_digest = checkpoint_digest(model_dir)
    key = run_key(recipe, base_digest=base_digest, data_digest=data_digest)
    run_dir = run_dir_for(recipe, key).absolute()
    # One writer per run directory: the LlamaFactory output it resumes from lives beside the adapter.
    return _Job(request=request, target=run_dir / ADAPTER, lock_dir=run_dir, model_dir=model_dir,
                model_config=model_config, base_digest=base_digest, data_digest=data_digest, key=key, run_dir=run_dir)


def _lookup(job: _Job) -> SftResult | None:
    published = find_published(job.target, "sft")
    if published is None:
        return None
    return _result_of(job, published, cached=True)


def _work(job: _Job, staging: Path) -> None:
    recipe = job.request.recipe
    job.python = _train_toolchain(recipe).python
    argv, env = _launch_in(job)
    resume = job.resumed_from
    if resume is not None and recipe.sft.finetuning_type == "lora" and _is_final_checkpoint(resume):
        # Killed after the last step's checkpoint, before publishing: a resume from it would make
        # transformers train one step past max_steps. The checkpoint holds the final adapter.
        _adapter_from_checkpoint(resume, job.output_dir)
    else:
        _train(job, argv, env)
    for name in ADAPTER_FILES:
        if (job.output_dir / name).is_file():
            shutil.copy2(job.output_dir / name, staging / name)


def _launch_in(job: _Job) -> tuple[list[str], dict[str, str]]:
    """Prepare the data, write the configs into the run directory and pick up its last checkpoint."""
    recipe, python = job.request.recipe, job.python
    assert python is not None
    template_model = job.model_dir if recipe.sft.template == "empty" else None
    dataset = prepare_dataset(
        recipe.dataset, recipe.store.layout.dataset(f"{recipe.dataset.name}-{job.data_digest[:12]}").absolute(),
        template=recipe.sft.template, model_dir=template_model,
    )
    plan = render_sft(recipe, model_dir=job.model_dir, dataset_dir=dataset.dataset_dir, output_dir=job.output_dir,
                      config_dir=job.run_dir, train_python=python, physical_cores=job.request.host.physical_cores,
                      model_config=job.model_config)
    atomic_write_bytes(job.run_dir / TRAIN_YAML, dump_yaml(plan.train_config).encode())
    if plan.accelerate_config is not None:
        atomic_write_bytes(job.run_dir / ACCELERATE_YAML, dump_yaml(plan.accelerate_config).encode())
    argv = list(plan.launch)
    job.resumed_from = last_complete_checkpoint(job.output_dir) if job.output_dir.exists() else None
    if job.resumed_from is not None:
        argv.append(f"resume_from_checkpoint={job.resumed_from}")  # LlamaFactory takes key=value after the YAML
    elif job.output_dir.exists():
        # Files but no complete checkpoint (killed before the first save): LlamaFactory refuses a
        # non-empty output_dir, and there is nothing to resume, so start this attempt clean.
        shutil.rmtree(job.output_dir)
    env = {**os.environ, "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}", **plan.env}
    env.setdefault("HF_HUB_OFFLINE", "1")  # the base and data are local: never reach for a hub
    return argv, env


def _train(job: _Job, argv: list[str], env: dict[str, str]) -> None:
    """Run LlamaFactory, following its trainer log (progress) and its output (errors)."""
    request = job.request

    def on_record(record: TrainerProgress) -> None:
        job.report(record.current_steps, record.total_steps)
        if request.on_record is not None:
            request.on_record(record)

    forward = ThrottledLines(request.log or (lambda line: None), keep=lambda line: "Error" in line or "error" in line)
    with LogFollower(job.output_dir / TRAINER_LOG, _trainer_records(on_record), poll_s=1.0):
        run_tool(argv, env=env, log_path=job.run_dir / "train.log", on_line=forward, timeout_s=request.timeout_s)


def _verify(job: _Job, staging: Path) -> None:
    missing = [n for n in ("adapter_model.safetensors", "adapter_config.json") if not (staging / n).is_file()]
    if job.request.recipe.sft.finetuning_type == "lora" and missing:
        raise KtflowError(f"LlamaFactory finished but {job.output_dir} lacks {', '.join(missing)}; "
                          f"see {job.run_dir / 'train.log'}")


def _manifest(job: _Job) -> StageManifest:
    recipe, python = job.request.recipe, job.python
    assert python is not None
    summary = _trainer_summary(job.output_dir)
    config_digest = hashlib.sha256((job.run_dir / TRAIN_YAML).read_bytes()).hexdigest()
    return StageManifest(
        stage="sft",
        inputs={"base": job.base_digest, "data": job.data_digest, "config": config_digest},
        settings={"backend": recipe.sft.backend, "run_key": job.key},
        # KT's forks are distributions of their own (llamafactory-kt, transformers-kt, ...) that import
        # under the upstream module names: a KT toolchain has no "transformers" distribution.
        tools=tool_versions(python, _TOOL_PACKAGES),
        extra={"steps": summary["steps"], "final_loss": summary["final_loss"],
               "tokens_per_second": summary["tokens_per_second"],
               "loss_curve": (job.output_dir / "training_loss.png").exists(),
               "resumed_from": str(job.resumed_from) if job.resumed_from else None,
               "backend_reason": job.request.backend_reason},
    )


_TOOL_PACKAGES = ("llamafactory", "transformers", "peft", "torch", "accelerate", "trl", "llamafactory-kt",
                  "transformers-kt", "peft-kt", "accelerate-kt", "trl-kt", "kt-kernel", "ktransformers")


def _result_of(job: _Job, manifest: StageManifest, *, cached: bool) -> SftResult:
    extra = manifest.extra
    curve = job.output_dir / "training_loss.png"
    return SftResult(adapter_dir=job.target, run_dir=job.run_dir, cached=cached,
                     resumed_from=None if cached else extra.get("resumed_from"), steps=extra.get("steps", 0),
                     final_loss=extra.get("final_loss"), seconds=job.seconds(),
                     tokens_per_second=extra.get("tokens_per_second"),
                     loss_curve=curve if extra.get("loss_curve") else None, manifest_digest=manifest.digest(),
                     backend=str(manifest.settings.get("backend", "")), backend_reason=extra.get("backend_reason"))


SFT: StageSpec[SftRequest, _Job, ModelSize, SftResult] = StageSpec(
    name="sft", prepare=_prepare, lookup=_lookup,
    measure=lambda job, staging: measure_sft(job.model_dir),
    needs=lambda request, sizes: sft_needs(request.recipe, sizes),
    work=_work, verify=_verify, manifest=_manifest,
    result=lambda job, manifest: _result_of(job, manifest, cached=False),
    host_fix="run this stage on a host that has them (ktflow doctor)",
)
"""The SFT stage, declared for :func:`~ktflow.runner.run_stage` (and a planner). Its staging holds
only the adapter's copy: what a retry resumes from is LlamaFactory's output in the run directory."""


def run_sft(
    recipe: Recipe,
    *,
    model_dir: Path,
    host: HostInfo,
    progress: Callable[[TrainerProgress], None] | None = None,
    log: Callable[[str], None] | None = None,
    timeout_s: float | None = None,
) -> SftResult:
    """Train (or resume, or reuse) the recipe's adapter on ``model_dir``.

    One run directory has one writer: a second run of the same recipe, base and data waits on
    :func:`~ktflow.store.artifact_lock` (logging whom it waits for), then finds the adapter
    published (a cache hit). A rerun after a crash resumes from the last complete checkpoint.

    Args:
        model_dir: the base weights LlamaFactory loads (BF16, or the INT4 source for KT RAWINT4).
        host: the host the run is checked against (:func:`ktflow.host.hardware.probe_host`).
        progress: receives every record of LlamaFactory's trainer log.
        log: receives LlamaFactory's error lines (throttled).
        timeout_s: stop training after this long (a retry resumes).

    Raises:
        InvalidInputError: the KT backend with a model class it cannot train (:func:`check_kt_model`).
        DatasetError: a bad record (every one is listed); nothing is launched.
        HostRequirementError: this host or toolchain cannot run the recipe's backend, a plain SFT's
            model cannot fit its GPUs (:func:`check_hf_fits_gpus`), too little RAM or free disk, or
            the store is not writable (all before anything is launched).
        StorageError: the store filled up (or became read-only) while preparing or publishing.
        ToolError: LlamaFactory failed (its last lines are in the message; the run resumes on retry).
    """
    choice = resolve_auto_backend(recipe, Path(model_dir), host)
    if choice is not None:
        recipe = choice.recipe
        if log is not None:
            log(f"sft.backend auto -> {choice.reason}")
    request = SftRequest(recipe=recipe, model_dir=Path(model_dir), host=host, on_record=progress, log=log,
                         timeout_s=timeout_s, backend_reason=choice.reason if choice else None)
    return run_stage(SFT, request, host=host)


def resolve_auto_backend(recipe: Recipe, model_dir: Path, host: HostInfo) -> SftChoice | None:
    """:func:`choose_sft_backend` for the model in ``model_dir`` (its headers); None unless the recipe says auto."""
    if recipe.sft.backend != "auto":
        return None
    config_path = Path(model_dir) / "config.json"
    model_config = json.loads(config_path.read_text()) if config_path.is_file() else None
    return choose_sft_backend(recipe, measure_sft(Path(model_dir)), host, model_config)


def _trainer_summary(output_dir: Path) -> dict[str, Any]:
    losses, steps, tokens_per_s = [], 0, None
    log_path = output_dir / TRAINER_LOG
    if log_path.exists():
        for line in log_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            steps = max(steps, int(record.get("current_steps", 0)))
            if record.get("loss") is not None:
                losses.append(float(record["loss"]))
            if record.get("throughput") is not None:
                tokens_per_s = float(record["throughput"])
    results = output_dir / "train_results.json"
    if results.exists():
        tokens_per_s = json.loads(results.read_text()).get("train_tokens_per_second", tokens_per_s)
    return {"steps": steps, "final_loss": losses[-1] if losses else None, "losses": losses,
            "tokens_per_second": tokens_per_s}
