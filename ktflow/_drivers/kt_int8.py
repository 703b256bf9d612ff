"""BF16 (or Kimi INT4) routed experts -> kt-kernel AMXINT8 expert shards, run inside the serving toolchain.

Started by :func:`ktflow.stages.quantize_int8.quantize_int8` as::

    <serve python> -m ktflow._drivers.kt_int8 --plan STAGING/.ktflow-int8-plan.json

with ``PYTHONPATH`` naming a directory that holds only the ``ktflow`` package. It imports the
standard library, torch, kt_kernel and ktflow's import-light ``safetensors_io``/``quant_decode``, never
pydantic or Prefect. The plan (JSON, written by the orchestrator) names every source tensor, so
this program makes no decisions about the checkpoint: it quantizes, writes, verifies.

What it does, in order (the same sequence as kt-kernel's own ``scripts/convert_cpu_weights.py``,
with resumability and bounded memory added):

1. Per MoE layer: the BF16 experts are read straight into three preallocated ``[E, I, H]`` /
   ``[E, H, I]`` buffers (no per-expert tensors, no ``torch.stack`` copy); a Kimi INT4 source's packed
   experts are decoded into them instead, by ktflow's bit-exact decode rule (no BF16 copy on disk). Then
   they are handed to kt-kernel's
   ``KTMoEWrapper(method="AMXINT8", cpu_save=True, threadpool_count=T)`` whose C++ side quantizes
   (per output row, scale = amax/127), packs and writes ``_layer_L/_numa_N/INT8_*.kt`` files into
   a scratch directory (``/dev/shm`` by default). Those files are streamed one at a time into the
   layer's safetensors shard (``blk.L.ffn_{gate,up,down}_exps.E.numa.N.{weight,scale}``), written
   under ``<shard>.tmp``, fsynced and renamed: a shard under its final name is complete. A layer
   whose shard already exists with the planned header is reused; a ``.tmp`` left by a kill is redone.
2. Verification: for the sampled layers, a second wrapper (no ``cpu_save``) loads the written
   shards through kt-kernel's own ``SafeTensorLoader`` (what sglang-kt's ``--kt-weight-path`` does)
   and runs its MoE forward on random tokens with random top-k routing; the result is compared with
   a float64 torch MoE of the BF16 weights. Exits with status 3 if a layer exceeds ``max_rel_err``.
3. The non-expert shard (every other tensor, ``model.layers.`` renamed ``blk.``), streamed tensor
   by tensor, same tmp + rename.

kt-kernel 0.7.2 never frees a wrapper's weight buffers, so each quantized or verified layer stays
in this process's RAM until it exits. The plan's ``wrappers_per_process`` bounds that: when it is
spent the driver exits with :data:`EXIT_RECYCLE` and the orchestrator starts a fresh one, which
skips what is already complete.

The merge stage drives it too: the plan's ``method`` may be ``AMXINT4`` (same layout, ``INT4`` .kt files,
two codes a byte), its ``lora`` names a converted adapter whose per-expert LoRA is merged into each layer's
buffers as they are loaded (:mod:`ktflow.formats.lora_merge`), and ``non_expert.source`` the checkpoint the
non-expert shard is copied from (the merged one).

Every event is one stdout line ``KTFLOW-INT8 <json>`` (see :data:`EVENT_PREFIX`).

kt-kernel's Python wrapper allocates pinned host memory, which needs a CUDA driver. On a host
without CUDA the pinning is dropped (kt-kernel's buffers become plain CPU tensors); quantize, load
and forward then run on the CPU, synchronously (``copy_inputs_to_cpu_buffers`` +
``run_pinned_forward_sync``), as in shared/reference/ktransformers.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ktflow.formats.kt_layout import KT_WEIGHT_BITS, PROJS, expert_key, kt_file_name, slice_sizes
from ktflow.formats.safetensors_io import (
    DTYPE_SIZES,
    SafetensorsHeader,
    SafetensorsWriter,
    fsync_dir,
    read_header,
    read_tensor,
)

EVENT_PREFIX = "KTFLOW-INT8 "
PLAN_NAME = ".ktflow-int8-plan.json"
TMP_SUFFIX = ".tmp"
SCRATCH_PREFIX = "ktflow-int8-"
KT_METHOD = "AMXINT8"
# What the driver can make (the plan's "method", AMXINT8 when absent) and kt-kernel's .kt file tag of each. AMXINT4
# is laid out as AMXINT8 (one fp32 scale per output row), two codes a byte (KT_WEIGHT_BITS).
FILE_TAGS = {"AMXINT8": "INT8", "AMXINT4": "INT4"}
CHUNK = 512  # chunked_prefill_size: kt-kernel's per-forward token capacity (buffers sized by it)
EXIT_VERIFY_FAILED = 3
EXIT_RECYCLE = 75  # the budget of kt-kernel wrappers is spent: rerun the driver to go on (complete work is kept)

Plan = list[tuple[str, str, tuple[int, ...]]]
_DTYPE_RANK = {name: rank for rank, name in enumerate(DTYPE_SIZES)}  # safetensors' Rust enum order


# --------------------------------------------------------------------------- the output layout


def safetensors_order(plan: Plan) -> Plan:
    """The order ``safetensors.torch.save_file`` lays tensors out in: dtype (enum) descending, then name.

    Writing in this order makes our header byte-identical to the one ``save_file`` (which
    convert_cpu_weights.py uses) writes for the same tensors without metadata.
    """
    return sorted(plan, key=lambda t: (-_DTYPE_RANK[t[1]], t[0]))


def method_slice_sizes(proj: str, hidden: int, moe_intermediate: int, threadpool_count: int,
                       method: str = KT_METHOD) -> tuple[int, int]:
    """:func:`~ktflow.formats.kt_layout.slice_sizes` for ``method``: AMXINT4 packs two codes a byte."""
    nbytes, scales = slice_sizes(proj, hidden, moe_intermediate, threadpool_count)
    return nbytes * KT_WEIGHT_BITS[method] // 8, scales


def layer_plan(layer: int, experts: int, hidden: int, moe_intermediate: int, threadpool_count: int,
               method: str = KT_METHOD) -> Plan:
    """Every tensor of one MoE layer's shard, as ``(name, dtype, shape)``, in file order."""
    plan: Plan = []
    for numa in range(threadpool_count):
        for expert in range(experts):
            for proj in PROJS:
                nbytes, scales = method_slice_sizes(proj, hidden, moe_intermediate, threadpool_count, method)
                plan.append((expert_key(layer, proj, expert, numa, "weight"), "I8", (nbytes,)))
                plan.append((expert_key(layer, proj, expert, numa, "scale"), "F32", (scales,)))
    return safetensors_order(plan)


