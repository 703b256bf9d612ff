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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from ktflow import ENGINE_VERSION
from ktflow.checkpoint import checkpoint_digest, inspect_checkpoint
from ktflow.dataset import PreparedDataset, dataset_digest, prepare_dataset
from ktflow.errors import HostRequirementError, InvalidInputError, KtflowError
from ktflow.hardware import HostInfo
from ktflow.process import ThrottledLines, run_tool
from ktflow.recipe import Recipe
from ktflow.safetensors_io import read_header
from ktflow.sizing import HF_DOES_NOT_FIT_FIX, sft_gpu_memory_problem
from ktflow.stages import check_requirement, host_requirements
from ktflow.store import (
    StageManifest,
    artifact_lock,
    atomic_write_bytes,
    publish_dir,
    read_manifest,
    staging_dir_for,
    storage_errors,
)

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


def check_hf_fits_gpus(recipe: Recipe, host: HostInfo, model_dir: Path) -> None:
    """Refuse, before anything is loaded (or dequantized), a plain SFT whose model cannot fit the GPUs.

    ``sft.backend: hf`` puts every weight on the GPU in BF16, so a MoE bigger than the GPUs it
    uses stops with CUDA out of memory only after minutes of loading. ``model_dir`` may be the
    quantized source or its BF16 copy: parameters are counted as the values they decode to. The
    arithmetic is :func:`ktflow.sizing.estimate_hf_sft_gpu_memory`; other backends and CPU runs
    pass.

    Raises:
        HostRequirementError: the model, its LoRA state and activations need more GPU memory than
            the ``sft.gpus`` GPUs of this host have; names both figures and ``backend: kt`` as the fix.
        CheckpointError: ``model_dir``'s config or headers cannot be read.
    """
    problem = sft_gpu_memory_problem(recipe, host, model_dir)
    if problem:
        raise HostRequirementError("sft.backend: hf", problem, HF_DOES_NOT_FIT_FIX)


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
    if sft.warmup_ratio:
        cfg["warmup_ratio"] = sft.warmup_ratio
    if sft.max_steps is not None:
        cfg["max_steps"] = sft.max_steps
    if sft.max_samples is not None:
        cfg["max_samples"] = sft.max_samples
    if sft.disable_gradient_checkpointing:
        cfg["disable_gradient_checkpointing"] = True

    bin_dir = train_python.parent
    env: dict[str, str] = {}
    accelerate_config: dict[str, Any] | None = None
    train_yaml = config_dir / TRAIN_YAML
    if sft.backend == "kt":
        assert sft.kt_config is not None  # the recipe validator guarantees it
        kt = sft.kt_config.model_dump(exclude_none=True)
        kt.setdefault("kt_num_threads", physical_cores)
        cfg.update(use_kt=True, kt_weight_path=str(model_dir))
        if sft.kt_cpu_activation is not None:
            cfg["kt_cpu_activation"] = sft.kt_cpu_activation
        cfg["kt_config"] = kt
        accelerate_config = {
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
        launch = [
            str(bin_dir / "accelerate"), "launch", "--config_file", str(config_dir / ACCELERATE_YAML),
            "--no_python", str(bin_dir / "llamafactory-cli"), "train", str(train_yaml),
        ]
    elif sft.backend == "kt-legacy":
        cfg.update(use_kt=True, kt_optimize_rule=sft.kt_optimize_rule, cpu_infer=sft.cpu_infer or physical_cores,
                   chunk_size=sft.chunk_size or 8192)
        env["USE_KT"] = "1"
        launch = [str(bin_dir / "llamafactory-cli"), "train", str(train_yaml)]
    else:
        if sft.gpus == 0:
            cfg["use_cpu"] = True
        launch = [str(bin_dir / "llamafactory-cli"), "train", str(train_yaml)]
    if sft.gpus > 0 and sft.backend != "kt":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(sft.gpus))
    cfg.update(sft.extra_args)
    env.update(recipe.toolchains.train.env)
    return SftPlan(train_config=cfg, accelerate_config=accelerate_config, launch=launch, env=env)


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
    return recipe.store.root / "runs" / f"{recipe.name}-{key[:12]}"


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


