"""Recognize and validate a model checkpoint directory from its config and headers alone.

``ktflow inspect`` calls :func:`inspect_checkpoint`. It reads ``config.json``, the shard index
and every shard's safetensors header (never tensor data, so it takes seconds on 600 GB), and
refuses anything a later stage would trip over hours in: missing or truncated shards, an index
that disagrees with its shards, a quantized weight without its scale, or a quantization scheme
ktflow does not decode.

Formats are recognized by structure (where the quantization config sits, what it says, how
tensors are named), never by ``model_type`` strings, which vary between copies of one model.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

from ktflow.errors import CheckpointError
from ktflow.formats.safetensors_io import SafetensorsHeader, TensorInfo, read_header, read_tensor
from ktflow.store import read_manifest

if TYPE_CHECKING:
    import torch

CheckpointFormat = Literal["kimi-k2.5-int4", "kimi-k2-int4", "deepseek-v3-fp8", "bf16"]
Layout = Literal["nested", "flat"]

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
NESTED_PREFIX = "language_model."
INT4_GROUP_SIZE = 32
FP8_BLOCK = [128, 128]
_REFETCH = "re-download the checkpoint (or re-run the stage that wrote it); the copy is incomplete."


class CheckpointInfo(BaseModel):
    """What ``ktflow inspect`` reports about a checkpoint directory."""

    path: str
    format: CheckpointFormat
    layout: Layout  # "nested": DeepSeek-V3 config under text_config (Kimi-K2.5); "flat": top level
    tensor_prefix: str  # "language_model." for nested checkpoints, "" for flat ones
    architectures: list[str]
    model_type: str | None
    num_layers: int
    first_k_dense: int
    num_routed_experts: int
    num_shared_experts: int
    hidden_size: int
    moe_intermediate_size: int
    intermediate_size: int
    num_shards: int
    num_tensors: int
    tensor_bytes: int  # sum of the tensors' sizes, headers excluded
    quantized_tensors: int  # weight_packed tensors plus FP8 weights
    dtypes: dict[str, int]  # safetensors dtype name -> number of tensors
    shards: list[str]


def load_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of checkpoint directory ``path``."""
    config_path = Path(path) / CONFIG_NAME
    if not config_path.is_file():
        raise CheckpointError(str(Path(path)), f"no {CONFIG_NAME}; this is not a Hugging Face checkpoint directory.",
                              "point at the directory that holds config.json and the safetensors shards.")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(str(config_path), f"cannot be read as JSON: {e}", _REFETCH) from None
    if not isinstance(config, dict):
        raise CheckpointError(str(config_path), f"is a JSON {type(config).__name__}, not an object.", _REFETCH)
    return config


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: ``text_config`` when nested (Kimi-K2.5), else ``config``."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def detect_format(config: dict[str, Any], tensor_names: Iterable[str]) -> tuple[CheckpointFormat, Layout, str]:
    """``(format, layout, tensor_prefix)`` of a checkpoint, from its config and tensor names.

    Raises:
        CheckpointError: an unsupported quantization scheme (naming the config field), or a
            config that contradicts the tensors.
    """
    names = list(tensor_names)
    prefixed = any(n.startswith(NESTED_PREFIX) for n in names)
    if prefixed and any(n.startswith("model.layers.") or n == "lm_head.weight" for n in names):
        raise CheckpointError(CONFIG_NAME, f"tensors mix '{NESTED_PREFIX}model.layers...' and 'model.layers...' "
                                           "names; a checkpoint uses one layout.", _REFETCH)
    layout: Layout = "nested" if isinstance(config.get("text_config"), dict) else "flat"
    qc, where, nested = _quantization_config(config, layout)
    if qc is None:
        quantized = next((n for n in names if n.endswith((".weight_packed", ".weight_scale_inv"))), None)
        if quantized is not None:
            raise CheckpointError(CONFIG_NAME, f"has no quantization_config, but tensor '{quantized}' is quantized.",
                                  "restore the quantization_config of the original checkpoint.")
        fmt: CheckpointFormat = "bf16"
    elif not isinstance(qc, dict):
        raise CheckpointError(CONFIG_NAME, f"{where} is {qc!r:.80}, not an object.")
    elif qc.get("quant_method") == "compressed-tensors":
        fmt = _int4_format(qc, where, names, nested=nested, prefixed=prefixed)
    elif qc.get("quant_method") == "fp8":
        _check_fp8_scheme(qc, where)
        if not any(n.endswith(".weight_scale_inv") for n in names):
            raise CheckpointError(CONFIG_NAME, f"{where} declares block FP8, but no tensor is a '.weight_scale_inv'.",
                                  _REFETCH)
        fmt = "deepseek-v3-fp8"
    else:
        raise CheckpointError(CONFIG_NAME, f"{where}.quant_method is {qc.get('quant_method')!r}; ktflow supports "
                                           "'compressed-tensors' (Kimi INT4) and 'fp8' (DeepSeek-V3 block FP8).",
                              "convert the checkpoint to BF16 first, or use one of the supported formats.")
    if (layout == "nested") != prefixed:
        config_says = "has a text_config (nested layout)" if layout == "nested" else "has no text_config (flat layout)"
        raise CheckpointError(CONFIG_NAME, f"{config_says}, but the tensors are {'' if prefixed else 'not '}"
                                           f"under '{NESTED_PREFIX}'.",
                              "use the config that came with these shards.")
    return fmt, layout, NESTED_PREFIX if prefixed else ""


