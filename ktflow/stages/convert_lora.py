"""The convert-lora stage: turn a training adapter into one SGLang loads, and prove it fits the base.

Adapters that do not fit their base are the classic silent failure of LoRA serving: a key
with the wrong prefix, a module the base does not have, an expert LoRA that was dropped, and
the server starts, answers, and applies nothing. This stage refuses such adapters before
anything is served.

- KT fused path (the input holds ``fused_expert_lora.safetensors``): kt-kernel's own converter
  (``python -m kt_kernel.sft.convert_kt_to_sglang_adapter``) runs in the serving toolchain and
  splits each fused ``[E, ...]`` tensor into per-expert PEFT keys
  ``model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.lora_{A,B}.weight``, merged with the
  non-expert LoRA (``base_model.model.`` and ``.orig_module`` stripped).
- Plain PEFT adapter (no fused file): no conversion; the tensors are copied and
  ``adapter_config.json`` normalized (``base_model_name_or_path`` made absolute).

Before anything runs, ``kt_adapter_manifest.json`` (when present) is checked: status ``ready``
and every listed file's size and sha256. The input is then validated against the base
checkpoint, and the result again, from safetensors headers and the base's index only (no
tensor data is read): every LoRA key names a module of the base, A is ``[r, in]`` and B
``[out, r]`` with ``in``/``out`` from the base weight, every rank equals ``r``,
``lora_alpha`` is positive and ``target_modules`` agrees with the keys.

The result is published atomically with a manifest (stage ``convert-lora``); a second call
with the same adapter files, base and settings is a cache hit.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from ktflow import ENGINE_VERSION
from ktflow.errors import AdapterError, HostRequirementError, InvalidInputError, KtflowError
from ktflow.formats.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_FILES,
    ADAPTER_MODEL,
    FUSED_EXPERT_LORA,
    KT_MANIFEST_VERSION,
    _adapter_config,
    _Base,
    _check_kt_manifest_lora,
    _is_positive_number,
    _require_dir,
    _Summary,
    _validate,
    verify_kt_manifest,
)
from ktflow.formats.checkpoint import checkpoint_digest
from ktflow.host.process import run_tool, tool_versions
from ktflow.resources import CONVERT_LORA_STAGE, DiskNeed, Resources
from ktflow.runner import Job, StageSpec, find_published, run_stage
from ktflow.store import StageManifest, file_sha256

STAGE = CONVERT_LORA_STAGE
KT_KERNEL_SERIES = "0.7"  # the kt-kernel release line whose converter and manifest format ktflow reads
CONVERTER_MODULE = "kt_kernel.sft.convert_kt_to_sglang_adapter"

AdapterKind = Literal["kt-fused", "peft"]


class ConvertLoraResult(BaseModel):
    """What the convert-lora stage produced."""

    path: Path
    kind: AdapterKind
    cached: bool
    tensors: int
    rank: int
    target_modules: list[str]
    manifest_digest: str


# --------------------------------------------------------------------------- the stage


@dataclass(frozen=True)
class ConvertLoraRequest:
    """The convert-lora stage's arguments (see :func:`convert_lora`)."""

    adapter_dir: Path
    out_dir: Path
    base_dir: Path
    serve_python: Path
    lora_alpha: float | None = None
    env: Mapping[str, str] | None = field(default=None, repr=False)  # the toolchain's: may hold credentials
    on_line: Callable[[str], None] | None = None


class ConvertLoraSizes(BaseModel):
    """What the converted adapter's size is a function of."""

    adapter_bytes: int  # the adapter files' bytes
    kind: AdapterKind


def convert_lora_needs(request: ConvertLoraRequest, sizes: ConvertLoraSizes) -> Resources:
    """Disk only: the adapter again (KT fused: twice, the split experts beside the copied rest)."""
    need = sizes.adapter_bytes * (2 if sizes.kind == "kt-fused" else 1)
    return Resources(disk=(DiskNeed(bytes=need, files=4, what="the converted adapter"),))


