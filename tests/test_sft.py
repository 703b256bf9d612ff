"""The SFT stage: rendering for every backend, real LlamaFactory training on CPU, resume after
kill -9, and refusals before launch."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ktflow.errors import DatasetError, HostRequirementError
from ktflow.host.hardware import probe_host
from ktflow.recipe import load_recipe
from ktflow.stages.sft import last_complete_checkpoint, render_sft, run_sft

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"
needs_train_env = pytest.mark.skipif(not TRAIN_PYTHON.exists(), reason="training toolchain not installed (make train-env)")
KT_ALLOWED = {
    "kt_backend", "kt_expert_weight_format", "kt_weight_lifecycle", "kt_num_threads", "kt_tp_enabled",
    "kt_threadpool_count", "kt_num_gpu_experts", "kt_max_cache_depth", "kt_share_backward_bb",
    "kt_force_fused_expert_lora", "kt_model_max_length",
}


def render(name: str, *overrides: str, tmp: Path = Path("/tmp/x")):
    recipe = load_recipe(RECIPES / name, overrides)
    return recipe, render_sft(recipe, model_dir=tmp / "model", dataset_dir=tmp / "data", output_dir=tmp / "out",
                              config_dir=tmp, train_python=tmp / "env/bin/python", physical_cores=64)


# --------------------------------------------------------------------------- rendering


@pytest.mark.parametrize("name", ["kimi-k2.5-rawint4.yaml", "kimi-k2.5-bf16-int8.yaml", "deepseek-v3-fp8.yaml",
                                  "qwen3-30b-a3b-bf16.yaml"])
def test_kt_07_renders_accelerate_fsdp2_launch(name: str) -> None:
    recipe, plan = render(name)
    assert plan.launch[:4] == ["/tmp/x/env/bin/accelerate", "launch", "--config_file", "/tmp/x/accelerate.yaml"]
    assert plan.launch[4:] == ["--no_python", "/tmp/x/env/bin/llamafactory-cli", "train", "/tmp/x/train.yaml"]
    assert plan.accelerate_config is not None
    assert plan.accelerate_config["num_processes"] == recipe.sft.gpus
    assert plan.accelerate_config["fsdp_config"]["fsdp_version"] == 2
    assert plan.accelerate_config["fsdp_config"]["fsdp_offload_params"] is True  # KT's example config
    _, no_offload = render(name, "sft.fsdp_offload_params=false")  # what resumes on torch 2.11 (GPU host)
    assert no_offload.accelerate_config["fsdp_config"]["fsdp_offload_params"] is False
    cfg = plan.train_config
    assert cfg["use_kt"] is True and cfg["kt_weight_path"] == "/tmp/x/model"
    assert set(cfg["kt_config"]) <= KT_ALLOWED
    assert cfg["kt_config"]["kt_num_threads"] == 64  # physical cores by default
    assert "kt_optimize_rule" not in cfg and "cpu_infer" not in cfg
    assert cfg["overwrite_output_dir"] is False and cfg["save_only_model"] is False


@pytest.mark.parametrize(("b", "g", "gpus", "split"), [
    (4, 1, 1, (4, 1)), (4, 1, 2, (2, 1)), (4, 1, 4, (1, 1)),  # the micro-batch shrinks only when it must
    (1, 8, 2, (1, 4)), (2, 4, 2, (2, 2)), (2, 3, 2, (1, 3)), (3, 2, 2, (3, 1)), (1, 8, 8, (1, 1)),
])
def test_the_recipes_batch_is_kept_whatever_the_gpu_count(b: int, g: int, gpus: int, split: tuple[int, int]) -> None:
    """per_device_train_batch_size x gradient_accumulation_steps is the batch a step holds on any number of
    GPUs: LlamaFactory gets each GPU's share (it multiplies by the GPU count), never a larger micro-batch."""
    recipe, plan = render("kimi-k2.5-rawint4.yaml", f"sft.per_device_train_batch_size={b}",
                          f"sft.gradient_accumulation_steps={g}", f"sft.gpus={gpus}")
    cfg = plan.train_config
    assert (cfg["per_device_train_batch_size"], cfg["gradient_accumulation_steps"]) == split
    assert plan.accelerate_config["num_processes"] == gpus
    assert cfg["per_device_train_batch_size"] * cfg["gradient_accumulation_steps"] * gpus == b * g
    assert recipe.sft.gpu_split().describe().startswith(f"batch {b * g} records a step")


