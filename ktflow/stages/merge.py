"""merge: a converted LoRA adapter folded into its base's weights, written as the server reads them.

One streaming pass, layer by layer: every weight the adapter touches becomes
``bf16(W + (lora_alpha / r) * B @ A)`` (:mod:`ktflow.formats.lora_merge`; an INT4 expert is decoded
first, bit-exactly), every other tensor passes through. Nothing holds more than a few tensors (or, for
the kt-kernel formats, one MoE layer's experts) at once, and no BF16 copy of the experts is made
on the way to a quantized output. The output, by ``method`` (sglang-kt's ``--kt-method`` names):

- ``BF16``: the merged model as a BF16 checkpoint (quantization config removed at every level): served
  with ``--kt-method BF16``, ``--kt-weight-path`` and ``--model-path`` both this directory.
- ``RAWINT4`` (Kimi-K2/K2.5 INT4 bases only): the whole checkpoint in the source's layout and scheme
  (compressed-tensors pack-quantized, group 32, symmetric; ``language_model.`` nesting, config and
  remote code as they were): merged experts re-quantized by :mod:`ktflow.formats.quant_encode`, the
  rest BF16. Keeps Kimi's memory footprint; served with ``--kt-method RAWINT4`` from this directory.
- ``AMXINT8`` / ``AMXINT4``: the non-expert weights as a BF16 checkpoint here (``--model-path``;
  config, tokenizer, index; no routed experts), and in ``kt/`` the experts quantized by kt-kernel's
  own quantizer, exactly as quantize-int8 publishes them for the same BF16 experts (its driver,
  :mod:`ktflow._drivers.kt_int8`, merges each layer's expert LoRA into the buffers it hands
  kt-kernel): ``--kt-weight-path OUT/kt --kt-threadpool-count T``.

Cached by the base's identity + the adapter's identity + the method (and T and kt-kernel's version
for the kt-kernel formats). Crash-safe as the other stages: each output shard is written under a
temporary name and renamed when complete; a rerun keeps complete shards (and the driver's complete
layers) and redoes the partial one; the index, config and manifest come last.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from pydantic import BaseModel

from ktflow import store
from ktflow._drivers import kt_int8 as driver
from ktflow.errors import AdapterError, ArtifactBusyError, CheckpointError, InvalidInputError, KtflowError
from ktflow.formats.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_MODEL,
    FUSED_EXPERT_LORA,
    NESTED_PREFIX,
    PEFT_PREFIX,
    validate_adapter,
)
from ktflow.formats.checkpoint import (
    CONFIG_NAME,
    INDEX_NAME,
    CheckpointInfo,
    CheckpointTensors,
    checkpoint_identity,
    copy_other_files,
    identity_digest,
    inspect_checkpoint,
)
from ktflow.formats.kt_layout import MERGED_KT_DIR, kt_layer_sizes
from ktflow.formats.lora_merge import merge_lora_
from ktflow.formats.quant_decode import INT4_GROUP_SIZE, decode_int4_pack_quantized
from ktflow.formats.quant_encode import encode_int4_pack_quantized
from ktflow.formats.safetensors_io import (
    DTYPE_SIZES,
    SafetensorsWriter,
    holds_planned_tensors,
    read_header,
    read_tensor,
)
from ktflow.host.hardware import physical_cores
from ktflow.host.process import single_thread_torch
from ktflow.planning.merge_cost import (
    MERGE_WORKER_BYTES_PER_PARAM,
    PROCESS_RUNTIME_BYTES,
    kt_layers_per_process,
    kt_quantizer_process_ram,
)
from ktflow.recipe.model import INT4_FORMATS
from ktflow.resources import MERGE_STAGE, DiskNeed, HostRequirement, RamNeed, Resources
from ktflow.runner import Job, Progress, StageSpec, find_published, run_stage
from ktflow.stages.quantize_int8 import (
    COPIED_FILES,
    VERIFY_SEED,
    VERIFY_TOKENS,
    _Layout,
    _run_driver,
    _sample_layers,
    _scratch,
    _serving_toolchain,
    check_int8_alignment,
)
from ktflow.store import StageManifest, StoreLayout, atomic_write_bytes, atomic_write_json
from ktflow.units import GiB

STAGE = MERGE_STAGE
MergeMethod = Literal["BF16", "RAWINT4", "AMXINT8", "AMXINT4"]
MERGE_METHODS: tuple[str, ...] = get_args(MergeMethod)
KT_METHODS = ("AMXINT8", "AMXINT4")  # made by kt-kernel's quantizer, in the serving toolchain
KT_DIR = MERGED_KT_DIR  # the kt-kernel formats' expert weights (--kt-weight-path), beside the non-expert checkpoint
INT4_ALIGN = 128  # kt-kernel AMXINT4: k % 128 (hidden, and each NUMA slice of the intermediate dim)
# kt-kernel's own MoE test accepts < 0.05 for INT8; AMXINT4 keeps one scale per output row (no groups), which
# kt-kernel's README warns costs accuracy: its bound is wider (per-row INT4 of Gaussian weights: ~0.1-0.15).
DEFAULT_MAX_REL_ERR = {"AMXINT8": 0.05, "AMXINT4": 0.25}
_JOURNAL = ".ktflow-merge.json"
_LOG = ".ktflow-merge.log"
_TMP_SUFFIX = ".tmp"
_HEADER_BYTES_PER_TENSOR = 128
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|weight_packed|weight_scale|weight_shape)$")
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<matrix>[AB])\.weight$")
_AMX_CPU = HostRequirement(
    stage="merge",
    min_cpu_variant="avx512_base",
    cpu_reason="kt-kernel's AMXINT8/AMXINT4 MoE kernels need AVX512F + AVX512BW (AMX is faster); its avx2 "
               "build has none",
)


class MergeResult(BaseModel):
    """What the merge stage produced."""

    path: Path
    method: str
    cached: bool  # an identical artifact (same base, adapter, method) was already published
    shards: int  # output shards of the checkpoint at ``path`` (kt/ not counted)
    shards_reused: int  # complete shards found from an earlier, interrupted attempt
    tensors_merged: int  # weights a LoRA was merged into (experts included)
    kt_layers: int  # MoE layers in kt/ (kt-kernel formats; 0 otherwise)
    seconds: float
    serve_flags: dict[str, Any]  # what sglang-kt is started with to serve it
    verification: dict[str, Any]  # kt-kernel formats: str(layer) -> kt-kernel's forward vs float64, as quantize-int8
    manifest_digest: str


# --------------------------------------------------------------------------- the adapter


class _Adapter:
    """A converted adapter (convert-lora's output): its scale and, by base module, where A and B are."""

    def __init__(self, adapter_dir: Path, base_dir: Path, prefix: str) -> None:
        self.path = adapter_dir
        if (adapter_dir / FUSED_EXPERT_LORA).exists():
            raise AdapterError(f"adapter_dir {adapter_dir}",
                               f"is KT's raw training output ({FUSED_EXPERT_LORA}); merge reads the converted adapter, "
                               "whose expert LoRA is split per expert.",
                               "convert it first (`ktflow convert-lora`) and merge the converted directory")
        # Checks the config (r, lora_alpha; refuses use_rslora, use_dora, rank_pattern, alpha_pattern: scalings
        # this merge does not apply) and every LoRA key against the base's shapes, from headers only.
        self.rank, _ = validate_adapter(adapter_dir, base_dir)
        config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        alpha = config.get("lora_alpha")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
            raise AdapterError(f"{adapter_dir / ADAPTER_CONFIG}: lora_alpha", f"is {alpha!r}; the merge scales each "
                               "LoRA by lora_alpha / r.", "restore adapter_config.json from the training output")
        self.alpha = float(alpha)
        self.scale = self.alpha / self.rank
        # Read once: every merged weight reads its A and B through it (a header read a weight grew with the
        # adapter's size, so the merge's time grew with the square of the model's depth).
        self.header = header = read_header(adapter_dir / ADAPTER_MODEL)
        found: dict[str, dict[str, str]] = {}
        for key in header.tensors:
            name = key.removeprefix(PEFT_PREFIX)
            match = _LORA.match(name)
            if match is None:  # validate_adapter let it through: an embedding's lora_embedding_A/B
                raise AdapterError(f"{adapter_dir / ADAPTER_MODEL}: tensor '{key}'",
                                   "is an embedding LoRA; merge folds Linear LoRA only.",
                                   "serve this adapter through the LoRA path instead of merging it")
            module = match.group("module")
            if prefix and not module.startswith(prefix):
                module = prefix + module  # kt-kernel's expert keys leave Kimi-K2.5's language_model. out
            found.setdefault(module, {})[match.group("matrix")] = key
        self.modules = {module: (keys["A"], keys["B"]) for module, keys in found.items()}
        self.identity = _adapter_identity(adapter_dir)


def _adapter_identity(adapter_dir: Path) -> dict[str, Any]:
    """The adapter's published manifest digest (convert-lora's output), else its files' sizes and mtimes."""
    published = store.read_manifest(adapter_dir)
    if published is not None:
        return {"manifest": published.digest()}
    files = {}
    for name in (ADAPTER_MODEL, ADAPTER_CONFIG):
        st = (adapter_dir / name).stat()
        files[name] = [st.st_size, st.st_mtime_ns]
    return {"files": files}


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class _Item:
    """One unit of work: a base tensor (or an INT4 weight with its companions) -> its output tensors."""

    kind: str  # "copy" | "merge" | "decode" (INT4 -> BF16, merged when ``lora``) | "reencode" (INT4 -> merged INT4)
    source: str  # the base tensor (for INT4: the weight_packed)
    outputs: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, shape)
    lora: tuple[str, str] | None = None  # (A key, B key) in the adapter

    @property
    def nbytes(self) -> int:
        total = 0
        for _, dtype, shape in self.outputs:
            n = DTYPE_SIZES[dtype]
            for d in shape:
                n *= d
            total += n
        return total

    @property
    def worker_bytes(self) -> int:
        """What a worker holds while making this item: a copy its tensors twice (read, written); a merge or an
        INT4 weight its float64 product (W += B @ A) beside the BF16 weight and the encoder's float32 rows."""
        if self.kind == "copy":
            return 2 * self.nbytes
        rows, cols = self.outputs[0][2][0], self.outputs[0][2][-1] * (8 if self.kind == "reencode" else 1)
        return rows * cols * MERGE_WORKER_BYTES_PER_PARAM


