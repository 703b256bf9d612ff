"""``sft.backend: auto``: hf when the model fits the GPUs with a margin, the weights are BF16 already and
it is predicted faster, else kt with this host's settings and, where the recipe lets it
(``sft.kt_shape_batches``), the micro-batch split KT trains fastest; and refusing plain SFT of a model the
GPUs cannot hold before anything is downloaded or converted."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from ktflow.errors import HostRequirementError, InvalidInputError
from ktflow.host.hardware import HostInfo
from ktflow.planning.batch_shape import RecordLengths, ShapeChoice, record_lengths, shape_kt_batches, tokens_per_micro_batch
from ktflow.planning.host_speed import calibrated_costs, kt_threads
from ktflow.planning.sizing import (
    HF_DOES_NOT_FIT_FIX,
    ModelSize,
    estimate_hf_sft_gpu_memory,
    estimate_kt_sft_memory,
    model_size,
    sft_gpu_memory_problem,
)
from ktflow.planning.stage_plan import host_requirements
from ktflow.recipe import Recipe, with_sft_backend
from ktflow.resources import check_requirement
from ktflow.stages.sft.render import check_kt_model
from ktflow.units import GiB


class SftChoice(BaseModel):
    """What ``sft.backend: auto`` resolved to on a host, and why."""

    recipe: Recipe  # the recipe with the chosen backend and KT settings, validated
    backend: Literal["hf", "kt"]
    reason: str
    hf_step_s: float | None = None  # predicted seconds a step (None: hf cannot run here)
    kt_step_s: float | None = None
    batch_shape: str | None = None  # the KT micro-batch split chosen, or the one that would be (and why)


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
                       model_config: dict[str, Any] | None = None, lengths: RecordLengths | None = None) -> SftChoice:
    """Resolve ``sft.backend: auto`` for ``size`` on ``host``.

    hf when the model, its LoRA state and activations fit the GPUs with a margin, the weights are
    BF16 already, and it is predicted faster (:mod:`ktflow.planning.costs`, tokens from ``lengths``
    where the dataset was read, else ``cutoff_len`` a record); kt otherwise, with the host's KT
    settings (:func:`_kt_side`) and the micro-batch split of
    :func:`~ktflow.planning.batch_shape.shape_kt_batches` where ``sft.kt_shape_batches`` allows. A
    recipe's explicit values always win.

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
    threads = kt_threads(kt_recipe.sft, host.physical_cores)
    shape: ShapeChoice | None = None
    t_kt = None
    if not kt_problems:
        shape = shape_kt_batches(kt_recipe, size, host, lengths)
        kt_recipe = shape.recipe
        tokens = tokens_per_micro_batch(kt_recipe.sft, lengths)
        # at this host's own speed, where it has KT runs (host_speed): as the plan and the shaper predict it
        host_costs, _ = calibrated_costs(kt_recipe, host.hostname, threads, tokens, size.expert_stored_bytes,
                                        machine=host.machine)
        t_kt = kt_step_seconds(size, kt_recipe.sft, threads, host_costs, tokens_per_micro_batch=tokens)
    hf_tokens = None if lengths is None else round(
        tokens_per_micro_batch(hf_recipe.sft, lengths) * hf_recipe.sft.gradient_accumulation_steps)
    t_hf = None if hf_problems else hf_step_seconds(size, hf_recipe.sft, tokens_per_step=hf_tokens)
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
        return SftChoice(recipe=kt_recipe, backend="kt", reason=reason, hf_step_s=t_hf, kt_step_s=t_kt,
                         batch_shape=shape.reason if shape is not None else None)
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


def resolve_auto_backend(recipe: Recipe, model_dir: Path, host: HostInfo,
                         lengths: RecordLengths | None = None) -> SftChoice | None:
    """:func:`choose_sft_backend` for the model in ``model_dir`` (its headers); None unless the recipe says auto."""
    if recipe.sft.backend != "auto":
        return None
    config_path = Path(model_dir) / "config.json"
    model_config = json.loads(config_path.read_text()) if config_path.is_file() else None
    return choose_sft_backend(recipe, model_size(Path(model_dir)), host, model_config, lengths)


def resolve_batch_shape(recipe: Recipe, model_dir: Path, host: HostInfo,
                        lengths: RecordLengths | None = None) -> ShapeChoice | None:
    """:func:`~ktflow.planning.batch_shape.shape_kt_batches` for a ``backend: kt`` recipe that opts in
    (``sft.kt_shape_batches: true``) on the model in ``model_dir``; None for any other recipe."""
    if recipe.sft.backend != "kt" or not recipe.sft.kt_shape_batches:
        return None
    return shape_kt_batches(recipe, model_size(Path(model_dir)), host, lengths)


@dataclass(frozen=True)
class ResolvedSft:
    """A recipe as :func:`~ktflow.stages.sft.run_sft` trains it on a host."""

    recipe: Recipe  # ``auto`` resolved, KT's micro-batch split shaped where the recipe allows
    backend_reason: str | None  # why ``auto`` chose its backend (None: the recipe named it)
    batch_shape: str | None  # the KT split chosen (or that would be), and why


def resolve_sft_recipe(recipe: Recipe, model_dir: Path, host: HostInfo) -> ResolvedSft:
    """``recipe`` as it trains on ``host``: ``sft.backend: auto`` resolved (:func:`choose_sft_backend`)
    and KT's split shaped (:func:`resolve_batch_shape`), from the records' token counts where a choice
    depends on them. The run's identity (:func:`~ktflow.stages.sft.run_key`) is the resolved recipe's.

    Raises:
        HostRequirementError: ``auto`` finds neither backend can run on ``host``.
        CheckpointError: ``model_dir``'s config or headers cannot be read.
    """
    lengths = dataset_lengths(recipe, Path(model_dir))
    choice = resolve_auto_backend(recipe, Path(model_dir), host, lengths)
    if choice is not None:
        return ResolvedSft(recipe=choice.recipe, backend_reason=choice.reason, batch_shape=choice.batch_shape)
    shape = resolve_batch_shape(recipe, Path(model_dir), host, lengths)
    if shape is not None:
        return ResolvedSft(recipe=shape.recipe, backend_reason=None, batch_shape=shape.reason)
    return ResolvedSft(recipe=recipe, backend_reason=None, batch_shape=None)


def dataset_lengths(recipe: Recipe, model_dir: Path) -> RecordLengths | None:
    """The records' token counts, read only where a choice depends on them (backend auto, or KT shaping)."""
    sft = recipe.sft
    if sft.backend == "auto" or (sft.backend == "kt" and sft.kt_shape_batches):
        return record_lengths(recipe, model_dir)
    return None
