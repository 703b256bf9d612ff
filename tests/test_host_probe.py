"""The host probe (ktflow.planning.host_probe): kt-kernel's own SFT expert kernels timed on this machine, kept per
machine in the store, and what the plan and the doctor say of it. Timings are checked for presence and sanity only."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from ktflow.host.hardware import probe_host
from ktflow.planning import host_probe
from ktflow.planning.costs import COSTS
from ktflow.planning.host_probe import (
    KtProbe,
    KtProbeSettings,
    cache_path,
    cached_probe,
    keep_probe,
    probe_settings,
    run_probe,
)
from ktflow.planning.host_speed import kt_threads
from ktflow.recipe import Recipe, load_recipe

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kt_step_model  # noqa: E402
from test_costs import _h100, _plan_sft  # noqa: E402

BIG = REPO / "gpu_host/big-kt-rawint4.yaml"
SERVE_PYTHON = REPO / ".venv-serve/bin/python"
NO_KT_PYTHON = Path(sys.executable)  # the orchestrator's: no kt-kernel


def _recipe(store: Path, python: Path = SERVE_PYTHON, *sets: str) -> Recipe:
    return load_recipe(BIG, [f"store.root={store}", "sft.kt_config.kt_model_max_length=4096",
                             "sft.kt_config.kt_num_threads=16", f"toolchains.train.python={python}",
                             f"toolchains.serve.python={python}", *sets])


def _size():
    return kt_step_model.model_sizes()[1]  # the Kimi-geometry model of the kt-throughput runs


def _kt_kernel_runs_here() -> bool:
    return SERVE_PYTHON.is_file() and probe_host().runnable_variant in host_probe.SFT_VARIANTS


def _measured(settings: KtProbeSettings, machine: str, forward_s: float = 0.2, backward_s: float = 0.5) -> KtProbe:
    return KtProbe(machine=machine, settings=settings, status="measured", kt_kernel="0.7.2", cpu_variant="amx",
                   forward_s=forward_s, backward_s=backward_s, pairs=5, weight_bytes=512 << 20,
                   measured_at="2026-01-01T00:00:00+00:00")


# --------------------------------------------------------------------------- the driver, for real


@pytest.mark.skipif(not _kt_kernel_runs_here(), reason="kt-kernel's SFT kernels do not run on this machine")
@pytest.mark.parametrize("method", ["AMXBF16_SFT", "RAWINT4_SFT"])
def test_the_probe_times_kt_kernels_sft_forward_and_backward_here(method: str) -> None:
    settings = KtProbeSettings(method=method, hidden=1024, moe_intermediate=512, experts=16, top_k=4, tokens=64,
                               threads=2, pools=1, lora_rank=8, lora_alpha=16.0, share_backward_bb=False)
    probe = run_probe(settings, "this machine", SERVE_PYTHON, toolchain="toolchains.serve.python", time_limit_s=5)
    assert probe.status == "measured" and probe.kt_kernel and probe.cpu_variant in host_probe.SFT_VARIANTS
    for seconds in (probe.forward_s, probe.backward_s):
        assert seconds is not None and seconds > 0 and math.isfinite(seconds)
    assert probe.pairs >= 1 and probe.weight_bytes > 0
    assert probe.wall_s < 5 + 60  # the limit holds after one warm-up and one measured pair
    assert "forward" in probe.figures() and "backward" in probe.figures()


@pytest.mark.skipif(not _kt_kernel_runs_here(), reason="kt-kernel's SFT kernels do not run on this machine")
def test_a_method_the_probe_cannot_make_weights_for_is_skipped_with_the_reason() -> None:
    settings = KtProbeSettings(method="INT8_SFT", hidden=1024, moe_intermediate=512, experts=16, top_k=4, tokens=64,
                               threads=2, pools=1, lora_rank=8, lora_alpha=16.0, share_backward_bb=True)
    probe = run_probe(settings, "this machine", SERVE_PYTHON, time_limit_s=5)
    assert probe.status == "skipped" and "pre-quantized" in probe.reason and probe.forward_s is None


# --------------------------------------------------------------------------- the settings


def test_the_probe_has_the_recipes_method_shape_and_threads_and_weights_past_the_caches(tmp_path: Path) -> None:
    recipe, size = _recipe(tmp_path), _size()
    settings = probe_settings(recipe.sft, size, 16)
    assert settings is not None
    assert (settings.method, settings.hidden, settings.moe_intermediate, settings.top_k) == ("RAWINT4_SFT", 7168, 2048, 8)
    assert (settings.threads, settings.pools, settings.lora_rank, settings.share_backward_bb) == (16, 1, 8, False)
    stored = settings.experts * 3 * 7168 * 2048 * 0.5625
    assert stored >= host_probe.PROBE_WEIGHT_BYTES and settings.experts < size.routed_experts
    # the model's tokens an expert (cutoff_len x micro-batch x top-k / experts), over the probe's experts
    tokens_an_expert = recipe.sft.cutoff_len * recipe.sft.per_device_train_batch_size * 8 / size.routed_experts
    assert settings.tokens == round(tokens_an_expert * settings.experts / 8)
    bf16 = _recipe(tmp_path, SERVE_PYTHON, "sft.kt_config.kt_backend=AMXBF16", "sft.kt_config.kt_expert_weight_format=bf16",
                   "sft.kt_config.kt_share_backward_bb=null", "sft.kt_config.kt_force_fused_expert_lora=null")
    assert probe_settings(bf16.sft, size, 16).method == "AMXBF16_SFT"
    assert host_probe.probe_model_seconds(settings, recipe.sft) > 0


# --------------------------------------------------------------------------- the plan and the cache


def _count_runs(monkeypatch: pytest.MonkeyPatch, forward_s: float = 0.2) -> list[str]:
    """run_probe replaced by a measured result (no kt-kernel needed), each call's machine recorded."""
    calls: list[str] = []

    def fake(settings: KtProbeSettings, machine: str, python: Path, **kwargs) -> KtProbe:
        calls.append(machine)
        return _measured(settings, machine, forward_s=forward_s)

    monkeypatch.setattr(host_probe, "run_probe", fake)
    monkeypatch.setattr(host_probe, "probe_toolchain", lambda recipe: ("toolchains.train.python", SERVE_PYTHON, {}))
    return calls