_Base = CheckpointTensors  # the base checkpoint: headers on demand, one tensor read at a time


def read_base_tensor(base: _Base, name: str) -> torch.Tensor:
    """One base tensor, read on its own (the only way the merge reads the base: tests count the reads)."""
    return base.tensor(name)


def _plan(base: _Base, info: CheckpointInfo, adapter: _Adapter, method: str) -> dict[str, list[_Item]]:
    """Every output shard of the checkpoint at OUT (one per layer, the rest first) and its items, in order."""
    unused = dict(adapter.modules)
    by_shard: dict[int, list[_Item]] = {}
    names = sorted(base.weight_map)
    for name in names:
        expert = _EXPERT.search(name)
        module = name.rpartition(".")[0]
        if expert is not None and expert.group(3) in ("weight_scale", "weight_shape"):
            continue  # an INT4 weight's companions go with its weight_packed
        lora = unused.pop(module, None)
        tensor_info = base.tensor_info(name)
        if expert is not None and method in KT_METHODS:
            continue  # kt-kernel's driver quantizes the experts, merging their LoRA itself
        if expert is not None and expert.group(3) == "weight_packed":
            rows, cols = (int(v) for v in base.tensor(module + ".weight_shape").tolist())
            if cols % INT4_GROUP_SIZE or tensor_info.shape[1] * 8 != cols:
                raise CheckpointError(f"{base.path / base.weight_map[name]}: tensor '{name}'",
                                      f"has {cols} columns, not whole INT4 groups of {INT4_GROUP_SIZE}.",
                                      "dequantize this checkpoint to BF16 first (`ktflow dequantize`), then merge that")
            if method == "RAWINT4":
                companions = [(n, base.tensor_info(n).dtype, tuple(base.tensor_info(n).shape))
                              for n in (name, module + ".weight_scale", module + ".weight_shape")]
                item = _Item("reencode" if lora else "copy", name, tuple(companions), lora)
            else:
                item = _Item("decode", name, ((module + ".weight", "BF16", (rows, cols)),), lora)
        elif lora is not None:
            if len(tensor_info.shape) != 2 or tensor_info.dtype not in ("BF16", "F32", "F16"):
                raise CheckpointError(f"{base.path / base.weight_map[name]}: tensor '{name}'",
                                      f"is {tensor_info.dtype} {list(tensor_info.shape)}; a LoRA merges into a 2-D "
                                      "BF16/F32/F16 weight.", "merge into a BF16 or Kimi INT4 checkpoint")
            item = _Item("merge", name, ((name, tensor_info.dtype, tuple(tensor_info.shape)),), lora)
        else:
            item = _Item("copy", name, ((name, tensor_info.dtype, tuple(tensor_info.shape)),))
        layer = _LAYER.search(name)
        by_shard.setdefault(int(layer.group(1)) + 1 if layer else 0, []).append(item)
    leftover = [m for m in unused if not (method in KT_METHODS and ".mlp.experts." in m)]
    if leftover:
        raise AdapterError(f"{adapter.path / ADAPTER_MODEL}", f"has LoRA for {len(leftover)} module(s) the merge found "
                           f"no weight for (e.g. {leftover[:3]}).", "check that the adapter was trained on this base")
    keys = sorted(by_shard)
    return {f"model-{k + 1:05d}-of-{len(keys):05d}.safetensors": by_shard[key] for k, key in enumerate(keys)}


