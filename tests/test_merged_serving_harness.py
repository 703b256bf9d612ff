"""gpu_host/merged_serving.py rehearsed on the CPU: its phases' plumbing at tiny size, through ktflow's real serve
stage (the merge stage for real, the model views, the launch's checks) against a stand-in sglang server, the
children in their own processes as on the GPU host. The stand-in server is tests/fake_sglang (streaming chat with
usage for benchmarks/serve_load.py, /generate's prompt logprobs for the served loss). The GPU runs themselves:
gpu_host/README.md, "Merged serving"."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "gpu_host"))

import merged_serving as ms  # noqa: E402

FAKE_SGLANG = REPO / "tests" / "fake_sglang"  # the stand-in sglang-kt: streaming chat, /generate's prompt logprobs


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def harness(tmp_path: Path, fixture_dir, monkeypatch: pytest.MonkeyPatch):
    """merged_serving's folders in tmp_path, a tiny Kimi-K2.5 fixture as 'the slice', the stand-in server on the
    serving toolchain's path, this python as every toolchain."""
    monkeypatch.setattr(ms, "BUILD", tmp_path / "build")
    monkeypatch.setattr(ms, "ROOT", tmp_path / "build" / "merged")
    monkeypatch.setattr(ms, "RESULTS", tmp_path / "build" / "merged" / "results")
    monkeypatch.setenv(ms.REHEARSAL_GPU_ENV, "1")
    monkeypatch.setenv("KTFLOW_API_KEY", "rehearsal-key-" + "x" * 16)
    ms.ROOT.mkdir(parents=True)
    (ms.ROOT / "depth.json").write_text(json.dumps({"moe_layers": 2}))
    shutil.copytree(fixture_dir("kimi-k2.5"), ms.ROOT / "moe2" / "model")
    sets = [f"toolchains.serve.env.PYTHONPATH={FAKE_SGLANG}", f"serving.port={_free_port()}", "serving.ready_timeout_s=60",
            "serving.kt_cpuinfer=2"]

    def run(*argv: str) -> int:
        common = ["--python", sys.executable, "--serve-python", sys.executable, "--bandwidth-gib", "0.01"]
        return ms.main([*argv, *common, *sum((["--set", s] for s in sets), [])])

    yield run, tmp_path
    left = [p.pid for p in psutil.process_iter(["cmdline"])  # nothing the phases started may be left
            if str(tmp_path) in " ".join(p.info["cmdline"] or []) and "--model-path" in (p.info["cmdline"] or [])]
    assert not left


def test_depth_is_the_deepest_the_disk_allows() -> None:
    assert ms.choose_depth(60) == 1 and ms.choose_depth(85) == 2 and ms.choose_depth(240) == 3
    assert ms.choose_depth(40) is None


def _work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ms.MergedWork:
    monkeypatch.setattr(ms, "ROOT", tmp_path / "merged")
    return ms.MergedWork(argparse.Namespace(moe_layers=1, python=sys.executable, ktflow_python=None,
                                            serve_python=sys.executable, set=None))


def _host(vram_gib: int, cores: int = 16):
    from ktflow.host.hardware import GpuInfo, probe_host

    return probe_host().model_copy(update={"gpus": [GpuInfo(index=0, name="H100", vram_bytes=vram_gib << 30)],
                                           "physical_cores": cores, "numa_nodes": 1})


def test_the_groups_are_the_products_candidates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each group: its own baseline (merged RAWINT4, graphs on) then the product's levers of its fields, as the
    harness's ``serving.X=Y`` overrides."""
    groups = ms.lever_groups(ms.harness_candidates(ms.lever_recipe(_work(tmp_path, monkeypatch)), _host(79)))
    names = {g: [c.name for c in cs] for g, cs in groups.items()}
    share = names["gpu"][1]
    assert names == {"engine": ["baseline", "cuda-graphs-off", "deferral-1", "deferral-2"],
                     "gpu": ["baseline", share, f"{share}-dynamic", "chunked-prefill-4096"],
                     "threads": ["baseline", "cpuinfer-16", "cpuinfer-14", "cpuinfer-8", "threadpools-2"],
                     "methods": ["baseline", "AMXINT4", "AMXINT8"], "combo": ["baseline"]}
    assert ms.lever_sets(groups["engine"][0].updates) == []  # the baseline: MERGED_SETS alone
    assert ms.lever_sets(groups["engine"][1].updates) == ["serving.disable_cuda_graph=true"]
    n = groups["gpu"][1].updates["kt_num_gpu_experts"]
    assert ms.lever_sets(groups["gpu"][2].updates) == [f"serving.kt_num_gpu_experts={n}",
                                                       "serving.kt_enable_dynamic_expert_update=true"]
    assert ms.lever_sets(groups["methods"][2].updates) == ["serving.kt_method=AMXINT8"]
    assert ms.set_updates(ms.lever_sets(groups["gpu"][2].updates)) == groups["gpu"][2].updates  # and back
    # one NUMA node, no AMX here: the product's reasons
    assert groups["threads"][4].status == "skipped" and "NUMA node" in groups["threads"][4].reason
    assert groups["threads"][2].status == "skipped"  # 14 = 16 cores less 2: what the baseline serves with


