"""The SFT stage declared for :func:`~ktflow.runner.run_stage`: :func:`run_sft` validates the data,
checks the host, and runs training in the training toolchain inside a deterministic run directory,
so a retry or a rerun after a crash resumes from the last complete checkpoint. The finished adapter
is published atomically with its manifest; a completed run is a cache hit. Its needs
(:func:`sft_needs`) are what ``ktflow plan`` reads."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ktflow.errors import InvalidInputError, KtflowError
from ktflow.formats.adapter import ADAPTER_FILES
from ktflow.formats.checkpoint import checkpoint_digest, checkpoint_fingerprint
from ktflow.formats.dataset import dataset_digest, prepare_dataset, validate_dataset
from ktflow.host.hardware import HostInfo, probe_host
from ktflow.host.process import LogFollower, ThrottledLines, run_tool, tool_versions
from ktflow.planning.host_speed import kt_step_record, kt_threads
from ktflow.planning.sizing import (
    ModelSize,
    hf_sft_gpu_need,
    kt_sft_needs,
    model_size,
)
from ktflow.planning.stage_plan import host_requirements
from ktflow.recipe import GpuSplit, Recipe
from ktflow.resources import DiskNeed, GpuNeed, RamNeed, Resources, ToolchainNeed
from ktflow.runner import Job, StageSpec, find_published, run_stage
from ktflow.stages.sft.auto import resolve_sft_recipe
from ktflow.stages.sft.render import (
    ACCELERATE_YAML,
    ADAPTER,
    LF_OUTPUT,
    TRAIN_YAML,
    TRAINER_LOG,
    SftResult,
    TrainerProgress,
    check_kt_model,
    dump_yaml,
    render_sft,
)
from ktflow.stages.sft.resume import (
    _adapter_from_checkpoint,
    _is_final_checkpoint,
    _trainer_records,
    last_complete_checkpoint,
    run_dir_for,
    run_key,
)
from ktflow.store import StageManifest, atomic_write_bytes, read_manifest
from ktflow.units import GiB

# --------------------------------------------------------------------------- the stage


def _train_toolchain(recipe: Recipe) -> ToolchainNeed:
    return recipe.toolchains.train.need(
        "toolchains.train.python", "LlamaFactory (for KT: ktransformers[sft])",
        "kt-train-env" if recipe.sft.backend == "kt" else "train-env",
    )


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


def run_adapter_dir(recipe: Recipe, model_dir: Path, host: HostInfo | None = None) -> Path:
    """Where this recipe's run on ``model_dir`` (same data and settings) publishes its adapter,
    whether or not it has run. ``sft.backend: auto`` is resolved as :func:`run_sft` resolves it on
    ``host`` (default: this host), since the run's identity is the resolved recipe's."""
    model_dir = model_dir.absolute()
    return _adapter_dir(recipe, model_dir, host, *_digests(recipe, model_dir))


def _digests(recipe: Recipe, model_dir: Path) -> tuple[str, str]:
    """The base's and the data's digests (``auto``'s resolution changes neither)."""
    template_model = model_dir if recipe.sft.template == "empty" else None
    data = dataset_digest(recipe.dataset, template=recipe.sft.template, model_dir=template_model)
    return checkpoint_digest(model_dir), data


def _adapter_dir(recipe: Recipe, model_dir: Path, host: HostInfo | None, base: str, data: str) -> Path:
    if recipe.sft.backend == "auto":
        recipe = resolve_sft_recipe(recipe, model_dir, host or probe_host()).recipe
    return (run_dir_for(recipe, run_key(recipe, base_digest=base, data_digest=data)) / ADAPTER).absolute()


def locate_adapter(recipe: Recipe, model_dir: Path, host: HostInfo | None = None) -> Path:
    """The published adapter of this recipe's run on ``model_dir`` (same data and settings).

    An ``sft.backend: auto`` recipe is resolved on ``host`` (default: this host) first; where that
    run is not here (another host trained it and resolved auto its own way, or this host cannot
    resolve it: no GPU), the store's published runs of the recipe are searched for the one trained
    from the recipe as written (its manifest's ``written_key``).

    Raises:
        InvalidInputError: the run has not completed (train it first with ``ktflow sft``).
    """
    model_dir = model_dir.absolute()
    base, data = _digests(recipe, model_dir)
    try:
        adapter = _adapter_dir(recipe, model_dir, host, base, data)
    except KtflowError:
        if recipe.sft.backend != "auto":
            raise
        adapter = None  # auto cannot resolve on this host: the search below still finds a run
    if adapter is not None and read_manifest(adapter) is not None:
        return adapter
    if recipe.sft.backend == "auto":
        written_key = run_key(recipe, base_digest=base, data_digest=data)
        for candidate in sorted(recipe.store.layout.run(recipe.name).parent.glob(f"{recipe.name}-*/{ADAPTER}")):
            manifest = read_manifest(candidate)
            if manifest is not None and manifest.settings.get("written_key") == written_key:
                return candidate.absolute()
    raise InvalidInputError(
        f"recipe '{recipe.name}'", f"has no trained adapter for this base and data (looked in "
        f"{adapter or recipe.store.layout.run(recipe.name).parent})",
        "train it first: ktflow sft RECIPE (or ktflow run RECIPE)",
    )


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
    batch_shape: str | None = None  # the KT micro-batch split chosen (or that would be), and why
    written: Recipe | None = None  # the recipe as written, where ``sft.backend: auto`` resolved it


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
        inputs={"base": job.base_digest, "data": job.data_digest, "config": config_digest,
                "base_fingerprint": checkpoint_fingerprint(job.request.model_dir)},
        settings={"backend": recipe.sft.backend, "run_key": job.key,
                  # an auto recipe's run is found from the recipe as written on any host (locate_adapter)
                  **({"written_key": run_key(job.request.written, base_digest=job.base_digest,
                                             data_digest=job.data_digest)} if job.request.written else {})},
        # KT's forks are distributions of their own (llamafactory-kt, transformers-kt, ...) that import
        # under the upstream module names: a KT toolchain has no "transformers" distribution.
        tools=tool_versions(python, _TOOL_PACKAGES),
        extra={"steps": summary["steps"], "final_loss": summary["final_loss"],
               "tokens_per_second": summary["tokens_per_second"],
               "loss_curve": (job.output_dir / "training_loss.png").exists(),
               "resumed_from": str(job.resumed_from) if job.resumed_from else None,
               "backend_reason": job.request.backend_reason, "batch_shape": job.request.batch_shape,
               "batch": recipe.sft.gpu_split().model_dump(),
               "kt_step": _kt_step_record(job, summary["records"])},
    )


