"""The streaming INT4/FP8 -> BF16 dequantizer: bit-exact against compressed-tensors, loadable,
resumable after kill -9, and refusing corrupt input before publishing anything."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ktflow.errors import CheckpointError, InvalidInputError
from ktflow.stages.dequantize import decode_fp8_block, decode_int4_pack_quantized, dequantize_checkpoint
from ktflow.store import read_manifest, staging_dir_for

QUANTIZED_KINDS = ["kimi-k2.5", "kimi-k2", "deepseek-v3"]


def all_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def assert_bit_identical(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(ref)
    for name, tensor in ref.items():
        mine = ours[name]
        assert mine.dtype == tensor.dtype, name
        assert mine.shape == tensor.shape, name
        assert torch.equal(mine.view(torch.uint8) if mine.dtype == torch.bool else mine.contiguous().view(torch.uint8),
                           tensor.contiguous().view(torch.uint8)), name


# --------------------------------------------------------------------------- kernels


@pytest.mark.parametrize(("rows", "cols"), [(16, 64), (5, 50), (3, 33), (7, 8), (2, 1)])
def test_int4_kernel_matches_compressed_tensors_on_odd_shapes(rows: int, cols: int) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    g = torch.Generator().manual_seed(rows * 1000 + cols)
    q = torch.randint(-8, 8, (rows, cols), generator=g, dtype=torch.int8)
    groups = (cols + 31) // 32
    scale = (torch.rand(rows, groups, generator=g) * 0.1 + 1e-3).to(torch.bfloat16)
    packed = pack_to_int32(q, 4)
    reference_q = unpack_from_int32(packed, 4, torch.Size((rows, cols)))
    assert torch.equal(reference_q.to(torch.int8), q)
    expanded = scale.repeat_interleave(32, dim=1)[:, :cols]
    reference = reference_q.to(torch.bfloat16) * expanded  # compressed-tensors multiplies in bf16
    ours = decode_int4_pack_quantized(packed, scale, (rows, cols))
    assert torch.equal(ours.view(torch.int16), reference.view(torch.int16))


def test_int4_kernel_uses_every_code_including_minus_8() -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.arange(-8, 8, dtype=torch.int8).repeat(2, 2)  # [2, 32]
    scale = torch.tensor([[0.5], [2.0]], dtype=torch.bfloat16)
    ours = decode_int4_pack_quantized(pack_to_int32(q, 4), scale, (2, 32))
    assert torch.equal(ours, (q.float() * scale.float()).to(torch.bfloat16))


@pytest.mark.parametrize(("rows", "cols"), [(256, 256), (160, 256), (300, 130)])
def test_fp8_kernel_handles_partial_blocks(rows: int, cols: int) -> None:
    g = torch.Generator().manual_seed(rows + cols)
    x = (torch.randn(rows, cols, generator=g) * 100).to(torch.float8_e4m3fn)
    scale_inv = torch.rand((rows + 127) // 128, (cols + 127) // 128, generator=g) + 0.01
    full = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    expected = (x.float() * full).to(torch.bfloat16)
    assert torch.equal(decode_fp8_block(x, scale_inv).view(torch.int16), expected.view(torch.int16))


# --------------------------------------------------------------------------- whole checkpoints


@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
def test_bit_exact_against_compressed_tensors(kind: str, fixture_dir, reference_bf16_dir, tmp_path: Path) -> None:
    src = fixture_dir(kind)
    result = dequantize_checkpoint(src, tmp_path / "out", workers=2)
    assert result.tensors_decoded > 0 and not result.reused_source
    assert_bit_identical(all_tensors(tmp_path / "out"), all_tensors(reference_bf16_dir(kind)))


@pytest.mark.parametrize("kind", ["kimi-k2.5", "kimi-k2"])
def test_output_checkpoint_is_complete(kind: str, fixture_dir, tmp_path: Path) -> None:
    src = fixture_dir(kind)
    out = tmp_path / "out"
    dequantize_checkpoint(src, out, workers=2)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in json.dumps(config)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards == sorted(p.name for p in src.glob("*.safetensors"))  # one output shard per input shard
    sizes = 0
    for shard in shards:
        with safe_open(out / shard, "pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == shard
                t = f.get_tensor(name)
                sizes += t.numel() * t.element_size()
                assert not name.endswith(("weight_packed", "weight_scale", "weight_shape"))
                if name.endswith("e_score_correction_bias"):
                    assert t.dtype == torch.float32  # fp32 stays fp32
    assert index["metadata"]["total_size"] == sizes
    copied = {p.name for p in src.iterdir() if p.is_file() and not p.name.endswith(".safetensors")} - {
        "config.json", "model.safetensors.index.json"}
    assert copied and copied <= {p.name for p in out.iterdir()}
    manifest = read_manifest(out)
    assert manifest is not None and manifest.stage == "dequantize"
    assert {f.path for f in manifest.files} >= set(shards)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "remote"), [("kimi-k2.5", True), ("deepseek-v3", False)])
def test_output_loads_in_transformers_close_to_the_original(kind: str, remote: bool, fixture_dir, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    dequantize_checkpoint(fixture_dir(kind), out, workers=2)
    tuned = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=remote, dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(fixture_dir("bf16"), dtype=torch.float32)
    ids = torch.randint(0, original.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = tuned(input_ids=ids).logits
        b = original(input_ids=ids).logits
    assert torch.isfinite(a).all()
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert cos > 0.98, float(cos)


def test_bf16_source_is_reused(fixture_dir, tmp_path: Path) -> None:
    src = fixture_dir("bf16")
    result = dequantize_checkpoint(src, tmp_path / "out")
    assert result.reused_source and result.path == src
    assert not (tmp_path / "out").exists()


def test_second_run_is_a_cache_hit(fixture_dir, tmp_path: Path) -> None:
    src = fixture_dir("kimi-k2")
    first = dequantize_checkpoint(src, tmp_path / "out", workers=1)
    second = dequantize_checkpoint(src, tmp_path / "out", workers=1)
    assert not first.cached and second.cached
    assert second.manifest_digest == first.manifest_digest


def test_refuses_an_existing_foreign_directory(fixture_dir, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("x")
    with pytest.raises(InvalidInputError, match="not a ktflow artifact"):
        dequantize_checkpoint(fixture_dir("kimi-k2"), tmp_path / "out")
    assert (tmp_path / "out" / "precious.txt").exists()


# --------------------------------------------------------------------------- kill -9 and resume

_KILLER = """
import os, signal, sys
from ktflow.stages.dequantize import dequantize_checkpoint
limit = int(sys.argv[3])
def progress(done, total):
    if done >= limit:
        os.kill(os.getpid(), signal.SIGKILL)