@dataclass(kw_only=True)
class _Job(Job[ConvertLoraRequest]):
    adapter_dir: Path
    base_dir: Path
    kind: AdapterKind
    base: _Base
    source: _Summary  # the input adapter, validated against the base
    stats: dict[str, tuple[int, int]]  # the adapter files' (size, mtime) before they were hashed
    identity: StageManifest  # inputs, settings and tools: the cache key
    made: _Summary | None = None  # the converted adapter, validated


def _check_paths(adapter_dir: Path, out_dir: Path, base_dir: Path) -> None:
    for a, b in ((out_dir, adapter_dir), (adapter_dir, out_dir), (out_dir, base_dir), (base_dir, out_dir)):
        if a == b or b in a.parents:
            raise InvalidInputError(f"out_dir {out_dir}", f"overlaps {b} (the output must be a separate directory, "
                                                          "neither inside nor around the adapter or the base).",
                                    "choose an output directory elsewhere.")


def _check_alpha(adapter_dir: Path, lora_alpha: float | None) -> None:
    """A given lora_alpha must be a positive number, and may not contradict the trained one."""
    if lora_alpha is not None and not _is_positive_number(lora_alpha):
        raise InvalidInputError("lora_alpha", f"is {lora_alpha!r}; expected a positive number.")
    trained_alpha = _adapter_config(adapter_dir).get("lora_alpha")
    if lora_alpha is not None and _is_positive_number(trained_alpha) and float(trained_alpha) != lora_alpha:
        raise AdapterError(f"{adapter_dir / ADAPTER_CONFIG}: lora_alpha",
                           f"is {trained_alpha!r}, but lora_alpha {lora_alpha:g} was given; the adapter was "
                           "trained with the config's value (and kt-kernel's converter keeps it).",
                           "leave lora_alpha unset, or fix adapter_config.json if it is really wrong.")


def _converter_tools(kind: AdapterKind, serve_python: Path) -> dict[str, str]:
    """The serving toolchain's kt-kernel version (KT fused path only; it runs the converter).

    Raises:
        HostRequirementError: no such python, no kt-kernel in it, or another release line.
    """
    if kind != "kt-fused":
        return {}
    tools = tool_versions(serve_python, ("kt-kernel",)) if serve_python.exists() else {}
    if "kt-kernel" not in tools:
        raise HostRequirementError(
            f"serve_python {serve_python}",
            "is missing or has no kt-kernel; converting a KT fused expert LoRA needs kt-kernel's converter.",
            "run `make serve-env`, or set toolchains.serve.python to the python of the environment with kt-kernel.")
    if tools["kt-kernel"].split("+")[0].split(".")[:2] != KT_KERNEL_SERIES.split("."):
        raise HostRequirementError(
            f"serve_python {serve_python}",
            f"has kt-kernel {tools['kt-kernel']}; the KT fused adapter format (manifest version "
            f"{KT_MANIFEST_VERSION}) and its converter are kt-kernel {KT_KERNEL_SERIES}'s.",
            f"run `make serve-env` (kt-kernel {KT_KERNEL_SERIES}.x, pinned in constraints/serve.txt), or point "
            "toolchains.serve.python at such an environment.")
    return tools


def _prepare(request: ConvertLoraRequest) -> _Job:
    adapter_dir = _require_dir(request.adapter_dir)
    stats = _input_stats(adapter_dir)  # before hashing: any later rewrite is seen
    out_dir, base_dir = Path(request.out_dir).absolute(), Path(request.base_dir).resolve()
    out_dir = out_dir.parent.resolve() / out_dir.name  # the converter compares resolved paths
    hashes = verify_kt_manifest(adapter_dir)  # first: nothing is trusted before this passes
    _check_paths(adapter_dir, out_dir, base_dir)
    kind: AdapterKind = "kt-fused" if (adapter_dir / FUSED_EXPERT_LORA).is_file() else "peft"
    _check_alpha(adapter_dir, request.lora_alpha)
    base = _Base(base_dir)
    source = _validate(adapter_dir, base, alpha_override=request.lora_alpha)
    _check_kt_manifest_lora(adapter_dir, source.rank, source.alpha)
    for name in ADAPTER_FILES:
        if name not in hashes and (adapter_dir / name).is_file():
            hashes[name] = file_sha256(adapter_dir / name)
    identity = StageManifest(
        stage=STAGE,
        inputs={**{f"adapter/{name}": digest for name, digest in sorted(hashes.items())},
                "base": checkpoint_digest(base_dir)},
        settings={"kind": kind, "base_model_name_or_path": str(base_dir), "lora_alpha": request.lora_alpha},
        tools=_converter_tools(kind, Path(request.serve_python).absolute()),
    )
    return _Job(request=request, target=out_dir, adapter_dir=adapter_dir, base_dir=base_dir, kind=kind, base=base,
                source=source, stats=stats, identity=identity)


