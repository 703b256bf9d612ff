"""The alpaca dialect: instruction/input/output records, with optional system, history, tools and images."""

from __future__ import annotations

from typing import Any

from ktflow.formats.dataset._common import (
    _Bad,
    _check_placeholders,
    _get_str,
    _images,
    _Located,
    _Normalized,
    _tools,
)


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

