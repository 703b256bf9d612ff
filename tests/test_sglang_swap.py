"""No-downtime adapter swap on a plain SGLang server, against a local server speaking SGLang's
adapter API (/load_lora_adapter, /unload_lora_adapter, /v1/chat/completions with "<served>:<name>")."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ktflow.errors import SwapError
from ktflow.stages.serve import swap_sglang_adapter

KEY = "k" * 24


class FakeSglang:
    """Loaded adapters by name; an adapter whose path contains 'broken' loads but can't answer.

    ``answer(adapter, prompt)`` is what a chat completion returns (``adapter`` is "" for the base
    model, ``model="<served>"``); default "hello"."""

    def __init__(self, answer=lambda adapter, prompt: "hello") -> None:
        self.loaded: dict[str, str] = {}
        self.calls: list[tuple[str, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _reply(self, status: int, doc: dict) -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.calls.append((self.path, payload))
                if self.headers.get("Authorization") != f"Bearer {KEY}":
                    return self._reply(401, {"error": "bad key"})
                if self.path == "/load_lora_adapter":
                    if payload["lora_name"] in fake.loaded:
                        return self._reply(400, {"error": "already loaded"})
                    fake.loaded[payload["lora_name"]] = payload["lora_path"]
                    return self._reply(200, {"success": True})
                if self.path == "/unload_lora_adapter":
                    fake.loaded.pop(payload["lora_name"], None)
                    return self._reply(200, {"success": True})
                if self.path == "/v1/chat/completions":
                    _, _, name = payload["model"].partition(":")
                    if name and (name not in fake.loaded or "broken" in fake.loaded[name]):
                        return self._reply(500, {"error": "adapter failed"})
                    content = answer(name, payload["messages"][-1]["content"])
                    return self._reply(200, {
                        "id": "x", "object": "chat.completion", "created": 0, "model": payload["model"],
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": content}}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
                    })
                return self._reply(404, {})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def sglang():
    fake = FakeSglang()
    yield fake
    fake.server.shutdown()


def swap(fake: FakeSglang, adapter: Path, record: Path):
    return swap_sglang_adapter(fake.url, KEY, served_model_name="kimi", adapter_name="tuned",
                               new_adapter_dir=adapter, record_dir=record)


def test_versioned_load_smoke_then_unload_the_old(sglang: FakeSglang, tmp_path: Path) -> None:
    first = swap(sglang, tmp_path / "a1", tmp_path / "rec")
    assert first.current.name == "tuned-v1" and first.previous is None
    second = swap(sglang, tmp_path / "a2", tmp_path / "rec")
    assert second.current.name == "tuned-v2" and second.previous.name == "tuned-v1"
    assert sglang.loaded == {"tuned-v2": str(tmp_path / "a2")}  # the old one unloaded only after the new answered
    paths = [path for path, _ in sglang.calls]
    assert paths.index("/unload_lora_adapter") > paths.index("/v1/chat/completions")
    assert json.loads((tmp_path / "rec" / "sglang-adapters.json").read_text())["current"]["name"] == "tuned-v2"


def test_a_failing_new_adapter_is_unloaded_and_the_old_keeps_serving(sglang: FakeSglang, tmp_path: Path) -> None:
    swap(sglang, tmp_path / "good", tmp_path / "rec")
    with pytest.raises(SwapError) as info:
        swap(sglang, tmp_path / "broken", tmp_path / "rec")
    assert info.value.rolled_back
    assert sglang.loaded == {"tuned-v1": str(tmp_path / "good")}
    record = json.loads((tmp_path / "rec" / "sglang-adapters.json").read_text())
    assert record["current"]["name"] == "tuned-v1"


def test_a_refused_load_changes_nothing(sglang: FakeSglang, tmp_path: Path) -> None:
    swap(sglang, tmp_path / "good", tmp_path / "rec")
    sglang.loaded["tuned-v2"] = "squatter"  # the next versioned name is taken: SGLang answers 400
    with pytest.raises(SwapError, match="HTTP 400"):
        swap(sglang, tmp_path / "new", tmp_path / "rec")
    assert sglang.loaded["tuned-v1"] == str(tmp_path / "good")
