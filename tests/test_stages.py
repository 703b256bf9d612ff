"""Stage planning and host checks (what `ktflow doctor --recipe` reports)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ktflow.host.hardware import GpuInfo, HostInfo, NumaNode
from ktflow.plan import check_recipe_on_host
from ktflow.planning.stage_plan import STAGE_ORDER, plan_stages
from ktflow.recipe import load_recipe

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def host(variant: str = "amx", gpus: int = 8, cores: int = 64, native: str | None = None) -> HostInfo:
    return HostInfo(
        hostname="h", cpu_model="test", cpu_flags=[], cpu_variant=variant, cpu_variant_overridden=native is not None,
        native_cpu_variant=native,
        logical_cores=cores * 2, physical_cores=cores, numa_nodes=1,
        numa=[NumaNode(id=0, cpus=list(range(cores)), mem_total_bytes=1 << 40, mem_free_bytes=1 << 40)],
        ram_bytes=1 << 40, ram_available_bytes=1 << 40,
        gpus=[GpuInfo(index=i, name="H200", vram_bytes=141 << 30) for i in range(gpus)],
        disk_path="/", disk_free_bytes=1 << 42, shm_bytes=1 << 38, shm_free_bytes=1 << 38,
    )


def planned(name: str, *overrides: str) -> dict[str, bool]:
    return {p.stage: p.needed for p in plan_stages(load_recipe(RECIPES / name, overrides))}


def test_plans_cover_every_stage_in_order() -> None:
    plans = plan_stages(load_recipe(RECIPES / "tiny-demo.yaml"))
    assert tuple(p.stage for p in plans) == STAGE_ORDER
    assert all(p.reason for p in plans)


def test_rawint4_recipe_skips_dequantize_and_int8() -> None:
    assert planned("kimi-k2.5-rawint4.yaml") == {
        "download": True, "dequantize": False, "sft": True, "convert-lora": True,
        "quantize-int8": False, "serve": True, "evaluate": True,
    }


def test_bf16_int8_recipe_dequantizes_and_quantizes() -> None:
    plan = planned("kimi-k2.5-bf16-int8.yaml")
    assert plan["dequantize"] and plan["quantize-int8"]


def test_bf16_source_never_dequantizes() -> None:
    assert planned("qwen3-30b-a3b-bf16.yaml")["dequantize"] is False


def test_local_source_skips_download_and_disabled_eval_skips_evaluate() -> None:
    plan = planned("tiny-demo.yaml", "evaluation.enabled=false")
    assert plan["download"] is False and plan["evaluate"] is False


def test_avx2_host_cannot_run_kt_sft() -> None:
    checks = {c.stage: c for c in check_recipe_on_host(load_recipe(RECIPES / "kimi-k2.5-bf16-int8.yaml"), host("avx2"))}
    assert not checks["sft"].runnable
    assert "sft needs a avx512_bf16 CPU or better" in checks["sft"].missing[0]
    assert "this CPU is test, kt-kernel variant avx2" in checks["sft"].missing[0]
    # This recipe serves AMXINT8: the INT8 weights are read by its own serve stage, so the stage
    # is not skipped on a host without the kernels; it is a host this recipe cannot run on.
    assert checks["quantize-int8"].needed and not checks["quantize-int8"].runnable
    assert "quantize-int8 needs a avx512_base CPU or better" in checks["quantize-int8"].missing[0]
    assert checks["download"].runnable


def test_legacy_kt_needs_amx() -> None:
    recipe = load_recipe(RECIPES / "deepseek-v2-lite-bf16.yaml")
    checks = {c.stage: c for c in check_recipe_on_host(recipe, host("avx512_bf16"))}
    assert "KT before 0.7 trains with AMX kernels only" in checks["sft"].missing[0]
    assert all(c.runnable for c in check_recipe_on_host(recipe, host("amx")))


def test_gpu_count_and_threads_are_checked() -> None:
    recipe = load_recipe(RECIPES / "kimi-k2.5-rawint4.yaml",
                         ["sft.kt_config.kt_num_threads=96", "sft.gpus=8", "serving.gpus=4"])
    checks = {c.stage: c for c in check_recipe_on_host(recipe, host(gpus=4, cores=64))}
    assert "sft needs 8 GPU(s); this host has 4" in checks["sft"].missing
    assert any("sft.kt_config.kt_num_threads is 96 but this host has 64 physical cores" in m for m in checks["sft"].missing)
    assert checks["serve"].runnable  # 4 GPUs is what serving asks for


@pytest.mark.parametrize("name", ["kimi-k2.5-rawint4.yaml", "kimi-k2.5-bf16-int8.yaml", "deepseek-v3-fp8.yaml"])
def test_reference_host_runs_the_big_recipes(name: str) -> None:
    assert all(c.runnable for c in check_recipe_on_host(load_recipe(RECIPES / name), host()))


def test_skipped_stages_are_not_checked() -> None:
    recipe = load_recipe(RECIPES / "kimi-k2.5-rawint4.yaml")
    checks = {c.stage: c for c in check_recipe_on_host(recipe, host("none", gpus=0))}
    assert checks["dequantize"].needed is False and checks["dequantize"].missing == []


def test_demo_int8_stage_is_skipped_with_the_reason_on_a_host_without_the_kernels() -> None:
    # The demo serves BF16 on CPU and makes INT8 weights only for a later SGLang host
    # (conversion.int8: always): an AVX2 host leaves them to an AVX512/AMX one.
    recipe = load_recipe(RECIPES / "tiny-demo.yaml")
    checks = {c.stage: c for c in check_recipe_on_host(recipe, host("avx2", gpus=0))}
    int8 = checks["quantize-int8"]
    assert int8.needed is False and int8.runnable and int8.missing == []
    for says in ("skipped on this host", "needs a avx512_base CPU or better", "AVX512F + AVX512BW",
                 "this CPU is test, kt-kernel variant avx2", "pool avx512-serve", "ktflow worker --pool avx512-serve"):
        assert says in int8.reason, (says, int8.reason)
    assert all(c.runnable for c in checks.values())  # so `ktflow doctor --recipe` exits 0 there
    # Without a host (the plan of a distributed run) and on an AVX512 host, it runs.
    assert planned("tiny-demo.yaml")["quantize-int8"] is True
    assert {p.stage: p.needed for p in plan_stages(recipe, host("avx512_base", gpus=0))}["quantize-int8"] is True
    # Never skipped when nothing else would make the weights: conversion.int8 auto + AMXINT8 serving.
    kimi = load_recipe(RECIPES / "kimi-k2.5-bf16-int8.yaml")
    assert {p.stage: p.needed for p in plan_stages(kimi, host("avx2"))}["quantize-int8"] is True


@pytest.mark.parametrize(("advertised", "native", "runs"), [
    ("amx", "avx2", "avx2"),                # a fake advertisement: kt-kernel would die on AMX code
    ("avx2", "avx512_bf16", "avx2"),        # forced down: kt-kernel loads its avx2 build
    ("avx512_bf16", "avx512_bf16", "avx512_bf16"),
])
def test_the_kernels_that_run_are_the_lower_of_advertised_and_native(advertised: str, native: str, runs: str) -> None:
    probed = host(advertised, native=native)
    assert probed.runnable_variant == runs
    checks = {c.stage: c for c in check_recipe_on_host(load_recipe(RECIPES / "tiny-demo.yaml"), probed)}
    assert checks["quantize-int8"].needed is (runs != "avx2")
    if advertised != native:
        assert f"KT_KERNEL_CPU_VARIANT={advertised}" in probed.describe_cpu()
