"""Training data: validate every record before training, and prepare what LlamaFactory reads.

LlamaFactory (0.9.5) checks records only while it tokenizes them, and then mostly by logging
"Skipping this abnormal example" and dropping the record: a typo in a role name costs a
training example silently, and a bad JSON line fails the run after the model has loaded.
:func:`validate_dataset` reads every record of every file up front and reports all the bad
ones at once, as ``file:line: reason``.

:func:`prepare_dataset` then writes a normalized copy of the data plus a ``dataset_info.json``
into one directory, so the SFT stage passes ``dataset: <name>`` and ``dataset_dir: <dir>``:

- alpaca: the records with canonical keys (instruction, input, output, system, history, tools,
  images), whatever keys the source used (``DatasetConfig.columns``);
- sharegpt: the conversations with the source's tags, plus system, tools and images columns;
- openai (OpenAI chat messages): LlamaFactory's sharegpt form with role/content tags; content
  parts are flattened to text, each image part becoming an ``<image>`` placeholder whose
  absolute path goes to the ``images`` column;
- template ``empty`` (the Kimi-K2.5 KT recipe): each conversation rendered with the model's own
  chat template into an alpaca prompt/response pair.

Every optional column is always written (``""`` or ``[]`` when a record has none), so the
``dataset_info.json`` entry depends on the config alone and :func:`dataset_digest` can compute
the stage's cache key from the files' bytes without parsing them.

The copy is one JSON *array* file, not JSON Lines, on purpose: the ``datasets`` JSON loader
infers the schema of JSON Lines from the first 10 MB only, so a list column that is empty
there (no record with images or history yet) is typed ``list<null>`` and the first later
record that has one fails the whole load ("Couldn't cast array of type list<item: string> to
null"). A JSON array is read whole, and its schema inferred over every record.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlparse

from pydantic import BaseModel

from ktflow.errors import DatasetError
from ktflow.recipe import DatasetConfig
from ktflow.store import StageManifest, file_sha256, publish_dir, read_manifest, staging_dir_for

STAGE_NAME = "dataset"
DATASET_INFO = "dataset_info.json"
# LlamaFactory's IMAGE_PLACEHOLDER (its default; the IMAGE_PLACEHOLDER env var can change it).
IMAGE_PLACEHOLDER = "<image>"
# How many bad records an error message lists before "and N more".
MAX_SHOWN = 20
# Version of the normalized copy's layout: part of the digest, so a change to how ktflow
# writes the copy invalidates every cached SFT run trained on the old one.
LAYOUT_VERSION = "ktflow-dataset/1"
SUPPORTED_SUFFIXES = (".json", ".jsonl")

# LlamaFactory's own sharegpt defaults (DatasetAttr in llamafactory/data/parser.py).
SHAREGPT_TAGS: dict[str, str] = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
# The tags of the sharegpt form openai records are converted to: OpenAI's role names, plus
# LlamaFactory's "function_call" for an assistant turn that calls tools.
OPENAI_TAGS: dict[str, str] = {
    "role_tag": "role",
    "content_tag": "content",
    "user_tag": "user",
    "assistant_tag": "assistant",
    "observation_tag": "tool",
    "function_tag": "function_call",
    "system_tag": "system",
}
OPENAI_ROLES = ("system", "user", "assistant", "tool")

# Per format: the LlamaFactory column names a config may remap, and the source key each
# reads by default. The normalized copy always uses the default keys.
SOURCE_COLUMNS: dict[str, dict[str, str]] = {
    "alpaca": {
        "prompt": "instruction", "query": "input", "response": "output", "system": "system",
        "history": "history", "tools": "tools", "images": "images",
    },
    "sharegpt": {"messages": "conversations", "system": "system", "tools": "tools", "images": "images"},
    "openai": {"messages": "messages", "tools": "tools"},
}
_OPENAI_ENTRY_COLUMNS = {"messages": "messages", "tools": "tools", "images": "images"}
_EMPTY_TEMPLATE_COLUMNS = {"prompt": "instruction", "response": "output"}
# LlamaFactory's OpenAI converter joins consecutive tool results with this; so do we.
_TOOL_RESPONSE_JOIN = "\n</tool_response>\n<tool_response>\n"


class BadRecord(BaseModel):
    """One record that cannot be trained on, and why.

    ``line`` is the 1-based line of a JSON Lines file (``unit="line"``) or the 1-based index of
    the record in a JSON array file (``unit="record"``); 0 means the file as a whole.
    """

    file: str
    line: int
    reason: str
    unit: Literal["line", "record"] = "line"

    def __str__(self) -> str:
        if self.line == 0:
            return f"{self.file}: {self.reason}"
        where = f"{self.line}" if self.unit == "line" else f"record {self.line}"
        return f"{self.file}:{where}: {self.reason}"


class PreparedDataset(BaseModel):
    """A dataset directory LlamaFactory reads as ``dataset: name``, ``dataset_dir: dataset_dir``."""

    dataset_dir: Path
    name: str
    records: int
    digest: str
    entry: dict[str, Any]
    reused: bool = False


# --------------------------------------------------------------------------- public API


def validate_dataset(cfg: DatasetConfig) -> int:
    """Check every record of every file against ``cfg.format``; return the record count.

    Raises:
        DatasetError: a file is missing or of an unsupported type, the config's columns/tags do
            not fit the format, or any record is bad (all of them listed, ``file:line: reason``).
    """
    _check_config(cfg)
    bad: list[BadRecord] = []
    count = 0
    for item in _normalized_records(cfg):
        if isinstance(item, BadRecord):
            bad.append(item)
        else:
            count += 1
    if bad:
        raise _bad_records_error(cfg, bad)
    return count


def user_prompts(cfg: DatasetConfig) -> Iterator[tuple[str, str]]:
    """Every user message of every good record, as ``(file:line, text)``, in file order.

    Records are read as training reads them (alpaca's ``instruction\\ninput`` is one user
    message). Bad records are skipped: :func:`validate_dataset` is what reports them.

    Raises:
        DatasetError: a file cannot be read at all (missing, empty, not JSON): what it holds is
            unknown, so nothing may be concluded from its absence.
    """
    for where, normalized in _good_records(cfg):
        at = f"{where.file}:{where.line if where.unit == 'line' else f'record {where.line}'}"
        for message in normalized.messages:
            content = message.get("content")
            if message.get("role") == "user" and isinstance(content, str) and content.strip():
                yield at, content


def record_messages(cfg: DatasetConfig) -> Iterator[list[dict[str, Any]]]:
    """Every good record's conversation as OpenAI-style messages, in file order (what a chat
    template renders; ``ktflow plan`` counts tokens from them). Bad records are skipped:
    :func:`validate_dataset` is what reports them.

    Raises:
        DatasetError: a file cannot be read at all, or the config does not fit the format.
    """
    for _, normalized in _good_records(cfg):
        yield normalized.messages


def _good_records(cfg: DatasetConfig) -> Iterator[Any]:
    """``(where, normalized)`` of every good record; a file that cannot be read at all raises."""
    _check_config(cfg)
    for item in _normalized_records(cfg):
        if isinstance(item, BadRecord):
            if item.line == 0:
                raise DatasetError("dataset.files", str(item), "fix the training data's path or file")
            continue
        yield item


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


# --------------------------------------------------------------------------- config checks


def _sharegpt_tags(cfg: DatasetConfig) -> dict[str, str]:
    return {**SHAREGPT_TAGS, **(cfg.tags or {})}


def _source_columns(cfg: DatasetConfig) -> dict[str, str]:
    return {**SOURCE_COLUMNS[cfg.format], **(cfg.columns or {})}


def _check_config(cfg: DatasetConfig) -> None:
    """Config-level problems (files, columns, tags): raised before any record is read."""
    problems: list[str] = []
    allowed = SOURCE_COLUMNS[cfg.format]
    for key, value in (cfg.columns or {}).items():
        if key not in allowed:
            problems.append(
                f"columns.{key}: not a column of format {cfg.format} (allowed: {', '.join(allowed)})"
            )
        elif not isinstance(value, str) or not value:
            problems.append(f"columns.{key}: must name a key of the records")
    if cfg.tags:
        if cfg.format != "sharegpt":
            problems.append(
                f"tags: only format sharegpt has tags (format {cfg.format} uses fixed role names)"
            )
        else:
            for key, value in cfg.tags.items():
                if key not in SHAREGPT_TAGS:
                    problems.append(f"tags.{key}: unknown tag (allowed: {', '.join(SHAREGPT_TAGS)})")
                elif not value:
                    problems.append(f"tags.{key}: must not be empty")
    if cfg.images_dir is not None and not Path(cfg.images_dir).is_dir():
        problems.append(f"images_dir: {cfg.images_dir} is not a directory")
    for path in cfg.files:
        path = Path(path)
        if path.suffix.lower() not in SUPPORTED_SUFFIXES:
            kind = path.suffix.lower() or "(no suffix)"
            hint = " (csv/parquet support is not built yet)" if kind in (".csv", ".parquet", ".arrow") else ""
            problems.append(f"{path}: unsupported file type {kind}{hint}; use .jsonl or .json")
        elif not path.exists():
            problems.append(f"{path}: no such file")
        elif not path.is_file():
            problems.append(f"{path}: not a regular file")
    if problems:
        raise DatasetError(
            f"dataset '{cfg.name}'",
            problems[0] if len(problems) == 1 else "\n  " + "\n  ".join(problems),
            "fix dataset.files/columns/tags/images_dir in the recipe",
        )


def _bad_records_error(cfg: DatasetConfig, bad: list[BadRecord]) -> DatasetError:
    shown = "\n  ".join(str(b) for b in bad[:MAX_SHOWN])
    more = f"\n  and {len(bad) - MAX_SHOWN} more" if len(bad) > MAX_SHOWN else ""
    error = DatasetError(
        f"dataset '{cfg.name}'",
        f"{len(bad)} bad record{'s' if len(bad) != 1 else ''} (file:line for JSON Lines, "
        f"file:record N for JSON arrays):\n  {shown}{more}\n",
        "fix or remove these records, then run again (nothing was trained or written).",
    )
    error.bad_records = bad  # type: ignore[attr-defined]  # for callers that want them all
    return error


# --------------------------------------------------------------------------- digest


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


# --------------------------------------------------------------------------- reading


class _Bad(Exception):
    """A record's problem; becomes a :class:`BadRecord` with the record's location."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Normalized:
    """A good record: what LlamaFactory reads, and the chat it stands for."""

    record: dict[str, Any]
    # OpenAI-style messages for the model's own chat template (template "empty").
    messages: list[dict[str, Any]]
    tools: list[Any] | None
    images: list[str]
    # Assistant text dropped because it came with tool calls (the sharegpt form has no place for it).
    text_with_tool_calls: list[str] = field(default_factory=list)


