"""What the dataset modules share: constants, the bad-record types, and the per-field checks every dialect uses."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlparse

from pydantic import BaseModel

from ktflow.recipe import DatasetConfig

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


def _sharegpt_tags(cfg: DatasetConfig) -> dict[str, str]:
    return {**SHAREGPT_TAGS, **(cfg.tags or {})}


def _source_columns(cfg: DatasetConfig) -> dict[str, str]:
    return {**SOURCE_COLUMNS[cfg.format], **(cfg.columns or {})}

