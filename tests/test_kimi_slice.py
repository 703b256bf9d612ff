"""gpu_host/kimi_slice.py's harness on the CPU: which adapter a depth converts and serves (the store holds every
depth's runs), the whole-model plan it saves (``ktflow plan``'s plan_recipe, calibrated from the store), and the
run.sh steps that call it. The KT runs themselves need the GPU host (benchmarks/data/kimi-slice)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "gpu_host"))

import kimi_slice  # noqa: E402


def work(moe_layers: int, threads: int | None = None) -> kimi_slice.SliceWork:
    return kimi_slice.SliceWork(argparse.Namespace(moe_layers=moe_layers, python=sys.executable, ktflow_python=None,
                                                   set=None, gpus=1, threads=threads, serve_python=sys.executable))


def test_each_depth_has_its_model_and_results_and_all_share_one_store() -> None:
    three, six = work(3), work(6)
    assert three.model != six.model and three.results != six.results
    assert three.sft_store == six.sft_store == kimi_slice.SLICE / "store"
    assert six.recipe.name == "slice-kt-rawint4.yaml" and six.serve_recipe.name == "slice-sglang-rawint4.yaml"
    sets = dict(s.split("=", 1) for s in six.sets(six.sft_store))
    assert sets["source.local_path"] == str(six.model) and sets["dataset.files"] == f"[{kimi_slice.DATA}]"
    threads = work(3, threads=16)
    assert threads.sft_name == "sft-t16" and threads.sft_store == kimi_slice.SLICE / "store-t16"


def test_a_depth_converts_and_serves_its_own_adapter_not_the_newest(tmp_path: Path) -> None:
    three, six = work(3), work(6)
    store = tmp_path / "store"
    for name, model in (("a", six.model), ("b", three.model)):  # depth 3 trained last
        adapter = store / "runs" / name / "adapter"
        adapter.mkdir(parents=True)
        (adapter / "manifest.json").write_text("{}")
        (adapter.parent / "train.yaml").write_text(f"model_name_or_path: {model}\n")
        time.sleep(0.01)
    os.utime(store / "runs/b/adapter", (time.time() + 5, time.time() + 5))
    assert six.published(store) == store / "runs/a/adapter"
    assert three.published(store) == store / "runs/b/adapter"
    assert work(9).published(store) is None


def test_whole_model_plan_is_ktflows_for_the_kimi_recipe(fixture_dir, tmp_path: Path) -> None:
    """Every variant on 1 GPU and on the host's GPUs, the whole model's size (not the slice's), RAM as if enough."""
    from ktflow.host.hardware import probe_host

    host = probe_host().model_copy(update={"ram_bytes": kimi_slice.AMPLE_RAM, "ram_available_bytes": kimi_slice.AMPLE_RAM,
                                           "gpus": []})
    path = tmp_path / "host.json"
    path.write_text(host.model_dump_json())
    data = tmp_path / "chat.jsonl"  # records of ~100+ tokens, as the slice's chat-data
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Question {i}: how do experts run on the CPU? " * 4},
        {"role": "assistant", "content": f"Answer {i}: beside the GPU, nya~ " * 8}]}) + "\n" for i in range(16)))
    rows = kimi_slice.plan_whole(path, tmp_path / "store", fixture_dir("kimi-k2.5"), data)
    assert [(r["variant"], r["gpus"]) for r in rows] == [(v, 1) for v in kimi_slice.WHOLE_VARIANTS]
    by = {r["variant"]: r for r in rows}
    for row in rows:
        assert row["step_s"] > 0 and row["ram_gib"] > 530  # 571 GB of INT4 experts in RAM
        assert "not yet calibrated on this host" in row["time_basis"]  # no slice run in this store
    assert "counted with the model's tokenizer" in by["as-the-slice-trains"]["time_basis"]
    assert "counted as cutoff_len 4096" in by["as-the-recipe-ships"]["time_basis"]
    assert "2,048 tokens a micro-batch" in by["as-the-seeds-guide"]["time_basis"]
    assert by["as-the-recipe-ships"]["step_s"] > by["as-the-seeds-guide"]["step_s"]
    json.dumps(rows)  # what whole.json holds


def test_run_sh_has_a_step_for_each_phase() -> None:
    text = (REPO / "gpu_host" / "run.sh").read_text()
    for step in ("slice-fixture-*", "slice-sft-*", "slice-whole", "slice-convert-*", "slice-serve-prep-*",
                 "slice-serve-*", "slice-clean-*", "pack-slice"):
        assert f"    {step})" in text, step
    # the longer patterns first: slice-serve-prep-6 is not slice-serve-*'s "prep-6"
    assert text.index("    slice-serve-prep-*)") < text.index("    slice-serve-*)")
    assert set(kimi_slice.PHASES) >= {"fixture", "sft", "convert", "whole", "serve-prep", "serve", "clean"}


@pytest.mark.parametrize("argv", [["sft", "--moe-layers", "3"], ["whole"]])
def test_cli_parses(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def phase(work: kimi_slice.SliceWork) -> int:
        seen["work"] = work
        return 0

    monkeypatch.setitem(kimi_slice.PHASES, argv[0], phase)
    assert kimi_slice.main(argv) == 0
    assert seen["work"].moe_layers == (3 if argv[0] == "sft" else 6)


def test_seeds_json_is_what_plan_seeds_gives_now(tmp_path: Path) -> None:
    """benchmarks/data/kimi-slice/seeds.json is ``kimi_slice.py seeds``'s output with the constants ktflow ships:
    rerun it after changing them (the README's seed table quotes it)."""
    docs = REPO / "benchmarks" / "data" / "kimi-slice"
    rows = kimi_slice.plan_seeds(docs / "host.json", tmp_path / "hosts")
    assert json.loads((docs / "seeds.json").read_text()) == json.loads(json.dumps({"plans": rows}))
    for row in rows:
        host = json.loads((tmp_path / "hosts" / f"{row['host']}.json").read_text())
        assert host["physical_cores"] == 96 and host["numa_nodes"] == 2 and len(host["gpus"]) == row["gpus"]
        assert row["step_s"] and row["step_s"] > 0
    deepseek = next(r for r in rows if r["what"].startswith("deepseek"))
    assert deepseek["tokens_per_step"] == 8192  # KT's user guide: qlen 512 x GAS 16
    assert deepseek["ram_gib"] > 2 * 653.9e9 / 2**30  # BF16 experts, as the seeds trained them


def test_deepseek_v3_size_block_is_its_671b() -> None:
    from ktflow.recipe import load_recipe

    size = load_recipe(REPO / "recipes" / "deepseek-v3-fp8.yaml").source.size
    assert round(size.parameters / 1e9) == 671 and size.expert_parameters == 58 * 256 * 3 * 7168 * 2048


def test_the_whole_models_plan_counts_records_with_any_depths_tokenizer(tmp_path: Path) -> None:
    for depth in (3, 6):
        (tmp_path / f"moe{depth}" / "model").mkdir(parents=True)
    assert kimi_slice.slice_tokenizer(tmp_path / "moe6" / "model", tmp_path) is None  # none on disk: ~4 B a token
    (tmp_path / "moe3" / "model" / "tokenizer.json").write_text("{}")
    assert kimi_slice.slice_tokenizer(tmp_path / "moe6" / "model", tmp_path) == tmp_path / "moe3" / "model"
    (tmp_path / "moe6" / "model" / "tokenizer.json").write_text("{}")
    assert kimi_slice.slice_tokenizer(tmp_path / "moe6" / "model", tmp_path) == tmp_path / "moe6" / "model"