def _quantization_config(config: dict[str, Any], layout: Layout) -> tuple[Any, str, bool]:
    """``(quantization_config or None, where it is, whether it is nested in text_config)``."""
    top_qc, nested_qc = config.get("quantization_config"), text_config(config).get("quantization_config")
    if layout == "flat":
        nested_qc = None  # text_config(config) is config itself
    if top_qc is not None and nested_qc is not None and top_qc != nested_qc:
        raise CheckpointError(CONFIG_NAME, "quantization_config and text_config.quantization_config disagree.",
                              "keep one of them (Kimi-K2.5 keeps it in text_config).")
    if nested_qc is not None:
        return nested_qc, "text_config.quantization_config", True
    return top_qc, "quantization_config", False


def _int4_format(qc: dict[str, Any], where: str, names: list[str], *, nested: bool, prefixed: bool) -> CheckpointFormat:
    """Kimi-K2.5 (nested config, prefixed tensors) or Kimi-K2 (flat) pack-quantized INT4."""
    _check_int4_scheme(qc, where)
    if not any(n.endswith(".weight_packed") for n in names):
        raise CheckpointError(CONFIG_NAME, f"{where} declares pack-quantized INT4, but no tensor is a "
                                           "'.weight_packed'.", _REFETCH)
    if nested and not prefixed:
        raise CheckpointError(CONFIG_NAME, f"{where} is nested (Kimi-K2.5 layout), but the tensors are not "
                                           f"under '{NESTED_PREFIX}'.",
                              "use the config that came with these shards.")
    if not nested and prefixed:
        raise CheckpointError(CONFIG_NAME, f"{where} is at the top level (Kimi-K2 layout), but the tensors are "
                                           f"under '{NESTED_PREFIX}' (Kimi-K2.5 layout).",
                              "move it into text_config, as Kimi-K2.5 ships it.")
    return "kimi-k2.5-int4" if prefixed else "kimi-k2-int4"


def _unsupported(field: str, value: object, supported: str) -> CheckpointError:
    return CheckpointError(CONFIG_NAME, f"{field} is {json.dumps(value)}; ktflow supports {supported}.",
                           "use a Kimi K2/K2.5 INT4, DeepSeek-V3 FP8 or BF16 checkpoint.")


def _check_int4_scheme(qc: dict[str, Any], where: str) -> None:
    """Kimi's scheme only: pack-quantized, INT4, symmetric, groups of 32, weights only."""
    if qc.get("format") != "pack-quantized":
        raise _unsupported(f"{where}.format", qc.get("format"), "format pack-quantized")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _unsupported(f"{where}.config_groups", groups, "one or more config groups")
    for group_name, group in groups.items():
        at = f"{where}.config_groups.{group_name}"
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise _unsupported(f"{at}.weights", group.get("weights") if isinstance(group, dict) else group,
                               "a weights scheme")
        for activations in ("input_activations", "output_activations"):
            if group.get(activations) is not None:
                raise _unsupported(f"{at}.{activations}", group[activations],
                                   "weight-only quantization (activations null)")
        weights = group["weights"]
        for field, expected in (("num_bits", 4), ("type", "int"), ("strategy", "group"),
                                ("group_size", INT4_GROUP_SIZE), ("symmetric", True)):
            if weights.get(field) != expected:
                raise _unsupported(f"{at}.weights.{field}", weights.get(field), f"{field} {json.dumps(expected)}")


def _check_fp8_scheme(qc: dict[str, Any], where: str) -> None:
    """DeepSeek-V3's scheme only: e4m3 weights in 128 x 128 blocks."""
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _unsupported(f"{where}.fmt", qc.get("fmt"), "fmt e4m3")
    if qc.get("weight_block_size") != FP8_BLOCK:
        raise _unsupported(f"{where}.weight_block_size", qc.get("weight_block_size"), "weight_block_size [128, 128]")