def _lookup(job: _Job) -> ConvertLoraResult | None:
    wanted = job.identity
    existing = find_published(job.target, STAGE, inputs=wanted.inputs, settings=wanted.settings, tools=wanted.tools,
                              intact=True)
    if existing is None or existing.engine_version != ENGINE_VERSION:
        return None
    return ConvertLoraResult(path=job.target, kind=job.kind, cached=True, tensors=existing.extra["tensors"],
                             rank=existing.extra["rank"], target_modules=existing.extra["target_modules"],
                             manifest_digest=existing.digest())


def _measure(job: _Job, resumed: Path | None) -> ConvertLoraSizes:
    return ConvertLoraSizes(adapter_bytes=sum(size for size, _ in job.stats.values()), kind=job.kind)


def _input_stats(adapter_dir: Path) -> dict[str, tuple[int, int]]:
    """``{file: (size, mtime_ns)}`` of the adapter files present: what a rewrite changes."""
    out = {}
    for name in ADAPTER_FILES:
        try:
            st = (adapter_dir / name).stat()
        except FileNotFoundError:
            continue
        out[name] = (st.st_size, st.st_mtime_ns)
    return out


def _work(job: _Job, staging: Path) -> None:
    request = job.request
    if job.kind == "kt-fused":
        _run_converter(job.adapter_dir, staging, job.base_dir, Path(request.serve_python).absolute(),
                       request.lora_alpha, request.env, request.on_line)
    else:
        _publish_peft(job.adapter_dir, staging, job.base_dir, request.lora_alpha)


def _run_converter(
    adapter_dir: Path, staging: Path, base_dir: Path, serve_python: Path, lora_alpha: float | None,
    env: Mapping[str, str] | None, on_line: Callable[[str], None] | None,
) -> None:
    argv = [str(serve_python), "-m", CONVERTER_MODULE, str(adapter_dir), str(staging),
            "--base-model-name-or-path", str(base_dir)]
    if lora_alpha is not None:
        argv += ["--lora-alpha", repr(float(lora_alpha))]
    run_tool(argv, env={**os.environ, **env} if env else None, on_line=on_line)


