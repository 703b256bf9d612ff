"""The LoRA adapter format: what an adapter directory holds (LlamaFactory/PEFT's files, KT's fused expert LoRA
and its manifest), how an expert LoRA is told from the rest, and an adapter checked against its base checkpoint
and its KT manifest, from headers only.

What the convert-lora stage proves before and after converting, and what serving checks before it
loads an adapter: ``kt_adapter_manifest.json`` (status ``ready``, every listed file's size and
sha256), then every LoRA key against the base checkpoint's index and safetensors headers (no tensor
data is read): the module exists in the base, A is ``[r, in]`` and B ``[out, r]``, every rank equals
``r``, ``lora_alpha`` is positive and ``target_modules`` agrees with the keys.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ktflow.errors import AdapterError, CheckpointError
from ktflow.formats.checkpoint import inspect_checkpoint, read_weight_map
from ktflow.formats.safetensors_io import SafetensorsHeader, read_header
from ktflow.store import file_sha256

ADAPTER_MODEL = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
FUSED_EXPERT_LORA = "fused_expert_lora.safetensors"
KT_MANIFEST = "kt_adapter_manifest.json"
KT_MANIFEST_VERSION = 1  # kt-kernel 0.7's artifacts.KT_ADAPTER_MANIFEST_VERSION
PEFT_PREFIX = "base_model.model."
KT_WRAPPER = ".orig_module"  # KTransformers' wrapper modules; kt-kernel's converter strips it
NESTED_PREFIX = "language_model."  # Kimi-K2.5 keeps the text model under it
ADAPTER_FILES = (ADAPTER_MODEL, ADAPTER_CONFIG, FUSED_EXPERT_LORA, KT_MANIFEST)
"""Every file an adapter directory may hold: SFT publishes these, convert-lora reads and writes them."""
_EXPERT_PROJECTIONS = (".gate_proj.", ".up_proj.", ".down_proj.")

# kt-kernel's fused key names: name -> (projection, lora matrix)
_FUSED_NAMES: dict[str, tuple[str, str]] = {
    "gate_lora_a": ("gate_proj", "lora_A"), "gate_lora_b": ("gate_proj", "lora_B"),
    "up_lora_a": ("up_proj", "lora_A"), "up_lora_b": ("up_proj", "lora_B"),
    "down_lora_a": ("down_proj", "lora_A"), "down_lora_b": ("down_proj", "lora_B"),
}
_FUSED_KEY = re.compile(r"^layers\.(\d+)\.experts\.([a-z_]+)$")
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<matrix>lora_A|lora_B)\.weight$")
_EMBEDDING_KEY = re.compile(r"^(?P<module>.+)\.(?P<matrix>lora_embedding_A|lora_embedding_B)$")
_FLOAT_DTYPES = ("F32", "BF16", "F16")
_PACK_FACTOR = {"I32": 8}  # compressed-tensors pack-quantized INT4: 8 values per int32 along `in`


# --------------------------------------------------------------------------- helpers


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise AdapterError(str(path), f"cannot be read as JSON: {e}",
                           "restore the file from the training output.") from None
    if not isinstance(doc, dict):
        raise AdapterError(str(path), f"is a JSON {type(doc).__name__}, not an object.",
                           "restore the file from the training output.")
    return doc


def _is_positive_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def _adapter_header(path: Path) -> SafetensorsHeader:
    """An adapter file's safetensors header; a damaged file is the adapter's problem, not the base's."""
    try:
        return read_header(path)
    except CheckpointError as e:
        raise AdapterError(e.subject, e.reason, "copy the adapter again from the training output.") from None


