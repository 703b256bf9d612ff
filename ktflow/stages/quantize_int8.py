"""quantize-int8: BF16 (or Kimi INT4) routed experts -> kt-kernel AMXINT8 CPU expert weights for sglang-kt.

The output is what sglang-kt reads with ``--kt-method AMXINT8 --kt-weight-path OUT
--kt-threadpool-count T``, laid out as kt-kernel's ``scripts/convert_cpu_weights.py`` (0.7.x, the
per-layer-shard version) writes it:

- one safetensors shard per MoE layer, ``model-{k:05d}-of-{n:05d}.safetensors`` (k = 1.. over the
  MoE layers in order), holding ``blk.{L}.ffn_{gate,up,down}_exps.{E}.numa.{N}.weight`` (I8, 1-D,
  kt-kernel's packed bytes) and ``.scale`` (F32, 1-D, one per output row) for every expert E and
  NUMA slice N < T;
- the last shard holds every non-expert tensor, names with ``language_model.`` dropped and
  ``model.layers.`` -> ``blk.``, then ``model.`` removed (``model.norm.weight`` -> ``norm.weight``),
  dtypes unchanged (the fp32 ``e_score_correction_bias`` stays fp32);
- ``model.safetensors.index.json`` with ``metadata.total_size`` 0 (as the reference writes it);
- ``config.json``, ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``
  copied when present (the reference's list), plus ktflow's ``manifest.json``.

The source is a BF16 checkpoint (the dequantize stage's output, or a BF16 release) or a Kimi-K2/K2.5
INT4 checkpoint as released: its packed experts are decoded layer by layer in memory by the same
bit-exact rule the dequantize stage uses, so the INT8 is the same either way and a Kimi model served
as AMXINT8 needs no BF16 copy on disk (2 TB for Kimi-K2.5).

The heavy work runs in the serving toolchain (kt-kernel pins torch 2.9.1) through the driver
:mod:`ktflow._drivers.kt_int8`, which calls kt-kernel's own ``KTMoEWrapper(method="AMXINT8",
cpu_save=True, threadpool_count=T)`` + ``load_weights_from_tensors`` per layer. ktflow adds:

- refusal before any work (format, alignment for T, CPU ISA, toolchain, RAM, scratch, disk);
- crash safety: each layer's shard is written under a temporary name and renamed when complete,
  so a kill costs at most the layer in progress, and a rerun reuses the complete layers (after a
  header check) and redoes the partial one; the index, non-expert shard, copied files and the
  manifest come last, then the staging directory is renamed to ``out_dir``;
- verification through kt-kernel's own inference path: for ``verify_layers`` MoE layers spread
  over the model, the written shards are loaded back through kt-kernel's AMXINT8 inference path (a
  wrapper without ``cpu_save``, reading the layout as sglang-kt does) and its MoE forward on 16
  random tokens (fixed seed, random top-k routing and weights) is compared with a float64 torch
  MoE of the BF16 weights (``down(silu(gate x) * up x)``, weighted over the selected experts).
  ``mean|out - ref| / mean|ref|`` per layer goes into the manifest; above ``max_rel_err`` the stage
  fails and nothing is published. Per-channel INT8 of weights (plus kt-kernel's per-token INT8
  activations) gives ~1-3%; kt-kernel's own MoE test accepts < 0.05, the default bound;
- bounded memory: BF16 experts are read straight into kt-kernel's input buffers and the quantized
  slices streamed from scratch into the shard (the reference stacks a second copy of each layer,
  keeps every input shard mmapped and builds each output shard in memory); and since kt-kernel
  0.7.2 never frees a wrapper's weight buffers (each layer's INT8 stays in the process until it
  exits: what makes 671B conversions run out of RAM), the driver is restarted after
  ``layers_per_process`` layers, sized from the available RAM.

The output depends on T: serve with the same ``--kt-threadpool-count``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel

from ktflow._drivers import kt_int8 as driver
from ktflow.errors import CheckpointError, HostRequirementError, InvalidInputError, KtflowError, ToolError
from ktflow.formats.checkpoint import (
    CONFIG_NAME,
    INDEX_NAME,
    CheckpointInfo,
    checkpoint_identity,
    identity_digest,
    inspect_checkpoint,
    read_weight_map,
)
from ktflow.formats.kt_layout import PROJS, kt_layer_sizes
from ktflow.formats.safetensors_io import SafetensorsHeader, read_header
from ktflow.host.process import ktflow_pythonpath, run_tool, tool_versions
from ktflow.planning.merge_cost import PROCESS_RUNTIME_BYTES, kt_layers_per_process, kt_quantizer_process_ram
from ktflow.recipe.model import INT4_FORMATS
from ktflow.resources import INT8_KERNELS, QUANTIZE_INT8_STAGE, DiskNeed, RamNeed, Resources
from ktflow.runner import Job, Progress, StageSpec, find_published, run_stage
from ktflow.store import StageManifest, atomic_write_bytes, atomic_write_json, existing_ancestor
from ktflow.units import GiB

STAGE = QUANTIZE_INT8_STAGE
KT_METHOD = driver.KT_METHOD
COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
INT8_ALIGN = 64  # k % 64 and n % 32 of every INT8 matrix: hidden and each NUMA slice of I
VERIFY_TOKENS = 16
VERIFY_SEED = 0
_JOURNAL = ".ktflow-int8.json"  # the source identity and settings a staging dir was started from
_LOG = ".ktflow-int8.log"
_HEADER_BYTES_PER_TENSOR = 128  # safetensors header estimate, for the disk check
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\."
                     r"(weight|weight_packed|weight_scale|weight_shape)$")


class QuantizeInt8Result(BaseModel):
    """What the quantize-int8 stage produced."""

    path: Path
    cached: bool  # an identical artifact (same source, T, kt-kernel) was already published
    layers: int  # MoE layers in the output
    layers_reused: int  # complete layers found from an earlier, interrupted attempt (all of them when cached)
    threadpool_count: int
    seconds: float
    verification: dict[str, Any]  # str(layer) -> mean_rel_err, max_abs_err, cosine, tokens, seconds, ...
    manifest_digest: str


# --------------------------------------------------------------------------- checks


def _valid_threadpool_counts(moe_intermediate: int, limit: int = 16) -> list[int]:
    return [t for t in range(1, limit + 1) if moe_intermediate % t == 0 and (moe_intermediate // t) % INT8_ALIGN == 0]


def check_int8_alignment(hidden: int, moe_intermediate: int, threadpool_count: int) -> None:
    """Refuse a (model, T) pair kt-kernel's INT8 kernels cannot run.

    kt-kernel splits the experts' intermediate dim into ``threadpool_count`` NUMA slices; each
    INT8 matrix needs ``n % 32 == 0`` (output rows) and ``k % 64 == 0`` (inputs): gate/up are
    ``[I/T, H]``, down ``[H, I/T]``. So ``hidden`` and ``moe_intermediate / T`` must be multiples
    of 64 (else kt-kernel fails with "n or k is not aligned", kvcache-ai/ktransformers#1777).

    Raises:
        InvalidInputError: naming ``--threadpool-count`` and the values, with the counts that work.
    """
    valid = _valid_threadpool_counts(moe_intermediate)
    use = (f"use --threadpool-count {' or '.join(map(str, valid))}" if valid
           else "this model cannot be quantized to AMXINT8; serve its experts with --kt-method BF16 instead")
    if type(threadpool_count) is not int or threadpool_count < 1:
        raise InvalidInputError(f"--threadpool-count {threadpool_count}",
                                "must be a positive integer (one kt-kernel thread pool per NUMA node).", use + ".")
    if hidden <= 0 or hidden % INT8_ALIGN:
        raise InvalidInputError(
            f"hidden_size {hidden}",
            f"is not a multiple of {INT8_ALIGN}: kt-kernel INT8 needs k % 64 for gate/up (k = hidden_size) and "
            "n % 32 for down; no --threadpool-count can fix that.",
            "serve this model's experts with --kt-method BF16 (or FP8) instead of AMXINT8.",
        )
    if moe_intermediate % threadpool_count:
        raise InvalidInputError(
            f"--threadpool-count {threadpool_count}",
            f"does not split moe_intermediate_size {moe_intermediate} into equal NUMA slices "
            f"({moe_intermediate} % {threadpool_count} = {moe_intermediate % threadpool_count}).",
            use + ".",
        )
    per_slice = moe_intermediate // threadpool_count
    if per_slice % INT8_ALIGN:
        raise InvalidInputError(
            f"--threadpool-count {threadpool_count}",
            f"splits moe_intermediate_size {moe_intermediate} into NUMA slices of {per_slice}, not a multiple of "
            f"{INT8_ALIGN}: kt-kernel INT8 needs each slice aligned (n % 32 for gate/up rows, k % 64 for down "
            "columns), else it fails with 'n or k is not aligned'.",
            use + " (and serve with the same --kt-threadpool-count).",
        )


def _non_expert_name(name: str) -> str:
    """convert_cpu_weights.py's renaming: drop ``language_model.``; ``model.layers.`` -> ``blk.``;
    then every ``model.`` removed (``model.embed_tokens.weight`` -> ``embed_tokens.weight``)."""
    key = name.replace("language_model.", "") if "language_model" in name else name
    if key.startswith("model."):
        key = key.replace("model.layers.", "blk.").replace("model.", "")
    return key


class _Layout:
    """What to quantize and copy, from the index and the shard headers.

    Each expert projection is ``[file, name]`` (a BF16 weight) or, for a Kimi INT4 source,
    ``[file, weight_packed, scale_file, weight_scale]`` (the driver decodes it to BF16).
    """

    def __init__(self, src: Path, num_layers: int, experts: int, hidden: int, inter: int, fmt: str = "bf16") -> None:
        weight_map, _ = read_weight_map(src)
        self.headers: dict[str, SafetensorsHeader] = {f: read_header(src / f) for f in sorted(set(weight_map.values()))}
        int4 = fmt in INT4_FORMATS
        found: dict[int, dict[tuple[str, int], list[str]]] = {}
        parts: dict[tuple[int, str, int], dict[str, tuple[str, str, Any]]] = {}  # INT4: packed/scale/shape
        self.non_expert: list[tuple[str, str, str]] = []  # (output name, file, source name)
        self.non_expert_bytes = 0
        seen_out: dict[str, str] = {}
        for file, header in self.headers.items():
            for name, info in sorted(header.tensors.items()):
                key = name.replace("language_model.", "") if "language_model" in name else name
                if ".mlp.experts." in key:
                    m = _EXPERT.match(key)
                    if m is None or (m.group(4) == "weight") == int4:
                        raise CheckpointError(f"{src / file}: tensor '{name}'",
                                              "is a routed-expert tensor in a layout quantize-int8 does not handle "
                                              "(it expects DeepSeek-V3-style model.layers.L.mlp.experts.E."
                                              "{gate,up,down}_proj.weight in BF16, or Kimi's INT4 "
                                              "weight_packed / weight_scale / weight_shape).",
                                              "use a DeepSeek-V3-architecture BF16 or Kimi INT4 checkpoint")
                    layer, expert, proj = int(m.group(1)), int(m.group(2)), m.group(3)
                    if layer >= num_layers:
                        continue  # an MTP layer's experts: convert_cpu_weights.py leaves them out too
                    if expert >= experts:
                        raise CheckpointError(f"{src / file}: tensor '{name}'",
                                              f"names expert {expert}, but config.json has n_routed_experts {experts}.",
                                              "use the config that came with these shards")
                    rows, cols = (hidden, inter) if proj == "down" else (inter, hidden)
                    if int4:
                        parts.setdefault((layer, proj, expert), {})[m.group(4)] = (file, name, info)
                        continue
                    if info.dtype != "BF16" or tuple(info.shape) != (rows, cols):
                        raise CheckpointError(f"{src / file}: tensor '{name}'",
                                              f"is {info.dtype} {list(info.shape)}; expected BF16 [{rows}, {cols}] "
                                              "(hidden_size / moe_intermediate_size of config.json).",
                                              "quantize-int8 takes a BF16 or Kimi INT4 checkpoint; run the dequantize "
                                              "stage first for other formats")
                    found.setdefault(layer, {})[(proj, expert)] = [file, name]
                else:
                    out = _non_expert_name(name)
                    if out in seen_out:
                        raise CheckpointError(f"{src / file}: tensor '{name}'",
                                              f"and '{seen_out[out]}' both become '{out}' in the INT8 layout.")
                    seen_out[out] = name
                    self.non_expert.append((out, file, name))
                    self.non_expert_bytes += info.nbytes
        for (layer, proj, expert), got in parts.items():
            found.setdefault(layer, {})[(proj, expert)] = _int4_entry(src, got, proj, expert, hidden, inter)
        if not found:
            raise CheckpointError(str(src), "has no routed-expert tensors (model.layers.L.mlp.experts.E.*_proj.weight);"
                                            " there is nothing to quantize.", "point at a MoE checkpoint")
        self.layers: list[dict[str, Any]] = []
        self.moe_layers = sorted(found)
        total = len(self.moe_layers) + 1
        for k, layer in enumerate(self.moe_layers, start=1):
            tensors = found[layer]
            entry: dict[str, Any] = {"layer": layer, "shard": f"model-{k:05d}-of-{total:05d}.safetensors"}
            for proj in PROJS:
                missing = [e for e in range(experts) if (proj, e) not in tensors]
                if missing:
                    raise CheckpointError(str(src), f"layer {layer} lacks {proj}_proj of expert(s) {missing[:8]}.",
                                          "the checkpoint is incomplete; re-download or re-run the stage that wrote it")
                entry[proj] = [list(tensors[(proj, e)]) for e in range(experts)]
            self.layers.append(entry)
        self.non_expert_shard = f"model-{total:05d}-of-{total:05d}.safetensors"


def _int4_entry(src: Path, got: dict[str, tuple[str, str, Any]], proj: str, expert: int, hidden: int,
                inter: int) -> list[str]:
    """``[file, weight_packed, scale_file, weight_scale]`` of one INT4 expert weight, its headers checked
    against the decode rule (I32 [rows, cols/8] words, BF16 [rows, cols/32] scales, a weight_shape beside)."""
    from ktflow.formats.quant_decode import INT4_GROUP_SIZE

    rows, cols = (hidden, inter) if proj == "down" else (inter, hidden)
    missing = [k for k in ("weight_packed", "weight_scale", "weight_shape") if k not in got]
    if missing:
        file, name, _ = next(iter(got.values()))
        raise CheckpointError(f"{src / file}: tensor '{name}'", f"has no {' / '.join(missing)} beside it "
                              f"(expert {expert}, {proj}_proj).", "the checkpoint is incomplete; re-download it")
    expect = {"weight_packed": ("I32", (rows, cols // 8)),
              "weight_scale": ("BF16", (rows, (cols + INT4_GROUP_SIZE - 1) // INT4_GROUP_SIZE))}
    for kind, (dtype, shape) in expect.items():
        file, name, info = got[kind]
        if info.dtype != dtype or tuple(info.shape) != shape:
            raise CheckpointError(f"{src / file}: tensor '{name}'",
                                  f"is {info.dtype} {list(info.shape)}; expected {dtype} {list(shape)} for a "
                                  f"[{rows}, {cols}] weight (hidden_size / moe_intermediate_size of config.json).",
                                  "the checkpoint is corrupt or its config is not its own; re-download it")
    if cols % INT4_GROUP_SIZE:
        file, name, _ = got["weight_packed"]
        raise CheckpointError(f"{src / file}: tensor '{name}'", f"has {cols} columns, not whole groups of "
                              f"{INT4_GROUP_SIZE}: quantize-int8 decodes only whole INT4 groups.",
                              "dequantize this checkpoint to BF16 first (`ktflow dequantize`), then quantize that")
    return [got["weight_packed"][0], got["weight_packed"][1], got["weight_scale"][0], got["weight_scale"][1]]


def _sample_layers(layers: list[int], k: int) -> list[int]:
    """``k`` MoE layers spread evenly over the model (first and last included)."""
    if k <= 0:
        return []
    if k >= len(layers):
        return list(layers)
    if k == 1:
        return [layers[len(layers) // 2]]
    picks = sorted({round(i * (len(layers) - 1) / (k - 1)) for i in range(k)})
    return [layers[i] for i in picks]


# --------------------------------------------------------------------------- the stage


@dataclass(frozen=True)
class QuantizeInt8Request:
    """The quantize-int8 stage's arguments (see :func:`quantize_int8`)."""

    bf16_dir: Path
    out_dir: Path
    threadpool_count: int
    serve_python: Path
    workers: int | None = None
    verify_layers: int = 2
    max_rel_err: float = 0.05
    fsync: bool = True
    scratch_dir: Path | None = None
    layers_per_process: int | None = None


class QuantizeInt8Sizes(BaseModel):
    """What quantize-int8's RAM, scratch and disk needs are a function of (the model's MoE shape)."""

    experts: int  # routed experts per MoE layer
    hidden: int
    moe_intermediate: int
    layers: int  # MoE layers
    non_expert_bytes: int  # the tensors copied into the non-expert shard
    non_expert_tensors: int
    copied_bytes: int  # config and tokenizer files
    done_bytes: int = 0  # layer shards an interrupted attempt finished


def quantize_int8_needs(request: QuantizeInt8Request, sizes: QuantizeInt8Sizes) -> Resources:
    """kt-kernel's INT8 kernels; RAM and scratch for one layer at a time; disk for the output.

    The driver holds one layer's BF16 experts twice (its buffers, and kt-kernel's copy as it quantizes) and its
    INT8 (plus the same again when kt-kernel's scratch is a tmpfs, whose pages are RAM) beside the process's python,
    torch and kt-kernel (``kt_quantizer_process_ram``).
    """
    t = request.threadpool_count
    bf16_layer, int8_layer = kt_layer_sizes(sizes.experts, sizes.hidden, sizes.moe_intermediate, t, KT_METHOD)
    _, shm, on_tmpfs = _scratch(request, int8_layer)
    out_total = (sizes.layers * (int8_layer + _HEADER_BYTES_PER_TENSOR * 6 * sizes.experts * t)
                 + sizes.non_expert_bytes + _HEADER_BYTES_PER_TENSOR * sizes.non_expert_tensors + sizes.copied_bytes)
    ram_why = (f"2 x {bf16_layer / GiB:.2f} GiB BF16 experts + {int8_layer / GiB:.2f} GiB INT8"
               f"{' + the same in ' + str(shm) if on_tmpfs else ''} + ~{PROCESS_RUNTIME_BYTES / GiB:.0f} GiB for "
               "python, torch and kt-kernel")
    return Resources(
        host=INT8_KERNELS,
        ram=RamNeed(bytes=int(kt_quantizer_process_ram(bf16_layer, int8_layer, scratch_in_ram=on_tmpfs) * 1.1),
                    what="one MoE layer", why=ram_why),
        disk=(DiskNeed(bytes=int8_layer, overhead=1.05, at=shm, what="kt-kernel's scratch for one layer",
                       fix="pass scratch_dir= a roomier directory"),
              DiskNeed(bytes=out_total - sizes.done_bytes, overhead=1.02, what="the output")),
        artifact_bytes=out_total,
    )


class ScratchSettings(Protocol):
    """Where a stage that drives kt-kernel's quantizer writes (quantize-int8's request, the merge's)."""

    scratch_dir: Path | None
    out_dir: Path


def _scratch(request: ScratchSettings, layer_bytes: int = 0) -> tuple[Path, Path, bool]:
    """Where kt-kernel's per-layer scratch goes, its nearest existing directory, and whether it is RAM.

    By default ``/dev/shm`` where it holds one layer's INT8 (``layer_bytes``) with margin, else beside the
    output: a container's small ``/dev/shm`` (64 MB by default in Docker) must not refuse a big model.
    """
    root = Path(request.scratch_dir).absolute() if request.scratch_dir is not None else Path("/dev/shm")
    if request.scratch_dir is None and (not root.is_dir() or shutil.disk_usage(root).free < layer_bytes * 1.1):
        root = Path(request.out_dir).absolute().parent  # no roomy tmpfs: kt-kernel's scratch goes beside the output
    shm = existing_ancestor(root)
    return root, shm, shm == Path("/dev/shm") or Path("/dev/shm") in shm.parents  # tmpfs pages are RAM


@dataclass(kw_only=True)
class _Job(Job[QuantizeInt8Request]):
    bf16_dir: Path
    info: CheckpointInfo
    layout: _Layout
    top_k: int
    serve_python: Path
    identity: dict[str, Any]
    inputs: dict[str, str]
    settings: dict[str, Any]
    events: dict[str, Any] = field(default_factory=lambda: {"layer": [], "verify": [], "processes": 0})
    finished: set[int] = field(default_factory=set)  # MoE layers done (now or by an earlier attempt)
    quantized: set[int] = field(default_factory=set)  # MoE layers this run quantized


def _check_arguments(request: QuantizeInt8Request) -> None:
    if type(request.verify_layers) is not int or request.verify_layers < 0:
        raise InvalidInputError(f"verify_layers {request.verify_layers}", "must be a non-negative integer.")
    if not request.max_rel_err > 0:
        raise InvalidInputError(f"max_rel_err {request.max_rel_err}",
                                "must be a positive number (kt-kernel's test uses 0.05).")
    workers, per_process = request.workers, request.layers_per_process
    if workers is not None and (type(workers) is not int or workers < 1):
        raise InvalidInputError(f"--workers {workers}", "must be a positive integer.")
    if per_process is not None and (type(per_process) is not int or per_process < 1):
        raise InvalidInputError(f"layers_per_process {per_process}", "must be a positive integer.")


def _inspect_source(bf16_dir: Path, out_dir: Path, t: int) -> CheckpointInfo:
    """The BF16 checkpoint's description, refusing what kt-kernel's INT8 path cannot take."""
    info = inspect_checkpoint(bf16_dir)
    if info.format != "bf16" and info.format not in INT4_FORMATS:
        raise InvalidInputError(
            str(bf16_dir),
            f"is a {info.format} checkpoint; quantize-int8 takes BF16 experts, or Kimi INT4 experts it decodes "
            "itself (kt-kernel's FP8 input needs a CUDA GPU).",
            f"convert it to BF16 first with the dequantize stage (`ktflow dequantize {bf16_dir} BF16_DIR`), then "
            "quantize BF16_DIR; or run the whole pipeline with `ktflow run`, which chains them.",
        )
    if out_dir == bf16_dir or bf16_dir in out_dir.parents:
        raise InvalidInputError(str(out_dir), "the output directory is the source or inside it.", "choose another OUT_DIR")
    check_int8_alignment(info.hidden_size, info.moe_intermediate_size, t)
    return info


def _serving_toolchain(serve_python: Path) -> dict[str, str]:
    """The serving toolchain's package versions; it must have kt-kernel."""
    if not serve_python.is_file():
        raise HostRequirementError(f"serve_python: {serve_python}", "does not exist.",
                                   "run `make serve-env`, or pass the python of the environment that has kt-kernel 0.7.2")
    versions = tool_versions(serve_python, ("kt-kernel", "torch", "safetensors"))
    if "kt-kernel" not in versions:
        raise HostRequirementError(f"serve_python: {serve_python}", "has no kt-kernel installed.",
                                   "run `make serve-env` (kt-kernel 0.7.2, torch 2.9.1)")
    return versions


def _prepare(request: QuantizeInt8Request) -> _Job:
    bf16_dir, out_dir = Path(request.bf16_dir).absolute(), Path(request.out_dir).absolute()
    t = request.threadpool_count
    info = _inspect_source(bf16_dir, out_dir, t)
    _check_arguments(request)
    if info.num_routed_experts < 2:
        raise CheckpointError(str(bf16_dir / CONFIG_NAME), f"n_routed_experts is {info.num_routed_experts}; "
                                                          "quantize-int8 needs a MoE model.")
    config = json.loads((bf16_dir / CONFIG_NAME).read_text(encoding="utf-8"))
    text_cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    top_k = max(1, min(int(text_cfg.get("num_experts_per_tok", 2)), info.num_routed_experts))
    layout = _Layout(bf16_dir, info.num_layers, info.num_routed_experts, info.hidden_size, info.moe_intermediate_size,
                     info.format)
    serve_python = Path(request.serve_python).absolute()  # not resolved: a venv's python is a symlink to the base
    versions = _serving_toolchain(serve_python)
    identity = checkpoint_identity(bf16_dir)
    settings = {"method": KT_METHOD, "threadpool_count": t, "kt_kernel": versions["kt-kernel"]}
    return _Job(request=request, target=out_dir, bf16_dir=bf16_dir, info=info, layout=layout, top_k=top_k,
                serve_python=serve_python, identity=identity, inputs={"source": identity_digest(identity)},
                settings=settings, journal={"identity": identity, "settings": settings}, fsync=request.fsync)


def _lookup(job: _Job) -> QuantizeInt8Result | None:
    existing = find_published(job.target, STAGE, inputs=job.inputs, settings=job.settings)
    if existing is None:
        return None
    verification = existing.extra.get("verification", {})
    bound = job.request.max_rel_err
    worst = {k: v["mean_rel_err"] for k, v in verification.items() if not v["mean_rel_err"] <= bound}
    if worst:
        raise KtflowError(f"{job.target}: the published INT8 weights were verified at mean relative error "
                          f"{worst} (layer: error), above max_rel_err {bound}")
    layers = len(existing.extra.get("layers", []))
    return QuantizeInt8Result(path=job.target, cached=True, layers=layers, layers_reused=layers,
                              threadpool_count=job.request.threadpool_count, seconds=job.seconds(),
                              verification=verification, manifest_digest=existing.digest())


def _measure(job: _Job, resumed: Path | None) -> QuantizeInt8Sizes:
    info, layout = job.info, job.layout
    return QuantizeInt8Sizes(
        experts=info.num_routed_experts, hidden=info.hidden_size, moe_intermediate=info.moe_intermediate_size,
        layers=len(layout.layers), non_expert_bytes=layout.non_expert_bytes, non_expert_tensors=len(layout.non_expert),
        copied_bytes=sum((job.bf16_dir / n).stat().st_size for n in COPIED_FILES if (job.bf16_dir / n).is_file()),
        done_bytes=sum(p.stat().st_size for p in resumed.glob("model-*.safetensors")) if resumed else 0,
    )


def _driver_plan(job: _Job) -> dict[str, Any]:
    """What the driver in the serving toolchain does: every layer, the checks, the non-expert shard."""
    request, info, layout, host = job.request, job.info, job.layout, job.host
    assert host is not None  # the preflight probed it (the stage needs the INT8 kernels)
    t = request.threadpool_count
    bf16_layer, int8_layer = kt_layer_sizes(info.num_routed_experts, info.hidden_size, info.moe_intermediate_size, t,
                                            KT_METHOD)
    scratch_root, _, on_tmpfs = _scratch(request, int8_layer)
    layers_per_process = request.layers_per_process
    if layers_per_process is None:  # what leaks per wrapper must fit beside one layer's working set
        layers_per_process = kt_layers_per_process(host.ram_available_bytes, bf16_layer, int8_layer,
                                                   scratch_in_ram=on_tmpfs)
    return {
        "source": str(job.bf16_dir), "experts": info.num_routed_experts, "top_k": job.top_k,
        "hidden": info.hidden_size, "moe_intermediate": info.moe_intermediate_size, "threadpool_count": t,
        "threads": max(request.workers or host.physical_cores, t), "scratch_dir": str(scratch_root),
        "fsync": request.fsync, "max_rel_err": request.max_rel_err, "wrappers_per_process": layers_per_process,
        "layers": layout.layers, "non_expert": {"shard": layout.non_expert_shard,
                                                "tensors": [list(x) for x in layout.non_expert]},
        "verify": {"layers": _sample_layers(layout.moe_layers, request.verify_layers), "tokens": VERIFY_TOKENS,
                   "seed": VERIFY_SEED},
    }


def _work(job: _Job, staging: Path) -> None:
    plan, plan_path = _driver_plan(job), staging / driver.PLAN_NAME
    verify, events = plan["verify"]["layers"], job.events

    def on_layer(event: dict[str, Any]) -> None:
        if event["status"] == "done":
            job.quantized.add(event["layer"])
        if event["layer"] not in job.finished:
            job.finished.add(event["layer"])
            job.report(len(job.finished), len(job.layout.layers))

    while True:  # one driver process per budget of wrappers; each skips what the previous ones finished
        verified = {v["layer"] for v in events["verify"]}
        plan["verify"]["layers"] = [layer for layer in verify if layer not in verified]
        atomic_write_json(plan_path, plan, fsync=False)
        before = (len(job.quantized), len(events["verify"]))
        if not _run_driver(job.serve_python, plan_path, staging / _LOG, events, on_layer):
            break
        if before == (len(job.quantized), len(events["verify"])):
            raise KtflowError(f"{STAGE}: the kt-kernel driver restarted without progress (see {staging / _LOG})")
    _write_index(job, staging)
    for name in COPIED_FILES:
        if (job.bf16_dir / name).is_file():
            shutil.copy2(job.bf16_dir / name, staging / name)


def _write_index(job: _Job, staging: Path) -> None:
    """The index, byte for byte what convert_cpu_weights.py writes: json.dump(indent=2), no trailing newline."""
    weight_map: dict[str, str] = {}
    for entry in job.layout.layers:
        for name in driver.layer_index_names(entry["layer"], job.info.num_routed_experts, job.request.threadpool_count):
            weight_map[name] = entry["shard"]
    for out_name, _, _ in job.layout.non_expert:
        weight_map[out_name] = job.layout.non_expert_shard
    index = json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}, indent=2)
    atomic_write_bytes(staging / INDEX_NAME, index.encode(), fsync=job.fsync)


