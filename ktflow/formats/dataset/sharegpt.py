"""The sharegpt dialect: a conversation list of role/content turns under configurable tags."""

from __future__ import annotations

import json
from typing import Any

from ktflow.formats.dataset._common import (
    _alternation,
    _Bad,
    _check_placeholders,
    _get_str,
    _images,
    _json_type,
    _Located,
    _messages_list,
    _Normalized,
    _tools,
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

