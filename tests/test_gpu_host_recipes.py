"""The bigger-than-GPU run's pieces that can be checked without a GPU: its two recipes (the same run
but for the backend; what the KT one renders passes LlamaFactory-kt and kt-kernel), run.sh's syntax,
and gpu_host/big.py's harness, rehearsed for real on the CPU at reduced size with the plain backend
(fixture, measured sft, kill -9, resume, the plain-LlamaFactory attempt). The KT phases themselves
run on the GPU host (tests/test_gpu_host.py -k big)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
GPU_HOST = REPO / "gpu_host"
TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"
KT_PYTHON = REPO / ".venv-kt-train" / "bin" / "python"
sys.path.insert(0, str(GPU_HOST))


def test_hf_recipe_is_the_kt_recipe_without_the_kt_fields() -> None:
    """The refused plain run and the KT run train the same thing; only the backend may differ."""
    kt = yaml.safe_load((GPU_HOST / "big-kt-rawint4.yaml").read_text())
    hf = yaml.safe_load((GPU_HOST / "big-hf.yaml").read_text())
    assert kt["sft"].pop("backend") == "kt" and hf["sft"].pop("backend") == "hf"
    kt_only = {k for k in kt["sft"] if k.startswith("kt_") or k == "fsdp_offload_params"}
    assert kt_only == {"kt_config", "kt_cpu_activation", "fsdp_offload_params"}  # FSDP is the KT launcher's
    for key in kt_only:
        kt["sft"].pop(key)
    kt.pop("description"), hf.pop("description")
    assert kt == hf


def test_the_kt_recipe_follows_the_rawint4_recipe_that_ran_on_the_host() -> None:
    from ktflow.recipe import load_recipe

    big, tiny = load_recipe(GPU_HOST / "big-kt-rawint4.yaml").sft, load_recipe(GPU_HOST / "tiny-kt-rawint4.yaml").sft
    same = ("backend", "gpus", "template", "lora_rank", "lora_alpha", "lora_dropout", "lora_target", "bf16",
            "disable_gradient_checkpointing", "fsdp_offload_params", "kt_cpu_activation")
    assert {k: getattr(big, k) for k in same} == {k: getattr(tiny, k) for k in same}
    assert big.kt_config.model_dump(exclude={"kt_num_threads", "kt_model_max_length"}) == \
        tiny.kt_config.model_dump(exclude={"kt_num_threads", "kt_model_max_length"})
    assert big.max_steps >= 5 and big.save_steps <= 2 and big.per_device_train_batch_size * big.cutoff_len <= 1024


@pytest.mark.slow
@pytest.mark.skipif(not KT_PYTHON.exists(), reason="KT training toolchain not installed (make kt-train-env)")
def test_what_the_kt_recipe_renders_passes_llamafactory_kt_and_kt_kernel() -> None:
    from test_sft_kt import check_in_kt_toolchain

    done = subprocess.run([sys.executable, "-m", "ktflow.cli", "sft", str(GPU_HOST / "big-kt-rawint4.yaml"), "--dry-run",
                           "--json"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    [result] = check_in_kt_toolchain([json.loads(done.stdout)["train_config"]])
    assert result["ok"], result.get("error")
    assert result["kt"]["kt_backend"] == "RAWINT4" and result["kt"]["kt_lora_rank"] == 8


def test_run_sh_parses_and_names_every_big_step() -> None:
    assert subprocess.run(["bash", "-n", str(GPU_HOST / "run.sh")]).returncode == 0
    text = (GPU_HOST / "run.sh").read_text()
    for step in ("fixture-big", "sft-big", "hf-big", "convert-big", "kill-big", "resume-big", "big-reduced"):
        assert f"    {step})" in text, step
    # the big steps come before convert-* (which would take convert-big for step_convert "big")
    assert text.index("    convert-big)") < text.index("    convert-*)")


def test_step_figures_leave_the_checkpoint_saves_out_of_the_plain_step() -> None:
    from big import _step_figures

    # steps 1..6, a save after 2 and 4: the intervals 2->3 and 4->5 carry it (+5 s)
    times = [30.0, 32.0, 39.0, 41.0, 48.0, 50.0]
    result = {"steps_logged": [1, 2, 3, 4, 5, 6], "step_logged_at_s": times, "tokens_logged": [100, 200, 300, 400, 500, 600]}
    figures = _step_figures(result, save_steps=2)
    assert figures["steady_step_no_save_s"] == 2.0 and figures["steady_step_with_save_s"] == 7.0
    assert figures["tokens_per_s_no_save"] == 50.0
    assert figures["step_intervals_s"] == [2.0, 7.0, 2.0, 7.0, 2.0]


def test_step_figures_skip_two_log_lines_seen_in_one_poll() -> None:
    """The 6-MoE-layer Kimi slice's run logged two steps between two polls: no interval between them (it raised
    ZeroDivisionError after the run, and the run's figures were lost)."""
    from big import _step_figures

    result = {"steps_logged": [1, 2, 3, 4, 5], "step_logged_at_s": [20.0, 40.0, 60.0, 78.0, 78.0],
              "tokens_logged": [100, 200, 300, 400, 500]}
    figures = _step_figures(result, save_steps=1000)
    assert figures["steady_step_no_save_s"] == 19.0 and figures["tokens_per_s_no_save"] == 5.3


