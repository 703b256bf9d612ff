"""The quantize-int8 stage: kt-kernel AMXINT8 weights in convert_cpu_weights.py's layout, checked
independently through kt-kernel's own inference path, resumable after kill -9, and refusing what
cannot work before anything is written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ktflow._drivers import kt_int8
from ktflow.errors import HostRequirementError, InvalidInputError, KtflowError
from ktflow.stages.quantize_int8 import check_int8_alignment, quantize_int8
from ktflow.store import read_manifest, staging_dir_for

REPO = Path(__file__).resolve().parent.parent
SERVE_PYTHON = REPO / ".venv-serve" / "bin" / "python"
needs_serve_env = pytest.mark.skipif(not SERVE_PYTHON.exists(), reason="serving toolchain not installed (make serve-env)")

# Run in the serving toolchain, with nothing from ktflow: load OUT_DIR with kt-kernel's AMXINT8
# inference wrapper (the way sglang-kt's --kt-weight-path does) and compare its MoE forward with
# a float64 torch MoE of the BF16 experts read from SRC_DIR with safetensors.
_INDEPENDENT_CHECK = textwrap.dedent("""
    import json, sys
    import torch
    from safetensors import safe_open
    import kt_kernel.experts_base as eb
    from kt_kernel import KTMoEWrapper

    out_dir, src_dir, T, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if not torch.cuda.is_available():  # kt-kernel pins its host buffers; there is no CUDA here
        class NoPin:
            def __getattr__(self, name):
                fn = getattr(torch, name)
                if name not in ("zeros", "empty", "full", "ones"):
                    return fn
                return lambda *a, **k: fn(*a, **{x: y for x, y in k.items() if x != "pin_memory"})
        eb.torch = NoPin()
    torch.set_num_threads(1)
    cfg = json.load(open(f"{src_dir}/config.json"))
    E, k, H, I = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    index = json.load(open(f"{src_dir}/model.safetensors.index.json"))["weight_map"]
    def tensor(name):
        with safe_open(f"{src_dir}/{index[name]}", "pt") as f:
            return f.get_tensor(name)
    layers = sorted({int(n.split(".")[2]) for n in index if ".mlp.experts." in n})
    results = {}
    for layer in layers:
        w = KTMoEWrapper(layer_idx=layer, num_experts=E, num_experts_per_tok=k, hidden_size=H,
                         moe_intermediate_size=I, gpu_experts_mask=None, cpuinfer_threads=2, threadpool_count=T,
                         weight_path=out_dir, chunked_prefill_size=256, cpu_save=False, method="AMXINT8")
        w.load_weights(torch.arange(E))
        g = torch.Generator().manual_seed(1234 + layer)
        x = torch.randn(tokens, H, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
        wt = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
        w.copy_inputs_to_cpu_buffers(x, ids, wt)
        w.run_pinned_forward_sync(x, None)
        out = eb.KExpertsCPUBuffer.get_buffer(x, k)[4][layer % eb.KExpertsCPUBuffer.buffer_depth].double()
        ref = torch.zeros(tokens, H, dtype=torch.float64)
        p = f"model.layers.{layer}.mlp.experts"
        for t in range(tokens):
            xt = x[t].double()
            for j in range(k):
                e = int(ids[t, j])
                gate = tensor(f"{p}.{e}.gate_proj.weight").double()
                up = tensor(f"{p}.{e}.up_proj.weight").double()
                down = tensor(f"{p}.{e}.down_proj.weight").double()
                ref[t] += float(wt[t, j]) * (down @ (torch.nn.functional.silu(gate @ xt) * (up @ xt)))
        results[layer] = ((out - ref).abs().mean() / ref.abs().mean()).item()
        del w
    print("RESULT " + json.dumps(results))
""")


def independent_errors(out_dir: Path, src_dir: Path, t: int, tokens: int = 32) -> dict[str, float]:
    done = subprocess.run([str(SERVE_PYTHON), "-c", _INDEPENDENT_CHECK, str(out_dir), str(src_dir), str(t), str(tokens)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def file_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name != "manifest.json"}


# --------------------------------------------------------------------------- alignment and refusals


def test_a_driver_process_takes_the_layers_its_ram_budget_allows() -> None:
    """The layer budget of a driver process: the most layers whose working set, runtime and kept INT8 buffers fit
    80 % of the available RAM, at least one."""
    from ktflow.planning.merge_cost import kt_layers_per_process, kt_quantizer_process_ram

    bf16, int8, available = 400 << 20, 200 << 20, 8 << 30
    n = kt_layers_per_process(available, bf16, int8, scratch_in_ram=True)
    assert kt_quantizer_process_ram(bf16, int8, n, scratch_in_ram=True) <= 0.8 * available
    assert kt_quantizer_process_ram(bf16, int8, n + 1, scratch_in_ram=True) > 0.8 * available
    assert kt_layers_per_process(1 << 30, bf16, int8, scratch_in_ram=True) == 1


def test_the_driver_keeps_a_layer_s_int8_and_frees_its_bf16_as_measured() -> None:
    """benchmarks/quantize_int8.py at 1, 4 and 8 MoE layers on the CPU box: the driver's peak RSS within the stage's
    budget for its process, and growing by the INT8 layer a layer (kt-kernel 0.7.2 keeps each wrapper's buffers and
    frees the BF16 it quantized), as kt_quantizer_process_ram's docstring says."""
    data = {int(p.stem.rsplit("-", 1)[1]): json.loads(p.read_text())
            for p in (REPO / "benchmarks/data/quantize-int8").glob("cpu-box-layers-*.json")}
    assert sorted(data) == [1, 4, 8]
    assert all(d["ratios"]["rss_over_budget"] <= 1.0 for d in data.values())
    peak = {n: d["runs"]["ours"]["peak_rss_mb"] * 1e6 for n, d in data.items()}
    layer_int8 = data[8]["layer_int8_bytes"]
    for low, high in ((1, 4), (4, 8)):
        assert (peak[high] - peak[low]) / (high - low) == pytest.approx(layer_int8, rel=0.02)


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4"])
@pytest.mark.parametrize(("hidden", "inter", "t"), [(7168, 2048, 1), (7168, 2048, 2), (64, 32, 4)])
def test_the_counted_layer_bytes_are_the_driver_s_layer(method: str, hidden: int, inter: int, t: int) -> None:
    """The one count of a quantized MoE layer (stages' RAM and disk checks, the merge's and the plan's estimates) is
    the bytes of every tensor the driver writes for it: codes and fp32 row scales of every NUMA slice."""
    from ktflow.formats.kt_layout import kt_layer_bytes

    itemsize = {"I8": 1, "F32": 4}
    written = sum(itemsize[dtype] * shape[0] for _, dtype, shape in kt_int8.layer_plan(0, 3, hidden, inter, t, method))
    assert kt_layer_bytes(3, hidden, inter, t, method) == written


@pytest.mark.parametrize("hidden,inter,t", [(256, 128, 1), (256, 128, 2), (7168, 2048, 2), (7168, 2048, 8),
                                            (7168, 2048, 32)])
def test_aligned_threadpool_counts_pass(hidden: int, inter: int, t: int) -> None:
    check_int8_alignment(hidden, inter, t)


@pytest.mark.parametrize("hidden,inter,t,says", [
    (256, 128, 4, ["--threadpool-count 4", "slices of 32", "128", "--threadpool-count 1 or 2"]),
    (7168, 2048, 64, ["--threadpool-count 64", "slices of 32", "n or k is not aligned"]),
    (256, 128, 3, ["--threadpool-count 3", "128 % 3 = 2"]),
    (96, 128, 1, ["hidden_size 96", "multiple of 64"]),
    (256, 128, 0, ["--threadpool-count 0", "positive"]),
])
def test_misaligned_settings_are_refused_with_the_reason(hidden: int, inter: int, t: int, says: list[str]) -> None:
    with pytest.raises(InvalidInputError) as info:
        check_int8_alignment(hidden, inter, t)
    assert info.value.exit_code == 2
    for text in says:
        assert text in str(info.value)


def test_misaligned_t_is_refused_before_any_layer(fixture_dir, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(InvalidInputError, match=r"--threadpool-count 4.*slices of 32"):
        quantize_int8(fixture_dir("bf16"), out, threadpool_count=4, serve_python=SERVE_PYTHON)
    assert not out.exists() and not staging_dir_for(out).exists()
    assert list(tmp_path.iterdir()) == []


def test_fp8_source_is_refused_with_the_dequantize_hint(fixture_dir, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(InvalidInputError) as info:
        quantize_int8(fixture_dir("deepseek-v3"), out, threadpool_count=1, serve_python=SERVE_PYTHON)
    message = str(info.value)
    assert "deepseek-v3-fp8" in message and "ktflow dequantize" in message and "ktflow run" in message
    assert list(tmp_path.iterdir()) == []


def test_an_int4_expert_whose_scales_do_not_fit_its_weight_is_refused_before_any_work(fixture_dir,
                                                                                      tmp_path: Path) -> None:
    """The INT4 source's headers are checked against the decode rule before kt-kernel is started."""
    import shutil

    from ktflow.formats.safetensors_io import read_header

    src = tmp_path / "kimi"
    shutil.copytree(fixture_dir("kimi-k2.5"), src)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(n for n in index if n.endswith("mlp.experts.1.up_proj.weight_scale"))
    shard = src / index[name]
    header = read_header(shard)
    raw = shard.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    doc = json.loads(raw[8:8 + size])
    rows, groups = doc[name]["shape"]
    doc[name]["shape"] = [rows * 2, groups // 2]  # the same bytes, another shape
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (size - len(text))
    assert len(text) == size and header.tensors[name].nbytes
    shard.write_bytes(raw[:8] + text + raw[8 + size:])
    out = tmp_path / "out"
    with pytest.raises(Exception) as info:
        quantize_int8(src, out, threadpool_count=1, serve_python=SERVE_PYTHON)
    assert name in str(info.value) and "expected BF16" in str(info.value)
    assert not out.exists() and not staging_dir_for(out).exists()


def test_missing_toolchain_is_a_host_requirement(fixture_dir, tmp_path: Path) -> None:
    with pytest.raises(HostRequirementError, match="make serve-env"):
        quantize_int8(fixture_dir("bf16"), tmp_path / "out", threadpool_count=1, serve_python=tmp_path / "no-python")
    assert not (tmp_path / "out").exists()


def test_scratch_is_dev_shm_only_where_a_layer_fits_there(tmp_path: Path) -> None:
    """A container's small /dev/shm (Docker: 64 MB) sends kt-kernel's per-layer scratch beside the output,
    instead of refusing the model; a scratch_dir given is always used."""
    import shutil

    from ktflow.stages.quantize_int8 import QuantizeInt8Request, _scratch

    request = QuantizeInt8Request(bf16_dir=tmp_path / "src", out_dir=tmp_path / "out" / "int8", threadpool_count=1,
                                  serve_python=tmp_path / "python")
    too_big = 1 << 60
    assert _scratch(request, too_big)[0] == tmp_path / "out"
    if Path("/dev/shm").is_dir() and shutil.disk_usage("/dev/shm").free > 1 << 20:
        assert _scratch(request, 1 << 10) == (Path("/dev/shm"), Path("/dev/shm"), True)
    given = QuantizeInt8Request(**{**request.__dict__, "scratch_dir": tmp_path / "scratch"})
    assert _scratch(given, too_big)[0] == tmp_path / "scratch"


def test_too_little_ram_or_scratch_is_refused(fixture_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ktflow.host.hardware as hardware
    import ktflow.stages.quantize_int8 as stage

    real = hardware.probe_host
    # An AVX512 host whatever this CPU is (the RAM refusal is tested on every CPU), short of RAM.
    monkeypatch.setattr(hardware, "probe_host", lambda path=None: real(path).model_copy(update={
        "ram_available_bytes": 1 << 20, "cpu_variant": "avx512_bf16", "native_cpu_variant": "avx512_bf16"}))
    monkeypatch.setattr(stage, "tool_versions", lambda python, packages: {"kt-kernel": "0.7.2"})
    fake_python = tmp_path / "python"
    fake_python.write_text("")  # never run: the refusal comes first
    out = tmp_path / "out"
    with pytest.raises(HostRequirementError, match=r"one MoE layer needs ~.* GiB of RAM \(.* BF16 experts"):
        quantize_int8(fixture_dir("bf16"), out, threadpool_count=1, serve_python=fake_python)
    assert not out.exists() and not staging_dir_for(out).exists()


@pytest.mark.parametrize(("advertised", "native"), [("avx2", "avx2"), ("avx512_bf16", "avx2"), ("avx2", "amx")])
def test_a_cpu_without_the_int8_kernels_is_refused_before_any_work(advertised: str, native: str, fixture_dir,
                                                                   tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # On every CPU: an AVX2 CPU, a fake AVX512 advertisement on one (kt-kernel would die on an
    # illegal instruction), and kt-kernel forced down to its avx2 build on an AMX CPU.
    import ktflow.host.hardware as hardware
    import ktflow.stages.quantize_int8 as stage

    real = hardware.probe_host
    monkeypatch.setattr(hardware, "probe_host", lambda path=None: real(path).model_copy(update={
        "cpu_model": "Test CPU", "cpu_variant": advertised, "native_cpu_variant": native,
        "cpu_variant_overridden": advertised != native}))
    monkeypatch.setattr(stage, "tool_versions", lambda python, packages: {"kt-kernel": "0.7.2"})
    fake_python = tmp_path / "python"
    fake_python.write_text("")  # never run: the refusal comes first
    out = tmp_path / "out"
    with pytest.raises(HostRequirementError) as refused:
        quantize_int8(fixture_dir("bf16"), out, threadpool_count=1, serve_python=fake_python)
    message = str(refused.value)
    for says in ("needs a avx512_base CPU or better", "AVX512F + AVX512BW", "Test CPU, kt-kernel variant avx2",
                 "Fix: quantize on an AVX512 or AMX host"):
        assert says in message, (says, message)
    assert not out.exists() and not staging_dir_for(out).exists()


@needs_serve_env
def test_driver_imports_nothing_from_the_orchestrator_env() -> None:
    code = ("import sys, ktflow._drivers.kt_int8\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('pydantic', 'prefect', 'psutil', 'kt_kernel')]\n"
            "assert not bad, bad")
    done = subprocess.run([str(SERVE_PYTHON), "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert done.returncode == 0, done.stderr


# --------------------------------------------------------------------------- the real thing


@needs_serve_env
@pytest.mark.int8_kernels
@pytest.mark.slow
@pytest.mark.parametrize("t", [1, 2])
def test_quantized_weights_run_in_kt_kernel_within_5_percent(t: int, fixture_dir, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save

    src = fixture_dir("bf16")  # 3 layers (0 dense), 8 experts, hidden 256, moe_intermediate 128
    out = tmp_path / "int8"
    seen: list[tuple[int, int]] = []
    result = quantize_int8(src, out, threadpool_count=t, serve_python=SERVE_PYTHON,
                           progress=lambda a, b: seen.append((a, b)))
    assert not result.cached and result.layers == 2 and result.layers_reused == 0 and result.threadpool_count == t
    assert seen == [(1, 2), (2, 2)]
    assert not staging_dir_for(out).exists()

    # convert_cpu_weights.py's layout
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "manifest.json", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 0}
    for k, layer in ((1, 1), (2, 2)):
        shard = out / f"model-0000{k}-of-00003.safetensors"
        tensors = load_file(shard)
        assert len(tensors) == 8 * 3 * t * 2
        for e in range(8):
            for numa in range(t):
                for proj, (n_bytes, n_scales) in {"gate": (128 // t * 256, 128 // t), "up": (128 // t * 256, 128 // t),
                                                  "down": (256 * 128 // t, 256)}.items():
                    w = tensors[f"blk.{layer}.ffn_{proj}_exps.{e}.numa.{numa}.weight"]
                    s = tensors[f"blk.{layer}.ffn_{proj}_exps.{e}.numa.{numa}.scale"]
                    assert (str(w.dtype), tuple(w.shape)) == ("torch.int8", (n_bytes,))
                    assert (str(s.dtype), tuple(s.shape)) == ("torch.float32", (n_scales,))
                    assert bool((s > 0).all())
        assert all(index["weight_map"][name] == shard.name for name in tensors)
        assert save(tensors) == shard.read_bytes()  # byte for byte what safetensors' save_file writes
    non_expert = load_file(out / "model-00003-of-00003.safetensors")
    assert not any(".mlp.experts." in name or name.startswith("model.") for name in non_expert)
    for name in ("embed_tokens.weight", "norm.weight", "lm_head.weight", "blk.0.mlp.gate_proj.weight",
                 "blk.0.self_attn.kv_a_proj_with_mqa.weight", "blk.1.mlp.shared_experts.up_proj.weight",
                 "blk.1.mlp.gate.weight"):
        assert name in non_expert and str(non_expert[name].dtype) == "torch.bfloat16", name
    assert str(non_expert["blk.2.mlp.gate.e_score_correction_bias"].dtype) == "torch.float32"
    assert set(index["weight_map"]) == set(non_expert) | {n for k in (1, 2) for n in
                                                          load_file(out / f"model-0000{k}-of-00003.safetensors")}
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()

    # the stage's own verification, recorded in the manifest
    manifest = read_manifest(out)
    assert manifest is not None and manifest.stage == "quantize-int8"
    assert manifest.settings["threadpool_count"] == t and manifest.tools["int8_weight_layout"]
    assert manifest.extra["verification"] == {
        layer: {k: v for k, v in figures.items() if k != "seconds"} for layer, figures in result.verification.items()}
    for layer in ("1", "2"):
        assert 0 < result.verification[layer]["mean_rel_err"] < 0.05
        assert result.verification[layer]["cosine"] > 0.999

    # an independent check: kt-kernel's AMXINT8 inference path reading OUT, vs float64 BF16 MoE
    errors = independent_errors(out, src, t)
    print(f"\nT={t}: kt-kernel AMXINT8 forward vs float64 BF16 MoE, mean|out-ref|/mean|ref| per layer: "
          f"{ {k: round(v, 4) for k, v in errors.items()} }; stage's own verification: "
          f"{ {k: round(v['mean_rel_err'], 4) for k, v in result.verification.items()} }")
    assert set(errors) == {"1", "2"}
    assert all(0 < v < 0.05 for v in errors.values())

    again = quantize_int8(src, out, threadpool_count=t, serve_python=SERVE_PYTHON)
    assert again.cached and again.manifest_digest == result.manifest_digest and again.layers_reused == 2


@needs_serve_env
@pytest.mark.int8_kernels
@pytest.mark.slow
def test_a_kimi_int4_source_quantizes_to_the_same_int8_as_its_bf16_decode(fixture_dir, reference_bf16_dir,
                                                                          tmp_path: Path) -> None:
    """Kimi INT4 in, no BF16 copy on disk: the expert shards equal, byte for byte, those quantize-int8 makes from
    compressed-tensors' own BF16 decode of the same checkpoint (ktflow's in-memory decode is bit-exact and
    kt-kernel's quantization deterministic), and kt-kernel's AMXINT8 forward of them passes verification."""
    src = fixture_dir("kimi-k2.5")
    via_int4 = quantize_int8(src, tmp_path / "from-int4", threadpool_count=1, serve_python=SERVE_PYTHON)
    via_bf16 = quantize_int8(reference_bf16_dir("kimi-k2.5"), tmp_path / "from-bf16", threadpool_count=1,
                             serve_python=SERVE_PYTHON)
    assert via_int4.layers == via_bf16.layers >= 2
    a, b = file_bytes(via_int4.path), file_bytes(via_bf16.path)
    shards = sorted(n for n in a if n.startswith("model-"))
    assert shards == sorted(n for n in b if n.startswith("model-"))
    for shard in shards:  # the expert layers and the non-expert shard (the same tensors, renamed alike)
        assert a[shard] == b[shard], shard
    assert a["model.safetensors.index.json"] == b["model.safetensors.index.json"]
    for figures in via_int4.verification.values():
        assert 0 < figures["mean_rel_err"] < 0.05 and figures["cosine"] > 0.999
    manifest = read_manifest(via_int4.path)
    assert manifest is not None and manifest.extra["source_path"] == str(src)


@pytest.mark.int8_kernels
@pytest.mark.slow
def test_verification_above_the_bound_publishes_nothing_and_a_rerun_trusts_only_whole_shards(fixture_dir,
                                                                                             tmp_path: Path) -> None:
    src = fixture_dir("bf16")
    out = tmp_path / "int8"
    with pytest.raises(KtflowError, match=r"above max_rel_err 1e-06; nothing published"):
        quantize_int8(src, out, threadpool_count=1, serve_python=SERVE_PYTHON, max_rel_err=1e-6)
    assert not out.exists()
    assert sorted(p.name for p in staging_dir_for(out).glob("*.safetensors")) == [
        "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"]  # no non-expert shard
    staging = staging_dir_for(out)
    second = staging / "model-00002-of-00003.safetensors"
    second.write_bytes(second.read_bytes()[:-1000])  # a damaged shard under its final name: not trusted
    (staging / "model-00003-of-00003.safetensors.tmp").write_bytes(b"a partial shard")
    result = quantize_int8(src, out, threadpool_count=1, serve_python=SERVE_PYTHON)
    assert result.layers_reused == 1 and not result.cached
    quantize_int8(src, tmp_path / "clean", threadpool_count=1, serve_python=SERVE_PYTHON)
    assert file_bytes(out) == file_bytes(tmp_path / "clean")


_STAGE = """
import sys
from pathlib import Path
from ktflow.stages.quantize_int8 import quantize_int8
quantize_int8(Path(sys.argv[1]), Path(sys.argv[2]), threadpool_count=2, serve_python=Path(sys.argv[3]), fsync=True)
"""


@needs_serve_env
@pytest.mark.int8_kernels
@pytest.mark.slow
def test_kill_9_mid_layer_then_rerun_redoes_only_that_layer(fixture_dir, tmp_path: Path) -> None:
    src = fixture_dir("bf16", layers=6, experts=16, hidden=512, moe_intermediate=256)  # 5 MoE layers
    out = tmp_path / "killed"
    staging = staging_dir_for(out)
    first = staging / "model-00001-of-00006.safetensors"
    proc = subprocess.Popen([sys.executable, "-c", _STAGE, str(src), str(out), str(SERVE_PYTHON)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and not first.exists():
        time.sleep(0.002)
    assert proc.poll() is None, "the stage ended before layer 1 was written"
    os.killpg(proc.pid, signal.SIGKILL)  # the orchestrator and the kt-kernel driver at once
    proc.wait()
    layer_shards = [staging / f"model-0000{k}-of-00006.safetensors" for k in range(1, 6)]
    complete = [p.name for p in layer_shards if p.exists()]
    partial = [p.name for p in staging.glob("*.tmp")]
    print(f"\nkilled with {len(complete)} complete layer shard(s) {complete} and partial {partial}")
    assert 1 <= len(complete) < 5
    assert not out.exists()

    resumed = quantize_int8(src, out, threadpool_count=2, serve_python=SERVE_PYTHON)
    assert resumed.layers == 5 and resumed.layers_reused == len(complete) and not resumed.cached
    assert not staging.exists()
    leftovers = [d for d in Path("/dev/shm").glob(kt_int8.SCRATCH_PREFIX + "*")
                 if not (Path("/proc") / d.name[len(kt_int8.SCRATCH_PREFIX):]).exists()]
    assert leftovers == []  # the killed driver's scratch was cleaned by the rerun

    clean = quantize_int8(src, tmp_path / "clean", threadpool_count=2, serve_python=SERVE_PYTHON)
    assert clean.layers_reused == 0
    assert file_bytes(out) == file_bytes(tmp_path / "clean")  # every shard, the index, the copied files
    assert resumed.manifest_digest == clean.manifest_digest  # same verification figures too


@needs_serve_env
@pytest.mark.int8_kernels
@pytest.mark.slow
def test_driver_restarts_bound_kt_kernels_leak_and_change_nothing(fixture_dir, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """kt-kernel never frees a wrapper's weight buffers; with one wrapper per process the driver runs
    once per layer and per verified layer (the non-expert shard needs no wrapper): same output."""
    import ktflow.stages.quantize_int8 as stage

    src = fixture_dir("bf16")
    one = quantize_int8(src, tmp_path / "one", threadpool_count=1, serve_python=SERVE_PYTHON)
    launches: list[list[str]] = []
    real = stage.run_tool
    monkeypatch.setattr(stage, "run_tool", lambda argv, **kw: (launches.append(list(argv)), real(argv, **kw))[1])
    seen: list[tuple[int, int]] = []
    many = quantize_int8(src, tmp_path / "many", threadpool_count=1, serve_python=SERVE_PYTHON, layers_per_process=1,
                         progress=lambda a, b: seen.append((a, b)))
    assert len(launches) == 4  # layer 1 | layer 2 | verify 1 | verify 2 + non-expert shard (no wrapper)
    assert many.layers_reused == 0 and seen == [(1, 2), (2, 2)]
    assert file_bytes(tmp_path / "many") == file_bytes(tmp_path / "one")
    assert many.manifest_digest == one.manifest_digest


# Run in the serving toolchain: the .kt layout the serve stage writes (LAYOUT) against what kt-kernel's own
# cpu_save writes for the same BF16 layer, then kt-kernel's AMXINT8_SFT wrapper (what sglang-kt builds for
# AMXINT8 with an expert LoRA) loading LAYOUT directly, with a random expert LoRA, against a float64 MoE of
# the BF16 weights plus that LoRA; and the same wrapper refusing quantize-int8's own output (INT8_DIR).
_SFT_CHECK = textwrap.dedent("""
    import filecmp, json, os, sys, tempfile
    import torch
    from safetensors import safe_open
    import kt_kernel.experts_base as eb
    import kt_kernel.sft.base as sb
    from kt_kernel import KTMoEWrapper

    layout, int8_dir, src_dir, T, tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    if not torch.cuda.is_available():  # kt-kernel pins its host buffers; there is no CUDA here
        class NoPin:
            def __getattr__(self, name):
                fn = getattr(torch, name)
                if name not in ("zeros", "empty", "full", "ones"):
                    return fn
                return lambda *a, **k: fn(*a, **{x: y for x, y in k.items() if x != "pin_memory"})
        eb.torch = sb.torch = NoPin()
    torch.set_num_threads(1)
    cfg = json.load(open(f"{src_dir}/config.json"))
    E, k, H, I = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    index = json.load(open(f"{src_dir}/model.safetensors.index.json"))["weight_map"]
    def tensor(name):
        with safe_open(f"{src_dir}/{index[name]}", "pt") as f:
            return f.get_tensor(name)
    layers = sorted({int(n.split(".")[2]) for n in index if ".mlp.experts." in n})
    common = dict(num_experts=E, num_experts_per_tok=k, hidden_size=H, moe_intermediate_size=I, gpu_experts_mask=None,
                  cpuinfer_threads=2, threadpool_count=T, chunked_prefill_size=256)
    rank, alpha = 4, 8.0
    results = {"layers": {}}
    for layer in layers:
        p = f"model.layers.{layer}.mlp.experts"
        w = {proj: torch.stack([tensor(f"{p}.{e}.{proj}_proj.weight") for e in range(E)]).contiguous()
             for proj in ("gate", "up", "down")}
        scratch = tempfile.mkdtemp()
        saver = KTMoEWrapper(layer_idx=layer, weight_path=scratch, cpu_save=True, method="AMXINT8", **common)
        saver.load_weights_from_tensors(w["gate"], w["up"], w["down"], torch.arange(E))
        del saver
        theirs = sorted(os.path.relpath(os.path.join(d, f), scratch) for d, _, fs in os.walk(scratch) for f in fs)
        ours = sorted(os.path.relpath(os.path.join(d, f), layout) for d, _, fs in os.walk(f"{layout}/_layer_{layer}")
                      for f in fs)
        same = theirs == ours and all(filecmp.cmp(f"{scratch}/{f}", f"{layout}/{f}", shallow=False) for f in theirs)

        sft = KTMoEWrapper(layer_idx=layer, weight_path=layout, method="AMXINT8_SFT", mode="sft", num_gpu_experts=0,
                           lora_rank=rank, lora_alpha=alpha, max_cache_depth=1, **common)
        sft.share_backward_bb = True  # as sglang-kt configures AMXINT8_SFT for serving
        sft.load_weights(torch.arange(E))
        g = torch.Generator().manual_seed(99 + layer)
        shapes = {"gate_a": (E, rank, H), "gate_b": (E, I, rank), "up_a": (E, rank, H), "up_b": (E, I, rank),
                  "down_a": (E, rank, I), "down_b": (E, H, rank)}
        lora = {n: (torch.randn(*s, generator=g) * 0.05).bfloat16().contiguous() for n, s in shapes.items()}
        sft.init_lora_weights(*(lora[n] for n in shapes), *(torch.zeros_like(lora[n]) for n in shapes))
        x = torch.randn(tokens, H, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
        wt = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
        out = sft.forward(x, ids, wt, save_for_backward=False).double()
        ref, base = torch.zeros(tokens, H, dtype=torch.float64), torch.zeros(tokens, H, dtype=torch.float64)
        s = alpha / rank
        for t in range(tokens):
            xt = x[t].double()
            for j in range(k):
                e = int(ids[t, j])
                m = {proj: w[proj][e].double() for proj in w}
                d = {proj: s * lora[f"{proj}_b"][e].double() @ lora[f"{proj}_a"][e].double() for proj in w}
                for into, delta in ((ref, 1.0), (base, 0.0)):
                    gate, up, down = (m[proj] + delta * d[proj] for proj in ("gate", "up", "down"))
                    into[t] += float(wt[t, j]) * (down @ (torch.nn.functional.silu(gate @ xt) * (up @ xt)))
        err = lambda r: ((out - r).abs().mean() / r.abs().mean()).item()
        results["layers"][layer] = {"kt_files": len(ours), "same_as_cpu_save": same, "direct_kt_load":
                                    bool(getattr(sft, "_use_kt_direct_load", False)), "rel_err": err(ref),
                                    "rel_err_without_lora": err(base)}
        del sft
    try:
        plain = KTMoEWrapper(layer_idx=layers[0], weight_path=int8_dir, method="AMXINT8_SFT", mode="sft",
                             num_gpu_experts=0, lora_rank=rank, lora_alpha=alpha, max_cache_depth=1, **common)
        plain.load_weights(torch.arange(E))
        results["plain_output"] = "loaded"
    except Exception as exc:
        results["plain_output"] = f"{type(exc).__name__}: {exc}"
    print("RESULT " + json.dumps(results))
""")


@needs_serve_env
@pytest.mark.int8_kernels
@pytest.mark.slow
@pytest.mark.parametrize("t", [1, 2])
def test_the_kt_layout_the_serve_stage_writes_is_kt_kernels_own_and_amxint8_sft_serves_it(t: int, fixture_dir,
                                                                                           tmp_path: Path) -> None:
    """sglang-kt serves AMXINT8 with an expert LoRA through kt-kernel's AMXINT8_SFT, which reads only the
    ``.kt`` layout (GPU host, call 9). The one the serve stage writes from quantize-int8's output is, file for
    file and byte for byte, what kt-kernel's own cpu_save writes for the same BF16 layer; AMXINT8_SFT loads it
    directly and its forward with an expert LoRA matches a float64 MoE of the BF16 weights plus that LoRA
    within 5 %; quantize-int8's output itself is refused by that wrapper."""
    import torch
    from safetensors.torch import save_file

    from ktflow.recipe import load_recipe
    from ktflow.stages.serve.sglang.inputs import KT_LAYOUT_STAGE, sglang_kt_weights

    src = fixture_dir("bf16")  # 3 layers (0 dense), 8 experts, hidden 256, moe_intermediate 128
    out = tmp_path / "int8"
    quantize_int8(src, out, threadpool_count=t, serve_python=SERVE_PYTHON)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    save_file({"base_model.model.model.layers.1.mlp.experts.0.up_proj.lora_A.weight": torch.zeros(8, 256)},
              str(adapter / "adapter_model.safetensors"))
    recipe = load_recipe(REPO / "gpu_host" / "tiny-sglang-bf16.yaml", [
        "serving.kt_method=AMXINT8", f"serving.kt_threadpool_count={t}", f"store.root={tmp_path / 'store'}"])
    layout = sglang_kt_weights(recipe, out, adapter)
    assert layout != out and read_manifest(layout).stage == KT_LAYOUT_STAGE

    done = subprocess.run([str(SERVE_PYTHON), "-c", _SFT_CHECK, str(layout), str(out), str(src), str(t), "16"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    print(f"\nT={t}: AMXINT8_SFT from the serve stage's .kt layout, with a random expert LoRA, vs float64 BF16 MoE "
          f"+ LoRA: {result}")
    assert set(result["layers"]) == {"1", "2"}
    for figures in result["layers"].values():
        assert figures["kt_files"] == 8 * t * 3 * 2
        assert figures["same_as_cpu_save"] and figures["direct_kt_load"]
        assert 0 < figures["rel_err"] < 0.05
        assert figures["rel_err_without_lora"] > 2 * figures["rel_err"]  # the LoRA is applied, not ignored
    assert "INT8_SFT requires pre-quantized .kt files" in result["plain_output"]
