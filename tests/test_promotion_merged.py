"""Promotion with merged serving (``serving.mode: merged``), end to end on the CPU: ktflow's promotion, judging,
merge and serve code for real against the stand-in sglang package (tests/fake_sglang; sglang-kt needs GPUs), as
tests/test_serve_sglang.py runs it.

A promoted version serves its merge (made by the merge stage, kept in the store, no LoRA flags); a candidate is
judged beside production through KT's LoRA path (no merge made for it), and one its gate rejects leaves
production's process and merge as they were; a rollback serves the previous version's merge from the store, or
rebuilds it when it was removed, and says which; a merge the disk has no room for removes the least recently
served merge no server reads.

The tests share one store and one production endpoint (the servers are the slow part); each first brings
production to the state it starts from through the same idempotent promotion, so any one of them runs alone."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from test_merge import make_converted_adapter
from test_serve_sglang import FAKE, REPO, free_port

from ktflow.host.hardware import GpuInfo, HostInfo, probe_host
from ktflow.recipe import Recipe, load_recipe
from ktflow.stages.merge import merge_target
from ktflow.stages.promotion import (
    judge_candidate,
    promote_version,
    register_adapter,
    registry_of,
    rollback,
    serving_dir,
)
from ktflow.stages.serve import read_endpoint, smoke_test, stop
from ktflow.store import StageManifest, atomic_write_json, read_manifest

KEY = "sglang-test-key-" + "m" * 16


@dataclass
class World:
    recipe: Recipe
    model: Path  # the base: adapters are trained on it, the merges are made of it, the LoRA path serves it
    host: HostInfo
    adapters: dict[int, Path]  # version -> converted adapter
    lines: list[str] = field(default_factory=list)  # everything ktflow logged

    @property
    def merges(self) -> Path:
        return self.recipe.store.root.absolute() / "merged"

    def merge_of(self, version: int) -> Path:
        return merge_target(self.recipe.store.layout, self.model, self.adapters[version], "BF16").absolute()

    def log(self, line: str) -> None:
        self.lines.append(line)

    def said(self, since: int) -> list[str]:
        return self.lines[since:]

    def promote(self, version: int, why: str = "ktflow promote"):
        return promote_version(self.recipe, version, model_dir=self.model, kt_weight_dir=self.model,
                               base_dir=self.model, why=why, log=self.log)

    def rollback(self):
        return rollback(self.recipe, model_dir=self.model, kt_weight_dir=self.model, base_dir=self.model, log=self.log)


def _converted(model: Path, out: Path, seed: int) -> Path:
    """A converted adapter as convert-lora publishes it (its manifest is its identity for the registry and the
    merge's cache key)."""
    make_converted_adapter(model, out, seed=seed)
    atomic_write_json(out / "manifest.json",
                      StageManifest(stage="convert-lora", inputs={"seed": str(seed)}).model_dump(mode="json"))
    return out


def _sft_run(root: Path, name: str) -> Path:
    root.joinpath(name).mkdir(parents=True)
    atomic_write_json(root / name / "manifest.json", StageManifest(stage="sft", inputs={"run": name}).model_dump(
        mode="json"))
    return root / name


@pytest.fixture(scope="module")
def world(fixture_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    import ktflow.resources
    from ktflow.demo import write_demo_dataset

    tmp = tmp_path_factory.mktemp("promotion")
    host = probe_host().model_copy(update={"gpus": [GpuInfo(index=0, name="test", vram_bytes=1 << 37)]})
    write_demo_dataset(tmp / "data")
    recipe = load_recipe(REPO / "recipes" / "qwen3-30b-a3b-bf16.yaml", [
        f"serving.port={free_port()}", f"store.root={tmp / 'store'}", f"toolchains.serve.python={sys.executable}",
        f"toolchains.serve.env.PYTHONPATH={FAKE}", "serving.ready_timeout_s=60", "serving.mem_fraction_static=0.3",
        "serving.mode=merged",
        f"dataset.files=[{tmp / 'data/train.jsonl'}]", "dataset.format=openai",
        f"evaluation.files=[{tmp / 'data/eval.jsonl'}]", "evaluation.format=openai",
        # a gate no candidate meets: rouge-l +100 over the base needs perfect answers from the candidate (the
        # stand-in answers "hello (v2) nya~") and none from the base
        "evaluation.gate_metric=rouge-l", "evaluation.gate_min_gain=100", "evaluation.candidate=beside"])
    model = fixture_dir("bf16")
    adapters = {}
    for seed in (1, 2):
        adapter = _converted(model, tmp / f"v{seed}", seed)
        version = register_adapter(recipe, adapter_dir=adapter, sft_adapter_dir=_sft_run(tmp / "sft", f"r{seed}"),
                                   base_dir=model)
        assert version.version == seed
        adapters[seed] = adapter.absolute()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KTFLOW_API_KEY", KEY)
        mp.setattr(ktflow.resources.hardware, "probe_host", lambda *a, **k: host)  # a GPU for the preflights
        try:
            yield World(recipe=recipe, model=model, host=host, adapters=adapters)
        finally:
            stop(serving_dir(recipe))


def _server_argv(log: Path) -> list[str]:
    """The argv of the last server started with ``log`` (a record directory's log is kept across restarts)."""
    line = [x for x in log.read_text().splitlines() if x.startswith("fake sglang argv: ")][-1]
    return json.loads(line.removeprefix("fake sglang argv: "))


def _served(world: World) -> tuple[list[str], Path, Path]:
    """Production's argv, and the merge its ``--model-path`` (a view sglang-kt can read) and ``--kt-weight-path``
    serve."""
    record = serving_dir(world.recipe)
    argv = _server_argv(record / "server.log")
    view = Path(argv[argv.index("--model-path") + 1])
    source = json.loads((view / "ktflow-model-view.json").read_text())["source"] if \
        (view / "ktflow-model-view.json").is_file() else str(view)
    return argv, Path(source), Path(argv[argv.index("--kt-weight-path") + 1])


def _assert_serves_merged(world: World, version: int) -> None:
    """Production is ``version``, served from its merge in the store with no LoRA flags."""
    endpoint = read_endpoint(serving_dir(world.recipe))
    merged = world.merge_of(version)
    assert endpoint is not None and endpoint.state == "ready" and psutil.Process(endpoint.pid).is_running()
    assert endpoint.adapter_version == version and endpoint.adapter_dir == world.adapters[version]
    assert endpoint.merged_dir == merged and merged.parent == world.merges
    assert read_manifest(merged).stage == "merge"
    assert registry_of(world.recipe).production().version == version
    argv, model_path, kt_weights = _served(world)
    assert "--enable-lora" not in argv and "--lora-paths" not in argv
    assert model_path == merged and kt_weights == merged
    assert endpoint.model == "qwen3-30b-a3b"  # the merged model is the served one: no adapter name
    assert smoke_test(endpoint.url, KEY, endpoint.model)["content"] == "hello"


def test_a_promoted_version_serves_its_merge(world: World) -> None:
    """Promoting v1 merges it into the base (the merge stage, published in the store) and starts production on
    the merge with no LoRA flags; promoting it again is a no-op."""
    since = len(world.lines)
    moved = world.promote(1)
    assert moved.version == 1
    _assert_serves_merged(world, 1)
    if moved.moved:  # this test ran first: v1's merge was made now
        assert any(line.startswith("merged weights made in") and str(world.merge_of(1)) in line
                   for line in world.said(since))
    again = world.promote(1)
    assert not again.moved and again.endpoint.pid == moved.endpoint.pid


def test_a_rejected_candidate_is_judged_through_the_lora_path_and_changes_nothing(world: World) -> None:
    """v2 is judged beside production in servers of its own, through KT's LoRA path (no merge is made for it);
    the gate rejects it; production is the same process serving the same merge of v1, and no v2 merge is left."""
    world.promote(1)
    shutil.rmtree(world.merge_of(2), ignore_errors=True)  # one an earlier test made (v1 serves: not in use)
    before = read_endpoint(serving_dir(world.recipe))
    merges_before = sorted(p.name for p in world.merges.iterdir())
    since = len(world.lines)

    judged = judge_candidate(world.recipe, 2, model_dir=world.model, serve_model_dir=world.model,
                             kt_weight_dir=world.model, host=world.host, log=world.log)

    assert judged.choice.mode == "beside" and not judged.accepted and judged.production_version == 1
    assert "not promoted" in judged.summary() and "production stays v1" in judged.summary()
    assert registry_of(world.recipe).get(2).verdict.status == "failed"
    evaluation = judged.evaluation
    assert {p["prediction"] for p in evaluation.tuned.predictions} == {"hello (v2) nya~"}  # the LoRA path answered
    assert {p["prediction"] for p in evaluation.production.predictions} == {"hello"}  # v1, merged
    out = world.recipe.store.layout.evaluation(world.recipe.name, 2).absolute()
    candidate_argv = _server_argv(out / "candidate-endpoint" / "server.log")
    assert "--enable-lora" in candidate_argv
    assert candidate_argv[candidate_argv.index("--lora-paths") + 1] == f"tuned={world.adapters[2]}"
    assert candidate_argv[candidate_argv.index("--kt-weight-path") + 1] == str(world.model)  # the base, unmerged
    assert not (out / "candidate-endpoint" / "endpoint.json").exists()  # stopped on the way out
    assert not [line for line in world.said(since) if line.startswith(("merging ", "merged weights "))]

    after = read_endpoint(serving_dir(world.recipe))
    assert after.pid == before.pid and after.run_id == before.run_id and after.merged_dir == before.merged_dir
    _assert_serves_merged(world, 1)
    assert sorted(p.name for p in world.merges.iterdir()) == merges_before  # no merge of v2 made or left
    assert not world.merge_of(2).exists()


def test_a_promotion_serves_the_new_merge_and_a_rollback_the_previous_one_kept_or_rebuilt(world: World) -> None:
    """Promoting v2 by hand (as `ktflow promote` does, whatever its verdict) swaps production onto v2's merge; a
    rollback serves v1's merge again, found in the store; with v1's merge deleted, a rollback rebuilds it and
    says it was made."""
    world.promote(1)
    since = len(world.lines)
    moved = world.promote(2)
    assert moved.moved and (moved.version, moved.replaced) == (2, 1)
    _assert_serves_merged(world, 2)
    assert world.merge_of(1).is_dir()  # the previous version's merge is kept
    assert any(line.startswith("merged weights made in") and str(world.merge_of(2)) in line
               for line in world.said(since))

    since = len(world.lines)
    back = world.rollback()
    assert back.moved and (back.version, back.replaced) == (1, 2)
    _assert_serves_merged(world, 1)
    said = world.said(since)
    assert f"merged weights found in the store: {world.merge_of(1)}" in said
    assert not any(line.startswith("merged weights made in") for line in said)  # nothing was rebuilt
    assert world.merge_of(2).is_dir()  # and v2's merge is kept in its turn

    world.promote(2)
    _assert_serves_merged(world, 2)
    shutil.rmtree(world.merge_of(1))  # the disk needed it: v1's merge is gone
    since = len(world.lines)
    back = world.rollback()
    assert back.moved and (back.version, back.replaced) == (1, 2)
    _assert_serves_merged(world, 1)
    said = world.said(since)
    made = [i for i, line in enumerate(said)
            if line.startswith("merged weights made in") and line.endswith(f" s: {world.merge_of(1)}")]
    swapping = [i for i, line in enumerate(said) if line.startswith(f"swapping {world.adapters[2]} -> ")]
    assert made and swapping and made[0] < swapping[0]  # rebuilt, and said so, while v2 still served
    assert not any(line.startswith("merged weights found in the store") for line in said[:made[0]])
    assert [m.to_version for m in registry_of(world.recipe).production().history][-5:] == [1, 2, 1, 2, 1]


def test_a_merge_that_does_not_fit_removes_the_least_recently_served_merge_no_server_reads(
        world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With room on the disk for two merges, promoting a third version removes the least recently served merge no
    server reads (never production's), says so, and serves the new merge; a rollback then finds production's former
    merge kept, and serving it marks it the most recently served."""
    import ktflow.store

    world.promote(1)
    world.promote(2)  # production v2; v1's merge kept beside it
    if 3 not in world.adapters:
        adapter = _converted(world.model, tmp_path / "v3", 3)
        version = register_adapter(world.recipe, adapter_dir=adapter, sft_adapter_dir=_sft_run(tmp_path / "sft", "r3"),
                                   base_dir=world.model)
        world.adapters[version.version] = adapter.absolute()
    os.utime(world.merge_of(2) / "manifest.json", (1, 1))  # production's merge served longest ago: still skipped
    os.utime(world.merge_of(1) / "manifest.json", (2, 2))
    one = sum(f.stat().st_size for f in world.merge_of(2).rglob("*") if f.is_file())
    real_free_bytes = ktflow.store.free_bytes

    def free_bytes(path: Path) -> int:  # a filesystem of 2.5 merges for the store's merges
        path = Path(path).absolute()
        if path != world.merges and world.merges not in path.parents:
            return real_free_bytes(path)
        return max(int(2.5 * one) - sum(f.stat().st_size for f in world.merges.rglob("*") if f.is_file()), 0)

    monkeypatch.setattr(ktflow.store, "free_bytes", free_bytes)
    since = len(world.lines)
    moved = world.promote(3)
    assert moved.moved and (moved.version, moved.replaced) == (3, 2)
    _assert_serves_merged(world, 3)
    said = world.said(since)
    assert any(line.startswith(f"removed the merge {world.merge_of(1)} (") for line in said)
    assert not world.merge_of(1).exists() and world.merge_of(2).is_dir()  # production's merge was never a candidate
    assert not list(world.merges.glob(".*.evicting"))

    since = len(world.lines)
    back = world.rollback()
    assert back.moved and (back.version, back.replaced) == (2, 3)
    _assert_serves_merged(world, 2)
    assert f"merged weights found in the store: {world.merge_of(2)}" in world.said(since)
    assert (world.merge_of(2) / "manifest.json").stat().st_mtime > 2  # served again: the last the store gives up