@dataclass
class _Located:
    file: str
    line: int
    unit: Literal["line", "record"]
    base_dir: Path

    def bad(self, reason: str) -> BadRecord:
        return BadRecord(file=self.file, line=self.line, reason=reason, unit=self.unit)


def _iter_file(path: Path) -> Iterator[tuple[int, Literal["line", "record"], Any] | BadRecord]:
    """The records of a .jsonl or .json file, with their 1-based line / record number.

    JSON Lines are streamed; a JSON array (a .json file starting with ``[``) is read whole.
    """
    label = str(path)
    first = _first_byte(path)
    if first is None:
        yield BadRecord(file=label, line=0, reason="the file is empty (no records)")
        return
    is_json = path.suffix.lower() == ".json"
    if is_json and first == b"[":
        try:
            array = json.loads(path.read_bytes().decode("utf-8-sig"))
        except UnicodeDecodeError as exc:
            yield BadRecord(file=label, line=0, reason=f"not UTF-8 text ({exc.reason} at byte {exc.start})")
            return
        except json.JSONDecodeError as exc:
            yield BadRecord(file=label, line=exc.lineno, reason=f"malformed JSON: {exc.msg} (column {exc.colno})")
            return
        if not array:
            yield BadRecord(file=label, line=0, reason="the file is empty (an empty JSON array)")
            return
        for index, obj in enumerate(array, start=1):
            yield index, "record", obj
        return
    # JSON Lines (a .json file may hold them too: the `datasets` JSON loader reads both).
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a BOM is common on Windows
            except UnicodeDecodeError as exc:
                yield BadRecord(file=label, line=number, reason=f"not UTF-8 text ({exc.reason} at byte {exc.start})")
                continue
            if not line.strip():
                continue  # blank lines are skipped by the `datasets` JSON Lines reader too
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                if number == 1 and is_json and _is_single_object(path):
                    yield BadRecord(
                        file=label, line=0, reason="holds a single JSON object; a .json file must hold a "
                        "JSON array of records (or JSON Lines)",
                    )
                    return
                yield BadRecord(file=label, line=number, reason=f"malformed JSON: {exc.msg} (column {exc.colno})")
                continue
            yield number, "line", obj