def read_weight_map(path: Path) -> tuple[dict[str, str], str]:
    """``{tensor: shard file name}`` from the index (or the single file's header), and its source."""
    index_path = path / INDEX_NAME
    if index_path.exists():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CheckpointError(str(index_path), f"cannot be read as JSON: {e}", _REFETCH) from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(str(index_path), "has no 'weight_map' object of tensor name -> shard file.",
                                  _REFETCH)
        return weight_map, INDEX_NAME
    if (path / SINGLE_FILE_NAME).is_file():
        header = read_header(path / SINGLE_FILE_NAME)
        return {name: SINGLE_FILE_NAME for name in header.tensors}, SINGLE_FILE_NAME
    others = sorted(p.name for p in path.glob("*.safetensors"))
    found = f" ({len(others)} other .safetensors files, e.g. {others[0]})" if others else ""
    raise CheckpointError(str(path), f"no {INDEX_NAME} and no {SINGLE_FILE_NAME}{found}.",
                          f"restore {INDEX_NAME}, or point at a complete checkpoint directory.")


def _int_field(config: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if type(value) is not int or value < 0:
        raise CheckpointError(CONFIG_NAME, f"{where}{key} is {json.dumps(value)}; expected a non-negative integer "
                                           "(ktflow handles DeepSeek-V3-architecture MoE models).")
    return value


def inspect_checkpoint(path: str | Path) -> CheckpointInfo:
    """Validate checkpoint directory ``path`` (config, index, shard headers) and describe it.

    Raises:
        CheckpointError: naming the file (and tensor or config field) that is wrong.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(str(path), "is not a directory." if path.exists() else "does not exist.",
                              "pass the checkpoint directory (the one holding config.json).")
    config = load_config(path)
    weight_map, source = read_weight_map(path)
    try:  # config problems first, before any shard is opened
        fmt, layout, prefix = detect_format(config, weight_map)
        dims = _dims(config, layout)
    except CheckpointError as e:
        if e.subject != CONFIG_NAME:
            raise
        raise CheckpointError(str(path / CONFIG_NAME), e.reason, e.fix) from None
    headers = _shard_headers(path, weight_map, source)
    dtypes = {name: headers[shard].tensors[name].dtype for name, shard in weight_map.items()}
    _check_companions(path, fmt, weight_map, dtypes, source)
    architectures = config.get("architectures")
    return CheckpointInfo(
        path=str(path),
        format=fmt,
        layout=layout,
        tensor_prefix=prefix,
        architectures=[a for a in architectures if isinstance(a, str)] if isinstance(architectures, list) else [],
        model_type=config.get("model_type") if isinstance(config.get("model_type"), str) else None,
        **dims,
        num_shards=len(headers),
        num_tensors=len(weight_map),
        tensor_bytes=sum(info.nbytes for h in headers.values() for info in h.tensors.values()),
        quantized_tensors=sum(1 for n, d in dtypes.items() if n.endswith(".weight_packed") or d.startswith("F8_")),
        dtypes=dict(sorted(Counter(dtypes.values()).items())),
        shards=sorted(headers),
    )


def _dims(config: dict[str, Any], layout: Layout) -> dict[str, int]:
    """The model's dimensions, from its (text) config."""
    tc, at = text_config(config), ("text_config." if layout == "nested" else "")
    return {
        "num_layers": _int_field(tc, "num_hidden_layers", at),
        "first_k_dense": _int_field(tc, "first_k_dense_replace", at, default=0),
        "num_routed_experts": _int_field(tc, "n_routed_experts", at),
        "num_shared_experts": _int_field(tc, "n_shared_experts", at, default=0),
        "hidden_size": _int_field(tc, "hidden_size", at),
        "moe_intermediate_size": _int_field(tc, "moe_intermediate_size", at),
        "intermediate_size": _int_field(tc, "intermediate_size", at),
    }


def _shard_headers(path: Path, weight_map: dict[str, str], source: str) -> dict[str, SafetensorsHeader]:
    """Every shard's header, each checked to hold exactly the tensors the index maps to it."""
    headers: dict[str, SafetensorsHeader] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = path / shard
        if not shard_path.is_file():
            named = [n for n, s in weight_map.items() if s == shard]
            raise CheckpointError(str(shard_path), f"missing shard: {source} names it for {len(named)} tensors "
                                                   f"(e.g. '{named[0]}'), but it is not on disk.", _REFETCH)
        headers[shard] = header = read_header(shard_path)
        for name in header.tensors:
            if weight_map.get(name) != shard:
                raise CheckpointError(f"{shard_path}: tensor '{name}'",
                                      f"is in this shard but {source} maps it to {weight_map.get(name)!r}.", _REFETCH)
    for name, shard in weight_map.items():
        if name not in headers[shard].tensors:
            raise CheckpointError(f"{path / shard}: tensor '{name}'",
                                  f"is named in {source} but absent from this shard.", _REFETCH)
    return headers


def _check_companions(path: Path, fmt: CheckpointFormat, weight_map: dict[str, str], dtypes: dict[str, str],
                      source: str) -> None:
    """Every quantized tensor has what decoding it takes (INT4: scale and shape; FP8: scale_inv)."""
    for name, dtype in dtypes.items():
        module = name.rpartition(".")[0]
        if name.endswith(".weight_packed"):
            companions = (f"{module}.weight_scale", f"{module}.weight_shape")
        elif dtype.startswith("F8_"):
            if fmt != "deepseek-v3-fp8":
                raise CheckpointError(f"{path / weight_map[name]}: tensor '{name}'",
                                      f"is {dtype}, but config.json declares no FP8 quantization.", _REFETCH)
            companions = (f"{module}.weight_scale_inv",)
        else:
            continue
        for companion in companions:
            if companion not in weight_map:
                raise CheckpointError(f"{path / weight_map[name]}: tensor '{name}'",
                                      f"has no companion '{companion}' in any shard of {source}.", _REFETCH)


def checkpoint_identity(path: str | Path) -> dict[str, Any]:
    """A cheap identity of a checkpoint directory: its shards' names, sizes and mtimes, plus the
    digest of the ktflow manifest it was published with (if any). Reads no tensor data.

    Any rewrite of a shard changes it; stages use its digest (:func:`identity_digest`) as the
    input part of their cache keys, so a 600 GB folder is never re-hashed on a cache check.
    """
    path = Path(path)
    files = {}
    for shard in sorted(set(read_weight_map(path)[0].values())):
        st = (path / shard).stat()
        files[shard] = [st.st_size, st.st_mtime_ns]
    upstream = read_manifest(path)
    return {"files": files, "upstream": upstream.digest() if upstream else None}


def identity_digest(identity: dict[str, Any]) -> str:
    """sha256 of an identity mapping (canonical JSON)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def checkpoint_digest(path: str | Path) -> str:
    """:func:`identity_digest` of :func:`checkpoint_identity`: a checkpoint's cache-key digest."""
    return identity_digest(checkpoint_identity(path))


FINGERPRINT_SPAN = 1 << 20


def checkpoint_fingerprint(path: str | Path) -> str:
    """A checkpoint's identity that is the same on every host holding the same bytes: each shard's
    name, size and the sha256 of its first and last MiB, plus ``config.json``. Unlike
    :func:`checkpoint_digest` (mtimes: a cache key on one host) it tells whether two hosts' copies,
    each downloaded or dequantized on its own, are one base; it reads 2 MiB a shard.
    """
    path = Path(path)
    digest = hashlib.sha256()
    config = path / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for shard in sorted(set(read_weight_map(path)[0].values())):
        size = (path / shard).stat().st_size
        digest.update(f"\0{shard}\0{size}\0".encode())
        with open(path / shard, "rb") as fh:
            digest.update(fh.read(FINGERPRINT_SPAN))
            if size > FINGERPRINT_SPAN:
                fh.seek(max(size - FINGERPRINT_SPAN, FINGERPRINT_SPAN))
                digest.update(fh.read(FINGERPRINT_SPAN))
    return digest.hexdigest()


class CheckpointTensors:
    """A checkpoint's tensors read one at a time: its index, each shard's header read once on demand (thread-safe,
    for parallel workers), and a clear error for a tensor the index lacks."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.weight_map, _ = read_weight_map(self.path)
        self._headers: dict[str, SafetensorsHeader] = {}
        self._lock = threading.Lock()

    def header(self, shard: str) -> SafetensorsHeader:
        with self._lock:
            if shard not in self._headers:
                self._headers[shard] = read_header(self.path / shard)
            return self._headers[shard]

    def tensor_info(self, name: str) -> TensorInfo:
        """The tensor's dtype, shape and place in its shard.

        Raises:
            CheckpointError: the index names no such tensor.
        """
        shard = self.weight_map.get(name)
        if shard is None:
            raise CheckpointError(f"{self.path / INDEX_NAME}", f"no tensor '{name}' in the index",
                                  "the checkpoint is incomplete; re-download it")
        return self.header(shard).tensors[name]

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, read on its own into its own storage."""
        self.tensor_info(name)
        return read_tensor(self.header(self.weight_map[name]), name)


def copy_other_files(src: Path, dst: Path, skip: set[str]) -> None:
    """Copy every file of checkpoint ``src`` into ``dst`` but those in ``skip`` (paths relative to ``src``) and hidden
    ones: the tokenizer, remote code, chat template, generation config... a converted checkpoint keeps."""
    for path in sorted(Path(src).rglob("*")):
        rel = path.relative_to(src)
        if rel.as_posix() in skip or any(part.startswith(".") for part in rel.parts):
            continue
        target = Path(dst) / rel
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
