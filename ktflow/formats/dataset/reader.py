"""Reading and validating: the config checks, the file reader (JSON Lines or a JSON array), each
record normalized by its dialect, and the public read API (validation, prompts, messages)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from ktflow.errors import DatasetError
from ktflow.formats.dataset._common import (
    MAX_SHOWN,
    SHAREGPT_TAGS,
    SOURCE_COLUMNS,
    SUPPORTED_SUFFIXES,
    BadRecord,
    _Bad,
    _json_type,
    _Located,
    _Normalized,
    _sharegpt_tags,
    _source_columns,
)
from ktflow.formats.dataset.alpaca import _normalize_alpaca
from ktflow.formats.dataset.openai import _normalize_openai
from ktflow.formats.dataset.sharegpt import _normalize_sharegpt
from ktflow.recipe import DatasetConfig


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