def _first_byte(path: Path) -> bytes | None:
    """The first byte that is not whitespace or a BOM, or None for an empty file."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            stripped = chunk.lstrip(b" \t\r\n\xef\xbb\xbf")
            if stripped:
                return stripped[:1]
    return None


def _is_single_object(path: Path) -> bool:
    """Whether the file is one (multi-line) JSON object rather than JSON Lines."""
    try:
        return isinstance(json.loads(path.read_bytes().decode("utf-8-sig")), dict)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False


def _normalized_records(cfg: DatasetConfig) -> Iterator[tuple[_Located, _Normalized] | BadRecord]:
    normalize = {"alpaca": _normalize_alpaca, "sharegpt": _normalize_sharegpt, "openai": _normalize_openai}[
        cfg.format
    ]
    columns = _source_columns(cfg)
    tags = _sharegpt_tags(cfg)
    for path in cfg.files:
        path = Path(path)
        base_dir = Path(cfg.images_dir) if cfg.images_dir is not None else path.parent
        for item in _iter_file(path):
            if isinstance(item, BadRecord):
                yield item
                continue
            number, unit, obj = item
            where = _Located(file=str(path), line=number, unit=unit, base_dir=base_dir.absolute())
            if not isinstance(obj, dict):
                yield where.bad(f"not a JSON object (got {_json_type(obj)})")
                continue
            try:
                yield where, normalize(obj, columns, tags, where)
            except _Bad as exc:
                yield where.bad(exc.reason)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def _get_str(obj: dict[str, Any], key: str, *, required: bool) -> str:
    if key not in obj or (obj[key] is None and not required):
        if required:
            raise _Bad(f"missing required key '{key}'")
        return ""
    value = obj[key]
    if not isinstance(value, str):
        raise _Bad(f"'{key}' must be a string (got {_json_type(value)})")
    return value


def _tools(obj: dict[str, Any], key: str) -> tuple[str, list[Any] | None]:
    """A record's tool list, as LlamaFactory's JSON string and as a list."""
    value = obj.get(key)
    if value is None or value == "" or value == []:
        return "", None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _Bad(f"'{key}' is not valid JSON ({exc.msg})") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise _Bad(f"'{key}' must be a list of tool (function) descriptions")
    return json.dumps(value, ensure_ascii=False), value


def _resolve_image(ref: Any, where: _Located, label: str) -> str:
    """The absolute path of an image reference, which must be an existing local file."""
    if not isinstance(ref, str) or not ref.strip():
        raise _Bad(f"{label}: an image must be a file path (got {_json_type(ref)})")
    if ref.startswith("file://"):
        ref = unquote(urlparse(ref).path)
    elif ref.startswith("data:") or "://" in ref:
        raise _Bad(f"{label}: only local image files are supported (got '{ref[:40]}'); download it and use its path")
    path = Path(ref).expanduser()
    if not path.is_absolute():
        path = where.base_dir / path
    if not path.is_file():
        raise _Bad(f"{label}: image file not found: {path}")
    return str(path.absolute())


def _images(obj: dict[str, Any], key: str, where: _Located) -> list[str]:
    value = obj.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise _Bad(f"'{key}' must be a list of image paths (got {_json_type(value)})")
    return [_resolve_image(ref, where, f"{key}[{i}]") for i, ref in enumerate(value)]


def _check_placeholders(texts: list[str], images: list[str]) -> None:
    # LlamaFactory's mm_plugin fails the run when the counts differ.
    found = sum(text.count(IMAGE_PLACEHOLDER) for text in texts)
    if found != len(images):
        raise _Bad(
            f"{len(images)} image(s) but {found} '{IMAGE_PLACEHOLDER}' placeholder(s) in the text; "
            "each image needs exactly one placeholder"
        )


def _parse_function_call(content: str, label: str) -> list[dict[str, Any]]:
    """A sharegpt function_call turn's JSON (one call or a list) as OpenAI tool calls."""
    try:
        calls = json.loads(content)
    except json.JSONDecodeError as exc:
        raise _Bad(f"{label}: a function call must be JSON {{\"name\", \"arguments\"}} ({exc.msg})") from None
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c for c in calls):
        raise _Bad(f"{label}: a function call must be JSON with 'name' and 'arguments' (or a list of them)")
    return [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


# --------------------------------------------------------------------------- per format


def _normalize_alpaca(
    obj: dict[str, Any], columns: dict[str, str], tags: dict[str, str], where: _Located
) -> _Normalized:
    prompt = _get_str(obj, columns["prompt"], required=True)
    response = _get_str(obj, columns["response"], required=True)
    query = _get_str(obj, columns["query"], required=False)
    system = _get_str(obj, columns["system"], required=False)
    history_key = columns["history"]
    history = obj.get(history_key) or []
    if not isinstance(history, list) or not all(
        isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair) for pair in history
    ):
        raise _Bad(f"'{history_key}' must be a list of [prompt, response] string pairs")
    tools_text, tools = _tools(obj, columns["tools"])
    images = _images(obj, columns["images"], where)
    if not prompt.strip() and not query.strip():
        raise _Bad(f"empty content: '{columns['prompt']}' and '{columns['query']}' are both empty")
    if not response.strip():
        raise _Bad(f"empty content: '{columns['response']}' is empty")
    for i, (old_prompt, old_response) in enumerate(history):
        if not old_prompt.strip() or not old_response.strip():
            raise _Bad(f"empty content in '{history_key}'[{i}]")
    _check_placeholders([prompt, query, response, *(t for pair in history for t in pair)], images)

    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for old_prompt, old_response in history:
        messages += [{"role": "user", "content": old_prompt}, {"role": "assistant", "content": old_response}]
    # LlamaFactory's alpaca converter: the user turn is "prompt\nquery", skipping empty parts.
    messages.append({"role": "user", "content": "\n".join(t for t in (prompt, query) if t)})
    messages.append({"role": "assistant", "content": response})
    record = {
        "instruction": prompt, "input": query, "output": response, "system": system,
        "history": history, "tools": tools_text, "images": images,
    }
    return _Normalized(record=record, messages=messages, tools=tools, images=images)