def layer_index_names(layer: int, experts: int, threadpool_count: int) -> list[str]:
    """The layer's tensor names in the order convert_cpu_weights.py lists them in its index
    (NUMA slice, expert, then down/gate/up, weight before scale)."""
    return [expert_key(layer, proj, expert, numa, kind)
            for numa in range(threadpool_count) for expert in range(experts)
            for proj in ("down", "gate", "up") for kind in ("weight", "scale")]


def kt_file(scratch: Path, layer: int, numa: int, proj: str, expert: int, nbytes: int, kind: str,
            method: str = KT_METHOD) -> Path:
    """Where kt-kernel's cpu_save writes one slice under ``scratch`` (:func:`ktflow.formats.kt_layout.kt_file_name`;
    AMXINT4's files are named as AMXINT8's with the tag INT4)."""
    name = kt_file_name(layer, numa, proj, expert, nbytes, kind)
    directory, _, file = name.rpartition("/")
    return scratch / directory / (FILE_TAGS[method] + file[file.index("_"):])


# --------------------------------------------------------------------------- the float64 reference


def reference_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """float64 routed-expert MoE: ``sum_k w_k * down_e(silu(gate_e x) * up_e x)`` per token.

    ``gate``/``up`` are ``[E, I, H]``, ``down`` ``[E, H, I]`` (BF16, as in the checkpoint).
    """
    xd = x.to(torch.float64)
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64)
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        h = xd[rows]
        act = torch.nn.functional.silu(h @ gate[e].to(torch.float64).T) * (h @ up[e].to(torch.float64).T)
        y = act @ down[e].to(torch.float64).T
        out.index_add_(0, rows, y * weights[rows, slots].to(torch.float64)[:, None])
    return out


# --------------------------------------------------------------------------- plumbing


def emit(event: str, **fields: Any) -> None:
    print(EVENT_PREFIX + json.dumps({"event": event, **fields}), flush=True)


class DriverError(RuntimeError):
    """Something this driver checks failed (the message says what); exit status 1."""


