"""The SFT preflight refuses a plain (hf) LoRA SFT whose model cannot fit the GPUs it would use,
before anything is loaded, and `ktflow doctor --recipe` says the same. The models are described
by headers only: the bigger-than-gpu fixture's config, index and shard headers, its 34 GB of
tensor bytes a sparse hole (read_header checks a file's size, never its contents)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ktflow.errors import HostRequirementError
from ktflow.fixtures.stream import BIGGER_THAN_GPU, MoeDims, plan_shards, shard_names
from ktflow.formats.safetensors_io import header_bytes
from ktflow.host.hardware import GpuInfo, HostInfo, NumaNode
from ktflow.planning.sizing import estimate_hf_sft_gpu_memory, model_size, sft_gpu_memory_problem
from ktflow.recipe import load_recipe
from ktflow.stages.sft import check_hf_fits_gpus, run_sft
from ktflow.units import GiB

REPO = Path(__file__).resolve().parent.parent
H100 = GpuInfo(index=0, name="NVIDIA H100 80GB HBM3", vram_bytes=81559 << 20)  # what nvidia-smi reports
MiB = 1 << 20


def gpu_host(gpus: int = 1) -> HostInfo:
    """The device's H100 host: 16 AMX cores, 125 GiB, 64 GiB disk."""
    return HostInfo(
        hostname="h100", cpu_model="Intel Xeon (AMX)", cpu_flags=[], cpu_variant="amx", cpu_variant_overridden=False,
        logical_cores=16, physical_cores=16, numa_nodes=1,
        numa=[NumaNode(id=0, cpus=list(range(16)), mem_total_bytes=125 * GiB, mem_free_bytes=120 * GiB)],
        ram_bytes=125 * GiB, ram_available_bytes=120 * GiB,
        gpus=[H100.model_copy(update={"index": i}) for i in range(gpus)],
        disk_path="/", disk_free_bytes=60 * GiB, shm_bytes=60 * GiB, shm_free_bytes=60 * GiB,
    )


def headers_only_checkpoint(path: Path, dims: MoeDims = BIGGER_THAN_GPU) -> Path:
    """A kimi-k2.5 checkpoint of ``dims`` with real config, index and headers and no tensor data."""
    from ktflow.fixtures.checkpoints import streamed_config

    path.mkdir(parents=True)
    shards = plan_shards(dims, vocab_size=402, pad_id=0)
    config = streamed_config(dims, vocab_size=402, eos_id=2, pad_id=0, scratch=path / ".scratch")
    (path / "config.json").write_text(json.dumps(config))
    weight_map: dict[str, str] = {}
    for shard, name in zip(shards, shard_names(len(shards))):
        header = header_bytes([(t.name, t.dtype, t.shape) for t in shard], {"format": "pt"})
        with open(path / name, "wb") as f:
            f.write(header)
            f.truncate(len(header) + sum(t.nbytes for t in shard))  # a hole: no disk used
        weight_map.update(dict.fromkeys((t.name for t in shard), name))
    total = sum(t.nbytes for shard in shards for t in shard)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    return path


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return headers_only_checkpoint(tmp_path_factory.mktemp("big") / "model")


def write_recipe(tmp_path: Path, model: Path, *, backend: str = "hf", gpus: int = 1) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello, nya~"}]}) + "\n")
    sft: dict = {"backend": backend, "gpus": gpus, "cutoff_len": 256, "lora_rank": 8, "lora_alpha": 16,
                 "lora_target": "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj", "max_steps": 6,
                 "gradient_accumulation_steps": gpus or 1}  # a batch of one record each GPU
    if backend == "kt":
        sft.update(kt_cpu_activation="retain", disable_gradient_checkpointing=True,
                   kt_config={"kt_backend": "RAWINT4", "kt_expert_weight_format": "rawint4", "kt_num_gpu_experts": 0,
                              "kt_share_backward_bb": False, "kt_force_fused_expert_lora": True})
    recipe = {
        "name": f"big-{backend}", "source": {"local_path": str(model), "format": "kimi-k2.5-int4"},
        "dataset": {"name": "d", "files": [str(data)], "format": "openai"}, "sft": sft,
        "serving": {"backend": "llamafactory"}, "store": {"root": str(tmp_path / "store")},
        "toolchains": {"train": {"python": str(tmp_path / "no-env/bin/python")},
                       "serve": {"python": str(tmp_path / "no-env/bin/python")}},
    }
    path = tmp_path / f"big-{backend}-{gpus}.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


