"""Serving load on a live OpenAI-compatible server (sglang-kt with KT CPU experts): TTFT, prefill and decode
rates by concurrency, peak GPU memory and server RSS, and decode against the host's memory-bandwidth floor.

Command (on the GPU host, the server already up; the serving venv has openai, psutil and torch):

    PYTHONPATH=. python benchmarks/serve_load.py --base-url http://127.0.0.1:30000/v1 --model BASE:ADAPTER \\
        --model-dir MODEL_DIR --kt-method RAWINT4 --server-pid PID --label RAWINT4 --json serve-load.json
    # options: [--concurrency 1,4,16] [--requests-per-level N] [--max-tokens 64] [--warmup 1] [--timeout-s 300]
    #          [--prompts FILE.jsonl | --num-prompts 32 --seed 0] [--api-key KEY] [--allow-prefix-cache]
    #          [--context-length N (with --model-dir: leave out prompts that do not fit)] [--stop-at-eos]
    #          [--no-bandwidth | --bandwidth-gib 4 --bandwidth-threads N --bandwidth-repeats 5]

What it does:
1. Host facts (CPU model, cores, memory, package versions; GPUs from ``nvidia-smi`` when present).
2. Host memory read bandwidth, once, before any request (the server idle): torch ``float32`` ``sum`` over a
   ``--bandwidth-gib`` buffer on the CPU at ``--bandwidth-threads`` (default: physical cores), best of
   ``--bandwidth-repeats``. GB/s = buffer bytes / best time / 1e9.
3. The decode floor from ``MODEL_DIR/config.json`` (Kimi-K2.5 nests the DeepSeek-V3 fields under
   ``text_config``; else the top level is read). Decoding one token of one sequence reads, in every MoE layer,
   the top-k routed experts' three matrices (gate and up: moe_intermediate rows x hidden inputs; down: hidden
   rows x moe_intermediate inputs) from host memory:

       moe_layers   = layers i in [first_k_dense_replace, num_hidden_layers) with i % moe_layer_freq == 0
                      (moe_layer_freq defaults to 1: num_hidden_layers - first_k_dense_replace)
       active_bytes = moe_layers * num_experts_per_tok * expert_bytes(kt_method)
       expert_bytes ~ 3 * moe_intermediate * hidden * bytes_per_weight, exactly, per matrix of R rows x K inputs:
           RAWINT4          R * (K/2 + 2 * ceil(K/32))   INT4 nibbles + one BF16 scale per group of 32 (0.5 + 2/32)
           AMXINT8          R * (K + 4)                  one byte a weight + one fp32 scale per output row
           AMXINT4          R * (K/2 + 4)                two weights a byte + one fp32 scale per output row
           BF16 / AMXBF16   R * K * 2
       floor_s_per_token  = active_bytes / (read_gb_s * 1e9)
       floor_tokens_per_s = 1 / floor_s_per_token
       decode_over_floor  = floor_tokens_per_s / measured decode tokens/s at concurrency 1
                            (how many times slower than reading the active experts once per token)

   The floor ignores everything else a step costs (attention and shared experts on the GPU, the GPU <-> CPU
   hand-off, kernel overheads), so the measured rate is always below it; only concurrency 1 is compared
   (with more sequences in a batch their experts overlap and the bytes per token fall).
4. ``--warmup`` requests, one at a time, not counted. Then, per concurrency level, in order:
   ``--requests-per-level`` requests (default max(2 x concurrency, 4)), ``concurrency`` of them in flight at
   once (a thread per slot, one shared ``openai`` client, no client retries), each a streaming chat completion
   (temperature 0, ``max_tokens``, ``stream_options.include_usage``, and SGLang's ``ignore_eos`` unless
   ``--stop-at-eos``: every request decodes ``max_tokens`` tokens, as serving benchmarks do, whatever the model
   would answer). With ``--context-length`` the prompts that would not fit the server's context with
   ``max_tokens`` to generate (counted with ``--model-dir``'s tokenizer and its chat template) are left out first.
   Every level starts at prompt 0, so the
   levels send the same prompts. Unless ``--allow-prefix-cache``, each request's first message starts with a
   tag unique to this run, level and request, so SGLang's radix (prefix) cache cannot serve a prefill measured
   here from an earlier request.

Per request: TTFT (send -> the first chunk with non-empty ``content`` or ``reasoning_content``), end time
(the stream closed), prompt_tokens and completion_tokens from the usage chunk (without one: completion tokens
= content chunks, marked ``usage_source: "chunks"``, prompt tokens unknown).

Per level: requests, errors, wall (first send -> last end), TTFT p50 / p95 / max (nearest rank; at
concurrency > 1 TTFT includes waiting behind other requests), prefill tokens/s as the median over requests
of prompt_tokens / TTFT and as an aggregate (all prompt tokens / the time at least one request was waiting
for its first token), decode tokens/s per request (median of (completion_tokens - 1) / (end - first token)),
aggregate output tokens/s (all completion tokens / wall), the most requests the client had in flight, and,
sampled every 0.2 s while the level runs: peak ``memory.used`` per GPU (``nvidia-smi``; null without it)
and peak RSS of ``--server-pid``'s process tree (children included; shared pages count once per process
that maps them; null without the option).

Output: a table on stdout; ``--json PATH`` writes settings, host facts, the bandwidth, the floor, every level
and every request's raw row. Exit status 1 when any counted request failed (the JSON is still written).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import host_info  # noqa: E402  (stdlib + psutil only)

PACKAGES = ("openai", "httpx", "psutil", "torch", "sglang", "sglang-kt", "kt-kernel", "ktflow")
DEFAULT_LEVELS = (1, 4, 16)
SAMPLE_INTERVAL_S = 0.2
KT_METHODS = ("RAWINT4", "AMXINT8", "AMXINT4", "BF16", "AMXBF16")

# --------------------------------------------------------------------------- prompts

_WORDS = (
    "the of and to in is that it for was on are as with be at by this had not but from or have an they which one "
    "you were all we when your can said there use each she do how their if will up other about out many then them "
    "these so some her would make like him into time has look two more write go see number no way could people my "
    "than first water been call who oil its now find long down day did get come made may part over new sound take "
    "only little work know place year live me back give most very after thing our just name good sentence man "
    "think say great where help through much before line right too mean old any same tell boy follow came want "
    "show also around form three small set put end does another well large must big even such because turn here "
    "why ask went men read need land different home us move try kind hand picture again change off play spell air "
    "away animal house point page letter mother answer found study still learn should world high every near add "
    "food between own below country plant last school father keep tree never start city earth eye light thought "
    "head under story saw left few while along might close something seem next hard open example begin life always "
    "those both paper together got group often run important until children side feet car mile night walk white "
    "sea began grow took river four carry state once book hear stop without second later miss idea enough eat face "
    "watch far real almost let above girl sometimes mountain cut young talk soon list song being leave family"
).split()
_TASKS = (
    "Summarize the following notes in two sentences.",
    "List three questions a careful reader might ask about this text.",
    "Rewrite the following paragraph in plain language.",
    "Extract the key facts from this passage as short bullet points.",
    "Continue this story for a few sentences, keeping its tone.",
    "Give this passage a title and explain your choice briefly.",
    "Point out anything in this text that seems inconsistent.",
    "Translate the gist of the following text into simple French.",
)
_SYSTEM = "You are a concise, helpful assistant."
# Passage words per prompt, spread evenly over this range (then shuffled): with the task line and the chat
# template about 50-400 tokens under a BPE tokenizer; the server's usage chunk gives the exact count.
_PASSAGE_WORDS = (35, 290)


def build_prompts(n: int = 32, seed: int = 0) -> list[list[dict[str, str]]]:
    """``n`` chat prompts (OpenAI ``messages`` lists) of varied lengths, the same for the same ``(n, seed)``.

    Lengths are spread evenly over ``_PASSAGE_WORDS`` rather than drawn, so every set covers the whole range.
    """
    rng = random.Random(seed)
    lo, hi = _PASSAGE_WORDS
    lengths = [lo + round(i * (hi - lo) / max(n - 1, 1)) for i in range(n)]
    rng.shuffle(lengths)
    prompts: list[list[dict[str, str]]] = []
    for i, words in enumerate(lengths):
        sentences: list[str] = []
        left = words
        while left > 0:
            k = min(left, rng.randint(6, 14))
            chosen = [rng.choice(_WORDS) for _ in range(k)]
            sentences.append(" ".join(chosen).capitalize() + ".")
            left -= k
        user = {"role": "user", "content": f"{_TASKS[i % len(_TASKS)]}\n\n{' '.join(sentences)}"}
        # every third prompt carries a system message: the template differs a little between requests
        prompts.append([{"role": "system", "content": _SYSTEM}, user] if i % 3 == 0 else [user])
    return prompts


def load_prompts(path: Path) -> list[list[dict[str, Any]]]:
    """Prompts from a JSONL file of ``{"messages": [...]}`` records (blank lines skipped)."""
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("messages"), list) or not record["messages"]:
                raise ValueError(f"{path}:{n}: expected {{\"messages\": [...]}} with at least one message")
            prompts.append(record["messages"])
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


TAG_TOKENS = 24  # what the per-request tag adds to a prompt, at most


def fit_to_context(prompts: list[list[dict[str, Any]]], model_dir: Path, context_length: int,
                   max_tokens: int) -> tuple[list[list[dict[str, Any]]], list[int]]:
    """The prompts whose chat-templated tokens (the model's own tokenizer) plus the tag and ``max_tokens`` fit
    ``context_length`` (a server refuses the rest), and each kept prompt's token count."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=True)
    kept, lengths = [], []
    for messages in prompts:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        n = len(ids)
        if n + TAG_TOKENS + max_tokens <= context_length:
            kept.append(messages)
            lengths.append(n)
    return kept, lengths


def tagged(messages: list[dict[str, Any]], tag: str | None) -> list[dict[str, Any]]:
    """``messages`` with ``tag`` at the start of the first message (a new system message if that one's content
    is not plain text): a prefix no earlier request shared, so the server's prefix cache cannot skip the prefill."""
    if not tag:
        return messages
    first = messages[0]
    if isinstance(first.get("content"), str):
        return [{**first, "content": f"[{tag}] {first['content']}"}, *messages[1:]]
    return [{"role": "system", "content": f"[{tag}]"}, *messages]


# --------------------------------------------------------------------------- the decode floor


def moe_dims(config: dict[str, Any]) -> dict[str, int]:
    """The routed-expert dimensions of a DeepSeek-V3-style config (Kimi-K2.5: under ``text_config``)."""
    text = config.get("text_config") or config
    layers, first_dense = int(text["num_hidden_layers"]), int(text.get("first_k_dense_replace") or 0)
    freq = int(text.get("moe_layer_freq") or 1)
    return {"num_hidden_layers": layers, "first_k_dense_replace": first_dense, "moe_layer_freq": freq,
            "moe_layers": sum(1 for i in range(first_dense, layers) if i % freq == 0),
            "num_experts_per_tok": int(text["num_experts_per_tok"]), "hidden_size": int(text["hidden_size"]),
            "moe_intermediate_size": int(text["moe_intermediate_size"])}


def matrix_bytes(rows: int, inputs: int, kt_method: str) -> int:
    """Bytes of one expert matrix (``rows`` outputs x ``inputs``) as ``--kt-method`` stores it for the CPU."""
    method = kt_method.upper()
    if method == "RAWINT4":  # two weights a byte, one BF16 scale per group of 32 inputs
        return rows * (math.ceil(inputs / 2) + 2 * math.ceil(inputs / 32))
    if method == "AMXINT8":  # one byte a weight, one fp32 scale per output row
        return rows * (inputs + 4)
    if method == "AMXINT4":  # two weights a byte, one fp32 scale per output row (no groups)
        return rows * (math.ceil(inputs / 2) + 4)
    if method in ("BF16", "AMXBF16"):
        return rows * inputs * 2
    raise ValueError(f"unknown kt method {kt_method!r}; known: {', '.join(KT_METHODS)}")


def active_expert_bytes_per_token(config: dict[str, Any], kt_method: str) -> int:
    """Routed-expert bytes one decoded token reads: moe_layers x top-k x (gate + up + down) (module docstring)."""
    d = moe_dims(config)
    hidden, inter = d["hidden_size"], d["moe_intermediate_size"]
    expert = 2 * matrix_bytes(inter, hidden, kt_method) + matrix_bytes(hidden, inter, kt_method)
    return d["moe_layers"] * d["num_experts_per_tok"] * expert


def decode_floor(config: dict[str, Any], kt_method: str, read_gb_s: float) -> dict[str, Any]:
    """The bandwidth floor of decoding one sequence: the active experts' bytes read once per token."""
    active = active_expert_bytes_per_token(config, kt_method)
    floor_s = active / (read_gb_s * 1e9)
    return {"kt_method": kt_method.upper(), **moe_dims(config), "active_expert_bytes_per_token": active,
            "read_gb_s": read_gb_s, "floor_s_per_token": floor_s, "floor_tokens_per_s": 1 / floor_s}


# --------------------------------------------------------------------------- host memory bandwidth


def read_bandwidth_samples(gib: float, threads: int, repeats: int = 5) -> list[float]:
    """GB/s of each of ``repeats`` torch ``float32`` sums over a ``gib`` GiB buffer at ``threads`` threads."""
    import torch

    n = int(gib * (1 << 30)) // 4
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.empty(n, dtype=torch.float32).fill_(1.0)  # touched: every page resident before timing
        buf.sum()  # warm (thread pool start-up)
        rates = []
        for _ in range(repeats):
            t = time.perf_counter()
            buf.sum()
            rates.append(4 * n / (time.perf_counter() - t) / 1e9)
        return rates
    finally:
        torch.set_num_threads(before)


def measure_read_bandwidth(gib: float, threads: int, repeats: int = 5) -> float:
    """Host memory read bandwidth in GB/s: the best of :func:`read_bandwidth_samples`."""
    return max(read_bandwidth_samples(gib, threads, repeats))


def bandwidth_record(gib: float = 4.0, threads: int | None = None, repeats: int = 5) -> dict[str, Any]:
    """The read bandwidth as the JSON records it: best and median GB/s of ``repeats``, at ``threads``
    (default: physical cores)."""
    threads = threads or psutil.cpu_count(logical=False) or os.cpu_count() or 1
    rates = read_bandwidth_samples(gib, threads, repeats)
    return {"read_gb_s": max(rates), "read_gb_s_median": statistics.median(rates), "threads": threads, "gib": gib,
            "repeats": repeats, "samples_gb_s": rates,
            "how": "torch float32 sum over the buffer on the CPU, before any request; best of the repeats"}


# --------------------------------------------------------------------------- sampling while a level runs


class Sampler:
    """Peak ``memory.used`` per GPU (``nvidia-smi --loop-ms``) and peak RSS of a process tree, every 0.2 s."""

    def __init__(self, server_pid: int | None, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.server_pid, self.interval_s = server_pid, interval_s
        self.gpu_peak: dict[int, int] = {}
        self.rss_peak: int | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._smi: subprocess.Popen[str] | None = None

    def __enter__(self) -> Sampler:
        if self.server_pid is not None:
            self._sample_rss()  # at least one sample, however short the level
            self._threads.append(threading.Thread(target=self._rss_loop, daemon=True))
        if shutil.which("nvidia-smi"):
            argv = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                    f"--loop-ms={int(self.interval_s * 1000)}"]
            self._smi = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._threads.append(threading.Thread(target=self._gpu_loop, daemon=True))
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._smi is not None:
            self._smi.terminate()
            self._smi.wait(timeout=10)
        for t in self._threads:
            t.join(timeout=10)
        if self.server_pid is not None:
            self._sample_rss()

    def _sample_rss(self) -> None:
        assert self.server_pid is not None
        try:
            root = psutil.Process(self.server_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        rss = 0
        for p in procs:
            try:
                rss += p.memory_info().rss
            except psutil.Error:  # a child that exited between the listing and the read
                continue
        self.rss_peak = max(self.rss_peak or 0, rss)

    def _rss_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample_rss()

    def _gpu_loop(self) -> None:
        assert self._smi is not None and self._smi.stdout is not None
        for line in self._smi.stdout:
            try:
                index, used = (int(v) for v in line.split(","))
            except ValueError:
                continue
            self.gpu_peak[index] = max(self.gpu_peak.get(index, 0), used)

    def gpu_peaks_mib(self) -> list[int] | None:
        return [self.gpu_peak[i] for i in sorted(self.gpu_peak)] if self.gpu_peak else None


# --------------------------------------------------------------------------- requests


COMPLETION_HEAD_CHARS = 300  # of each completion kept in its row: enough to see repetition, not the whole text


def one_request(client: Any, model: str, messages: list[dict[str, Any]], max_tokens: int, timeout_s: float,
                t0: float, ignore_eos: bool = False) -> dict[str, Any]:
    """One streaming chat completion; times relative to ``t0`` (``time.perf_counter``).

    ``ignore_eos``: SGLang's sampling parameter, so every request decodes exactly ``max_tokens`` (a tuned
    model that answers in a few tokens would otherwise leave the decode rate resting on a handful of them).

    The row keeps the completion's start and how many of its chunks differ: two servers of one geometry can decode
    at different rates when one repeats itself (the same experts read token after token stay in the CPU's caches),
    so a comparison of rates needs what each generated."""
    row: dict[str, Any] = {"t_send_s": time.perf_counter() - t0, "t_first_s": None, "t_end_s": None, "ttft_s": None,
                           "prompt_tokens": None, "completion_tokens": None, "usage_source": None,
                           "content_chunks": 0, "distinct_chunks": 0, "completion_head": "", "finish_reason": None,
                           "error": None}
    chunks: list[str] = []
    sent = time.perf_counter()
    usage = None
    try:
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, timeout=timeout_s,
            **({"extra_body": {"ignore_eos": True}} if ignore_eos else {}))
        with stream:
            for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    delta = choice.delta
                    # reasoning models stream their thinking as reasoning_content: tokens all the same
                    text = (delta.content or getattr(delta, "reasoning_content", None)) if delta is not None else None
                    if text:
                        row["content_chunks"] += 1
                        chunks.append(text)
                        if row["t_first_s"] is None:
                            row["t_first_s"], row["ttft_s"] = now - t0, now - sent
                    if choice.finish_reason:
                        row["finish_reason"] = choice.finish_reason
                if now - sent > timeout_s:  # the client's timeout bounds each read, this the whole request
                    raise TimeoutError(f"request still streaming after {timeout_s} s")
    except Exception as exc:  # any failure is a counted error, never the end of the level
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
    row["t_end_s"] = time.perf_counter() - t0
    row.update(distinct_chunks=len(set(chunks)), completion_head="".join(chunks)[:COMPLETION_HEAD_CHARS])
    if row["error"] is None:
        if usage is not None and usage.completion_tokens is not None:
            row.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                       usage_source="server")
        else:
            row.update(completion_tokens=row["content_chunks"], usage_source="chunks")
    return row


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile (``p`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def _union_length(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize_level(rows: list[dict[str, Any]], concurrency: int, wall_s: float) -> dict[str, Any]:
    """The per-level figures (module docstring) from the raw rows."""
    ok = [r for r in rows if r["error"] is None]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    prefill = [r["prompt_tokens"] / r["ttft_s"] for r in ok if r["prompt_tokens"] and r["ttft_s"]]
    with_prompt = [r for r in ok if r["prompt_tokens"] and r["ttft_s"] is not None]
    waiting = _union_length([(r["t_send_s"], r["t_first_s"]) for r in with_prompt])
    decode = [(r["completion_tokens"] - 1) / (r["t_end_s"] - r["t_first_s"]) for r in ok
              if r["t_first_s"] is not None and (r["completion_tokens"] or 0) >= 2 and r["t_end_s"] > r["t_first_s"]]
    completion = sum(r["completion_tokens"] or 0 for r in ok)
    errors = [r["error"] for r in rows if r["error"] is not None]
    # the share of each completion's chunks that differ (1: no repeat; near 0: one token over and over)
    distinct = [r["distinct_chunks"] / r["content_chunks"] for r in ok if r.get("content_chunks")]
    return {"concurrency": concurrency, "requests": len(rows), "ok": len(ok), "errors": len(errors),
            "error_samples": errors[:3], "wall_s": wall_s,
            "ttft_s": {"p50": percentile(ttfts, 50), "p95": percentile(ttfts, 95), "max": max(ttfts, default=None)},
            "prefill_tokens_per_s_median": statistics.median(prefill) if prefill else None,
            "prefill_tokens_per_s_aggregate": (sum(r["prompt_tokens"] for r in with_prompt) / waiting
                                               if waiting > 0 else None),
            "decode_tokens_per_s_median": statistics.median(decode) if decode else None,
            "output_tokens_per_s": completion / wall_s if wall_s > 0 else None,
            "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok), "completion_tokens": completion,
            "usage_from_chunks": sum(1 for r in ok if r["usage_source"] == "chunks"),
            "distinct_share_median": statistics.median(distinct) if distinct else None}


def run_level(client: Any, model: str, prompts: Sequence[list[dict[str, Any]]], concurrency: int, max_tokens: int,
              *, requests: int | None = None, timeout_s: float = 600.0, server_pid: int | None = None,
              tag: str | None = None, ignore_eos: bool = False) -> dict[str, Any]:
    """Send ``requests`` (default max(2 x concurrency, 4)) requests, ``concurrency`` in flight at once.

    Prompts are taken in order from the first, cycling; ``tag`` (if given) makes each request's prefix unique.
    Returns :func:`summarize_level`'s figures plus ``max_in_flight``, the sampled peaks and the raw ``rows``.
    """
    n = requests if requests is not None else max(2 * concurrency, 4)
    in_flight = peak_in_flight = 0
    lock = threading.Lock()

    def send(i: int) -> dict[str, Any]:
        nonlocal in_flight, peak_in_flight
        messages = tagged(prompts[i % len(prompts)], f"{tag} c{concurrency} r{i}" if tag else None)
        with lock:
            in_flight += 1
            peak_in_flight = max(peak_in_flight, in_flight)
        try:
            return {"index": i, "prompt_index": i % len(prompts),
                    **one_request(client, model, messages, max_tokens, timeout_s, t0, ignore_eos)}
        finally:
            with lock:
                in_flight -= 1

    with Sampler(server_pid) as sampler, ThreadPoolExecutor(max_workers=concurrency) as pool:
        t0 = time.perf_counter()
        rows = list(pool.map(send, range(n)))
        wall = time.perf_counter() - t0
    return {**summarize_level(rows, concurrency, wall), "max_in_flight": peak_in_flight,
            "peak_gpu_mem_used_mib": sampler.gpu_peaks_mib(), "peak_server_rss_bytes": sampler.rss_peak,
            "rows": rows}


# --------------------------------------------------------------------------- report


def gpus() -> list[dict[str, str]] | None:
    if not shutil.which("nvidia-smi"):
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                           "--format=csv,noheader"], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return None
    keys = ("index", "name", "memory_total", "driver")
    return [dict(zip(keys, (v.strip() for v in line.split(",")), strict=False))
            for line in done.stdout.splitlines() if line.strip()]


def _f(value: float | None, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}{fmt}}"


def print_table(levels: list[dict[str, Any]]) -> None:
    print(f"{'conc':>4} {'reqs':>4} {'err':>3} {'wall s':>7} {'TTFT p50':>8} {'p95':>7} {'max ms':>7} "
          f"{'prefill/s':>9} {'agg':>7} {'decode/s':>8} {'out tok/s':>9} {'peak GPU MiB':>13} {'server RSS GiB':>14}")
    for lv in levels:
        ms = {k: None if v is None else v * 1000 for k, v in lv["ttft_s"].items()}
        gpu = "-" if lv["peak_gpu_mem_used_mib"] is None else "/".join(map(str, lv["peak_gpu_mem_used_mib"]))
        rss = None if lv["peak_server_rss_bytes"] is None else lv["peak_server_rss_bytes"] / (1 << 30)
        print(f"{lv['concurrency']:>4} {lv['requests']:>4} {lv['errors']:>3} {lv['wall_s']:7.2f} "
              f"{_f(ms['p50'], '.0f', 8)} {_f(ms['p95'], '.0f', 7)} {_f(ms['max'], '.0f', 7)} "
              f"{_f(lv['prefill_tokens_per_s_median'], '.0f', 9)} {_f(lv['prefill_tokens_per_s_aggregate'], '.0f', 7)} "
              f"{_f(lv['decode_tokens_per_s_median'], '.2f', 8)} {_f(lv['output_tokens_per_s'], '.2f', 9)} "
              f"{gpu:>13} {_f(rss, '.2f', 14)}")
    print("(TTFT: send -> first content chunk, nearest rank; prefill/s: median of prompt tokens / TTFT, agg: all "
          "prompt tokens / time some request awaited its first token; decode/s: median per request of "
          "(completion - 1) / (end - first token); out tok/s: all completion tokens / wall)")


def parse_levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be positive integers: {text!r}")
    return levels


def build_parser() -> argparse.ArgumentParser:
    """The command line of :func:`main` (a caller building an argv checks it here)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="the server's OpenAI API root, e.g. http://127.0.0.1:30000/v1")
    p.add_argument("--model", required=True, help="model name as the server knows it (SGLang LoRA: BASE:ADAPTER)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                   help="default: $OPENAI_API_KEY, else EMPTY (a key that starts with '-': --api-key=KEY)")
    p.add_argument("--concurrency", type=parse_levels, default=list(DEFAULT_LEVELS),
                   help="comma-separated levels, run in order (default 1,4,16)")
    p.add_argument("--requests-per-level", type=int, default=None, help="default: max(2 x concurrency, 4)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default 64)")
    p.add_argument("--warmup", type=int, default=1, help="requests before the levels, not counted (default 1)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request (default 600)")
    p.add_argument("--prompts", type=Path, default=None, help='JSONL of {"messages": [...]} (default: built-in)')
    p.add_argument("--num-prompts", type=int, default=32, help="built-in prompts (default 32)")
    p.add_argument("--seed", type=int, default=0, help="built-in prompts' seed (default 0)")
    p.add_argument("--context-length", type=int, default=None,
                   help="the server's context length: prompts that would not fit it with --max-tokens are left out "
                        "(counted with --model-dir's tokenizer)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="let requests end at the model's EOS (default: SGLang's ignore_eos, exactly --max-tokens each)")
    p.add_argument("--allow-prefix-cache", action="store_true",
                   help="send prompts untagged: repeated prompts may hit the server's prefix cache")
    p.add_argument("--server-pid", type=int, default=None, help="the server's pid: peak RSS of its process tree")
    p.add_argument("--model-dir", type=Path, default=None, help="holds the model's config.json (for the floor)")
    p.add_argument("--kt-method", default=None, type=str.upper, choices=KT_METHODS,
                   help="the server's --kt-method (for the floor)")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the memory bandwidth measurement (no floor)")
    p.add_argument("--read-gb-s", type=float, default=None,
                   help="the host's read bandwidth measured by the caller (e.g. before the server started, whose idle "
                        "kt-kernel threads may spin); used instead of measuring it here")
    p.add_argument("--bandwidth-gib", type=float, default=4.0, help="buffer size (default 4 GiB)")
    p.add_argument("--bandwidth-threads", type=int, default=None, help="default: physical cores")
    p.add_argument("--bandwidth-repeats", type=int, default=5, help="best of (default 5)")
    p.add_argument("--label", default=None, help="stored in the JSON (default: the kt method)")
    p.add_argument("--json", type=Path, default=None, help="write everything to this JSON file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)

    import openai

    prompts = load_prompts(args.prompts) if args.prompts else build_prompts(args.num_prompts, args.seed)
    fitted = None
    if args.context_length:
        if args.model_dir is None:
            p.error("--context-length needs --model-dir (its tokenizer counts the prompts)")
        before = len(prompts)
        prompts, lengths = fit_to_context(prompts, args.model_dir, args.context_length, args.max_tokens)
        if not prompts:
            p.error(f"no prompt fits --context-length {args.context_length} with --max-tokens {args.max_tokens}")
        fitted = {"context_length": args.context_length, "prompts_before": before, "prompts_kept": len(prompts),
                  "prompt_tokens_min": min(lengths), "prompt_tokens_max": max(lengths)}
        print(f"prompts fitted to the context ({args.context_length} tokens with {args.max_tokens} to generate): "
              f"{len(prompts)} of {before} kept, {min(lengths)}-{max(lengths)} tokens", flush=True)
    config = json.loads((args.model_dir / "config.json").read_text()) if args.model_dir else None
    host = {**host_info(PACKAGES), "gpus": gpus(), "load_average_at_start": os.getloadavg()}
    print(f"host: {host['cpu']}, {host['physical_cores']} physical / {host['logical_cores']} logical cores, "
          f"{host['memory_gb']} GB RAM; GPUs: "
          + (", ".join(g.get("name", "?") for g in host["gpus"]) if host["gpus"] else "none seen"), flush=True)

    bandwidth = None
    if args.read_gb_s is not None:
        bandwidth = {"read_gb_s": args.read_gb_s, "how": "given by the caller (--read-gb-s)"}
    elif not args.no_bandwidth:
        bandwidth = bandwidth_record(args.bandwidth_gib, args.bandwidth_threads, args.bandwidth_repeats)
        threads = bandwidth["threads"]
        print(f"memory read bandwidth: {bandwidth['read_gb_s']:.1f} GB/s best, {bandwidth['read_gb_s_median']:.1f} "
              f"median ({threads} threads, {args.bandwidth_gib:g} GiB, {args.bandwidth_repeats} repeats)", flush=True)

    floor, floor_note = None, None
    if config is None or args.kt_method is None or bandwidth is None:
        floor_note = "needs --model-dir, --kt-method and the bandwidth measurement"
    else:
        try:
            floor = decode_floor(config, args.kt_method, bandwidth["read_gb_s"])
        except (KeyError, ValueError) as exc:
            floor_note = f"config.json lacks what the floor needs: {exc}"
    if floor:
        print(f"decode floor ({floor['kt_method']}): {floor['active_expert_bytes_per_token'] / 1e9:.3f} GB of routed "
              f"experts per token ({floor['moe_layers']} MoE layers x top-{floor['num_experts_per_tok']}) / "
              f"{floor['read_gb_s']:.1f} GB/s -> {floor['floor_tokens_per_s']:.2f} tokens/s", flush=True)

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=args.timeout_s)
    run_tag = None if args.allow_prefix_cache else f"run {secrets.token_hex(4)}"
    warm: dict[str, Any] = {"requests": args.warmup, "errors": 0, "wall_s": 0.0}
    if args.warmup:
        w = run_level(client, args.model, prompts, 1, args.max_tokens, requests=args.warmup,
                      timeout_s=args.timeout_s, tag=f"{run_tag} warmup" if run_tag else None,
                      ignore_eos=not args.stop_at_eos)
        warm.update(errors=w["errors"], wall_s=w["wall_s"], error_samples=w["error_samples"])
        print(f"warm-up: {args.warmup} request(s) in {w['wall_s']:.2f} s, {w['errors']} error(s)", flush=True)

    levels = []
    for c in args.concurrency:
        lv = run_level(client, args.model, prompts, c, args.max_tokens, requests=args.requests_per_level,
                       timeout_s=args.timeout_s, server_pid=args.server_pid, tag=run_tag,
                       ignore_eos=not args.stop_at_eos)
        levels.append(lv)
        print(f"  concurrency {c}: {lv['requests']} requests in {lv['wall_s']:.2f} s, {lv['errors']} error(s), "
              f"{lv['max_in_flight']} in flight at most", flush=True)

    one = next((lv for lv in levels if lv["concurrency"] == 1), None)
    measured = one["decode_tokens_per_s_median"] if one else None
    vs_floor = {"concurrency": 1, "measured_decode_tokens_per_s": measured,
                "floor_tokens_per_s": floor["floor_tokens_per_s"] if floor else None,
                "decode_over_floor": floor["floor_tokens_per_s"] / measured if floor and measured else None}

    print(f"\n{args.label or args.kt_method or ''} {args.model} at {args.base_url}: {len(prompts)} prompts "
          f"({args.prompts or f'built-in, seed {args.seed}'}), max_tokens {args.max_tokens}, temperature 0, "
          f"prefix cache {'allowed' if args.allow_prefix_cache else 'bypassed (unique tag per request)'}")
    print_table(levels)
    if vs_floor["decode_over_floor"] is not None:
        print(f"decode at concurrency 1: {measured:.2f} tokens/s measured, floor {vs_floor['floor_tokens_per_s']:.2f} "
              f"tokens/s -> {vs_floor['decode_over_floor']:.2f}x slower than the bandwidth floor")
    else:
        print(f"decode vs floor: not computed ({floor_note or 'no successful concurrency-1 decode'})")

    if args.json:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"}
        settings["prompts_source"] = str(args.prompts) if args.prompts else f"built-in: {len(prompts)} prompts"
        settings["prefix_cache_tag"] = run_tag
        settings["prompts_fitted"] = fitted
        doc = {"label": args.label or args.kt_method, "stamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "settings": settings, "host": host, "bandwidth": bandwidth,
               "model_dims": _dims_or_none(config) if config else None, "floor": floor, "floor_note": floor_note,
               "decode_vs_floor": vs_floor, "warmup": warm, "levels": levels}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if any(lv["errors"] for lv in levels) else 0


def _dims_or_none(config: dict[str, Any]) -> dict[str, int] | None:
    try:
        return moe_dims(config)
    except (KeyError, ValueError, TypeError):
        return None


if __name__ == "__main__":
    sys.exit(main())
