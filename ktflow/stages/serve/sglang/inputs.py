"""What sglang-kt 0.7.2 is given to load, where the pipeline's own outputs are not what it reads.

Two preparations, each applied only when the checkpoint (or the adapter) needs it, said in the log,
and made atomically (a staging directory renamed into place: no server or stage ever reads a
half-written one). Both were first done by hand on the GPU host (``gpu_host/serve_check.py``
``served-model`` and ``int8-kt-layout``; benchmarks/data/sglang-serve); the serve stage does them
itself before every sglang-kt start (serve, swap, rollback, a candidate's server).

**The model directory** (``--model-path``), :func:`sglang_model_view`:

- sglang-kt's ``deepseek_v2.py`` reads ``moe_layer_freq``, ``topk_method`` and ``scoring_func`` from
  a DeepSeek-V2/V3 (and Kimi K2/K2.5) config without a default. Published configs carry them; a
  config saved by transformers' ``DeepseekV3Config`` / ``DeepseekV2Config`` (any transformers-saved
  checkpoint, ktflow's fixtures among them) drops them. The view is a folder of links to the
  checkpoint with a ``config.json`` that adds the missing ones (nothing else changed), with the
  values transformers' own modelling computes for that ``model_type`` (:data:`ROUTING_FIELDS`):
  the routing the model was trained with.
- A Kimi-K2.5 checkpoint whose ``vision_config`` is not MoonViT's (the fields sglang-kt's
  ``KimiK25ForConditionalGeneration`` builds its vision tower from are missing, as in ktflow's
  fixtures, which carry a few small stand-in vision modules) cannot be loaded by sglang-kt at all.
  The view is then its language model: ``text_config`` (plus the fields above) as a
  ``DeepseekV3ForCausalLM`` config, the ``language_model.*`` tensors with that prefix dropped (the
  INT4 packed experts included, bytes unchanged) and the vision tensors left out: what sglang-kt's
  Kimi K2.5 class itself hands its ``DeepseekV3ForCausalLM``. These shards are copies (a tensor's
  name lives in its shard's header), the size of the language model. The KT CPU experts still come
  from the original checkpoint (``--kt-weight-path``). A real Kimi K2.5 (MoonViT) is served as it is.

The view lives in the endpoint's record directory (``model-view-<digest>``, the digest of the
checkpoint's identity and what the view changes): one per endpoint, reused by its restarts and
swaps; a changed checkpoint gets a new one.

**The AMXINT8 expert weights** (``--kt-weight-path``), :func:`sglang_kt_weights`: with an adapter
that carries an expert LoRA, sglang-kt builds kt-kernel's ``AMXINT8_SFT`` wrapper, whose loader
(kt-kernel 0.7.2 ``sft/amx.py``) reads only pre-quantized ``_layer_L/_numa_N/INT8_*.kt`` files
(kt-kernel's ``cpu_save`` layout) and refuses the ``blk.*`` safetensors the quantize-int8 stage
publishes (what kt-kernel's inference wrapper, without LoRA, reads). :func:`int8_kt_layout` writes
each packed slice of those safetensors back into that layout, byte for byte (the shards hold
exactly the bytes ``cpu_save`` wrote), and links the rest.

Why here and not in quantize-int8's output: whether the ``.kt`` layout is needed depends on the
adapter served (an expert LoRA: kt-kernel's SFT wrapper; none: its inference wrapper, which reads
only the safetensors), which only the serve stage knows; quantize-int8's output stays exactly what
kt-kernel's ``convert_cpu_weights.py`` writes (its tests hold it byte for byte), every output
already made stays valid, and the copy (the size of the INT8 experts) is made only where a LoRA
with experts is served, once per INT8 artifact: it is an artifact of its own in the store
(``int8/<name>-kt-<digest>``, keyed by the quantize-int8 manifest's digest, with a manifest of
stage ``int8-kt-layout`` that repeats the INT8 settings the launch checks), shared by every server
of those weights, never rebuilt per endpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import psutil
from pydantic import BaseModel

from ktflow.errors import CheckpointError, KtflowError
from ktflow.formats.adapter import has_expert_lora
from ktflow.formats.checkpoint import (
    CONFIG_NAME,
    INDEX_NAME,
    NESTED_PREFIX,
    checkpoint_identity,
    identity_digest,
    load_config,
    read_weight_map,
    text_config,
)
from ktflow.formats.kt_layout import SHARD_KEY, has_kt_layout, kt_file_name, kt_files_of_layer
from ktflow.formats.safetensors_io import SafetensorsWriter, fsync_dir, read_header
from ktflow.recipe import Recipe
from ktflow.resources import QUANTIZE_INT8_STAGE
from ktflow.store import (
    MANIFEST_NAME,
    StageManifest,
    artifact_lock,
    check_free_space,
    publish_dir,
    read_manifest,
    staging_dir_for,
)

Log = Callable[[str], None] | None

MODEL_VIEW_PREFIX = "model-view-"
MODEL_VIEW_RECORD = "ktflow-model-view.json"
_VIEW_VERSION = 1  # bump when what a view holds changes: older views are then made again

# The routing fields sglang-kt reads without a default, per model_type family, with the values
# transformers' modelling computes (DeepseekV3: sigmoid scores, bias-corrected top-k; DeepseekV2:
# softmax, greedy top-k, transformers' default topk_method) and every layer from
# first_k_dense_replace on a MoE layer (moe_layer_freq 1). Published configs carry these values.
ROUTING_FIELDS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
    "deepseek_v2": {"moe_layer_freq": 1, "topk_method": "greedy", "scoring_func": "softmax"},
}
_FAMILY_OF_MODEL_TYPE = {"deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3", "deepseek_v2": "deepseek_v2"}
_FAMILY_OF_ARCHITECTURE = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v2"}

# What sglang-kt's MoonViT3dPretrainedModel reads from a Kimi K2.5 vision_config; a config without
# them is not a MoonViT sglang-kt can build (ktflow's fixtures carry stand-in vision modules).
MOONVIT_CONFIG_FIELDS = ("merge_kernel_size", "init_pos_emb_height", "num_hidden_layers", "vt_hidden_size")
# Top-level config keys the language model's config takes over when its text_config lacks them.
_CARRIED_KEYS = ("quantization_config", "tie_word_embeddings", "eos_token_id", "pad_token_id", "bos_token_id")

KT_LAYOUT_STAGE = "int8-kt-layout"
_COPY_CHUNK = 1 << 24


# --------------------------------------------------------------------------- the model directory


class ModelView(BaseModel):
    """What sglang-kt needs changed about a checkpoint directory to load it (:func:`model_view_plan`)."""

    kind: Literal["config", "language-model"]
    reason: str
    added: dict[str, Any]  # the routing fields added to the (text) config


def _family(config: dict[str, Any]) -> str | None:
    """The DeepSeek family sglang-kt builds for this (text) config, or None."""
    family = _FAMILY_OF_MODEL_TYPE.get(str(config.get("model_type", "")))
    if family is None:
        archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
        family = next((_FAMILY_OF_ARCHITECTURE[a] for a in archs if a in _FAMILY_OF_ARCHITECTURE), None)
    return family


def _missing_routing_fields(config: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    family = _family(config) or _family(top)
    if family is None:
        return {}
    return {k: v for k, v in ROUTING_FIELDS[family].items() if k not in config}


def _unbuildable_vision(config: dict[str, Any]) -> bool:
    """A Kimi-K2.5 config whose vision part sglang-kt cannot build (not MoonViT)."""
    vision = config.get("vision_config")
    return (str(config.get("model_type", "")).startswith("kimi_k25") and isinstance(vision, dict)
            and isinstance(config.get("text_config"), dict)
            and not all(k in vision for k in MOONVIT_CONFIG_FIELDS))


def model_view_plan(model_dir: Path) -> ModelView | None:
    """What sglang-kt needs changed about ``model_dir`` (from its config.json), or None: it loads it as it is.

    Raises:
        CheckpointError: no readable config.json.
    """
    config = load_config(model_dir)
    text = text_config(config)
    added = _missing_routing_fields(text, config)
    if _unbuildable_vision(config):
        missing = [k for k in MOONVIT_CONFIG_FIELDS if k not in config["vision_config"]]
        return ModelView(kind="language-model", added=added, reason=(
            "a Kimi-K2.5 checkpoint whose vision_config is not MoonViT's (no " + ", ".join(missing) + "): "
            "sglang-kt cannot build its vision tower, so its language model is served (the same tensors)"))
    if added:
        return ModelView(kind="config", added=added, reason=(
            f"config.json lacks {', '.join(sorted(added))}, which sglang-kt reads without a default "
            "(a transformers-saved DeepSeek config drops them)"))
    return None


def _view_dir(model_dir: Path, record_dir: Path, plan: ModelView) -> Path:
    key = identity_digest({"model_dir": str(model_dir.resolve()), "checkpoint": checkpoint_identity(model_dir),
                           "config": (model_dir / CONFIG_NAME).read_text(encoding="utf-8"),
                           "view": plan.model_dump(mode="json"), "version": _VIEW_VERSION})
    return Path(record_dir).absolute() / f"{MODEL_VIEW_PREFIX}{key[:16]}"


def sglang_model_view(model_dir: Path, record_dir: Path, *, create: bool = True, log: Log = None) -> Path:
    """``model_dir`` as sglang-kt can load it: ``model_dir`` itself when it can, else a view of it in
    ``record_dir`` (the module docstring says which and why), made once, atomically.

    ``create=False`` only names the view (``ktflow serve --dry-run``).

    Raises:
        CheckpointError: the checkpoint cannot be read (config, index, shard headers).
    """
    model_dir = Path(model_dir).absolute()
    plan = model_view_plan(model_dir)
    if plan is None:
        return model_dir
    view = _view_dir(model_dir, record_dir, plan)
    if not create or view.is_dir():
        if log and create:
            log(f"sglang-kt model: {view} ({plan.reason}; made before)")
        return view
    view.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(view)
    staging = view.parent / f".{view.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        what = (_language_model_view if plan.kind == "language-model" else _config_view)(model_dir, staging, plan)
        (staging / MODEL_VIEW_RECORD).write_text(json.dumps({
            "source": str(model_dir), "kind": plan.kind, "reason": plan.reason, "added": plan.added, **what,
        }, indent=1) + "\n")
        fsync_dir(staging)
        try:
            os.rename(staging, view)
        except OSError:
            if not view.is_dir():  # another start made it meanwhile: use that one
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if log:
        log(f"sglang-kt model: {view} ({plan.reason})")
    return view


def _remove_abandoned(view: Path) -> None:
    """Staging directories of ``view`` whose maker died (a kill mid-copy): never read, only in the way."""
    for staging in view.parent.glob(f".{view.name}.tmp-*"):
        pid = staging.name.rsplit(".tmp-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)


def _link_rest(src: Path, dst: Path, skip: set[str]) -> None:
    """Link every entry of ``src`` not in ``skip`` (nor ktflow's manifest, which lists src's files) into ``dst``."""
    for entry in sorted(src.iterdir()):
        if entry.name not in skip and entry.name != MANIFEST_NAME:
            (dst / entry.name).symlink_to(entry)


def _config_view(model_dir: Path, out: Path, plan: ModelView) -> dict[str, Any]:
    config = load_config(model_dir)
    text = text_config(config)
    text.update(plan.added)  # in place: text_config is a part of config when nested
    _link_rest(model_dir, out, {CONFIG_NAME})
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return {}


def _language_model_view(model_dir: Path, out: Path, plan: ModelView) -> dict[str, Any]:
    config = load_config(model_dir)
    text = dict(config["text_config"])
    text.update(plan.added)
    text["architectures"] = ["DeepseekV3ForCausalLM"]
    for key in _CARRIED_KEYS:
        if key in config and key not in text:
            text[key] = config[key]
    weight_map, _ = read_weight_map(model_dir)
    kept: dict[str, str] = {}
    total = 0
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        names, nbytes = _copy_renamed(model_dir / shard, out / shard)
        kept.update(dict.fromkeys(names, shard))
        total += nbytes
    index_path = model_dir / INDEX_NAME
    index = json.loads(index_path.read_text(encoding="utf-8")) if index_path.is_file() else {}
    index["metadata"] = {**(index.get("metadata") or {}), "total_size": total}
    index["weight_map"] = dict(sorted(kept.items()))
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    # the stand-in's remote code is not needed (the view names a built-in architecture)
    _link_rest(model_dir, out, {CONFIG_NAME, INDEX_NAME, *shards, *(p.name for p in model_dir.glob("*.py"))})
    (out / CONFIG_NAME).write_text(json.dumps(text, indent=2) + "\n")
    return {"architectures": text["architectures"], "tensors": len(kept),
            "dropped_tensors": len(weight_map) - len(kept), "renamed": f"{NESTED_PREFIX}* -> *"}


def _copy_renamed(src: Path, dst: Path) -> tuple[list[str], int]:
    """``dst``: ``src``'s ``language_model.*`` tensors without that prefix, bytes unchanged; the names written
    and their bytes."""
    header = read_header(src)
    keep = [(name, info) for name, info in header.tensors.items() if name.startswith(NESTED_PREFIX)]
    plan = [(name.removeprefix(NESTED_PREFIX), info.dtype, info.shape) for name, info in keep]
    with open(src, "rb") as f, SafetensorsWriter(dst, plan, metadata=header.metadata or None) as writer:
        for (name, info), (new, _, _) in zip(keep, plan, strict=True):
            writer.write_pieces(new, _pieces(f, info.start, info.nbytes))
    return [new for new, _, _ in plan], sum(info.nbytes for _, info in keep)


def _pieces(f: Any, start: int, nbytes: int):
    f.seek(start)
    while nbytes:
        chunk = f.read(min(nbytes, _COPY_CHUNK))
        if not chunk:
            raise CheckpointError(f.name, f"truncated: ends before byte {start + nbytes}",
                                  "re-download or re-run the stage that wrote it")
        nbytes -= len(chunk)
        yield memoryview(chunk)


# --------------------------------------------------------------------------- AMXINT8 expert weights


def kt_layout_dir_for(recipe: Recipe, int8_dir: Path) -> Path:
    """Where the ``.kt`` layout of the quantize-int8 output ``int8_dir`` is published in the recipe's store."""
    manifest = read_manifest(int8_dir)
    digest = manifest.digest() if manifest is not None else identity_digest({"dir": str(Path(int8_dir).absolute())})
    return recipe.store.layout.int8(f"{Path(int8_dir).name}-kt-{digest[:12]}").absolute()


