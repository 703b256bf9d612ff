"""Fake ``sglang.launch_server``: parses the flags ktflow passes and serves a canned answer, as sglang-kt
would: the base model answers "hello", the adapter "hello (<adapter folder>) nya~", and with an adapter
loaded a base request is refused (sglang-kt pairs its KT expert LoRA statically with that adapter).

For ``ktflow tune-serving``: a streamed chat answer comes a token every TOKEN_S, sped up by the engine's levers as
no real engine promises (deferral d: x(1 + d/2); chunked prefill 4096: x1.25; more than 2 KT threads: x0.5, as
a pool on every core of the tests' 4-core host would starve the scheduler), and ``/generate`` gives prompt
logprobs of LOGPROB a token, except with deferral 2, whose answers are fast and wrong (its loss is 0.01 higher)."""

import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--host")
parser.add_argument("--port", type=int)
parser.add_argument("--api-key")
parser.add_argument("--served-model-name")
parser.add_argument("--lora-paths", nargs="*")
parser.add_argument("--kt-max-deferred-experts-per-token", type=int, default=0)
parser.add_argument("--chunked-prefill-size", type=int, default=None)
parser.add_argument("--kt-cpuinfer", type=int, default=None)
args, _ = parser.parse_known_args(sys.argv[1:])
TOKEN_S, LOGPROB = 0.01, -0.05
speedup = (1 + args.kt_max_deferred_experts_per_token / 2) * (1.25 if args.chunked_prefill_size == 4096 else 1.0)
speedup *= 0.5 if (args.kt_cpuinfer or 0) > 2 else 1.0
logprob = LOGPROB - (0.01 if args.kt_max_deferred_experts_per_token == 2 else 0.0)
adapters = dict(p.split("=", 1) for p in (args.lora_paths or []))
models = [args.served_model_name] + [f"{args.served_model_name}:{a}" for a in adapters]


def answer(model):
    """The reply to ``model``, or None when this server refuses it."""
    if model == args.served_model_name:
        return None if adapters else "hello"
    adapter = model.split(":", 1)[1] if ":" in model else None
    return f"hello ({adapters[adapter].rstrip('/').rsplit('/', 1)[-1]}) nya~" if adapter in adapters else None


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _reply(self, status, doc):
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self):
        return self.headers.get("Authorization") == f"Bearer {args.api_key}"

    def do_GET(self):
        if not self._authorized():
            return self._reply(401, {"error": "unauthorized"})
        if self.path == "/health":
            return self._reply(200, {})
        if self.path == "/v1/models":
            return self._reply(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in models]})
        self._reply(404, {})

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not self._authorized():
            return self._reply(401, {"error": "unauthorized"})
        if self.path == "/generate":
            ids = payload["input_ids"]
            return self._reply(200, {"text": "x", "meta_info": {
                "input_token_logprobs": [[None, ids[0], None]] + [[logprob, i, None] for i in ids[1:]]}})
        if self.path == "/v1/chat/completions" and payload.get("model") in models:
            content = answer(payload["model"])
            if content is None:
                return self._reply(400, {"error": "This server has KT expert LoRA statically paired with adapter "
                                                  f"{next(iter(adapters))!r}; base requests are not supported."})
            if payload.get("stream"):
                return self._stream(payload, int(payload.get("max_tokens") or 8))
            return self._reply(200, {"id": "x", "object": "chat.completion", "created": 0, "model": payload["model"],
                                     "choices": [{"index": 0, "finish_reason": "stop",
                                                  "message": {"role": "assistant", "content": content}}],
                                     "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}})
        self._reply(404, {"error": f"unknown model {payload.get('model')}"})

    def _stream(self, payload, tokens):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": payload["model"]}
        for i in range(tokens):
            time.sleep(TOKEN_S / speedup)
            self._event({**base, "choices": [{"index": 0, "delta": {"content": "x"},
                                              "finish_reason": "length" if i == tokens - 1 else None}]})
        self._event({**base, "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": tokens,
                                                       "total_tokens": 4 + tokens}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, doc):
        self.wfile.write(f"data: {json.dumps(doc)}\n\n".encode())
        self.wfile.flush()


print(f"fake sglang argv: {json.dumps([a for a in sys.argv[1:] if not a.startswith('--api-key')])}", flush=True)
print(f"fake sglang serving {models} on {args.host}:{args.port}", flush=True)
ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