def test_gpu_experts_are_the_whole_models_share_of_the_card(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The product's share (ktflow.stages.serve.levers.gpu_expert_share) for the WHOLE Kimi-K2.5: its 23.4 GB of
    non-expert weights, a KV pool and a reserve first; then 60 layers of ~24.8 MB experts."""
    from ktflow.recipe import load_recipe
    from ktflow.stages.serve.levers import gpu_expert_share

    recipe = ms.lever_recipe(_work(tmp_path, monkeypatch))

    def gpu(vram_gib: int):
        return ms.lever_groups(ms.harness_candidates(recipe, _host(vram_gib)))["gpu"][1]

    h100 = gpu(79)
    n = h100.updates["kt_num_gpu_experts"]
    assert h100.status == "run" and 20 <= n <= 36 and h100.name == f"gpu-experts-{n}"
    assert "23.6 MiB experts" in h100.why and "of 384 experts a layer" in h100.why
    whole = load_recipe(ms.WHOLE_RECIPE).source.size
    assert n == gpu_expert_share(whole, 79 << 30, method="RAWINT4",
                                 context_tokens=recipe.serving.context_length).experts_per_layer
    assert gpu(140).updates["kt_num_gpu_experts"] > n
    assert gpu(20).status == "skipped" and "no room for experts" in gpu(20).reason


def _server(rate: float | None, sets: list[str] | None = None, *, loss: float | None = None) -> dict:
    """A levers.json entry as run_server leaves it, written before the harness kept candidates (its overrides)."""
    doc = {"ok": rate is not None, "lever_sets": sets or [], "levels": [] if rate is None else [
        {"concurrency": 1, "errors": 0, "requests": 3, "decode_tokens_per_s_median": rate, "ttft_s": {"p50": 0.2}}]}
    if rate is None:
        doc["error"] = "ServerStartError: out of memory"
    if loss is not None:
        doc["served_loss"] = {"loss": loss, "records": 16}
    return doc


def test_a_baseline_is_shared_only_on_the_same_machine_since_it_booted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group reuses another group's served baseline of this machine and boot (one server start less a step), not
    one of another machine or boot, not one that did not serve, and where losses are compared only one with a
    served loss."""
    monkeypatch.setattr(ms, "machine_boot", lambda: "host-a/boot-1")
    here = {**_server(40.0), "boot": "host-a/boot-1"}
    shared = ms.shared_baseline({"engine": {"baseline": here}}, "gpu", with_loss=False)
    assert shared == {**here, "shared_from": "engine"}
    assert ms.shared_baseline({"engine": {"baseline": here}}, "engine", with_loss=False) is None  # its own
    for other in ({**_server(40.0), "boot": "host-a/boot-0"}, {**_server(40.0), "boot": "host-b/boot-1"},
                  {**_server(None), "boot": "host-a/boot-1"}, _server(40.0)):
        assert ms.shared_baseline({"engine": {"baseline": other}}, "gpu", with_loss=False) is None
    assert ms.shared_baseline({"engine": {"baseline": here}}, "methods", with_loss=True) is None  # no loss to compare
    with_loss = {**_server(40.0, loss=0.5), "boot": "host-a/boot-1"}
    assert ms.shared_baseline({"engine": {"baseline": with_loss}}, "methods", with_loss=True)["served_loss"]["loss"] == 0.5


def test_the_chosen_settings_and_the_combination(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The product's rules on what the steps measured: each lever judged against its own step's baseline (served
    loss compared where measured), the fastest correct chosen, the levers that beat theirs by 3 % combined."""
    from ktflow.stages.serve.levers import COMBINED, ServedModel, ServingLevers, choose_settings

    recipe = ms.lever_recipe(_work(tmp_path, monkeypatch))
    host = _host(79)
    candidates = ms.harness_candidates(recipe, host)
    model = ServedModel(path="/slice/model", kt_method="RAWINT4", mode="merged")
    deferral, chunks, graphs_off = ("serving.kt_max_deferred_experts_per_token=1", "serving.chunked_prefill_size=4096",
                                    "serving.disable_cuda_graph=true")
    levers = {"engine": {"baseline": _server(40.0), "deferral-1": _server(44.0, [deferral]),
                         "cuda-graphs-off": _server(39.0, [graphs_off])},
              "gpu": {"baseline": _server(30.0), "chunked-prefill-4096": _server(36.0, [chunks])},
              # another CPU method: 1.5x as fast but 2 % more served loss than its step's baseline (1 % allowed)
              "methods": {"baseline": _server(20.0, loss=0.5),
                          "AMXINT8": _server(30.0, ["serving.kt_method=AMXINT8"], loss=0.51),
                          "AMXINT4": _server(20.4, ["serving.kt_method=AMXINT4"], loss=0.503)}}
    record, where = ms.lever_record(levers, candidates, recipe, host, model)
    runs = {r.candidate.name: r for r in record.runs}
    assert runs["AMXINT8"].correct is False and "wrong" in runs["AMXINT8"].verdict
    assert runs["AMXINT4"].correct and runs["AMXINT4"].vs_baseline == 1.02  # +0.6 %: within 1 %
    chunked = runs["chunked-prefill-4096"]
    assert chunked.vs_baseline == 1.2 and chunked.measurement.decode_tokens_per_s == pytest.approx(48.0)  # 36 x 40/30
    assert "against the gpu step's baseline of 30.0" in chunked.verdict
    assert runs["deferral-2"].verdict.startswith("not measured yet") and runs["threadpools-2"].verdict.startswith("skipped")
    assert record.choice == choose_settings(record.runs) and record.machine == host.machine
    assert ms.levers_chosen(record, where) == {"name": "gpu/chunked-prefill-4096",
                                               "sets": ["serving.chunked_prefill_size=4096"], "vs_baseline": 1.2,
                                               "reason": record.choice.reason}
    combined = runs[COMBINED]  # deferral-1 (1.1x) and the chunks (1.2x): the combo step's to measure
    assert combined.measurement is None and combined.verdict == "not measured yet (merged-levers-combo)"
    assert ms.lever_sets(combined.candidate.updates) == [chunks, deferral]  # AMXINT4's 1.02x: not in it
    # the combo step measured it: 1.25x its own baseline, the fastest correct
    levers["combo"] = {"baseline": _server(50.0), COMBINED: {
        **_server(62.5, ms.lever_sets(combined.candidate.updates)), "candidate": combined.candidate.model_dump()}}
    record, where = ms.lever_record(levers, candidates, recipe, host, model)
    assert ms.levers_chosen(record, where)["name"] == "combo/combined"
    assert ms.levers_chosen(record, where)["sets"] == ms.lever_sets(combined.candidate.updates)
    assert ServingLevers.model_validate_json(record.model_dump_json()) == record
    # the gpu step's baseline started again measured 1.1x its first start: put on the reference's scale (44.0),
    # which the chunks' 48.0 still beats by 3 %; at 1.2x (48.0) nothing does, and the recipe's settings stay
    levers["gpu"]["baseline-again"] = {**_server(33.0), "candidate": {"name": "baseline-again",
                                                                      "updates": {"mode": "merged"}, "why": "again"}}
    del levers["combo"]
    record, where = ms.lever_record(levers, candidates, recipe, host, model)
    again = {r.candidate.name: r for r in record.runs}["baseline-again"]
    assert again.measurement.decode_tokens_per_s == pytest.approx(44.0) and again.vs_baseline == 1.1
    assert ms.levers_chosen(record, where)["name"] == "gpu/chunked-prefill-4096"
    levers["gpu"]["baseline-again"].update(_server(36.0))
    record, where = ms.lever_record(levers, candidates, recipe, host, model)
    assert record.choice.name == "baseline" and ms.levers_chosen(record, where)["sets"] == []
    assert "no setting beat them by 3% or more" in record.choice.reason
    # no baseline served: nothing chosen, the baseline's (empty) overrides
    record, where = ms.lever_record({"engine": {"baseline": _server(None), "deferral-1": _server(44.0)}},
                                    candidates, recipe, host, model)
    assert record.choice is None and ms.levers_chosen(record, where)["sets"] == []
    assert "did not serve" in {r.candidate.name: r for r in record.runs}["deferral-1"].verdict


def test_run_sh_names_every_phase() -> None:
    text = (REPO / "gpu_host" / "run.sh").read_text()
    for step in ("merged-fixture", "merged-adapter", "merged-merge", "merged-levers-*", "merged-load",
                 "merged-alternate", "merged-check-*", "merged-report", "pack-merged"):
        assert f"    {step})" in text, step
    assert "merged" in (REPO / "gpu_host" / "run.sh").read_text().split("steps=(")[0]  # the function's defined first


def _in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Servers measured by this process instead of a child of the serving toolchain (each child imports torch,
    transformers and ktflow: seconds on this box); the load phase keeps its children."""
    import ktflow.resources
    from ktflow.host.hardware import GpuInfo, probe_host
    from ktflow.stages.serve import stop

    host = probe_host().model_copy(update={"gpus": [GpuInfo(index=0, name="rehearsal", vram_bytes=80 << 30)]})
    monkeypatch.setattr(ktflow.resources.hardware, "probe_host", lambda *a, **k: host)

    def run_server(work, spec, limit_s):
        doc = ms.serve_and_measure(spec)
        stop(Path(spec["record_dir"]))
        return {**doc, "child": {"rc": 0, "outcome": "in process"}}

    monkeypatch.setattr(ms, "run_server", run_server)


def test_phases_rehearsed_with_the_stand_in_server(harness, fixture_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """adapter (random), merge, levers, load, check and report, in that order; the load phase's servers each a
    child of the serving toolchain's python, as on the GPU host, the others measured in this process."""
    run, tmp = harness
    monkeypatch.setattr(ms, "LOAD_ARGS", "--concurrency 1,4 --max-tokens 6 --warmup 0")
    monkeypatch.setattr(ms, "LEVER_ARGS", "--concurrency 1 --max-tokens 6 --warmup 0 --requests-per-level 2")
    real_groups = ms.lever_groups

    def groups(candidates):
        found = real_groups(candidates)
        assert found["gpu"][1].name.startswith("gpu-experts-") and found["gpu"][1].status == "run"
        return {**found, "engine": found["engine"][:2]}  # baseline and CUDA graphs off

    monkeypatch.setattr(ms, "lever_groups", groups)
    results = ms.RESULTS

    assert run("adapter", "--random") == 0
    converted = json.loads((results / "adapter.json").read_text())["converted"]
    assert converted["expert_tensors"] > 0 and converted["tensors"] > converted["expert_tensors"]

    assert run("merge") == 0
    merge = json.loads((results / "merge-RAWINT4.json").read_text())
    assert merge["made"]["rc"] == 0 and merge["estimate"]["seconds"] > 0 and merge["bytes_on_disk"] > 0

    with monkeypatch.context() as inside:
        _in_process(inside)
        assert run("levers", "--group", "engine") == 0
    levers = json.loads((results / "levers.json").read_text())["engine"]
    assert set(levers) == {"baseline", "cuda-graphs-off", "baseline-again"}  # the baseline's second start, last
    assert list(levers)[-1] == "baseline-again" and levers["baseline-again"]["lever_sets"] == []
    base_argv, off_argv = levers["baseline"]["argv"], levers["cuda-graphs-off"]["argv"]
    assert "--disable-cuda-graph" not in base_argv and "--disable-cuda-graph" in off_argv
    assert "--lora-paths" not in base_argv  # merged: no LoRA flags
    assert levers["baseline"]["endpoint"]["merged_dir"] and levers["baseline"]["floor"]["floor_tokens_per_s"] > 0
    assert all(not d["leftover_processes"] for d in levers.values())
    assert levers["cuda-graphs-off"]["lever_sets"] == ["serving.disable_cuda_graph=true"]
    chosen = json.loads((results / "levers-chosen.json").read_text())
    assert {"name", "sets", "vs_baseline"} <= set(chosen)
    # the product's record beside levers.json, as `ktflow tune-serving` keeps it
    from ktflow.stages.serve.levers import ServingLevers, choose_settings

    record = ServingLevers.model_validate_json((results / "serving-levers.json").read_text())
    runs = {r.candidate.name: r for r in record.runs}
    assert runs["baseline"].correct and runs["cuda-graphs-off"].measurement.decode_tokens_per_s > 0
    assert runs["cuda-graphs-off"].candidate.updates == {"mode": "merged", "disable_cuda_graph": True}
    assert runs["chunked-prefill-4096"].verdict == "not measured yet (merged-levers-gpu)"  # another step's
    assert runs["AMXINT8"].candidate.status == "skipped" and runs["AMXINT8"].verdict.startswith("skipped: ")
    assert record.choice == choose_settings(record.runs) and record.choice is not None
    assert chosen["sets"] == ms.lever_sets(record.choice.updates)
    assert record.gpu == "rehearsal" and record.model.path == str(ms.ROOT / "moe2" / "model")
    step = json.loads((results / "levers-engine.json").read_text())
    assert step["gpu_expert_share"]["status"] == "run" and step["runs"]["baseline"]["correct"] is True

    assert run("load") == 0
    load = json.loads((results / "load.json").read_text())
    for what in ("lora", "merged", "base"):
        got = load[what]
        assert got["ok"], got.get("error") or got.get("child")
        assert [lv["concurrency"] for lv in got["levels"]] == [1, 4] and got["read_bandwidth"]["read_gb_s"] > 0
        assert not got["leftover_processes"]
    assert "--lora-paths" in load["lora"]["argv"] and "--disable-cuda-graph" in load["lora"]["argv"]
    assert "--lora-paths" not in load["merged"]["argv"] and "--lora-paths" not in load["base"]["argv"]
    assert load["merged"]["endpoint"]["merged_dir"] and not load["base"]["endpoint"]["merged_dir"]
    # one model view per served checkpoint: the LoRA path and the base server share the base's
    views = sorted(p.parent.name for p in ms.ROOT.glob("moe2/endpoints/*/model-view-*"))
    assert views == ["base", "merged-RAWINT4"]
    summary = json.loads((results / "load-summary.json").read_text())
    assert summary["ratios"]["1"]["merged_over_base"] > 0
    # what each server generated, as repetition: the stand-in's completions share no chunk
    assert all(0 < lv["distinct_share"] <= 1 for s in summary["servers"].values() for lv in s["levels"].values())

    # item 5's gap against the spread between starts: base and merged in turn, the chosen settings
    with monkeypatch.context() as inside:
        _in_process(inside)
        assert run("alternate", "--starts", "2") == 0
    alternate = json.loads((results / "alternate.json").read_text())
    assert alternate["order"] == ["base", "merged"] and alternate["chosen"] == chosen
    assert [s["what"] for s in alternate["starts"]] == ["base", "merged"] and all(s["ok"] for s in alternate["starts"])
    assert Path(alternate["starts"][1]["server"]).name == "alternate-2-merged.json"
    assert alternate["summary"]["merged_over_base"] > 0

    # item 4: the tiny BF16 fixture, its converted adapter, loss_check's outputs where run.sh leaves them
    bf16 = fixture_dir("bf16")
    monkeypatch.setattr(ms, "TINY_BASES", {"bf16": bf16})
    monkeypatch.setattr(ms, "CHECK_VARIANTS", {"bf16": [("lora", None), ("merged-BF16", "BF16"),
                                                         ("merged-BF16-lora-path", None)]})
    build = tmp / "build"
    ms.random_converted_adapter(bf16, build / "store" / "converted" / "bf16")
    (build / "results").mkdir(parents=True, exist_ok=True)
    (build / "results" / "tokens-bf16.json").write_text(json.dumps(
        [{"input_ids": [1, 2, 3, 4, 5], "labels": [-100, -100, 3, 4, 5]}] * 3))
    (build / "results" / "loss-bf16-full.json").write_text(json.dumps({"loss": 0.0503}))
    monkeypatch.setattr(ms, "REFERENCE_PYTHON", sys.executable)
    with monkeypatch.context() as inside:
        _in_process(inside)
        # the merged checkpoint through the LoRA path needs the merge that serving merged-BF16 makes
        assert run("check", "--name", "bf16", "--only", "merged-BF16-lora-path") == 1
        first = json.loads((results / "check-bf16.json").read_text())["merged-BF16-lora-path"]
        assert not first["ok"] and "run ONLY=merged-BF16,merged-BF16-lora-path first" in first["error"]
        assert run("check", "--name", "bf16") == 0
    check = json.loads((results / "check-bf16-summary.json").read_text())
    assert [r["server"] for r in check["rows"]] == ["lora", "merged-BF16", "merged-BF16-lora-path"]
    assert all(r["served_loss"] == pytest.approx(0.05) and r["within_0.0005"] for r in check["rows"])
    assert check["bf16_within_tolerance"] is True
    # the merged BF16 weights scored in float32 by loss_check.py (ktflow's own python holds what its base variant
    # needs), the served difference split into the weights' rounding and the server's computation
    fp32 = check["rows"][1]["merged_weights_fp32"]
    assert math.isfinite(fp32["loss"]) and fp32["rounding"] == pytest.approx(fp32["loss"] - 0.0503)
    assert fp32["server"] == pytest.approx(check["rows"][1]["served_loss"] - fp32["loss"])
    # the merged checkpoint through the LoRA path: the merge's folder as the model, the adapter with its B zeroed
    through = json.loads((results / "servers" / "check-bf16-merged-BF16-lora-path.json").read_text())
    merged_dir = json.loads((results / "servers" / "check-bf16-merged-BF16.json").read_text())["endpoint"]["merged_dir"]
    argv = through["argv"]
    assert through["mode"] == "lora" and "--enable-lora" in argv
    assert argv[argv.index("--kt-weight-path") + 1] == merged_dir
    assert Path(through["adapter"]).name == "bf16" and "tiny-zero-b" in through["adapter"]
    assert json.loads((results / "check-bf16.json").read_text())["merged-BF16-lora-path"]["merged_dir"] == merged_dir

    assert run("report") == 0
    report = json.loads((results / "summary.json").read_text())
    assert report["item5_side_by_side"]["servers"]["merged"]["ok"] and "engine" in report["item3_levers"]
    assert "bf16" in report["item4_served_equals_trained"]


def test_alternate_starts_take_turns_and_weigh_the_gap_against_each_models_own_spread() -> None:
    assert ms.alternate_order("base", 4) == ["base", "merged", "base", "merged"]
    assert ms.alternate_order("merged", 2) == ["merged", "base"]
    for bad in (3, 0):
        with pytest.raises(SystemExit, match="even number"):
            ms.alternate_order("base", bad)
    with pytest.raises(SystemExit, match="not one of"):
        ms.alternate_order("lora", 2)

    def starts(*pairs: tuple[str, float | None]) -> list[dict]:
        return [{"what": w, "ok": r is not None, "decode_tokens_per_s": r} for w, r in pairs]

    # merged 0.80x the base model while each model's own starts are within 2 %: the gap is merging's
    wide = ms.alternate_summary(starts(("base", 200.0), ("merged", 160.0), ("base", 204.0), ("merged", 162.0)))
    assert wide["merged_over_base"] == pytest.approx(161.0 / 202.0)
    assert wide["within_10_percent"] is False and wide["gap_wider_than_own_spread"] is True
    assert wide["models"]["base"]["range"] == [200.0, 204.0] and wide["models"]["base"]["starts"] == 2
    # 0.93x with starts of one model 10 % apart: no wider than the machine's own spread
    noise = ms.alternate_summary(starts(("base", 200.0), ("merged", 190.0), ("base", 220.0), ("merged", 200.0)))
    assert noise["within_10_percent"] is True and noise["gap_wider_than_own_spread"] is False
    # a start that measured nothing, failed or is not measured yet is left out, and one start of a model says
    # nothing of its spread
    one = ms.alternate_summary([*starts(("base", 200.0), ("merged", None), ("base", 210.0)), None,
                                {"what": "merged", "ok": False, "decode_tokens_per_s": 150.0},
                                *starts(("merged", 190.0))])
    assert one["models"]["merged"]["starts"] == 1 and one["gap_wider_than_own_spread"] is None


def test_alternate_starts_go_on_in_turn_and_measure_a_failed_start_again(
        harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run with no time for a start leaves it and every later one for the next run (the starts keep their turns);
    a run measures the starts not measured or failed, in order, and keeps the others."""
    run, _ = harness
    served: list[str] = []
    rates = iter([200.0, None, 205.0, 180.0, 190.0])  # the second start fails the first time

    def run_server(work, spec, limit_s):
        served.append(spec["label"])
        rate = next(rates)
        return {"ok": rate is not None, "error": None if rate else "died",
                "levels": [{"concurrency": 1, "decode_tokens_per_s_median": rate, "errors": 0 if rate else 3,
                            "ttft_s": {"p50": 0.3}, "distinct_share_median": 0.8}]}

    monkeypatch.setattr(ms, "run_server", run_server)
    monkeypatch.setattr(ms, "timed_merge", lambda *a, **k: {"made": "reused (already in the store)"})
    monkeypatch.setattr(ms, "room_for", lambda work, spec: {"fits": True})
    monkeypatch.setattr(ms, "merge_dir", lambda *a, **k: ms.ROOT / "no-merge-yet")  # each merged start counts one
    assert run("adapter", "--random") == 0
    monkeypatch.setattr(ms, "START_S", {2: ms.big.PHASE_LIMIT_S})  # no start fits the phase's time
    assert run("alternate") == 0
    doc = json.loads((ms.RESULTS / "alternate.json").read_text())
    assert served == [] and doc["starts"] == [None] * 4 and doc["skipped"].startswith("starts 1-4: ")
    monkeypatch.setattr(ms, "START_S", {2: 5.0})
    assert run("alternate") == 1  # the second start died
    doc = json.loads((ms.RESULTS / "alternate.json").read_text())
    assert [s["ok"] for s in doc["starts"]] == [True, False, True, True] and "skipped" not in doc
    assert run("alternate") == 0  # only the failed start again, in its turn's slot
    doc = json.loads((ms.RESULTS / "alternate.json").read_text())
    assert served == ["alternate-1-base", "alternate-2-merged", "alternate-3-base", "alternate-4-merged",
                      "alternate-2-merged"]
    assert [s["what"] for s in doc["starts"]] == ["base", "merged", "base", "merged"]
    assert [s["decode_tokens_per_s"] for s in doc["starts"]] == [200.0, 190.0, 205.0, 180.0]
    assert all(s["started"] for s in doc["starts"])
    summary = doc["summary"]
    assert summary["merged_over_base"] == pytest.approx(185.0 / 202.5) and summary["within_10_percent"] is True
    # within the target, yet 1.09x apart: wider than either model's own starts (merged 1.06x, base 1.03x)
    assert summary["gap_wider_than_own_spread"] is True


def test_a_phase_out_of_time_says_what_it_left_and_goes_on_when_run_again(
        harness, monkeypatch: pytest.MonkeyPatch) -> None:
    run, _ = harness
    monkeypatch.setattr(ms, "LOAD_ARGS", "--concurrency 1 --max-tokens 4 --warmup 0")
    assert run("adapter", "--random") == 0
    _in_process(monkeypatch)
    monkeypatch.setattr(ms, "START_S", {2: ms.big.PHASE_LIMIT_S})  # no server fits the phase's time
    assert run("load", "--only", "base") == 0
    load = json.loads((ms.RESULTS / "load.json").read_text())
    assert load["skipped"][0]["what"] == "base" and "base" not in load
    monkeypatch.setattr(ms, "START_S", {2: 5.0})
    assert run("load", "--only", "base") == 0
    assert json.loads((ms.RESULTS / "load.json").read_text())["base"]["ok"]


def test_make_room_removes_other_views_and_merges_never_the_base(tmp_path: Path, monkeypatch) -> None:
    work = _work(tmp_path, monkeypatch)
    for d in ("endpoints/base/model-view-a", "endpoints/merged-RAWINT4/model-view-b", "model"):
        (work.root / d).mkdir(parents=True)
    (work.sft_store / "merged" / "x").mkdir(parents=True)
    monkeypatch.setattr(ms, "free_disk_gb", lambda path: 1.0)  # never enough: everything removable goes
    room = ms.make_room(work, 10**9, keep={work.model, work.endpoint("merged-RAWINT4")})
    assert not room["fits"] and sorted(Path(p).name for p in room["removed"]) == ["model-view-a", "x"]
    assert work.model.is_dir() and (work.root / "endpoints/merged-RAWINT4/model-view-b").is_dir()


def test_views_in_ram_leave_the_disk_to_the_base_and_its_merge(tmp_path: Path, monkeypatch) -> None:
    """VIEW_ROOT on another filesystem (a tmpfs): the disk holds the base and its merge, the views go there, a
    64 GiB disk takes depth 2; room for a view is made on the views' filesystem, never by removing a merge."""
    assert ms.choose_depth(60) == 1 and ms.choose_depth(60, 70) == 2 and ms.choose_depth(60, 40) == 1
    assert ms.choose_depth(240, 240) == 3 and ms.choose_depth(20, 240) is None
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no /dev/shm on a filesystem of its own here")
    views = Path(tempfile.mkdtemp(prefix="ktflow-views-", dir=shm))
    try:
        monkeypatch.setenv(ms.VIEW_ROOT_ENV, str(views))
        work = _work(tmp_path, monkeypatch)
        assert work.endpoint("base") == views / f"moe{work.moe_layers}" / "base" and ms.views_elsewhere()
        for d in ("base/model-view-a", "merged-RAWINT4/model-view-b"):
            (work.endpoints / d).mkdir(parents=True)
        (work.sft_store / "merged" / "x").mkdir(parents=True)
        monkeypatch.setattr(ms, "free_disk_gb", lambda path: 1.0)
        room = ms.make_room(work, 10**9, keep={work.model, work.endpoint("merged-RAWINT4")},
                            on=work.endpoint("merged-RAWINT4"))
        assert [Path(p).name for p in room["removed"]] == ["model-view-a"]
        assert (work.sft_store / "merged" / "x").is_dir() and (work.endpoints / "merged-RAWINT4/model-view-b").is_dir()
    finally:
        shutil.rmtree(views, ignore_errors=True)


def test_gpu_experts_wait_for_the_marlin_kernel_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU-experts lever starts only where `run.sh serve-jit` built sglang's Marlin MoE kernel into the JIT cache
    (its first build is minutes of nvcc inside the server's CUDA-graph capture)."""
    monkeypatch.delenv("TVM_FFI_CACHE_DIR", raising=False)
    assert not ms.marlin_built()
    monkeypatch.setenv("TVM_FFI_CACHE_DIR", str(tmp_path))
    assert not ms.marlin_built()
    (tmp_path / "sgl_kernel_jit_moe_wna16_marlin_bf16_t_0123").mkdir()
    assert ms.marlin_built()


def test_a_load_step_runs_the_servers_only_names_and_refuses_a_typo() -> None:
    assert ms.load_servers(None) == ["lora", "merged", "base"] and ms.load_servers("base,lora") == ["base", "lora"]
    with pytest.raises(SystemExit, match=r"\['bsae'\] are not servers of the load step"):
        ms.load_servers("bsae")


def test_a_check_step_runs_the_servers_only_names_and_refuses_one_the_fixture_has_not() -> None:
    """`ONLY=merged-BF16,merged-AMXINT8 run.sh merged-check-bf16` skips a LoRA path measured before; a label of
    another fixture (or a typo) stops the step before any server starts, naming the labels it knows."""
    assert ms.check_variants("bf16", None) == ms.CHECK_VARIANTS["bf16"]
    assert ms.check_variants("bf16", "merged-AMXINT4,merged-BF16") == [("merged-BF16", "BF16"),
                                                                        ("merged-AMXINT4", "AMXINT4")]
    with pytest.raises(SystemExit, match=r"merged-RAWINT4.*not servers of the bf16 check"):
        ms.check_variants("bf16", "merged-RAWINT4")


def test_a_merged_rawint4_checkpoint_is_scored_as_the_bf16_it_decodes_to(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixture_dir) -> None:
    """The check's float32 score of a merged RAWINT4 server's weights: ktflow's merge and dequantize, then
    loss_check.py's base variant, all real on the CPU; the served difference split into the merge's rounding and
    the server's computation."""
    from ktflow.stages.dequantize import dequantize_checkpoint
    from ktflow.stages.merge import merge_adapter

    base = fixture_dir("kimi-k2.5")
    adapter = ms.random_converted_adapter(base, tmp_path / "adapter")
    merged = tmp_path / "merged"
    merge_adapter(base, adapter, merged, method="RAWINT4", fsync=False)
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([{"input_ids": [1, 2, 3, 4, 5, 6], "labels": [-100, -100, 3, 4, 5, 6]}] * 2))
    monkeypatch.setattr(ms, "REFERENCE_PYTHON", sys.executable)
    work = _work(tmp_path, monkeypatch)
    got = {"endpoint": {"merged_dir": str(merged)}, "served_loss": {"loss": 7.0}}
    fp32 = ms.merged_weights_loss(work, got, "RAWINT4", adapter, tokens, reference=6.0)
    assert "error" not in fp32, fp32
    assert math.isfinite(fp32["loss"]) and fp32["rounding"] == pytest.approx(fp32["loss"] - 6.0)
    assert fp32["server"] == pytest.approx(7.0 - fp32["loss"])
    # the merged weights were scored, not the base's: the same scoring of the base (its exact BF16) differs
    plain = tmp_path / "base-bf16"
    dequantize_checkpoint(base, plain, fsync=False)
    base_got = {**got, "endpoint": {"merged_dir": str(plain)}}
    assert abs(ms.merged_weights_loss(work, base_got, "BF16", adapter, tokens, reference=6.0)["loss"]
               - fp32["loss"]) > 1e-3
    broken = {**got, "endpoint": {"merged_dir": str(tmp_path / "missing")}}
    assert "dequantize exited" in ms.merged_weights_loss(work, broken, "RAWINT4", adapter, tokens,
                                                         reference=6.0)["error"]


def test_a_zero_b_adapter_adds_nothing_and_keeps_the_rest(tmp_path: Path, fixture_dir) -> None:
    """The LoRA path of a merged checkpoint is served with the adapter's every B zeroed: its A, config and file
    metadata kept, its manifest (the trained adapter's) left out, remade from the adapter each time."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    adapter = ms.random_converted_adapter(fixture_dir("bf16"), tmp_path / "converted")
    (adapter / "manifest.json").write_text("{}")
    zero = ms.zero_b_adapter(adapter, tmp_path / "zero")
    before, after = load_file(str(adapter / "adapter_model.safetensors")), load_file(str(zero / "adapter_model.safetensors"))
    assert before.keys() == after.keys() and any(k.endswith(".lora_B.weight") for k in after)
    for key, tensor in after.items():
        assert tensor.dtype == before[key].dtype and tensor.shape == before[key].shape
        assert (tensor == 0).all() if key.endswith(".lora_B.weight") else (tensor == before[key]).all()
    assert (zero / "adapter_config.json").read_text() == (adapter / "adapter_config.json").read_text()
    assert not (zero / "manifest.json").exists() and not (tmp_path / "zero.tmp").exists()
    with safe_open(str(zero / "adapter_model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    (adapter / "adapter_config.json").write_text('{"r": 4}')  # another adapter at the same place: remade
    assert (ms.zero_b_adapter(adapter, tmp_path / "zero") / "adapter_config.json").read_text() == '{"r": 4}'