class _TrainerLogFollower:
    """Tail ``trainer_log.jsonl`` while training runs and report each new record."""

    def __init__(self, path: Path, callback: Callable[[TrainerProgress], None], poll_s: float = 1.0) -> None:
        self._path, self._callback, self._poll = path, callback, poll_s
        self._stop = threading.Event()
        self._offset = path.stat().st_size if path.exists() else 0
        self._thread = threading.Thread(target=self._run, name="trainer-log", daemon=True)

    def __enter__(self) -> _TrainerLogFollower:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read_new()

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            self._read_new()

    def _read_new(self) -> None:
        if not self._path.exists():
            return
        if self._path.stat().st_size < self._offset:  # rewritten from scratch
            self._offset = 0
        with open(self._path, encoding="utf-8") as f:
            f.seek(self._offset)
            while True:
                line = f.readline()
                if not line.endswith("\n"):  # partial line: wait for the rest
                    break
                self._offset = f.tell()
                try:
                    record = TrainerProgress.model_validate(json.loads(line))
                except ValueError:
                    continue
                self._callback(record)


# --------------------------------------------------------------------------- the stage


def _toolchain_python(recipe: Recipe) -> Path:
    return recipe.toolchains.train.require(
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
    import subprocess

    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    return json.loads(done.stdout) if done.returncode == 0 else {}


_GiB = 1 << 30


def check_sft_resources(recipe: Recipe, host: HostInfo, model_bytes: int) -> list[str]:
    """RAM and disk the run needs on this host, as sentences for what is missing (empty: fine).

    ``model_bytes`` is the base checkpoint's tensor bytes. KT keeps the experts in CPU RAM, split
    over ``kt_threadpool_count`` NUMA pools when ``kt_tp_enabled``; one node running out kills
    rank 0 hours in ("Gloo connection closes"), so each node is checked. A plain CPU run holds
    the model in fp32 (twice BF16) plus gradients and optimizer state of the LoRA weights.
    """
    sft = recipe.sft
    problems = []
    if sft.backend in ("kt", "kt-legacy"):
        pools = sft.kt_config.effective_threadpool_count if sft.kt_config else 1
        per_pool = model_bytes / max(pools, 1)
        nodes = sorted(host.numa, key=lambda n: n.mem_total_bytes)
        if pools > 1 and len(nodes) >= pools:
            smallest = nodes[0]
            if smallest.mem_total_bytes < per_pool * 1.1:
                problems.append(
                    f"sft needs ~{per_pool / _GiB:.0f} GiB per NUMA node for its share of the experts "
                    f"({model_bytes / _GiB:.0f} GiB over {pools} pools); node {smallest.id} has "
                    f"{smallest.mem_total_bytes / _GiB:.0f} GiB"
                )
        if host.ram_bytes < model_bytes * 1.1:
            problems.append(
                f"sft needs ~{model_bytes * 1.1 / _GiB:.0f} GiB of RAM for the CPU experts; this host has "
                f"{host.ram_bytes / _GiB:.0f} GiB"
            )
    elif sft.gpus == 0 and host.ram_bytes < model_bytes * 2.5:
        problems.append(
            f"CPU training needs ~{model_bytes * 2.5 / _GiB:.1f} GiB of RAM (the model in fp32 and its "
            f"activations); this host has {host.ram_bytes / _GiB:.1f} GiB"
        )
    need_disk = (3 * model_bytes if sft.finetuning_type == "full" else 0) + _GiB
    if host.disk_free_bytes < need_disk:
        problems.append(
            f"sft needs ~{need_disk / _GiB:.1f} GiB free at the store for checkpoints; {host.disk_path} has "
            f"{host.disk_free_bytes / _GiB:.1f} GiB"
        )
    return problems


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


def run_sft(
    recipe: Recipe,
    *,
    model_dir: Path,
    host: HostInfo,
    progress: Callable[[TrainerProgress], None] | None = None,
    log: Callable[[str], None] | None = None,
    timeout_s: float | None = None,
    _locked: bool = False,
) -> SftResult:
    """Train (or resume, or reuse) the recipe's adapter on ``model_dir``.

    One run directory has one writer: a second run of the same recipe, base and data waits on
    :func:`~ktflow.store.artifact_lock` (logging whom it waits for), then finds the adapter
    published (a cache hit).

    Raises:
        InvalidInputError: the KT backend with a model class it cannot train (:func:`check_kt_model`).
        DatasetError: a bad record (every one is listed); nothing is launched.
        HostRequirementError: this host or toolchain cannot run the recipe's backend, a plain SFT's
            model cannot fit its GPUs (:func:`check_hf_fits_gpus`), the store has too little free
            disk, or the store is not writable (all before anything is launched).
        StorageError: the store filled up (or became read-only) while preparing or publishing.
        ToolError: LlamaFactory failed (its last lines are in the message; the run resumes on retry).
    """
    started = time.perf_counter()
    model_dir = model_dir.absolute()
    config_path = model_dir / "config.json"
    model_config = json.loads(config_path.read_text()) if config_path.exists() else None
    check_kt_model(recipe, model_config, config_path)
    problems = check_requirement(host_requirements(recipe)["sft"], host)
    if problems:
        raise HostRequirementError("sft", "; ".join(problems), "run this stage on a host that has them (ktflow doctor)")
    check_hf_fits_gpus(recipe, host, model_dir)
    python = _toolchain_python(recipe)
    problems = check_sft_resources(recipe, host, inspect_checkpoint(model_dir).tensor_bytes)
    if problems:
        raise HostRequirementError("sft", "; ".join(problems), "free memory or disk, or use a larger host")
    template_needs_model = recipe.sft.template == "empty"
    data_digest = dataset_digest(recipe.dataset, template=recipe.sft.template,
                                 model_dir=model_dir if template_needs_model else None)
    base_digest = checkpoint_digest(model_dir)
    key = run_key(recipe, base_digest=base_digest, data_digest=data_digest)
    run_dir = run_dir_for(recipe, key).absolute()
    adapter_dir = run_dir / ADAPTER

    published = read_manifest(adapter_dir) if adapter_dir.is_dir() else None
    if published is not None:
        extra = published.extra
        return SftResult(adapter_dir=adapter_dir, run_dir=run_dir, cached=True, resumed_from=None,
                         steps=extra.get("steps", 0), final_loss=extra.get("final_loss"),
                         seconds=time.perf_counter() - started, tokens_per_second=extra.get("tokens_per_second"),
                         loss_curve=run_dir / LF_OUTPUT / "training_loss.png" if extra.get("loss_curve") else None,
                         manifest_digest=published.digest())
    if not _locked:  # one writer per run directory; a concurrent run waits, then finds the adapter
        with artifact_lock(run_dir), storage_errors(adapter_dir):
            return run_sft(recipe, model_dir=model_dir, host=host, progress=progress, log=log, timeout_s=timeout_s,
                           _locked=True)

    # Validate every record before anything heavy; the prepared copy is what LlamaFactory reads.
    dataset: PreparedDataset = prepare_dataset(
        recipe.dataset, (recipe.store.root / "datasets" / f"{recipe.dataset.name}-{data_digest[:12]}").absolute(),
        template=recipe.sft.template, model_dir=model_dir if template_needs_model else None,
    )
    output_dir = run_dir / LF_OUTPUT
    run_dir.mkdir(parents=True, exist_ok=True)
    plan = render_sft(recipe, model_dir=model_dir, dataset_dir=dataset.dataset_dir, output_dir=output_dir,
                      config_dir=run_dir, train_python=python, physical_cores=host.physical_cores,
                      model_config=model_config)
    atomic_write_bytes(run_dir / TRAIN_YAML, dump_yaml(plan.train_config).encode())
    if plan.accelerate_config is not None:
        atomic_write_bytes(run_dir / ACCELERATE_YAML, dump_yaml(plan.accelerate_config).encode())

    resume = last_complete_checkpoint(output_dir) if output_dir.exists() else None
    argv = list(plan.launch)
    if resume is not None:
        argv.append(f"resume_from_checkpoint={resume}")  # LlamaFactory takes key=value after the YAML
    elif output_dir.exists():
        # Files but no complete checkpoint (killed before the first save): LlamaFactory refuses a
        # non-empty output_dir, and there is nothing to resume, so start this attempt clean.
        shutil.rmtree(output_dir)
    env = {**os.environ, "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}", **plan.env}
    env.setdefault("HF_HUB_OFFLINE", "1")  # the base and data are local: never reach for a hub

    last: list[TrainerProgress] = []

    def on_progress(record: TrainerProgress) -> None:
        last.append(record)
        if progress is not None:
            progress(record)

    forward = ThrottledLines(log or (lambda line: None), keep=lambda line: "Error" in line or "error" in line)
    if resume is not None and recipe.sft.finetuning_type == "lora" and _is_final_checkpoint(resume):
        # Killed after the last step's checkpoint, before publishing: a resume from it would make
        # transformers train one step past max_steps. The checkpoint holds the final adapter.
        _adapter_from_checkpoint(resume, output_dir)
    else:
        with _TrainerLogFollower(output_dir / TRAINER_LOG, on_progress):
            run_tool(argv, env=env, log_path=run_dir / "train.log", on_line=forward, timeout_s=timeout_s)

    missing = [n for n in ("adapter_model.safetensors", "adapter_config.json") if not (output_dir / n).is_file()]
    if recipe.sft.finetuning_type == "lora" and missing:
        raise KtflowError(f"LlamaFactory finished but {output_dir} lacks {', '.join(missing)}; see {run_dir / 'train.log'}")
    return _publish_adapter(recipe, run_dir, output_dir, python, base_digest, data_digest, key, resume, started)


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


def _publish_adapter(
    recipe: Recipe, run_dir: Path, output_dir: Path, python: Path, base_digest: str, data_digest: str,
    key: str, resume: Path | None, started: float,
) -> SftResult:
    adapter_dir = run_dir / ADAPTER
    staging = staging_dir_for(adapter_dir)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in ADAPTER_FILES:
        if (output_dir / name).is_file():
            shutil.copy2(output_dir / name, staging / name)
    summary = _trainer_summary(output_dir)
    curve = output_dir / "training_loss.png"
    config_digest = hashlib.sha256((run_dir / TRAIN_YAML).read_bytes()).hexdigest()
    manifest = StageManifest(
        stage="sft",
        inputs={"base": base_digest, "data": data_digest, "config": config_digest},
        settings={"backend": recipe.sft.backend, "run_key": key},
        # KT's forks are distributions of their own (llamafactory-kt, transformers-kt, ...) that import
        # under the upstream module names: a KT toolchain has no "transformers" distribution.
        tools=tool_versions(python, ("llamafactory", "transformers", "peft", "torch", "accelerate", "trl",
                                     "llamafactory-kt", "transformers-kt", "peft-kt", "accelerate-kt", "trl-kt",
                                     "kt-kernel", "ktransformers")),
        extra={"steps": summary["steps"], "final_loss": summary["final_loss"],
               "tokens_per_second": summary["tokens_per_second"], "loss_curve": curve.exists(),
               "resumed_from": str(resume) if resume else None},
    )
    manifest = publish_dir(staging, adapter_dir, manifest)
    return SftResult(adapter_dir=adapter_dir, run_dir=run_dir, cached=False, resumed_from=str(resume) if resume else None,
                     steps=summary["steps"], final_loss=summary["final_loss"], seconds=time.perf_counter() - started,
                     tokens_per_second=summary["tokens_per_second"], loss_curve=curve if curve.exists() else None,
                     manifest_digest=manifest.digest())