def _messages_list(obj: dict[str, Any], key: str) -> list[Any]:
    if key not in obj:
        raise _Bad(f"missing required key '{key}'")
    messages = obj[key]
    if not isinstance(messages, list):
        raise _Bad(f"'{key}' must be a list of messages (got {_json_type(messages)})")
    if not messages:
        raise _Bad(f"empty conversation: '{key}' has no messages")
    return messages


def _alternation(roles: list[tuple[int, str, str]], key: str, first: tuple[str, ...], second: tuple[str, ...]) -> None:
    """LlamaFactory's rule: turns alternate first-kind / second-kind, ending with the second.

    ``roles`` holds (index in the source list, role as written, canonical kind) per turn.
    """
    if not roles:
        raise _Bad(f"empty conversation: '{key}' has only a system message")
    for turn, (index, written, kind) in enumerate(roles):
        expected = first if turn % 2 == 0 else second
        if kind not in expected:
            raise _Bad(
                f"roles do not alternate: {key}[{index}] is '{written}' where {' or '.join(expected)} "
                "was expected (user and assistant turns alternate after an optional leading system message)"
            )
    if len(roles) % 2:
        index, written, _ = roles[-1]
        raise _Bad(f"the last message must be the assistant's: {key}[{index}] is '{written}'")


