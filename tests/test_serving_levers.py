"""The serving engine's settings chosen by measurement (ktflow.stages.serve.levers, ``ktflow tune-serving``): the
levers tried on a host, the choice of the fastest correct configuration, the record kept per machine and applied
where the recipe leaves a setting unset, and the command against the stand-in sglang server (tests/fake_sglang),
which really starts a server per configuration and times it."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ktflow.host.hardware import GpuInfo, HostInfo, NumaNode
from ktflow.recipe import ServingConfig, load_recipe
from ktflow.stages.serve.levers import (
    BASELINE,
    BASELINE_AGAIN,
    COMBINED,
    GPU_RESERVE_BYTES,
    LeverMeasurement,
    ServedModel,
    ServingLevers,
    apply_measured_levers,
    choose_settings,
    gpu_expert_share,
    keep_levers,
    kept_levers,
    lever_candidates,
    levers_path,
    measure_levers,
)
from ktflow.units import GiB

REPO = Path(__file__).resolve().parent.parent
FAKE = Path(__file__).resolve().parent / "fake_sglang"
KIMI = REPO / "recipes" / "kimi-k2.5-rawint4.yaml"


def _host(*, cores: int = 16, numa: int = 1, variant: str = "avx512_bf16", gpus: int = 1,
          vram_gib: int = 80) -> HostInfo:
    per = cores // numa
    return HostInfo(
        hostname="box", cpu_model="test cpu", cpu_flags=[], cpu_variant=variant, cpu_variant_overridden=False,
        logical_cores=cores, physical_cores=cores, numa_nodes=numa,
        numa=[NumaNode(id=i, cpus=list(range(i * per, (i + 1) * per)), mem_total_bytes=1 << 40,
                       mem_free_bytes=1 << 40) for i in range(numa)],
        ram_bytes=numa << 40, ram_available_bytes=numa << 40,
        gpus=[GpuInfo(index=i, name="NVIDIA H100 80GB HBM3", vram_bytes=vram_gib * GiB) for i in range(gpus)],
        disk_path="/", disk_free_bytes=1 << 42, shm_bytes=GiB, shm_free_bytes=GiB,
    )


def _by_name(candidates) -> dict[str, Any]:
    return {c.name: c for c in candidates}


# --------------------------------------------------------------------------- the candidates


def test_the_whole_models_share_of_the_card_by_hand() -> None:
    """Kimi-K2.5 (the recipe's source.size) on an 80 GiB card, RAWINT4, the recipe's 2048-token context:
    (80 GiB - non-expert weights - KV - 8 GiB) // (60 MoE layers x one INT4 expert as stored)."""
    size = load_recipe(KIMI).source.size
    expert = 570760888320 / (60 * 384)  # 24.8 MB: 7168 x 2048 x 3 INT4 values with a BF16 scale per 32
    left = 80 * GiB - (594205305856 - 570760888320) - 70272 * 2048 - 8 * GiB
    assert int(left // (60 * int(expert))) == 36
    share = gpu_expert_share(size, 80 * GiB, method="RAWINT4", context_tokens=2048)
    assert share.experts_per_layer == 36 and share.reserve_bytes == GPU_RESERVE_BYTES
    assert "36 of 384 experts a layer" in share.describe()
    # two ranks: each card holds half the non-expert weights and half of each expert (the MLA cache whole)
    assert gpu_expert_share(size, 80 * GiB, method="RAWINT4", gpus=2, context_tokens=2048).experts_per_layer > 2 * 36
    assert gpu_expert_share(size, 24 * GiB, method="RAWINT4").experts_per_layer == 0  # no room beside the rest


def test_levers_on_a_one_node_host_without_amx() -> None:
    recipe = load_recipe(KIMI, ["serving.mode=merged", "serving.disable_cuda_graph=true"])
    found = _by_name(lever_candidates(recipe, _host(cores=16)))
    assert list(found)[0] == BASELINE and found[BASELINE].updates == {"mode": "merged"}
    assert found["cuda-graphs-on"].updates["disable_cuda_graph"] is False  # the recipe has them off here
    shipped = _by_name(lever_candidates(load_recipe(KIMI), _host(cores=16)))  # merged, graphs on as shipped
    assert shipped["cuda-graphs-off"].updates["disable_cuda_graph"] is True
    assert found["deferral-1"].status == found["deferral-2"].status == "run"
    gpu = found["gpu-experts-36"]
    assert gpu.status == "run" and gpu.updates["kt_num_gpu_experts"] == 36 and "36 of 384" in gpu.why
    assert found["gpu-experts-36-dynamic"].updates["kt_enable_dynamic_expert_update"] is True
    assert found["chunked-prefill-4096"].updates["chunked_prefill_size"] == 4096
    # the recipe's threads unset: cores less 2 is what it serves with; every core and half of them are the levers
    assert found["cpuinfer-16"].updates["kt_cpuinfer"] == 16 and found["cpuinfer-16"].status == "run"
    assert found["cpuinfer-14"].status == "skipped" and "recipe's own thread count (14)" in found["cpuinfer-14"].reason
    assert found["cpuinfer-8"].status == "run"
    assert found["threadpools-2"].status == "skipped" and "recipe's own" in found["threadpools-2"].reason
    for method in ("AMXINT4", "AMXINT8"):
        assert found[method].status == "skipped" and "no AMX" in found[method].reason
    one_pool = _by_name(lever_candidates(load_recipe(KIMI, ["serving.mode=merged", "serving.kt_threadpool_count=1"]),
                                         _host()))
    assert one_pool["threadpools-2"].status == "skipped" and "1 NUMA node" in one_pool["threadpools-2"].reason


def test_levers_on_a_two_node_amx_host_and_a_refused_one() -> None:
    recipe = load_recipe(KIMI, ["serving.mode=merged", "serving.kt_threadpool_count=1"])
    found = _by_name(lever_candidates(recipe, _host(cores=64, numa=2, variant="amx")))
    assert found["threadpools-2"].status == "run"
    assert found["AMXINT8"].status == "run" and found["AMXINT8"].updates["kt_method"] == "AMXINT8"
    # the recipe judges candidates through the LoRA path, which cannot read AMXINT4 experts: refused, its words
    assert found["AMXINT4"].status == "refused" and "evaluation.candidate: offline" in found["AMXINT4"].reason
    assert found["cpuinfer-64"].status == "run" and found["cpuinfer-32"].status == "run"
    assert found["cpuinfer-62"].status == "skipped"  # the default: 64 cores less 2
    # an AMX format holds no GPU experts; KT's LoRA path none either; no GPU, none
    amx = _by_name(lever_candidates(load_recipe(KIMI, ["serving.mode=merged", "serving.kt_method=AMXINT8",
                                                       "serving.kt_threadpool_count=1", "evaluation.enabled=false"]),
                                    _host(variant="amx")))
    assert amx["gpu-experts"].status == "skipped" and "CPU layout only" in amx["gpu-experts"].reason
    assert amx["AMXINT8"].status == "skipped" and amx["AMXINT4"].status == "run"
    lora = _by_name(lever_candidates(load_recipe(KIMI, ["serving.mode=lora"]), _host(variant="amx")))
    assert "LoRA path" in lora["gpu-experts"].reason and lora["AMXINT8"].status == "skipped"
    assert lora["deferral-1"].status == "refused" and "without deferral" in lora["deferral-1"].reason
    assert "no GPU" in _by_name(lever_candidates(recipe, _host(gpus=0)))["gpu-experts"].reason


# --------------------------------------------------------------------------- the choice


def _measured(rates: dict[str, float], losses: dict[str, float] | None = None):
    """A measurement whose decode is 10 tokens/s times each changed field's factor, and whose loss is 0.5 plus the
    fields' shifts."""
    def measure(serving: ServingConfig) -> LeverMeasurement:
        rate, loss = 10.0, 0.5
        for field, factor in rates.items():
            name, value = field.split("=")
            if str(getattr(serving, name)) == value:
                rate *= factor
                loss += (losses or {}).get(field, 0.0)
        return LeverMeasurement(ok=True, decode_tokens_per_s=rate, ttft_p50_s=0.1, served_loss=loss, loss_records=2,
                                requests=3)
    return measure


def _run(recipe, measure, host=None) -> ServingLevers:
    model = ServedModel(path="/models/kimi", kt_method="RAWINT4", mode="merged")
    return measure_levers(recipe, lever_candidates(recipe, host or _host()), measure, machine="test machine",
                          model=model)


def test_the_fastest_correct_and_the_combination() -> None:
    recipe = load_recipe(KIMI, ["serving.mode=merged", "serving.kt_threadpool_count=1"])
    rates = {"kt_max_deferred_experts_per_token=1": 1.2, "kt_max_deferred_experts_per_token=2": 2.0,
             "chunked_prefill_size=4096": 1.05, "kt_cpuinfer=8": 0.9}
    record = _run(recipe, _measured(rates, {"kt_max_deferred_experts_per_token=2": 0.01}))
    deferral2 = record.run("deferral-2")
    assert deferral2.correct is False and "wrong" in deferral2.verdict  # 2x as fast, 0.01 of loss: excluded
    assert record.run("deferral-1").correct and record.run("deferral-1").vs_baseline == 1.2
    combined = record.run(COMBINED)
    assert combined is not None and combined.candidate.updates == {
        "mode": "merged", "kt_max_deferred_experts_per_token": 1, "chunked_prefill_size": 4096}
    assert record.choice.name == COMBINED and record.choice.decode_tokens_per_s == pytest.approx(12.6)
    assert "mode" not in record.choice.updates and "1.26x" in record.choice.reason
    # a combination slower than its best lever is measured, not chosen
    slower = _measured(rates, {"kt_max_deferred_experts_per_token=2": 0.01})

    def measure(serving: ServingConfig) -> LeverMeasurement:
        m = slower(serving)
        both = serving.kt_max_deferred_experts_per_token == 1 and serving.chunked_prefill_size == 4096
        return m.model_copy(update={"decode_tokens_per_s": 9.0}) if both else m
    record = _run(recipe, measure)
    assert record.run(COMBINED).measurement.decode_tokens_per_s == 9.0 and record.choice.name == "deferral-1"


def test_a_lever_must_beat_both_starts_of_the_baseline() -> None:
    """The baseline is started again last; a lever wins only by beating the faster of its two measurements by 3 %:
    the spread between two starts of one configuration is not a gain (measured: 9 % on an H200 host)."""
    recipe = load_recipe(KIMI, ["serving.mode=merged", "serving.kt_threadpool_count=1"])
    starts = iter([10.0, 10.8])  # the baseline, then the baseline again

    def measure(serving: ServingConfig) -> LeverMeasurement:
        if serving == recipe.serving:
            rate = next(starts)
        else:
            rate = 11.0 if serving.chunked_prefill_size == 4096 else 9.0
        return LeverMeasurement(ok=True, decode_tokens_per_s=rate, ttft_p50_s=0.1, requests=3)

    record = _run(recipe, measure)
    assert [r.candidate.name for r in record.runs][-1] == BASELINE_AGAIN and record.run(COMBINED) is None
    assert record.run(BASELINE_AGAIN).vs_baseline == 1.08 and record.run("chunked-prefill-4096").vs_baseline == 1.1
    # 1.10x the first start, 1.02x the second: within the spread, so the recipe's own settings stay
    assert record.choice.name == BASELINE and record.choice.updates == {}
    assert "no setting beat them by 3% or more" in record.choice.reason and "10.0 and 10.8" in record.choice.reason
    starts = iter([10.0, 10.2])
    record = _run(recipe, measure)
    assert record.choice.name == "chunked-prefill-4096" and "1.08x its second start's 10.2" in record.choice.reason
    # no second start (the baseline alone as reference): the first start's 3 %
    runs = [r for r in record.runs if r.candidate.name != BASELINE_AGAIN]
    assert choose_settings(runs).name == "chunked-prefill-4096"


def test_another_method_may_cost_a_little_quality_and_says_so() -> None:
    recipe = load_recipe(KIMI, ["serving.mode=merged", "serving.kt_threadpool_count=1", "evaluation.enabled=false"])
    amx = _host(variant="amx")
    record = _run(recipe, _measured({"kt_method=AMXINT4": 1.5, "kt_method=AMXINT8": 1.3},
                                    {"kt_method=AMXINT4": 0.008, "kt_method=AMXINT8": 0.004}), amx)
    assert record.run("AMXINT4").correct is False  # +1.6 %: past the 1 % a re-quantization may cost
    assert record.run("AMXINT8").correct and "+0.8%" in record.run("AMXINT8").verdict
    assert record.choice.name == "AMXINT8" and "re-quantized experts allow 0.0050" in record.choice.reason
    # the same weights allow 0.002 only: a lever that moves the loss by 0.004 is wrong
    record = _run(recipe, _measured({"chunked_prefill_size=4096": 1.5}, {"chunked_prefill_size=4096": 0.004}), amx)
    assert record.run("chunked-prefill-4096").correct is False and record.choice.name == BASELINE


def test_a_baseline_that_does_not_serve_chooses_nothing() -> None:
    recipe = load_recipe(KIMI, ["serving.mode=merged"])
    record = _run(recipe, lambda serving: LeverMeasurement(ok=False, error="ServerStartError: out of memory"))
    assert record.choice is None and record.run(BASELINE).verdict.startswith("did not serve: ServerStartError")
    assert all(r.measurement is None for r in record.runs[1:])


# --------------------------------------------------------------------------- kept per machine, applied


def _record(updates: dict[str, Any], *, path: str = "/models/kimi", digest: str | None = None) -> ServingLevers:
    recipe = load_recipe(KIMI, ["serving.mode=merged"])
    model = ServedModel(path=path, digest=digest, kt_method="RAWINT4", mode="merged")
    field, value = next(iter(updates.items()))
    rates = {f"{k}={v}": 1.1 for k, v in updates.items()}
    record = measure_levers(recipe, lever_candidates(recipe, _host()), _measured(rates), machine="m1", model=model)
    assert record.choice is not None and record.choice.updates.get(field) == value
    return record


def test_the_record_is_kept_per_machine_and_model(tmp_path: Path) -> None:
    record = _record({"kt_max_deferred_experts_per_token": 1}, digest="abc")
    path = keep_levers(tmp_path, record)
    assert path == levers_path(tmp_path, "m1", record.model)
    assert re.fullmatch(r"serving-levers/[0-9a-f]{16}/kimi-rawint4-merged-[0-9a-f]{12}\.json",
                        path.relative_to(tmp_path).as_posix())
    assert kept_levers(tmp_path, "m1", record.model) == record
    assert kept_levers(tmp_path, "m2", record.model) is None  # another machine
    assert kept_levers(tmp_path, "m1", record.model.model_copy(update={"mode": "lora"})) is None
    assert kept_levers(tmp_path, "m1", record.model.model_copy(update={"digest": "other"})) is None  # weights replaced
    path.write_text("{")
    assert kept_levers(tmp_path, "m1", record.model) is None


def test_measured_settings_apply_where_the_recipe_sets_nothing() -> None:
    record = _record({"kt_max_deferred_experts_per_token": 1, "chunked_prefill_size": 4096})
    serving = load_recipe(KIMI, ["serving.mode=merged"]).serving  # sets chunked_prefill_size: 256 itself
    applied, line = apply_measured_levers(serving, record)
    assert applied.kt_max_deferred_experts_per_token == 1 and applied.chunked_prefill_size == 256
    assert line.startswith(f"serving settings measured on this machine on {record.measured_at[:10]}: combined")
    assert "applied: kt_max_deferred_experts_per_token 1" in line
    assert "recipe sets chunked_prefill_size 256 (measured best: chunked_prefill_size 4096), kept" in line
    baseline = record.model_copy(update={"choice": record.choice.model_copy(update={"updates": {}})})
    same, said = apply_measured_levers(serving, baseline)
    assert same is serving and "the recipe's own settings kept, no setting beat them by 3% or more" in said


# --------------------------------------------------------------------------- the command, for real


def test_tune_serving_starts_a_server_per_configuration_and_serve_and_plan_use_the_choice(
        fixture_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`ktflow tune-serving` merges the adapter once, starts the stand-in server with each configuration, times it
    and reads its served loss; the fake's deferral 2 is fastest but wrong, and deferral 1 with prefill chunks of
    4096 together fastest and correct. `ktflow serve --dry-run` then starts with those, and `ktflow plan` says so."""
    from test_merge import make_converted_adapter

    import ktflow.host.hardware
    from ktflow.cli import main
    from ktflow.plan import plan_recipe
    from ktflow.planning.sizing import model_size

    monkeypatch.setenv("KTFLOW_API_KEY", "levers-test-key-" + "x" * 16)
    model = fixture_dir("bf16")
    here = ktflow.host.hardware.probe_host()
    host = here.model_copy(update={"gpus": [GpuInfo(index=0, name="test GPU", vram_bytes=1 << 37)],
                                   "physical_cores": 4, "numa_nodes": 1})
    monkeypatch.setattr(ktflow.host.hardware, "probe_host", lambda *a, **k: host)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                     {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
                            for i in range(3)))
    size = model_size(model)
    document = yaml.safe_load((REPO / "recipes" / "qwen3-30b-a3b-bf16.yaml").read_text())
    document["source"] = {"local_path": str(model), "format": "bf16", "size": {
        k: getattr(size, k) for k in ("parameters", "expert_parameters", "stored_bytes", "expert_stored_bytes",
                                      "num_layers", "moe_layers", "hidden_size", "vocab_size", "routed_experts",
                                      "experts_per_token")}}
    document["dataset"]["files"] = [str(data)]
    document["sft"]["template"] = "empty"
    document["serving"].update(mode="merged", kt_cpuinfer=2, ready_timeout_s=60, port=30000)
    document["evaluation"] = {"enabled": False}
    document["store"] = {"root": str(tmp_path / "store")}
    document["toolchains"] = {"serve": {"python": sys.executable, "env": {"PYTHONPATH": str(FAKE)}},
                              "train": {"python": sys.executable}}
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(document))
    adapter = make_converted_adapter(model, tmp_path / "adapter", seed=1)

    assert main(["tune-serving", str(recipe_file), "--adapter", str(adapter), "--requests", "2", "--max-tokens",
                 "24", "--loss-records", "2", "--json"]) == 0
    record = ServingLevers.model_validate(json.loads(capsys.readouterr().out))
    runs = {r.candidate.name: r for r in record.runs}
    assert record.machine == host.machine and record.gpu == "test GPU" and record.model.path == str(model)
    assert runs[BASELINE].measurement.served_loss == pytest.approx(0.05)
    assert runs[BASELINE].measurement.loss_records == 2 and runs[BASELINE].measurement.ttft_p50_s is not None
    assert runs["deferral-2"].correct is False and runs["deferral-2"].measurement.served_loss == pytest.approx(0.06)
    assert runs["deferral-1"].vs_baseline > 1.3
    assert runs["cpuinfer-2"].candidate.status == "skipped"  # 4 cores: 4 - 2 = 4 / 2 = the recipe's own 2
    assert runs["cpuinfer-4"].vs_baseline < 0.8 and "kt_cpuinfer" not in record.choice.updates  # every core: slower
    assert record.choice.name == COMBINED
    assert {"kt_max_deferred_experts_per_token": 1, "chunked_prefill_size": 4096}.items() <= \
        record.choice.updates.items()
    merges = list((tmp_path / "store" / "merged").iterdir())
    assert len(merges) == 1  # merged once, every server started on it
    assert not list((tmp_path / "store").rglob("tune-serving/endpoint.json"))  # every server stopped

    other = tmp_path / "other-store"  # the table, kept in another store (the first record stays as it is)
    assert main(["tune-serving", str(recipe_file), "--adapter", str(adapter), "--requests", "1", "--max-tokens",
                 "8", "--loss-records", "0", "--store", str(other)]) == 0
    text = capsys.readouterr().out
    assert "serving levers on" in text and "deferral-2" in text and f"kept in {other}" in " ".join(text.split())

    assert main(["serve", str(recipe_file), "--dry-run", "--json"]) == 0
    launch = json.loads(capsys.readouterr().out)
    argv = launch["argv"]
    assert launch["serving_settings"].startswith("serving settings measured on this machine")
    assert argv[argv.index("--kt-max-deferred-experts-per-token") + 1] == "1"
    assert argv[argv.index("--chunked-prefill-size") + 1] == "4096"

    plan = plan_recipe(load_recipe(recipe_file), host)
    serve = next(s for s in plan.stages if s.stage == "serve")
    assert serve.serving_settings_basis.startswith("serving settings measured on this machine")
    assert "measured on this machine" in serve.summary and serve.measured_decode_tokens_per_s is not None
    assert any(m.startswith("merged: ") and "measured on this machine" in m for m in serve.decode_by_mode)