def _publish_peft(adapter_dir: Path, staging: Path, base_dir: Path, lora_alpha: float | None) -> None:
    staging.mkdir(parents=True, exist_ok=True)
    shutil.copy2(adapter_dir / ADAPTER_MODEL, staging / ADAPTER_MODEL)
    config = _adapter_config(adapter_dir)
    config["base_model_name_or_path"] = str(base_dir)
    if config.get("lora_alpha") is None and lora_alpha is not None:
        config["lora_alpha"] = lora_alpha
    (staging / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _verify(job: _Job, staging: Path) -> None:
    job.made = _check_result(staging, job.base, job.base_dir, job.source, job.kind)
    if _input_stats(job.adapter_dir) != job.stats:
        raise KtflowError(f"{job.adapter_dir}: adapter files changed while being converted ({sorted(job.stats)}); "
                          "nothing was published. Rerun once the training output is stable.")


def _check_result(staging: Path, base: _Base, base_dir: Path, source: _Summary, kind: AdapterKind) -> _Summary:
    result = _validate(staging, base)
    config = _adapter_config(staging)
    if config.get("base_model_name_or_path") != str(base_dir):
        raise KtflowError(f"the converted adapter_config.json names base {config.get('base_model_name_or_path')!r}, "
                          f"not {str(base_dir)!r}")
    if (result.rank, result.alpha) != (source.rank, source.alpha):
        raise KtflowError(f"the converted adapter has r={result.rank}, lora_alpha={result.alpha:g}; the input has "
                          f"r={source.rank}, lora_alpha={source.alpha:g}")
    if result.keys != source.keys:  # the field failure: expert (or other) LoRA silently dropped or renamed
        missing, extra = sorted(source.keys - result.keys), sorted(result.keys - source.keys)
        raise KtflowError(f"the converted adapter ({kind}) does not hold exactly the input's LoRA tensors: "
                          f"{len(missing)} missing (e.g. {missing[:3]}), {len(extra)} unexpected (e.g. {extra[:3]})")
    return result


def _manifest(job: _Job) -> StageManifest:
    made = job.made
    assert made is not None
    return job.identity.model_copy(update={"extra": {
        "tensors": made.tensors, "rank": made.rank, "lora_alpha": made.alpha,
        "target_modules": made.target_modules, "source": str(job.adapter_dir),
    }})


def _result(job: _Job, manifest: StageManifest) -> ConvertLoraResult:
    made = job.made
    assert made is not None
    return ConvertLoraResult(path=job.target, kind=job.kind, cached=False, tensors=made.tensors, rank=made.rank,
                             target_modules=made.target_modules, manifest_digest=manifest.digest())


CONVERT_LORA: StageSpec[ConvertLoraRequest, _Job, ConvertLoraSizes, ConvertLoraResult] = StageSpec(
    name=STAGE, prepare=_prepare, lookup=_lookup, measure=_measure, needs=convert_lora_needs,
    work=_work, verify=_verify, manifest=_manifest, result=_result,
    discard_on=(BaseException,),  # small and quick: a failed attempt leaves nothing to resume
)
"""The convert-lora stage, declared for :func:`~ktflow.runner.run_stage` (and a planner)."""


def convert_lora(
    adapter_dir: Path,
    out_dir: Path,
    *,
    base_dir: Path,
    serve_python: Path,
    lora_alpha: float | None = None,
    env: Mapping[str, str] | None = None,
    on_line: Callable[[str], None] | None = None,
) -> ConvertLoraResult:
    """Make ``adapter_dir`` servable by SGLang against ``base_dir`` and publish it as ``out_dir``.

    Args:
        adapter_dir: LlamaFactory's output_dir, a ``checkpoint-N`` or the SFT stage's adapter.
        out_dir: where the converted adapter is published (atomically, with ``manifest.json``).
        base_dir: the base checkpoint the adapter will be served on (written, absolute, into
            ``adapter_config.json``; every LoRA key is checked against its index and headers).
        serve_python: the serving toolchain's python (has kt-kernel; runs the KT converter).
        lora_alpha: only for an adapter_config.json without ``lora_alpha``; a different value
            than the config's is refused (kt-kernel's converter would ignore it silently).
        env: extra environment variables for the converter (the toolchain's ``env``).
        on_line: called with each output line of the converter.

    Raises:
        AdapterError: a tampered/unfinished KT manifest, or an adapter that does not fit the base.
        HostRequirementError: the serving toolchain (kt-kernel) is missing (KT fused path); too
            little free disk or an unwritable OUT_DIR (before any work).
        StorageError: the disk filled up (or became read-only) mid-run; nothing published.
        KtflowError: an adapter file changed while it was being converted; nothing published.
        ToolError: kt-kernel's converter failed.

    Concurrent runs onto one ``out_dir`` are serialized (:func:`~ktflow.store.artifact_lock`):
    the second waits, then finds the artifact published (a cache hit).
    """
    request = ConvertLoraRequest(adapter_dir=Path(adapter_dir), out_dir=Path(out_dir), base_dir=Path(base_dir),
                                 serve_python=Path(serve_python), lora_alpha=lora_alpha, env=env, on_line=on_line)
    return run_stage(CONVERT_LORA, request)