@pytest.mark.slow
@pytest.mark.skipif(not TRAIN_PYTHON.exists(), reason="training toolchain not installed (make train-env)")
def test_big_harness_rehearsed_on_the_cpu_at_reduced_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu_host/big.py for real, on the CPU, the plain backend standing in for KT (which needs a GPU)."""
    import big

    monkeypatch.setattr(big, "BUILD", tmp_path)
    common = ["--size", "reduced", "--python", str(TRAIN_PYTHON), "--ktflow-python", sys.executable,
              "--set", "sft.gpus=0"]

    def phase(*argv: str) -> dict:
        monkeypatch.setattr(sys, "argv", ["big.py", *argv, *common])
        assert big.main() == 0, argv
        return json.loads((tmp_path / "big-reduced/results" / f"{argv[0]}.json").read_text())

    fixture = phase("fixture")
    assert fixture["made"]["outcome"] == "ok" and fixture["dims"]["hidden_size"] == 1024
    assert fixture["parameters"] > 60e6 and fixture["data_records"] == 48
    sft = phase("sft", "--trainer", "hf")
    assert sft["outcome"] == "trained" and sft["steps"] == 4 and sft["prelaunch_s"] > 0 and sft["post_s"] >= 0
    assert "error" not in sft["predicted"] and sft["predicted"]["ram_gib"] > 0, sft["predicted"]  # ktflow plan, before
    assert not list((tmp_path / "big-reduced/store").glob("runs/*/output/checkpoint-*"))  # pruned after collecting
    assert (tmp_path / "big-reduced/results/run-sft/trainer_log.jsonl").is_file()
    kill = phase("kill", "--trainer", "hf")
    assert kill["outcome"] == "killed after checkpoint-1" and "checkpoint-1" in kill["output_listing"]
    resume = phase("resume", "--trainer", "hf")
    assert resume["outcome"] == "trained" and resume["resumed_from"].endswith("checkpoint-1")
    assert resume["vs_uninterrupted"]["steps"] == [1, 2, 3, 4]
    hf = phase("hf")
    assert hf["doctor"]["rc"] == 0 and hf["ktflow_sft"]["rc"] == 0  # on the CPU (gpus: 0) nothing is refused
    plain = hf["plain_llamafactory"]
    assert plain["outcome"] == "ok" and plain["steps_logged"] == 4
    assert plain["train_yaml"]["model_name_or_path"] == str(tmp_path / "big-reduced/model")  # the INT4 source itself
    # What transformers (5.x here) makes of the INT4 experts is read from the log, whatever it is.
    assert {"model load", "training started"} <= set(plain["markers_s"])


def test_big_runs_on_several_gpus_and_thread_counts_are_named_apart_and_keep_the_batch(tmp_path: Path) -> None:
    """``big.py sft --gpus N --threads T``: its own store and results name, the recipe's batch split over the GPUs,
    and the serving recipe's overrides keep the trained run's (so `ktflow serve` finds its adapter)."""
    import argparse

    import big

    from ktflow.recipe import load_recipe
    from ktflow.stages.sft.resume import run_key

    def work(*argv: str) -> big.Work:
        parser = argparse.Namespace(size="full", python=sys.executable, ktflow_python=None, set=None, trainer="kt",
                                    gpus=1, threads=None, serve_python=sys.executable, methods=None)
        for flag, value in zip(argv[::2], argv[1::2]):
            setattr(parser, flag.lstrip("-"), int(value))
        return big.Work(parser)

    one, four = work(), work("--gpus", "4", "--threads", "32")
    assert (one.sft_name, one.sft_store.name) == ("sft", "store")
    assert (four.sft_name, four.sft_store.name) == ("sft-gpus4-t32", "store-gpus4-t32")
    written = big.Work(argparse.Namespace(size="full", python=sys.executable, ktflow_python=None, set=None,
                                          trainer="kt", gpus=1, threads=None, serve_python=sys.executable,
                                          methods=None, as_written=True))
    assert (written.sft_name, written.sft_store.name) == ("sft-written", "store-written")  # the shaper's check
    assert load_recipe(big.RECIPES["kt"], written.sets(written.sft_store)).sft.kt_shape_batches is False
    recipe = load_recipe(big.RECIPES["kt"], four.sets(four.sft_store))
    assert recipe.sft.gpus == 4 and recipe.sft.kt_config.kt_num_threads == 32
    split = recipe.sft.gpu_split()
    assert split.per_device_train_batch_size * split.gradient_accumulation_steps * 4 == 4  # the recipe's batch 4
    served = load_recipe(big.SERVE_RECIPE, big.serve_sets(one, "AMXINT8"))
    trained = load_recipe(big.RECIPES["kt"], one.sets(one.root / "store"))
    assert served.serving.kt_method == "AMXINT8" and served.toolchains.serve.python == Path(sys.executable)
    assert run_key(served, base_digest="b", data_digest="d") == run_key(trained, base_digest="b", data_digest="d")
    assert served.name == trained.name and served.store.root == trained.store.root