def _verify(job: _Job, staging: Path) -> None:
    """The driver finished every layer (its own check of each sampled layer passed), and the source held still."""
    events = job.events
    if events.get("start") is None or job.finished != set(job.layout.moe_layers) or events.get("done") is None:
        raise KtflowError(f"the kt-int8 driver ended without finishing (see {staging / _LOG})")
    if checkpoint_identity(job.bf16_dir) != job.identity:  # layers from two versions of the source: never publish a mix
        raise KtflowError(f"{job.bf16_dir} changed while it was being quantized; nothing was published. Rerun the stage "
                          "once the source is stable (the layers made from the old version are discarded).")


def _verification(job: _Job) -> dict[str, dict[str, Any]]:
    """Each verified layer's figures (timings included), by layer."""
    return {str(v["layer"]): {k: v[k] for k in v if k != "event"} for v in job.events["verify"]}


def _manifest(job: _Job) -> StageManifest:
    start, info, t = job.events["start"], job.info, job.request.threadpool_count
    # Timings go to the result only: the manifest (and so its digest) holds what is reproducible.
    recorded = {layer: {k: v for k, v in figures.items() if k != "seconds"}
                for layer, figures in _verification(job).items()}
    return StageManifest(
        stage=STAGE,
        inputs=job.inputs,
        settings=job.settings,
        tools={"kt-kernel": str(start.get("kt_kernel")), "torch": str(start.get("torch")),
               "cpu_variant": str(start.get("cpu_variant")), "int8_kernel": str(start.get("int8_kernel")),
               "int8_weight_layout": str(start.get("int8_weight_layout"))},
        extra={"source_path": str(job.bf16_dir), "layers": job.layout.moe_layers, "experts": info.num_routed_experts,
               "hidden": info.hidden_size, "moe_intermediate": info.moe_intermediate_size, "top_k": job.top_k,
               "verification": recorded, "max_rel_err": job.request.max_rel_err,
               "serve_flags": {"--kt-method": KT_METHOD, "--kt-threadpool-count": t}},
    )


