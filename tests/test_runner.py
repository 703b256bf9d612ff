"""The stage runner: one skeleton (refuse, cache, lock, preflight, staging, work, verify, publish)
for every stage, shown on a toy stage; and the stage declarations a planner reads."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import ktflow.store as store
from ktflow.errors import HostRequirementError, InsufficientDiskError, InvalidInputError, KtflowError
from ktflow.host.hardware import GpuInfo, HostInfo, NumaNode
from ktflow.resources import INT8_KERNELS, DiskNeed, GpuNeed, HostRequirement, RamNeed, Resources, preflight
from ktflow.runner import Job, StageSpec, find_published, run_stage
from ktflow.stages.dequantize import DEQUANTIZE, DequantizeRequest, DequantizeSizes
from ktflow.stages.quantize_int8 import QUANTIZE_INT8, QuantizeInt8Request, QuantizeInt8Sizes
from ktflow.store import StageManifest, lock_path_for, read_manifest, staging_dir_for

GiB = 1 << 30


def host(*, ram: int = 64 * GiB, variant: str = "amx", gpus: int = 0, vram: int = 80 * GiB) -> HostInfo:
    return HostInfo(
        hostname="h", cpu_model="Test CPU", cpu_flags=[], cpu_variant=variant, cpu_variant_overridden=False,
        logical_cores=8, physical_cores=4, numa_nodes=1,
        numa=[NumaNode(id=0, cpus=list(range(8)), mem_total_bytes=ram, mem_free_bytes=ram)],
        ram_bytes=ram, ram_available_bytes=ram,
        gpus=[GpuInfo(index=i, name="H100", vram_bytes=vram) for i in range(gpus)],
        disk_path="/", disk_free_bytes=1 << 42, shm_bytes=1 << 38, shm_free_bytes=1 << 38,
    )


# --------------------------------------------------------------------------- a toy stage: copy one file


@dataclass(frozen=True)
class CopyRequest:
    src: Path
    out: Path
    ram: int = 0
    fail_in_work: bool = False


@dataclass(kw_only=True)
class CopyJob(Job[CopyRequest]):
    data: bytes
    seen: dict = field(default_factory=dict)  # what the steps saw, for the assertions


def _prepare(request: CopyRequest) -> CopyJob:
    if not request.src.is_file():
        raise InvalidInputError(str(request.src), "does not exist")
    data = request.src.read_bytes()
    return CopyJob(request=request, target=request.out, data=data, journal={"size": len(data)})


def _lookup(job: CopyJob) -> str | None:
    found = find_published(job.target, "download", inputs={"src": job.data.hex()}, intact=True)
    return None if found is None else "cached"


def _measure(job: CopyJob, resumed: Path | None) -> dict:
    job.seen["resumed"] = resumed is not None and (resumed / "part").exists()
    return {"bytes": len(job.data)}


def _needs(request: CopyRequest, sizes: dict) -> Resources:
    ram = RamNeed(bytes=request.ram, what="the copy", why="all of it at once") if request.ram else None
    return Resources(ram=ram, disk=(DiskNeed(bytes=sizes["bytes"], what="the copy"),))


def _work(job: CopyJob, staging: Path) -> None:
    job.seen["journal"] = json.loads((staging / ".journal").read_text())
    (staging / "part").write_bytes(job.data[:1])
    if job.request.fail_in_work:
        raise KtflowError("the tool failed")
    (staging / "data.bin").write_bytes(job.data)
    job.report(1, 1)


def _verify(job: CopyJob, staging: Path) -> None:
    if (staging / "data.bin").read_bytes() != job.data:
        raise KtflowError("the copy differs")


def toy_spec(**changes) -> StageSpec:
    spec = dict(name="download", prepare=_prepare, lookup=_lookup, measure=_measure, needs=_needs, work=_work,
                verify=_verify, manifest=lambda job: StageManifest(stage="download", inputs={"src": job.data.hex()}),
                result=lambda job, manifest: "made", resume=True, journal=".journal", bookkeeping=("part",))
    spec.update(changes)
    return StageSpec(**spec)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    path = tmp_path / "src.bin"
    path.write_bytes(b"weights")
    return path


def test_publishes_once_then_is_a_cache_hit(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "store" / "out"
    seen: list[tuple[int, int]] = []
    assert run_stage(toy_spec(), CopyRequest(src, out), progress=lambda d, t: seen.append((d, t))) == "made"
    assert sorted(p.name for p in out.iterdir()) == ["data.bin", "manifest.json"]  # journal and bookkeeping gone
    assert [f.path for f in read_manifest(out).files] == ["data.bin"]
    assert seen == [(1, 1)]
    assert not staging_dir_for(out).exists() and not lock_path_for(out).exists()
    assert run_stage(toy_spec(), CopyRequest(src, out)) == "cached"
    (out / "data.bin").write_bytes(b"short")  # a damaged artifact is made again
    assert run_stage(toy_spec(), CopyRequest(src, out)) == "made"


def test_bad_input_and_a_foreign_target_are_refused_before_any_write(src: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="does not exist"):
        run_stage(toy_spec(), CopyRequest(tmp_path / "missing", tmp_path / "out"))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("x")
    with pytest.raises(InvalidInputError, match="not a ktflow artifact"):
        run_stage(toy_spec(), CopyRequest(src, foreign))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "src.bin"]
    placeholder = tmp_path / "placeholder"
    placeholder.mkdir()  # an empty directory made beforehand gives way to the artifact
    assert run_stage(toy_spec(), CopyRequest(src, placeholder)) == "made"


def test_a_failed_attempt_is_resumed_only_from_the_same_inputs(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(KtflowError, match="the tool failed"):
        run_stage(toy_spec(), CopyRequest(src, out, fail_in_work=True))
    assert (staging_dir_for(out) / "part").exists() and not out.exists()
    job = _prepare(CopyRequest(src, out))
    run_stage(toy_spec(prepare=lambda request: job), CopyRequest(src, out))
    assert job.seen == {"resumed": True, "journal": {"size": 7}}

    other = tmp_path / "other"  # a staging directory started from another source is not resumed
    staging_dir_for(other).mkdir()
    (staging_dir_for(other) / ".journal").write_text(json.dumps({"size": 7}))
    (staging_dir_for(other) / "part").write_bytes(b"w")
    src.write_bytes(b"other weights")
    job = _prepare(CopyRequest(src, other))
    run_stage(toy_spec(prepare=lambda request: job), CopyRequest(src, other))
    assert job.seen == {"resumed": False, "journal": {"size": 13}}
    assert (other / "data.bin").read_bytes() == b"other weights"


def test_discard_on_removes_staging(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(KtflowError):
        run_stage(toy_spec(discard_on=(KtflowError,)), CopyRequest(src, out, fail_in_work=True))
    assert not staging_dir_for(out).exists() and not out.exists() and not lock_path_for(out).exists()


def test_preflight_refuses_what_the_host_lacks(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    with pytest.raises(HostRequirementError, match=r"the copy needs ~2.00 GiB of RAM \(all of it at once\); "
                                                   r"1.00 GiB is available"):
        run_stage(toy_spec(), CopyRequest(src, out, ram=2 * GiB), host=host(ram=GiB))
    monkeypatch.setattr(store, "free_bytes", lambda path: 3)
    with pytest.raises(InsufficientDiskError) as disk:
        run_stage(toy_spec(), CopyRequest(src, out))
    assert "the copy needs" in str(disk.value) and disk.value.free == 3 and disk.value.need > 7
    with pytest.raises(HostRequirementError) as both:  # every capacity shortfall in one message
        run_stage(toy_spec(), CopyRequest(src, out, ram=2 * GiB), host=host(ram=GiB))
    assert not isinstance(both.value, InsufficientDiskError)
    assert "GiB of RAM" in str(both.value) and "the copy needs ~" in str(both.value)
    assert "free memory or disk" in str(both.value)
    assert not out.exists() and not staging_dir_for(out).exists()


def test_capabilities_are_checked_before_capacity(tmp_path: Path) -> None:
    needs = Resources(host=HostRequirement(stage="sft", min_gpus=2, min_cpu_variant="avx512_bf16", cpu_reason="KT"),
                      gpu=GpuNeed(bytes=40 * GiB, gpus=2))
    with pytest.raises(HostRequirementError) as missing:
        preflight("sft", needs, tmp_path / "out", host=host(variant="avx2", gpus=1), fix="use the GPU host")
    for says in ("sft needs a avx512_bf16 CPU or better (KT)", "sft needs 2 GPU(s); this host has 1",
                 "Fix: use the GPU host"):
        assert says in str(missing.value)
    with pytest.raises(HostRequirementError, match=r"needs ~40.0 GiB on each of 2 GPU\(s\); GPU 0 \(H100\) has 24.0"):
        preflight("sft", needs, tmp_path / "out", host=host(gpus=2, vram=24 * GiB))
    assert preflight("sft", needs, tmp_path / "out", host=host(gpus=2)) is not None


# --------------------------------------------------------------------------- what a planner reads


def test_needs_are_a_pure_function_of_the_request_and_the_sizes(tmp_path: Path) -> None:
    request = DequantizeRequest(src=tmp_path / "src", dst=tmp_path / "dst")
    sizes = DequantizeSizes(tensor_bytes=10 << 30, tensors=1000, shards=4, other_bytes=1 << 20,
                            output_bytes=20 << 30)
    needs = DEQUANTIZE.needs(request, sizes)
    assert needs.disk[0].bytes == (10 << 30) + 128 * 1000 + (1 << 20) and needs.disk[0].files == 12
    assert needs.artifact_bytes == (20 << 30) + (1 << 20) and not needs.probes_host

    int8 = QUANTIZE_INT8.needs(
        QuantizeInt8Request(bf16_dir=tmp_path / "bf16", out_dir=tmp_path / "int8", threadpool_count=2,
                            serve_python=tmp_path / "python", scratch_dir=tmp_path),
        QuantizeInt8Sizes(experts=384, hidden=7168, moe_intermediate=2048, layers=60, non_expert_bytes=30 << 30,
                          non_expert_tensors=1500, copied_bytes=1 << 20),
    )
    assert int8.host == INT8_KERNELS and int8.ram is not None
    # one layer's BF16 experts twice (the driver's, kt-kernel's as it quantizes), its INT8, ~1 GiB of runtime
    bf16_layer = 384 * 3 * 2048 * 7168 * 2
    assert 2 * bf16_layer + GiB < int8.ram.bytes < 3 * bf16_layer and int8.ram.what == "one MoE layer"
    assert [d.what for d in int8.disk] == ["kt-kernel's scratch for one layer", "the output"]
    assert int8.artifact_bytes is not None and int8.artifact_bytes > 60 * 384 * 3 * 2048 * 7168


def test_the_readme_example_stage_runs_caches_and_refuses(tmp_path: Path) -> None:
    """docs/contributing.md shows a stage to copy (the architecture page shows it too); it must run as written."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "contributing.md").read_text()
    section = page.split("## A stage to copy", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "docs/contributing.md (A stage to copy)", "exec"), namespace)  # noqa: S102 (our own docs)
    src = tmp_path / "weights.bin"
    src.write_bytes(b"experts")
    out = tmp_path / "store" / "checksum"
    seen: list[tuple[int, int]] = []
    assert namespace["run_stage"](namespace["CHECKSUM"], namespace["ChecksumRequest"](src=src, out=out),
                                  progress=lambda done, total: seen.append((done, total))) == out
    assert (out / "data").read_bytes() == b"experts" and read_manifest(out).stage == "checksum"
    assert seen == [(1, 1)]
    published = (out / "manifest.json").stat().st_mtime_ns
    assert namespace["checksum_file"](src, out) == out  # a cache hit: nothing rewritten
    assert (out / "manifest.json").stat().st_mtime_ns == published
    with pytest.raises(InvalidInputError, match="is not a file"):
        namespace["checksum_file"](tmp_path / "missing", tmp_path / "other")
    assert not (tmp_path / "other").exists()
