"""Adapter versions, lineage and the production pointer (ktflow.registry), the candidate-mode
choice (ktflow.stages.promotion.choose_candidate_mode) and SGLang's beside-production candidate path.
Fast: no model is loaded; the SGLang server is a local one speaking its adapter API."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_sglang_swap import KEY, FakeSglang

from ktflow.errors import InvalidInputError
from ktflow.recipe import load_recipe
from ktflow.registry import JUDGING_MOVE, AdapterRegistry, Lineage, PendingMove, Trigger, Verdict
from ktflow.store import StageManifest, atomic_write_json

REPO = Path(__file__).resolve().parent.parent
GiB = 1 << 30


def _adapter(root: Path, name: str, weights: str = "w") -> Path:
    """A published adapter directory (its manifest digest is its identity)."""
    path = root / name
    path.mkdir(parents=True)
    (path / "adapter_model.safetensors").write_text(weights)
    manifest = StageManifest(stage="convert-lora", inputs={"adapter": weights})
    atomic_write_json(path / "manifest.json", manifest.model_dump(mode="json"))
    return path


def _lineage(root: Path, data: str = "d1") -> Lineage:
    return Lineage(base_digest="b" * 64, base_dir=root / "base", dataset_digest=data, recipe_digest="r" * 64,
                   sft_run=root / "run", sft_manifest_digest="s" * 64, trigger=Trigger(kind="cli", detail="test"))


def test_each_new_adapter_is_the_next_version_and_the_same_adapter_the_same_version(tmp_path: Path) -> None:
    registry = AdapterRegistry(tmp_path / "store", "demo")
    first = registry.register(_adapter(tmp_path, "a1", "one"), _lineage(tmp_path))
    again = registry.register(_adapter(tmp_path, "a1-copy", "one"), _lineage(tmp_path, "other"))
    second = registry.register(_adapter(tmp_path, "a2", "two"), _lineage(tmp_path, "d2"))
    assert (first.version, again.version, second.version) == (1, 1, 2)
    assert again.lineage.dataset_digest == "d1"  # the first registration's lineage is kept
    assert [v.label for v in registry.versions()] == ["v1", "v2"]
    assert registry.get(2).lineage.trigger.kind == "cli"
    with pytest.raises(InvalidInputError, match=r"demo v7: no such adapter version \(the recipe has: v1, v2\)"):
        registry.get(7)
    with pytest.raises(InvalidInputError, match="holds no manifest.json"):
        registry.register(tmp_path, _lineage(tmp_path))


def test_concurrent_registrations_never_share_a_number(tmp_path: Path) -> None:
    registry = AdapterRegistry(tmp_path / "store", "demo")
    adapters = [_adapter(tmp_path, f"a{i}", f"w{i}") for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        versions = list(pool.map(lambda a: registry.register(a, _lineage(tmp_path)).version, adapters))
    assert sorted(versions) == list(range(1, 9))


def test_the_production_pointer_moves_keeps_its_history_and_knows_where_rollback_goes(tmp_path: Path) -> None:
    registry = AdapterRegistry(tmp_path / "store", "demo")
    for i in (1, 2, 3):
        registry.register(_adapter(tmp_path, f"a{i}", f"w{i}"), _lineage(tmp_path))
    with pytest.raises(InvalidInputError, match="nothing was promoted yet"):
        registry.rollback_target()
    registry.finish_move(1, "first")
    with pytest.raises(InvalidInputError, match="only v1 was ever promoted"):
        registry.rollback_target()
    registry.begin_move(PendingMove(from_version=1, to_version=2, why="gate passed", model_dir=tmp_path))
    assert registry.pending() is not None and registry.pending().to_version == 2
    production = registry.finish_move(2, "gate passed")
    assert (production.version, production.previous) == (2, 1) and registry.pending() is None
    assert registry.rollback_target().version == 1
    assert registry.finish_move(2, "again").history == production.history  # idempotent: no new move
    cleared = registry.clear_production("swap mode: v3 failed")
    assert cleared.version is None and cleared.previous == 1
    assert [(m.from_version, m.to_version) for m in cleared.history] == [(None, 1), (1, 2), (2, None)]
    registry.record_verdict(3, Verdict(status="failed", summary="style +0.00 < +50.00", mode="beside"))
    assert registry.get(3).verdict.status == "failed"


# --------------------------------------------------------------------------- candidate mode


def _host(ram_gib: float, gpus: int = 0, vram_gib: float = 141):
    from ktflow.host.hardware import GpuInfo, HostInfo, NumaNode

    ram = int(ram_gib * GiB)
    return HostInfo(hostname="box", cpu_model="test", cpu_flags=[], cpu_variant="avx512_bf16",
                    cpu_variant_overridden=False, logical_cores=2, physical_cores=2, numa_nodes=1,
                    numa=[NumaNode(id=0, cpus=[0, 1], mem_total_bytes=ram, mem_free_bytes=ram)], ram_bytes=ram,
                    ram_available_bytes=ram, disk_path="/store", disk_free_bytes=100 * GiB,
                    gpus=[GpuInfo(index=i, name="H200", vram_bytes=int(vram_gib * GiB)) for i in range(gpus)],
                    shm_bytes=GiB, shm_free_bytes=GiB)


def _sizes(parameters: int, kt_weight_bytes: int = 0):
    from ktflow.planning.sizing import ModelSize
    from ktflow.stages.serve import ServeSizes

    return ServeSizes(model=ModelSize(path="m", parameters=parameters, hidden_size=8, num_layers=1, vocab_size=8,
                                      linear_shapes={}), kt_weight_bytes=kt_weight_bytes)


@pytest.mark.parametrize(("recipe", "ram_gib", "running", "mode", "says"), [
    # LlamaFactory's CPU server: judging beside starts two more (the candidate's and the base model's), each the
    # model in BF16 again (8 GiB here); swap one (the base model's).
    ("tiny-demo", 20, True, "beside", "two more servers, the candidate's and the base model's, each with the model "
                                      "in BF16"),  # 16 more fit in 20 free
    ("tiny-demo", 12, True, "offline", "nothing fits beside production (judging the candidate needs ~16"),
    ("tiny-demo", 12, False, "swap", "; production: the model in BF16"),  # planned: 16 + 8 and 8 + 8 exceed 12
    ("tiny-demo", 6, True, "swap", "the candidate serves in production's place"),
    # sglang-kt (one adapter, loaded at start-up): beside is a second sglang-kt process (and one for the base
    # model), each with its own copy of the CPU experts (40 GiB here); else offline when the model fits in RAM
    # in BF16, else swap.
    ("kimi-k2.5-rawint4", 96, True, "beside", "two more servers, the candidate's and the base model's, each with "
                                              "the CPU experts as RAWINT4"),
    ("kimi-k2.5-rawint4", 64, True, "offline", "nothing fits beside production (judging the candidate needs ~80"),
    ("kimi-k2.5-rawint4", 6, True, "swap", "nor offline generation"),
])
def test_unset_candidate_mode_is_chosen_from_the_hosts_memory_and_says_why(recipe, ram_gib, running, mode,
                                                                             says) -> None:
    from ktflow.stages.serve import choose_candidate_mode

    recipe = load_recipe(REPO / f"recipes/{recipe}.yaml")
    choice = choose_candidate_mode(recipe, _sizes(4 * GiB, 40 * GiB), _host(ram_gib), production_running=running)
    assert choice.mode == mode and says in choice.reason, choice
    assert [p.mode for p in choice.prices] == ["beside", "offline", "swap"]
    assert [p.servers for p in choice.prices] == [2, 0, 1]
    if mode != "swap":  # chosen because it fits (swap is what is left when nothing does)
        assert choice.problem is None and {p.mode: p for p in choice.prices}[mode].problem is None


def test_the_recipes_candidate_mode_wins_and_a_shortfall_is_named() -> None:
    from ktflow.stages.serve import choose_candidate_mode

    recipe = load_recipe(REPO / "recipes/tiny-demo.yaml", ["evaluation.candidate=beside"])
    choice = choose_candidate_mode(recipe, _sizes(4 * GiB), _host(6), production_running=True)
    assert choice.mode == "beside" and choice.reason.startswith("set by evaluation.candidate (though ")
    assert "judging the candidate needs ~16" in choice.reason and choice.ram_bytes == 16 * GiB
    assert choice.problem is not None and choice.problem in choice.reason


@pytest.mark.parametrize(("overrides", "vram_gib", "fits", "says"), [
    # kimi-k2.5-rawint4 served on 4 GPUs, mem_fraction_static 0.75; 32 GiB of non-expert BF16 weights: 8 GiB per GPU.
    # production takes 0.75 of each GPU, the candidate's server 0.75 of the rest, the base model's 0.75 of that:
    # 0.75 * 0.25^2 * 141 = 6.6 GiB < 8.
    ([], 141, False, "leaves the last one 6.61 GiB, less than its non-expert weights in BF16 (8.00 GiB)"),
    (["serving.mem_fraction_static=0.4"], 141, True, ""),  # 0.4 * 0.6^2 * 141 = 20.3 GiB
    (["serving.mem_fraction_static=null"], 141, False, "serving.mem_fraction_static is unset"),
    ([], 0, True, ""),  # a host without GPUs (a plan for the CPU side): GPU memory is not what is judged here
])
def test_a_second_sglang_kt_server_must_fit_the_gpu_memory_production_leaves(overrides, vram_gib, fits,
                                                                              says) -> None:
    from ktflow.stages.serve import candidate_prices

    recipe = load_recipe(REPO / "recipes/kimi-k2.5-rawint4.yaml", ["serving.gpus=4", *overrides])
    host = _host(4096, gpus=4 if vram_gib else 0, vram_gib=vram_gib)
    beside, offline, swap = candidate_prices(recipe, _sizes(16 * GiB, 40 * GiB), host, production_running=True)
    assert (beside.problem is None) == fits and says in (beside.problem or ""), beside
    assert beside.gpu_bytes == 2 * 8 * GiB and beside.ram_bytes == 2 * 40 * GiB  # two servers' worth, per GPU
    assert offline.problem is None and offline.gpu_bytes == 0 and offline.servers == 0
    assert swap.servers == 1 and swap.gpu_bytes == 8 * GiB
    assert "the candidate takes production traffic while judged" in swap.brief()


def test_a_1t_kt_recipe_on_its_host_is_judged_by_swap_and_the_plan_says_so() -> None:
    """Kimi-K2.5 on a 2 x 48-core host with 1.5 TB: the CPU experts take most of the RAM; neither a
    second sglang-kt server nor BF16 generation fits beside production."""
    from ktflow.plan import plan_recipe

    recipe = load_recipe(REPO / "recipes/kimi-k2.5-rawint4.yaml")
    host = _host(1536)
    plan = plan_recipe(recipe, host)
    [evaluate] = [s for s in plan.stages if s.stage == "evaluate"]
    assert "candidate judged swap" in evaluate.reason and "nothing fits beside production" in evaluate.reason
    assert evaluate.fits
    # every mode priced: beside is two more sglang-kt processes (the candidate's, the base model's), each with
    # its own copy of the CPU experts; swap one (the base model's, beside the candidate in production's place)
    beside, offline, swap = evaluate.candidate_prices
    assert beside.startswith("beside: +1.0 TiB RAM") and "2 more servers: does not fit" in beside
    assert offline.startswith("offline: +1.9 TiB RAM") and "does not fit" in offline
    assert swap.startswith("swap: +531.6 GiB RAM") and swap.endswith("the candidate takes production traffic while "
                                                                      "judged: fits")
    assert abs(evaluate.ram_bytes / GiB - 531.6) < 0.1  # the chosen mode's cost
    dynamic = load_recipe(REPO / "recipes/kimi-k2.5-rawint4.yaml", ["serving.dynamic_lora=true"])
    [evaluate] = [s for s in plan_recipe(dynamic, host).stages if s.stage == "evaluate"]
    assert "candidate judged beside" in evaluate.reason, evaluate.reason


# --------------------------------------------------------------------------- SGLang: a second adapter name


def _sglang_with_production() -> FakeSglang:
    """SGLang serving production as "tuned": base, production and candidate answer differently (the
    candidate never in the recipe's style)."""
    fake = FakeSglang(answer=lambda adapter, prompt: {"": f"base: {prompt}", "tuned": f"{prompt} nya~"}.get(
        adapter, f"candidate: {prompt}"))
    fake.loaded["tuned"] = "/adapters/production"
    return fake


def test_sglang_judges_a_candidate_under_a_second_adapter_name_and_unloads_it(tmp_path: Path) -> None:
    from ktflow.demo import write_demo_dataset
    from ktflow.stages.evaluate import Candidate, evaluate_candidate
    from ktflow.stages.serve import Endpoint

    key = KEY
    fake = _sglang_with_production()
    write_demo_dataset(tmp_path / "data")
    recipe = load_recipe(REPO / "recipes/kimi-k2.5-rawint4.yaml", [
        "serving.dynamic_lora=true", "serving.served_model_name=kimi", f"dataset.files=[{tmp_path / 'data/train.jsonl'}]",
        "dataset.format=openai", f"evaluation.files=[{tmp_path / 'data/eval.jsonl'}]", "evaluation.format=openai",
        "evaluation.style={marker: 'nya~'}", "evaluation.gate_metric=style", "evaluation.gate_min_gain=50"])
    production = Endpoint(url=f"{fake.url}/v1", backend="sglang", served_model_name="kimi",
                          adapter_model_name="kimi:tuned", pid=1, log_path=tmp_path / "log", adapter_dir=None,
                          adapter_manifest_digest=None, started_at="now")
    try:
        result = evaluate_candidate(recipe, mode="beside", model_dir=tmp_path, serve_model_dir=tmp_path,
                                    candidate=Candidate(version=2, adapter_dir=tmp_path / "v2"), production=production,
                                    production_version=1, api_key=key, out_dir=tmp_path / "eval")
    finally:
        fake.server.shutdown()
    assert fake.loaded == {"tuned": "/adapters/production"}  # the candidate is gone, production untouched
    assert result.tuned.model == "kimi:tuned-candidate-v2" and result.base.model == "kimi"
    assert result.production is not None and result.production.model == "kimi:tuned"
    # Production carries the style on every prompt, the candidate on none: it is not promoted.
    assert result.production.metrics["style"] == 100.0 and result.tuned.metrics["style"] == 0.0
    assert result.adapter_applied and not result.promoted
    assert "| style ('nya~') | 0.00 | 0.00 | +0.00 | 100.00 |" in result.table
    assert "production (v1)" in result.table.splitlines()[0]
    assert "Candidate v2, judged beside production" in result.report_md.read_text()


def test_a_candidate_sglang_refuses_to_load_changes_nothing(tmp_path: Path) -> None:
    from ktflow.errors import EvaluationError
    from ktflow.stages.serve import dynamic_adapter

    key = KEY
    fake = _sglang_with_production()
    fake.loaded["tuned-candidate-v2"] = "squatter"
    try:
        with pytest.raises(EvaluationError, match=r"HTTP 400.*production is untouched"):
            with dynamic_adapter(fake.url, key, "tuned-candidate-v2", tmp_path):
                pass
    finally:
        fake.server.shutdown()
    assert fake.loaded == {"tuned": "/adapters/production", "tuned-candidate-v2": "squatter"}


def test_rollback_skips_a_candidate_that_served_only_to_be_judged_and_failed(tmp_path: Path) -> None:
    registry = AdapterRegistry(tmp_path / "store", "demo")
    for i in (1, 2, 3):
        registry.register(_adapter(tmp_path, f"a{i}", f"w{i}"), _lineage(tmp_path))
    for version in (1, 2):
        registry.finish_move(version, "promoted")
    registry.finish_move(3, JUDGING_MOVE)  # swap mode: v3 serves to be judged
    registry.record_verdict(3, Verdict(status="failed", summary="style +0.00 < +50.00", mode="swap"))
    registry.finish_move(2, "swap mode: v3 failed its gate")  # v2 restored
    assert registry.rollback_target().version == 1  # not v3, which production pointed at in between
    registry.finish_move(3, "ktflow promote")  # promoted by hand, failed verdict or not: it counts
    registry.finish_move(2, "ktflow promote")
    assert registry.rollback_target().version == 3


def test_a_version_trained_on_another_base_is_refused_before_the_server_is_touched(tmp_path: Path) -> None:
    from ktflow.errors import AdapterError
    from ktflow.stages.promotion import promote_version

    recipe = load_recipe(REPO / "recipes/tiny-demo.yaml", [f"store.root={tmp_path / 'store'}"])
    registry = AdapterRegistry(recipe.store.root, recipe.name)
    registry.register(_adapter(tmp_path, "a1", "w1"), _lineage(tmp_path))
    other = _lineage(tmp_path).model_copy(update={"base_digest": "c" * 64, "base_dir": tmp_path / "other-base"})
    registry.register(_adapter(tmp_path, "a2", "w2"), other)
    registry.finish_move(1, "promoted")
    with pytest.raises(AdapterError, match=r"demo v2: was trained on base cccccccccccc \(.*other-base\), not on v1's "
                                           r"base \(bbbbbbbbbbbb\)"):
        promote_version(recipe, 2, model_dir=tmp_path / "model")
    assert registry.production().version == 1 and registry.pending() is None
    assert not (recipe.store.root / "serving").exists()  # nothing was started, stopped or recorded
