#!/usr/bin/env python3
"""Serve a recipe with SGLang for real on the GPU host and check it through its own API (gpu_host/run.sh serve-*).

    serve_check.py env OUT.json
        What the serving toolchain finds on this host: torch/CUDA/nvcc, and whether each piece of the
        server imports (sgl_kernel's compiled ops, flashinfer, tvm-ffi, sglang's HTTP server, kt-kernel).
    serve_check.py run --recipe R --model M --kt-weights W --adapter A --records JSONL --out DIR [--via stage|cli]
        Start the recipe's endpoint through ktflow's serve stage (``--via stage``: ktflow.stages.serve.serve()
        with these paths; ``--via cli``: ``ktflow serve R``, which finds the trained adapter in the recipe's
        store and converts it, and for AMXINT8 runs quantize-int8 itself; M, W and A are then only what the
        queries read the tokenizer from), i.e. the argv ktflow.stages.serve.sglang.launch renders, health-gated and
        smoke-tested, with what the serve stage prepares for sglang-kt (ktflow.stages.serve.sglang.inputs:
        the language-model view of a Kimi-K2.5 checkpoint whose vision part sglang-kt cannot build, the
        DeepSeek-V3 config fields a transformers-saved config lacks, kt-kernel's .kt layout of AMXINT8
        experts served with an expert LoRA; done here by hand before, with the ``served-model`` and
        ``int8-kt-layout`` steps); then ask it through the openai client (models, chat, completions) and
        SGLang's /generate with ``return_logprob`` + ``logprob_start_len: 0``: the prompt logprobs of the first records (chat
        template) and, with ``--tokens`` (gpu_host/loss_check.py tokens' file: the training tokenization), the
        served loss over every label token, loss_check.py's figure through SGLang. Requests for the base model
        are tried too and recorded: sglang-kt 0.7.2 refuses them on a server whose KT expert LoRA is loaded
        (HTTP 400, "statically paired with adapter"), so base/no-expert figures need servers of their own.
        Then stop it (``ktflow serve --stop`` or the stage's stop()), check no process is left and the GPU
        memory is back. DIR gets results.json and server.log.tail. With ``--load-json``: the host's read
        bandwidth before the server starts, and benchmarks/serve_load.py against it once ready (the
        bigger-than-GPU model's serving benchmark, gpu_host/big.py serve).

Runs in the serving toolchain's python (build/gpu-host/serve/bin/python). Nothing here is specific to the
tiny fixture: the recipe, the weights, the adapter and the records are arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _tail(path: Path, lines: int = 120) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"<{path}: {exc}>"


def _gpu_used_mib() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


# --------------------------------------------------------------------------- env


def _try(name: str, fn, out: dict[str, Any]) -> None:
    started = time.perf_counter()
    try:
        value = fn()
        out[name] = {"ok": True, "value": value, "s": round(time.perf_counter() - started, 2)}
    except BaseException as exc:  # noqa: BLE001 - every failure is a finding
        out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                     "trace": traceback.format_exc()[-1500:], "s": round(time.perf_counter() - started, 2)}
    print(f"[env] {name}: {json.dumps(out[name], default=str)[:600]}", flush=True)


def cmd_env(args: argparse.Namespace) -> int:
    out: dict[str, Any] = {"python": sys.version, "executable": sys.executable}

    def torch_info():
        import torch
        return {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available(),
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                "capability": torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None}

    def nvcc():
        done = subprocess.run(["nvcc", "--version"], capture_output=True, text=True)
        return done.stdout.strip().splitlines()[-2:] if done.returncode == 0 else done.stderr

    def sgl_kernel():
        import sgl_kernel
        import torch
        x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.ones(256, device="cuda", dtype=torch.bfloat16)
        y = sgl_kernel.rmsnorm(x, w, 1e-6)
        ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return {"version": sgl_kernel.__version__, "file": sgl_kernel.__file__,
                "rmsnorm_max_err": float((y.float() - ref).abs().max())}

    def versions():
        import importlib.metadata as md
        names = ["sglang-kt", "sglang-kernel", "flashinfer-python", "apache-tvm-ffi", "transformers-kt", "transformers",
                 "kt-kernel", "tokenizers", "triton", "torch", "fastapi", "uvicorn", "openai", "pydantic"]
        found = {}
        for n in names:
            try:
                found[n] = md.version(n)
            except md.PackageNotFoundError:
                found[n] = None
        return found

    def transformers_info():
        import transformers
        return {"version": transformers.__version__, "file": transformers.__file__}

    def kt_kernel_info():
        import kt_kernel
        from kt_kernel import KTMoEWrapper  # noqa: F401  (what sglang-kt's kt_ep_wrapper imports)
        return {"version": getattr(kt_kernel, "__version__", None), "variant": getattr(kt_kernel, "__cpu_variant__",
                                                                                         None)}

    _try("torch", torch_info, out)
    _try("nvcc", nvcc, out)
    _try("versions", versions, out)
    _try("sgl_kernel", sgl_kernel, out)
    _try("flashinfer.sampling", lambda: __import__("flashinfer.sampling").__version__, out)
    _try("tvm_ffi", lambda: __import__("tvm_ffi").__version__, out)
    _try("transformers", transformers_info, out)
    _try("kt_kernel", kt_kernel_info, out)
    _try("sglang.srt.server_args", lambda: bool(__import__("sglang.srt.server_args")), out)
    _try("sglang.srt.entrypoints.http_server", lambda: bool(__import__("sglang.srt.entrypoints.http_server")), out)
    _try("sglang.srt.managers.scheduler", lambda: bool(__import__("sglang.srt.managers.scheduler")), out)
    _try("sglang.srt.models.deepseek_v2", lambda: bool(__import__("sglang.srt.models.deepseek_v2")), out)
    _try("sglang.srt.layers.moe.kt_ep_wrapper", lambda: bool(__import__("sglang.srt.layers.moe.kt_ep_wrapper")), out)
    _try("sglang.srt.lora.lora_manager", lambda: bool(__import__("sglang.srt.lora.lora_manager")), out)
    _try("sglang.srt.models.kimi_k25 (Kimi K2.5, FA3 left out)",
         lambda: bool(__import__("sglang.srt.models.kimi_k25")), out)
    _try("sglang.srt.layers.attention.triton_backend",
         lambda: bool(__import__("sglang.srt.layers.attention.triton_backend")), out)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0 if all(v.get("ok") for v in out.values() if isinstance(v, dict)) else 1


# --------------------------------------------------------------------------- run


def _records(path: Path, n: int) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:n]


def _prompt_logprobs(root: str, key: str, input_ids: list[int], lora: str | None) -> list[float | None]:
    import httpx

    payload: dict[str, Any] = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                               "return_logprob": True, "logprob_start_len": 0}
    if lora is not None:
        payload["lora_path"] = lora
    r = httpx.post(f"{root}/generate", json=payload, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    r.raise_for_status()
    meta = r.json()["meta_info"]
    return [t[0] for t in meta["input_token_logprobs"]]


def _queries(recipe, endpoint_url: str, key: str, model_dir: Path, records: list[dict], log,
             tokens: Path | None = None) -> dict[str, Any]:
    import openai
    from transformers import AutoTokenizer

    from ktflow.demo import STYLE_MARKER

    served = recipe.serving.served_model_name
    tuned = f"{served}:{recipe.serving.adapter_name}"
    root = endpoint_url.removesuffix("/v1")
    out: dict[str, Any] = {}
    client = openai.OpenAI(base_url=endpoint_url, api_key=key, timeout=120, max_retries=0)
    out["models"] = [m.id for m in client.models.list().data]
    log(f"models: {out['models']}")
    chats = []
    for rec in records[:4]:
        question = rec["messages"][0]["content"]
        row: dict[str, Any] = {"question": question}
        for label, model in (("tuned", tuned), ("base", served)):
            started = time.perf_counter()
            try:
                resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                      max_tokens=48, temperature=0)
            except openai.BadRequestError as exc:  # sglang-kt: KT expert LoRA is statically paired with the adapter
                row[label] = {"refused": str(exc)[:400]}
                continue
            text = resp.choices[0].message.content or ""
            row[label] = {"content": text, "marker": STYLE_MARKER in text, "finish": resp.choices[0].finish_reason,
                          "usage": resp.usage.model_dump() if resp.usage else None,
                          "s": round(time.perf_counter() - started, 3)}
        chats.append(row)
        log(f"chat {question!r}: tuned {row['tuned'].get('content')!r} | base {row['base']}")
    out["chat"] = chats
    comp = client.completions.create(model=tuned, prompt=records[0]["messages"][0]["content"], max_tokens=24,
                                     temperature=0)
    out["completion"] = {"text": comp.choices[0].text, "finish": comp.choices[0].finish_reason,
                         "usage": comp.usage.model_dump() if comp.usage else None}
    log(f"completion: {out['completion']['text']!r}")
    client.close()

    # /generate prompt logprobs: the chat-templated record, as training renders it (template: empty -> the
    # model's own chat template); the answer's tokens are those after the prompt with the generation prompt.
    tok = AutoTokenizer.from_pretrained(model_dir)
    per: list[dict[str, Any]] = []
    sums = {"tuned": [0.0, 0], "base": [0.0, 0]}
    for rec in records:
        full = _ids(tok.apply_chat_template(rec["messages"], tokenize=True, add_generation_prompt=False))
        prompt = _ids(tok.apply_chat_template(rec["messages"][:1], tokenize=True, add_generation_prompt=True))
        row = {"tokens": len(full), "prompt_tokens": len(prompt)}
        for label, lora in (("tuned", recipe.serving.adapter_name), ("base", None)):
            try:
                lps = _prompt_logprobs(root, key, full, lora)
            except Exception as exc:  # noqa: BLE001 - the KT fork refuses requests without its one adapter
                row[label] = {"refused": str(exc)[:300]}
                continue
            answer = [lp for lp in lps[len(prompt):] if lp is not None]
            whole = [lp for lp in lps if lp is not None]
            row[label] = {"answer_nll": -sum(answer) / max(len(answer), 1), "all_nll": -sum(whole) / max(len(whole), 1),
                          "n_logprobs": len(lps)}
            sums[label][0] -= sum(answer)
            sums[label][1] += len(answer)
            row[label]["answer_logprobs"] = answer
        per.append(row)
    out["generate_logprobs"] = {"records": per, "answer_tokens": {k: v[1] for k, v in sums.items()},
                                "mean_answer_nll": {k: (v[0] / v[1] if v[1] else None) for k, v in sums.items()}}
    log(f"/generate mean answer-token NLL: {out['generate_logprobs']['mean_answer_nll']}")
    if tokens is not None:
        out["served_loss"] = _served_loss(root, key, recipe.serving.adapter_name, tokens)
        log(f"served loss over the training tokens (loss_check's tokenization): {out['served_loss']['loss']}")
    return out


def _served_loss(root: str, key: str, adapter: str | None, tokens: Path) -> dict[str, Any]:
    """The mean token loss of the training records (input_ids + labels as training tokenized them, the file
    gpu_host/loss_check.py tokens writes) from the server's prompt logprobs: the same figure as
    loss_check.py's ``loss`` (token-weighted over every label token), through SGLang's /generate."""
    rows = json.loads(Path(tokens).read_text())
    total, count, per_record = 0.0, 0, []
    started = time.perf_counter()
    for row in rows:
        ids, labels = row["input_ids"], row["labels"]
        lps = _prompt_logprobs(root, key, ids, adapter)
        nll = [-lps[i] for i in range(1, len(ids)) if labels[i] != -100 and lps[i] is not None]
        total += sum(nll)
        count += len(nll)
        per_record.append(sum(nll) / max(len(nll), 1))
    return {"loss": total / max(count, 1), "label_tokens": count, "records": len(rows),
            "loss_mean_of_records": sum(per_record) / max(len(per_record), 1), "s": round(time.perf_counter() - started, 2)}


def _ids(encoded: Any) -> list[int]:
    """Token ids from apply_chat_template(tokenize=True): a list, or (transformers 5) a BatchEncoding."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _leftovers(marker_pids: set[int], scope: str | None = None) -> list[dict]:
    """The server's processes still running: its recorded pids, or any process naming sglang / launch_server (with
    ``scope``: only those whose command line also names it, e.g. the folder its models live in, so servers of
    others on the machine do not count), except this process and its ancestors (the shell that started this check
    may name a tiny-sglang recipe)."""
    import psutil

    me = psutil.Process()
    mine = {me.pid, *(a.pid for a in me.parents())}
    left = []
    for p in psutil.process_iter(["pid", "cmdline", "name"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except psutil.Error:
            continue
        named = ("sglang" in cmd or "launch_server" in cmd) and (scope is None or scope in cmd)
        if (p.pid in marker_pids or named) and p.pid not in mine:
            left.append({"pid": p.pid, "cmd": cmd[:200]})
    return left


def _load_recipe_with_key(recipe_path: Path, sets: list[str]) -> tuple[Any, str]:
    """The recipe as ktflow's CLI loads it (its relative paths read against its project folder)
    and the server's API key, put into the recipe's key variable for the servers and `ktflow` commands started."""
    from ktflow.recipe import load_recipe

    recipe = load_recipe(recipe_path, sets)
    key = os.environ.get(recipe.serving.api_key_env) or secrets.token_urlsafe(24)
    os.environ[recipe.serving.api_key_env] = key
    return recipe, key


def _ktflow_argv(recipe, recipe_path: Path, command: str, *argv: str, sets: list[str]) -> list[str]:
    """``ktflow COMMAND RECIPE ARGV... --set ...`` in the recipe's serving toolchain."""
    return [str(recipe.toolchains.serve.python.parent / "ktflow"), command, str(recipe_path), *argv,
            *sum((["--set", s] for s in sets), [])]


def cmd_run(args: argparse.Namespace) -> int:
    if args.tokens:
        args.tokens = Path(args.tokens).absolute()
    for name in ("out", "recipe", "model", "kt_weights", "adapter", "records"):
        setattr(args, name, Path(getattr(args, name)).absolute())
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    recipe_path = args.recipe
    recipe, key = _load_recipe_with_key(recipe_path, args.set or [])
    results: dict[str, Any] = {"recipe": str(args.recipe), "via": args.via, "overrides": args.set or [],
                               "model": str(args.model), "kt_weights": str(args.kt_weights),
                               "adapter": str(args.adapter), "gpu_used_mib_before": _gpu_used_mib()}

    def log(line: str) -> None:
        print(f"[serve] {line}", flush=True)

    def write() -> None:
        (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")

    if args.load_json:  # the decode floor's bandwidth, measured before the server (whose kt-kernel threads may spin)
        results["read_bandwidth"] = _read_bandwidth()
    record_dir = out_dir / "endpoint"
    started = time.perf_counter()
    server_log: Path | None = None
    pids: set[int] = set()
    status = 1
    try:
        if args.via == "stage":
            from ktflow.stages.serve import serve
            endpoint = serve(recipe, model_dir=Path(args.model), adapter_dir=Path(args.adapter), record_dir=record_dir,
                             kt_weight_dir=Path(args.kt_weights), log=lambda line: print(line, flush=True))
        else:
            from ktflow.stages.promotion import serving_dir
            from ktflow.stages.serve import read_endpoint
            record_dir = serving_dir(recipe)
            argv = _ktflow_argv(recipe, recipe_path, "serve", sets=args.set or [])
            log(f"$ {' '.join(argv)}")
            done = subprocess.run(argv, timeout=recipe.serving.ready_timeout_s + 300)
            endpoint = read_endpoint(record_dir)
            if done.returncode != 0 or endpoint is None:
                raise RuntimeError(f"ktflow serve exited {done.returncode}; endpoint record: {endpoint}")
        server_log = Path(endpoint.log_path)
        pids.add(endpoint.pid)
        results["ready_s"] = round(time.perf_counter() - started, 1)
        results["endpoint"] = {"url": endpoint.url, "pid": endpoint.pid, "model": endpoint.adapter_model_name,
                               "state": endpoint.state}
        results["gpu_used_mib_ready"] = _gpu_used_mib()
        log(f"ready in {results['ready_s']} s at {endpoint.url} (pid {endpoint.pid})")
        try:
            import psutil
            pids |= {c.pid for c in psutil.Process(endpoint.pid).children(recursive=True)}
            results["server_processes"] = len(pids)
        except Exception:  # noqa: BLE001
            pass
        # the tokenizer as the server read it: the model view the serve stage made, if it made one
        from ktflow.stages.serve.sglang.inputs import sglang_model_view
        served_dir = sglang_model_view(Path(args.model), record_dir, create=False)
        results["served_model_dir"] = str(served_dir)
        results["queries"] = _queries(recipe, endpoint.url, key, served_dir if served_dir.is_dir() else args.model,
                                      _records(Path(args.records), args.n_records), log,
                                      tokens=Path(args.tokens).absolute() if args.tokens else None)
        if args.load_json:
            results["load"] = _load_benchmark(args, recipe, endpoint, key,
                                              served_dir if served_dir.is_dir() else args.model,
                                              results["read_bandwidth"]["read_gb_s"])
            write()
        status = 0
    except BaseException as exc:  # noqa: BLE001 - recorded, then the server is stopped
        results["error"] = f"{type(exc).__name__}: {exc}"
        results["trace"] = traceback.format_exc()[-4000:]
        log(f"FAILED: {results['error']}")
        server_log = server_log or getattr(exc, "log_path", None) or (record_dir / "server.log")
    finally:
        stop_started = time.perf_counter()
        try:
            if args.via == "stage":
                from ktflow.stages.serve import stop
                results["stopped"] = stop(record_dir)
            else:
                done = subprocess.run(_ktflow_argv(recipe, recipe_path, "serve", "--stop", sets=args.set or []),
                                      capture_output=True, text=True, timeout=120)
                results["stopped"] = done.stdout.strip() or done.stderr.strip()[-500:]
        except Exception as exc:  # noqa: BLE001
            results["stop_error"] = f"{type(exc).__name__}: {exc}"
        results["stop_s"] = round(time.perf_counter() - stop_started, 1)
        time.sleep(3)
        results["leftover_processes"] = _leftovers(pids)
        results["gpu_used_mib_after"] = _gpu_used_mib()
        if server_log is not None:
            (out_dir / "server.log.tail").write_text(_tail(Path(server_log), 400) + "\n")
            results["server_log_tail"] = _tail(Path(server_log), 60)
        write()
        log(f"stopped: {results.get('stopped')}, leftovers {results['leftover_processes']}, GPU used "
            f"{results['gpu_used_mib_before']} -> {results.get('gpu_used_mib_ready')} -> "
            f"{results['gpu_used_mib_after']} MiB")
    if results["leftover_processes"]:
        status = status or 3
    return status


# --------------------------------------------------------------------------- load (benchmarks/serve_load.py)


def _serve_load() -> Any:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import serve_load

    return serve_load


def _read_bandwidth() -> dict[str, Any]:
    """The host's read bandwidth (serve_load's measurement: every physical core, 4 GiB, best of 5)."""
    found = _serve_load().bandwidth_record()
    print(f"[serve] host read bandwidth {found['read_gb_s']:.1f} GB/s ({found['threads']} threads), before the server",
          flush=True)
    return found


def load_benchmark_argv(args: argparse.Namespace, recipe: Any, endpoint: Any, key: str, model_dir: Path,
                        read_gb_s: float) -> list[str]:
    """serve_load's command line against ``endpoint``. The key goes as ``--api-key=KEY``: a random URL-safe key
    starts with '-' once in 64, which argparse would read as the next option."""
    return ["--base-url", endpoint.url, "--model", endpoint.adapter_model_name or endpoint.served_model_name,
            f"--api-key={key}", "--server-pid", str(endpoint.pid), "--model-dir", str(model_dir),
            "--kt-method", recipe.serving.kt_method, "--label", recipe.serving.kt_method,
            "--read-gb-s", str(read_gb_s), "--json", str(Path(args.load_json).absolute()),
            *(["--context-length", str(recipe.serving.context_length)] if recipe.serving.context_length else []),
            *(args.load_args.split() if args.load_args else [])]


def _load_benchmark(args: argparse.Namespace, recipe: Any, endpoint: Any, key: str, model_dir: Path,
                    read_gb_s: float) -> dict[str, Any]:
    """benchmarks/serve_load.py against the running endpoint (concurrency levels, TTFT, prefill, decode, GPU
    memory, the server tree's RSS, decode against its floor); its JSON goes to ``--load-json``."""
    argv = load_benchmark_argv(args, recipe, endpoint, key, model_dir, read_gb_s)
    started = time.perf_counter()
    rc = _serve_load().main(argv)
    doc = json.loads(Path(args.load_json).read_text())
    return {"rc": rc, "seconds": round(time.perf_counter() - started, 1), "json": str(args.load_json),
            "decode_vs_floor": doc.get("decode_vs_floor")}


# --------------------------------------------------------------------------- promotion


def _greedy_answers(url: str, key: str, model: str, questions: list[str]) -> list[str]:
    """Temperature-0 chat answers: what a rejected candidate must leave unchanged on production."""
    import openai

    client = openai.OpenAI(base_url=url, api_key=key, timeout=120, max_retries=0)
    try:
        return [client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}], max_tokens=48,
                                               temperature=0).choices[0].message.content or "" for q in questions]
    finally:
        client.close()