def sglang_kt_weights(recipe: Recipe, kt_weight_dir: Path, adapter_dir: Path | None, *, create: bool = True,
                      log: Log = None) -> Path:
    """The ``--kt-weight-path`` sglang-kt reads: ``kt_weight_dir``, or for ``AMXINT8`` with an expert LoRA
    and a quantize-int8 output without ``.kt`` files, its ``.kt`` layout (published once, in the store)."""
    kt_weight_dir = Path(kt_weight_dir).absolute()
    if recipe.serving.kt_method != "AMXINT8" or adapter_dir is None or not has_expert_lora(adapter_dir):
        return kt_weight_dir
    manifest = read_manifest(kt_weight_dir) if kt_weight_dir.is_dir() else None
    if manifest is None or manifest.stage != QUANTIZE_INT8_STAGE or has_kt_layout(kt_weight_dir):
        return kt_weight_dir  # already in that layout, or not INT8 weights at all: the launch check says so
    out = kt_layout_dir_for(recipe, kt_weight_dir)
    if not create:
        return out
    why = ("the adapter carries an expert LoRA, so sglang-kt serves the experts through kt-kernel's AMXINT8_SFT, "
           "which reads only kt-kernel's _layer_L/_numa_N/*.kt files")
    made = int8_kt_layout(kt_weight_dir, out, log=log)
    if log:
        log(f"sglang-kt AMXINT8 experts: {made} ({why})")
    return made


