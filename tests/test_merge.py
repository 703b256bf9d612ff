"""The merge stage: a converted adapter folded into its base, as BF16, Kimi INT4 (RAWINT4) and kt-kernel's
AMXINT8/AMXINT4; checked against float32 references, PEFT, the INT4 encode rule and quantize-int8 itself,
cached, kill -9 safe, streaming, and refusing what cannot work before anything is written."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ktflow.errors import AdapterError, HostRequirementError, InvalidInputError
from ktflow.formats.quant_decode import decode_int4_pack_quantized
from ktflow.formats.quant_encode import encode_int4_pack_quantized, int4_codes, pack_int4
from ktflow.stages import merge as merge_stage
from ktflow.stages.merge import merge_adapter
from ktflow.store import StageManifest, StoreLayout, atomic_write_json, read_manifest, staging_dir_for

REPO = Path(__file__).resolve().parent.parent
SERVE_PYTHON = REPO / ".venv-serve" / "bin" / "python"
needs_serve_env = pytest.mark.skipif(not SERVE_PYTHON.exists(), reason="serving toolchain not installed (make serve-env)")
RANK, ALPHA = 8, 16
ATTENTION = ("q_a_proj", "kv_a_proj_with_mqa", "o_proj")


# --------------------------------------------------------------------------- adapters as convert-lora writes them


def _index(base: Path) -> dict[str, str]:
    return json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]


def _base_tensor(base: Path, name: str) -> torch.Tensor:
    with safe_open(base / _index(base)[name], framework="pt") as f:
        return f.get_tensor(name)


def _text_config(base: Path) -> dict:
    config = json.loads((base / "config.json").read_text())
    return config.get("text_config", config)


def make_converted_adapter(base: Path, out: Path, *, seed: int = 0, zero: bool = False, config: dict | None = None,
                           std: float = 0.05) -> Path:
    """What kt-kernel's converter writes for a KT fused adapter of ``base``: non-expert PEFT keys (float32, with
    Kimi-K2.5's ``language_model.`` where the base has it), per-expert ``model.layers.L.mlp.experts.E.*`` keys
    (BF16, never prefixed), no ``base_model.model.``; ``zero``: every B is 0 (the merge changes nothing)."""
    text, index = _text_config(base), _index(base)
    prefix = "language_model." if any(k.startswith("language_model.") for k in index) else ""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}

    def pair(module: str, rows: int, cols: int, dtype: torch.dtype) -> None:
        tensors[f"{module}.lora_A.weight"] = (torch.randn(RANK, cols, generator=gen) * std).to(dtype)
        b = torch.randn(rows, RANK, generator=gen) * std
        tensors[f"{module}.lora_B.weight"] = (b * 0 if zero else b).to(dtype)

    with safe_open(base / index[f"{prefix}model.layers.0.self_attn.o_proj.weight"], framework="pt"):
        pass
    for layer in range(text["num_hidden_layers"]):
        for proj in ATTENTION:
            name = f"{prefix}model.layers.{layer}.self_attn.{proj}.weight"
            with safe_open(base / index[name], framework="pt") as f:
                rows, cols = f.get_slice(name).get_shape()
            pair(f"{prefix}model.layers.{layer}.self_attn.{proj}", rows, cols, torch.float32)
    e, h, i = text["n_routed_experts"], text["hidden_size"], text["moe_intermediate_size"]
    for layer in range(text["first_k_dense_replace"], text["num_hidden_layers"]):
        for expert in range(e):
            for proj, (rows, cols) in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
                pair(f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj", rows, cols, torch.bfloat16)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = {"base_model_name_or_path": str(base), "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK,
           "lora_alpha": ALPHA, "lora_dropout": 0.0, "bias": "none",
           "target_modules": [*ATTENTION, "gate_proj", "up_proj", "down_proj"], "use_dora": False,
           "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}}
    cfg.update(config or {})
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _bf16_ulp_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance, in BF16 steps, between two BF16 tensors of one sign pattern."""
    ai, bi = a.view(torch.int16).to(torch.int32), b.view(torch.int16).to(torch.int32)
    return int((ai - bi).abs().max())


def _within_bf16_rounding(merged: torch.Tensor, base: Path, adapter: Path, name: str, module_key: str) -> bool:
    """``merged`` is the float32 reference ``W + (alpha / r) * B @ A`` rounded to BF16: within half a BF16 step of
    it, give or take the reference's own float32 rounding."""
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    w = _base_tensor(base, name).float()
    a, b = lora[f"{module_key}.lora_A.weight"].float(), lora[f"{module_key}.lora_B.weight"].float()
    delta = (ALPHA / RANK) * (b @ a)
    ref = w + delta
    half_step = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 8)
    slack = 1e-6 * (w.abs() + delta.abs())
    return bool(((merged.float() - ref).abs() <= half_step + slack).all())


