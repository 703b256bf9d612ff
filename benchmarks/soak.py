"""Soak test of the CPU serving backend: many requests, several in flight, no error, bounded memory.

Command (from the repository root):

    .venv/bin/python benchmarks/soak.py
    # options: [-n 200] [--concurrency 8] [--max-tokens 8] [--warmup 16] [--steps 2]
    #          [--max-growth-mb 200] [--max-growth-pct 25] [--workdir DIR] [--keep] [--json PATH]

What it does:
1. In a fresh directory under ``--workdir`` (default ``.ktflow/bench/``; removed unless
   ``--keep``): the tiny bf16 fixture (``ktflow.fixtures.checkpoints.make_fixture``), the demo dataset
   (``ktflow.demo.write_demo_dataset``) and a ``--steps``-step LoRA adapter trained by
   ``ktflow.stages.sft.run_sft`` (recipe ``recipes/tiny-demo.yaml``, ``.venv-train`` as the toolchain) —
   in a child process, so this one never loads torch.
2. Serves it with ``ktflow.stages.serve.serve`` (LlamaFactory's OpenAI API, ``llamafactory-cli api``,
   HuggingFace engine on CPU, adapter merged at load) on a free loopback port.
3. Warm-up: ``--warmup`` requests at ``--concurrency`` (not counted). Then ``-n`` chat completions
   through the ``openai`` client (no retries, temperature 0, ``--max-tokens``) from a thread pool
   of ``--concurrency`` workers, the demo questions in turn, each numbered. A sampler thread reads
   the server's RSS (its whole process tree, ``psutil``) every 0.25 s.
4. Prints, and writes as JSON (``--json``, default ``<workdir>/soak.json``, kept without ``--keep``):
   requests, errors (any exception, or an answer without text), p50 / p95 / max latency (client
   side, nearest rank), requests/s over the measured phase, completion tokens/s, server RSS after
   the warm-up, at its peak, and at the end, and the growth end - after-warm-up (MB and %).
5. Stops the server (``ktflow.stages.serve.stop``) in a ``finally`` and checks with ``psutil`` that nothing
   is left: the server pid gone, no process carrying its ``KTFLOW_SERVER_RUN`` marker, no child of
   this process, the port closed.

Exit 0 when every request succeeded, the growth is within ``--max-growth-mb`` AND
``--max-growth-pct`` of the after-warm-up RSS, and nothing was left behind; 1 otherwise.
``tests/test_soak.py`` runs :func:`run_soak` with the same defaults and asserts the same.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import host_info, report, run_child  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"
RECIPE = REPO / "recipes" / "tiny-demo.yaml"
QUESTIONS = ["What is a shard?", "What does LoRA train?", "Why quantize experts to INT8?", "What does the router do?",
             "What is a mixture of experts?", "Where do the experts run with KTransformers?",
             "Why dequantize INT4 weights?", "What serves the tuned model?"]
MB = 1 << 20


def overrides(work: Path, steps: int) -> list[str]:
    return [f"source.local_path={work / 'fixture'}", "source.format=bf16",
            f"dataset.files=[{work / 'data' / 'train.jsonl'}]", f"evaluation.files=[{work / 'data' / 'eval.jsonl'}]",
            f"store.root={work / 'store'}", f"sft.max_steps={steps}", f"sft.save_steps={steps}",
            f"toolchains.train.python={TRAIN_PYTHON}", "serving.ready_timeout_s=300"]


def job_prepare(work: Path, steps: int) -> dict[str, Any]:
    """In a child: the fixture, the data and the adapter."""
    from ktflow.demo import write_demo_dataset
    from ktflow.fixtures.checkpoints import FixtureSpec, make_fixture
    from ktflow.host.hardware import probe_host
    from ktflow.recipe import load_recipe
    from ktflow.stages.sft import run_sft

    t0 = time.perf_counter()
    make_fixture(FixtureSpec(kind="bf16"), work / "fixture")
    write_demo_dataset(work / "data")
    recipe = load_recipe(RECIPE, overrides(work, steps))
    sft = run_sft(recipe, model_dir=work / "fixture", host=probe_host(recipe.store.root))
    return {"prepare_s": time.perf_counter() - t0, "adapter_dir": str(sft.adapter_dir), "steps": sft.steps}


def tree_rss(pid: int) -> int:
    """RSS (bytes) of ``pid`` and its live descendants; 0 when it is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