def int8_kt_layout(int8_dir: Path, out_dir: Path, *, fsync: bool = True, log: Log = None) -> Path:
    """Publish ``out_dir``: the quantize-int8 output ``int8_dir`` in kt-kernel's ``.kt`` layout as well.

    Each ``blk.L.ffn_P_exps.E.numa.N.{weight,scale}`` tensor is written back, byte for byte, to the
    ``_layer_L/_numa_N/INT8_P_E_<bytes>Byte_{quant,scale}_.kt`` file kt-kernel's ``cpu_save`` wrote it
    from; every other file of ``int8_dir`` is linked. Checked before it is published: every layer of
    the INT8 manifest has each (NUMA slice, expert, projection) exactly once, at the size kt-kernel
    gives it. A cache hit when published for the same INT8 artifact.

    Raises:
        KtflowError: ``int8_dir`` is not a quantize-int8 output, or its shards do not hold the layout
            its manifest names.
        InsufficientDiskError: the filesystem cannot take the copy (before anything is written).
    """
    int8_dir, out_dir = Path(int8_dir).absolute(), Path(out_dir).absolute()
    source = read_manifest(int8_dir)
    if source is None or source.stage != QUANTIZE_INT8_STAGE:
        raise KtflowError(f"{int8_dir} is not a quantize-int8 output (no manifest.json of that stage)")
    inputs = {"int8": source.digest()}

    def published() -> bool:
        found = read_manifest(out_dir) if out_dir.is_dir() else None
        return found is not None and found.stage == KT_LAYOUT_STAGE and found.inputs == inputs

    if published():
        return out_dir
    with artifact_lock(out_dir):
        if published():
            return out_dir
        slices = _int8_slices(int8_dir)
        _check_slices(int8_dir, source, slices)
        total = sum(nbytes for *_, nbytes in slices)
        check_free_space(out_dir, total, what=f"the .kt layout of {int8_dir.name}", files=len(slices))
        if log:
            log(f"writing kt-kernel's .kt layout of {int8_dir} ({total / 2**30:.2f} GiB, {len(slices)} files) "
                f"to {out_dir}")
        staging = staging_dir_for(out_dir)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for entry in sorted(int8_dir.iterdir()):
            if entry.name != MANIFEST_NAME:
                (staging / entry.name).symlink_to(entry)
        layers: set[int] = set()
        for shard, start, rel, nbytes in slices:
            dst = staging / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            with open(int8_dir / shard, "rb") as f, open(dst, "wb") as g:
                for piece in _pieces(f, start, nbytes):
                    g.write(piece)
                if fsync:
                    g.flush()
                    os.fsync(g.fileno())
            layers.add(int(rel.split("/")[0].removeprefix("_layer_")))
        publish_dir(staging, out_dir, StageManifest(
            stage=KT_LAYOUT_STAGE, inputs=inputs, settings={**source.settings, "layout": "kt"},
            tools=dict(source.tools),
            extra={"int8_dir": str(int8_dir), "layers": sorted(layers), "kt_files": len(slices),
                   "bytes": total, "verification": source.extra.get("verification", {})},
        ), fsync=fsync)
    return out_dir