def _result(job: _Job, manifest: StageManifest) -> QuantizeInt8Result:
    layers = len(job.layout.layers)
    return QuantizeInt8Result(path=job.target, cached=False, layers=layers, layers_reused=layers - len(job.quantized),
                              threadpool_count=job.request.threadpool_count, seconds=job.seconds(),
                              verification=_verification(job), manifest_digest=manifest.digest())


QUANTIZE_INT8: StageSpec[QuantizeInt8Request, _Job, QuantizeInt8Sizes, QuantizeInt8Result] = StageSpec(
    name=STAGE, prepare=_prepare, lookup=_lookup, measure=_measure, needs=quantize_int8_needs,
    work=_work, verify=_verify, manifest=_manifest, result=_result,
    # Complete layers of an interrupted attempt with the same source and settings are kept.
    resume=True, journal=_JOURNAL, bookkeeping=(driver.PLAN_NAME, _LOG),
    host_fix="quantize on an AVX512 or AMX host (the output is portable to any AVX512/AMX server); `ktflow doctor` "
             "says what this host can run",
)
"""The quantize-int8 stage, declared for :func:`~ktflow.runner.run_stage` (and a planner)."""


def quantize_int8(
    bf16_dir: Path,
    out_dir: Path,
    *,
    threadpool_count: int,
    serve_python: Path,
    workers: int | None = None,
    verify_layers: int = 2,
    max_rel_err: float = 0.05,
    progress: Progress | None = None,
    fsync: bool = True,
    scratch_dir: Path | None = None,
    layers_per_process: int | None = None,
) -> QuantizeInt8Result:
    """Quantize a BF16 checkpoint's routed experts to kt-kernel AMXINT8 for ``--kt-threadpool-count T``.

    The written shards of ``verify_layers`` layers are verified through kt-kernel's own inference
    path (the module's docstring says how) against ``max_rel_err``.

    Args:
        bf16_dir: a BF16 DeepSeek-V3-architecture checkpoint (the dequantize stage's output), or a Kimi-K2/K2.5
            INT4 checkpoint (its experts are decoded in memory, one layer at a time).
        out_dir: the output; it appears only when complete.
        threadpool_count: T, kt-kernel's NUMA thread pools; serve with the same ``--kt-threadpool-count``.
        serve_python: the serving toolchain's python (kt-kernel 0.7.2, torch 2.9.1).
        workers: kt-kernel CPU threads (default: physical cores; at least T).
        verify_layers: MoE layers to verify (0 skips verification).
        max_rel_err: verification bound on mean|out - ref| / mean|ref|.
        progress: called with (layers finished, MoE layers) after each layer.
        fsync: fsync every shard before it is renamed into place.
        scratch_dir: where kt-kernel's per-layer ``.kt`` files go before they are packed into a
            shard (default ``/dev/shm``; it needs room for one layer in INT8).
        layers_per_process: kt-kernel wrappers (quantized + verified layers) one driver process
            may create before it is restarted. kt-kernel 0.7.2 never frees a wrapper's weight
            buffers, so each one stays in RAM (its layer's INT8 size) until the process exits;
            the default fits the available RAM (all layers at once for small models).

    Raises:
        InvalidInputError: neither BF16 nor Kimi INT4 (run dequantize first), misaligned T, bad arguments.
        CheckpointError: the checkpoint is malformed or not a DeepSeek-V3-style MoE.
        HostRequirementError: CPU without kt-kernel's INT8 kernels, no serving toolchain, too little RAM, scratch or disk,
            or OUT_DIR's directory is not writable (all before any work).
        StorageError: the disk filled up (or became read-only) mid-run; complete layers stay in
            staging for the rerun, nothing is published.
        KtflowError: kt-kernel failed, the BF16 source changed during the run, or verification
            exceeded ``max_rel_err`` (nothing published).

    Concurrent runs onto one ``out_dir`` are serialized (:func:`~ktflow.store.artifact_lock`):
    the second waits, then finds the artifact published (a cache hit).
    """
    request = QuantizeInt8Request(
        bf16_dir=Path(bf16_dir), out_dir=Path(out_dir), threadpool_count=threadpool_count,
        serve_python=Path(serve_python), workers=workers, verify_layers=verify_layers, max_rel_err=max_rel_err,
        fsync=fsync, scratch_dir=scratch_dir, layers_per_process=layers_per_process,
    )
    return run_stage(QUANTIZE_INT8, request, progress=progress)