def _expert_loras(base: _Base, adapter: _Adapter, layout: _Layout, prefix: str) -> None:
    """Add each MoE layer's expert LoRA (``[file, A, file, B]`` per expert and projection) to the driver's layers."""
    for entry in layout.layers:
        loras: dict[str, list[list[str] | None]] = {}
        for proj in driver.PROJS:
            per_expert: list[list[str] | None] = []
            for e in range(len(entry[proj])):
                keys = adapter.modules.get(f"{prefix}model.layers.{entry['layer']}.mlp.experts.{e}.{proj}_proj")
                per_expert.append([ADAPTER_MODEL, keys[0], ADAPTER_MODEL, keys[1]] if keys else None)
            loras[proj] = per_expert
        entry["lora"] = loras


# --------------------------------------------------------------------------- the stage


@dataclass(frozen=True)
class MergeRequest:
    """The merge stage's arguments (see :func:`merge_adapter`)."""

    base_dir: Path
    adapter_dir: Path
    out_dir: Path
    method: str
    threadpool_count: int = 1
    serve_python: Path | None = None
    workers: int | None = None
    verify_layers: int = 2
    max_rel_err: float | None = None
    fsync: bool = True
    scratch_dir: Path | None = None
    layers_per_process: int | None = None


class MergeSizes(BaseModel):
    """What the merge's disk, RAM and host needs are a function of."""

    method: str
    output_bytes: int  # every tensor of the output (kt/ included), written or not
    left_bytes: int  # what is still to be written (an interrupted attempt's complete shards excluded)
    tensors: int
    other_bytes: int  # config, tokenizer and other files copied
    largest_tensor_bytes: int  # one weight, as a worker holds it
    in_flight_bytes: int = 0  # what the workers hold at once at most: the ``workers`` largest items' worker_bytes
    layer_bf16_bytes: int = 0  # kt-kernel formats: one MoE layer's experts in BF16 (the driver's buffers)
    layer_quant_bytes: int = 0  # ... and quantized


def _workers(request: MergeRequest) -> int:
    """Tensors merged at once: the request's, else a worker a physical core."""
    return request.workers or physical_cores()


def merge_needs(request: MergeRequest, sizes: MergeSizes) -> Resources:
    """The host's CPU (kt-kernel formats), RAM for a few tensors per worker (or one MoE layer), disk for the output."""
    workers = _workers(request)
    if sizes.method in KT_METHODS:
        on_tmpfs = _scratch(request, sizes.layer_quant_bytes)[2]
        ram = kt_quantizer_process_ram(sizes.layer_bf16_bytes, sizes.layer_quant_bytes, scratch_in_ram=on_tmpfs)
        why = (f"{sizes.layer_bf16_bytes / GiB:.2f} GiB of one MoE layer's BF16 experts twice (the driver's and "
               "kt-kernel's as it quantizes) + its quantized form in kt-kernel"
               + (" and its scratch in a tmpfs" if on_tmpfs else "")
               + f" + ~{PROCESS_RUNTIME_BYTES / GiB:.0f} GiB for python, torch and kt-kernel")
        host: HostRequirement | None = _AMX_CPU
    else:
        # each worker holds one item: a weight as read, its float64 merge and the result
        in_flight = sizes.in_flight_bytes or workers * 3 * sizes.largest_tensor_bytes
        ram = in_flight + PROCESS_RUNTIME_BYTES
        why = (f"{workers} worker(s), each holding one weight, its float64 merge and the result "
               f"({in_flight / GiB:.2f} GiB at most at once) + ~{PROCESS_RUNTIME_BYTES / GiB:.0f} GiB of runtime")
        host = None
    return Resources(
        host=host,
        ram=RamNeed(bytes=int(ram * 1.1), what="merge", why=why),
        disk=(DiskNeed(bytes=sizes.left_bytes + _HEADER_BYTES_PER_TENSOR * sizes.tensors + sizes.other_bytes,
                       overhead=1.02, what="the merged weights"),),
        artifact_bytes=sizes.output_bytes + sizes.other_bytes,
    )


