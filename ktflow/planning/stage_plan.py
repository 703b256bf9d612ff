"""The pipeline's stages, which of them a recipe needs, and what each needs of a host.

This is the one place where what a recipe asks of each stage's host is written down (the stage
names, their order and the host-requirement type are :mod:`ktflow.resources`'s). ``ktflow doctor``
reads it to say whether this host can run a recipe (:func:`ktflow.plan.check_recipe_on_host`, above
the stages, adds the SFT stage's own sizing); the stage flows re-check it on the host that picked a run
up.
"""

from __future__ import annotations

from pydantic import BaseModel

from ktflow.host.hardware import HostInfo
from ktflow.host.pools import pool_for_stage
from ktflow.recipe import (
    Recipe,
    as_weights_reader,
    int8_threadpool_count,
    needs_bf16_weights,
    needs_int8_weights,
)
from ktflow.recipe.model import INT4_FORMATS
from ktflow.resources import INT8_KERNELS, STAGE_ORDER, HostRequirement, StageName, check_requirement

__all__ = [
    "INT8_KERNELS", "STAGE_ORDER", "HostRequirement", "StageCheck", "StageName", "StagePlan", "StageSkipped",
    "check_requirement", "deferral_reason", "host_requirements", "plan_stages",
    "prepared_for_another_host",
]

class StagePlan(BaseModel):
    """Whether a stage runs for a recipe, and why (or why not)."""

    stage: StageName
    needed: bool
    reason: str


class StageSkipped(BaseModel):
    """What a stage returns when the host that picked it up leaves it to another (and why)."""

    stage: StageName
    reason: str


class StageCheck(BaseModel):
    """A stage's plan and whether this host can run it."""

    stage: StageName
    needed: bool
    reason: str
    runnable: bool
    missing: list[str]


def plan_stages(recipe: Recipe, host: HostInfo | None = None) -> list[StagePlan]:
    """Derive the stages a recipe runs, in order, each with the reason it runs or is skipped.

    With ``host`` (a run where every stage runs on that host), a stage that only prepares an
    artifact for another host (:func:`prepared_for_another_host`) and whose kernels this host
    lacks is skipped, with what it needs, what this CPU has and where it runs instead.
    """
    plans = _plan(recipe)
    if host is not None:
        for plan in plans:
            if plan.needed and plan.stage in prepared_for_another_host(recipe):
                missing = check_requirement(host_requirements(recipe)[plan.stage], host)
                if missing:
                    plan.needed, plan.reason = False, deferral_reason(plan.stage, missing)
    return plans


def prepared_for_another_host(recipe: Recipe) -> set[StageName]:
    """Stages whose output no later stage of this recipe's run reads.

    Only INT8 weights made for a later SGLang host (``conversion.int8: always`` while this
    recipe serves another way) qualify: a host without the kernels can leave them to one with.
    """
    if recipe.conversion.int8 == "always" and recipe.serving.kt_method != "AMXINT8":
        return {"quantize-int8"}
    return set()


def deferral_reason(stage: StageName, missing: list[str]) -> str:
    """Why ``stage`` is skipped on this host, and where it runs instead."""
    pool = pool_for_stage(stage).name
    return (f"skipped on this host: {'; '.join(missing)}. No later stage of this run reads its output; it runs on "
            f"a host of pool {pool} (start one there with `ktflow worker --pool {pool}`), or run `ktflow {stage}` "
            "on such a host")


