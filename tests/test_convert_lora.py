"""The convert-lora stage: KT fused adapters through kt-kernel's own converter, plain PEFT adapters
from real PEFT, and refusals of adapters that would be silently ignored by a server."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ktflow.errors import AdapterError, KtflowError
from ktflow.formats.adapter import validate_adapter
from ktflow.stages.convert_lora import convert_lora
from ktflow.store import read_manifest, staging_dir_for

REPO = Path(__file__).resolve().parent.parent
SERVE_PYTHON = REPO / ".venv-serve" / "bin" / "python"
TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"
needs_serve_env = pytest.mark.skipif(not SERVE_PYTHON.exists(), reason="serving toolchain not installed (make serve-env)")
needs_train_env = pytest.mark.skipif(not TRAIN_PYTHON.exists(), reason="training toolchain not installed (make train-env)")

ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
FUSED = ("gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b")
RANK, ALPHA = 8, 16


# --------------------------------------------------------------------------- a KT-style training output


def _dims(base: Path) -> dict[str, int]:
    config = json.loads((base / "config.json").read_text())
    text = config.get("text_config", config)
    return {"layers": text["num_hidden_layers"], "dense": text["first_k_dense_replace"],
            "experts": text["n_routed_experts"], "hidden": text["hidden_size"],
            "inter": text["moe_intermediate_size"]}


def _base_shapes(base: Path) -> dict[str, list[int]]:
    """Every base tensor's shape, read with safetensors itself (not ktflow's reader)."""
    weight_map = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    shapes = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(base / shard, framework="pt") as f:
            for key in f.keys():
                shapes[key] = f.get_slice(key).get_shape()
    return shapes


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_kt_manifest(adapter: Path, base: Path, *, status: str = "ready") -> None:
    """kt_adapter_manifest.json exactly as kt-kernel 0.7.2's save_kt_adapter_artifacts writes it."""
    artifacts = {}
    for name in ("adapter_config.json", "adapter_model.safetensors", "fused_expert_lora.safetensors"):
        path = adapter / name
        if not path.exists():
            continue
        record = {"size": path.stat().st_size, "sha256": _sha256(path)}
        if name == "fused_expert_lora.safetensors":
            with safe_open(path, framework="pt") as f:
                contract = {k: {"shape": list(f.get_slice(k).get_shape()), "dtype": f.get_slice(k).get_dtype()}
                            for k in sorted(f.keys())}
            record.update({"tensor_count": len(contract), "tensors": contract})
        artifacts[name] = record
    payload = {"version": 1, "status": status, "expert_weight_format": "bf16",
               "base": {"model_name_or_path": str(base)}, "lora": {"rank": RANK, "alpha": float(ALPHA)},
               "artifacts": artifacts}
    with open(adapter / "kt_adapter_manifest.json", "w", encoding="utf-8") as f:
        json.dump(payload, f, ensure_ascii=False, indent=2, sort_keys=True)
        f.write("\n")


Mutate = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], dict], None]