def _normalize_sharegpt(
    obj: dict[str, Any], columns: dict[str, str], tags: dict[str, str], where: _Located
) -> _Normalized:
    key = columns["messages"]
    messages = _messages_list(obj, key)
    role_tag, content_tag = tags["role_tag"], tags["content_tag"]
    kinds = {
        tags["user_tag"]: "user", tags["assistant_tag"]: "assistant", tags["observation_tag"]: "observation",
        tags["function_tag"]: "function", tags["system_tag"]: "system",
    }
    system = _get_str(obj, columns["system"], required=False)
    tools_text, tools = _tools(obj, columns["tools"])
    images = _images(obj, columns["images"], where)

    turns: list[tuple[int, str, str, str]] = []  # index, role as written, kind, content
    for i, message in enumerate(messages):
        label = f"{key}[{i}]"
        if not isinstance(message, dict):
            raise _Bad(f"{label} must be an object (got {_json_type(message)})")
        for tag in (role_tag, content_tag):
            if tag not in message:
                raise _Bad(f"{label}: missing required key '{tag}'")
        role, content = message[role_tag], message[content_tag]
        if not isinstance(role, str) or role not in kinds:
            raise _Bad(f"{label}: unknown role {json.dumps(role)} (expected one of {', '.join(kinds)})")
        if not isinstance(content, str):
            raise _Bad(f"{label}: '{content_tag}' must be a string (got {_json_type(content)})")
        turns.append((i, role, kinds[role], content))

    chat: list[dict[str, Any]] = []
    if turns[0][2] == "system":
        chat.append({"role": "system", "content": turns[0][3]})
        body = turns[1:]
    else:
        if system:
            chat.append({"role": "system", "content": system})
        body = turns
    for index, role, kind, _ in body:
        if kind == "system":
            raise _Bad(f"{key}[{index}]: a system message ('{role}') is only allowed first")
    _alternation(
        [(i, role, kind) for i, role, kind, _ in body], key, ("user", "observation"), ("assistant", "function")
    )
    for index, role, kind, content in body:
        if not content.strip():
            raise _Bad(f"empty content: {key}[{index}] ('{role}')")
        if kind == "function":
            chat.append({"role": "assistant", "content": "",
                         "tool_calls": _parse_function_call(content, f"{key}[{index}]")})
        elif kind == "observation":
            chat.append({"role": "tool", "content": content})
        else:
            chat.append({"role": kind, "content": content})
    _check_placeholders([t[3] for t in turns], images)

    record = {
        "conversations": [{role_tag: role, content_tag: content} for _, role, _, content in turns],
        "system": system, "tools": tools_text, "images": images,
    }
    return _Normalized(record=record, messages=chat, tools=tools, images=images)


