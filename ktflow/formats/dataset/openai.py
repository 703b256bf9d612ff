"""The openai dialect: OpenAI chat messages (content parts, tool calls, tool results), converted to
LlamaFactory's sharegpt form with role/content tags."""

from __future__ import annotations

import json
from typing import Any

from ktflow.formats.dataset._common import (
    _TOOL_RESPONSE_JOIN,
    IMAGE_PLACEHOLDER,
    OPENAI_ROLES,
    _alternation,
    _Bad,
    _json_type,
    _Located,
    _messages_list,
    _Normalized,
    _resolve_image,
    _tools,
)


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

