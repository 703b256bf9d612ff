"""INT4 (compressed-tensors pack-quantized) and block-FP8 checkpoints -> BF16, streamed.

Bit-exact with compressed-tensors' decompression (the decode rules are in
shared/reference/checkpoints.md), bounded in memory by a few tensors per worker whatever the
shard size, parallel across tensors, resumable per shard, and published atomically:

- every output shard is written by :class:`~ktflow.formats.safetensors_io.SafetensorsWriter` (header
  first, then each tensor at its offset, from any worker thread) into a temporary name inside
  the staging directory, fsynced, then renamed to its final name: a shard under its final
  name is complete;
- a rerun after a crash skips the shards already complete and redoes the partial one;
- the index, config, copied files and the manifest come last, and the staging directory is
  renamed to the destination, so nothing half-written is ever visible there.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import closing
from dataclasses import dataclass, field
from functools import cached_property
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from ktflow.errors import CheckpointError, InvalidInputError, KtflowError
from ktflow.formats.checkpoint import (
    CONFIG_NAME,
    INDEX_NAME,
    CheckpointFormat,
    CheckpointInfo,
    CheckpointTensors,
    checkpoint_identity,
    identity_digest,
    inspect_checkpoint,
)
from ktflow.formats.quant_decode import (  # noqa: F401  (the decode rules, public here as before)
    FP8_BLOCK,
    INT4_GROUP_SIZE,
    _chunk_for,
    _decode_chunk,
    _decode_int4_rows,
    _int4_fast_path,
    _scratch_buffer,
    _set_thread_chunk,
    decode_fp8_block,
    decode_int4_pack_quantized,
)
from ktflow.formats.safetensors_io import (
    DTYPE_SIZES,
    SafetensorsWriter,
    TensorInfo,
    holds_planned_tensors,
    read_tensor,
)
from ktflow.host.hardware import physical_cores
from ktflow.host.process import single_thread_torch
from ktflow.resources import DEQUANTIZE_STAGE, DiskNeed, Resources
from ktflow.runner import Job, Progress, StageSpec, find_published, run_stage
from ktflow.store import StageManifest, atomic_write_json

STAGE = DEQUANTIZE_STAGE
_JOURNAL = ".ktflow-dequantize.json"  # identity of the source a staging dir was started from
_TMP_SUFFIX = ".tmp"
_HEADER_BYTES_PER_TENSOR = 128  # safetensors header estimate, for the disk check
Pieces = Generator[memoryview, None, None]  # one tensor's bytes in order, each piece valid until the next


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class _OutTensor:
    """One tensor of an output shard and how to make it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str  # "copy" | "int4" | "fp8"
    source: str  # source tensor name (the packed/fp8 weight, or the tensor itself)

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


class DequantizeResult(BaseModel):
    """What the dequantize stage produced."""

    path: Path
    source_format: CheckpointFormat
    reused_source: bool  # the source was already BF16: nothing written
    cached: bool  # an identical artifact was already published
    shards: int
    tensors_decoded: int
    bytes_written: int
    seconds: float
    manifest_digest: str | None


class _Checkpoint(CheckpointTensors):
    """A validated source checkpoint: its format, and its tensors read one at a time."""

    def __init__(self, path: Path, info: CheckpointInfo) -> None:
        super().__init__(path)
        self.info = info

    def expect(self, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None = None) -> None:
        """Refuse a companion tensor whose dtype or shape the decode rule does not allow."""
        info = self.tensor_info(name)
        where = f"{self.weight_map[name]}: tensor '{name}'"
        if info.dtype not in dtypes:
            raise CheckpointError(where, f"has dtype {info.dtype}; expected {' or '.join(dtypes)}",
                                  "this is not a checkpoint in the format its config declares")
        if shape is not None and tuple(info.shape) != shape:
            raise CheckpointError(where, f"has shape {list(info.shape)}; expected {list(shape)}",
                                  "the checkpoint is corrupt; re-download it")

    def shards(self) -> list[str]:
        return sorted(set(self.weight_map.values()))