class RssSampler:
    """Samples :func:`tree_rss` of ``pid`` every ``interval`` seconds in a thread: (t, bytes) pairs."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - t0, tree_rss(self.pid)))
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def nearest_rank(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = max(1, -(-int(q * 100) * len(sorted_values) // 100))  # ceil(q * n), at least 1
    return sorted_values[min(k, len(sorted_values)) - 1]


def drive(url: str, key: str, model: str, *, n: int, concurrency: int, max_tokens: int, offset: int = 0,
          timeout_s: float = 120.0) -> dict[str, Any]:
    """``n`` chat completions, ``concurrency`` in flight: latencies, errors, tokens, wall."""
    import openai

    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=timeout_s)
    errors: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> tuple[float, int] | None:
        began = time.perf_counter()
        try:
            response = client.chat.completions.create(
                model=model, temperature=0, max_tokens=max_tokens,
                messages=[{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{offset + i})"}])
            if not response.choices or not isinstance(response.choices[0].message.content, str):
                raise ValueError("an answer without text")
            tokens = response.usage.completion_tokens if response.usage else 0
        except Exception as exc:  # noqa: BLE001 - every failure is counted, none stops the soak
            with lock:
                errors.append(f"request {offset + i}: {type(exc).__name__}: {exc}"[:500])
            return None
        return time.perf_counter() - began, tokens

    began = time.perf_counter()
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, range(n)))
    finally:
        client.close()
    wall = time.perf_counter() - began
    ok = [r for r in results if r is not None]
    latencies = sorted(r[0] for r in ok)
    return {"requests": n, "ok": len(ok), "errors": len(errors), "error_samples": errors[:5], "wall_s": wall,
            "requests_per_s": n / wall if wall else 0.0, "completion_tokens": sum(r[1] for r in ok),
            "p50_ms": nearest_rank(latencies, 0.50) * 1000, "p95_ms": nearest_rank(latencies, 0.95) * 1000,
            "max_ms": (latencies[-1] * 1000) if latencies else float("nan"),
            "mean_ms": (sum(latencies) / len(latencies) * 1000) if latencies else float("nan")}


def leftovers(pid: int, run_id: str | None, port: int, already: frozenset[int] = frozenset()) -> dict[str, Any]:
    """What a stopped server left: its pid alive, marked processes, children of ours (but ``already``:
    those that ran before the soak started, e.g. a test session's own servers), an open port."""
    from ktflow.stages.serve import SERVER_MARKER, port_is_open

    def alive(p: int) -> bool:
        try:
            return psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    marked = []
    for proc in psutil.process_iter():
        try:
            if run_id and proc.environ().get(SERVER_MARKER) == run_id and proc.status() != psutil.STATUS_ZOMBIE:
                marked.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    children = [c.pid for c in psutil.Process().children(recursive=True) if c.pid not in already and alive(c.pid)]
    return {"server_alive": alive(pid), "marked": marked, "children": children,
            "port_open": port_is_open("127.0.0.1", port)}


def run_soak(work: Path, *, n: int = 200, concurrency: int = 8, max_tokens: int = 8, warmup: int = 16,
             steps: int = 2, max_growth_mb: float = 200.0, max_growth_pct: float = 25.0,
             log=print) -> dict[str, Any]:
    """Prepare, serve, warm up, soak, stop and check (see the module docstring). The figures, with
    ``passed`` and, when it is False, ``why``. The server is stopped whatever happens."""
    from ktflow.recipe import load_recipe
    from ktflow.stages.serve import api_key_for, free_port, serve, stop

    work = Path(work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    already = frozenset(c.pid for c in psutil.Process().children(recursive=True))  # not the soak's
    prep = run_child([str(Path(__file__).resolve()), "--child", "prepare", "--dir", str(work), "--steps", str(steps)],
                     work / "prepare.log", env={"HF_HUB_OFFLINE": "1"})
    if prep.returncode != 0 or not prep.result:
        raise RuntimeError("fixture / SFT failed; last output:\n" + prep.log.read_text(errors="replace")[-3000:])
    log(f"prepared the tiny bf16 fixture, the demo data and a {prep.result['steps']}-step adapter in "
        f"{prep.result['prepare_s']:.1f} s")

    port = free_port()
    record = work / "endpoint"
    recipe = load_recipe(RECIPE, [*overrides(work, steps), f"serving.port={port}"])
    result: dict[str, Any] = {"requests": n, "concurrency": concurrency, "max_tokens": max_tokens, "warmup": warmup,
                              "bounds": {"max_growth_mb": max_growth_mb, "max_growth_pct": max_growth_pct}}
    endpoint = None
    try:
        t0 = time.perf_counter()
        endpoint = serve(recipe, model_dir=work / "fixture", adapter_dir=Path(prep.result["adapter_dir"]),
                         record_dir=record)
        result["start_s"] = time.perf_counter() - t0
        key = api_key_for(endpoint)
        assert key, "no API key recorded for the endpoint"
        log(f"server: {endpoint.url}, model {endpoint.model}, pid {endpoint.pid}, ready in {result['start_s']:.1f} s")
        with RssSampler(endpoint.pid) as sampler:
            warm = drive(endpoint.url, key, endpoint.model, n=warmup, concurrency=concurrency, max_tokens=max_tokens,
                         offset=-warmup)
            time.sleep(0.5)
            after_warmup = tree_rss(endpoint.pid)
            mark = len(sampler.samples)
            log(f"warm-up: {warmup} requests, {warm['errors']} error(s); server RSS {after_warmup / MB:.0f} MB")
            soak = drive(endpoint.url, key, endpoint.model, n=n, concurrency=concurrency, max_tokens=max_tokens)
            time.sleep(0.5)
            final = tree_rss(endpoint.pid)
        during = [b for _, b in sampler.samples[mark:]] or [final]
        every = max(1, len(sampler.samples) // 60)  # the trace keeps ~60 samples
        growth = final - after_warmup
        result.update(soak)
        result.update(
            warmup_errors=warm["errors"], rss_after_warmup_mb=after_warmup / MB, rss_peak_mb=max(during) / MB,
            rss_final_mb=final / MB, rss_growth_mb=growth / MB,
            rss_growth_pct=100.0 * growth / after_warmup if after_warmup else float("nan"),
            rss_samples=len(sampler.samples),
            rss_trace_mb=[(round(t, 2), round(b / MB, 1)) for t, b in sampler.samples[::every]],
        )
    finally:
        if endpoint is not None or (record / "endpoint.json").exists():
            stop(record, grace_s=10)
    left = leftovers(endpoint.pid if endpoint else -1, endpoint.run_id if endpoint else None, port, already)
    result["leftovers"] = left
    why = []
    if result.get("errors", 1) or result.get("warmup_errors", 1):
        why.append(f"{result.get('errors')} request error(s), {result.get('warmup_errors')} in the warm-up: "
                   f"{result.get('error_samples')}")
    if not result.get("rss_growth_mb", 0) <= max_growth_mb or not result.get("rss_growth_pct", 0) <= max_growth_pct:
        why.append(f"server RSS grew {result['rss_growth_mb']:.0f} MB ({result['rss_growth_pct']:.1f}%) after the "
                   f"warm-up; bound {max_growth_mb:.0f} MB and {max_growth_pct:.0f}%")
    if left["server_alive"] or left["marked"] or left["children"] or left["port_open"]:
        why.append(f"left behind after stop: {left}")
    result["passed"] = not why
    result["why"] = why
    return result


def print_report(r: dict[str, Any]) -> None:
    print(f"\n{r['requests']} requests, {r['concurrency']} in flight, max_tokens {r['max_tokens']}, temperature 0 "
          f"(after {r['warmup']} warm-up requests)")
    print(f"  errors           {r['errors']} (warm-up {r['warmup_errors']})")
    print(f"  latency          p50 {r['p50_ms']:.0f} ms, p95 {r['p95_ms']:.0f} ms, max {r['max_ms']:.0f} ms "
          f"(mean {r['mean_ms']:.0f} ms; client side, nearest rank)")
    print(f"  throughput       {r['requests_per_s']:.2f} requests/s, {r['completion_tokens'] / r['wall_s']:.1f} "
          f"completion tokens/s ({r['wall_s']:.1f} s wall)")
    print(f"  server RSS       after warm-up {r['rss_after_warmup_mb']:.0f} MB, peak {r['rss_peak_mb']:.0f} MB, "
          f"end {r['rss_final_mb']:.0f} MB: growth {r['rss_growth_mb']:+.1f} MB ({r['rss_growth_pct']:+.1f}%), "
          f"bound {r['bounds']['max_growth_mb']:.0f} MB and {r['bounds']['max_growth_pct']:.0f}% "
          f"({r['rss_samples']} samples, process tree)")
    left = r["leftovers"]
    print(f"  after stop       server alive: {left['server_alive']}, marked processes: {left['marked']}, "
          f"children: {left['children']}, port open: {left['port_open']}")
    print("PASS" if r["passed"] else "FAIL: " + "; ".join(r["why"]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", type=int, default=200, help="measured requests (default 200)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens per request (default 8)")
    p.add_argument("--warmup", type=int, default=16, help="warm-up requests, not measured (default 16)")
    p.add_argument("--steps", type=int, default=2, help="SFT steps of the served adapter (default 2)")
    p.add_argument("--max-growth-mb", type=float, default=200.0, help="RSS growth bound, MB (default 200)")
    p.add_argument("--max-growth-pct", type=float, default=25.0, help="RSS growth bound, %% (default 25)")
    p.add_argument("--workdir", type=Path, default=REPO / ".ktflow" / "bench", help="a fresh run dir is made in it")
    p.add_argument("--keep", action="store_true", help="keep the run dir (fixture, store, adapter, server.log)")
    p.add_argument("--json", type=Path, default=None, help="where to write the figures (default <workdir>/soak.json)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "prepare":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        report(job_prepare(Path(args.dir), args.steps))
        return 0
    if not TRAIN_PYTHON.exists():
        print(f"{TRAIN_PYTHON} is missing (make train-env)", file=sys.stderr)
        return 1
    args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="soak-", dir=args.workdir)).absolute()
    host = host_info(("ktflow", "openai", "psutil"))
    print(f"host: {host['cpu']}, {host['logical_cores']} logical cores, {host['memory_gb']} GB RAM; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    try:
        result = run_soak(work, n=args.n, concurrency=args.concurrency, max_tokens=args.max_tokens,
                          warmup=args.warmup, steps=args.steps, max_growth_mb=args.max_growth_mb,
                          max_growth_pct=args.max_growth_pct, log=lambda s: print(s, flush=True))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result["host"] = host
    result["command"] = " ".join([".venv/bin/python", "benchmarks/soak.py", *sys.argv[1:]])
    print_report(result)
    out = args.json or args.workdir / "soak.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"figures written to {out}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