def _out_tensors(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(_index(out).values())):
        tensors.update(load_file(str(out / shard)))
    return tensors


def _file_bytes(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != "manifest.json"}


# --------------------------------------------------------------------------- the INT4 encode rule


def test_int4_encode_of_a_decoded_kimi_weight_gives_back_its_bits() -> None:
    """On-grid weights (decoded Kimi INT4, some |q| = 7 a group, as Kimi's absmax/7 scales make): encode(decode(x))
    is x's packed codes and BF16 scales bit for bit, over scales spanning 2^-20..2^4."""
    gen = torch.Generator().manual_seed(7)
    rows, cols = 2048, 512
    q = torch.randint(-7, 8, (rows, cols), generator=gen)
    sign = torch.randint(0, 2, (rows, cols // 32), generator=gen) * 2 - 1
    q.view(rows, -1, 32)[:, :, 3] = 7 * sign
    scale = torch.exp2(torch.rand(rows, cols // 32, generator=gen) * 24 - 20).to(torch.bfloat16)
    packed = pack_int4(q.to(torch.int8))
    weight = decode_int4_pack_quantized(packed, scale, (rows, cols))
    new_packed, new_scale, shape = encode_int4_pack_quantized(weight)
    assert torch.equal(new_scale.view(torch.int16), scale.view(torch.int16))
    assert torch.equal(new_packed, packed)
    assert shape.tolist() == [rows, cols] and shape.dtype == torch.int32


def test_int4_encode_is_the_nearest_grid_point_for_its_scale() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(512, 256, generator=gen) * 0.02).to(torch.bfloat16)
    packed, scale, _ = encode_int4_pack_quantized(weight)
    codes = int4_codes(weight, scale)
    assert torch.equal(pack_int4(codes), packed)
    w, s = weight.float().view(512, 8, 32), scale.float().unsqueeze(-1)
    assert bool(((w / s - codes.float().view(512, 8, 32)).abs() <= 0.5 + 1e-6).all())  # nearest grid point
    absmax7 = (w.abs().amax(-1) / 7).to(torch.bfloat16).view(torch.int16).to(torch.int32)
    assert int((scale.view(torch.int16).to(torch.int32) - absmax7).abs().max()) <= 1  # Kimi's absmax/7, +-1 step
    with pytest.raises(InvalidInputError, match="whole groups of 32"):
        encode_int4_pack_quantized(torch.zeros(4, 48))


# --------------------------------------------------------------------------- BF16


def test_bf16_merge_is_the_float32_reference_to_bf16_rounding(fixture_dir, tmp_path: Path) -> None:
    base = fixture_dir("bf16")
    adapter = make_converted_adapter(base, tmp_path / "adapter")
    seen: list[tuple[int, int]] = []
    result = merge_adapter(base, adapter, tmp_path / "out", method="BF16", progress=lambda a, b: seen.append((a, b)))
    out = result.path
    assert not result.cached and result.method == "BF16" and seen[-1] == (result.shards, result.shards)
    text = _text_config(base)
    experts = (text["num_hidden_layers"] - text["first_k_dense_replace"]) * text["n_routed_experts"] * 3
    assert result.tensors_merged == len(ATTENTION) * text["num_hidden_layers"] + experts
    merged = _out_tensors(out)
    assert set(merged) == set(_index(base))
    for name, tensor in merged.items():
        m = re.match(r"(.+)\.weight$", name)
        module = m.group(1) if m else ""
        if module.endswith(ATTENTION) or ".mlp.experts." in module:
            assert tensor.dtype == torch.bfloat16 and _within_bf16_rounding(tensor, base, adapter, name, module), name
        else:
            assert torch.equal(tensor, _base_tensor(base, name)) and tensor.dtype == _base_tensor(base, name).dtype
    assert merged["model.layers.2.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((base / "config.json").read_text())
    assert (out / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    manifest = read_manifest(out)
    assert manifest is not None and manifest.stage == "merge" and manifest.settings == {"method": "BF16"}
    assert set(manifest.inputs) == {"base", "adapter"} and manifest.digest() == result.manifest_digest
    assert result.serve_flags == {"--model-path": str(out), "--kt-method": "BF16", "--kt-weight-path": str(out)}

    # the same inputs again: a cache hit that leaves the artifact alone
    inode = out.stat().st_ino
    again = merge_adapter(base, adapter, tmp_path / "out", method="BF16")
    assert again.cached and again.manifest_digest == result.manifest_digest and out.stat().st_ino == inode


def test_bf16_merge_equals_peft_merge_and_unload_for_the_non_expert_modules(fixture_dir, tmp_path: Path) -> None:
    peft = pytest.importorskip("peft", reason="PEFT is not installed in this environment")
    from transformers import AutoModelForCausalLM

    base = fixture_dir("bf16")
    adapter = make_converted_adapter(base, tmp_path / "adapter")
    peft_dir = tmp_path / "peft-adapter"  # PEFT's own layout: non-expert modules only, base_model.model. keys
    peft_dir.mkdir()
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    save_file({f"base_model.model.{k}": v for k, v in lora.items() if ".mlp.experts." not in k},
              str(peft_dir / "adapter_model.safetensors"))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["target_modules"] = list(ATTENTION)
    (peft_dir / "adapter_config.json").write_text(json.dumps(cfg))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    merged_by_peft = peft.PeftModel.from_pretrained(model, peft_dir).merge_and_unload().state_dict()
    ours = _out_tensors(merge_adapter(base, adapter, tmp_path / "out", method="BF16").path)
    for layer in range(_text_config(base)["num_hidden_layers"]):
        for proj in ATTENTION:
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            assert _bf16_ulp_apart(ours[name], merged_by_peft[name]) <= 1, name


# --------------------------------------------------------------------------- Kimi INT4


def test_rawint4_merge_mirrors_kimi_and_decodes_to_the_nearest_grid_of_the_merged_weights(fixture_dir,
                                                                                         tmp_path: Path) -> None:
    base = fixture_dir("kimi-k2.5")
    adapter = make_converted_adapter(base, tmp_path / "adapter")
    int4 = merge_adapter(base, adapter, tmp_path / "int4", method="RAWINT4")
    bf16 = merge_adapter(base, adapter, tmp_path / "bf16", method="BF16")
    ours, merged = _out_tensors(int4.path), _out_tensors(bf16.path)
    source = {name: _base_tensor(base, name) for name in _index(base)}
    assert sorted(ours) == sorted(source)  # the source's names, companions and language_model. nesting
    assert {n: t.dtype for n, t in ours.items()} == {n: t.dtype for n, t in source.items()}
    assert (int4.path / "config.json").read_bytes() != b"" and json.loads((int4.path / "config.json").read_text()) \
        == json.loads((base / "config.json").read_text())  # quantization_config kept: still Kimi INT4
    assert (int4.path / "modeling_kimi_k25.py").is_file()
    assert "quantization_config" not in json.loads((bf16.path / "config.json").read_text())["text_config"]
    experts = 0
    for name, packed in ours.items():
        if not name.endswith(".weight_packed"):
            if not name.endswith((".weight_scale", ".weight_shape")):
                assert torch.equal(packed, merged[name]), name  # non-expert weights: the BF16 merge's
            continue
        module = name.removesuffix("_packed")
        rows, cols = ours[module + "_shape"].tolist()
        decoded = decode_int4_pack_quantized(packed, ours[module + "_scale"], (rows, cols))
        target = merged[module]  # the merged weight, BF16
        scale = ours[module + "_scale"]
        assert torch.equal(pack_int4(int4_codes(target, scale)), packed), name  # nearest grid point of each value
        assert torch.equal(decoded, encode_and_decode(target)), name
        experts += 1
    assert experts == 2 * 8 * 3
    assert int4.tensors_merged == bf16.tensors_merged


def encode_and_decode(weight: torch.Tensor) -> torch.Tensor:
    packed, scale, _ = encode_int4_pack_quantized(weight)
    return decode_int4_pack_quantized(packed, scale, tuple(weight.shape))


def test_a_zero_lora_leaves_a_kimi_checkpoint_bit_identical(fixture_dir, tmp_path: Path) -> None:
    """Decode, merge nothing, re-encode: the experts come back bit for bit (the encode inverts Kimi's decode)."""
    base = fixture_dir("kimi-k2.5")
    adapter = make_converted_adapter(base, tmp_path / "adapter", zero=True)
    out = merge_adapter(base, adapter, tmp_path / "int4", method="RAWINT4").path
    ours = _out_tensors(out)
    for name in _index(base):
        assert torch.equal(ours[name], _base_tensor(base, name)), name


# --------------------------------------------------------------------------- kt-kernel formats


@needs_serve_env
@pytest.mark.int8_kernels
@pytest.mark.slow
def test_amxint8_merge_is_what_quantize_int8_makes_of_the_bf16_merge(fixture_dir, tmp_path: Path) -> None:
    from ktflow.stages.quantize_int8 import quantize_int8

    base = fixture_dir("bf16")
    adapter = make_converted_adapter(base, tmp_path / "adapter")
    bf16 = merge_adapter(base, adapter, tmp_path / "bf16", method="BF16")
    amx = merge_adapter(base, adapter, tmp_path / "amx", method="AMXINT8", serve_python=SERVE_PYTHON)
    int8 = quantize_int8(bf16.path, tmp_path / "int8", threadpool_count=1, serve_python=SERVE_PYTHON)
    assert _file_bytes(amx.path / "kt") == _file_bytes(int8.path)  # every shard, the index, the copied files
    assert amx.kt_layers == 2 and set(amx.verification) == {"1", "2"}
    assert all(0 < v["mean_rel_err"] < 0.05 for v in amx.verification.values())
    # the non-expert checkpoint sglang loads as --model-path: the BF16 merge without the routed experts
    non_expert = _out_tensors(amx.path)
    full = _out_tensors(bf16.path)
    assert set(non_expert) == {n for n in full if ".mlp.experts." not in n}
    assert all(torch.equal(t, full[n]) for n, t in non_expert.items())
    assert amx.serve_flags["--kt-weight-path"] == str(amx.path / "kt")
    assert amx.serve_flags["--kt-method"] == "AMXINT8" and amx.serve_flags["--kt-threadpool-count"] == 1
    again = merge_adapter(base, adapter, tmp_path / "amx", method="AMXINT8", serve_python=SERVE_PYTHON)
    assert again.cached and again.manifest_digest == amx.manifest_digest


@needs_serve_env
@pytest.mark.int8_kernels
@pytest.mark.slow
def test_amxint4_from_kimi_int4_is_the_quantizers_own_output_for_the_bf16_merge(fixture_dir, tmp_path: Path) -> None:
    """A Kimi INT4 base, merged into AMXINT4 in one pass (no BF16 copy), equals the same driver quantizing the
    BF16 merge as it is (a zero LoRA on the BF16 merge: W + 0 is W, bit for bit)."""
    base = fixture_dir("kimi-k2.5")
    adapter = make_converted_adapter(base, tmp_path / "adapter")
    bf16 = merge_adapter(base, adapter, tmp_path / "bf16", method="BF16")
    amx = merge_adapter(base, adapter, tmp_path / "amx", method="AMXINT4", serve_python=SERVE_PYTHON)
    nothing = make_converted_adapter(bf16.path, tmp_path / "zero", zero=True)
    again = merge_adapter(bf16.path, nothing, tmp_path / "amx-of-bf16", method="AMXINT4", serve_python=SERVE_PYTHON)
    assert _file_bytes(amx.path / "kt") == _file_bytes(again.path / "kt")
    print(f"\nAMXINT4 of a merged Kimi layer vs float64 BF16 MoE: "
          f"{ {k: round(v['mean_rel_err'], 4) for k, v in amx.verification.items()} }")
    assert all(0 < v["mean_rel_err"] < 0.25 for v in amx.verification.values())
    shard = load_file(str(amx.path / "kt" / "model-00001-of-00003.safetensors"))
    assert shard["blk.1.ffn_down_exps.0.numa.0.weight"].numel() == 256 * 128 // 2  # two codes a byte


# --------------------------------------------------------------------------- crash safety and streaming


_STAGE = """
import sys
from pathlib import Path
from ktflow.stages.merge import merge_adapter
merge_adapter(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), method="BF16", workers=1, fsync=True)
"""


@pytest.mark.slow
def test_kill_9_mid_run_publishes_nothing_and_the_rerun_finishes_the_same(fixture_dir, tmp_path: Path) -> None:
    base = fixture_dir("bf16", layers=8, experts=16, hidden=512, moe_intermediate=256)
    adapter = make_converted_adapter(base, tmp_path / "adapter")
    out = tmp_path / "killed"
    staging = staging_dir_for(out)
    proc = subprocess.Popen([sys.executable, "-c", _STAGE, str(base), str(adapter), str(out)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and len(list(staging.glob("model-*.safetensors"))) < 2:
        time.sleep(0.002)
    assert proc.poll() is None, "the stage ended before two shards were written"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    complete = sorted(p.name for p in staging.glob("model-*.safetensors"))
    assert 2 <= len(complete) < 9 and not out.exists()  # nothing a later stage could read

    resumed = merge_adapter(base, adapter, out, method="BF16")
    assert not resumed.cached and resumed.shards_reused >= len(complete) - 1 and resumed.shards_reused >= 1
    assert not staging.exists()
    clean = merge_adapter(base, adapter, tmp_path / "clean", method="BF16")
    assert _file_bytes(out) == _file_bytes(clean.path) and resumed.manifest_digest == clean.manifest_digest


def test_the_base_is_read_one_tensor_at_a_time_layer_by_layer(fixture_dir, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    base = fixture_dir("kimi-k2.5")
    adapter = make_converted_adapter(base, tmp_path / "adapter")
    reads: list[str] = []
    live, peak = [0], [0]
    real = merge_stage.read_base_tensor

    def counted(ckpt, name: str) -> torch.Tensor:
        reads.append(name)
        tensor = real(ckpt, name)
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        import weakref
        weakref.finalize(tensor, lambda: live.__setitem__(0, live[0] - 1))
        return tensor

    monkeypatch.setattr(merge_stage, "read_base_tensor", counted)
    merge_adapter(base, adapter, tmp_path / "out", method="RAWINT4", workers=1)
    work = [n for n in reads if not n.endswith(".weight_shape")]  # the plan reads each shape (8 bytes) first
    # every tensor once (the shapes are written from the shape itself), never a shard or a layer at once
    assert sorted(work) == sorted(n for n in _index(base) if not n.endswith(".weight_shape"))
    layers = [int(m.group(1)) + 1 if (m := re.search(r"\.layers\.(\d+)\.", n)) else 0 for n in work]
    assert layers == sorted(layers)  # layer by layer, in order
    assert peak[0] <= 3  # a packed weight, its scale and its shape at most


def test_the_adapter_header_is_read_once_not_once_a_weight(fixture_dir, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every merged weight reads its A and B through the adapter's header, read once: a read a weight would grow
    with the adapter (every expert of every layer), so the whole model's merge would grow with its depth squared."""
    base = fixture_dir("kimi-k2.5")
    adapter = make_converted_adapter(base, tmp_path / "adapter")
    reads: list[Path] = []
    real = merge_stage.read_header

    def counted(path):  # noqa: ANN001, ANN202 - the stage's own calls, by path
        reads.append(Path(path))
        return real(path)

    monkeypatch.setattr(merge_stage, "read_header", counted)
    result = merge_adapter(base, adapter, tmp_path / "out", method="RAWINT4", workers=2)
    assert result.tensors_merged > 10
    assert reads.count(adapter / "adapter_model.safetensors") == 1


# --------------------------------------------------------------------------- refusals


def _nothing_written(tmp_path: Path, out: Path, keep: set[str]) -> None:
    assert not out.exists() and not staging_dir_for(out).exists()
    assert {p.name for p in tmp_path.iterdir()} == keep


def test_an_adapter_of_another_base_is_refused_naming_the_shapes(fixture_dir, tmp_path: Path) -> None:
    adapter = make_converted_adapter(fixture_dir("bf16", hidden=384), tmp_path / "adapter")
    out = tmp_path / "out"
    with pytest.raises(AdapterError) as info:
        merge_adapter(fixture_dir("bf16"), adapter, out, method="BF16")
    assert "trained on this base" in str(info.value) and "256" in str(info.value) and "384" in str(info.value)
    _nothing_written(tmp_path, out, {"adapter"})


@pytest.mark.parametrize("change, says", [
    ({"r": "eight"}, "r: is 'eight'"),
    ({"r": 0}, "r: is 0"),
    ({"lora_alpha": None}, "lora_alpha: is None"),
    ({"lora_alpha": -4}, "lora_alpha: is -4"),
    ({"use_rslora": True}, "use_rslora: is true"),
    ({"rank_pattern": {"o_proj": 4}}, "rank_pattern: is"),
    ({"alpha_pattern": {"o_proj": 4}}, "alpha_pattern: is"),
])
def test_an_unreadable_or_unsupported_scaling_is_refused(change: dict, says: str, fixture_dir, tmp_path: Path) -> None:
    adapter = make_converted_adapter(fixture_dir("bf16"), tmp_path / "adapter", config=change)
    out = tmp_path / "out"
    with pytest.raises(AdapterError) as info:
        merge_adapter(fixture_dir("bf16"), adapter, out, method="BF16")
    assert says in str(info.value) and "Fix:" in str(info.value)
    _nothing_written(tmp_path, out, {"adapter"})


def test_a_raw_kt_training_output_is_refused_with_the_convert_hint(fixture_dir, tmp_path: Path) -> None:
    adapter = make_converted_adapter(fixture_dir("bf16"), tmp_path / "adapter")
    (adapter / "fused_expert_lora.safetensors").write_bytes(b"")
    with pytest.raises(AdapterError, match="convert-lora"):
        merge_adapter(fixture_dir("bf16"), adapter, tmp_path / "out", method="BF16")


@pytest.mark.parametrize("method, kind, says", [
    ("RAWINT4", "bf16", "--method RAWINT4: re-quantizes to the source's Kimi INT4 scheme"),
    ("INT8", "bf16", "--method INT8: is not an output format"),
    ("BF16", "deepseek-v3", "ktflow dequantize"),
])
def test_a_format_the_base_cannot_give_is_refused(method: str, kind: str, says: str, fixture_dir,
                                                  tmp_path: Path) -> None:
    base = fixture_dir(kind)
    adapter = make_converted_adapter(fixture_dir("bf16"), tmp_path / "adapter")
    with pytest.raises(InvalidInputError) as info:
        merge_adapter(base, adapter, tmp_path / "out", method=method)
    assert says in str(info.value)
    _nothing_written(tmp_path, tmp_path / "out", {"adapter"})


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4"])
def test_a_kt_kernel_format_this_cpu_cannot_serve_is_refused_before_any_work(method: str, fixture_dir, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import ktflow.host.hardware as hardware
    import ktflow.stages.merge as stage

    real = hardware.probe_host
    monkeypatch.setattr(hardware, "probe_host", lambda path=None: real(path).model_copy(update={
        "cpu_model": "Test CPU", "cpu_variant": "avx2", "native_cpu_variant": "avx2"}))
    monkeypatch.setattr(stage, "_serving_toolchain", lambda python: {"kt-kernel": "0.7.2"})
    base = fixture_dir("bf16")
    adapter = make_converted_adapter(base, tmp_path / "adapter")
    out = tmp_path / "out"
    with pytest.raises(HostRequirementError) as refused:
        merge_adapter(base, adapter, out, method=method, serve_python=tmp_path / "python")
    message = str(refused.value)
    for says in ("merge needs a avx512_base CPU or better", "AVX512F + AVX512BW", "Test CPU", "Fix: merge to"):
        assert says in message, (says, message)
    _nothing_written(tmp_path, out, {"adapter"})


def test_amxint4_refuses_a_threadpool_count_kt_kernel_cannot_split(fixture_dir, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    base = fixture_dir("bf16")  # moe_intermediate 128: T=2 gives slices of 64, kt-kernel's INT4 needs 128
    adapter = make_converted_adapter(base, tmp_path / "adapter")
    with pytest.raises(InvalidInputError, match=r"--threadpool-count 2.*slices of 64.*use --threadpool-count 1"):
        merge_adapter(base, adapter, tmp_path / "out", method="AMXINT4", threadpool_count=2,
                      serve_python=tmp_path / "python")


# --------------------------------------------------------------------------- the plan's price


def test_the_plan_prices_each_merge_method_from_the_model_size() -> None:
    from ktflow.planning.costs import COSTS
    from ktflow.planning.merge_cost import merge_estimate
    from ktflow.planning.sizing import ModelSize

    # Kimi-K2.5's text model: 1.03T parameters, 60 MoE layers of 384 experts, 595 GB as INT4
    experts = 60 * 384 * 3 * 7168 * 2048
    size = ModelSize(path="kimi", parameters=experts + 16_000_000_000, hidden_size=7168, num_layers=61,
                     vocab_size=163840, linear_shapes={}, expert_parameters=experts, stored_bytes=595 * 10**9,
                     moe_layers=60, routed_experts=384, experts_per_token=8)
    bf16, int4, int8, amx4 = (merge_estimate(size, m, cores=64) for m in ("BF16", "RAWINT4", "AMXINT8", "AMXINT4"))
    assert bf16.disk_bytes == 2 * size.parameters and bf16.seconds == bf16.disk_bytes / COSTS.dequantize_bytes_per_s
    assert int4.disk_bytes == size.stored_bytes < int8.disk_bytes < bf16.disk_bytes
    assert amx4.disk_bytes < int8.disk_bytes
    # a MoE layer's BF16 twice (the driver's buffers, kt-kernel's copy), the quantized layer and its scratch in
    # /dev/shm: not the model
    layer_bf16 = 2 * experts // 60
    # the INT8 layer as kt-kernel lays it out: a byte a weight and an fp32 scale a row (gate/up 2048 rows, down 7168)
    layer_int8 = experts // 60 + 384 * 4 * (2 * 2048 + 7168)
    assert int8.ram_bytes == 2 * layer_bf16 + 2 * layer_int8 + GIB
    assert amx4.ram_bytes < int8.ram_bytes < 100 * GIB
    assert "no merge of this method timed" in bf16.basis
    assert not any("no merge of this method timed" in e.basis for e in (int4, int8, amx4))
    # the quantized formats at the timed merges' rate: the experts' BF16 at 18.8 MB/s a core x 64, beside the write
    merge_s = 2 * experts / (COSTS.merge_expert_bytes_per_core_s * 64)
    assert int4.seconds == pytest.approx(size.stored_bytes / COSTS.dequantize_bytes_per_s + merge_s)
    assert int8.seconds == amx4.seconds == pytest.approx(merge_s + 4 * size.non_expert_parameters
                                                         / COSTS.dequantize_bytes_per_s)
    assert "one timed RAWINT4 merge" in int4.basis and int4.ram_bytes < 40 * GIB  # a worker a core, one expert weight
    with pytest.raises(ValueError, match="unknown merge method"):
        merge_estimate(size, "FP8", cores=8)


GIB = 1 << 30


def test_the_merge_rate_basis_quotes_the_timed_merges_it_was_not_fitted_on() -> None:
    """The plan's words on the merge rate (one timed RAWINT4 merge, serving/) say what every other timed RAWINT4
    merge of the slice took against its estimate, from the raw data: the range and median of those made while the
    merge read the adapter's header once a weight, and the one made since it reads it once."""
    import statistics

    from ktflow.planning.merge_cost import _MERGE_RATE_BASIS

    data = REPO / "benchmarks/data/merged-serving"
    since = {"h200-merge-header-once"}  # the merges timed after the adapter's header was read once
    before, after = [], []
    for path in sorted(data.glob("*/merge-RAWINT4.json")):
        merge = json.loads(path.read_text())
        made = merge.get("made")
        if path.parent.name == "serving" or not isinstance(made, dict) or made.get("outcome") != "ok":
            continue  # the merge the rate was fitted on; merges reused from an earlier run time nothing
        (after if path.parent.name in since else before).append(made["wall_s"] / merge["estimate"]["seconds"])
    assert len(before) == 7 and len(after) == 1
    assert (f"seven more took {min(before):.2f}-{max(before):.2f}x the estimate while the merge read the adapter's "
            f"header once a weight, one since {after[0]:.2f}x") in _MERGE_RATE_BASIS
    costs = " ".join(line.strip().lstrip("# ") for line in (REPO / "ktflow/planning/costs.py").read_text().splitlines())
    assert f"took {min(before):.2f}-{max(before):.2f}x the estimate (median {statistics.median(before):.2f}x;" in costs
    assert f"took {after[0]:.2f}x, so at one MoE layer this rate now errs long" in costs


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4"])
def test_the_amx_merge_estimate_is_held_to_its_timed_merges(method: str) -> None:
    """The AMX merges of the Kimi-K2.5 slice (one MoE layer, 16 cores) timed on a GPU host: their peak RAM as the
    quantizer's rule counts it and their disk as the estimate gives it (within 2 %), their time within the 10 % the
    cost model's comment quotes."""
    from ktflow.planning.merge_cost import kt_quantizer_layer_ram, merge_estimate
    from ktflow.planning.sizing import ModelSize

    data = REPO / "benchmarks/data/merged-serving/h200-methods"
    fixture = json.loads((data / "fixture.json").read_text())
    dims = fixture["dims"]
    experts = dims["n_routed_experts"] * 3 * dims["hidden_size"] * dims["moe_intermediate_size"]
    size = ModelSize(path="slice", parameters=fixture["parameters"], hidden_size=dims["hidden_size"],
                     num_layers=dims["num_hidden_layers"], vocab_size=dims["vocab_size"], linear_shapes={},
                     expert_parameters=experts, moe_layers=1, routed_experts=dims["n_routed_experts"],
                     experts_per_token=dims["num_experts_per_tok"])
    levers = json.loads((data / "levers.json").read_text())
    # AMXINT4 made by its own merge step; AMXINT8 inside the methods step (its merge step ran before the serving
    # toolchain it needs was installed, and said so)
    merge = (json.loads((data / "merge-AMXINT4.json").read_text()) if method == "AMXINT4"
             else levers["methods"]["AMXINT8"]["merge"])
    made = merge["made"]
    assert made["outcome"] == "ok"
    estimate = merge_estimate(size, method, cores=16)
    # the peak RSS is the driver's working set without kt-kernel's scratch (a tmpfs there, which RSS does not count)
    # the quantized layer as kt-kernel lays it out: the codes and an fp32 scale a row of each projection
    rows = dims["n_routed_experts"] * (2 * dims["moe_intermediate_size"] + dims["hidden_size"])
    layer_quant = experts * (8 if method == "AMXINT8" else 4) // 8 + 4 * rows
    working = kt_quantizer_layer_ram(2 * experts, layer_quant, scratch_in_ram=False) + GIB
    assert made["peak_host_rss_gib"] * GIB == pytest.approx(working, rel=0.02)
    assert estimate.ram_bytes == working + layer_quant  # the plan counts the scratch in /dev/shm too
    assert merge["bytes_on_disk"] == pytest.approx(estimate.disk_bytes, rel=0.02)
    assert 0.95 < made["wall_s"] / estimate.seconds < 1.11


def test_the_merge_command_merges_and_says_how_to_serve_it(fixture_dir, tmp_path: Path, capsys) -> None:
    from ktflow.cli import main

    base = fixture_dir("bf16")
    adapter = make_converted_adapter(base, tmp_path / "adapter", seed=3)
    out = tmp_path / "merged"
    assert main(["merge", str(base), str(adapter), str(out), "--method", "BF16", "--no-fsync"]) == 0
    printed = capsys.readouterr().out
    assert f"-> {out}" in printed and f"--kt-weight-path {out}" in printed and "--kt-method BF16" in printed
    assert read_manifest(out).stage == "merge"
    assert main(["merge", str(base), str(adapter), str(out), "--method", "BF16"]) == 0
    assert "merge: cache hit" in capsys.readouterr().out


# --------------------------------------------------------------------------- room for a new merge


def _published_merges(tmp_path: Path, sizes: dict[str, int]) -> StoreLayout:
    """A store with a published merge of ``size`` bytes for each name, oldest first in the dict's order."""
    layout = StoreLayout(root=tmp_path / "store")
    for age, (name, size) in enumerate(sizes.items()):
        merged = layout.merged(name)
        merged.mkdir(parents=True)
        (merged / "model.safetensors").write_bytes(b"\0" * size)
        atomic_write_json(merged / "manifest.json", StageManifest(stage="merge", inputs={"name": name}).model_dump(
            mode="json"))
        os.utime(merged / "manifest.json", (1000 + age, 1000 + age))
    return layout


def _disk_of(layout: StoreLayout, capacity: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The merges' filesystem holds ``capacity`` bytes (the store's merges are all that is on it)."""
    import ktflow.store

    root = layout.merged("")
    monkeypatch.setattr(ktflow.store, "free_bytes", lambda path: capacity - sum(
        f.stat().st_size for f in root.rglob("*") if f.is_file()))


def test_room_for_a_merge_removes_the_oldest_merges_not_kept_and_stops_when_there_is_enough(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = _published_merges(tmp_path, {"a": 1000, "b": 1000, "c": 1000, "d": 1000})
    _disk_of(layout, 4500, monkeypatch)  # 500 free
    said: list[str] = []
    removed = merge_stage.evict_merges(layout, 1900, keep=[layout.merged("a")], log=said.append)
    # "a" is kept (a server reads it), "b" then "c" go: 2,500 free; "d", the newest, stays
    assert removed == [layout.merged("b"), layout.merged("c")]
    assert [p.name for p in merge_stage.stored_merges(layout)] == ["a", "d"]
    assert len(said) == 2 and said[0].startswith(f"removed the merge {layout.merged('b')} (")
    assert not list(layout.merged("").glob(".*"))  # no lock, staging or half-removed merge left


def test_room_for_a_merge_never_removes_a_merge_being_written_or_kept_and_clears_a_crashed_removal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ktflow.store import artifact_lock

    layout = _published_merges(tmp_path, {"a": 1000, "b": 1000})
    crashed = layout.merged("").joinpath(".old" + merge_stage.EVICTING_SUFFIX)
    crashed.mkdir()
    (crashed / "model.safetensors").write_bytes(b"\0" * 1000)
    _disk_of(layout, 3000, monkeypatch)  # 0 free
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from ktflow.store import artifact_lock\n"
        f"with artifact_lock(Path({str(layout.merged('a'))!r})):\n"
        "    print('held', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        removed = merge_stage.evict_merges(layout, 2000, keep=[layout.merged("b")])
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert removed == [] and not crashed.exists()  # the crashed removal's leftover is cleared first
    assert [p.name for p in merge_stage.stored_merges(layout)] == ["a", "b"]  # "a" locked, "b" kept
    with artifact_lock(layout.merged("a")):
        pass


def test_room_for_a_merge_removes_nothing_when_every_removable_merge_would_not_make_enough(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = _published_merges(tmp_path, {"a": 1000, "b": 1000, "c": 1000})
    _disk_of(layout, 3200, monkeypatch)  # 200 free; "a" and "b" could go: 2,200 free, 2,500 needed
    said: list[str] = []
    assert merge_stage.evict_merges(layout, 2500, keep=[layout.merged("c")], log=said.append) == []
    assert [p.name for p in merge_stage.stored_merges(layout)] == ["a", "b", "c"]
    assert len(said) == 1 and said[0].startswith("kept the store's 2 merge(s) no server reads")


def test_the_merge_depth_benchmark_runs_and_reports_every_depth(tmp_path: Path) -> None:
    """benchmarks/merge_depth.py end to end at a small size: each depth merged in its own process, its seconds a MoE
    layer set against the shallowest depth's (correctness only; the timings are its to print)."""
    out = tmp_path / "depth.json"
    done = subprocess.run([sys.executable, "benchmarks/merge_depth.py", "--depths", "2,1", "--experts", "8",
                           "--workers", "2", "--workdir", str(tmp_path / "work"), "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [run["moe_layers"] for run in runs] == [1, 2]
    # every expert's three matrices and the attention's five projections a layer (the dense layer too)
    assert [run["tensors_merged"] for run in runs] == [8 * 3 + 5 * 2, 2 * 8 * 3 + 5 * 3]
    assert runs[0]["over_shallowest"] == 1.0 and runs[1]["over_shallowest"] > 0
    assert "a MoE layer / the shallowest's" in done.stdout
    assert not list((tmp_path / "work").iterdir())  # each depth's checkpoints removed