def test_a_batch_the_gpus_cannot_share_evenly_is_refused_with_the_fix() -> None:
    from ktflow.errors import RecipeError

    with pytest.raises(RecipeError) as caught:
        load_recipe(RECIPES / "kimi-k2.5-rawint4.yaml", ["sft.per_device_train_batch_size=1",
                                                         "sft.gradient_accumulation_steps=6", "sft.gpus=4"])
    text = str(caught.value)
    assert "sft.gpus" in text and "6 records a step" in text and "gradient_accumulation_steps to 8" in text


def test_the_plan_counts_the_same_steps_on_one_gpu_and_on_two() -> None:
    from ktflow.plan import sft_steps

    one = load_recipe(RECIPES / "kimi-k2.5-rawint4.yaml", ["sft.gpus=1"])
    two = load_recipe(RECIPES / "kimi-k2.5-rawint4.yaml", ["sft.gpus=2"])
    assert one.sft.max_steps is None and one.sft.per_device_train_batch_size * one.sft.gradient_accumulation_steps == 64
    assert sft_steps(one, 1000) == sft_steps(two, 1000) == int(one.sft.num_train_epochs * -(-1000 // 64))


def test_rawint4_render_matches_kt_rules() -> None:
    _, plan = render("kimi-k2.5-rawint4.yaml")
    kt = plan.train_config["kt_config"]
    assert kt["kt_backend"] == "RAWINT4" and kt["kt_expert_weight_format"] == "rawint4"
    assert kt["kt_share_backward_bb"] is False and kt["kt_force_fused_expert_lora"] is True
    assert plan.train_config["lora_rank"] == 8 and plan.train_config["lora_dropout"] == 0.0
    assert plan.train_config["kt_cpu_activation"] == "recompute"
    assert plan.accelerate_config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "DeepseekV3DecoderLayer"


def test_qwen_wraps_its_own_decoder_layer() -> None:
    _, plan = render("qwen3-30b-a3b-bf16.yaml")
    assert plan.accelerate_config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "Qwen3MoeDecoderLayer"


def test_legacy_renders_use_kt_env_and_rule() -> None:
    _, plan = render("deepseek-v2-lite-bf16.yaml")
    assert plan.env["USE_KT"] == "1"
    assert plan.launch == ["/tmp/x/env/bin/llamafactory-cli", "train", "/tmp/x/train.yaml"]
    assert plan.accelerate_config is None
    cfg = plan.train_config
    assert cfg["kt_optimize_rule"].endswith("DeepSeek-V2-Lite-Chat-sft-amx.yaml")
    assert cfg["cpu_infer"] == 32 and cfg["chunk_size"] == 8192
    assert "kt_config" not in cfg


def test_hf_on_cpu_uses_cpu_and_extra_args() -> None:
    _, plan = render("tiny-demo.yaml", "sft.extra_args.weight_decay=0.1")
    cfg = plan.train_config
    assert cfg["use_cpu"] is True and "use_kt" not in cfg
    assert cfg["weight_decay"] == 0.1
    assert "CUDA_VISIBLE_DEVICES" not in plan.env


def test_cli_dry_run_json_has_the_contract_keys() -> None:
    result = subprocess.run([sys.executable, "-m", "ktflow.cli", "sft", "recipes/kimi-k2.5-rawint4.yaml", "--dry-run",
                             "--json"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert set(doc) == {"train_config", "accelerate_config", "launch", "env"}
    assert doc["launch"][1] == "launch" and doc["train_config"]["kt_config"]["kt_backend"] == "RAWINT4"


def test_cli_dry_run_text_shows_yaml_and_command() -> None:
    result = subprocess.run([sys.executable, "-m", "ktflow.cli", "sft", "recipes/deepseek-v2-lite-bf16.yaml",
                             "--dry-run"], cwd=REPO, capture_output=True, text=True, env={**os.environ, "COLUMNS": "300"})
    assert result.returncode == 0, result.stderr
    assert "# train.yaml" in result.stdout and "USE_KT=1" in result.stdout
    start = result.stdout.index("# train.yaml") + len("# train.yaml")
    end = result.stdout.index("# launch")
    assert yaml.safe_load(result.stdout[start:end])["use_kt"] is True


@needs_train_env
@pytest.mark.slow
def test_llamafactory_parser_accepts_the_cpu_render(tmp_path: Path, fixture_dir) -> None:
    """LlamaFactory 0.9.5's own argument parser (the version the training toolchain pins)."""
    _, plan = render("tiny-demo.yaml", tmp=tmp_path)
    cfg = dict(plan.train_config, model_name_or_path=str(fixture_dir("bf16")))
    code = (
        "import json, sys\n"
        "from llamafactory.hparams import get_train_args\n"
        "model, data, training, finetuning, generating = get_train_args(json.loads(sys.argv[1]))\n"
        "print(json.dumps({'rank': finetuning.lora_rank, 'cpu': training.use_cpu, 'out': training.output_dir}))\n"
    )
    done = subprocess.run([str(TRAIN_PYTHON), "-c", code, json.dumps(cfg)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed == {"rank": plan.train_config["lora_rank"], "cpu": True, "out": str(tmp_path / "out")}
    assert plan.train_config["lora_rank"] == 16  # the demo recipe's


# --------------------------------------------------------------------------- refusals before launch


def _recipe(tmp_path: Path, model: Path, *overrides: str):
    data = tmp_path / "data"
    if not (data / "train.jsonl").exists():
        from ktflow.demo import write_demo_dataset

        write_demo_dataset(data)
    return load_recipe(RECIPES / "tiny-demo.yaml", [
        f"source.local_path={model}", "source.format=bf16", f"dataset.files=[{data / 'train.jsonl'}]",
        f"evaluation.files=[{data / 'eval.jsonl'}]", f"store.root={tmp_path / 'store'}",
        f"toolchains.train.python={TRAIN_PYTHON}", *SHORT_RUN, *overrides,
    ])


SHORT_RUN = ["sft.max_steps=6", "sft.save_steps=2", "sft.logging_steps=1"]
"""A short run with frequent checkpoints (the demo recipe trains 400 steps)."""


def test_malformed_record_stops_before_launch(tmp_path: Path, fixture_dir) -> None:
    recipe = _recipe(tmp_path, fixture_dir("bf16"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{not json\n')
    recipe = recipe.model_copy(update={"dataset": recipe.dataset.model_copy(update={"files": [bad]})})
    if not TRAIN_PYTHON.exists():
        recipe = recipe.model_copy(update={"toolchains": recipe.toolchains.model_copy(
            update={"train": recipe.toolchains.train.model_copy(update={"python": Path(sys.executable)})})})
    with pytest.raises(DatasetError, match=r"bad.jsonl:2"):
        run_sft(recipe, model_dir=fixture_dir("bf16"), host=probe_host())
    assert not (tmp_path / "store" / "runs").exists()


def test_missing_toolchain_is_refused(tmp_path: Path, fixture_dir) -> None:
    recipe = _recipe(tmp_path, fixture_dir("bf16"), f"toolchains.train.python={tmp_path / 'nope/bin/python'}")
    with pytest.raises(HostRequirementError, match="toolchains.train.python"):
        run_sft(recipe, model_dir=fixture_dir("bf16"), host=probe_host())


def test_kt_backend_without_gpus_is_refused_by_preflight(tmp_path: Path, fixture_dir) -> None:
    recipe = load_recipe(RECIPES / "qwen3-30b-a3b-bf16.yaml", [f"store.root={tmp_path}"])
    data = tmp_path / "train.jsonl"  # good data: the refusal is the host's
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    recipe = recipe.model_copy(update={"dataset": recipe.dataset.model_copy(update={"files": [data]})})
    host = probe_host().model_copy(update={"gpus": []})
    with pytest.raises(HostRequirementError, match="sft needs 1 GPU"):
        run_sft(recipe, model_dir=fixture_dir("bf16"), host=host)


def test_incomplete_checkpoints_are_set_aside(tmp_path: Path) -> None:
    out = tmp_path / "out"
    good = out / "checkpoint-2"
    good.mkdir(parents=True)
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, good / "adapter_model.safetensors")
    for name in ("optimizer.pt", "scheduler.pt"):
        (good / name).write_bytes(b"x")
    (good / "trainer_state.json").write_text("{}")
    partial = out / "checkpoint-4"
    partial.mkdir()
    (partial / "adapter_model.safetensors").write_bytes(b"truncated")
    assert last_complete_checkpoint(out) == good
    assert not partial.exists() and list(out.glob(".incomplete-checkpoint-4-*"))


@pytest.mark.parametrize("optimizer", ["optimizer.pt", "optimizer.bin", "optimizer_0/.metadata", "kt"])
def test_a_checkpoint_is_complete_with_the_optimizer_state_as_each_launch_saves_it(tmp_path: Path,
                                                                                 optimizer: str) -> None:
    """One process saves optimizer.pt; accelerate's FSDP over several processes optimizer.bin (full state dict) or
    optimizer_0/ (sharded, complete once torch.distributed.checkpoint wrote its .metadata); transformers-kt on
    2+ GPUs one optimizer_rank_NNNNN.pt per rank, then kt_optimizer.index.json naming them (what ktflow took for
    an incomplete checkpoint on the 2-GPU host, restarting a killed 2-GPU run from step 0)."""
    import torch
    from safetensors.torch import save_file

    from ktflow.stages.sft.resume import checkpoint_is_complete

    ckpt = tmp_path / "checkpoint-24"
    (ckpt / "optimizer_0").mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, ckpt / "adapter_model.safetensors")
    (ckpt / "scheduler.pt").write_bytes(b"x")
    (ckpt / "trainer_state.json").write_text("{}")
    assert not checkpoint_is_complete(ckpt)  # no optimizer state yet: a kill during the save
    if optimizer == "kt":
        ranks = ["optimizer_rank_00000.pt", "optimizer_rank_00001.pt"]
        (ckpt / ranks[0]).write_bytes(b"x")
        index = {"version": 1, "world_size": 2, "rank_files": ranks}
        (ckpt / "kt_optimizer.index.json").write_text(json.dumps(index))
        assert not checkpoint_is_complete(ckpt)  # rank 1's file missing
        (ckpt / ranks[1]).write_bytes(b"x")
    else:
        (ckpt / optimizer).write_bytes(b"x")
    assert checkpoint_is_complete(ckpt)


# --------------------------------------------------------------------------- real training


@needs_train_env
@pytest.mark.slow
def test_real_training_produces_an_adapter_that_changes_logits(tmp_path: Path, fixture_dir) -> None:
    model = fixture_dir("bf16")
    recipe = _recipe(tmp_path, model)
    seen = []
    result = run_sft(recipe, model_dir=model, host=probe_host(), progress=seen.append)
    assert not result.cached and result.steps == 6
    assert result.final_loss is not None and result.final_loss > 0
    assert [r.current_steps for r in seen if r.loss is not None][-1] == 6  # followed live
    assert result.loss_curve is not None and result.loss_curve.exists()
    manifest = json.loads((result.adapter_dir / "manifest.json").read_text())
    assert manifest["tools"]["llamafactory"] == "0.9.5" and manifest["extra"]["steps"] == 6
    train_yaml = yaml.safe_load((result.run_dir / "train.yaml").read_text())
    assert train_yaml["overwrite_output_dir"] is False

    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from peft import PeftModel\n"
        "base = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)\n"
        "ids = torch.arange(1, 17).unsqueeze(0)\n"
        "with torch.no_grad(): a = base(input_ids=ids).logits\n"
        "tuned = PeftModel.from_pretrained(base, sys.argv[2])\n"
        "with torch.no_grad(): b = tuned(input_ids=ids).logits\n"
        "print((a - b).abs().max().item())\n"
    )
    done = subprocess.run([str(TRAIN_PYTHON), "-c", code, str(model), str(result.adapter_dir)], capture_output=True,
                          text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.strip().splitlines()[-1]) > 1e-4  # the adapter changes the model

    again = run_sft(recipe, model_dir=model, host=probe_host())
    assert again.cached and again.adapter_dir == result.adapter_dir


@needs_train_env
@pytest.mark.slow
def test_kill_9_mid_training_resumes_from_the_last_checkpoint(tmp_path: Path, fixture_dir) -> None:
    import torch
    from safetensors.torch import load_file

    model = fixture_dir("bf16")
    steps = ["sft.max_steps=12", "sft.save_steps=3"]
    clean = run_sft(_recipe(tmp_path / "clean", model, *steps), model_dir=model, host=probe_host())

    root = tmp_path / "killed"
    recipe = _recipe(root, model, *steps)
    argv = [sys.executable, "-m", "ktflow.cli", "sft", str(RECIPES / "tiny-demo.yaml")]
    for override in [f"source.local_path={model}", "source.format=bf16",
                     f"dataset.files=[{root / 'data' / 'train.jsonl'}]",
                     f"evaluation.files=[{root / 'data' / 'eval.jsonl'}]",
                     f"store.root={root / 'store'}", f"toolchains.train.python={TRAIN_PYTHON}", *SHORT_RUN, *steps]:
        argv += ["--set", override]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    killed_at = None
    while time.monotonic() < deadline and proc.poll() is None:
        ckpts = list((root / "store" / "runs").glob("*/output/checkpoint-3/trainer_state.json"))
        if ckpts:
            time.sleep(0.3)
            os.killpg(proc.pid, signal.SIGKILL)  # the orchestrator and LlamaFactory at once
            killed_at = ckpts[0].parent
            break
        time.sleep(0.1)
    proc.wait()
    assert killed_at is not None, "training finished or never checkpointed before the kill"
    assert not (killed_at.parent.parent / "adapter").exists()  # nothing published

    resumed = run_sft(recipe, model_dir=model, host=probe_host())
    assert resumed.resumed_from is not None and "checkpoint-" in resumed.resumed_from
    assert resumed.steps == 12
    a = load_file(clean.adapter_dir / "adapter_model.safetensors")
    b = load_file(resumed.adapter_dir / "adapter_model.safetensors")
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-3, atol=1e-5)


def test_resource_check_per_numa_node_and_disk(tmp_path: Path) -> None:
    from ktflow.host.hardware import NumaNode
    from ktflow.planning.sizing import ModelSize
    from ktflow.resources import shortfalls
    from ktflow.stages.sft import sft_needs

    def size(stored: int) -> ModelSize:  # a MoE whose weights are nearly all routed experts, in BF16
        return ModelSize(path="m", parameters=stored // 2, expert_parameters=stored // 2 - (1 << 20), hidden_size=64,
                         num_layers=4, vocab_size=64, linear_shapes={}, stored_bytes=stored,
                         expert_stored_bytes=stored - (2 << 20), moe_layers=4, routed_experts=8, experts_per_token=2)

    def problems(recipe, host, model_bytes: int) -> list[str]:
        needs = sft_needs(recipe, size(model_bytes))
        return [e.reason for e in shortfalls("sft", needs.model_copy(update={"disk": ()}), tmp_path / "a", host)]

    recipe = load_recipe(RECIPES / "kimi-k2.5-bf16-int8.yaml")  # KT, kt_tp_enabled, 2 pools
    host = probe_host().model_copy(update={
        "numa": [NumaNode(id=0, cpus=[0], mem_total_bytes=1200 << 30, mem_free_bytes=0),
                 NumaNode(id=1, cpus=[1], mem_total_bytes=700 << 30, mem_free_bytes=0)],
        "numa_nodes": 2, "ram_bytes": 1900 << 30, "disk_free_bytes": 100 << 30,
    })
    found = problems(recipe, host, 2000 << 30)  # 2 TB of BF16 experts
    assert any("per NUMA node" in p and "node 1 has 700 GiB" in p for p in found), found
    assert any("GiB of RAM (" in p and "routed experts as stored" in p for p in found), found
    roomy = host.model_copy(update={"numa": [n.model_copy(update={"mem_total_bytes": 1500 << 30}) for n in host.numa],
                                        "ram_bytes": 3000 << 30})
    assert problems(recipe, roomy, 2000 << 30) == []
    # Full fine-tuning's checkpoints hold the weights and Adam's two moments: 3x the model, at the store.
    full = load_recipe(RECIPES / "qwen3-30b-a3b-bf16.yaml", ["sft.finetuning_type=full"])
    (disk,) = sft_needs(full, size(60 << 30)).disk
    assert disk.bytes == (180 << 30) + (1 << 30) and "checkpoints" in disk.what
    (lora_disk,) = sft_needs(recipe, size(60 << 30)).disk
    assert lora_disk.bytes == 1 << 30


LEGACY_LF = REPO / ".venv-train" / "llamafactory-0.9.4"


@pytest.mark.slow
@pytest.mark.skipif(not LEGACY_LF.exists(), reason="LlamaFactory 0.9.4 not unpacked (make test does it)")
def test_legacy_render_passes_llamafactory_094_argument_parsing(tmp_path: Path) -> None:
    """LlamaFactory 0.9.4 is the last release that parses the legacy-KT keys. Its parser accepts
    every key and value of the render and stops only at its dependency check, which wants the
    legacy `ktransformers` package (present on a real legacy-KT host, not here)."""
    _, plan = render("deepseek-v2-lite-bf16.yaml", tmp=tmp_path)
    code = (
        "import json, sys, tempfile\n"
        "import transformers.training_args as ta\n"
        "ta.is_torch_bf16_gpu_available = lambda: True\n"
        "from llamafactory.hparams import get_train_args\n"
        "cfg = json.loads(sys.argv[1])\n"
        "try:\n"
        "    get_train_args(cfg)\n"
        "    print('RESULT parsed')\n"
        "except BaseException as exc:\n"
        "    print('RESULT', type(exc).__name__, str(exc).replace(chr(10), ' '))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(LEGACY_LF), "DISABLE_VERSION_CHECK": "1"}
    good = subprocess.run([str(TRAIN_PYTHON), "-c", code, json.dumps(plan.train_config)], capture_output=True, text=True,
                          env=env)
    result = next(ln for ln in good.stdout.splitlines() if ln.startswith("RESULT"))
    assert "'ktransformers' distribution was not found" in result, result
    bad = dict(plan.train_config, kt_optimize_rle="typo.yaml")  # an unknown key fails before that check
    bad_run = subprocess.run([str(TRAIN_PYTHON), "-c", code, json.dumps(bad)], capture_output=True, text=True, env=env)
    bad_result = next(ln for ln in bad_run.stdout.splitlines() if ln.startswith("RESULT"))
    assert "kt_optimize_rle" in bad_result and "distribution was not found" not in bad_result, bad_result


@needs_train_env
def test_a_kill_after_the_last_checkpoint_publishes_it_without_training_past_max_steps(tmp_path: Path,
                                                                                       fixture_dir) -> None:
    """Killed after checkpoint-N (N = max_steps) but before publishing: resuming would have made
    transformers train step N+1; the final checkpoint's adapter is published instead."""
    import torch
    from safetensors.torch import load_file

    model = fixture_dir("bf16")
    recipe = _recipe(tmp_path, model, "sft.max_steps=4", "sft.save_steps=2")
    done = run_sft(recipe, model_dir=model, host=probe_host())
    output = done.run_dir / "output"
    final = load_file(output / "checkpoint-4" / "adapter_model.safetensors")
    shutil.rmtree(done.adapter_dir)  # as if killed before publishing ...
    (output / "adapter_model.safetensors").write_bytes(b"\0" * 10)  # ... in the middle of the final save
    again = run_sft(recipe, model_dir=model, host=probe_host())
    assert not again.cached and again.resumed_from is not None and again.resumed_from.endswith("checkpoint-4")
    assert again.steps == 4
    log = (output / "trainer_log.jsonl").read_text()
    assert '"current_steps": 5' not in log
    published = load_file(again.adapter_dir / "adapter_model.safetensors")
    assert sorted(published) == sorted(final)
    assert all(torch.equal(published[n], final[n]) for n in final)