def _run_driver(python: Path, plan_path: Path, log_path: Path, events: dict[str, Any],
                on_layer: Callable[[dict[str, Any]], None]) -> bool:
    """Run the driver once in the serving toolchain, collecting its events into ``events``
    (``layer``/``verify`` append to lists, others replace). True when it asks to be restarted."""

    for transient in ("recycle", "error", "verify_failed", "done"):
        events.pop(transient, None)

    def on_line(line: str) -> None:
        if not line.startswith(driver.EVENT_PREFIX):
            return
        try:
            event = json.loads(line[len(driver.EVENT_PREFIX):])
        except ValueError:
            return
        kind = event.get("event")
        if kind in ("layer", "verify"):
            events[kind].append(event)
            if kind == "layer":
                on_layer(event)
        else:
            events[kind] = event

    with ktflow_pythonpath() as pkg_dir:
        env = {**os.environ, "PYTHONPATH": pkg_dir, "PYTHONUNBUFFERED": "1"}
        argv = [str(python), "-m", "ktflow._drivers.kt_int8", "--plan", str(plan_path)]
        events["processes"] += 1
        try:
            run_tool(argv, env=env, log_path=log_path, on_line=on_line)
        except ToolError as exc:
            if exc.returncode == driver.EXIT_RECYCLE and "recycle" in events:
                return True
            if "verify_failed" in events:
                bound = events["verify_failed"]["max_rel_err"]
                bad = {str(v["layer"]): round(v["mean_rel_err"], 5) for v in events["verify"]
                       if not v["mean_rel_err"] <= bound}
                raise KtflowError(
                    f"{STAGE}: kt-kernel's AMXINT8 forward of the written weights differs from the float64 BF16 "
                    f"reference by mean relative error {bad} (layer: error), above max_rel_err {bound}; nothing "
                    f"published (log: {log_path})"
                ) from None
            failure = events.get("error", {})
            message = failure.get("message")
            if failure.get("errno") in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
                # a full or read-only output filesystem: the caller's storage_errors names it
                raise OSError(failure["errno"], os.strerror(failure["errno"]), failure.get("filename")) from exc
            if message:
                raise KtflowError(f"{STAGE}: the kt-kernel driver failed: {message} (log: {log_path})") from exc
            raise
    return False