def _flatten_content(content: Any, label: str, where: _Located) -> tuple[str, list[str]]:
    """OpenAI message content (a string or a list of parts) as text with image placeholders.

    Consecutive text parts are joined with a newline; an image part becomes the placeholder
    where it stands, its file's absolute path going to the returned list.
    """
    if content is None:
        return "", []
    if isinstance(content, str):
        if IMAGE_PLACEHOLDER in content:
            raise _Bad(f"{label}: the text holds a literal '{IMAGE_PLACEHOLDER}', which LlamaFactory takes for an image")
        return content, []
    if not isinstance(content, list):
        raise _Bad(f"{label}: 'content' must be a string or a list of parts (got {_json_type(content)})")
    pieces: list[str] = []
    images: list[str] = []
    previous_text = False
    for k, part in enumerate(content):
        part_label = f"{label}.content[{k}]"
        if not isinstance(part, dict):
            raise _Bad(f"{part_label} must be an object (got {_json_type(part)})")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise _Bad(f"{part_label}: 'text' must be a string (got {_json_type(text)})")
            if IMAGE_PLACEHOLDER in text:
                raise _Bad(
                    f"{part_label}: the text holds a literal '{IMAGE_PLACEHOLDER}', which LlamaFactory takes for an image"
                )
            if previous_text:
                pieces.append("\n")
            pieces.append(text)
            previous_text = True
            continue
        if kind == "image_url":
            ref = part.get("image_url")
            ref = ref.get("url") if isinstance(ref, dict) else ref
        elif kind == "image":
            ref = part.get("image")
        else:
            raise _Bad(f"{part_label}: unsupported part type {json.dumps(kind)} (text, image_url and image are supported)")
        images.append(_resolve_image(ref, where, part_label))
        pieces.append(IMAGE_PLACEHOLDER)
        previous_text = False
    return "".join(pieces), images


_Parsed = tuple[int, str, str, "list[Any] | None"]  # index, role, text, tool calls


def _normalize_openai(
    obj: dict[str, Any], columns: dict[str, str], tags: dict[str, str], where: _Located
) -> _Normalized:
    key = columns["messages"]
    messages = _messages_list(obj, key)
    tools_text, tools = _tools(obj, columns["tools"])
    parsed: list[_Parsed] = []
    images: list[str] = []
    chat: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role, text, tool_calls, part_images = _openai_message(message, f"{key}[{i}]", where)
        images += part_images
        parsed.append((i, role, text, tool_calls))
        # The model's own template gets the message as written, content flattened to text.
        chat.append({**message, "content": text})
    body = parsed[1:] if parsed[0][1] == "system" else parsed
    _check_openai_turns(body, key)
    out: list[dict[str, str]] = [{"role": "system", "content": parsed[0][2]}] if parsed[0][1] == "system" else []
    dropped = _sharegpt_turns(body, key, out)
    record = {"messages": out, "tools": tools_text, "images": images}
    return _Normalized(record=record, messages=chat, tools=tools, images=images, text_with_tool_calls=dropped)