def _neutralize_pinning() -> None:
    """Without CUDA, make kt-kernel's ``pin_memory=True`` host buffers plain CPU tensors."""
    if torch.cuda.is_available():
        return
    import kt_kernel.experts_base as experts_base

    class _Unpinned:
        def __init__(self, module: Any) -> None:
            self._module = module

        def __getattr__(self, name: str) -> Any:
            attr = getattr(self._module, name)
            if name in ("zeros", "empty", "full", "ones"):
                def unpinned(*args: Any, **kwargs: Any) -> Any:
                    kwargs.pop("pin_memory", None)
                    return attr(*args, **kwargs)
                return unpinned
            return attr

    experts_base.torch = _Unpinned(torch)  # type: ignore[attr-defined]


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (killed, not yet reaped: some container inits reap late) is dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] not in "ZX"
    except (OSError, ValueError, IndexError):
        return True


def _clean_stale_scratch(root: Path) -> None:
    """Remove scratch dirs of earlier drivers that died (kill -9 leaves one layer in /dev/shm)."""
    for d in root.glob(SCRATCH_PREFIX + "*"):
        suffix = d.name[len(SCRATCH_PREFIX):]
        if suffix.isdigit() and int(suffix) != os.getpid() and not _pid_alive(int(suffix)):
            shutil.rmtree(d, ignore_errors=True)