def make_kt_adapter(base: Path, out: Path, *, mutate: Mutate | None = None, fused: bool = True,
                    manifest: bool = True, kt_wrapper_layers: tuple[int, ...] = ()) -> Path:
    """A KT fused-path training output for ``base``'s shapes: non-expert PEFT LoRA on the MLA
    projections (float32, ``base_model.model.model.layers.{L}.self_attn.{proj}.lora_{A,B}.weight``,
    as KT 0.7.2 wrote them on the GPU host with FSDP2; the layers in ``kt_wrapper_layers`` carry
    KTransformers' ``.orig_module`` wrapper names, which real 0.7.2 output did not have), fused
    expert LoRA for every MoE layer, the config and kt-kernel's manifest."""
    d, shapes = _dims(base), _base_shapes(base)
    root = "language_model.model" if any(k.startswith("language_model.") for k in shapes) else "model"
    gen = torch.Generator().manual_seed(0)
    peft: dict[str, torch.Tensor] = {}
    for layer in range(d["layers"]):
        for module in ATTENTION:
            out_dim, in_dim = shapes[f"{root}.layers.{layer}.self_attn.{module}.weight"]
            if layer in kt_wrapper_layers:
                prefix = f"base_model.model.{root}.orig_module.layers.{layer}.self_attn.{module}.orig_module"
            else:
                prefix = f"base_model.model.{root}.layers.{layer}.self_attn.{module}"
            peft[f"{prefix}.lora_A.weight"] = torch.randn(RANK, in_dim, generator=gen)
            peft[f"{prefix}.lora_B.weight"] = torch.randn(out_dim, RANK, generator=gen)
    experts: dict[str, torch.Tensor] = {}
    e, h, i = d["experts"], d["hidden"], d["inter"]
    for layer in range(d["dense"], d["layers"]):
        for name, shape in zip(FUSED, [(e, RANK, h), (e, i, RANK), (e, RANK, h), (e, i, RANK), (e, RANK, i),
                                       (e, h, RANK)]):
            experts[f"layers.{layer}.experts.{name}"] = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    config = {"base_model_name_or_path": str(base), "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK,
              "lora_alpha": ALPHA, "lora_dropout": 0.0, "bias": "none", "target_modules": list(ATTENTION),
              "use_dora": False, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}}
    if mutate:
        mutate(peft, experts, config)
    out.mkdir(parents=True)
    save_file(peft, out / "adapter_model.safetensors", metadata={"format": "pt"})
    if fused:
        save_file(experts, out / "fused_expert_lora.safetensors")
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    if manifest:
        write_kt_manifest(out, base)
    return out


