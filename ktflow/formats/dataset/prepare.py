"""The prepared copy: its digest (the SFT stage's cache key), its ``dataset_info.json`` entry, the
model's chat template for template ``empty``, and the normalized records published in place."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ktflow.errors import DatasetError
from ktflow.formats.dataset._common import (
    _EMPTY_TEMPLATE_COLUMNS,
    _OPENAI_ENTRY_COLUMNS,
    DATASET_INFO,
    LAYOUT_VERSION,
    OPENAI_TAGS,
    SOURCE_COLUMNS,
    STAGE_NAME,
    BadRecord,
    _Bad,
    _Normalized,
    _sharegpt_tags,
    _source_columns,
)
from ktflow.formats.dataset.reader import _bad_records_error, _check_config, _normalized_records
from ktflow.recipe import DatasetConfig
from ktflow.store import StageManifest, file_sha256, publish_dir, read_manifest, staging_dir_for


class PreparedDataset(BaseModel):
    """A dataset directory LlamaFactory reads as ``dataset: name``, ``dataset_dir: dataset_dir``."""

    dataset_dir: Path
    name: str
    records: int
    digest: str
    entry: dict[str, Any]
    reused: bool = False


def dataset_digest(cfg: DatasetConfig, *, template: str, model_dir: Path | None = None) -> str:
    """The digest :func:`prepare_dataset` would give, without parsing or writing anything.

    sha256 over the layout version, each source file's sha256 (streamed), the
    ``dataset_info.json`` entry, the template name, ``images_dir`` and, for template
    ``empty``, the model's chat template files: the SFT stage's cache key for its data.
    """
    _check_config(cfg)
    return _digest(cfg, template, model_dir, _file_hashes(cfg))[0]


def prepare_dataset(
    cfg: DatasetConfig, out_dir: Path, *, template: str, model_dir: Path | None = None
) -> PreparedDataset:
    """Validate ``cfg``'s data and publish the normalized copy + ``dataset_info.json`` in ``out_dir``.

    Written in a staging directory beside ``out_dir`` and renamed into place, so ``out_dir``
    is complete or absent. An ``out_dir`` prepared before with the same digest is reused as is.

    Args:
        cfg: the recipe's dataset section.
        out_dir: the directory to publish (the SFT stage's ``dataset_dir``).
        template: the LlamaFactory template the SFT stage trains with. ``empty`` renders each
            conversation with the model's own chat template here instead.
        model_dir: the model (its tokenizer and chat template); required for template ``empty``.

    Raises:
        DatasetError: bad records (nothing is published), a bad config, a missing model for
            template ``empty``, or an ``out_dir`` that holds something else.
    """
    out_dir = Path(out_dir)
    _check_config(cfg)
    file_hashes = _file_hashes(cfg)
    digest, entry = _digest(cfg, template, model_dir, file_hashes)

    reusable = _existing_artifact(out_dir)
    if reusable is not None and reusable.extra.get("digest") == digest:
        file_name = reusable.extra.get("entry", {}).get("file_name", "")
        if file_name and (out_dir / file_name).is_file() and (out_dir / DATASET_INFO).is_file():
            return PreparedDataset(
                dataset_dir=out_dir, name=cfg.name, records=int(reusable.extra["records"]),
                digest=digest, entry=reusable.extra["entry"], reused=True,
            )
    renderer = _ChatRenderer(model_dir) if template == "empty" else None  # type: ignore[arg-type]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir_for(out_dir)
    shutil.rmtree(staging, ignore_errors=True)  # what a crashed earlier attempt left
    staging.mkdir()
    try:
        bad, count = _write_records(cfg, staging / entry["file_name"], renderer)
        if bad:
            raise _bad_records_error(cfg, bad)
        if count == 0:
            raise DatasetError(f"dataset '{cfg.name}'", "the files hold no records", "add training records")
        (staging / DATASET_INFO).write_text(json.dumps({cfg.name: entry}, indent=2) + "\n", encoding="utf-8")
        manifest = _dataset_manifest(cfg, template, model_dir if renderer is not None else None, file_hashes,
                                     tools=renderer.tools if renderer is not None else {},
                                     extra={"digest": digest, "records": count, "entry": entry, "name": cfg.name})
        if out_dir.is_dir() and reusable is None:
            out_dir.rmdir()  # empty (checked by _existing_artifact); a rename cannot replace it otherwise
        publish_dir(staging, out_dir, manifest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return PreparedDataset(dataset_dir=out_dir, name=cfg.name, records=count, digest=digest, entry=entry)


def _dataset_manifest(cfg: DatasetConfig, template: str, model_dir: Path | None, file_hashes: list[tuple[str, str, int]],
                      *, tools: dict[str, str], extra: dict[str, Any]) -> StageManifest:
    """What a prepared dataset is: the files' hashes, the format settings, the chat template's tools."""
    return StageManifest(
        stage=STAGE_NAME,
        inputs={label: sha for label, sha, _ in file_hashes},
        settings={
            "format": cfg.format, "template": template,
            "columns": cfg.columns or {}, "tags": cfg.tags or {},
            "images_dir": str(cfg.images_dir) if cfg.images_dir else None,
            "model_dir": str(model_dir) if model_dir is not None else None,
        },
        tools=tools,
        extra=extra,
    )


def dataset_entry(cfg: DatasetConfig, *, template: str) -> dict[str, Any]:
    """The ``dataset_info.json`` entry :func:`prepare_dataset` writes for ``cfg`` (config only)."""
    file_name = f"{cfg.name}.json"
    if template == "empty":
        return {"file_name": file_name, "formatting": "alpaca", "columns": dict(_EMPTY_TEMPLATE_COLUMNS)}
    if cfg.format == "alpaca":
        return {"file_name": file_name, "formatting": "alpaca", "columns": dict(SOURCE_COLUMNS["alpaca"])}
    if cfg.format == "sharegpt":
        return {
            "file_name": file_name, "formatting": "sharegpt",
            "columns": dict(SOURCE_COLUMNS["sharegpt"]), "tags": _sharegpt_tags(cfg),
        }
    # LlamaFactory 0.9.5 also has formatting "openai", but its converter appends "detailed
    # thinking off" to every system prompt (a Nemotron convention); sharegpt with role/content
    # tags reads the same messages without rewriting them.
    return {
        "file_name": file_name, "formatting": "sharegpt",
        "columns": dict(_OPENAI_ENTRY_COLUMNS), "tags": dict(OPENAI_TAGS),
    }


def _file_hashes(cfg: DatasetConfig) -> list[tuple[str, str, int]]:
    """(label, sha256, size) of each source file, streamed."""
    out = []
    for path in cfg.files:
        out.append((str(path), file_sha256(Path(path)), Path(path).stat().st_size))
    return out


def _digest(
    cfg: DatasetConfig, template: str, model_dir: Path | None, file_hashes: list[tuple[str, str, int]]
) -> tuple[str, dict[str, Any]]:
    entry = dataset_entry(cfg, template=template)
    h = hashlib.sha256()
    h.update(f"{LAYOUT_VERSION}\n".encode())
    for _, sha, size in file_hashes:
        # The content identifies a file; its name or location does not change the training data.
        h.update(f"file {sha} {size}\n".encode())
    header = {
        "entry": entry,
        "template": template,
        # The source config (columns, tags, images_dir) decides what the copy holds, even
        # where the written entry is the same.
        "columns": _source_columns(cfg),
        "tags": cfg.tags or {},
        "format": cfg.format,
        "images_dir": str(Path(cfg.images_dir).absolute()) if cfg.images_dir else None,
    }
    h.update(json.dumps(header, sort_keys=True).encode())
    if template == "empty":
        h.update(b"\nchat-template\n")
        h.update(_chat_template_identity(_require_model_dir(model_dir)))
    return h.hexdigest(), entry


def _require_model_dir(model_dir: Path | None) -> Path:
    if model_dir is None:
        raise DatasetError(
            "template 'empty'", "needs the model directory: records are pre-rendered with the model's own "
            "chat template", "pass model_dir (the SFT stage's model_name_or_path)",
        )
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise DatasetError(str(model_dir), "model directory not found", "check the model path")
    return model_dir


def _chat_template_identity(model_dir: Path) -> bytes:
    """The bytes that decide how the model's tokenizer renders a chat (cheap: no tokenizer load).

    The chat template (``chat_template.jinja``, ``chat_template.json`` or the one in
    ``tokenizer_config.json``) plus ``tokenizer_config.json`` itself, whose special tokens
    the template may use.
    """
    parts: list[bytes] = []
    for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
        path = model_dir / name
        if path.is_file():
            parts.append(name.encode() + b"\n" + path.read_bytes())
    has_template = (model_dir / "chat_template.jinja").is_file() or (model_dir / "chat_template.json").is_file()
    if not has_template and (model_dir / "tokenizer_config.json").is_file():
        try:
            config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = {}
        has_template = bool(config.get("chat_template"))
    if not has_template:
        raise DatasetError(
            str(model_dir), "the model has no chat template (no chat_template.jinja, chat_template.json "
            "or tokenizer_config.json chat_template); template 'empty' renders records with it",
            "use a model directory with a chat template, or a LlamaFactory template other than 'empty'",
        )
    return b"\0".join(parts)


class _ChatRenderer:
    """Renders conversations with the model's own chat template (LlamaFactory template "empty")."""

    def __init__(self, model_dir: Path) -> None:
        model_dir = _require_model_dir(model_dir)
        _chat_template_identity(model_dir)  # a clear error when the model has no template
        import transformers
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
        except Exception as exc:  # noqa: BLE001 - any loader failure means the same to the user
            raise DatasetError(str(model_dir), f"cannot load the model's tokenizer ({exc})",
                               "check the model directory's tokenizer files") from exc
        self.tools = {"transformers": transformers.__version__}

    def render(self, item: _Normalized) -> dict[str, str]:
        """The alpaca record {instruction: prompt, output: response} for the last assistant turn."""
        kwargs: dict[str, Any] = {"tokenize": False}
        if item.tools:
            kwargs["tools"] = item.tools
        try:
            prompt = self.tokenizer.apply_chat_template(item.messages[:-1], add_generation_prompt=True, **kwargs)
            full = self.tokenizer.apply_chat_template(item.messages, **kwargs)
        except Exception as exc:  # noqa: BLE001 - jinja raise_exception() and friends
            raise _Bad(f"the model's chat template cannot render this conversation: {exc}") from exc
        if not full.startswith(prompt):
            at = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
            raise _Bad(
                "the model's chat template does not render incrementally: the whole conversation does "
                "not start with the rendering of all but the last message plus the generation prompt "
                f"(they differ from character {at}: {prompt[at:at + 30]!r} vs {full[at:at + 30]!r})"
            )
        response = full[len(prompt):]
        if not response.strip():
            raise _Bad("the model's chat template rendered an empty response")
        return {"instruction": prompt, "output": response}


def _write_records(
    cfg: DatasetConfig, path: Path, renderer: _ChatRenderer | None
) -> tuple[list[BadRecord], int]:
    """Stream the normalized records into a JSON array file; collect the bad ones."""
    bad: list[BadRecord] = []
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        f.write("[\n")
        for item in _normalized_records(cfg):
            if isinstance(item, BadRecord):
                bad.append(item)
                continue
            where, normalized = item
            try:
                record = _final_record(normalized, renderer)
            except _Bad as exc:
                bad.append(where.bad(exc.reason))
                continue
            if bad:
                continue  # nothing will be published; keep checking, stop writing
            f.write(",\n" if count else "")
            f.write(json.dumps(record, ensure_ascii=False))
            count += 1
        f.write("\n]\n")
        f.flush()
        os.fsync(f.fileno())
    return bad, count


def _final_record(item: _Normalized, renderer: _ChatRenderer | None) -> dict[str, Any]:
    if renderer is not None:
        if item.images:
            raise _Bad(
                f"has {len(item.images)} image(s), but template 'empty' pre-renders text with the model's "
                "chat template and cannot carry images; drop the images or train with a multimodal template"
            )
        return renderer.render(item)
    if item.text_with_tool_calls:
        raise _Bad(
            f"{', '.join(item.text_with_tool_calls)}: an assistant message with both text and tool_calls; "
            "LlamaFactory's form keeps only the tool calls, so the text would be lost from training "
            "(use template 'empty' to render it with the model's own chat template, or move the text)"
        )
    return item.record


def _existing_artifact(out_dir: Path) -> StageManifest | None:
    """The manifest of a dataset ``out_dir`` prepared before; None if absent or empty.

    Raises:
        DatasetError: ``out_dir`` holds something else (never replaced silently).
    """
    if not out_dir.exists():
        return None
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        return None
    try:
        manifest = read_manifest(out_dir) if out_dir.is_dir() else None
    except ValueError:
        manifest = None
    if manifest is None or manifest.stage != STAGE_NAME:
        raise DatasetError(
            str(out_dir), "exists and is not a dataset prepared by ktflow; refusing to replace it",
            "pick another output directory or delete this one",
        )
    return manifest