def _kt_step_record(job: _Job, records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The evidence the next plan on this host is scaled by (:mod:`ktflow.planning.host_speed`)."""
    sft, host = job.request.recipe.sft, job.request.host
    if sft.backend != "kt":
        return None
    try:
        size = measure_sft(job.model_dir)
    except KtflowError:  # measured before training; a record is evidence for later plans, never worth the run
        return None
    record = kt_step_record(sft, host.hostname, kt_threads(sft, host.physical_cores), size, records, host.machine)
    return record.model_dump(mode="json") if record is not None else None


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
                     backend=str(manifest.settings.get("backend", "")), backend_reason=extra.get("backend_reason"),
                     batch_shape=extra.get("batch_shape"), kt_step=extra.get("kt_step"),
                     batch=GpuSplit.model_validate(extra["batch"]).describe() if extra.get("batch") else None)


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
    resolved = resolve_sft_recipe(recipe, Path(model_dir), host)
    if resolved.backend_reason and log is not None:
        log(f"sft.backend auto -> {resolved.backend_reason}")
    if resolved.batch_shape and log is not None:
        log(f"sft {resolved.batch_shape}")
    request = SftRequest(recipe=resolved.recipe, model_dir=Path(model_dir), host=host, on_record=progress, log=log,
                         timeout_s=timeout_s, backend_reason=resolved.backend_reason,
                         batch_shape=resolved.batch_shape,
                         written=recipe if recipe.sft.backend == "auto" else None)
    return run_stage(SFT, request, host=host)


def _trainer_summary(output_dir: Path) -> dict[str, Any]:
    losses, steps, tokens_per_s, records = [], 0, None, []
    log_path = output_dir / TRAINER_LOG
    if log_path.exists():
        for line in log_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            records.append(record)
            steps = max(steps, int(record.get("current_steps", 0)))
            if record.get("loss") is not None:
                losses.append(float(record["loss"]))
            if record.get("throughput") is not None:
                tokens_per_s = float(record["throughput"])
    results = output_dir / "train_results.json"
    if results.exists():
        tokens_per_s = json.loads(results.read_text()).get("train_tokens_per_second", tokens_per_s)
    return {"steps": steps, "final_loss": losses[-1] if losses else None, "losses": losses,
            "tokens_per_second": tokens_per_s, "records": records}