class _Source:
    """The source checkpoint: headers on demand, experts read (BF16) or decoded (Kimi INT4) into caller buffers.

    A plan entry ``[file, name]`` is a BF16 expert weight, read as it is; ``[file, packed, scale_file, scale]``
    is a compressed-tensors ``pack-quantized`` INT4 weight (Kimi-K2/K2.5), decoded to BF16 bit for bit by
    ktflow's own decode rule (:mod:`ktflow.formats.quant_decode`, the dequantize stage's): the INT8 made from
    it equals the INT8 made from the dequantize stage's BF16 output, without that copy on disk.
    """

    def __init__(self, path: Path, threads: int = 1, lora: dict[str, Any] | None = None) -> None:
        self.path = path
        self.threads = max(1, threads)
        self._headers: dict[str, SafetensorsHeader] = {}
        self._lock = threading.Lock()
        # An adapter merged into the experts as they are loaded (the merge stage): its directory and
        # lora_alpha / r; each layer entry's "lora" names every expert's A and B.
        self.lora = _Adapter(Path(lora["source"]), float(lora["scale"])) if lora else None

    def header(self, file: str) -> SafetensorsHeader:
        with self._lock:
            if file not in self._headers:
                self._headers[file] = read_header(self.path / file)
            return self._headers[file]

    def _info(self, file: str, name: str) -> tuple[SafetensorsHeader, Any]:
        header = self.header(file)
        info = header.tensors.get(name)
        if info is None:
            raise DriverError(f"{header.path}: no tensor '{name}'")
        return header, info

    def read_into(self, file: str, name: str, out: torch.Tensor, *, dtype: str = "BF16",
                  shape: tuple[int, ...] | None = None) -> None:
        """The tensor's bytes into ``out``; it must be ``dtype`` of ``shape`` (default: ``out``'s shape)."""
        header, info = self._info(file, name)
        if info.dtype != dtype or tuple(info.shape) != (shape or tuple(out.shape)):
            raise DriverError(f"{header.path}: tensor '{name}' is {info.dtype} {list(info.shape)}; "
                              f"expected {dtype} {list(shape or out.shape)}")
        view = memoryview(out.view(torch.uint8).reshape(-1).numpy())
        fd = os.open(header.path, os.O_RDONLY)
        try:
            done = 0
            while done < info.nbytes:
                got = os.preadv(fd, [view[done:]], info.start + done)
                if got <= 0:
                    raise DriverError(f"{header.path}: tensor '{name}' is truncated")
                done += got
        finally:
            os.close(fd)

    def decode_int4_into(self, file: str, packed: str, scale_file: str, scale: str, out: torch.Tensor) -> None:
        """``out`` [rows, cols] BF16 <- the INT4 weight ``packed`` (I32 [rows, cols/8]) with its BF16 ``scale``."""
        from ktflow.formats.quant_decode import INT4_GROUP_SIZE, _scratch_buffer, decode_int4_pack_quantized

        rows, cols = out.shape
        # this thread's scratch, reused: a fresh tensor per expert costs its page faults
        packed_buf = _scratch_buffer("packed", rows * cols // 2, torch.uint8)
        scale_buf = _scratch_buffer("scale", rows * (cols // INT4_GROUP_SIZE) * 2, torch.uint8)
        self.read_into(file, packed, packed_buf, dtype="I32", shape=(rows, cols // 8))
        self.read_into(scale_file, scale, scale_buf, shape=(rows, cols // INT4_GROUP_SIZE))
        scales = scale_buf.view(torch.bfloat16).view(rows, cols // INT4_GROUP_SIZE)
        if not bool(torch.isfinite(scales).all()):  # NaN/inf weights would quantize to garbage silently
            raise DriverError(f"{self.header(scale_file).path}: tensor '{scale}' has NaN or infinite scales: "
                              "the shard is corrupt; re-download it")
        decode_int4_pack_quantized(packed_buf.view(torch.int32).view(rows, cols // 8), scales, (rows, cols), out=out)

    def _load_one(self, item: list[str], out: torch.Tensor, lora: list[str] | None = None) -> None:
        if len(item) == 2:
            self.read_into(item[0], item[1], out)
        else:
            self.decode_int4_into(item[0], item[1], item[2], item[3], out)
        if lora is not None:
            assert self.lora is not None
            self.lora.merge_into(out, lora)

    def load_layer(self, entry: dict[str, Any], bufs: dict[str, torch.Tensor]) -> None:
        """One layer's experts into ``bufs``, decoded where INT4, with the plan's adapter merged in."""
        loras = entry.get("lora") or {}
        jobs = [(item, bufs[proj][e], (loras.get(proj) or [None] * len(entry[proj]))[e])
                for proj in PROJS for e, item in enumerate(entry[proj])]
        if self.threads == 1 or all(len(item) == 2 and lora is None for item, _, lora in jobs):
            for item, out, lora in jobs:  # BF16: plain reads, the disk's pace either way
                self._load_one(item, out, lora)
            return
        # INT4 decodes and merges are CPU work (torch releases the GIL in its kernels): experts over threads
        with ThreadPoolExecutor(max_workers=self.threads) as pool:
            for future in [pool.submit(self._load_one, item, out, lora) for item, out, lora in jobs]:
                future.result()


class _Adapter:
    """A converted adapter's per-expert LoRA, read one matrix at a time and merged by ktflow's rule
    (:func:`ktflow.formats.lora_merge.merge_lora_`, bit-identical to the orchestrator's merge)."""

    def __init__(self, path: Path, scale: float) -> None:
        self.source = _Source(path)
        self.scale = scale

    def merge_into(self, weight: torch.Tensor, item: list[str]) -> None:
        """``item`` = ``[file, lora_A name, file, lora_B name]``."""
        from ktflow.formats.lora_merge import merge_lora_

        a = read_tensor(self.source.header(item[0]), item[1])
        b = read_tensor(self.source.header(item[2]), item[3])
        rows, cols = weight.shape
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != cols or b.shape[0] != rows or a.shape[0] != b.shape[1]:
            raise DriverError(f"LoRA '{item[1]}' {list(a.shape)} / '{item[3]}' {list(b.shape)} does not fit the "
                              f"expert weight {[rows, cols]}")
        merge_lora_(weight, a, b, self.scale)


def _header_matches(path: Path, plan: Plan) -> bool:
    """A file under its final name was renamed there complete; check its header against the plan anyway."""
    try:
        header = read_header(path)
    except Exception:  # noqa: BLE001 - any unreadable file is simply not complete
        return False
    return [(t.name, t.dtype, tuple(t.shape)) for t in header.tensors.values()] == [
        (n, d, tuple(s)) for n, d, s in plan]


def _kt_wrapper(plan: dict[str, Any], layer: int, weight_path: Path, cpu_save: bool) -> Any:
    from kt_kernel import KTMoEWrapper

    experts = plan["experts"]
    return KTMoEWrapper(
        layer_idx=layer,
        num_experts=experts,
        num_experts_per_tok=plan["top_k"],
        hidden_size=plan["hidden"],
        moe_intermediate_size=plan["moe_intermediate"],
        gpu_experts_mask=torch.zeros(experts, dtype=torch.bool),  # every expert on the CPU
        cpuinfer_threads=plan["threads"],
        threadpool_count=plan["threadpool_count"],
        weight_path=str(weight_path),
        chunked_prefill_size=CHUNK,
        cpu_save=cpu_save,
        method=plan.get("method", KT_METHOD),
    )


# --------------------------------------------------------------------------- the three steps


def quantize_layer(plan: dict[str, Any], entry: dict[str, Any], source: _Source, bufs: dict[str, torch.Tensor],
                   scratch: Path, staging: Path, copy_buf: torch.Tensor) -> None:
    """Quantize one layer with kt-kernel and publish its shard (tmp, fsync, rename)."""
    layer, experts, T = entry["layer"], plan["experts"], plan["threadpool_count"]
    hidden, inter, method = plan["hidden"], plan["moe_intermediate"], plan.get("method", KT_METHOD)
    source.load_layer(entry, bufs)
    wrapper = _kt_wrapper(plan, layer, scratch, cpu_save=True)
    wrapper.load_weights_from_tensors(bufs["gate"], bufs["up"], bufs["down"], torch.arange(experts, dtype=torch.int64))
    del wrapper  # frees kt-kernel's in-memory copy of the quantized layer before the next one
    gc.collect()

    final = staging / entry["shard"]
    tmp = final.with_name(final.name + TMP_SUFFIX)
    tensors = layer_plan(layer, experts, hidden, inter, T, method)
    sources: dict[str, Path] = {}
    for numa in range(T):
        for expert in range(experts):
            for proj in PROJS:
                nbytes, scales = method_slice_sizes(proj, hidden, inter, T, method)
                sources[expert_key(layer, proj, expert, numa, "weight")] = kt_file(
                    scratch, layer, numa, proj, expert, nbytes, "quant", method)
                sources[expert_key(layer, proj, expert, numa, "scale")] = kt_file(
                    scratch, layer, numa, proj, expert, scales * 4, "scale", method)
    try:
        with _into_place(tmp, final, staging, plan["fsync"]), SafetensorsWriter(tmp, tensors, metadata=None) as writer:
            for name, dtype, shape in tensors:
                path = sources[name]
                nbytes = DTYPE_SIZES[dtype] * shape[0]
                try:
                    size = path.stat().st_size
                except FileNotFoundError:
                    found = sorted(p.name for p in path.parent.glob("*"))[:6] if path.parent.is_dir() else []
                    raise DriverError(f"kt-kernel wrote no {path} (this kt-kernel's cpu_save layout differs from "
                                      f"the one ktflow reads; found e.g. {found})") from None
                if size != nbytes:
                    raise DriverError(f"{path} has {size} bytes; expected {nbytes}")
                view = copy_buf[:nbytes]
                with open(path, "rb", buffering=0) as f:
                    done = 0
                    mv = memoryview(view.numpy())
                    while done < nbytes:
                        got = f.readinto(mv[done:])
                        if not got:
                            raise DriverError(f"{path} shrank while being read")
                        done += got
                writer.write(name, view.view(torch.int8 if dtype == "I8" else torch.float32).reshape(shape))
            writer.close(fsync=plan["fsync"])
    finally:
        shutil.rmtree(scratch / f"_layer_{layer}", ignore_errors=True)


def verify_layer(plan: dict[str, Any], entry: dict[str, Any], source: _Source, bufs: dict[str, torch.Tensor],
                 staging: Path) -> dict[str, Any]:
    """kt-kernel's AMXINT8 forward from the written shards vs a float64 MoE of the BF16 weights."""
    from kt_kernel.experts_base import KExpertsCPUBuffer

    layer, experts, top_k, hidden = entry["layer"], plan["experts"], plan["top_k"], plan["hidden"]
    tokens, seed = plan["verify"]["tokens"], plan["verify"]["seed"]
    started = time.perf_counter()
    source.load_layer(entry, bufs)
    gen = torch.Generator().manual_seed(seed * 100_003 + layer)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k].contiguous()
    w = torch.rand(tokens, top_k, generator=gen) + 0.05
    w = (w / w.sum(dim=1, keepdim=True)).to(torch.float32)

    wrapper = _kt_wrapper(plan, layer, staging, cpu_save=False)
    wrapper.load_weights(torch.arange(experts, dtype=torch.int64))
    wrapper.copy_inputs_to_cpu_buffers(x, ids, w)
    wrapper.run_pinned_forward_sync(x, None)
    slot = layer % KExpertsCPUBuffer.buffer_depth
    out = KExpertsCPUBuffer.get_buffer(x, top_k)[4][slot].to(torch.float64).clone()
    del wrapper
    gc.collect()

    ref = reference_moe(x, ids, w, bufs["gate"], bufs["up"], bufs["down"])
    diff = (out - ref).abs()
    cosine = torch.nn.functional.cosine_similarity(out.reshape(-1), ref.reshape(-1), dim=0).item()
    return {"layer": layer, "tokens": tokens, "top_k": top_k, "seed": seed,
            "mean_rel_err": (diff.mean() / ref.abs().mean()).item(),
            "max_abs_err": diff.max().item(), "ref_mean_abs": ref.abs().mean().item(), "cosine": cosine,
            "seconds": round(time.perf_counter() - started, 3)}


def write_non_expert(plan: dict[str, Any], source: _Source, staging: Path) -> str:
    """Copy every non-expert tensor (renamed per the plan) into one shard; 'done' or 'reused'.

    ``non_expert.source``, where the plan names one, is the checkpoint they are read from instead of
    the experts' source (the merge stage's merged non-expert weights)."""
    spec = plan["non_expert"]
    if spec.get("source"):
        source = _Source(Path(spec["source"]))
    final = staging / spec["shard"]
    tmp = final.with_name(final.name + TMP_SUFFIX)
    origin = {}
    tensors: Plan = []
    for out_name, file, name in spec["tensors"]:
        info = source.header(file).tensors[name]
        tensors.append((out_name, info.dtype, tuple(info.shape)))
        origin[out_name] = (file, name)
    tensors = safetensors_order(tensors)
    if final.exists() and _header_matches(final, tensors):
        return "reused"
    with _into_place(tmp, final, staging, plan["fsync"]), SafetensorsWriter(tmp, tensors, metadata=None) as writer:
        for out_name, _, _ in tensors:
            file, name = origin[out_name]
            writer.write(out_name, read_tensor(source.header(file), name))
        writer.close(fsync=plan["fsync"])
    return "done"


@contextlib.contextmanager
def _into_place(tmp: Path, final: Path, staging: Path, fsync: bool) -> Iterator[None]:
    """A shard written as ``tmp`` inside goes to ``final`` (durably, with ``fsync``), or is removed on failure."""
    try:
        yield
        os.replace(tmp, final)
        if fsync:
            fsync_dir(staging)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def run(plan: dict[str, Any], staging: Path) -> int:
    started = time.perf_counter()
    _neutralize_pinning()
    # kt-kernel's worker threads spin on the cores while idle; torch's own intra-op threads (the
    # float64 reference) would fight them and run ~100x slower. One torch thread does this job.
    torch.set_num_threads(1)
    _emit_start(plan)
    # INT4 sources are decoded by a pool of threads (at most 16: the decode streams memory, and more threads
    # only queue on the memory bus)
    source = _Source(Path(plan["source"]), threads=min(16, int(plan.get("threads") or 1)), lora=plan.get("lora"))
    experts, hidden, inter, T = plan["experts"], plan["hidden"], plan["moe_intermediate"], plan["threadpool_count"]
    method = plan.get("method", KT_METHOD)
    bufs = {"gate": torch.empty(experts, inter, hidden, dtype=torch.bfloat16),
            "up": torch.empty(experts, inter, hidden, dtype=torch.bfloat16),
            "down": torch.empty(experts, hidden, inter, dtype=torch.bfloat16)}
    largest = max(max(method_slice_sizes(p, hidden, inter, T, method)[0], 4 * slice_sizes(p, hidden, inter, T)[1])
                  for p in PROJS)
    budget = _Budget(plan.get("wrappers_per_process") or 0)
    if not _quantize_layers(plan, source, bufs, torch.empty(largest, dtype=torch.uint8), staging, budget):
        return EXIT_RECYCLE
    code = _verify_layers(plan, source, bufs, staging, budget)
    if code is not None:
        return code
    del bufs

    t0 = time.perf_counter()
    status = write_non_expert(plan, source, staging)
    emit("non_expert", status=status, shard=plan["non_expert"]["shard"], tensors=len(plan["non_expert"]["tensors"]),
         seconds=round(time.perf_counter() - t0, 3))
    emit("done", seconds=round(time.perf_counter() - started, 3), peak_rss_bytes=_peak_rss())
    return 0


def _emit_start(plan: dict[str, Any]) -> None:
    from importlib import metadata

    import kt_kernel

    emit("start", kt_kernel=metadata.version("kt-kernel"), torch=torch.__version__,
         cpu_variant=getattr(kt_kernel, "__cpu_variant__", None),
         int8_kernel=getattr(kt_kernel, "__int8_kernel__", None),
         int8_weight_layout=getattr(kt_kernel, "__int8_weight_layout__", None),
         method=plan.get("method", KT_METHOD),
         layers=len(plan["layers"]), threadpool_count=plan["threadpool_count"], threads=plan["threads"])


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Budget:
    """How many kt-kernel wrappers this process may still create.

    kt-kernel 0.7.2 never frees a wrapper's weight buffers (AMX_MOE_BASE aligned_alloc's them and
    nothing frees them): each quantized or verified layer leaks its INT8 size for the life of the
    process, which is how converting a 671B model runs out of RAM. So this process stops after
    ``wrappers_per_process`` wrappers and asks to be restarted (EXIT_RECYCLE); finished layers
    and verifications are kept and not redone.
    """

    def __init__(self, budget: int) -> None:
        self.budget, self.used = budget, 0

    def spent(self, next_step: str) -> bool:
        """Whether the budget is used up (then the restart is asked for, naming ``next_step``)."""
        if self.budget and self.used >= self.budget:
            emit("recycle", wrappers=self.used, budget=self.budget, next=next_step, peak_rss_bytes=_peak_rss())
            return True
        return False


def _quantize_layers(plan: dict[str, Any], source: _Source, bufs: dict[str, torch.Tensor], copy_buf: torch.Tensor,
                     staging: Path, budget: _Budget) -> bool:
    """Every layer's shard, reusing complete ones; False when the budget ran out first."""
    experts, hidden, inter, T = plan["experts"], plan["hidden"], plan["moe_intermediate"], plan["threadpool_count"]
    layers = plan["layers"]
    scratch_root = Path(plan["scratch_dir"])
    scratch_root.mkdir(parents=True, exist_ok=True)
    _clean_stale_scratch(scratch_root)
    scratch = scratch_root / f"{SCRATCH_PREFIX}{os.getpid()}"
    try:
        for i, entry in enumerate(layers):
            t0 = time.perf_counter()
            final = staging / entry["shard"]
            final.with_name(final.name + TMP_SUFFIX).unlink(missing_ok=True)  # a kill's partial layer
            if final.exists() and _header_matches(final, layer_plan(entry["layer"], experts, hidden, inter, T,
                                                                    plan.get("method", KT_METHOD))):
                status = "reused"
            else:
                if budget.spent(f"layer {entry['layer']}"):
                    return False
                scratch.mkdir(parents=True, exist_ok=True)
                quantize_layer(plan, entry, source, bufs, scratch, staging, copy_buf)
                budget.used += 1
                status = "done"
            emit("layer", layer=entry["layer"], index=i + 1, total=len(layers), status=status, shard=entry["shard"],
                 seconds=round(time.perf_counter() - t0, 3))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return True


def _verify_layers(plan: dict[str, Any], source: _Source, bufs: dict[str, torch.Tensor], staging: Path,
                   budget: _Budget) -> int | None:
    """Check the sampled layers through kt-kernel's inference path; an exit code to stop with, or None."""
    by_layer = {entry["layer"]: entry for entry in plan["layers"]}
    for layer in plan["verify"]["layers"]:
        if budget.spent(f"verify layer {layer}"):
            return EXIT_RECYCLE
        result = verify_layer(plan, by_layer[layer], source, bufs, staging)
        budget.used += 1
        emit("verify", **result)
        if not result["mean_rel_err"] <= plan["max_rel_err"]:  # NaN fails too
            emit("verify_failed", layers=[layer], max_rel_err=plan["max_rel_err"])
            return EXIT_VERIFY_FAILED
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ktflow._drivers.kt_int8", description=__doc__.split("\n")[0])
    parser.add_argument("--plan", type=Path, required=True, help="the plan JSON written by ktflow.stages.quantize_int8")
    args = parser.parse_args(argv)
    plan = json.loads(args.plan.read_text(encoding="utf-8"))
    try:
        return run(plan, args.plan.parent)
    except Exception as exc:  # noqa: BLE001 - reported as an event, then as a traceback
        emit("error", message=f"{type(exc).__name__}: {exc}", errno=getattr(exc, "errno", None),
             filename=str(exc.filename) if getattr(exc, "filename", None) else None)
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
