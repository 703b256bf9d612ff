"""Work pools: which hardware class runs which stage, and whether this host qualifies.

This is the one place where pool names, the capability each pool demands of a host, and the
stage -> pool routing are written down. Prefect routes runs by work pool only (tags and labels
are metadata), so capability matching is ours: ``ktflow worker`` probes the host and joins
the pools it qualifies for; ``deployments/prefect.yaml`` puts each stage's deployment on the
pool named here (a test keeps the two in agreement); the stage flows re-check the recipe's
own needs (``ktflow.planning.stage_plan.host_requirements``) on the host that picked the run up.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from ktflow.errors import HostRequirementError
from ktflow.host.hardware import CpuVariant, HostInfo, variant_at_least
from ktflow.resources import INT8_KERNELS, STAGE_ORDER, StageName


class WorkPoolSpec(BaseModel):
    """A Prefect process work pool for one class of host."""

    name: str
    role: str = Field(description="what the pool's hosts are for")
    min_cpu_variant: CpuVariant | None = Field(None, description="kt-kernel variant a host needs (None: any)")
    cpu_reason: str = ""
    stages: tuple[str, ...] = Field(description="the stage deployments that run on this pool")
    prepares: tuple[str, ...] = Field(
        (), description="stages it also runs for its own store when hosts keep their own stores (store.artifacts): "
                        "the base weights its other stages read, made on the host itself")
    concurrency_limit: int | None = Field(None, description="runs at a time per worker (None: unlimited)")


CONTROL_POOL = "ktflow-control"
"""The parent pipeline flows: they only dispatch and wait, so any host may run them. Kept apart
from the stage pools so a waiting parent never holds the slot its own child needs."""

WORK_POOLS: tuple[WorkPoolSpec, ...] = (
    WorkPoolSpec(
        name=CONTROL_POOL,
        role="parent pipeline flows (dispatch only)",
        stages=(),
    ),
    WorkPoolSpec(
        name="amx-train",
        role="training host: download, INT4/FP8 -> BF16, LoRA SFT",
        # Named for AMX, but KT 0.7's SFT kernels also exist in kt-kernel's avx512_bf16 build, so such hosts (AMD
        # Zen 4 and newer, Intel Cooper Lake) train too; the sft stage itself still refuses a recipe of the pre-0.7
        # KT API (sft.backend kt-legacy, AMX only) on them (ktflow.planning.stage_plan.host_requirements).
        min_cpu_variant="avx512_bf16",
        cpu_reason="KT 0.7 SFT kernels exist only in kt-kernel's avx512_bf16 and amx builds",
        stages=("download", "dequantize", "sft"),
        # One training job at a time: SFT takes every core and most of the RAM.
        concurrency_limit=1,
    ),
    WorkPoolSpec(
        name="avx512-serve",
        role="serving host: adapter conversion, CPU INT8 quantization, SGLang, evaluation",
        min_cpu_variant=INT8_KERNELS.min_cpu_variant,
        cpu_reason=INT8_KERNELS.cpu_reason,
        stages=("convert-lora", "quantize-int8", "serve", "evaluate"),
        prepares=("download", "dequantize"),
    ),
)


def pool_named(name: str) -> WorkPoolSpec:
    """The pool spec called ``name``, or an error listing the known ones."""
    for pool in WORK_POOLS:
        if pool.name == name:
            return pool
    known = ", ".join(p.name for p in WORK_POOLS)
    raise HostRequirementError(f"work pool '{name}'", "is not one of ktflow's pools", f"use one of: {known}")


def serving_pool() -> WorkPoolSpec:
    """The pool of the serving host: where production's store (and the adapter registry) lives."""
    return pool_for_stage("serve")


def pool_for_stage(stage: StageName) -> WorkPoolSpec:
    """The pool whose workers run ``stage``."""
    for pool in WORK_POOLS:
        if stage in pool.stages:
            return pool
    raise KeyError(stage)  # a stage without a pool is a bug in WORK_POOLS, not a user error


def pool_shortfalls(pool: WorkPoolSpec, host: HostInfo) -> list[str]:
    """Why ``host`` may not join ``pool``, as sentences (empty: it qualifies)."""
    missing = []
    if pool.min_cpu_variant and not variant_at_least(host.cpu_variant, pool.min_cpu_variant):
        missing.append(
            f"pool {pool.name} needs a CPU of kt-kernel variant {pool.min_cpu_variant} or better ({pool.cpu_reason}); "
            f"this CPU is {host.cpu_variant}"
        )
    return missing


def qualifying_pools(host: HostInfo) -> list[WorkPoolSpec]:
    """Every pool ``host`` may join."""
    return [pool for pool in WORK_POOLS if not pool_shortfalls(pool, host)]


def _check_routing() -> None:
    routed = [stage for pool in WORK_POOLS for stage in pool.stages]
    assert sorted(routed) == sorted(STAGE_ORDER), f"every stage on exactly one pool: {routed}"


_check_routing()