def test_the_estimate_matches_the_gpu_memory_measured_for_deepseek_v2_lite() -> None:
    """benchmarks/kt_vs_hf.py leg a on the H100 host: 33,277 MiB over idle (README, benchmarks/data/kt-vs-hf)."""
    from transformers import DeepseekV3ForCausalLM

    from ktflow.fixtures.checkpoints import FixtureSpec, _deepseek_v2_lite_config
    from ktflow.planning.sizing import _NOT_LORA, ModelSize

    spec = FixtureSpec(kind="deepseek-v2-lite", full_size=True, architecture="DeepseekV3ForCausalLM")
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(_deepseek_v2_lite_config(spec, vocab_size=402, eos_id=2, pad_id=0))
    linear = {name: tuple(m.weight.shape) for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and not _NOT_LORA.search(f"{name}.weight")}
    size = ModelSize(path="v2-lite", parameters=sum(p.numel() for p in model.parameters()), hidden_size=2048,
                     num_layers=27, vocab_size=102400, linear_shapes=linear)
    estimate = estimate_hf_sft_gpu_memory(size, load_recipe(REPO / "benchmarks/recipes/v2-lite-hf.yaml").sft)
    assert abs(estimate.total_bytes / MiB - 33277) / 33277 < 0.05, estimate
    assert estimate.weights_bytes == 2 * size.parameters and estimate.tokens_per_step == 1024


def test_headers_give_the_parameters_as_decoded_and_the_lora_targets(big_model: Path) -> None:
    from ktflow.fixtures.checkpoints import _vision_modules, streamed_parameters

    size = model_size(big_model)
    vision = sum(p.numel() for p in _vision_modules(BIGGER_THAN_GPU.hidden).values())
    assert size.parameters == streamed_parameters(BIGGER_THAN_GPU, vocab_size=402) - vision  # INT4 counted decoded
    assert (size.hidden_size, size.num_layers, size.vocab_size) == (7168, 8, 402)
    assert not any(".experts." in m and "shared" not in m for m in size.linear_shapes)  # fused: LoRA cannot reach
    assert size.linear_shapes["language_model.model.layers.3.self_attn.q_b_proj"] == (64 * 192, 1536)
    assert "language_model.model.layers.3.mlp.gate" not in size.linear_shapes  # the router is no Linear


def test_ktflow_sft_refuses_plain_sft_bigger_than_the_gpu_before_anything_runs(big_model: Path, tmp_path: Path) -> None:
    recipe = load_recipe(write_recipe(tmp_path, big_model))
    with pytest.raises(HostRequirementError) as info:
        run_sft(recipe, model_dir=big_model, host=gpu_host())
    error = info.value
    assert error.subject == "sft.backend: hf"
    assert "57.0B parameters" in error.reason and "106.2 GiB of BF16 weights" in error.reason
    need = int(error.reason.split("needs ~")[1].split(" GiB")[0])
    assert 110 < need < 125, error.reason
    assert "have 79.6 GiB" in error.reason and "NVIDIA H100 80GB HBM3" in error.reason
    assert "sft.backend: kt" in error.fix
    # Refused before the toolchain (absent here) is looked at, the data prepared or a run directory made.
    assert not (tmp_path / "store").exists()