@dataclass(kw_only=True)
class _Job(Job[MergeRequest]):
    base: _Base
    info: CheckpointInfo
    adapter: _Adapter
    method: str
    plans: dict[str, list[_Item]]
    inputs: dict[str, str]
    settings: dict[str, Any]
    identity: dict[str, Any]
    layout: _Layout | None = None  # kt-kernel formats: the experts' layers
    serve_python: Path | None = None
    top_k: int = 2
    merged: int = 0
    reused: int = 0
    events: dict[str, Any] = field(default_factory=lambda: {"layer": [], "verify": [], "processes": 0})
    finished: set[int] = field(default_factory=set)


def _check_request(request: MergeRequest, info: CheckpointInfo) -> None:
    method = request.method
    if method not in MERGE_METHODS:
        raise InvalidInputError(f"--method {method}", "is not an output format the merge writes.",
                                f"use one of {', '.join(MERGE_METHODS)}")
    if info.format not in INT4_FORMATS and info.format != "bf16":
        raise InvalidInputError(str(request.base_dir), f"is a {info.format} checkpoint; merge reads BF16 or Kimi INT4 "
                                "weights.", f"dequantize it first (`ktflow dequantize {request.base_dir} BF16_DIR`) "
                                "and merge into BF16_DIR")
    if method == "RAWINT4" and info.format not in INT4_FORMATS:
        raise InvalidInputError(f"--method {method}", f"re-quantizes to the source's Kimi INT4 scheme, but "
                                f"{request.base_dir} is {info.format}.", "use --method BF16, AMXINT8 or AMXINT4")
    if info.num_routed_experts < 2 and method in KT_METHODS:
        raise CheckpointError(str(request.base_dir / CONFIG_NAME),
                              f"n_routed_experts is {info.num_routed_experts}; {method} is for MoE experts.",
                              "use --method BF16")
    if method == "AMXINT8":
        check_int8_alignment(info.hidden_size, info.moe_intermediate_size, request.threadpool_count)
    elif method == "AMXINT4":
        _check_int4_alignment(info.hidden_size, info.moe_intermediate_size, request.threadpool_count)
    out, base = request.out_dir.absolute(), request.base_dir.absolute()
    if out == base or base in out.parents or out in base.parents:
        raise InvalidInputError(str(request.out_dir), "the output directory is the base, inside it or around it.",
                                "choose another output directory")


