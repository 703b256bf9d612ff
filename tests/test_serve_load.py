"""benchmarks/serve_load.py against a real HTTP server in the test: a stdlib OpenAI-style SSE endpoint with a
fixed first-token delay and per-token delay, which counts the requests it has in flight at once. The floor
arithmetic is checked against hand-computed bytes."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import serve_load  # noqa: E402

FIRST_DELAY_S = 0.15  # before the first token
TOKEN_DELAY_S = 0.03  # between later tokens
TOKENS = 12
GATHER_S = 10.0  # how long a tagged request waits for its level's other requests


class FakeServer(ThreadingHTTPServer):
    """POST /v1/chat/completions, ``stream: true`` only: TOKENS content chunks, a usage chunk, ``[DONE]``."""

    daemon_threads = True
    request_queue_size = 64  # listen backlog (stdlib: 5): a level of 16 connects at once must not overflow it

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock = threading.Condition()
        self.in_flight = self.max_in_flight = self.arrived = 0
        self.fail_every = 0  # every n-th arriving request gets HTTP 500 (0: none)
        self.usage = True  # False: no usage chunk (a server that ignores stream_options)
        self.repeat_from = TOKENS  # from this token on, every chunk is the same (a model repeating itself)
        self.bodies: list[dict[str, Any]] = []


class Handler(BaseHTTPRequestHandler):
    server: FakeServer

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_POST(self) -> None:  # noqa: N802  (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        with srv.lock:
            srv.arrived += 1
            n = srv.arrived
            srv.bodies.append(body)
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
            srv.lock.notify_all()
            # A request tagged "c<N>" (serve_load's tag: its level's concurrency) is held until N are in flight
            # (at most GATHER_S): the level's overlap then does not rest on how fast this box starts threads.
            gather = re.search(r"\bc(\d+) r\d+\]", str(body.get("messages", [{}])[0].get("content", "")))
            if gather:
                srv.lock.wait_for(lambda: srv.in_flight >= int(gather.group(1)), timeout=GATHER_S)
        try:
            if self.path != "/v1/chat/completions" or not body.get("stream"):
                self.send_error(404)
            elif srv.fail_every and n % srv.fail_every == 0:
                payload = json.dumps({"error": {"message": "injected failure", "type": "server_error"}}).encode()
                self.send_response(500)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            else:
                self._stream(body)
        finally:
            with srv.lock:
                srv.in_flight -= 1

    def _stream(self, body: dict[str, Any]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes

        def send(obj: dict[str, Any] | str) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        base = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
        send({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        time.sleep(FIRST_DELAY_S)
        for i in range(TOKENS):
            if i:
                time.sleep(TOKEN_DELAY_S)
            finish = "length" if i == TOKENS - 1 else None
            text = f"t{min(i, self.server.repeat_from)} "
            send({**base, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]})
        words = sum(len(str(m["content"]).split()) for m in body["messages"])
        if self.server.usage:
                send({**base, "choices": [], "usage": {"prompt_tokens": words, "completion_tokens": TOKENS,
                                                    "total_tokens": words + TOKENS}})
        send("[DONE]")


@pytest.fixture
def server() -> Iterator[FakeServer]:
    srv = FakeServer()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)


def client_for(srv: FakeServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1", api_key="EMPTY", max_retries=0,
                         timeout=30)


def test_level_runs_requests_concurrently_and_times_them(server: FakeServer) -> None:
    prompts = serve_load.build_prompts(8, seed=1)
    level = serve_load.run_level(client_for(server), "base:adapter", prompts, 4, 32, timeout_s=30, tag="t")
    assert server.max_in_flight == 4 and level["max_in_flight"] == 4
    assert level["requests"] == 8 and level["errors"] == 0 and len(level["rows"]) == 8
    for row in level["rows"]:
        assert FIRST_DELAY_S <= row["ttft_s"] < FIRST_DELAY_S + 1
        assert row["completion_tokens"] == TOKENS and row["usage_source"] == "server"
        assert row["finish_reason"] == "length"
        assert row["distinct_chunks"] == TOKENS and row["completion_head"].startswith("t0 t1 ")
    assert level["completion_tokens"] == 8 * TOKENS and level["distinct_share_median"] == 1
    # the server's per-token delay sets the rate; timing jitter only widens it (both ways, generously)
    assert 0.25 / TOKEN_DELAY_S <= level["decode_tokens_per_s_median"] <= 2 / TOKEN_DELAY_S
    assert FIRST_DELAY_S <= level["ttft_s"]["p50"] <= level["ttft_s"]["p95"] <= level["ttft_s"]["max"]
    assert level["prefill_tokens_per_s_median"] > 0 and level["prefill_tokens_per_s_aggregate"] > 0
    assert level["output_tokens_per_s"] == pytest.approx(8 * TOKENS / level["wall_s"])
    # what was sent: the model name passed through, greedy, usage asked for, a unique tag on every prompt
    body = server.bodies[0]
    assert body["model"] == "base:adapter" and body["temperature"] == 0 and body["max_tokens"] == 32
    assert body["stream_options"] == {"include_usage": True} and "ignore_eos" not in body
    firsts = [b["messages"][0]["content"] for b in server.bodies]
    assert len(set(firsts)) == 8 and all(f.startswith("[t c4 r") for f in firsts)


def test_failed_requests_are_counted_not_fatal(server: FakeServer) -> None:
    server.fail_every = 3
    level = serve_load.run_level(client_for(server), "m", serve_load.build_prompts(4, 0), 2, 16, requests=6,
                                 timeout_s=30)
    assert level["requests"] == 6 and level["errors"] == 2 and level["ok"] == 4
    assert all("500" in e or "InternalServerError" in e for e in level["error_samples"])
    assert level["completion_tokens"] == 4 * TOKENS and level["ttft_s"]["p50"] is not None


def test_prompts_are_deterministic_and_varied() -> None:
    a, b = serve_load.build_prompts(32, 7), serve_load.build_prompts(32, 7)
    assert a == b and a != serve_load.build_prompts(32, 8)
    words = [sum(len(m["content"].split()) for m in p) for p in a]
    assert len(a) == 32 and min(words) < 60 and max(words) > 280
    assert all(p[-1]["role"] == "user" for p in a)


CONFIG = {"num_hidden_layers": 4, "first_k_dense_replace": 1, "num_experts_per_tok": 2, "hidden_size": 64,
          "moe_intermediate_size": 32, "n_routed_experts": 16}


def test_floor_arithmetic_by_hand() -> None:
    # 3 MoE layers x top-2 = 6 experts per token; each: gate + up (32 rows x 64 inputs), down (64 rows x 32 inputs)
    # BF16: 3 x 32 x 64 x 2 = 12288 B an expert
    assert serve_load.active_expert_bytes_per_token(CONFIG, "BF16") == 6 * 12288
    assert serve_load.active_expert_bytes_per_token(CONFIG, "AMXBF16") == 6 * 12288
    # RAWINT4: gate/up 32 x (32 nibble bytes + 2 groups x 2 B) = 1152 each; down 64 x (16 + 1 x 2) = 1152
    assert serve_load.active_expert_bytes_per_token(CONFIG, "RAWINT4") == 6 * 3456
    # AMXINT8: gate/up 32 x 64 + 4 x 32 = 2176 each; down 64 x 32 + 4 x 64 = 2304
    assert serve_load.active_expert_bytes_per_token(CONFIG, "amxint8") == 6 * (2 * 2176 + 2304)
    floor = serve_load.decode_floor(CONFIG, "RAWINT4", read_gb_s=2.0736e-5)  # 20736 B at 20736 B/s
    assert floor["moe_layers"] == 3 and floor["active_expert_bytes_per_token"] == 20736
    assert floor["floor_s_per_token"] == pytest.approx(1.0) and floor["floor_tokens_per_s"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        serve_load.active_expert_bytes_per_token(CONFIG, "Q4_K")


def test_nested_text_config_is_read() -> None:
    kimi = {"architectures": ["KimiK25ForConditionalGeneration"], "vision_config": {"hidden_size": 1152},
            "text_config": CONFIG}
    assert serve_load.active_expert_bytes_per_token(kimi, "BF16") == 6 * 12288
    # Kimi-K2's widths: 60 MoE layers x top-8 x 24,772,608 B (RAWINT4 at 0.5625 B a weight) = 11.89 GB a token
    k2 = {"text_config": {"num_hidden_layers": 61, "first_k_dense_replace": 1, "num_experts_per_tok": 8,
                          "hidden_size": 7168, "moe_intermediate_size": 2048}}
    assert serve_load.active_expert_bytes_per_token(k2, "RAWINT4") == 60 * 8 * 3 * 2048 * 7168 * 9 // 16


def test_read_bandwidth_is_measured() -> None:
    gb_s = serve_load.measure_read_bandwidth(0.25, 1)
    assert isinstance(gb_s, float) and gb_s > 0


def test_main_end_to_end_writes_three_levels(server: FakeServer, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"text_config": CONFIG}))
    out = tmp_path / "out" / "load.json"
    rc = serve_load.main(["--base-url", f"http://127.0.0.1:{server.server_address[1]}/v1", "--model", "b:a",
                          "--max-tokens", "16", "--model-dir", str(model_dir), "--kt-method", "RAWINT4",
                          "--bandwidth-gib", "0.0625", "--bandwidth-threads", "1", "--bandwidth-repeats", "2",
                          "--server-pid", str(os.getpid()), "--label", "RAWINT4", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0, [lv["error_samples"] for lv in doc["levels"]]
    assert {"label", "settings", "host", "bandwidth", "floor", "decode_vs_floor", "warmup", "levels"} <= set(doc)
    assert doc["label"] == "RAWINT4" and doc["warmup"]["requests"] == 1 and "api_key" not in doc["settings"]
    assert [lv["concurrency"] for lv in doc["levels"]] == [1, 4, 16]
    assert [lv["requests"] for lv in doc["levels"]] == [4, 8, 32]
    assert server.arrived == 1 + 4 + 8 + 32 and server.max_in_flight == 16
    assert all(lv["errors"] == 0 and len(lv["rows"]) == lv["requests"] for lv in doc["levels"])
    assert all(lv["peak_server_rss_bytes"] > 0 for lv in doc["levels"])
    if shutil.which("nvidia-smi") is None:
        assert all(lv["peak_gpu_mem_used_mib"] is None for lv in doc["levels"])
    assert doc["bandwidth"]["read_gb_s"] > 0 and doc["bandwidth"]["threads"] == 1
    assert doc["floor"]["active_expert_bytes_per_token"] == 20736
    vs = doc["decode_vs_floor"]
    assert vs["measured_decode_tokens_per_s"] == doc["levels"][0]["decode_tokens_per_s_median"]
    assert vs["decode_over_floor"] == pytest.approx(vs["floor_tokens_per_s"] / vs["measured_decode_tokens_per_s"])
    assert doc["host"]["cpu"] and doc["host"]["logical_cores"]
    assert all(body.get("ignore_eos") is True for body in server.bodies)  # exactly max_tokens each, by default


def test_prompts_file_and_usage_fallback(server: FakeServer, tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n\n")
    prompts = serve_load.load_prompts(path)
    assert prompts == [[{"role": "user", "content": "hi"}]]
    # no usage chunk: completion tokens counted from content chunks, and marked so; prompt tokens unknown
    server.usage = False
    level = serve_load.run_level(client_for(server), "m", prompts, 1, 16, requests=1, timeout_s=30)
    row = level["rows"][0]
    assert row["usage_source"] == "chunks" and row["completion_tokens"] == TOKENS and row["prompt_tokens"] is None
    assert level["usage_from_chunks"] == 1 and level["prefill_tokens_per_s_median"] is None
    assert level["decode_tokens_per_s_median"] is not None


def test_a_completion_that_repeats_itself_says_so(server: FakeServer) -> None:
    """Two servers of one geometry can decode at different rates when one repeats itself: each row keeps how many of
    its chunks differ and the completion's start, each level the median share."""
    server.repeat_from = 2  # t0 t1 t2 t2 t2 ...
    level = serve_load.run_level(client_for(server), "m", serve_load.build_prompts(2, seed=1), 1, 16, requests=2,
                                 timeout_s=30)
    row = level["rows"][0]
    assert row["content_chunks"] == TOKENS and row["distinct_chunks"] == 3
    assert row["completion_head"].startswith("t0 t1 t2 t2 ")
    assert level["distinct_share_median"] == pytest.approx(3 / TOKENS)


def test_prompts_that_would_not_fit_the_servers_context_are_left_out(fixture_dir) -> None:
    """A server refuses a prompt longer than its context (HTTP 400): the harness counts each prompt with the
    model's own tokenizer and chat template and leaves out those that would not fit with max_tokens."""
    from transformers import AutoTokenizer

    model_dir = fixture_dir("bf16")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = serve_load.build_prompts(12, seed=3)
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in prompts]
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert len(set(lengths)) > 8  # prompts of many lengths
    context = sorted(lengths)[6] + serve_load.TAG_TOKENS + 64  # the 7 shortest fit with 64 tokens to generate
    kept, counted = serve_load.fit_to_context(prompts, model_dir, context, 64)
    assert len(kept) == 7 and sorted(counted) == sorted(lengths)[:7]
    assert all(n + serve_load.TAG_TOKENS + 64 <= context for n in counted)
    assert [prompts.index(m) for m in kept] == sorted(prompts.index(m) for m in kept)  # order kept