def _plan_shard(ckpt: _Checkpoint, shard: str) -> list[_OutTensor]:
    """The output tensors of one shard, in the source shard's order, companions dropped."""
    fmt = ckpt.info.format
    header = ckpt.header(shard)
    plan: list[_OutTensor] = []
    for name, info in header.tensors.items():
        if fmt in ("kimi-k2.5-int4", "kimi-k2-int4"):
            if name.endswith((".weight_scale", ".weight_shape")):
                continue
            if name.endswith(".weight_packed"):
                base = name.removesuffix("_packed")
                ckpt.expect(name, ("I32",))
                ckpt.expect(base + "_shape", ("I32", "I64"), (2,))
                shape_tensor = ckpt.tensor(base + "_shape")
                if shape_tensor.numel() != 2:
                    raise CheckpointError(f"{shard}: tensor '{base}_shape'",
                                          f"has {shape_tensor.numel()} values; expected [out, in]")
                rows, cols = (int(v) for v in shape_tensor.tolist())
                if rows != info.shape[0] or (cols + 7) // 8 != info.shape[1]:
                    raise CheckpointError(
                        f"{shard}: tensor '{name}'",
                        f"packed shape {list(info.shape)} does not hold weight_shape [{rows}, {cols}]",
                        "the checkpoint is corrupt; re-download it",
                    )
                ckpt.expect(base + "_scale", ("BF16",), (rows, (cols + INT4_GROUP_SIZE - 1) // INT4_GROUP_SIZE))
                plan.append(_OutTensor(base, "BF16", (rows, cols), "int4", name))
                continue
        elif fmt == "deepseek-v3-fp8":
            if name.endswith("_scale_inv"):
                continue
            if info.dtype == "F8_E4M3":
                if name + "_scale_inv" not in ckpt.weight_map:
                    raise CheckpointError(f"{shard}: tensor '{name}'", "is FP8 but has no '_scale_inv' companion",
                                          "the checkpoint is incomplete; re-download it")
                blocks = tuple((d + b - 1) // b for d, b in zip(info.shape, FP8_BLOCK))
                ckpt.expect(name + "_scale_inv", ("F32",), blocks)
                plan.append(_OutTensor(name, "BF16", info.shape, "fp8", name))
                continue
        plan.append(_OutTensor(name, info.dtype, info.shape, "copy", name))
    return plan


def _check_finite_scales(ckpt: _Checkpoint, name: str, scale: torch.Tensor) -> None:
    """A NaN or infinite scale would publish NaN/inf weights that fail only at training time."""
    if not bool(torch.isfinite(scale).all()):
        bad = int((~torch.isfinite(scale)).sum())
        raise CheckpointError(
            f"{ckpt.weight_map.get(name, '?')}: tensor '{name}'",
            f"has {bad} NaN or infinite value(s) among {scale.numel()} scales: the shard is corrupt",
            "re-download the shard (`ktflow download` verifies hashes) or restore it from the source",
        )


def _make_tensor(ckpt: _Checkpoint, shard: str, item: _OutTensor) -> torch.Tensor:
    if item.kind == "copy":
        return read_tensor(ckpt.header(shard), item.source)
    if item.kind == "int4":
        base = item.name
        packed = read_tensor(ckpt.header(shard), item.source)
        scale = ckpt.tensor(base + "_scale")
        _check_finite_scales(ckpt, base + "_scale", scale)  # type: ignore[arg-type]
        return decode_int4_pack_quantized(packed, scale, item.shape,  # type: ignore[arg-type]
                                          reuse_buffers=True)  # consumed by writer.write before this thread's next decode
    weight = read_tensor(ckpt.header(shard), item.source)
    scale_inv = ckpt.tensor(item.source + "_scale_inv")
    _check_finite_scales(ckpt, item.source + "_scale_inv", scale_inv)  # type: ignore[arg-type]
    return decode_fp8_block(weight, scale_inv)


def _int4_pieces(ckpt: _Checkpoint, shard: str, item: _OutTensor) -> Pieces | None:
    """An INT4 item's BF16 bytes, decoded a few rows at a time, or None when its shape needs the general decode.

    Each piece is this thread's scratch, valid until the next one is asked for: read the packed rows
    from the source (page cache), gather, scale, hand over for writing, all while they are in the CPU
    cache. No tensor-sized buffer is read, allocated or written: memory per worker is a few MB.
    """
    info = ckpt.header(shard).tensors[item.source]
    scale_name = item.name + "_scale"
    scale_info = ckpt.tensor_info(scale_name)  # dtype and shape checked by _plan_shard
    rows, cols = item.shape
    if not _int4_fast_path(info.shape[1], scale_info.shape[1], cols, INT4_GROUP_SIZE):
        return None
    scale = _scratch_buffer("scale", scale_info.nbytes, torch.uint8)  # a fresh 1 MB tensor costs its page faults
    scale_path = ckpt.path / ckpt.weight_map[scale_name]
    fd = os.open(scale_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _pread_exact(fd, scale, scale_info.start, f"{scale_path}: tensor '{scale_name}'")
    finally:
        os.close(fd)
    scale_values = scale.view(torch.bfloat16).view(scale_info.shape)
    _check_finite_scales(ckpt, scale_name, scale_values)
    return _decode_int4_stream(ckpt.path / shard, info, scale_values, rows, cols)


def _decode_int4_stream(path: Path, info: TensorInfo, scale: torch.Tensor, rows: int, cols: int) -> Pieces:
    step = max(1, min(rows, _decode_chunk() // max(cols, 1)))
    packed = _scratch_buffer("packed", step * cols // 2, torch.uint8)
    index = _scratch_buffer("index", step * cols // 4, torch.int32)
    out = _scratch_buffer("out", step * cols, torch.bfloat16)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for r0 in range(0, rows, step):
            r = min(step, rows - r0)
            chunk = packed[: r * cols // 2]
            _pread_exact(fd, chunk, info.start + r0 * cols // 2, f"{path}: tensor '{info.name}'")
            decoded = out[: r * cols].view(r, cols)
            _decode_int4_rows(decoded, chunk, scale[r0 : r0 + r], index[: r * cols // 4], INT4_GROUP_SIZE)
            yield memoryview(decoded.view(-1).view(torch.uint8).numpy())
    finally:
        os.close(fd)


def _copy_pieces(ckpt: _Checkpoint, shard: str, item: _OutTensor) -> Pieces | None:
    """A pass-through tensor's bytes, read a few MB at a time into this thread's scratch (each piece
    valid until the next), or None for BOOL tensors, which :func:`read_tensor` validates."""
    info = ckpt.header(shard).tensors[item.source]
    if info.dtype == "BOOL":
        return None
    return _read_stream(ckpt.path / shard, info)


def _read_stream(path: Path, info: TensorInfo) -> Pieces:
    buf = _scratch_buffer("copy", min(info.nbytes, 2 * _decode_chunk()), torch.uint8)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for start in range(0, info.nbytes, buf.numel()):
            chunk = buf[: min(buf.numel(), info.nbytes - start)]
            _pread_exact(fd, chunk, info.start + start, f"{path}: tensor '{info.name}'")
            yield memoryview(chunk.numpy())
    finally:
        os.close(fd)


def _pread_exact(fd: int, buf: torch.Tensor, offset: int, where: str) -> None:
    view, done = memoryview(buf.numpy()), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if not got:
            raise CheckpointError(where, f"truncated: the file ends at {offset + done} (it shrank after its header "
                                         "was checked)", "re-download or re-run the stage")
        done += got


# --------------------------------------------------------------------------- the stage


def _strip_quantization_config(config: Any) -> Any:
    if isinstance(config, dict):
        return {k: _strip_quantization_config(v) for k, v in config.items() if k != "quantization_config"}
    if isinstance(config, list):
        return [_strip_quantization_config(v) for v in config]
    return config


@dataclass(frozen=True)
class DequantizeRequest:
    """The dequantize stage's arguments (see :func:`dequantize_checkpoint`)."""

    src: Path
    dst: Path
    workers: int | None = None
    fsync: bool = True


class DequantizeSizes(BaseModel):
    """What the BF16 output's size is a function of (what is left of it, when resuming)."""

    tensor_bytes: int  # BF16 and pass-through tensor bytes still to write
    tensors: int  # tensors still to write
    shards: int  # output shards still to write
    other_bytes: int  # files copied as they are (config, tokenizer, remote code, ...)
    output_bytes: int  # every tensor of the output, written or not


def dequantize_needs(request: DequantizeRequest, sizes: DequantizeSizes) -> Resources:
    """Disk only: the tensors still to write (plus a safetensors header estimate each) and the copies."""
    return Resources(
        disk=(DiskNeed(bytes=sizes.tensor_bytes + _HEADER_BYTES_PER_TENSOR * sizes.tensors + sizes.other_bytes,
                       files=sizes.shards + 8, what="the BF16 output"),),
        artifact_bytes=sizes.output_bytes + sizes.other_bytes,
    )


@dataclass(kw_only=True)
class _Job(Job[DequantizeRequest]):
    info: CheckpointInfo
    ckpt: _Checkpoint | None = None  # None: a BF16 source, used as it is
    identity: dict[str, Any] = field(default_factory=dict)
    decoded: int = 0
    total: int = 0

    @property
    def inputs(self) -> dict[str, str]:
        return {"source": identity_digest(self.identity)}

    @cached_property
    def plans(self) -> dict[str, list[_OutTensor]]:
        """Every output shard's tensors: each header, dtype, shape and companion checked."""
        assert self.ckpt is not None
        return {shard: _plan_shard(self.ckpt, shard) for shard in self.ckpt.shards()}


def _prepare(request: DequantizeRequest) -> _Job:
    src, dst = Path(request.src), Path(request.dst)
    info = inspect_checkpoint(src)  # validates config, index and every header before any work
    if info.format == "bf16":
        return _Job(request=request, target=dst, info=info)
    if dst.resolve() == src.resolve() or src.resolve() in dst.resolve().parents:
        raise InvalidInputError(str(dst), "the output directory is the source or inside it", "choose another DST")
    identity = checkpoint_identity(src)
    return _Job(request=request, target=dst, info=info, ckpt=_Checkpoint(src, info), identity=identity,
                journal={"identity": identity}, fsync=request.fsync)


def _lookup(job: _Job) -> DequantizeResult | None:
    if job.ckpt is None:
        return DequantizeResult(path=job.request.src, source_format="bf16", reused_source=True, cached=False,
                                shards=job.info.num_shards, tensors_decoded=0, bytes_written=0, seconds=job.seconds(),
                                manifest_digest=None)
    existing = find_published(job.target, STAGE, inputs=job.inputs)
    if existing is None:
        return None
    return DequantizeResult(path=job.target, source_format=job.info.format, reused_source=False, cached=True,
                            shards=len(job.ckpt.shards()), tensors_decoded=0, bytes_written=0, seconds=job.seconds(),
                            manifest_digest=existing.digest())


def _measure(job: _Job, resumed: Path | None) -> DequantizeSizes:
    assert job.ckpt is not None
    left = [plan for shard, plan in job.plans.items() if resumed is None or not _complete(resumed / shard, plan)]
    return DequantizeSizes(
        tensor_bytes=sum(t.nbytes for plan in left for t in plan), tensors=sum(len(plan) for plan in left),
        shards=len(left), output_bytes=sum(t.nbytes for plan in job.plans.values() for t in plan),
        other_bytes=sum(p.stat().st_size for p in job.ckpt.path.rglob("*") if p.is_file() and p.name not in job.plans),
    )


def _work(job: _Job, staging: Path) -> None:
    assert job.ckpt is not None
    job.total = sum(t.nbytes for plan in job.plans.values() for t in plan)
    job.decoded = sum(1 for plan in job.plans.values() for t in plan if t.kind != "copy")
    advance = _Advance(job.total, job.report)
    jobs: list[_ShardJob] = []
    for shard, plan in job.plans.items():
        final = staging / shard
        if _complete(final, plan):
            advance(sum(t.nbytes for t in plan))  # finished by an earlier attempt
        else:
            jobs.append(_ShardJob(job.ckpt, shard, plan, final, job.fsync, job.identity))
    with single_thread_torch():
        _run_jobs(jobs, job.request.workers or physical_cores(), advance)
    src = job.ckpt.path
    config = _strip_quantization_config(json.loads((src / CONFIG_NAME).read_text(encoding="utf-8")))
    atomic_write_json(staging / CONFIG_NAME, config, fsync=job.fsync)
    weight_map = {t.name: shard for shard, plan in job.plans.items() for t in plan}
    atomic_write_json(staging / INDEX_NAME, {"metadata": {"total_size": job.total},
                                             "weight_map": dict(sorted(weight_map.items()))}, fsync=job.fsync)
    _copy_other_files(src, staging, skip=set(job.plans) | {CONFIG_NAME, INDEX_NAME})


def _verify(job: _Job, staging: Path) -> None:
    assert job.ckpt is not None
    if checkpoint_identity(job.ckpt.path) != job.identity:  # a shard checks only its own source; scales live in others
        raise KtflowError(f"{job.ckpt.path} changed while it was being converted; nothing was published. Rerun the "
                          "stage once the source is stable (what was made from the old version is discarded).")


def _manifest(job: _Job) -> StageManifest:
    assert job.ckpt is not None
    return StageManifest(
        stage=STAGE,
        inputs=job.inputs,
        settings={"source_format": job.info.format},
        tools={"torch": torch.__version__},
        extra={"source_path": str(job.ckpt.path.resolve()), "tensors_decoded": job.decoded, "bytes": job.total},
    )


def _result(job: _Job, manifest: StageManifest) -> DequantizeResult:
    return DequantizeResult(path=job.target, source_format=job.info.format, reused_source=False, cached=False,
                            shards=len(job.plans), tensors_decoded=job.decoded, bytes_written=job.total,
                            seconds=job.seconds(), manifest_digest=manifest.digest())


DEQUANTIZE: StageSpec[DequantizeRequest, _Job, DequantizeSizes, DequantizeResult] = StageSpec(
    name=STAGE, prepare=_prepare, lookup=_lookup, measure=_measure, needs=dequantize_needs,
    work=_work, verify=_verify, manifest=_manifest, result=_result,
    # Complete shards of an interrupted attempt at the same source are kept. A corrupt source (e.g.
    # NaN scales) found while decoding discards them: they come from a source that must be replaced.
    resume=True, journal=_JOURNAL, discard_on=(CheckpointError,),
)
"""The dequantize stage, declared for :func:`~ktflow.runner.run_stage` (and a planner)."""


def dequantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    workers: int | None = None,
    fsync: bool = True,
    progress: Progress | None = None,
) -> DequantizeResult:
    """Write a BF16 copy of an INT4 or FP8 checkpoint; reuse a BF16 source as it is.

    Args:
        src: checkpoint directory (Kimi-K2.5 / Kimi-K2 INT4, DeepSeek-V3 FP8, or BF16).
        dst: the output directory; it appears only when complete.
        workers: tensors decoded in parallel (default: physical cores).
        fsync: fsync each shard before publishing it (durable output).
        progress: called with (bytes written, bytes total) as tensors complete.

    Concurrent runs onto one ``dst`` are serialized by :func:`~ktflow.store.artifact_lock`: the
    second waits, then finds the artifact published (a cache hit).

    Raises:
        CheckpointError: the source is malformed or in an unsupported format (nothing written).
        HostRequirementError: too little free space for the output, or DST's directory is not
            writable (checked before any work).
        StorageError: the disk filled up (or became read-only) mid-run; complete shards stay in
            staging for the rerun.
        KtflowError: a source shard changed during the run.
    """
    request = DequantizeRequest(src=Path(src), dst=Path(dst), workers=workers, fsync=fsync)
    return run_stage(DEQUANTIZE, request, progress=progress)


class _Advance:
    """``advance(n)``: count ``n`` more bytes done (from any worker thread) and report progress."""

    def __init__(self, total: int, report: Progress) -> None:
        self.total, self.report, self.done = total, report, 0
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n
            current = self.done
        self.report(current, self.total)


def _complete(path: Path, plan: list[_OutTensor]) -> bool:
    return holds_planned_tensors(path, [(t.name, t.dtype, tuple(t.shape)) for t in plan])


class _ShardJob:
    """One output shard in flight: its writer opens with its first tensor; the worker that
    writes its last tensor closes it (fsync), checks the source, and renames it into place."""

    def __init__(
        self, ckpt: _Checkpoint, shard: str, plan: list[_OutTensor], final: Path, fsync: bool, identity: dict[str, Any]
    ) -> None:
        self.ckpt, self.shard, self.plan, self.final, self.fsync, self.identity = ckpt, shard, plan, final, fsync, identity
        self.tmp = final.with_name(final.name + _TMP_SUFFIX)
        self.remaining = len(plan)
        self.writer: SafetensorsWriter | None = None
        self._lock = threading.Lock()

    def open(self) -> None:
        self.writer = SafetensorsWriter(self.tmp, [(t.name, t.dtype, t.shape) for t in self.plan], metadata={"format": "pt"})

    def write(self, item: _OutTensor) -> None:
        assert self.writer is not None
        pieces = (_int4_pieces(self.ckpt, self.shard, item) if item.kind == "int4"
                  else _copy_pieces(self.ckpt, self.shard, item) if item.kind == "copy" else None)
        if pieces is not None:
            with closing(pieces):  # closes its source fd, also when the write fails midway
                self.writer.write_pieces(item.name, pieces)
        else:
            self.writer.write(item.name, _make_tensor(self.ckpt, self.shard, item))
        if self.fsync:  # start this tensor's writeback now, so the shard's closing fsync has little left
            self.writer.start_writeback(item.name)
        with self._lock:
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.writer.close(fsync=self.fsync)
            _check_unchanged(self.ckpt, self.shard, self.identity)
            os.replace(self.tmp, self.final)

    def abandon(self) -> None:
        if self.writer is not None:
            self.writer._release(fsync=False)
        self.tmp.unlink(missing_ok=True)


def _interleaved(jobs: list[_ShardJob], lanes: int) -> Iterator[tuple[_ShardJob, _OutTensor]]:
    """Every (job, tensor), in shard order but alternating between ``lanes`` shards in progress;
    a lane whose shard is done takes the next one.

    Buffered writes to one file serialize on its inode lock, and a writer waiting for it spins on
    the CPU while the holder copies into the page cache; workers on different shards do not.
    """
    upcoming = (iter([(job, item) for item in job.plan]) for job in jobs if job.plan)
    active: list[Iterator[tuple[_ShardJob, _OutTensor]] | None] = list(islice(upcoming, lanes))
    while active:
        for i, lane in enumerate(active):
            entry = next(lane, None)
            while entry is None and lane is not None:  # this shard is done: the lane takes the next one
                active[i] = lane = next(upcoming, None)
                entry = None if lane is None else next(lane, None)
            if entry is not None:
                yield entry
        active = [lane for lane in active if lane is not None]


def _run_jobs(jobs: list[_ShardJob], n_workers: int, advance: Callable[[int], None]) -> None:
    """Decode and write every job's tensors on ``n_workers`` threads, shards overlapping.

    Tensors are submitted with at most 2 per worker in flight, so memory stays bounded whatever
    the shard size, alternating between ``n_workers`` shards in progress at once (see
    :func:`_interleaved`; measured: 0.22 vs 0.33 s median wall for 1.09 GB on 2 cores, and less CPU
    lost spinning once writeback runs). Letting the next shard start while the last one's tail and
    fsync run keeps every core busy.
    """
    if not jobs:
        return

    def work(job: _ShardJob, item: _OutTensor) -> None:
        job.write(item)
        advance(item.nbytes)

    pending: set[Future[None]] = set()
    with ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="dequant", initializer=_set_thread_chunk,
                            initargs=(_chunk_for(n_workers),)) as pool:
        try:
            for job, item in _interleaved(jobs, n_workers):
                if job.writer is None:
                    job.open()
                if len(pending) >= 2 * n_workers:
                    finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for f in finished:
                        f.result()
                pending.add(pool.submit(work, job, item))
            for f in pending:
                f.result()
        except BaseException:
            for f in pending:
                f.cancel()
            wait(pending)
            for job in jobs:
                if not job.final.exists():
                    job.abandon()
            raise


def _check_unchanged(ckpt: _Checkpoint, shard: str, identity: dict[str, Any]) -> None:
    st = (ckpt.path / shard).stat()
    if [st.st_size, st.st_mtime_ns] != identity["files"][shard]:
        raise KtflowError(
            f"{ckpt.path / shard} changed while it was being converted; rerun the stage once the source is stable"
        )


def _copy_other_files(src: Path, staging: Path, skip: set[str]) -> None:
    """Copy tokenizer, remote code, chat template, generation config...: everything but shards."""
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if rel.as_posix() in skip or any(part.startswith(".") for part in rel.parts):
            continue
        target = staging / rel
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