def _check_int4_alignment(hidden: int, moe_intermediate: int, t: int) -> None:
    """kt-kernel's AMXINT4 needs ``k % 128`` for every matrix: hidden (gate/up) and ``I / T`` (down)."""
    valid = [n for n in range(1, 17) if moe_intermediate % n == 0 and (moe_intermediate // n) % INT4_ALIGN == 0]
    use = f"use --threadpool-count {' or '.join(map(str, valid))}" if valid else "use --method AMXINT8 or BF16"
    if type(t) is not int or t < 1:
        raise InvalidInputError(f"--threadpool-count {t}", "must be a positive integer.", use)
    if hidden % INT4_ALIGN:
        raise InvalidInputError(f"hidden_size {hidden}", f"is not a multiple of {INT4_ALIGN}, which kt-kernel's "
                                "AMXINT4 needs.", "use --method AMXINT8 or BF16")
    if moe_intermediate % t or (moe_intermediate // t) % INT4_ALIGN:
        raise InvalidInputError(f"--threadpool-count {t}",
                                f"splits moe_intermediate_size {moe_intermediate} into NUMA slices of "
                                f"{moe_intermediate / t:g}, not a multiple of {INT4_ALIGN}: kt-kernel's AMXINT4 fails "
                                "with 'n or k is not aligned'.", use + " (and serve with the same --kt-threadpool-count)")


def _prepare(request: MergeRequest) -> _Job:
    base_dir, adapter_dir = request.base_dir.absolute(), request.adapter_dir.absolute()
    info = inspect_checkpoint(base_dir)
    _check_request(request, info)
    adapter = _Adapter(adapter_dir, base_dir, info.tensor_prefix)
    base = _Base(base_dir)
    method = request.method
    identity = checkpoint_identity(base_dir)
    settings: dict[str, Any] = {"method": method}
    serve_python, layout, top_k = None, None, 2
    if method in KT_METHODS:
        if request.serve_python is None:
            raise InvalidInputError("serve_python", f"is needed for {method}: kt-kernel quantizes the experts in the "
                                    "serving toolchain.", "pass the serving toolchain's python (`make serve-env`)")
        serve_python = Path(request.serve_python).absolute()
        versions = _serving_toolchain(serve_python)
        settings.update(threadpool_count=request.threadpool_count, kt_kernel=versions["kt-kernel"])
        layout = _Layout(base_dir, info.num_layers, info.num_routed_experts, info.hidden_size,
                         info.moe_intermediate_size, info.format)
        _expert_loras(base, adapter, layout, info.tensor_prefix)
        config = json.loads((base_dir / CONFIG_NAME).read_text(encoding="utf-8"))
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        top_k = max(1, min(int(text.get("num_experts_per_tok", 2)), info.num_routed_experts))
    inputs = {"base": identity_digest(identity), "adapter": identity_digest(adapter.identity)}
    return _Job(request=request, target=request.out_dir.absolute(), base=base, info=info, adapter=adapter,
                method=method, plans=_plan(base, info, adapter, method), inputs=inputs, settings=settings,
                identity=identity, layout=layout, serve_python=serve_python, top_k=top_k,
                journal={"inputs": inputs, "settings": settings}, fsync=request.fsync)


def _serve_flags(job: _Job) -> dict[str, Any]:
    out = job.target
    if job.method in KT_METHODS:
        return {"--model-path": str(out), "--kt-method": job.method, "--kt-weight-path": str(out / KT_DIR),
                "--kt-threadpool-count": job.request.threadpool_count}
    return {"--model-path": str(out), "--kt-method": job.method, "--kt-weight-path": str(out)}


def _lookup(job: _Job) -> MergeResult | None:
    existing = find_published(job.target, STAGE, inputs=job.inputs, settings=job.settings)
    if existing is None:
        return None
    return MergeResult(path=job.target, method=job.method, cached=True, shards=len(job.plans),
                       shards_reused=len(job.plans), tensors_merged=existing.extra.get("tensors_merged", 0),
                       kt_layers=len(existing.extra.get("kt_layers", [])), seconds=job.seconds(),
                       serve_flags=_serve_flags(job), verification=existing.extra.get("verification", {}),
                       manifest_digest=existing.digest())


def _kt_sizes(job: _Job) -> tuple[int, int, int]:
    """(whole kt/ output bytes, one layer's BF16 experts, one layer quantized) for the kt-kernel formats."""
    if job.layout is None:
        return 0, 0, 0
    info, t = job.info, job.request.threadpool_count
    bf16, quant = kt_layer_sizes(info.num_routed_experts, info.hidden_size, info.moe_intermediate_size, t, job.method)
    non_expert = sum(item.nbytes for items in job.plans.values() for item in items)
    return len(job.layout.layers) * quant + non_expert, bf16, quant


def _measure(job: _Job, resumed: Path | None) -> MergeSizes:
    total = sum(item.nbytes for items in job.plans.values() for item in items)
    left = sum(item.nbytes for shard, items in job.plans.items()
               if resumed is None or not _complete(resumed / shard, items) for item in items)
    kt_total, layer_bf16, layer_quant = _kt_sizes(job)
    if resumed is not None and kt_total:
        kt_total_left = kt_total - sum(p.stat().st_size for p in (resumed / KT_DIR).glob("model-*.safetensors"))
    else:
        kt_total_left = kt_total
    other = sum(p.stat().st_size for p in job.base.path.iterdir() if p.is_file() and p.suffix != ".safetensors")
    return MergeSizes(method=job.method, output_bytes=total + kt_total, left_bytes=left + kt_total_left,
                      tensors=sum(len(item.outputs) for items in job.plans.values() for item in items),
                      other_bytes=other,
                      largest_tensor_bytes=max((item.nbytes for items in job.plans.values() for item in items),
                                               default=0),
                      in_flight_bytes=sum(sorted((item.worker_bytes for items in job.plans.values() for item in items),
                                                 reverse=True)[:_workers(job.request)]),
                      layer_bf16_bytes=layer_bf16, layer_quant_bytes=layer_quant)


def _complete(path: Path, items: list[_Item]) -> bool:
    return holds_planned_tensors(path, [output for item in items for output in item.outputs])


def _make(job: _Job, item: _Item) -> list[torch.Tensor]:
    """An item's output tensors, in its ``outputs`` order."""
    if item.kind == "copy":
        return [read_base_tensor(job.base, name) for name, _, _ in item.outputs]
    if item.kind == "merge":
        weight = read_base_tensor(job.base, item.source).contiguous()
        return [_merge(job, weight, item)]
    module = item.source.removesuffix("_packed")
    packed = read_base_tensor(job.base, item.source)
    scale = read_base_tensor(job.base, module + "_scale")
    if not bool(torch.isfinite(scale).all()):
        raise CheckpointError(f"{job.base.path / job.base.weight_map[module + '_scale']}: tensor '{module}_scale'",
                              "has NaN or infinite scales: the shard is corrupt.", "re-download it")
    rows, cols = packed.shape[0], packed.shape[1] * 8
    weight = decode_int4_pack_quantized(packed, scale, (rows, cols))
    if item.lora is not None:
        weight = _merge(job, weight, item)
    if item.kind == "decode":
        return [weight]
    new_packed, new_scale, shape = encode_int4_pack_quantized(weight)
    shape_dtype = item.outputs[2][1]
    return [new_packed, new_scale, shape.to(torch.int64 if shape_dtype == "I64" else torch.int32)]


def _merge(job: _Job, weight: torch.Tensor, item: _Item) -> torch.Tensor:
    assert item.lora is not None
    a, b = read_tensor(job.adapter.header, item.lora[0]), read_tensor(job.adapter.header, item.lora[1])
    merge_lora_(weight, a, b, job.adapter.scale)
    if not bool(torch.isfinite(weight).all()):
        raise KtflowError(f"{STAGE}: merging '{item.lora[0]}' into '{item.source}' gave NaN or infinite weights; "
                          "nothing was published (check the adapter's values)")
    return weight


def _write_shard(job: _Job, staging: Path, shard: str, items: list[_Item], workers: int) -> None:
    final = staging / shard
    tmp = final.with_name(final.name + _TMP_SUFFIX)
    plan = [(n, d, tuple(s)) for item in items for n, d, s in item.outputs]

    def work(item: _Item) -> None:
        for (name, _, _), tensor in zip(item.outputs, _make(job, item)):
            writer.write(name, tensor.contiguous())

    try:
        with SafetensorsWriter(tmp, plan, metadata={"format": "pt"}) as writer:
            if workers <= 1:
                for item in items:
                    work(item)
            else:  # torch releases the GIL in its kernels; each worker holds one item
                with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="merge") as pool:
                    for future in [pool.submit(work, item) for item in items]:
                        future.result()
            writer.close(fsync=job.fsync)
        _check_unchanged(job)
        tmp.replace(final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _check_unchanged(job: _Job) -> None:
    if checkpoint_identity(job.base.path) != job.identity:
        raise KtflowError(f"{job.base.path} changed while it was being merged; rerun the stage once it is stable")


def _work(job: _Job, staging: Path) -> None:
    workers = _workers(job.request)
    shards = list(job.plans.items())
    kt_layers = len(job.layout.layers) if job.layout is not None else 0
    total = len(shards) + kt_layers
    done = 0
    with single_thread_torch():
        for shard, items in shards:
            staging.joinpath(shard + _TMP_SUFFIX).unlink(missing_ok=True)  # a kill's partial shard
            if _complete(staging / shard, items):
                job.reused += 1
            else:
                _write_shard(job, staging, shard, items, workers)
            done += 1
            job.report(done, total)
    job.merged = sum(1 for items in job.plans.values() for item in items if item.lora is not None)
    _write_checkpoint_files(job, staging)
    if job.layout is not None:
        _work_kt(job, staging, done, total)


def _write_checkpoint_files(job: _Job, staging: Path) -> None:
    """Index, config and every other file of the base (tokenizer, remote code, chat template, ...)."""
    src = job.base.path
    weight_map = {name: shard for shard, items in job.plans.items() for item in items for name, _, _ in item.outputs}
    total = sum(item.nbytes for items in job.plans.values() for item in items)
    atomic_write_json(staging / INDEX_NAME, {"metadata": {"total_size": total},
                                             "weight_map": dict(sorted(weight_map.items()))}, fsync=job.fsync)
    config = json.loads((src / CONFIG_NAME).read_text(encoding="utf-8"))
    if job.method != "RAWINT4":  # every other output is BF16 (or has no experts here)
        config = _strip_quantization_config(config)
    atomic_write_json(staging / CONFIG_NAME, config, fsync=job.fsync)
    copy_other_files(src, staging, skip=set(job.base.weight_map.values()) | {INDEX_NAME, CONFIG_NAME,
                                                                           store.MANIFEST_NAME})


def _strip_quantization_config(config: Any) -> Any:
    if isinstance(config, dict):
        return {k: _strip_quantization_config(v) for k, v in config.items() if k != "quantization_config"}
    if isinstance(config, list):
        return [_strip_quantization_config(v) for v in config]
    return config


def _work_kt(job: _Job, staging: Path, done: int, total: int) -> None:
    """kt-kernel quantizes each layer's merged experts into ``kt/`` (quantize-int8's driver and layout);
    its non-expert shard is made from the merged non-expert checkpoint just written."""
    assert job.layout is not None and job.serve_python is not None and job.host is not None
    kt = staging / KT_DIR
    kt.mkdir(exist_ok=True)
    plan = _driver_plan(job, staging)
    plan_path = kt / driver.PLAN_NAME
    verify = plan["verify"]["layers"]

    def on_layer(event: dict[str, Any]) -> None:
        if event["layer"] not in job.finished:
            job.finished.add(event["layer"])
            job.report(done + len(job.finished), total)

    while True:  # one driver process per budget of kt-kernel wrappers (kt-kernel never frees one)
        verified = {v["layer"] for v in job.events["verify"]}
        plan["verify"]["layers"] = [layer for layer in verify if layer not in verified]
        atomic_write_json(plan_path, plan, fsync=False)
        before = (len(job.finished), len(job.events["verify"]))
        if not _run_driver(job.serve_python, plan_path, kt / _LOG, job.events, on_layer):
            break
        if before == (len(job.finished), len(job.events["verify"])) and job.events["layer"]:
            raise KtflowError(f"{STAGE}: the kt-kernel driver restarted without progress (see {kt / _LOG})")
    plan_path.unlink(missing_ok=True)
    (kt / _LOG).unlink(missing_ok=True)
    _write_kt_index(job, kt)
    for name in COPIED_FILES:  # what quantize-int8 copies, from the merged checkpoint it would have read
        if (staging / name).is_file():
            shutil.copy2(staging / name, kt / name)


def _driver_plan(job: _Job, staging: Path) -> dict[str, Any]:
    assert job.layout is not None and job.host is not None
    request, info, layout = job.request, job.info, job.layout
    t = request.threadpool_count
    _, layer_bf16, layer_quant = _kt_sizes(job)
    scratch_root, _, on_tmpfs = _scratch(request, layer_quant)
    per_process = request.layers_per_process
    if per_process is None:
        per_process = kt_layers_per_process(job.host.ram_available_bytes, layer_bf16, layer_quant,
                                            scratch_in_ram=on_tmpfs)
    non_expert = [[_kt_name(name), shard, name] for shard, items in job.plans.items()
                  for item in items for name, _, _ in item.outputs]
    return {
        "method": job.method, "source": str(job.base.path), "experts": info.num_routed_experts, "top_k": job.top_k,
        "hidden": info.hidden_size, "moe_intermediate": info.moe_intermediate_size, "threadpool_count": t,
        "threads": max(request.workers or job.host.physical_cores, t), "scratch_dir": str(scratch_root),
        "fsync": request.fsync, "max_rel_err": _max_rel_err(request), "wrappers_per_process": per_process,
        "layers": layout.layers, "lora": {"source": str(job.adapter.path), "scale": job.adapter.scale},
        "non_expert": {"shard": layout.non_expert_shard, "tensors": non_expert, "source": str(staging)},
        "verify": {"layers": _sample_layers(layout.moe_layers, request.verify_layers), "tokens": VERIFY_TOKENS,
                   "seed": VERIFY_SEED},
    }


def _kt_name(name: str) -> str:
    """quantize-int8's renaming of a non-expert tensor (convert_cpu_weights.py's)."""
    key = name.replace(NESTED_PREFIX, "") if "language_model" in name else name
    if key.startswith("model."):
        key = key.replace("model.layers.", "blk.").replace("model.", "")
    return key


def _max_rel_err(request: MergeRequest) -> float:
    return request.max_rel_err if request.max_rel_err is not None else DEFAULT_MAX_REL_ERR.get(request.method, 0.05)


def _write_kt_index(job: _Job, kt: Path) -> None:
    """The index byte for byte as quantize-int8 (and convert_cpu_weights.py) writes it."""
    assert job.layout is not None
    weight_map: dict[str, str] = {}
    for entry in job.layout.layers:
        for name in driver.layer_index_names(entry["layer"], job.info.num_routed_experts, job.request.threadpool_count):
            weight_map[name] = entry["shard"]
    for items in job.plans.values():
        for item in items:
            for name, _, _ in item.outputs:
                weight_map[_kt_name(name)] = job.layout.non_expert_shard
    atomic_write_bytes(kt / INDEX_NAME, json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map},
                                                   indent=2).encode(), fsync=job.fsync)


def _verify(job: _Job, staging: Path) -> None:
    _check_unchanged(job)
    if _adapter_identity(job.adapter.path) != job.adapter.identity:
        raise KtflowError(f"{job.adapter.path} changed while it was being merged; nothing was published. Rerun the "
                          "stage once the adapter is stable.")
    if job.layout is not None:
        events = job.events
        if events.get("start") is None or job.finished != set(job.layout.moe_layers) or events.get("done") is None:
            raise KtflowError(f"{STAGE}: the kt-kernel driver ended without finishing (see {staging / KT_DIR / _LOG})")


def _verification(job: _Job) -> dict[str, dict[str, Any]]:
    return {str(v["layer"]): {k: v[k] for k in v if k not in ("event", "seconds")} for v in job.events["verify"]}


def _manifest(job: _Job) -> StageManifest:
    tools = {"torch": torch.__version__}
    extra: dict[str, Any] = {"base_path": str(job.base.path), "adapter_path": str(job.adapter.path),
                             "lora_rank": job.adapter.rank, "lora_alpha": job.adapter.alpha,
                             "tensors_merged": job.merged}
    if job.layout is not None:
        start = job.events.get("start") or {}
        tools.update({"kt-kernel": str(start.get("kt_kernel")), "kt_torch": str(start.get("torch")),
                      "cpu_variant": str(start.get("cpu_variant"))})
        extra.update(kt_layers=job.layout.moe_layers, verification=_verification(job),
                     max_rel_err=_max_rel_err(job.request))
    return StageManifest(stage=STAGE, inputs=job.inputs, settings=job.settings, tools=tools, extra=extra)


def _result(job: _Job, manifest: StageManifest) -> MergeResult:
    return MergeResult(path=job.target, method=job.method, cached=False, shards=len(job.plans),
                       shards_reused=job.reused, tensors_merged=job.merged,
                       kt_layers=len(job.layout.layers) if job.layout is not None else 0, seconds=job.seconds(),
                       serve_flags=_serve_flags(job), verification=_verification(job) if job.layout else {},
                       manifest_digest=manifest.digest())


MERGE: StageSpec[MergeRequest, _Job, MergeSizes, MergeResult] = StageSpec(
    name=STAGE,
    prepare=_prepare, lookup=_lookup, measure=_measure, needs=merge_needs,
    work=_work, verify=_verify, manifest=_manifest, result=_result,
    # Complete shards (and kt-kernel layers) of an interrupted attempt with the same inputs are kept.
    resume=True, journal=_JOURNAL,
    host_fix="merge to AMXINT8/AMXINT4 on an AVX512 or AMX host (the serving host), or merge to BF16 or RAWINT4; "
             "`ktflow doctor` says what this host can run",
)
"""The merge stage, declared for :func:`~ktflow.runner.run_stage` (and a planner)."""


def merge_target(layout: StoreLayout, base_dir: Path, adapter_dir: Path, method: str, threadpool_count: int = 1) -> Path:
    """Where the merge of ``adapter_dir`` into ``base_dir`` as ``method`` is published in a store (its cache key, from
    the same identities the stage checks: the base's and the adapter's; headers and manifests only)."""
    base = identity_digest(checkpoint_identity(Path(base_dir).absolute()))
    adapter = identity_digest(_adapter_identity(Path(adapter_dir).absolute()))
    return layout.merged(merged_dir_name(base, adapter, method, threadpool_count))


def served_paths(merged_dir: Path, method: str) -> tuple[Path, Path]:
    """``(--model-path, --kt-weight-path)`` of a merge published in ``merged_dir`` as ``method``."""
    merged_dir = Path(merged_dir)
    return merged_dir, merged_dir / KT_DIR if method in KT_METHODS else merged_dir


def merged_dir_name(base_digest: str, adapter_digest: str, method: str, threadpool_count: int | None = None) -> str:
    """The store folder of a merge (``store.layout.merged(...)``): its cache key, readable."""
    tail = f"-tp{threadpool_count}" if method in KT_METHODS and threadpool_count else ""
    return f"{base_digest[:16]}-{adapter_digest[:16]}-{method.lower()}{tail}"


EVICTING_SUFFIX = ".evicting"  # a merge being removed: renamed first, so no reader ever finds half of one


def mark_merge_served(merged: Path) -> None:
    """Record that ``merged`` is served now (its manifest's time), so the store gives it up last
    (:func:`evict_merges` removes the least recently served first)."""
    try:
        os.utime(Path(merged) / store.MANIFEST_NAME)
    except OSError:  # a read-only store: it is only an order
        pass


def stored_merges(layout: StoreLayout) -> list[Path]:
    """The merges published in a store, least recently served (or published) first."""
    root = layout.merged("")
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir()
             if path.is_dir() and not path.name.startswith(".") and (path / store.MANIFEST_NAME).is_file()]
    return sorted(found, key=lambda path: (path / store.MANIFEST_NAME).stat().st_mtime)