def _int8_slices(int8_dir: Path) -> list[tuple[str, int, str, int]]:
    """Every packed slice of the INT8 shards: (shard, absolute start, .kt path, bytes)."""
    slices = []
    for shard in sorted(int8_dir.glob("*.safetensors")):
        for name, info in read_header(shard).tensors.items():
            m = SHARD_KEY.match(name)
            if m is None:
                continue
            layer, proj, expert, numa, kind = int(m[1]), m[2], int(m[3]), int(m[4]), m[5]
            rel = kt_file_name(layer, numa, proj, expert, info.nbytes, "quant" if kind == "weight" else "scale")
            slices.append((shard.name, info.start, rel, info.nbytes))
    return slices


def _check_slices(int8_dir: Path, manifest: StageManifest, slices: list[tuple[str, int, str, int]]) -> None:
    """Every (layer, NUMA slice, expert, projection, quant|scale) of the manifest, once, at kt-kernel's size."""
    t, experts = manifest.settings.get("threadpool_count"), manifest.extra.get("experts")
    hidden, inter = manifest.extra.get("hidden"), manifest.extra.get("moe_intermediate")
    layers = manifest.extra.get("layers")
    if not all(isinstance(v, int) for v in (t, experts, hidden, inter)) or not isinstance(layers, list):
        raise KtflowError(f"{int8_dir / MANIFEST_NAME} does not say the INT8 layout (threadpool_count, experts, "
                          "hidden, moe_intermediate, layers); re-run the quantize-int8 stage")
    expected = set().union(*(kt_files_of_layer(layer, t, experts, hidden, inter) for layer in layers))
    found = [rel for _, _, rel, _ in slices]
    if len(found) != len(set(found)) or set(found) != expected:
        missing, extra = sorted(expected - set(found)), sorted(set(found) - expected)
        raise KtflowError(f"{int8_dir}: the INT8 shards do not hold the layout its manifest names (missing "
                          f"{missing[:3]}, unexpected {extra[:3]}); re-run the quantize-int8 stage")


# --------------------------------------------------------------------------- both


def sglang_inputs(recipe: Recipe, *, model_dir: Path, kt_weight_dir: Path, adapter_dir: Path | None,
                  record_dir: Path, create: bool = True, log: Log = None) -> tuple[Path, Path]:
    """``(--model-path, --kt-weight-path)`` for an sglang-kt server of ``recipe`` started from ``record_dir``:
    :func:`sglang_model_view` and :func:`sglang_kt_weights` (each the input itself where nothing is needed)."""
    return (sglang_model_view(model_dir, record_dir, create=create, log=log),
            sglang_kt_weights(recipe, kt_weight_dir, adapter_dir, create=create, log=log))