dequantize_checkpoint(sys.argv[1], sys.argv[2], workers=2, progress=progress)
"""


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kill_9_then_rerun_is_bit_identical(seed: int, fixture_dir, tmp_path: Path) -> None:
    src = fixture_dir("kimi-k2.5")
    clean = tmp_path / "clean"
    total = dequantize_checkpoint(src, clean, workers=2).bytes_written
    out = tmp_path / "out"
    limit = random.Random(seed).randrange(1, total)
    killed = subprocess.run([sys.executable, "-c", _KILLER, str(src), str(out), str(limit)], capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    assert not out.exists()  # nothing visible under the final name
    staging = staging_dir_for(out)
    for shard in staging.glob("*.safetensors"):  # shards under their final name are whole
        load_file(shard)
    result = dequantize_checkpoint(src, out, workers=2)
    assert not result.cached
    assert_bit_identical(all_tensors(out), all_tensors(clean))
    assert not staging.exists()


def test_a_changed_source_restarts_the_staging_dir(fixture_dir, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("kimi-k2"), src)
    out = tmp_path / "out"
    staging = staging_dir_for(out)
    staging.mkdir()
    (staging / ".ktflow-dequantize.json").write_text(json.dumps({"identity": {"files": {}, "upstream": None}}))
    stale = staging / sorted(p.name for p in src.glob("*.safetensors"))[0]
    stale.write_bytes(b"stale shard from another source")
    dequantize_checkpoint(src, out, workers=1)
    load_file(out / stale.name)  # rewritten, not trusted


# --------------------------------------------------------------------------- corrupt input


def _first_shard(directory: Path) -> Path:
    return sorted(directory.glob("model-*.safetensors"))[0]


def _rewrite(shard: Path, edit) -> None:
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def corrupt_truncate(src: Path) -> str:
    shard = _first_shard(src)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    return shard.name


def corrupt_header_offsets(src: Path) -> str:
    shard = _first_shard(src)
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 4  # lie about where the tensor ends
    text = json.dumps(header).encode().ljust(n)
    data[8 : 8 + n] = text[:n] if len(text) >= n else text
    shard.write_bytes(bytes(data))
    return shard.name


def corrupt_missing_companion(src: Path) -> str:
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    victim = next(k for k in index["weight_map"] if k.endswith(".weight_scale"))
    shard = src / index["weight_map"].pop(victim)
    index_path.write_text(json.dumps(index))
    _rewrite(shard, lambda t: t.pop(victim))
    return victim.removesuffix("_scale") + "_packed"


def corrupt_scale_dtype(src: Path) -> str:
    index = json.loads((src / "model.safetensors.index.json").read_text())
    victim = next(k for k in index["weight_map"] if k.endswith(".weight_scale"))

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[victim] = t[victim].to(torch.float16)

    _rewrite(src / index["weight_map"][victim], edit)
    return victim


@pytest.mark.parametrize(
    "corrupt", [corrupt_truncate, corrupt_header_offsets, corrupt_missing_companion, corrupt_scale_dtype]
)
def test_corrupt_input_is_refused_before_anything_is_published(corrupt, fixture_dir, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("kimi-k2.5"), src)
    named = corrupt(src)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as info:
        dequantize_checkpoint(src, out, workers=1)
    assert named in str(info.value)
    assert not out.exists()


def test_cli_corrupt_input_exits_2(fixture_dir, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("kimi-k2"), src)
    shard = corrupt_truncate(src)
    result = subprocess.run(
        [sys.executable, "-m", "ktflow.cli", "dequantize", str(src), str(tmp_path / "out")],
        capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert shard in result.stderr
    assert not (tmp_path / "out").exists()


def test_cli_dequantize_prints_a_summary(fixture_dir, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ktflow.cli", "dequantize", str(fixture_dir("deepseek-v3")), str(tmp_path / "out"),
         "--workers", "2"],
        capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stderr
    assert "deepseek-v3-fp8" in result.stdout
    assert (tmp_path / "out" / "manifest.json").exists()


def test_int4_kernel_reused_buffers_give_the_same_bits() -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    results = []
    for seed, (rows, cols) in enumerate([(64, 256), (32, 128), (64, 256)]):
        g = torch.Generator().manual_seed(seed)
        q = torch.randint(-8, 8, (rows, cols), generator=g, dtype=torch.int8)
        scale = (torch.rand(rows, cols // 32, generator=g) + 0.01).to(torch.bfloat16)
        packed = pack_to_int32(q, 4)
        fresh = decode_int4_pack_quantized(packed, scale, (rows, cols))
        reused = decode_int4_pack_quantized(packed, scale, (rows, cols), reuse_buffers=True).clone()
        assert torch.equal(fresh.view(torch.int16), reused.view(torch.int16))
        into = torch.full((rows, cols), float("nan"), dtype=torch.bfloat16)  # quantize-int8's driver decodes in place
        assert decode_int4_pack_quantized(packed, scale, (rows, cols), out=into) is into
        assert torch.equal(fresh.view(torch.int16), into.view(torch.int16))
        results.append(reused)
    assert not torch.equal(results[0], results[2])  # different seeds, and no stale scratch leaked
    # a shape off the fast path (a partial scale group) decodes into ``out`` alike
    q = torch.randint(-8, 8, (3, 40), generator=torch.Generator().manual_seed(7), dtype=torch.int8)
    scale = torch.full((3, 2), 0.5, dtype=torch.bfloat16)
    into = torch.empty(3, 40, dtype=torch.bfloat16)
    decode_int4_pack_quantized(pack_to_int32(q, 4), scale, (3, 40), out=into)
    assert torch.equal(into, decode_int4_pack_quantized(pack_to_int32(q, 4), scale, (3, 40)))
    assert torch.equal(into, (q.float() * 0.5).to(torch.bfloat16))


@pytest.mark.parametrize("chunk", [64, 1000])
@pytest.mark.parametrize("kind", ["kimi-k2.5", "kimi-k2"])
def test_streamed_in_many_uneven_steps_is_still_bit_exact(
    kind: str, chunk: int, fixture_dir, reference_bf16_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoded and copied tensors go out a few rows / bytes at a time: tiny steps (one row; rows not a
    multiple of the step, so a short last step) must give the same bytes as compressed-tensors."""
    import ktflow.formats.quant_decode as kernels

    monkeypatch.setattr(kernels, "_DECODE_CHUNK", chunk)
    dequantize_checkpoint(fixture_dir(kind), tmp_path / "out", workers=2, fsync=False)
    assert_bit_identical(all_tensors(tmp_path / "out"), all_tensors(reference_bf16_dir(kind)))