def evict_merges(layout: StoreLayout, need: int, *, keep: Iterable[Path],
                 log: Callable[[str], None] | None = None) -> list[Path]:
    """Remove a store's merges, least recently served first, until ``need`` bytes are free on their filesystem.

    A merge is as large as its model (~595 GB for Kimi-K2.5), so a store keeps every merge while the disk allows and
    gives up the least recently served when a new one does not fit; serving one again merges it again. Never
    removed: a merge in ``keep`` (what a running server reads, the merge about to be made) or one another process
    holds the lock of; and none at all when removing every other one would still leave less than ``need`` free.
    Each is renamed out of the way before it is deleted, so a crash leaves no half of a merge where the serve stage
    would look (a leftover is deleted by the next call).

    Returns:
        The merges removed (their former paths); empty when none could go.
    """
    root = layout.merged("")
    if not root.is_dir():
        return []
    for leftover in root.glob(f".*{EVICTING_SUFFIX}"):
        shutil.rmtree(leftover, ignore_errors=True)
    kept = {Path(path).resolve() for path in keep}
    candidates = [(merge, store.tree_bytes(merge)) for merge in stored_merges(layout) if merge.resolve() not in kept]
    reachable = store.free_bytes(root) + sum(size for _, size in candidates)
    if reachable < need:
        if log and candidates:
            log(f"kept the store's {len(candidates)} merge(s) no server reads: removing them all would leave "
                f"{reachable / GiB:.1f} GiB free, and {need / GiB:.1f} GiB is needed")
        return []
    removed: list[Path] = []
    for merge, size in candidates:
        if store.free_bytes(root) >= need:
            break
        doomed = merge.with_name(f".{merge.name}{EVICTING_SUFFIX}")
        try:
            with store.artifact_lock(merge, wait=False):
                merge.rename(doomed)
        except ArtifactBusyError:  # being written or removed by another process
            continue
        except OSError:  # a store it cannot change (read-only, permissions)
            continue
        shutil.rmtree(doomed, ignore_errors=True)  # what a failure leaves is cleared by the next call
        removed.append(merge)
        if log:
            log(f"removed the merge {merge} ({size / GiB:.1f} GiB, no server reads it) to make room; serving it again "
                f"merges it again")
    return removed


