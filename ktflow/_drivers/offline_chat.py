"""Chat answers without a server: LlamaFactory's ``ChatModel``, run inside the training toolchain.

Started by :func:`ktflow.stages.offline_generation.generate_offline` as::

    <train python> -m ktflow._drivers.offline_chat --plan PLAN.json --out OUT.json

with ``PYTHONPATH`` naming a directory that holds only the ``ktflow`` package. It imports the
standard library and LlamaFactory (which brings torch), never pydantic or Prefect.

``PLAN.json``::

    {"infer_config": {...},   # LlamaFactory inference args: what ktflow.stages.serve.render_llamafactory_api
                              # renders as infer.yaml for `llamafactory-cli api`
     "requests": [{"messages": [{"role": "user", "content": "..."}, ...],
                   "max_tokens": 48, "temperature": 0.0}, ...]}

The model (base + adapter, merged at load) is loaded once, with the same args the API server
gets, and each request becomes the ``ChatModel.chat`` call that LlamaFactory 0.9.5's OpenAI
server (``llamafactory/api/chat.py``) makes for the same chat completion request:

- a *leading* system message is taken out of the messages and passed as ``system`` (a list
  content gives its first part's text); any other system message is refused, as the server
  refuses it ("Invalid role");
- the rest must alternate user|tool / assistant|function, starting and ending with a user turn
  (the server: "Only supports u/a/u/a/u..."); ``tool`` is LlamaFactory's ``observation`` role; a
  list content is the concatenation of its text parts;
- generation keywords: ``do_sample`` (None unless given), ``temperature``, ``top_p`` (None unless
  given), ``max_new_tokens=max_tokens``, ``num_return_sequences=1``,
  ``repetition_penalty=presence_penalty`` (None unless given), ``stop``. LlamaFactory's engine
  then turns temperature 0 into greedy decoding (``do_sample=False``), and a missing or zero
  ``max_tokens`` into the generating args' default ``max_new_tokens``, exactly as for the server.

So at temperature 0 the answer equals the served endpoint's for the same base + adapter.

Output: one stdout line ``KTFLOW_OFFLINE {"done": i, "total": n}`` per answered request (and
``KTFLOW_OFFLINE {"error": "..."}`` before a failing exit), then ``OUT.json``, written atomically:
``[{"text": str, "seconds": float, "completion_tokens": int | null, "finish_reason": "stop" | "length"}]``
in request order. Exit status: 0 done, 2 a bad plan, 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EVENT_PREFIX = "KTFLOW_OFFLINE "
EXIT_BAD_PLAN = 2

# The OpenAI roles the server accepts -> LlamaFactory's data roles (llamafactory.api.chat.ROLE_MAPPING).
ROLE_MAPPING = {"user": "user", "assistant": "assistant", "system": "system", "function": "function",
                "tool": "observation"}
# Optional OpenAI request fields the server forwards to ChatModel.chat, with the keyword it uses.
_PASSED_THROUGH = {"do_sample": "do_sample", "top_p": "top_p", "presence_penalty": "repetition_penalty",
                   "stop": "stop"}


class PlanError(ValueError):
    """The plan cannot be answered the way the API server would answer it."""


def _emit(**fields: Any) -> None:
    print(EVENT_PREFIX + json.dumps(fields), flush=True)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: the server concatenates the text ones
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise PlanError(f"{where}: only text content parts are supported offline, got {part!r:.80}")
            parts.append(part["text"])
        return "".join(parts)
    raise PlanError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def to_chat_call(request: dict[str, Any], where: str = "request") -> tuple[list[dict[str, str]], str | None, dict[str, Any]]:
    """``(messages, system, generation keywords)`` for ``ChatModel.chat``, as the API server makes them.

    Raises:
        PlanError: a request the server would refuse (or one this driver cannot express).
    """
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PlanError(f"{where}: messages must be a non-empty list")
    messages = list(messages)
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLE_MAPPING:
            raise PlanError(f"{where}: messages[{j}]: role must be one of {sorted(ROLE_MAPPING)}, got "
                            f"{message.get('role') if isinstance(message, dict) else message!r:.80}")
    system: str | None = None
    if messages[0]["role"] == "system":
        content = messages.pop(0).get("content")
        if isinstance(content, list):  # the server takes the first part's text only
            system = content[0].get("text") if content and isinstance(content[0], dict) else ""
        else:
            system = _text(content, f"{where}: messages[0]")
    if len(messages) % 2 == 0:
        raise PlanError(f"{where}: LlamaFactory only supports user/assistant/.../user turns after an optional "
                        f"leading system message (got {len(messages)} turns after it)")
    converted = []
    offset = len(request["messages"]) - len(messages)
    for i, message in enumerate(messages):
        allowed = ("user", "tool") if i % 2 == 0 else ("assistant", "function")
        if message["role"] not in allowed:
            raise PlanError(f"{where}: messages[{i + offset}]: role {message['role']!r} where LlamaFactory's API "
                            f"expects {' or '.join(allowed)} (a system message may only come first)")
        if message["role"] == "assistant" and isinstance(message.get("tool_calls"), list) and message["tool_calls"]:
            try:
                calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                         for c in message["tool_calls"]]
            except (KeyError, TypeError):
                raise PlanError(f"{where}: messages[{i + offset}]: tool_calls need function.name and "
                                f"function.arguments") from None
            converted.append({"role": ROLE_MAPPING["function"], "content": json.dumps(calls, ensure_ascii=False)})
        else:
            converted.append({"role": ROLE_MAPPING[message["role"]],
                              "content": _text(message.get("content"), f"{where}: messages[{i + offset}]")})
    max_tokens = request.get("max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0):
        raise PlanError(f"{where}: max_tokens must be a non-negative integer, got {max_tokens!r}")
    temperature = request.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))):
        raise PlanError(f"{where}: temperature must be a number, got {temperature!r}")
    kwargs: dict[str, Any] = {
        "do_sample": None, "temperature": None if temperature is None else float(temperature), "top_p": None,
        "max_new_tokens": max_tokens, "num_return_sequences": 1, "repetition_penalty": None, "stop": None,
    }
    for field, keyword in _PASSED_THROUGH.items():
        if request.get(field) is not None:
            kwargs[keyword] = request[field]
    return converted, system, kwargs


def check_plan(plan: Any) -> list[tuple[list[dict[str, str]], str | None, dict[str, Any]]]:
    """Every request of the plan as its ``ChatModel.chat`` call (all checked before the model loads)."""
    if not isinstance(plan, dict) or not isinstance(plan.get("infer_config"), dict):
        raise PlanError("the plan must be an object with an 'infer_config' object")
    requests = plan.get("requests")
    if not isinstance(requests, list):
        raise PlanError("the plan's 'requests' must be a list")
    return [to_chat_call(r if isinstance(r, dict) else {}, f"requests[{i}]") for i, r in enumerate(requests)]


def _atomic_write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def answer(plan: dict[str, Any],
           calls: list[tuple[list[dict[str, str]], str | None, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Load the model once with the plan's infer config and answer every call, in order."""
    from llamafactory.chat import ChatModel

    try:
        chat_model = ChatModel(dict(plan["infer_config"]))
    except Exception as exc:
        raise RuntimeError(f"LlamaFactory could not load the model: {type(exc).__name__}: {exc}") from exc
    answers: list[dict[str, Any]] = []
    for i, (messages, system, kwargs) in enumerate(calls):
        started = time.perf_counter()
        responses = chat_model.chat(messages, system, None, None, None, None, **kwargs)
        seconds = time.perf_counter() - started
        first = responses[0] if responses else None
        answers.append({
            "text": first.response_text if first is not None else "",
            "seconds": round(seconds, 4),
            # the server's usage.completion_tokens: the responses' lengths (up to and with the EOS token)
            "completion_tokens": sum(r.response_length for r in responses) if responses else None,
            "finish_reason": None if first is None else ("stop" if first.finish_reason == "stop" else "length"),
        })
        _emit(done=i + 1, total=len(calls))
    return answers


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ktflow._drivers.offline_chat", description=__doc__.split("\n")[0])
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        plan = json.loads(args.plan.read_text(encoding="utf-8"))
        calls = check_plan(plan)
    except (OSError, ValueError) as exc:  # PlanError and JSON errors are ValueErrors
        _emit(error=f"{args.plan}: {exc}")
        return EXIT_BAD_PLAN
    try:
        answers = answer(plan, calls)
        _atomic_write_json(args.out, answers)
    except Exception as exc:  # noqa: BLE001 - reported on stdout for the orchestrator, with the trace
        traceback.print_exc()
        _emit(error=str(exc) if isinstance(exc, RuntimeError) else f"{type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