def _converted(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(path / "adapter_model.safetensors"), json.loads((path / "adapter_config.json").read_text())


# --------------------------------------------------------------------------- KT fused path


@needs_serve_env
@pytest.mark.slow
def test_kt_fused_result_is_kt_kernels_own_conversion(tmp_path: Path, fixture_dir) -> None:
    base = fixture_dir("bf16")
    adapter = make_kt_adapter(base, tmp_path / "train" / "checkpoint-6", kt_wrapper_layers=(2,))
    out = tmp_path / "store" / "sglang-adapter"
    lines: list[str] = []
    result = convert_lora(adapter, out, base_dir=base, serve_python=SERVE_PYTHON, on_line=lines.append)

    by_hand = tmp_path / "by-hand"
    done = subprocess.run([str(SERVE_PYTHON), "-m", "kt_kernel.sft.convert_kt_to_sglang_adapter", str(adapter),
                           str(by_hand), "--base-model-name-or-path", str(base.resolve())],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    ours, our_config = _converted(out)
    theirs, their_config = _converted(by_hand)
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    assert our_config == their_config

    d = _dims(base)
    n_experts = (d["layers"] - d["dense"]) * d["experts"] * 6
    assert result.kind == "kt-fused" and not result.cached and result.rank == RANK
    assert result.tensors == len(ours) == 2 * len(ATTENTION) * d["layers"] + n_experts
    assert sum(".mlp.experts." in k for k in ours) == n_experts
    assert not any(k.startswith("base_model.") or "orig_module" in k for k in ours)
    assert "model.layers.2.self_attn.q_a_proj.lora_A.weight" in ours  # .orig_module stripped
    assert set(result.target_modules) == set(ATTENTION) | {"gate_proj", "up_proj", "down_proj"}
    assert our_config["base_model_name_or_path"] == str(base.resolve()) and our_config["r"] == RANK
    assert our_config["lora_alpha"] == ALPHA
    assert any("Converted KT fused expert LoRA adapter" in line for line in lines)

    manifest = read_manifest(out)
    assert manifest is not None and manifest.stage == "convert-lora" and manifest.digest() == result.manifest_digest
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", manifest.tools["kt-kernel"])
    assert manifest.inputs["adapter/fused_expert_lora.safetensors"] == _sha256(adapter / "fused_expert_lora.safetensors")
    assert set(manifest.inputs) >= {"base", "adapter/adapter_model.safetensors", "adapter/kt_adapter_manifest.json"}
    assert {f.path for f in manifest.files} == {"adapter_model.safetensors", "adapter_config.json"}
    assert not staging_dir_for(out).exists()
    assert validate_adapter(out, base) == (RANK, result.target_modules)

    # Same adapter, same base, same settings: a cache hit that leaves the artifact alone.
    inode = out.stat().st_ino
    again = convert_lora(adapter, out, base_dir=base, serve_python=SERVE_PYTHON)
    assert again.cached and again.manifest_digest == result.manifest_digest and again.tensors == result.tensors
    assert out.stat().st_ino == inode and read_manifest(out).created_at == manifest.created_at


@needs_serve_env
@pytest.mark.slow
def test_kt_fused_on_kimi_k25_maps_the_language_model_prefix(tmp_path: Path, fixture_dir) -> None:
    """Kimi-K2.5's base keeps the text model under ``language_model.``: PEFT keys carry it, kt-kernel's
    expert keys do not, and INT4 experts have ``weight_packed`` instead of ``weight``."""
    base = fixture_dir("kimi-k2.5")
    adapter = make_kt_adapter(base, tmp_path / "adapter")
    result = convert_lora(adapter, tmp_path / "out", base_dir=base, serve_python=SERVE_PYTHON)
    ours, _ = _converted(tmp_path / "out")
    assert result.rank == RANK and result.tensors == len(ours)
    assert "language_model.model.layers.1.self_attn.q_a_proj.lora_A.weight" in ours
    assert "model.layers.1.mlp.experts.7.down_proj.lora_B.weight" in ours


@needs_serve_env
@pytest.mark.slow
def test_a_converter_that_drops_expert_lora_is_caught(tmp_path: Path, fixture_dir) -> None:
    """The field failure: expert LoRA keys lost on the way to the server. A stand-in for the serving
    python runs kt-kernel's real converter, then drops expert 7's tensors from its output."""
    drop = ("import sys; from safetensors.torch import load_file, save_file; p = sys.argv[1]; "
            "t = load_file(p); save_file({k: v for k, v in t.items() if '.experts.7.' not in k}, p)")
    shim = tmp_path / "python"
    shim.write_text(f'#!/bin/sh\n"{SERVE_PYTHON}" "$@" || exit $?\n'
                    f'if [ "$1" = "-m" ]; then exec "{SERVE_PYTHON}" -c "{drop}" "$4/adapter_model.safetensors"; fi\n')
    shim.chmod(0o755)
    base = fixture_dir("bf16")
    adapter = make_kt_adapter(base, tmp_path / "adapter")
    out = tmp_path / "out"
    with pytest.raises(KtflowError, match=r"12 missing \(e\.g\. \['model\.layers\.1\.mlp\.experts\.7\.") as info:
        convert_lora(adapter, out, base_dir=base, serve_python=shim)
    assert info.value.exit_code == 1  # the converter's fault, not the user's
    assert not out.exists() and not staging_dir_for(out).exists()


@pytest.mark.parametrize("kind", ["deepseek-v3", "kimi-k2.5"])
def test_validate_adapter_on_quantized_bases(tmp_path: Path, fixture_dir, kind: str) -> None:
    base = fixture_dir(kind)
    adapter = make_kt_adapter(base, tmp_path / "adapter")
    rank, targets = validate_adapter(adapter, base)
    assert rank == RANK and targets == [*ATTENTION, "down_proj", "gate_proj", "up_proj"]


# --------------------------------------------------------------------------- refusals


def _set(key_part: str, shape: tuple[int, ...], *, fused: bool = False) -> Mutate:
    def mutate(peft: dict, experts: dict, config: dict) -> None:
        target = experts if fused else peft
        key = next(k for k in target if key_part in k)
        target[key] = torch.zeros(shape, dtype=target[key].dtype)
    return mutate


def _add_q_proj(peft: dict, experts: dict, config: dict) -> None:  # DeepSeek-V3 has q_a/q_b_proj, no q_proj
    peft["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"] = torch.zeros(RANK, 256)
    peft["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"] = torch.zeros(192, RANK)
    config["target_modules"].append("q_proj")


def _dense_layer_experts(peft: dict, experts: dict, config: dict) -> None:
    for name in FUSED:
        experts[f"layers.0.experts.{name}"] = experts[f"layers.1.experts.{name}"].clone()


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


REJECTIONS = {
    # name: (mutate, after-build edit, fused, manifest, error pattern)
    "tampered-file": (None, lambda a: _flip_last_byte(a / "adapter_model.safetensors"), True, True,
                      r"adapter_model\.safetensors: has sha256 [0-9a-f]{64}, but kt_adapter_manifest\.json says"),
    "missing-file": (None, lambda a: (a / "fused_expert_lora.safetensors").unlink(), True, True,
                     r"fused_expert_lora\.safetensors: is listed in kt_adapter_manifest\.json but missing"),
    "not-ready": (None, lambda a: write_kt_manifest(a, a, status="saving"), True, True, r"status: is 'saving'"),
    "fused-without-manifest": (None, None, True, False, r"kt_adapter_manifest\.json: is missing, but fused"),
    "rank-4-peft": (_set("layers.1.self_attn.q_a_proj.lora_A", (4, 256)), None, True, True,
                    r"q_a_proj\.lora_A\.weight': has shape \[4, 256\]: rank 4, but adapter_config\.json says r=8"),
    "rank-4-fused": (_set("layers.2.experts.up_lora_a", (8, 4, 256), fused=True), None, True, True,
                     r"layers\.2\.experts\.up_lora_a': has shape \[8, 4, 256\]: rank 4, but adapter_config\.json"),
    "absent-module": (_add_q_proj, None, True, True,
                      r"q_proj\.lora_A\.weight': is LoRA for module 'model\.layers\.1\.self_attn\.q_proj', which the "
                      r"base checkpoint .* does not have"),
    "shape": (_set("layers.0.self_attn.q_b_proj.lora_B", (100, 8)), None, True, True,
              r"q_b_proj\.lora_B\.weight': has shape \[100, 8\], but the base weight "
              r"'model\.layers\.0\.self_attn\.q_b_proj\.weight' is \[192, 128\], so lora_B must be \[192, 8\]"),
    "experts-on-dense-layer": (_dense_layer_experts, None, True, True,
                               r"layers\.0\.experts\.down_lora_a': is expert LoRA for layer 0, but the base"),
    "kt-wrapper-in-plain-peft": (lambda p, e, c: _wrap_layer(p, 2), None, False, False,
                                 r"orig_module\.layers\.2\.self_attn\.\w+\.orig_module\.lora_A\.weight'.*does not "
                                 r"have.*wrapper name '\.orig_module'"),
    "target-modules-disagree": (lambda p, e, c: c["target_modules"].remove("o_proj"), None, True, True,
                                r"target_modules: is \[.*\], which does not cover module 'model\.layers\.0\.self_attn"
                                r"\.o_proj'"),
    "truncated-plain-peft": (None, lambda a: os.truncate(a / "adapter_model.safetensors", 4096), False, False,
                             r"adapter_model\.safetensors.*truncated"),
    "alpha-missing": (lambda p, e, c: c.pop("lora_alpha"), None, True, True, r"lora_alpha: is None"),
}


def _wrap_layer(peft: dict[str, torch.Tensor], layer: int) -> None:
    """Rename one layer's attention LoRA keys to KTransformers' wrapper form (``.orig_module``)."""
    for key in [k for k in peft if f".layers.{layer}.self_attn." in k]:
        module, matrix = key.rsplit(".lora_", 1)
        root, rest = module.split(f".layers.{layer}.", 1)
        peft[f"{root}.orig_module.layers.{layer}.{rest}.orig_module.lora_{matrix}"] = peft.pop(key)


@pytest.mark.parametrize("case", sorted(REJECTIONS))
def test_bad_adapter_is_refused_and_nothing_is_published(tmp_path: Path, fixture_dir, case: str) -> None:
    mutate, edit, fused, manifest, pattern = REJECTIONS[case]
    base = fixture_dir("bf16")
    adapter = make_kt_adapter(base, tmp_path / "adapter", mutate=mutate, fused=fused, manifest=manifest)
    if edit:
        edit(adapter)
    out = tmp_path / "out"
    with pytest.raises(AdapterError, match=pattern) as info:
        convert_lora(adapter, out, base_dir=base, serve_python=SERVE_PYTHON)
    assert info.value.exit_code == 2 and info.value.fix
    assert not out.exists() and not staging_dir_for(out).exists()
    with pytest.raises(AdapterError, match=pattern):
        validate_adapter(adapter, base)


def test_lora_alpha_that_contradicts_the_config_is_refused(tmp_path: Path, fixture_dir) -> None:
    base = fixture_dir("bf16")
    adapter = make_kt_adapter(base, tmp_path / "adapter", fused=False, manifest=False,
                              mutate=lambda p, e, c: [p.pop(k) for k in [k for k in p if "orig_module" in k]])
    with pytest.raises(AdapterError, match=r"lora_alpha: is 16, but lora_alpha 32 was given"):
        convert_lora(adapter, tmp_path / "out", base_dir=base, serve_python=SERVE_PYTHON, lora_alpha=32)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- plain PEFT passthrough

PEFT_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                "down_proj"]


@pytest.fixture(scope="module")
def peft_adapter(fixture_dir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter saved by PEFT 0.18.1 itself (training toolchain), loading the base by a relative path."""
    if not TRAIN_PYTHON.exists():
        pytest.skip("training toolchain not installed (make train-env)")
    return save_peft_adapter(fixture_dir("bf16"), tmp_path_factory.mktemp("peft") / "adapter")


def save_peft_adapter(base: Path, out: Path) -> Path:
    """A rank-8 LoRA adapter on ``base`` with random (non-zero) B, saved by PEFT itself in the
    training toolchain; its config names the base by a relative path."""
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from peft import LoraConfig, get_peft_model\n"
        "torch.manual_seed(0)\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)\n"
        f"config = LoraConfig(r={RANK}, lora_alpha={ALPHA}, target_modules={PEFT_TARGETS!r}, task_type='CAUSAL_LM',"
        " init_lora_weights=False)\n"
        "get_peft_model(model, config).save_pretrained(sys.argv[2])\n"
    )
    done = subprocess.run([str(TRAIN_PYTHON), "-c", code, base.name, str(out)], cwd=base.parent,
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@needs_train_env
@pytest.mark.slow
def test_plain_peft_adapter_passes_through_validated(tmp_path: Path, fixture_dir, peft_adapter: Path) -> None:
    base = fixture_dir("bf16")
    source_config = json.loads((peft_adapter / "adapter_config.json").read_text())
    assert source_config["base_model_name_or_path"] == base.name  # relative, as PEFT saw it
    out = tmp_path / "out"
    # serve_python is not needed without a fused expert LoRA: nothing is converted.
    result = convert_lora(peft_adapter, out, base_dir=base, serve_python=tmp_path / "no-such-python")
    assert result.kind == "peft" and not result.cached and result.rank == RANK
    assert sorted(result.target_modules) == sorted(PEFT_TARGETS)
    assert (out / "adapter_model.safetensors").read_bytes() == (peft_adapter / "adapter_model.safetensors").read_bytes()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    assert config == {**source_config, "base_model_name_or_path": str(base.resolve())}
    with safe_open(out / "adapter_model.safetensors", framework="pt") as f:
        keys = list(f.keys())
    assert result.tensors == len(keys) and all(k.startswith("base_model.model.model.layers.") for k in keys)
    # transformers 5 fuses the routed experts into 3-D parameters, so plain PEFT puts no LoRA on them.
    assert not any(".mlp.experts." in k for k in keys)
    assert validate_adapter(out, base) == (RANK, result.target_modules)

    again = convert_lora(peft_adapter, out, base_dir=base, serve_python=tmp_path / "no-such-python")
    assert again.cached and again.manifest_digest == result.manifest_digest


@needs_train_env
@pytest.mark.slow
def test_plain_peft_adapter_with_a_wrong_rank_config_is_refused(tmp_path: Path, peft_adapter: Path,
                                                                 fixture_dir) -> None:
    adapter = tmp_path / "adapter"
    shutil.copytree(peft_adapter, adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "r": 4}))
    with pytest.raises(AdapterError, match=r"lora_A\.weight': has shape \[8, \d+\]: rank 8, but adapter_config"
                                           r"\.json says r=4"):
        convert_lora(adapter, tmp_path / "out", base_dir=fixture_dir("bf16"), serve_python=SERVE_PYTHON)
    assert not (tmp_path / "out").exists()
