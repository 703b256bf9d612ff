"""Plan before starting: what each stage of a recipe will need of a host, and how long it will take.

The plan assembler: it sits above the stages and reads their declarations, while the models it
uses (sizing, costs, batch shape, a host's speed) are :mod:`ktflow.planning`'s, below the stages.
:func:`check_recipe_on_host` is ``ktflow doctor --recipe``'s table: the stages' host requirements
plus the SFT stage's GPU-memory sizing.

:func:`plan_recipe` reads the SFT and serve stages' own declarations (``sft_needs``,
``serve_needs``: what their preflights check, worded as they word it) for the model's size, sizes
download, dequantize and quantize-int8 by their byte counts (their preflights measure the files
themselves once they are there), and adds a predicted wall time from :class:`~ktflow.planning.costs.CostModel`, whose
constants are fitted on the runs kept in benchmarks/data (``calibration.json`` lists every one
with its source files). ``sft.backend: auto`` is resolved as ``ktflow sft`` would resolve it.

The model's size comes from the checkpoint's headers when it is on this host, else from the
recipe's ``source.size`` (what a model card or config.json says), else from the hub's
safetensors headers, so a 600 GB download is sized before it starts. ``ktflow plan RECIPE [--host FILE]
[--json]`` prints it; ``--host`` plans for another machine described by ``ktflow doctor --json``.

Times are predictions for the host kind they were measured on (an H100 + 16-core AMX Xeon). KT's
step follows the tokens a micro-batch carries (from the dataset's records when the files are here,
else ``cutoff_len`` a record: the line says which), the micro-batches a step holds, the KT threads
(through that host's measured bandwidth and matmul rate, not proportionally) and NUMA pools; the
line names the micro-batch split the SFT stage trains (:mod:`ktflow.planning.batch_shape`). Where a
stage has no calibration (the download's network), the line says so instead of guessing.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, Field

from ktflow.errors import InvalidInputError
from ktflow.host.hardware import HostInfo
from ktflow.host.pools import WORK_POOLS, pool_for_stage
from ktflow.planning.batch_shape import RecordLengths, record_lengths, shape_kt_batches, tokens_basis, tokens_per_micro_batch
from ktflow.planning.costs import COSTS, CostModel, hf_step_seconds, kt_step_estimate, serve_decode_estimate
from ktflow.planning.host_probe import ProbeScale, probe_scale
from ktflow.planning.host_speed import UNCALIBRATED, calibrated_costs, host_records, kt_threads
from ktflow.planning.merge_cost import PROCESS_RUNTIME_BYTES, kt_quantized_layer_bytes, kt_quantizer_process_ram
from ktflow.planning.sizing import ModelSize, hub_model_size, model_size
from ktflow.planning.stage_plan import StageCheck, host_requirements, plan_stages
from ktflow.recipe import ModelFacts, Recipe, int8_threadpool_count
from ktflow.recipe.serving import kt_serving_threads
from ktflow.resources import GpuNeed, RamNeed, StageName, check_requirement, gpu_shortfall, ram_shortfall
from ktflow.units import GB, GiB, human_bytes


class StageEstimate(BaseModel):
    """One stage's predicted needs on one host, and whether they fit."""

    stage: StageName
    needed: bool
    reason: str
    disk_bytes: int = 0
    ram_bytes: int = 0
    gpu_bytes: int = 0  # on each GPU
    gpus: int = 0
    seconds: float | None = None
    step_seconds: float | None = None  # sft: one optimizer step, predicted
    decode_tokens_per_s: float | None = None  # serve (sglang + KT): one sequence's decode, predicted
    measured_decode_tokens_per_s: float | None = None  # serve: the same, measured here by `ktflow tune-serving`
    serving_settings: str = ""  # serve: the engine settings it would use, in brief
    serving_settings_basis: str = ""  # serve: where they come from (the recipe, or a measurement on this machine)
    decode_by_mode: list[str] = []  # serve (sglang): each mode's expected decode at concurrency 1, and why
    kt_probe: ProbeScale | None = None  # sft with KT on a host without KT runs: kt-kernel's kernels timed there
    time_basis: str = ""
    # ``ktflow plan``'s one line for the stage, the essentials of time_basis, reason and candidate (not in the JSON)
    summary: str = Field(default="", exclude=True)
    candidate: str = ""  # evaluate: how a retrained adapter is judged here, and why
    candidate_prices: list[str] = []  # evaluate: what each mode (beside, offline, swap) costs here, and if it fits
    fits: bool = True
    problems: list[str] = []
    pools: list[str] = []  # the work pools (hosts) that run it when distributed; each makes its own copy