def test_piecewise_writes_are_checked_like_whole_ones(tmp_path: Path) -> None:
    from ktflow.formats.safetensors_io import SafetensorsWriter

    writer = SafetensorsWriter(tmp_path / "x.safetensors", [("a", "BF16", (2, 4)), ("b", "U8", (3,))])
    whole = torch.arange(8, dtype=torch.bfloat16)
    raw = memoryview(whole.view(torch.uint8).numpy())
    with pytest.raises(ValueError, match="got 8 of its 16 bytes"):
        writer.write_pieces("a", [raw[:8]])
    with pytest.raises(ValueError, match="more than its 16 bytes"):
        writer.write_pieces("a", [raw, raw[:2]])
    with pytest.raises(ValueError, match="not in the plan"):
        writer.write_pieces("c", [raw])
    writer.write_pieces("a", [raw[:6], raw[6:]])  # a failed attempt does not count as written
    with pytest.raises(ValueError, match="written twice"):
        writer.write_pieces("a", [raw])
    writer.write("b", torch.tensor([1, 2, 3], dtype=torch.uint8))
    writer.close()
    loaded = load_file(tmp_path / "x.safetensors")
    assert torch.equal(loaded["a"], whole.view(2, 4)) and loaded["b"].tolist() == [1, 2, 3]


def test_shards_are_interleaved_and_every_tensor_comes_once() -> None:
    from types import SimpleNamespace

    from ktflow.stages.dequantize import _interleaved

    jobs = [SimpleNamespace(plan=[f"{name}{i}" for i in range(n)]) for name, n in zip("abcde", (5, 1, 3, 0, 2))]
    for lanes in (1, 2, 3, 8):
        order = [item for _, item in _interleaved(jobs, lanes)]  # type: ignore[arg-type]
        assert sorted(order) == sorted(item for job in jobs for item in job.plan)
    assert [item for _, item in _interleaved(jobs, 2)][:4] == ["a0", "b0", "a1", "c0"]  # type: ignore[arg-type]
    assert [item for _, item in _interleaved(jobs, 1)] == [i for job in jobs for i in job.plan]  # type: ignore[arg-type]