def test_what_fits_is_not_refused(big_model: Path, tmp_path: Path, fixture_dir) -> None:
    host = gpu_host(gpus=2)
    assert sft_gpu_memory_problem(load_recipe(write_recipe(tmp_path, big_model, gpus=2)), host, big_model) is None
    # KT keeps the routed experts in RAM; a CPU run is sized against RAM: neither is this check's business.
    check_hf_fits_gpus(load_recipe(write_recipe(tmp_path, big_model, backend="kt")), gpu_host(), big_model)
    check_hf_fits_gpus(load_recipe(write_recipe(tmp_path, big_model, gpus=0)), gpu_host(), big_model)
    tiny = fixture_dir("kimi-k2.5")
    check_hf_fits_gpus(load_recipe(write_recipe(tmp_path, tiny)), gpu_host(), tiny)
    # A host without the GPUs gets the capability message, not a memory figure.
    assert sft_gpu_memory_problem(load_recipe(write_recipe(tmp_path, big_model, gpus=2)), gpu_host(1), big_model) is None


def test_the_refusal_comes_from_the_sum_of_the_gpus_used(big_model: Path, tmp_path: Path) -> None:
    small = gpu_host(gpus=2).model_copy(update={"gpus": [H100.model_copy(update={"index": i, "vram_bytes": 40 * GiB})
                                                          for i in range(2)]})
    problem = sft_gpu_memory_problem(load_recipe(write_recipe(tmp_path, big_model, gpus=2)), small, big_model)
    assert problem is not None and "have 80.0 GiB" in problem and "sft.gpus: 2" in problem


def test_doctor_says_the_same_for_the_recipe(big_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    import ktflow.host.hardware
    from ktflow.cli import main
    from ktflow.plan import check_recipe_on_host

    recipe_file = write_recipe(tmp_path, big_model)
    checks = {c.stage: c for c in check_recipe_on_host(load_recipe(recipe_file), gpu_host())}
    assert not checks["sft"].runnable
    assert "GiB of GPU memory" in checks["sft"].missing[0] and "sft.backend: kt" in checks["sft"].missing[0]
    kt = {c.stage: c for c in check_recipe_on_host(load_recipe(write_recipe(tmp_path, big_model, backend="kt")),
                                                   gpu_host())}
    assert kt["sft"].runnable

    monkeypatch.setattr(ktflow.host.hardware, "probe_host", lambda store=None: gpu_host())
    monkeypatch.chdir(tmp_path)  # the CLI works in the recipe's folder
    assert main(["doctor", "--recipe", str(recipe_file), "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    sft = next(s for s in report["stages"] if s["stage"] == "sft")
    assert not sft["runnable"] and "have 79.6 GiB" in sft["missing"][0]


def test_doctor_sizes_nothing_it_would_have_to_download(tmp_path: Path) -> None:
    from ktflow.plan import check_recipe_on_host

    recipe = load_recipe(REPO / "recipes/kimi-k2.5-bf16-int8.yaml", [f"store.root={tmp_path}"])
    assert recipe.source.repo_id is not None
    assert all("GPU memory" not in m for c in check_recipe_on_host(recipe, gpu_host(8)) for m in c.missing)


def test_ktflow_sft_refuses_before_the_bf16_copy_is_made(big_model: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`backend: hf` on an INT4 source would dequantize to BF16 first (hours, 114 GB here): the
    refusal comes before that, from the source's headers."""
    import ktflow.host.hardware
    from ktflow.cli import main

    recipe_file = write_recipe(tmp_path, big_model)
    monkeypatch.setattr(ktflow.host.hardware, "probe_host", lambda store=None: gpu_host())
    monkeypatch.chdir(tmp_path)
    assert main(["sft", str(recipe_file)]) == 2
    err = capsys.readouterr().err
    assert "sft.backend: hf" in err and "have 79.6 GiB" in err and "backend: kt" in err, err
    store = tmp_path / "store"
    made = sorted(p.relative_to(store).as_posix() for p in store.rglob("*")) if store.exists() else []
    assert not [p for p in made if "bf16" in p or p.startswith("runs")], made