class Plan(BaseModel):
    """A recipe's stages on a host: ``ktflow plan``'s output."""

    recipe: str
    host: str
    model_source: str  # where the model's size came from
    model: ModelSize | None
    stages: list[StageEstimate]

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages if s.needed)

    @property
    def disk_by_pool(self) -> dict[str, int]:
        """The disk each host's store needs, by work pool, when distributed (a stage two hosts run,
        as download and dequantize where hosts keep their own stores, counts on each)."""
        disk: dict[str, int] = {}
        for s in self.stages:
            if s.needed:
                for pool in s.pools:
                    disk[pool] = disk.get(pool, 0) + s.disk_bytes
        return disk

    @property
    def seconds(self) -> float | None:
        times = [s.seconds for s in self.stages if s.needed]
        return None if any(t is None for t in times) else sum(t for t in times if t is not None)


# --------------------------------------------------------------------------- time


def sft_steps(recipe: Recipe, records: int | None) -> int | None:
    """Optimizer steps the run takes: ``max_steps``, else epochs over the records (None: unknown)."""
    sft = recipe.sft
    if sft.max_steps is not None:
        return sft.max_steps
    if records is None:
        return None
    per_step = sft.per_device_train_batch_size * sft.gradient_accumulation_steps  # over all GPUs
    records = min(records, sft.max_samples or records)
    return max(1, int(sft.num_train_epochs * -(-records // per_step)))


# --------------------------------------------------------------------------- the plan


def model_size_for(recipe: Recipe) -> tuple[ModelSize | None, str]:
    """The model's size and where it came from: the checkpoint on this host, else the recipe's
    ``source.size``, else the hub's safetensors headers (range requests, no weights), else unknown."""
    from ktflow.stages.weights import expected_source

    source = expected_source(recipe)
    if (source / "config.json").is_file():
        return model_size(source), f"checkpoint headers at {source}"
    facts = recipe.source.size
    if facts is not None:
        return size_from_facts(facts, str(recipe.source.repo_id or recipe.source.uri)), "the recipe's source.size"
    if recipe.source.repo_id is None:
        return None, "unknown: not fetched yet, and the recipe has no source.size"
    import huggingface_hub.constants

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return None, "unknown: not downloaded, no source.size, and the hub is off (HF_HUB_OFFLINE)"
    try:
        size = hub_model_size(recipe.source.repo_id, recipe.source.revision)
    except Exception as exc:  # noqa: BLE001 - any hub failure leaves the size unknown, said why
        return None, f"unknown: not downloaded, no source.size, and the hub did not answer ({type(exc).__name__})"
    return size, f"the hub's safetensors headers of {recipe.source.repo_id}@{recipe.source.revision}"


def size_from_facts(facts: ModelFacts, path: str) -> ModelSize:
    """A :class:`ModelSize` from a recipe's model facts (no LoRA target shapes: LoRA state is small)."""
    return ModelSize(path=path, linear_shapes={}, **facts.model_dump())


def plan_recipe(recipe: Recipe, host: HostInfo, *, size: ModelSize | None = None, model_source: str = "",
                records: int | None = None, lengths: RecordLengths | None = None, costs: CostModel = COSTS,
                probe: bool = False) -> Plan:
    """Predict every stage of ``recipe`` on ``host``: disk, RAM, GPU memory, GPUs and time, and what does not fit.

    Args:
        size: the model's size (default: :func:`model_size_for`).
        records: the training records (default: counted from the dataset files when they exist).
        lengths: the records' tokens (default: read from the dataset files when they exist, with the
            model's tokenizer when the checkpoint is here; else each record counts as ``cutoff_len``).
        probe: ``host`` is this machine: where it has no KT runs and no probe kept for the recipe's KT
            settings, time kt-kernel's SFT kernels here first (:mod:`ktflow.planning.host_probe`, at most
            ~30 s). Without it a kept probe is still used.
    """
    if size is None:
        size, model_source = model_size_for(recipe)
    if records is None:
        records = _count_records(recipe)
    if lengths is None and records is not None:
        from ktflow.stages.weights import expected_source

        lengths = record_lengths(recipe, expected_source(recipe))
    requirements = host_requirements(recipe)
    estimates = []
    for stage in plan_stages(recipe, host):
        line = StageEstimate(stage=stage.stage, needed=stage.needed, reason=stage.reason,
                             pools=stage_pools(recipe, stage.stage))
        if stage.needed:
            line.problems = check_requirement(requirements[stage.stage], host)
            if size is not None:
                _predict(line, recipe, host, size, records, lengths, costs, probe)
            else:
                line.time_basis = "model size unknown"
            line.fits = not line.problems
        estimates.append(line)
    return Plan(recipe=recipe.name, host=host.hostname, model_source=model_source, model=size, stages=estimates)


def stage_pools(recipe: Recipe, stage: StageName) -> list[str]:
    """The work pools that run ``stage`` of ``recipe`` when distributed: its own, and, where hosts keep
    their own stores (``store.artifacts``), the pools that make the base weights for themselves."""
    pools = [pool_for_stage(stage).name]
    if recipe.store.artifacts:
        pools += [p.name for p in WORK_POOLS if stage in p.prepares]
    return pools


def _count_records(recipe: Recipe) -> int | None:
    from ktflow.errors import KtflowError
    from ktflow.formats.dataset import validate_dataset

    try:
        return validate_dataset(recipe.dataset) if all(Path(f).is_file() for f in recipe.dataset.files) else None
    except KtflowError:
        return None


def _predict(line: StageEstimate, recipe: Recipe, host: HostInfo, size: ModelSize, records: int | None,
             lengths: RecordLengths | None, costs: CostModel, probe: bool = False) -> None:
    bf16_bytes = 2 * size.parameters
    ram: RamNeed | None = None
    gpu: GpuNeed | None = None
    if line.stage == "download":
        line.disk_bytes = size.stored_bytes
        line.time_basis = "network-bound: not predicted"
        line.summary = f"{human_bytes(size.stored_bytes)} to fetch; the time depends on the network (not predicted)"
    elif line.stage == "dequantize":
        line.disk_bytes = bf16_bytes
        # Measured peak RSS 279-847 MB (README, dequantize); the stage declares disk only.
        ram = RamNeed(bytes=GiB, what="dequantize", why="python, torch and a few MB of scratch per worker")
        line.seconds = bf16_bytes / costs.dequantize_bytes_per_s
        line.time_basis = f"{costs.dequantize_bytes_per_s / GB:.1f} GB/s of BF16 written (fsync)"
        line.summary = f"a BF16 copy of the checkpoint, written at {costs.dequantize_bytes_per_s / GB:.1f} GB/s"
    elif line.stage == "sft":
        ram, gpu = _predict_sft(line, recipe, host, size, records, lengths, costs, probe)
    elif line.stage == "quantize-int8":
        expert_bf16 = 2 * size.expert_parameters
        layer_bf16, layer_int8 = kt_quantized_layer_bytes(size, "AMXINT8", int8_threadpool_count(recipe))
        line.disk_bytes = max(size.moe_layers, 1) * layer_int8  # INT8 and its row scales
        ram = RamNeed(bytes=kt_quantizer_process_ram(layer_bf16, layer_int8, scratch_in_ram=True),
                      what="quantize-int8", why="one MoE layer's BF16 experts twice (the driver's and kt-kernel's as "
                                                 "it quantizes), their INT8 and its scratch in /dev/shm, "
                                                 f"~{PROCESS_RUNTIME_BYTES / GiB:.0f} GiB of runtime")
        line.seconds = expert_bf16 / (costs.quantize_bytes_per_core_s * host.physical_cores)
        line.time_basis = f"{costs.quantize_bytes_per_core_s / GB:.2f} GB/s of BF16 experts per core"
        line.summary = (f"INT8 experts for serving, {costs.quantize_bytes_per_core_s / GB:.2f} GB/s of BF16 a core "
                        f"on {host.physical_cores} cores")
    elif line.stage == "serve":
        from ktflow.stages.serve import ServeSizes, serve_needs

        needs = serve_needs(recipe, ServeSizes(model=size, kt_weight_bytes=_kt_bytes(recipe, size)))
        ram, gpu = needs.ram, needs.gpu
        line.summary = line.reason
        if recipe.serving.backend == "sglang" and recipe.serving.kt_method:
            recipe = _serving_settings(line, recipe, host)
            serving = recipe.serving
            threads = kt_serving_threads(serving, host.physical_cores)
            decode = serve_decode_estimate(size, str(serving.kt_method), threads, costs, mode=serving.resolved_mode)
            if decode is not None:
                line.decode_tokens_per_s = decode.tokens_per_s
                line.time_basis = decode.basis
            _price_serving_mode(line, recipe, host, size, costs)
            line.decode_by_mode = _decode_by_mode(recipe, host, size, costs, line)
    elif line.stage == "convert-lora":
        line.disk_bytes = GiB
        line.summary = line.reason
    elif line.stage == "evaluate":
        ram, gpu = _predict_candidate(line, recipe, host, size)
    _check_fit(line, host, ram, gpu)


def _price_serving_mode(line: StageEstimate, recipe: Recipe, host: HostInfo, size: ModelSize, costs: CostModel) -> None:
    """The serving mode in the serve line's reason; for ``merged``, the merge stage the serve stage runs first:
    its time (the line's), its output on disk, and its peak RAM against what the host has."""
    from ktflow.planning.merge_cost import merge_estimate

    serving = recipe.serving
    mode = serving.resolved_mode
    why = "set by serving.mode" if serving.mode != "auto" else (
        f"auto: the merge stage writes {serving.kt_method}" if mode == "merged" else
        f"auto: the merge stage does not write {serving.kt_method}")
    measured = line.serving_settings_basis.startswith("serving settings measured")
    if line.measured_decode_tokens_per_s is not None:
        decode = (f"; {line.measured_decode_tokens_per_s:.1f} tokens/s decode at concurrency 1 measured on this "
                  f"machine with {line.serving_settings}")
    else:
        decode = (f"; ~{line.decode_tokens_per_s:.1f} tokens/s decode at concurrency 1"
                  if line.decode_tokens_per_s is not None else "")
        if line.serving_settings:
            decode += (f" with the settings measured on this machine ({line.serving_settings})" if measured
                       else f" with the recipe's settings ({line.serving_settings})")
    if mode == "lora":
        line.reason += f"; the adapter through KT's LoRA path ({why}: CUDA graphs off, no GPU experts)"
        line.summary = f"lora mode ({why}){decode}"
        return
    assert serving.kt_method is not None
    merge = merge_estimate(size, serving.kt_method, host.physical_cores, serving.kt_threadpool_count, costs)
    line.reason += (f"; the adapter merged into the weights as {serving.kt_method} ({why}), served with no LoRA "
                    "flags")
    line.seconds = merge.seconds
    line.disk_bytes += merge.disk_bytes
    merge_basis = (f"merge first: ~{merge.seconds / 60:.0f} min, {merge.disk_bytes / GiB:.1f} GiB on disk, "
                   f"{merge.ram_bytes / GiB:.1f} GiB RAM at its peak ({merge.basis})")
    line.time_basis = f"{line.time_basis}; {merge_basis}" if line.time_basis else merge_basis
    line.summary = f"merged mode ({why}), merging first takes ~{brief_duration(merge.seconds)}{decode}"
    shortfall = ram_shortfall("merge", RamNeed(bytes=merge.ram_bytes, what="merge", why=merge.basis), host)
    if shortfall:
        line.problems.append(f"{shortfall}; or set serving.mode: lora")


def _serving_settings(line: StageEstimate, recipe: Recipe, host: HostInfo) -> Recipe:
    """The serve line's engine settings: those ``ktflow tune-serving`` measured on ``host``'s machine for this model
    and mode where the store keeps them (applied as the serve stage applies them), else the recipe's own. Returns
    the recipe the serve stage would start."""
    from ktflow.stages.serve.levers import (
        expected_served_model,
        kept_levers,
        lever_settings,
        measured_decode,
        recipe_with_levers,
        split_choice,
    )

    model = expected_served_model(recipe)
    record = kept_levers(recipe.store.root, host.machine, model) if model is not None else None
    if model is None or record is None:
        line.serving_settings = lever_settings(recipe.serving, host.physical_cores)
        line.serving_settings_basis = ("the recipe's serving section (no measurement of this machine kept in the "
                                       "store: `ktflow tune-serving RECIPE` measures one)")
        return recipe
    applied, _ = split_choice(recipe.serving, record)
    served, said = recipe_with_levers(recipe, record)  # the record read above, applied as the serve stage does
    line.serving_settings = lever_settings(served.serving, host.physical_cores)
    line.serving_settings_basis = said
    if served is not recipe or not applied:
        line.measured_decode_tokens_per_s = measured_decode(record, applied)
    return served


def _decode_by_mode(recipe: Recipe, host: HostInfo, size: ModelSize, costs: CostModel,
                    line: StageEstimate) -> list[str]:
    """Each serving mode's expected decode at concurrency 1 on ``host``, and why: the decode model of that mode
    (KT's LoRA path with CUDA graphs off; merged weights and the base model without LoRA flags, graphs on), a
    measurement on this machine where one is kept."""
    from ktflow.recipe.serving import MERGED_METHODS
    from ktflow.stages.serve.levers import expected_served_model, kept_levers

    serving = recipe.serving
    method = str(serving.kt_method)
    threads = kt_serving_threads(serving, host.physical_cores)

    def predicted(mode: str) -> str:
        estimate = serve_decode_estimate(size, method, threads, costs, mode=mode)
        if estimate is None:
            return "no estimate (the model's experts are not known)"
        how = "KT's LoRA path, CUDA graphs off" if mode == "lora" else "no LoRA flags, CUDA graphs on"
        return f"~{estimate.tokens_per_s:.1f} tokens/s predicted ({how}; the decode model of this mode)"

    lines = []
    for mode in ("lora", "merged"):
        if mode == "merged" and method not in MERGED_METHODS:
            lines.append(f"merged: not available: the merge stage does not write {method}")
            continue
        if mode == "lora" and method == "AMXINT4":
            lines.append("lora: not available: AMXINT4 experts exist only as a merge")
            continue
        model = expected_served_model(recipe, mode)  # type: ignore[arg-type]
        record = kept_levers(recipe.store.root, host.machine, model) if model is not None else None
        chosen = record.choice if record is not None else None
        if chosen is not None:
            lines.append(f"{mode}: {chosen.decode_tokens_per_s:.1f} tokens/s measured on this machine on "
                         f"{record.measured_at[:10]} with {chosen.name} ({chosen.reason})")  # type: ignore[union-attr]
        elif mode == "lora":
            lines.append(f"lora: {predicted('lora')}")
        else:
            lines.append(f"merged: {predicted('merged')}; not measured on this machine yet "
                         f"(`ktflow tune-serving RECIPE --set serving.mode=merged` measures it)")
    lines.append(f"base: {predicted('base')}: the base model served as merged weights are")
    mode = serving.resolved_mode
    return [f"{text} (this recipe's mode)" if text.startswith(f"{mode}:") else text for text in lines]


def _predict_candidate(line: StageEstimate, recipe: Recipe, host: HostInfo, size: ModelSize
                       ) -> tuple[RamNeed | None, GpuNeed | None]:
    """How a candidate is judged on ``host`` (``evaluation.candidate`` or the choice from its memory),
    what that costs beside production (the serve stage's own declaration of a candidate), and what
    each of the three modes would cost there (``candidate_prices``)."""
    from ktflow.stages.serve import ServeSizes, choose_candidate_mode

    sizes = ServeSizes(model=size, kt_weight_bytes=_kt_bytes(recipe, size))
    choice = choose_candidate_mode(recipe, sizes, host, production_running=False)
    line.candidate = f"candidate judged {choice.mode}: {choice.reason}"
    line.reason += f"; {line.candidate}"
    how, why = _CANDIDATE_MODES[choice.mode]
    line.summary = f"candidate judged {how} (" + (
        "set by evaluation.candidate" if recipe.evaluation.candidate is not None else why) + ")"
    line.candidate_prices = [p.brief() for p in choice.prices]
    line.ram_bytes, line.gpu_bytes = choice.ram_bytes, choice.gpu_bytes
    if recipe.evaluation.candidate is not None and choice.problem:  # chosen by the recipe: checked
        line.problems.append(f"candidate {choice.mode}: {choice.problem}")
    return None, None


# evaluate's line: how the candidate is judged, and why that mode when the host's memory chose it
_CANDIDATE_MODES = {
    "beside": ("beside production, which keeps serving", "it fits here"),
    "offline": ("offline through the training toolchain, production keeps serving",
                "servers beside production do not fit here"),
    "swap": ("in production's place (swap), and a failed gate rolls production back",
             "neither beside production nor offline fits here"),
}


def _kt_bytes(recipe: Recipe, size: ModelSize) -> int:
    """The CPU experts' bytes as ``serving.kt_method`` reads them."""
    return size.expert_parameters if recipe.serving.kt_method == "AMXINT8" else size.expert_stored_bytes


def _predict_sft(line: StageEstimate, recipe: Recipe, host: HostInfo, size: ModelSize, records: int | None,
                 lengths: RecordLengths | None, costs: CostModel,
                 probe: bool = False) -> tuple[RamNeed | None, GpuNeed | None]:
    """The SFT line's time, and its declared RAM and GPU needs (``sft_needs``, what its preflight checks).

    KT's micro-batch split is the one the SFT stage will train (``sft.kt_shape_batches``), and the line
    names a faster one when the recipe pins its own. A host without KT runs has KT's CPU passes scaled by
    its probe (:func:`~ktflow.planning.host_probe.probe_scale`; ``probe``: run it here if none is kept)."""
    from ktflow.errors import HostRequirementError
    from ktflow.stages.sft import choose_sft_backend, sft_needs
    from ktflow.stages.weights import trains_on_source

    if not trains_on_source(recipe):  # SFT reads the BF16 copy dequantize makes, not the source as stored
        size = size.model_copy(update={"stored_bytes": 2 * size.parameters,
                                       "expert_stored_bytes": 2 * size.expert_parameters})
    chosen, shaped = "", ""
    if recipe.sft.backend == "auto":
        try:
            choice = choose_sft_backend(recipe, size, host, lengths=lengths)
        except HostRequirementError as exc:
            line.problems.append(exc.reason)
            return None, None
        recipe, chosen, shaped = choice.recipe, f"auto -> {choice.reason}. ", choice.batch_shape or ""
        line.summary = f"auto chose {choice.backend.upper()}, "
        costs = _probe_kt(line, recipe, size, host, probe, costs)  # the choice itself is made as fitted
    elif recipe.sft.backend == "kt":
        costs = _probe_kt(line, recipe, size, host, probe, costs)
        shape = shape_kt_batches(recipe, size, host, lengths, costs)
        recipe, shaped = shape.recipe, shape.reason
    sft = recipe.sft
    needs = sft_needs(recipe, size)
    line.disk_bytes = sum(d.bytes for d in needs.disk)
    line.gpus = sft.gpus
    gb = size.stored_bytes / GB
    tokens = tokens_per_micro_batch(sft, lengths)
    if sft.backend == "kt":
        threads = kt_threads(sft, host.physical_cores)
        host_costs, speed = calibrated_costs(recipe, host.hostname, threads, tokens, size.expert_stored_bytes, costs,
                                             machine=host.machine)
        estimate = kt_step_estimate(size, sft, threads, host_costs, tokens)
        step = estimate.step_s
        load = costs.kt_load_s + costs.kt_load_s_per_gb * gb
        calibration = speed.basis if speed is not None else UNCALIBRATED
        calibrated = (f"calibrated on this host (x{speed.factor:.2f})" if speed is not None else
                      f"scaled x{line.kt_probe.factor:.2f} by this machine's KT probe"
                      if line.kt_probe is not None and line.kt_probe.factor != 1.0 else "not yet calibrated on this host")
        if speed is None and line.kt_probe is not None:
            calibration += f"; {line.kt_probe.basis}"
        # The routing the step assumes: a router that concentrates a micro-batch on fewer experts makes small
        # micro-batches cheaper than this (benchmarks/kt_routing.py).
        reached = (f", a micro-batch reaching {estimate.active_experts:.0f} of {size.routed_experts} routed experts a "
                   "MoE layer (balanced routing)" if size.routed_experts else "")
        basis = (f"KT step {step:.1f} s ({threads} threads in {estimate.pools} NUMA pool(s), "
                 f"{sft.gpu_split().describe()}, "
                 f"{tokens_basis(sft, lengths)}{reached}; "
                 f"{estimate.step_s / estimate.flop_floor_s:.1f}x the expert FLOP floor; "
                 f"model fitted on the H100 + 16-core AMX host, benchmarks/data/kt-throughput; {calibration})")
        if sft.gpus > 1:
            step = step / costs.kt_multi_gpu_speed
            basis += (f"; on {sft.gpus} GPUs {step:.1f} s, slower than on one ({costs.kt_multi_gpu_speed:.2f}x its "
                      "tokens/s): KT's CPU experts stream every micro-batch of the step whatever the GPU count, and "
                      "the ranks add their hand-offs (fitted on 2 x H200 tiny runs, 0.61-0.65x; the 57B model on "
                      "4 x H200, not used to fit: 0.66x on 2 GPUs, 0.65x on 4; benchmarks/data/multi-gpu); more "
                      "GPUs add GPU memory, not speed")
    elif sft.backend == "hf" and sft.gpus > 0:
        step = hf_step_seconds(size, sft, costs, tokens_per_step=round(tokens * sft.gradient_accumulation_steps))
        load = costs.hf_load_s + costs.hf_load_s_per_gb * gb
        basis = f"step {step:.1f} s ({tokens_basis(sft, lengths)}; fitted on the H100 host)"
        calibrated = "as fitted on the H100 host (no per-host calibration)"
    else:
        line.time_basis = f"{chosen}no calibration for sft.backend {sft.backend} on {sft.gpus} GPU(s)"
        line.summary = line.summary or f"{sft.backend}, "
        line.summary += f"time not predicted (no calibration for it on {sft.gpus} GPU(s))"
        return needs.ram, needs.gpu
    line.step_seconds = step
    if shaped:
        basis += f"; {shaped}"
    steps = sft_steps(recipe, records)
    line.summary = (line.summary or f"{sft.backend.upper()}, ") + (
        f"{brief_duration(step)} a step ({sft.gpu_split().describe().split(': ', 1)[1]})"
        f"{f', {steps:,} steps' if steps is not None else ''}, {calibrated}")
    if steps is None:
        line.time_basis = chosen + basis + "; steps unknown until the dataset is here"
        line.summary += "; steps unknown until the dataset is here"
        return needs.ram, needs.gpu
    line.seconds = costs.prelaunch_s + load + steps * step + costs.publish_s
    line.time_basis = f"{chosen}{basis}; {steps} steps"
    return needs.ram, needs.gpu


def _probe_kt(line: StageEstimate, recipe: Recipe, size: ModelSize, host: HostInfo, run: bool,
              costs: CostModel) -> CostModel:
    """``costs`` with KT's CPU passes scaled by ``host``'s probe, and the probe on ``line``; ``costs`` as given
    where ``recipe`` trains without KT or the host has KT runs (they calibrate it instead)."""
    if recipe.sft.backend != "kt":
        return costs
    threads = kt_threads(recipe.sft, host.physical_cores)
    if host_records(recipe, host.hostname, threads, host.machine):
        return costs
    line.kt_probe = probe_scale(recipe, size, host, threads, costs, run=run)
    return costs.model_copy(update={"kt_cpu_factor": line.kt_probe.factor})


def _check_fit(line: StageEstimate, host: HostInfo, ram: RamNeed | None, gpu: GpuNeed | None) -> None:
    """What of ``line`` does not fit ``host``: RAM and GPU memory as the stages' preflights word and
    check them (:func:`~ktflow.resources.ram_shortfall`, :func:`~ktflow.resources.gpu_shortfall`); disk
    against the host's free-disk figure (a plan may be for another host, whose filesystem is not here)."""
    if ram is not None:
        line.ram_bytes = ram.bytes
        line.problems += filter(None, [ram_shortfall(line.stage, ram, host)])
    if gpu is not None:
        line.gpu_bytes = gpu.bytes // gpu.gpus if gpu.summed else gpu.bytes
        line.gpus = line.gpus or gpu.gpus
        line.problems += filter(None, [gpu_shortfall(line.stage, gpu, host)])
    if line.disk_bytes > host.disk_free_bytes:
        line.problems.append(f"needs ~{line.disk_bytes / GiB:.1f} GiB of disk; {host.disk_path} has "
                             f"{host.disk_free_bytes / GiB:.1f} GiB free")


def brief_duration(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.4 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def check_recipe_on_host(recipe: Recipe, host: HostInfo) -> list[StageCheck]:
    """The doctor's table: every stage of the recipe, whether it runs, and whether it can run here."""
    reqs = host_requirements(recipe)
    checks = []
    for plan in plan_stages(recipe, host):
        missing = check_requirement(reqs[plan.stage], host) if plan.needed else []
        if plan.stage == "sft" and plan.needed and not missing:
            missing = _sft_size_problems(recipe, host)
        checks.append(
            StageCheck(
                stage=plan.stage,
                needed=plan.needed,
                reason=plan.reason,
                runnable=not missing,
                missing=missing,
            )
        )
    return checks


def _sft_size_problems(recipe: Recipe, host: HostInfo) -> list[str]:
    """The SFT stage's GPU-memory preflight (``ktflow.stages.sft.check_hf_fits_gpus``), where the model is
    already on this host (a local source, or a hub source downloaded): headers only, no download."""
    from ktflow.errors import CheckpointError
    from ktflow.planning.sizing import HF_DOES_NOT_FIT_FIX, sft_gpu_memory_problem
    from ktflow.stages.weights import expected_source

    source = expected_source(recipe)
    if not (source / "config.json").is_file():
        return []
    try:
        problem = sft_gpu_memory_problem(recipe, host, source)
    except CheckpointError as exc:
        return [f"sft cannot size the model: {exc}"]
    return [f"sft: {problem} Fix: {HF_DOES_NOT_FIT_FIX}"] if problem else []


def load_host(path: Path) -> HostInfo:
    """A host described by ``ktflow doctor --json`` (its recipe and stage checks are ignored).

    Raises:
        InvalidInputError: the file is not such a description.
    """
    try:
        document = json.loads(Path(path).read_text())
        if not isinstance(document, dict):
            raise ValueError(f"a JSON {type(document).__name__}, not an object")
        return HostInfo.model_validate({k: v for k, v in document.items() if k in HostInfo.model_fields})
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"--host {path}", f"is not a host description: {exc}",
                                "write one with `ktflow doctor --json > host.json` on that host") from None