def _plan(recipe: Recipe) -> list[StagePlan]:
    source = recipe.source
    fmt = source.format
    plans: list[StagePlan] = []

    if source.local_path is not None:
        plans.append(StagePlan(stage="download", needed=False, reason=f"local source {source.local_path}"))
    else:
        where = source.repo_id or source.uri
        plans.append(StagePlan(stage="download", needed=True, reason=f"fetch {where}@{source.revision}"))

    if not needs_bf16_weights(recipe):
        plans.append(StagePlan(stage="dequantize", needed=False, reason=f"no stage reads BF16; {fmt} is used natively"))
    elif fmt == "bf16":
        plans.append(StagePlan(stage="dequantize", needed=False, reason="the source is already BF16"))
    else:
        plans.append(StagePlan(stage="dequantize", needed=True, reason=f"{fmt} -> BF16 for {_bf16_readers(recipe)}"))

    plans.append(StagePlan(stage="sft", needed=True, reason=f"LoRA SFT with the '{recipe.sft.backend}' backend"))
    plans.append(StagePlan(stage="convert-lora", needed=True,
                           reason="validate the adapter against the base (convert KT fused expert LoRA)"))

    if needs_int8_weights(recipe):
        t = int8_threadpool_count(recipe)
        why = "serving.kt_method AMXINT8" if recipe.serving.kt_method == "AMXINT8" else "conversion.int8: always"
        plans.append(StagePlan(stage="quantize-int8", needed=True, reason=f"{why} (T={t})"))
    else:
        plans.append(StagePlan(stage="quantize-int8", needed=False,
                               reason=f"serving uses {recipe.serving.kt_method or 'BF16 on CPU'}"))

    plans.append(StagePlan(stage="serve", needed=True, reason=f"'{recipe.serving.backend}' on "
                            + (f"{recipe.serving.host}:{recipe.serving.port}" if recipe.serving.port != "auto"
                               else f"{recipe.serving.host}, a free port")))
    if recipe.evaluation.enabled:
        plans.append(StagePlan(stage="evaluate", needed=True, reason=f"{recipe.evaluation.task} eval, base vs tuned"))
    else:
        plans.append(StagePlan(stage="evaluate", needed=False, reason="evaluation.enabled is false"))
    return plans


def _bf16_readers(recipe: Recipe) -> str:
    recipe = as_weights_reader(recipe)
    readers = []
    sft = recipe.sft
    if sft.backend != "kt" or (sft.kt_config and sft.kt_config.effective_weight_format == "bf16"):
        readers.append("sft")
    if recipe.serving.backend == "llamafactory" or recipe.serving.kt_method in ("BF16", "AMXBF16"):
        readers.append("serve")
    if needs_int8_weights(recipe) and recipe.source.format not in INT4_FORMATS:  # Kimi INT4 is quantized as it is
        readers.append("quantize-int8")
    return ", ".join(readers)


def host_requirements(recipe: Recipe) -> dict[StageName, HostRequirement]:
    """What each stage of the recipe needs of its host (capabilities, not sizes)."""
    sft = recipe.sft
    serving = recipe.serving
    reqs: dict[StageName, HostRequirement] = {name: HostRequirement(stage=name) for name in STAGE_ORDER}

    if sft.backend == "kt":
        # kt-kernel 0.7 builds its SFT kernels only for these two variants.
        reqs["sft"] = HostRequirement(
            stage="sft", min_cpu_variant="avx512_bf16", min_gpus=sft.gpus,
            cpu_reason="KT 0.7 SFT kernels exist only in kt-kernel's avx512_bf16 and amx builds",
            max_threads=sft.kt_config.kt_num_threads if sft.kt_config else None,
            threads_field="sft.kt_config.kt_num_threads",
        )
    elif sft.backend == "kt-legacy":
        reqs["sft"] = HostRequirement(stage="sft", min_cpu_variant="amx", min_gpus=sft.gpus,
                                      cpu_reason="KT before 0.7 trains with AMX kernels only",
                                      max_threads=sft.cpu_infer, threads_field="sft.cpu_infer")
    else:  # hf, and auto (which picks kt only where kt's CPU requirement holds)
        reqs["sft"] = HostRequirement(stage="sft", min_gpus=sft.gpus)

    if needs_int8_weights(recipe):
        reqs["quantize-int8"] = INT8_KERNELS
    if serving.backend == "sglang":
        cpu, reason = None, ""
        if serving.kt_method == "AMXINT8":
            cpu, reason = INT8_KERNELS.min_cpu_variant, INT8_KERNELS.cpu_reason
        elif serving.kt_method == "FP8":
            cpu, reason = "avx512_bf16", "native FP8 experts need AVX512F+BF16+VNNI+VBMI"
        reqs["serve"] = HostRequirement(
            stage="serve",
            min_cpu_variant=cpu,
            cpu_reason=reason,
            min_gpus=serving.gpus,
            max_threads=serving.kt_cpuinfer,
            threads_field="serving.kt_cpuinfer",
        )
    return reqs