def write_no_expert_adapter(adapter_dir: Path, out_dir: Path) -> Path:
    """The converted adapter without its routed-expert LoRA (``...mlp.experts.E.*`` tensors dropped),
    published as an artifact of its own: the candidate a conversion that lost the expert part would
    produce, and the "adapter without its expert part" server of the served-loss comparison."""
    import shutil

    from safetensors.torch import load_file, save_file

    from ktflow.store import publish_dir, read_manifest, staging_dir_for

    if read_manifest(out_dir) is not None:
        return out_dir
    source = read_manifest(adapter_dir)
    assert source is not None, f"{adapter_dir} is not a published adapter"
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    kept = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    staging = staging_dir_for(out_dir)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    # only the modules left: sglang sets up LoRA buffers for every target module it is told of
    config["target_modules"] = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in kept})
    (staging / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(kept, str(staging / "adapter_model.safetensors"), metadata={"format": "pt"})
    manifest = source.model_copy(update={
        "inputs": {**source.inputs, "variant-of": source.digest()}, "files": [],
        "extra": {**source.extra, "variant": "no-experts", "dropped_tensors": len(tensors) - len(kept)}})
    publish_dir(staging, out_dir, manifest)
    return out_dir


def cmd_promotion(args: argparse.Namespace) -> int:
    """Promotion on the real server (issue: a rejected candidate leaves production answering with the
    production adapter; `ktflow promote` / `ktflow rollback` restart the real server, health-gated), and the
    served loss of the base model and of the adapter without its expert part, through SGLang:

    1. v1 = the SFT run's converted adapter, v2 = the same without its expert LoRA; both registered as the
       pipeline registers versions. `ktflow promote R 1` starts production; greedy answers A1, served loss.
    2. A base-model server (no adapter) on a free port through the serve stage: greedy answers, served loss.
    3. judge_candidate(v2) as the evaluate stage calls it (the mode ktflow picks from the host's memory, or
       --candidate; beside: a candidate server and a base server beside production); production's pid and
       its answers (== A1) after.
    4. `ktflow promote R 2`: the real server restarts with v2: answers, served loss (no expert LoRA).
    5. `ktflow rollback R`: v1 again, answers == A1.  6. `ktflow serve R --stop`; no process left.
    """
    from ktflow.cli.serving import _production_weights, _served_adapter
    from ktflow.demo import STYLE_MARKER
    from ktflow.stages.promotion import judge_candidate, register_adapter, registry_of, serving_dir
    from ktflow.stages.serve import read_endpoint, temporary_server
    from ktflow.stages.sft import locate_adapter

    out_dir = Path(args.out).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    recipe_path = Path(args.recipe).absolute()
    tokens = Path(args.tokens).absolute()
    records = _records(Path(args.records).absolute(), 10_000)
    questions = list(dict.fromkeys(r["messages"][0]["content"] for r in records))[:args.n_questions]
    eval_file = out_dir / "eval.jsonl"  # the first distinct training questions: what the adapter memorized
    first = {}
    for r in records:
        first.setdefault(r["messages"][0]["content"], r)
    eval_file.write_text("".join(json.dumps(first[q]) + "\n" for q in questions))
    sets = [*(args.set or []), f"evaluation.files=[{eval_file}]", "evaluation.format=openai", "evaluation.enabled=true",
            f"evaluation.style={{marker: '{STYLE_MARKER}'}}", "evaluation.gate_metric=style",
            f"evaluation.gate_min_gain={args.gate_min_gain}", "evaluation.allow_contamination=true",
            "evaluation.max_tokens=48", *([f"evaluation.candidate={args.candidate}"] if args.candidate != "auto" else [])]
    recipe, key = _load_recipe_with_key(recipe_path, sets)
    served, name = recipe.serving.served_model_name, recipe.serving.adapter_name
    tuned = f"{served}:{name}"
    results: dict[str, Any] = {"recipe": str(recipe_path), "overrides": sets, "questions": questions,
                               "gpu_used_mib_before": _gpu_used_mib(), "steps": []}
    pids: set[int] = set()

    def log(line: str) -> None:
        print(f"[promotion] {line}", flush=True)

    def step(what: str, **facts: Any) -> None:
        results["steps"].append({"step": what, "at": round(time.perf_counter() - started, 1), **facts})
        log(f"{what}: {json.dumps(facts, default=str)[:900]}")
        (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")

    def cli(command: str, *argv: str) -> subprocess.CompletedProcess:  # ktflow COMMAND RECIPE ARGV... --set ...
        t = time.perf_counter()
        done = subprocess.run(_ktflow_argv(recipe, recipe_path, command, *argv, sets=sets), capture_output=True,
                              text=True, timeout=recipe.serving.ready_timeout_s + 300)
        log(f"$ ktflow {command} {' '.join(argv)} -> {done.returncode} in {time.perf_counter() - t:.1f} s\n"
            f"{done.stdout[-1500:]}{done.stderr[-2500:]}")
        return done

    def production_now() -> Any:
        ep = read_endpoint(serving_dir(recipe))
        if ep is not None:
            pids.add(ep.pid)
        return ep

    started = time.perf_counter()
    status = 1
    try:
        weights = _production_weights(recipe)
        base_dir = weights["base_dir"]
        v1_dir = _served_adapter(recipe, base_dir)
        sft_dir = locate_adapter(recipe, base_dir)
        v2_dir = write_no_expert_adapter(v1_dir, v1_dir.parent / f"{v1_dir.name}-no-experts")
        v1 = register_adapter(recipe, adapter_dir=v1_dir, sft_adapter_dir=sft_dir, base_dir=base_dir)
        v2 = register_adapter(recipe, adapter_dir=v2_dir, sft_adapter_dir=sft_dir, base_dir=base_dir)
        step("registered", v1=v1.version, v2=v2.version, v1_dir=v1_dir, v2_dir=v2_dir,
             weights={k: str(v) for k, v in weights.items()})

        t = time.perf_counter()
        done = cli("promote", str(v1.version))
        ep = production_now()
        assert done.returncode == 0 and ep is not None, "ktflow promote v1 did not start production"
        a1 = _greedy_answers(ep.url, key, tuned, questions)
        root = ep.url.removesuffix("/v1")
        step("promote v1 (start)", s=round(time.perf_counter() - t, 1), pid=ep.pid, url=ep.url, answers=a1,
             marker=[STYLE_MARKER in a for a in a1], served_loss=_served_loss(root, key, name, tokens),
             gpu_used_mib=_gpu_used_mib())

        t = time.perf_counter()
        with temporary_server(recipe, model_dir=weights["model_dir"], adapter_dir=None, api_key=key,
                              record_dir=out_dir / "base-endpoint", what="base-model", log=log,
                              kt_weight_dir=weights["kt_weight_dir"]) as base:
            ready = round(time.perf_counter() - t, 1)
            ab = _greedy_answers(base.url, key, base.model, questions)
            step("base server (no adapter) beside production", ready_s=ready, url=base.url, answers=ab,
                 marker=[STYLE_MARKER in a for a in ab],
                 served_loss=_served_loss(base.url.removesuffix("/v1"), key, None, tokens), gpu_used_mib=_gpu_used_mib())

        t = time.perf_counter()
        judgement = judge_candidate(recipe, v2.version, model_dir=base_dir, serve_model_dir=weights["model_dir"],
                                    kt_weight_dir=weights["kt_weight_dir"], log=log)
        ev = judgement.evaluation
        after = production_now()
        a1_after = _greedy_answers(after.url, key, tuned, questions)
        step("judge v2", s=round(time.perf_counter() - t, 1), mode=judgement.choice.mode, reason=judgement.choice.reason,
             prices=[p.model_dump() for p in judgement.choice.prices],
             accepted=judgement.accepted, summary=judgement.summary(), table=ev.table, report=ev.report_md,
             production_pid_same=after.pid == ep.pid, production_answers_same=a1_after == a1, answers=a1_after,
             verdict=registry_of(recipe).get(v2.version).verdict)

        t = time.perf_counter()
        done = cli("promote", str(v2.version))
        ep2 = production_now()
        assert done.returncode == 0 and ep2 is not None, "ktflow promote v2 failed"
        a2 = _greedy_answers(ep2.url, key, tuned, questions)
        step("promote v2 (restart)", s=round(time.perf_counter() - t, 1), pid=ep2.pid, version=ep2.adapter_version,
             answers=a2, marker=[STYLE_MARKER in a for a in a2],
             served_loss=_served_loss(ep2.url.removesuffix("/v1"), key, name, tokens))

        t = time.perf_counter()
        done = cli("rollback")
        ep3 = production_now()
        assert done.returncode == 0 and ep3 is not None, "ktflow rollback failed"
        a3 = _greedy_answers(ep3.url, key, tuned, questions)
        step("rollback to v1 (restart)", s=round(time.perf_counter() - t, 1), pid=ep3.pid, version=ep3.adapter_version,
             answers=a3, answers_same_as_v1=a3 == a1,
             served_loss=_served_loss(ep3.url.removesuffix("/v1"), key, name, tokens))
        done = cli("adapters")
        step("ktflow adapters", out=done.stdout[-3000:])
        status = 0
    except BaseException as exc:  # noqa: BLE001 - recorded, then everything is stopped
        results["error"] = f"{type(exc).__name__}: {exc}"
        results["trace"] = traceback.format_exc()[-4000:]
        log(f"FAILED: {results['error']}")
    finally:
        done = cli("serve", "--stop")
        time.sleep(3)
        results["stopped"] = done.stdout.strip()
        results["leftover_processes"] = _leftovers(pids)
        results["gpu_used_mib_after"] = _gpu_used_mib()
        log_path = serving_dir(recipe) / "server.log"
        (out_dir / "server.log.tail").write_text(_tail(log_path, 400) + "\n")
        step("stopped", leftovers=results["leftover_processes"], gpu_used_mib=results["gpu_used_mib_after"])
    return status or (3 if results["leftover_processes"] else 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env")
    e.add_argument("out")
    r = sub.add_parser("run")
    r.add_argument("--recipe", required=True)
    r.add_argument("--model", required=True)
    r.add_argument("--kt-weights", required=True)
    r.add_argument("--adapter", required=True)
    r.add_argument("--records", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--via", choices=["stage", "cli"], default="stage")
    r.add_argument("--n-records", type=int, default=8)
    r.add_argument("--tokens", help="gpu_host/loss_check.py tokens output: also the served loss over those tokens")
    r.add_argument("--set", action="append", help="recipe override KEY=VALUE (as ktflow's --set)")
    r.add_argument("--load-json", help="also run benchmarks/serve_load.py against the server; its JSON here")
    r.add_argument("--load-args", help="more serve_load.py arguments, space-separated (e.g. '--max-tokens 64')")
    pr = sub.add_parser("promotion", help=cmd_promotion.__doc__.splitlines()[0])
    pr.add_argument("--recipe", required=True)
    pr.add_argument("--records", required=True, help="the training records (chat); the first distinct questions are asked")
    pr.add_argument("--tokens", required=True, help="gpu_host/loss_check.py tokens output: the served losses")
    pr.add_argument("--out", required=True)
    pr.add_argument("--n-questions", type=int, default=8)
    pr.add_argument("--gate-min-gain", type=float, default=75.0)
    pr.add_argument("--candidate", default="auto", choices=["auto", "beside", "offline", "swap"],
                    help="evaluation.candidate (auto: unset, ktflow picks the mode from the host's memory)")
    pr.add_argument("--set", action="append", help="recipe override KEY=VALUE (as ktflow's --set)")
    args = ap.parse_args()
    return {"env": cmd_env, "run": cmd_run, "promotion": cmd_promotion}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