def _shape(shape: tuple[int, ...] | list[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# --------------------------------------------------------------------------- KT manifest


def verify_kt_manifest(adapter_dir: Path) -> dict[str, str]:
    """Check ``kt_adapter_manifest.json`` and every file it lists; return ``{file: sha256}``.

    Returns an empty mapping when the directory has no manifest and no fused expert LoRA
    (a plain PEFT adapter).

    Raises:
        AdapterError: the manifest is not ``ready``, is malformed, lists a file that is missing
            or differs (size or sha256) from what was written, or leaves an adapter file out;
            or a fused expert LoRA has no manifest (kt-kernel deletes it before rewriting the
            files and writes it last, so its absence means an unfinished save).
    """
    adapter_dir = Path(adapter_dir)
    path = adapter_dir / KT_MANIFEST
    if not path.exists():
        if (adapter_dir / FUSED_EXPERT_LORA).exists():
            raise AdapterError(
                str(path), f"is missing, but {FUSED_EXPERT_LORA} is there: kt-kernel removes the manifest before "
                           "rewriting an adapter and writes it last, so this save never finished (or the manifest "
                           "was not copied).",
                "use a checkpoint-N whose kt_adapter_manifest.json exists, or copy the manifest along with the "
                "adapter files.")
        return {}
    artifacts = _manifest_artifacts(adapter_dir, path)
    return {name: _verify_listed_file(adapter_dir, path, name, record) for name, record in sorted(artifacts.items())}


_UNFINISHED_SAVE_FIX = "use the last complete checkpoint-N, or re-save the adapter from training."


def _manifest_artifacts(adapter_dir: Path, path: Path) -> dict[str, Any]:
    """The manifest's ``artifacts``, once its version and status are right and it lists every adapter file."""
    manifest = _read_json_object(path)
    fix = _UNFINISHED_SAVE_FIX
    if manifest.get("version") != KT_MANIFEST_VERSION:
        raise AdapterError(f"{path}: version", f"is {manifest.get('version')!r}; ktflow reads version "
                                               f"{KT_MANIFEST_VERSION} (kt-kernel 0.7).",
                           "convert with the kt-kernel release that trained the adapter.")
    if manifest.get("status") != "ready":
        raise AdapterError(f"{path}: status", f"is {manifest.get('status')!r}, not 'ready': the adapter save did "
                                              "not finish.", fix)
    artifacts = manifest.get("artifacts")
    if not isinstance(artifacts, dict) or not artifacts:
        raise AdapterError(f"{path}: artifacts", "is missing or empty; it must list every adapter file.", fix)
    for name in (ADAPTER_CONFIG, ADAPTER_MODEL, FUSED_EXPERT_LORA):
        if (adapter_dir / name).exists() and name not in artifacts:
            raise AdapterError(f"{path}: artifacts", f"does not list {name}, which is in the directory: it cannot "
                                                     "be verified (it was written after the manifest).", fix)
    return artifacts


def _verify_listed_file(adapter_dir: Path, path: Path, name: Any, record: Any) -> str:
    """The sha256 of one file the manifest lists, once its size and hash are the listed ones."""
    if not isinstance(name, str) or name != os.path.basename(name) or name in ("", ".", ".."):
        raise AdapterError(f"{path}: artifacts", f"names {name!r}, which is not a plain file name.",
                           _UNFINISHED_SAVE_FIX)
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
        raise AdapterError(f"{path}: artifacts.{name}", "has no sha256.", _UNFINISHED_SAVE_FIX)
    file = adapter_dir / name
    if file.is_symlink() or not file.is_file():
        raise AdapterError(str(file), f"is listed in {KT_MANIFEST} but missing from the adapter directory.",
                           "copy the whole adapter directory (every file the manifest lists).")
    size = file.stat().st_size
    if record.get("size") != size:
        raise AdapterError(str(file), f"is {size} bytes, but {KT_MANIFEST} says {record.get('size')}: the file "
                                      "was changed or truncated after the adapter was saved.",
                           "copy the file again from the training output.")
    digest = file_sha256(file)
    if digest != record["sha256"]:
        raise AdapterError(str(file), f"has sha256 {digest}, but {KT_MANIFEST} says {record['sha256']}: the file "
                                      "was changed after the adapter was saved (tampered or corrupted).",
                           "copy the file again from the training output.")
    return digest


# --------------------------------------------------------------------------- base checkpoint


class _Base:
    """The base checkpoint's weight shapes, from its index and shard headers (no tensor data)."""

    def __init__(self, base_dir: Path) -> None:
        self.path = Path(base_dir)
        info = inspect_checkpoint(self.path)  # raises CheckpointError for a broken base
        self.prefix = info.tensor_prefix
        self.weight_map, _ = read_weight_map(self.path)
        self._headers: dict[str, SafetensorsHeader] = {}

    def _info(self, name: str):  # noqa: ANN202 - TensorInfo | None
        shard = self.weight_map.get(name)
        if shard is None:
            return None
        if shard not in self._headers:
            self._headers[shard] = read_header(self.path / shard)
        return self._headers[shard].tensors.get(name)

    def candidates(self, module: str) -> list[str]:
        """Base module names an adapter module may mean (Kimi-K2.5's ``language_model.`` either way)."""
        names = [module]
        if self.prefix and not module.startswith(self.prefix):
            names.append(self.prefix + module)
        if not self.prefix and module.startswith(NESTED_PREFIX):
            names.append(module[len(NESTED_PREFIX):])
        return names

    def weight(self, module: str) -> tuple[str, tuple[int, ...]] | None:
        """``(base tensor name, logical weight shape)`` of ``module``, or None if the base has none."""
        for candidate in self.candidates(module):
            info = self._info(f"{candidate}.weight")
            if info is not None:
                return info.name, info.shape
            packed = self._info(f"{candidate}.weight_packed")
            if packed is not None and len(packed.shape) == 2 and packed.dtype in _PACK_FACTOR:
                return packed.name, (packed.shape[0], packed.shape[1] * _PACK_FACTOR[packed.dtype])
        return None

    def experts_in_layer(self, layer: int, proj: str) -> int:
        """How many routed experts layer ``layer`` has (0 for a dense layer)."""
        count = 0
        while self.weight(f"model.layers.{layer}.mlp.experts.{count}.{proj}") is not None:
            count += 1
        return count


# --------------------------------------------------------------------------- adapter validation


@dataclass
class _LoraModule:
    module: str  # as the adapter names it, e.g. model.layers.1.self_attn.q_a_proj
    embedding: bool = False
    a: tuple[str, tuple[int, ...]] | None = None  # (key, shape)
    b: tuple[str, tuple[int, ...]] | None = None
    file: str = ADAPTER_MODEL


@dataclass
class _Summary:
    rank: int
    alpha: float
    target_modules: list[str]
    tensors: int
    keys: set[str] = field(default_factory=set)  # keys as SGLang will see them after conversion


def _adapter_config(adapter_dir: Path) -> dict[str, Any]:
    path = adapter_dir / ADAPTER_CONFIG
    if not path.is_file():
        raise AdapterError(str(path), "is missing; SGLang needs it (r, lora_alpha, target_modules).",
                           "point at the directory LlamaFactory saved the adapter in (it writes adapter_config.json).")
    return _read_json_object(path)


def _check_config(config: dict[str, Any], where: Path, *, alpha_override: float | None) -> tuple[int, float]:
    """``(r, lora_alpha)`` of an adapter config, refusing what SGLang would apply differently."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{where}: peft_type", f"is {peft_type!r}; SGLang serves LoRA adapters only.",
                           "train with finetuning_type: lora.")
    for flag, why in (("use_dora", "DoRA's magnitude vectors"), ("use_rslora", "rsLoRA's lora_alpha/sqrt(r) scaling")):
        if config.get(flag):
            raise AdapterError(f"{where}: {flag}", f"is true; SGLang does not apply {why} (it scales every LoRA by "
                                                   "lora_alpha/r), so the served model would silently differ.",
                               f"retrain with {flag}: false.")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if config.get(pattern):
            raise AdapterError(f"{where}: {pattern}", f"is {config[pattern]!r:.200}; SGLang uses one r and one "
                                                      "lora_alpha for the whole adapter.",
                               f"retrain without {pattern}.")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"{where}: r", f"is {rank!r}; expected a positive integer (the LoRA rank).",
                           "restore adapter_config.json from the training output.")
    alpha = config.get("lora_alpha")
    if alpha is None:
        alpha = alpha_override
    if alpha is None or not _is_positive_number(alpha):
        raise AdapterError(f"{where}: lora_alpha", f"is {alpha!r}; expected a positive number (the LoRA scale is "
                                                   "lora_alpha / r, so without it the server applies the wrong scale).",
                           "restore adapter_config.json, or pass the training run's lora_alpha.")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as e:
            raise AdapterError(f"{where}: target_modules", f"is the pattern {targets!r}, which is not a valid "
                                                           f"regular expression: {e}.") from None
    elif not (isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets)):
        raise AdapterError(f"{where}: target_modules", f"is {targets!r:.200}; expected a non-empty list of module "
                                                       "names (SGLang decides which layers get LoRA from it).",
                           "restore adapter_config.json from the training output.")
    return rank, float(alpha)


def _matches(module: str, targets: str | list[str]) -> bool:
    """PEFT's rule: a list entry matches a module named so or ending in ``.name``; a string is a regex."""
    if isinstance(targets, str):
        return targets == "all-linear" or re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def _peft_modules(path: Path, *, strip_kt_wrapper: bool) -> tuple[dict[str, _LoraModule], int]:
    """The LoRA modules of a PEFT/SGLang ``adapter_model.safetensors`` and its tensor count."""
    header = _adapter_header(path)
    modules: dict[str, _LoraModule] = {}
    for key, info in header.tensors.items():
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        if strip_kt_wrapper:
            name = name.replace(KT_WRAPPER, "")
        match = _LORA_KEY.match(name) or _EMBEDDING_KEY.match(name)
        subject = f"{path}: tensor '{key}'"
        if match is None:
            raise AdapterError(subject, "is not a LoRA weight SGLang loads (expected '<module>.lora_A.weight', "
                                        "'<module>.lora_B.weight' or an embedding's lora_embedding_A/B); SGLang would "
                                        "ignore it (modules_to_save, lora bias, DoRA magnitudes are not served).",
                               "retrain without modules_to_save / lora_bias / use_dora, or serve with a backend that "
                               "merges the adapter.")
        if info.dtype not in _FLOAT_DTYPES or len(info.shape) != 2:
            raise AdapterError(subject, f"is {info.dtype} {_shape(info.shape)}; a LoRA matrix is a 2-D "
                                        f"{'/'.join(_FLOAT_DTYPES)} tensor.", "re-save the adapter from training.")
        module = match.group("module")
        entry = modules.setdefault(module, _LoraModule(module, embedding=match.group("matrix").startswith("lora_emb")))
        slot = "a" if match.group("matrix").endswith("A") else "b"
        if getattr(entry, slot) is not None:
            raise AdapterError(subject, f"names the same module as '{getattr(entry, slot)[0]}' once the prefixes "
                                        f"'{PEFT_PREFIX}' and '{KT_WRAPPER}' are removed; SGLang would keep only one.",
                               "re-save the adapter from training.")
        setattr(entry, slot, (key, info.shape))
    return modules, len(header.tensors)


def _check_module(entry: _LoraModule, base: _Base, rank: int, adapter_dir: Path) -> None:
    for slot, missing in (("a", "lora_A"), ("b", "lora_B")):
        if getattr(entry, slot) is None:
            key = (entry.b if slot == "a" else entry.a)[0]
            raise AdapterError(f"{adapter_dir / entry.file}: tensor '{key}'",
                               f"has no matching {missing}; a LoRA needs both matrices.", "re-save the adapter.")
    assert entry.a is not None and entry.b is not None
    found = base.weight(entry.module)
    if found is None:
        hint = ""
        if KT_WRAPPER.strip(".") in entry.module:
            hint = (f" It still contains KTransformers' wrapper name '{KT_WRAPPER}', which SGLang does not strip "
                    "(kt-kernel's converter does, on the KT fused path).")
        raise AdapterError(
            f"{adapter_dir / entry.file}: tensor '{entry.a[0]}'",
            f"is LoRA for module '{entry.module}', which the base checkpoint {base.path} does not have (looked for "
            f"{' or '.join(repr(c + '.weight') for c in base.candidates(entry.module))}); SGLang would silently skip "
            f"it.{hint}",
            "check that the adapter was trained on this base model (same architecture and naming).")
    base_name, weight_shape = found
    if len(weight_shape) != 2:
        raise AdapterError(f"{adapter_dir / entry.file}: tensor '{entry.a[0]}'",
                           f"is LoRA for '{entry.module}', but the base tensor '{base_name}' is "
                           f"{_shape(weight_shape)}, not a 2-D linear or embedding weight.",
                           "check that the adapter was trained on this base model.")
    if entry.embedding:  # nn.Embedding: weight [num, dim]; A [r, num], B [dim, r]
        dim_in, dim_out = weight_shape[0], weight_shape[1]
    else:  # nn.Linear: weight [out, in]; A [r, in], B [out, r]
        dim_out, dim_in = weight_shape
    for (key, shape), expected, label in ((entry.a, (rank, dim_in), "A"), (entry.b, (dim_out, rank), "B")):
        if tuple(shape) == expected:
            continue
        rank_dim = 0 if label == "A" else 1
        other_dim = 1 - rank_dim
        if shape[other_dim] == expected[other_dim]:
            reason = (f"has shape {_shape(shape)}: rank {shape[rank_dim]}, but adapter_config.json says r={rank} "
                      f"(lora_{label} must be {_shape(expected)} for base '{base_name}' {_shape(weight_shape)}).")
        else:
            reason = (f"has shape {_shape(shape)}, but the base weight '{base_name}' is {_shape(weight_shape)}, so "
                      f"lora_{label} must be {_shape(expected)} (A is [r, in], B is [out, r]).")
        raise AdapterError(f"{adapter_dir / entry.file}: tensor '{key}'", reason,
                           "check that the adapter was trained on this base model, with the rank in "
                           "adapter_config.json.")


def _fused_modules(path: Path, base: _Base, rank: int) -> tuple[list[str], set[str]]:
    """Validate kt-kernel's fused expert LoRA; return its projection names and the per-expert keys it becomes."""
    header = _adapter_header(path)
    out_keys: set[str] = set()
    projections: set[str] = set()
    for key, info in sorted(header.tensors.items()):
        subject = f"{path}: tensor '{key}'"
        match = _FUSED_KEY.match(key)
        if match is None or match.group(2) not in _FUSED_NAMES:
            raise AdapterError(subject, "is not a kt-kernel fused expert LoRA tensor (expected "
                                        "'layers.{L}.experts.{gate,up,down}_lora_{a,b}').",
                               "re-save the adapter from KT training.")
        layer = int(match.group(1))
        proj, matrix = _FUSED_NAMES[match.group(2)]
        if len(info.shape) != 3 or info.dtype not in _FLOAT_DTYPES:
            raise AdapterError(subject, f"is {info.dtype} {_shape(info.shape)}; expected a 3-D [E, ...] float tensor.",
                               "re-save the adapter from KT training.")
        num_experts = info.shape[0]
        base_experts = base.experts_in_layer(layer, proj)
        if base_experts == 0:
            raise AdapterError(subject, f"is expert LoRA for layer {layer}, but the base checkpoint {base.path} has no "
                                        f"routed experts 'model.layers.{layer}.mlp.experts.*.{proj}' there (dense "
                                        "layer or no such layer).",
                               "check that the adapter was trained on this base model.")
        if num_experts != base_experts:
            raise AdapterError(subject, f"has {num_experts} experts (shape {_shape(info.shape)}), but layer {layer} "
                                        f"of the base has {base_experts}.",
                               "check that the adapter was trained on this base model.")
        found = base.weight(f"model.layers.{layer}.mlp.experts.0.{proj}")
        assert found is not None
        base_name, (dim_out, dim_in) = found[0], found[1]
        expected = (num_experts, rank, dim_in) if matrix == "lora_A" else (num_experts, dim_out, rank)
        if tuple(info.shape) != expected:
            rank_dim = 1 if matrix == "lora_A" else 2
            if info.shape[rank_dim] != rank and all(info.shape[d] == expected[d] for d in range(3) if d != rank_dim):
                reason = (f"has shape {_shape(info.shape)}: rank {info.shape[rank_dim]}, but adapter_config.json "
                          f"says r={rank} (must be {_shape(expected)}).")
            else:
                reason = (f"has shape {_shape(info.shape)}, but the base expert weight '{base_name}' is "
                          f"{_shape((dim_out, dim_in))}, so it must be {_shape(expected)} "
                          "(A is [E, r, in], B is [E, out, r]).")
            raise AdapterError(subject, reason, "check that the adapter was trained on this base model.")
        projections.add(proj)
        out_keys.update(f"model.layers.{layer}.mlp.experts.{e}.{proj}.{matrix}.weight" for e in range(num_experts))
    if not header.tensors:
        raise AdapterError(str(path), "holds no tensors.", "re-save the adapter from KT training.")
    return sorted(projections), out_keys


def _validate(adapter_dir: Path, base: _Base, *, alpha_override: float | None = None) -> _Summary:
    """Validate an adapter directory (training output or converted) against the base."""
    config = _adapter_config(adapter_dir)
    rank, alpha = _check_config(config, adapter_dir / ADAPTER_CONFIG, alpha_override=alpha_override)
    targets: str | list[str] = config["target_modules"]
    fused = adapter_dir / FUSED_EXPERT_LORA
    kt_input = fused.is_file()
    model_path = adapter_dir / ADAPTER_MODEL
    if not model_path.is_file() and not kt_input:
        other = "adapter_model.bin is there, but ktflow reads safetensors only" if (
            adapter_dir / "adapter_model.bin").exists() else "it is missing"
        raise AdapterError(str(model_path), f"{other}.", "save the adapter with safe_serialization (the default).")

    modules, count = _peft_modules(model_path, strip_kt_wrapper=kt_input) if model_path.is_file() else ({}, 0)
    keys: set[str] = set()
    for entry in modules.values():
        _check_module(entry, base, rank, adapter_dir)
        assert entry.a is not None and entry.b is not None
        for key, _ in (entry.a, entry.b):
            keys.add(key.removeprefix(PEFT_PREFIX).replace(KT_WRAPPER, "") if kt_input else key)
        if not _matches(entry.module, targets):
            raise AdapterError(f"{adapter_dir / ADAPTER_CONFIG}: target_modules",
                               f"is {targets!r:.300}, which does not cover module '{entry.module}' (tensor "
                               f"'{entry.a[0]}'); SGLang sizes its LoRA buffers from target_modules and would skip it.",
                               "restore adapter_config.json from the training output.")
    covered = [entry.module for entry in modules.values()]
    fused_projections: list[str] = []
    if kt_input:
        fused_projections, expert_keys = _fused_modules(fused, base, rank)
        keys |= expert_keys
        count += len(expert_keys)
        covered += fused_projections
    if not keys:
        raise AdapterError(str(adapter_dir), "holds no LoRA tensors.", "re-save the adapter from training.")
    if isinstance(targets, list):
        for target in targets:
            if not any(module == target or module.endswith("." + target) for module in covered):
                raise AdapterError(f"{adapter_dir / ADAPTER_CONFIG}: target_modules",
                                   f"lists '{target}', but no LoRA tensor is for a module of that name; the adapter "
                                   "and its config do not belong together.",
                                   "restore adapter_config.json and the weights from the same training output.")
        target_list = list(targets) + [p for p in fused_projections if p not in targets]
    else:
        target_list = sorted({m.rsplit(".", 1)[-1] for m in covered})
    return _Summary(rank=rank, alpha=alpha, target_modules=target_list, tensors=count, keys=keys)


def _check_kt_manifest_lora(adapter_dir: Path, rank: int, alpha: float) -> None:
    path = adapter_dir / KT_MANIFEST
    if not path.is_file():
        return
    lora = _read_json_object(path).get("lora")
    if not isinstance(lora, dict):
        return
    if lora.get("rank") is not None and lora.get("rank") != rank:
        raise AdapterError(f"{path}: lora.rank", f"is {lora.get('rank')!r}, but adapter_config.json says r={rank}.",
                           "restore adapter_config.json from the same training output.")
    if lora.get("alpha") is not None and (not _is_positive_number(lora["alpha"]) or float(lora["alpha"]) != alpha):
        raise AdapterError(f"{path}: lora.alpha", f"is {lora.get('alpha')!r}, but adapter_config.json says "
                                                  f"lora_alpha={alpha:g}.",
                           "restore adapter_config.json from the same training output.")


def _require_dir(adapter_dir: Path) -> Path:
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise AdapterError(str(adapter_dir), "is not a directory." if adapter_dir.exists() else "does not exist.",
                           "pass the adapter directory (LlamaFactory's output_dir, a checkpoint-N or the SFT "
                           "stage's adapter).")
    adapter_dir = adapter_dir.resolve()
    _refuse_links_out(adapter_dir)
    return adapter_dir


def _refuse_links_out(adapter_dir: Path) -> None:
    """Refuse an adapter file that is a symbolic link leading out of the adapter directory.

    The files are read, hashed and copied into the store (and served): a link would make ktflow
    publish whatever it points at (another user's file, a secret) as part of an adapter.
    """
    for name in ADAPTER_FILES:
        path = adapter_dir / name
        if not path.is_symlink():
            continue
        target = Path(os.path.realpath(path))
        if adapter_dir not in target.parents:
            raise AdapterError(str(path), f"is a symbolic link to {target}, outside the adapter directory; ktflow "
                                          "does not follow links out of an adapter.",
                               "copy the real file into the adapter directory instead of linking it.")


def validate_adapter(adapter_dir: Path, base_dir: Path) -> tuple[int, list[str]]:
    """Validate an adapter against its base checkpoint; return ``(rank, target_modules)``.

    Works on a training output (PEFT, or KT fused with ``fused_expert_lora.safetensors``, whose
    ``kt_adapter_manifest.json`` is verified first) and on a converted adapter. Reads
    safetensors headers and the base's index only.

    Raises:
        AdapterError: naming the file, key or config field, and both shapes where they differ.
        CheckpointError: the base checkpoint itself is broken.
    """
    adapter_dir = _require_dir(adapter_dir)
    verify_kt_manifest(adapter_dir)
    summary = _validate(adapter_dir, _Base(base_dir))
    _check_kt_manifest_lora(adapter_dir, summary.rank, summary.alpha)
    return summary.rank, summary.target_modules


# --------------------------------------------------------------------------- what serving reads


def is_expert_lora_key(name: str) -> bool:
    """Whether a converted adapter's tensor ``name`` belongs to a routed expert's gate/up/down projection
    (``...mlp.experts.E.gate_proj.lora_A.weight``), as sglang-kt tells the expert LoRA from the rest."""
    return ".mlp.experts." in name and any(p in name for p in _EXPERT_PROJECTIONS)


def has_expert_lora(adapter_dir: Path) -> bool:
    """Whether the converted adapter carries an expert LoRA (sglang-kt then serves the experts through
    kt-kernel's SFT kernels). An adapter whose weights cannot be read says no: the server's own loader
    names what is wrong with it."""
    weights = Path(adapter_dir) / ADAPTER_MODEL
    if not weights.is_file() or weights.stat().st_size == 0:
        return False
    try:
        names = read_header(weights).tensors
    except CheckpointError:
        return False
    return any(is_expert_lora_key(n) for n in names)


def check_servable_adapter(adapter_dir: Path, base_dir: Path | None = None) -> Path:
    """The absolute ``adapter_dir`` if a server can load it: a PEFT adapter (``adapter_config.json`` and
    ``adapter_model.safetensors``), not KT's raw training output (``fused_expert_lora.safetensors``, which no
    server reads: convert-lora makes it servable). With ``base_dir``, also validated against that base
    (:func:`validate_adapter`, headers only).

    Raises:
        AdapterError: the directory is missing, a raw KT training adapter, not a LoRA adapter, or does not fit
            ``base_dir``.
    """
    adapter_dir = Path(adapter_dir).absolute()
    if not adapter_dir.is_dir():
        raise AdapterError(f"adapter_dir {adapter_dir}", "does not exist." if not adapter_dir.exists()
                           else "is not a directory.", "pass the convert-lora stage's output")
    if (adapter_dir / FUSED_EXPERT_LORA).exists():
        raise AdapterError(
            f"adapter_dir {adapter_dir}", f"is a raw KT training adapter ({FUSED_EXPERT_LORA}); no server loads it.",
            "convert it first (`ktflow convert-lora`) and serve the converted directory",
        )
    if base_dir is not None:
        validate_adapter(adapter_dir, base_dir)
        return adapter_dir
    missing = [n for n in (ADAPTER_CONFIG, ADAPTER_MODEL) if not (adapter_dir / n).is_file()]
    if missing:
        raise AdapterError(f"adapter_dir {adapter_dir}", f"has no {' and no '.join(missing)}; it is not a LoRA "
                           "adapter.", "pass the convert-lora stage's output")
    return adapter_dir