def test_a_plan_probes_once_per_machine_and_the_next_plan_reuses_it(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_runs(monkeypatch)
    recipe, size, host = _recipe(tmp_path), _size(), _h100()
    fitted = _plan_sft(recipe, host, size=size)
    assert fitted.kt_probe is not None and "none of this machine" in fitted.kt_probe.basis and not calls
    first = _plan_sft(recipe, host, size=size, probe=True)
    assert calls == [host.machine] and cache_path(tmp_path, host.machine).is_file()
    assert first.kt_probe is not None and first.kt_probe.probe is not None
    assert "KT probe: kt-kernel 0.7.2" in first.time_basis and "forward 200.0 ms" in first.time_basis
    # RAWINT4 ships a reference: the probe's ratio over it scales the prediction, and the plan says by how much
    reference = COSTS.kt_probe_reference["RAWINT4_SFT"]
    assert first.kt_probe.reference == reference
    assert first.kt_probe.factor == pytest.approx(first.kt_probe.ratio / reference)
    assert f"the reference {reference:.2f}x" in first.time_basis and f"x{first.kt_probe.factor:.2f}" in first.time_basis
    # without a reference for the method, the figures are reported and the prediction is the fitted one
    unreferenced = _plan_sft(recipe, host, size=size, costs=COSTS.model_copy(update={"kt_probe_reference": {}}))
    assert "no host with KT runs has probed RAWINT4_SFT" in unreferenced.time_basis
    assert unreferenced.step_seconds == pytest.approx(fitted.step_seconds)
    assert unreferenced.kt_probe.factor == 1.0 and unreferenced.kt_probe.reference is None
    second = _plan_sft(recipe, host, size=size, probe=True)
    assert calls == [host.machine] and second.kt_probe.probe == first.kt_probe.probe  # kept, not run again
    other = host.model_copy(update={"cpu_model": "another CPU"})
    _plan_sft(recipe, other, size=size, probe=True)
    assert calls == [host.machine, other.machine]  # another machine key: probed on its own
    assert len(json.loads(cache_path(tmp_path, host.machine).read_text())["probes"]) == 1


def test_with_a_reference_the_probe_scales_kts_cpu_passes_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _count_runs(monkeypatch)
    recipe, size, host = _recipe(tmp_path), _size(), _h100()
    fitted = _plan_sft(recipe, host, size=size, probe=True, costs=COSTS.model_copy(update={"kt_probe_reference": {}}))
    ratio = fitted.kt_probe.ratio
    costs = COSTS.model_copy(update={"kt_probe_reference": {"RAWINT4_SFT": ratio / 2}})  # this host: 2x slower
    scaled = _plan_sft(recipe, host, size=size, costs=costs)
    assert scaled.kt_probe.factor == pytest.approx(2.0) and "x2.00" in scaled.time_basis
    assert fitted.step_seconds < scaled.step_seconds < 2 * fitted.step_seconds  # the GPU's part is not scaled


def test_a_host_with_kt_runs_is_calibrated_by_them_not_probed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_runs(monkeypatch)
    recipe, size, host = _recipe(tmp_path), _size(), _h100()
    monkeypatch.setattr("ktflow.plan.host_records", lambda *a, **k: [("2026-01-01", "run", None)])
    line = _plan_sft(recipe, host, size=size, probe=True)
    assert line.kt_probe is None and not calls and "KT probe" not in line.time_basis


def test_without_kt_kernel_the_plan_is_as_fitted_and_says_why(tmp_path: Path) -> None:
    recipe, size, host = _recipe(tmp_path, NO_KT_PYTHON), _size(), _h100()
    line = _plan_sft(recipe, host, size=size, probe=True)
    assert "KT probe: not run: no toolchain with kt-kernel: toolchains.train.python" in line.time_basis
    assert line.kt_probe.factor == 1.0 and not cache_path(tmp_path, host.machine).exists()
    assert line.step_seconds == pytest.approx(_plan_sft(recipe, host, size=size).step_seconds)


def test_a_cpu_without_kt_kernels_sft_isa_is_not_probed_and_says_so(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_runs(monkeypatch)
    host = _h100().model_copy(update={"cpu_variant": "avx2", "native_cpu_variant": "avx2"})
    line = _plan_sft(_recipe(tmp_path), host, size=_size(), probe=True)
    assert "has no SFT kernels" in line.time_basis and "avx2" in line.time_basis and not calls
    assert line.kt_probe.factor == 1.0


def test_a_skipped_probe_is_kept_and_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe, size, host = _recipe(tmp_path), _size(), _h100()
    settings = probe_settings(recipe.sft, size, kt_threads(recipe.sft, host.physical_cores))
    keep_probe(tmp_path, KtProbe(machine=host.machine, settings=settings, status="skipped",
                                 reason="this kt-kernel build has no RAWINT4_SFT kernels"))
    line = _plan_sft(recipe, host, size=size)
    assert "not measured (this kt-kernel build has no RAWINT4_SFT kernels)" in line.time_basis
    assert cached_probe(tmp_path, host.machine, settings).status == "skipped"


def test_the_doctor_shows_the_probe_kept_for_this_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from ktflow.cli import main

    recipe, size = _recipe(tmp_path), _size()
    monkeypatch.setattr("ktflow.plan.model_size_for", lambda r: (size, "test"))
    here = probe_host(tmp_path)
    settings = probe_settings(recipe.sft, size, kt_threads(recipe.sft, here.physical_cores))
    keep_probe(tmp_path, _measured(settings, here.machine))
    sets = ["--set", f"store.root={tmp_path}", "--set", "sft.kt_config.kt_model_max_length=4096",
            "--set", "sft.kt_config.kt_num_threads=16"]
    main(["doctor", "--recipe", str(BIG), *sets, "--json"])
    document = json.loads(capsys.readouterr().out)
    probe = document["kt_probe"]["probe"]
    assert probe["machine"] == here.machine and probe["forward_s"] > 0 and probe["backward_s"] > 0
    assert "the reference" in document["kt_probe"]["basis"] and "KT's CPU passes x" in document["kt_probe"]["basis"]


def _script(name: str):
    """benchmarks/NAME.py, imported as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_the_shipped_reference_is_the_estimate_of_the_probed_hosts_and_checks_on_the_host_left_out() -> None:
    """CostModel.kt_probe_reference is benchmarks/probe_reference.py's estimate (reference.json) from the hosts with
    a probe and a KT run, recomputed here with today's time model (a constant refitted since makes it stale); each
    host's step predicted with the other's estimate is within 10 % of what it measured."""
    script = _script("probe_reference")
    document = json.loads((script.DATA / "reference.json").read_text())
    points = [script.host_point(script.DATA / p["host"]) for p in document["hosts"]]
    assert len(points) >= 2
    for kept, now in zip(document["hosts"], points):
        assert now["reference_estimate"] == pytest.approx(kept["reference_estimate"], rel=1e-6)
    reference = script.reference_of(points)
    assert reference == pytest.approx(sum(p["reference_estimate"] for p in points) / len(points))
    assert document["reference"] == pytest.approx(reference, abs=1e-3)
    assert COSTS.kt_probe_reference[document["method"]] == pytest.approx(reference, abs=1e-3)
    checks = script.out_of_sample(points)  # each host with the others' estimate, recomputed
    assert [c["host"] for c in checks] == [p["host"] for p in points]
    for check, point in zip(checks, points):
        others = [p["reference_estimate"] for p in points if p is not point]
        assert check["predicted_with_probe_s"] == pytest.approx(
            point["gpu_s"] + point["cpu_s"] * point["probe_ratio"] / (sum(others) / len(others)))
        assert check["predicted_with_probe_s"] != pytest.approx(point["predicted_step_s"])  # the probe changed it
        assert abs(check["error_with_probe"]) < 0.10


def test_the_runs_the_reference_never_saw_are_the_scripts_checks_and_their_plans_as_recorded() -> None:
    """benchmarks/probe_reference.py's checks (runs planned with the shipped reference, not used to estimate it):
    recomputed here, each equals what the plan on its host said before it trained (its own probe, the shipped
    reference), and reference.json keeps them and the shaper's gain as measured, misses included."""
    script = _script("probe_reference")
    document = json.loads((script.DATA / "reference.json").read_text())
    runs, gains = script.checked(COSTS.kt_probe_reference[document["method"]])
    fitted = {(script.DATA / p["host"]).resolve() for p in document["hosts"]}
    assert len(runs) == len(script.CHECKS) >= 3
    for run, (name, folder, file) in zip(runs, script.CHECKS):
        assert folder.resolve() not in fitted
        recorded = json.loads((folder / file).read_text())["predicted"]["step_s"]
        assert run["predicted_with_probe_s"] == pytest.approx(recorded, rel=5e-3)
    assert [r["check"] for r in document["checks"]] == [r["check"] for r in runs]
    for kept, now in zip(document["checks"], runs):
        assert kept["error_with_probe"] == pytest.approx(now["error_with_probe"], abs=1e-6)
    assert len(gains) == len(document["shaper_gain"]) >= 1
    for kept, now in zip(document["shaper_gain"], gains):
        assert now["measured_gain"] == pytest.approx(
            next(r["measured_step_s"] for r in runs if r["check"] == now["as_written"])
            / next(r["measured_step_s"] for r in runs if r["check"] == now["shaped"]))
        assert kept["predicted_gain"] == pytest.approx(now["predicted_gain"], abs=1e-6)


def test_the_shaper_gain_table_is_the_runs_recorded_gains_by_experts_per_layer() -> None:
    """benchmarks/shaper_gain.py: every pair's gain is its two runs' steps as recorded (the planner's and the measured),
    the Kimi-K2.5 slice's pairs are reference.json's, and shaper-gain.json is what the script prints now."""
    script = _script("shaper_gain")
    rows = script.gains()
    assert json.loads((script.PROBE / "shaper-gain.json").read_text())["gains"] == rows
    check = json.loads((script.KT / "out-of-sample-check.json").read_text())
    steps = {(m["machine"], r["split"], r["model"]): (r["planner_step_s"], r["step_s"]) for m in check["machines"]
             for r in m["runs"] if r["threads"] == 16 and r["pools"] == 1 and r["model"] in script.FIXTURES}
    by_experts = {script._experts(f): model for model, f in script.FIXTURES.items()}
    for row in rows:
        assert row["error"] == pytest.approx(row["predicted_gain"] / row["measured_gain"] - 1)
        if row["experts_per_layer"] in by_experts:
            model = by_experts[row["experts_per_layer"]]
            other, shaped = steps[(row["machine"], row["other"], model)], steps[(row["machine"], row["shaped"], model)]
            assert row["predicted_gain"] == pytest.approx(other[0] / shaped[0])
            assert row["measured_gain"] == pytest.approx(other[1] / shaped[1])
    slice_rows = [r for r in rows if r["experts_per_layer"] == 384]
    reference = json.loads((script.PROBE / "reference.json").read_text())
    assert len(slice_rows) == len(reference["shaper_gain"])
    assert {round(r["measured_gain"], 9) for r in slice_rows} == {round(g["measured_gain"], 9)
                                                                   for g in reference["shaper_gain"]}
    assert {r["experts_per_layer"] for r in rows} == {96, 180, 384}


def test_the_two_part_fit_recovers_the_split_that_made_the_ratios() -> None:
    """benchmarks/kt_expert_count.py's least squares: CPU times made from a known bytes-floor scale and cost a layer
    pass, each machine at its own speed, give back that scale and cost."""
    script = _script("kt_expert_count")
    s_true, t0_true = 0.4, 0.25

    def point(calls: float, bytes_part: float, flops: float, passes: float, speed: float) -> dict:
        p = {"calls": calls, "bytes": bytes_part, "flops": flops, "layer_passes": passes}
        return {**p, "measured_cpu_s": speed * script.cpu_s(p, s_true, t0_true)}

    groups = [(point(0.1, 3.5, 9.4, 3, 1.1), [point(0.5, 14.0, 7.7, 12, 1.1), point(1.1, 27.8, 6.5, 24, 1.1)]),
              (point(0.1, 0.9, 8.0, 3, 0.7), [point(1.0, 7.0, 5.0, 24, 0.7)])]
    s, t0 = script.fit(groups)
    assert s == pytest.approx(s_true, rel=1e-9) and t0 == pytest.approx(t0_true, rel=1e-9)


def test_expert_count_json_is_what_the_script_fits_now() -> None:
    """plan-probe/expert-count.json is the script's output from the recorded runs (a run or a constant changed since
    makes it stale), and the fit rows are the runs FIT names, the checks the runs CHECK names."""
    script = _script("kt_expert_count")
    kept = json.loads((REPO / "benchmarks/data/plan-probe/expert-count.json").read_text())
    fitted = [(script.run_point(s), [script.run_point(o) for o in others]) for _, s, others in script.FIT]
    s, t0 = script.fit(fitted)
    assert kept["bytes_floor_scale"] == pytest.approx(s) and kept["layer_pass_s"] == pytest.approx(t0)
    assert kept["fit"] == [n for n, _, _ in script.FIT] and kept["check"] == [n for n, _, _ in script.CHECK]
    assert len([r for r in kept["ratios"] if r["set"] == "fit"]) == sum(len(o) for _, _, o in script.FIT)
    assert len([r for r in kept["ratios"] if r["set"] == "check"]) == sum(len(o) for _, _, o in script.CHECK)
    for row in kept["ratios"]:
        assert row["shipped_error"] == pytest.approx(row["shipped_gain"] / row["measured_gain"] - 1)


def test_the_experts_a_call_reached_are_kt_kernels_own_count_over_layers_and_calls() -> None:
    script = _script("kt_routing")
    profile = {"profile": {"layers": {"1": {"tp.0.active_experts": 300.0, "tp.0.forward.total.calls": 2.0},
                                      "2": {"tp.0.active_experts": 200.0, "tp.0.forward.total.calls": 2.0}}}}
    assert script.active_per_call(profile) == 125.0


def test_routing_json_is_what_the_script_computes_now_from_the_profiled_runs() -> None:
    """plan-probe/routing.json is benchmarks/kt_routing.py's output (a run or a constant changed since makes it stale),
    every profiled routing run is in it, and every count of experts reached, measured or balanced, is within the
    layer's experts."""
    script = _script("kt_routing")
    kept = json.loads((REPO / "benchmarks/data/plan-probe/routing.json").read_text())
    points = script.fit_points() + script.check_points()
    assert kept == json.loads(json.dumps({"points": points, "gains": script.gains(points)}))
    runs = {p.name.removesuffix(".kt_profile.json") for p in script.ROUTING.glob("*/*.kt_profile.json")}
    assert runs == {p["run"] for p in kept["points"] if p["where"].startswith("h200")}
    for point in kept["points"]:
        assert 0 < point["active_measured"] <= point["experts"] and 0 < point["active_balanced"] <= point["experts"]