def merge_adapter(
    base_dir: Path,
    adapter_dir: Path,
    out_dir: Path,
    *,
    method: str,
    threadpool_count: int = 1,
    serve_python: Path | None = None,
    workers: int | None = None,
    verify_layers: int = 2,
    max_rel_err: float | None = None,
    progress: Progress | None = None,
    fsync: bool = True,
    scratch_dir: Path | None = None,
    layers_per_process: int | None = None,
) -> MergeResult:
    """Merge a converted adapter into its base and write the result as ``method`` serves it.

    Args:
        base_dir: the base checkpoint the adapter was trained on: BF16 (a release, or the dequantize
            stage's output) or Kimi-K2/K2.5 INT4 as released.
        adapter_dir: the convert-lora stage's output (PEFT keys, per-expert LoRA).
        out_dir: the output (the module's docstring says what it holds); it appears only when complete.
        method: ``BF16``, ``RAWINT4`` (Kimi INT4 bases), ``AMXINT8`` or ``AMXINT4``.
        threadpool_count: kt-kernel formats: T, its NUMA thread pools (serve with the same
            ``--kt-threadpool-count``).
        serve_python: kt-kernel formats: the serving toolchain's python (kt-kernel 0.7.2).
        workers: tensors merged at once (default: physical cores); kt-kernel formats: its CPU threads (default:
            physical cores).
        verify_layers, max_rel_err: kt-kernel formats: MoE layers checked through kt-kernel's own
            forward against a float64 MoE of the merged BF16 experts, and the bound (default 0.05 for
            AMXINT8, 0.25 for AMXINT4: one scale per row).
        progress: called with (shards + kt-kernel layers done, total).
        fsync: fsync every shard before it is renamed into place.
        scratch_dir, layers_per_process: kt-kernel formats, as :func:`~ktflow.stages.quantize_int8.quantize_int8`.

    Raises:
        InvalidInputError: an unknown method, a base in another format (FP8: dequantize first), RAWINT4 for a
            base that is not Kimi INT4, a threadpool count kt-kernel cannot split the experts by.
        AdapterError: an adapter trained on another base (a module or shape the base lacks), an unreadable or
            unsupported r / lora_alpha / use_rslora / rank_pattern / alpha_pattern, KT's raw training output.
        HostRequirementError: AMXINT8/AMXINT4 on a CPU without kt-kernel's INT8/INT4 kernels, no serving
            toolchain, too little RAM or disk (all before any work).
        StorageError: the disk filled up mid-run; complete shards stay in staging for the rerun.
        KtflowError: the base or adapter changed during the run, a merge gave NaN/inf, kt-kernel failed or its
            forward exceeded ``max_rel_err`` (nothing published).
    """
    request = MergeRequest(base_dir=Path(base_dir), adapter_dir=Path(adapter_dir), out_dir=Path(out_dir),
                           method=method, threadpool_count=threadpool_count,
                           serve_python=Path(serve_python) if serve_python is not None else None, workers=workers,
                           verify_layers=verify_layers, max_rel_err=max_rel_err, fsync=fsync,
                           scratch_dir=scratch_dir, layers_per_process=layers_per_process)
    return run_stage(MERGE, request, progress=progress)