def _openai_message(message: Any, label: str, where: _Located) -> tuple[str, str, list[Any] | None, list[str]]:
    """One OpenAI message, checked: its role, its content as text, its tool calls, its images."""
    if not isinstance(message, dict):
        raise _Bad(f"{label} must be an object (got {_json_type(message)})")
    if "role" not in message:
        raise _Bad(f"{label}: missing required key 'role'")
    role = message["role"]
    if role not in OPENAI_ROLES:
        hint = " (write 'system')" if role == "developer" else ""
        raise _Bad(f"{label}: unknown role {json.dumps(role)} (expected one of {', '.join(OPENAI_ROLES)}){hint}")
    tool_calls = message.get("tool_calls") if role == "assistant" else None
    if tool_calls is not None:
        tool_calls = _check_tool_calls(tool_calls, label)
    if "content" not in message and not tool_calls:
        raise _Bad(f"{label}: missing required key 'content'")
    text, part_images = _flatten_content(message.get("content"), label, where)
    return role, text, tool_calls, part_images


def _check_openai_turns(body: list[_Parsed], key: str) -> None:
    """After an optional leading system message: no other system message, no empty turn, and turns
    that alternate (user or tool results, then assistant or tool calls)."""
    aligned: list[tuple[int, str, str]] = []  # index, role as written, kind
    for index, role, text, tool_calls in body:
        if role == "system":
            raise _Bad(f"{key}[{index}]: a system message is only allowed first")
        if not text.strip() and not tool_calls:
            raise _Bad(f"empty content: {key}[{index}] ('{role}')")
        if role == "tool":
            # Consecutive tool results (parallel calls) are one observation turn, as in
            # LlamaFactory's own OpenAI converter.
            if aligned and aligned[-1][2] == "observation":
                continue
            aligned.append((index, role, "observation"))
        elif tool_calls:
            aligned.append((index, "assistant with tool_calls", "function"))
        else:
            aligned.append((index, role, role))
    _alternation(aligned, key, ("user", "observation"), ("assistant", "function"))


def _sharegpt_turns(body: list[_Parsed], key: str, out: list[dict[str, str]]) -> list[str]:
    """Append LlamaFactory's turns for ``body`` to ``out``; return the messages whose text beside
    tool calls is dropped (LlamaFactory keeps only the calls)."""
    dropped: list[str] = []
    pending_tool: list[str] = []
    for index, role, text, tool_calls in body:
        if role != "tool" and pending_tool:
            out.append({"role": "tool", "content": _TOOL_RESPONSE_JOIN.join(pending_tool)})
            pending_tool = []
        if role == "tool":
            pending_tool.append(text)
        elif tool_calls:
            out.append({"role": "function_call", "content": json.dumps(
                [{"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
                 for c in tool_calls], ensure_ascii=False)})
            if text.strip():
                dropped.append(f"{key}[{index}]")
        else:
            out.append({"role": role, "content": text})
    if pending_tool:
        out.append({"role": "tool", "content": _TOOL_RESPONSE_JOIN.join(pending_tool)})
    return dropped


def _check_tool_calls(tool_calls: Any, label: str) -> list[dict[str, Any]]:
    if not isinstance(tool_calls, list):
        raise _Bad(f"{label}: 'tool_calls' must be a list (got {_json_type(tool_calls)})")
    for k, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _Bad(f"{label}.tool_calls[{k}]: needs 'function' with a 'name'")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise _Bad(f"{label}.tool_calls[{k}]: 'arguments' is not valid JSON ({exc.msg})") from None
    return tool_calls


def _arguments(arguments: Any) -> Any:
    # OpenAI sends arguments as a JSON string; LlamaFactory's function formatter json.dumps()
    # them again, so a string would be trained double-encoded ("{\"city\": ...}").
    if isinstance(arguments, str):
        return json.loads(arguments) if arguments.strip() else {}
    return arguments if arguments is not None else {}


# --------------------------------------------------------------------------- writing


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
