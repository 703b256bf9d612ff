#!/usr/bin/env python3
"""Serve a recipe with SGLang for real on the GPU host and check it through its own API (gpu_host/run.sh serve-*).

    serve_check.py served-model BASE OUT
        BASE as sglang-kt can load it: a transformers-saved DeepSeek-V3 config.json lacks fields the published
        checkpoints carry (moe_layer_freq, topk_method, scoring_func); OUT links BASE's files with those added.
        A Kimi-K2.5-format checkpoint whose vision part is ktflow's stand-in (not MoonViT, which sglang-kt's
        KimiK25ForConditionalGeneration builds and loads by name) is served as its language model: OUT is the
        DeepSeek-V3 text model (text_config, the same INT4 compressed-tensors tensors without the
        ``language_model.`` prefix, no vision tensors): what sglang-kt's Kimi K2.5 class hands its
        DeepseekV3ForCausalLM. The KT experts still come from BASE itself (--kt-weight-path, RAWINT4).
    serve_check.py int8-kt-layout INT8_DIR OUT
        ktflow quantize-int8's output as sglang-kt's AMXINT8 expert LoRA path reads it: kt-kernel 0.7.2's
        AMXINT8_SFT wrapper loads only pre-quantized ``_layer_L/_numa_N/INT8_*.kt`` files (kt-kernel's cpu_save
        layout), never the ``blk.*`` safetensors; OUT links INT8_DIR's files and writes each packed slice back
        into that layout, byte for byte (the safetensors hold exactly the bytes cpu_save wrote).
    serve_check.py env OUT.json
        What the serving toolchain finds on this host: torch/CUDA/nvcc, and whether each piece of the
        server imports (sgl_kernel's compiled ops, flashinfer, tvm-ffi, sglang's HTTP server, kt-kernel).
    serve_check.py run --recipe R --model M --kt-weights W --adapter A --records JSONL --out DIR [--via stage|cli]
        Start the recipe's endpoint through ktflow's serve stage (``--via stage``: ktflow.stages.serve.serve()
        with these paths; ``--via cli``: ``ktflow serve R``, which finds the trained adapter in the recipe's
        store and converts it), i.e. the argv ktflow.stages.sglang_launch renders, health-gated and
        smoke-tested; then ask it through the openai client (models, chat, completions) and SGLang's /generate
        with ``return_logprob`` + ``logprob_start_len: 0``: the prompt logprobs of the first records (chat
        template) and, with ``--tokens`` (gpu_host/loss_check.py tokens' file: the training tokenization), the
        served loss over every label token, loss_check.py's figure through SGLang. Requests for the base model
        are tried too and recorded: sglang-kt 0.7.2 refuses them on a server whose KT expert LoRA is loaded
        (HTTP 400, "statically paired with adapter"), so base/no-expert figures need servers of their own.
        Then stop it (``ktflow serve --stop`` or the stage's stop()), check no process is left and the GPU
        memory is back. DIR gets results.json and server.log.tail.

Runs in the serving toolchain's python (build/gpu-host/serve/bin/python). Nothing here is specific to the
tiny fixture: the recipe, the weights, the adapter and the records are arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


# --------------------------------------------------------------------------- served-model

# What the config.json of DeepSeek-V3 (and Kimi K2/K2.5, its architecture) as published carries and sglang-kt's
# deepseek_v2.py reads without a default, but transformers' DeepseekV3Config does not keep (a checkpoint that
# transformers saved, as ktflow's fixtures are, lacks them): the values of deepseek-ai/DeepSeek-V3's config.json,
# which are also what transformers' DeepseekV3 computes (sigmoid scores, bias-corrected top-k, every layer past
# first_k_dense_replace a MoE layer).
DEEPSEEK_V3_CONFIG_FIELDS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}


# What sglang-kt's MoonViT3dPretrainedModel reads from a Kimi K2.5 vision_config (the real checkpoint has them;
# ktflow's Kimi-K2.5 fixture has a few small stand-in modules instead, which that class cannot load).
MOONVIT_CONFIG_FIELDS = ("merge_kernel_size", "init_pos_emb_height", "num_hidden_layers", "vt_hidden_size")
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
TEXT_PREFIX = "language_model."


def _read_st_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and the offset where its data starts."""
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), 8 + n


def _copy_range(src, dst, start: int, nbytes: int) -> None:
    src.seek(start)
    while nbytes:
        chunk = src.read(min(nbytes, 1 << 24))
        if not chunk:
            raise ValueError(f"{src.name}: truncated")
        dst.write(chunk)
        nbytes -= len(chunk)


def _write_renamed_shard(src: Path, dst: Path, rename) -> list[str]:
    """Copy ``src`` to ``dst`` keeping the tensors ``rename(name)`` maps to a name (None drops it), bytes unchanged."""
    header, data_start = _read_st_header(src)
    kept, offset = {}, 0
    order = sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0])
    plan = []
    for name, info in order:
        new = rename(name)
        if new is None:
            continue
        start, end = info["data_offsets"]
        kept[new] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [offset, offset + end - start]}
        plan.append((data_start + start, end - start))
        offset += end - start
    if "__metadata__" in header:
        kept = {"__metadata__": header["__metadata__"], **kept}
    raw = json.dumps(kept, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with src.open("rb") as f, dst.open("wb") as g:
        g.write(len(raw).to_bytes(8, "little"))
        g.write(raw)
        for start, nbytes in plan:
            _copy_range(f, g, start, nbytes)
    return [k for k in kept if k != "__metadata__"]


def _kimi_stand_in(config: dict) -> bool:
    """A Kimi-K2.5-format config whose vision part is not MoonViT (ktflow's fixture stand-in)."""
    vision = config.get("vision_config")
    return (str(config.get("model_type", "")).startswith("kimi_k25") and isinstance(vision, dict)
            and not all(k in vision for k in MOONVIT_CONFIG_FIELDS) and isinstance(config.get("text_config"), dict))


def _served_text_model(base: Path, out: Path, config: dict) -> dict[str, Any]:
    """OUT: BASE's language model as a DeepSeek-V3 checkpoint (see the module docstring); what changed."""
    text = dict(config["text_config"])
    added = {k: v for k, v in DEEPSEEK_V3_CONFIG_FIELDS.items() if k not in text}
    text.update(added)
    text["architectures"] = ["DeepseekV3ForCausalLM"]
    for key in ("tie_word_embeddings", "eos_token_id", "pad_token_id", "bos_token_id"):
        if key in config and key not in text:
            text[key] = config[key]
    index = json.loads((base / "model.safetensors.index.json").read_text())

    def rename(name: str) -> str | None:
        if name.startswith(VISION_PREFIXES):
            return None
        return name[len(TEXT_PREFIX):] if name.startswith(TEXT_PREFIX) else name

    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        for name in _write_renamed_shard(base / shard, out / shard, rename):
            weight_map[name] = shard
    dropped = len(index["weight_map"]) - len(weight_map)
    index = {**index, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    skip = {"config.json", "model.safetensors.index.json", *set(index["weight_map"].values())}
    for f in base.iterdir():
        if f.name not in skip and not f.name.endswith(".py"):  # the stand-in's remote code is not needed
            (out / f.name).symlink_to(f)
    (out / "config.json").write_text(json.dumps(text, indent=2) + "\n")
    return {"text_model_of": "KimiK25ForConditionalGeneration (vision stand-in, not MoonViT)",
            "architectures": text["architectures"], "dropped_vision_tensors": dropped,
            "renamed": f"{TEXT_PREFIX}* -> *", "added": added}


def cmd_served_model(args: argparse.Namespace) -> int:
    """OUT: BASE's files (symlinks) with config.json given the DeepSeek-V3 fields it lacks; BASE itself if none.
    A Kimi-K2.5 checkpoint with ktflow's vision stand-in: OUT is its language model (a DeepSeek-V3 checkpoint)."""
    base, out = Path(args.base).absolute(), Path(args.out).absolute()
    config = json.loads((base / "config.json").read_text())
    if _kimi_stand_in(config):
        if out.exists():
            for f in out.iterdir():
                f.unlink()
        out.mkdir(parents=True, exist_ok=True)
        what = _served_text_model(base, out, config)
        (out / "ktflow-served-config.json").write_text(json.dumps({"base": str(base), **what}, indent=1) + "\n")
        print(f"{base} is a Kimi-K2.5 checkpoint with a vision stand-in: serving its language model {out} ({what})",
              file=sys.stderr)
        print(out)
        return 0
    text = config.get("text_config", config)
    deepseek = str(text.get("model_type", "")).startswith(("deepseek_v3", "kimi")) or any(
        "DeepseekV3" in a for a in config.get("architectures") or [])
    added = {k: v for k, v in DEEPSEEK_V3_CONFIG_FIELDS.items() if deepseek and k not in text}
    if not added:
        print(base)
        return 0
    if out.exists():
        for f in out.iterdir():
            f.unlink()
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    text.update(added)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "ktflow-served-config.json").write_text(json.dumps({"base": str(base), "added": added}, indent=1) + "\n")
    print(f"config.json of {base} lacks {sorted(added)}: serving {out} (added {added})", file=sys.stderr)
    print(out)
    return 0


# --------------------------------------------------------------------------- int8-kt-layout

_INT8_KEY = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(\d+)\.numa\.(\d+)\.(weight|scale)$")
KT_INT8_TAG = "INT8"  # kt-kernel's method tag in .kt names (ktflow._drivers.kt_int8.KT_FILE_TAG)


def kt_int8_file(layer: int, numa: int, proj: str, expert: int, nbytes: int, kind: str) -> str:
    """kt-kernel cpu_save's name for one slice (ktflow._drivers.kt_int8.kt_file, relative)."""
    return f"_layer_{layer}/_numa_{numa}/{KT_INT8_TAG}_{proj}_{expert}_{nbytes}Byte_{kind}_.kt"


def cmd_int8_kt_layout(args: argparse.Namespace) -> int:
    """OUT: INT8_DIR's files (links) plus ``_layer_L/_numa_N/INT8_{proj}_{E}_{bytes}Byte_{quant|scale}_.kt``."""
    src, out = Path(args.int8_dir).absolute(), Path(args.out).absolute()
    if out.exists():
        import shutil
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in src.iterdir():
        (out / f.name).symlink_to(f)
    files = slices = 0
    for shard in sorted(src.glob("*.safetensors")):
        header, data_start = _read_st_header(shard)
        with shard.open("rb") as f:
            for name, info in header.items():
                m = _INT8_KEY.match(name)
                if m is None:
                    continue
                layer, proj, expert, numa, kind = int(m[1]), m[2], int(m[3]), int(m[4]), m[5]
                start, end = info["data_offsets"]
                dst = out / kt_int8_file(layer, numa, proj, expert, end - start, "quant" if kind == "weight" else "scale")
                dst.parent.mkdir(parents=True, exist_ok=True)
                with dst.open("wb") as g:
                    _copy_range(f, g, data_start + start, end - start)
                slices += 1
        files += 1
    layers = sorted(int(p.name.removeprefix("_layer_")) for p in out.glob("_layer_*"))
    summary = {"int8_dir": str(src), "shards_read": files, "kt_files": slices, "layers": layers}
    (out / "ktflow-kt-layout.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary), file=sys.stderr)
    print(out)
    return 0 if slices else 1


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


def _served_loss(root: str, key: str, adapter: str, tokens: Path) -> dict[str, Any]:
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


def _leftovers(marker_pids: set[int]) -> list[dict]:
    """The server's processes still running: its recorded pids, or any process naming sglang / launch_server,
    except this process and its ancestors (the shell that started this check may name a tiny-sglang recipe)."""
    import psutil

    me = psutil.Process()
    mine = {me.pid, *(a.pid for a in me.parents())}
    left = []
    for p in psutil.process_iter(["pid", "cmdline", "name"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except psutil.Error:
            continue
        if (p.pid in marker_pids or "sglang" in cmd or "launch_server" in cmd) and p.pid not in mine:
            left.append({"pid": p.pid, "cmd": cmd[:200]})
    return left


def cmd_run(args: argparse.Namespace) -> int:
    from ktflow.cli import project_dir_of
    from ktflow.recipe import load_recipe

    if args.tokens:
        args.tokens = Path(args.tokens).absolute()
    for name in ("out", "recipe", "model", "kt_weights", "adapter", "records"):
        setattr(args, name, Path(getattr(args, name)).absolute())
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    recipe_path = args.recipe
    os.chdir(project_dir_of(recipe_path))  # as ktflow's CLI does: the recipe's relative paths mean its project's
    recipe = load_recipe(recipe_path, args.set or [])
    key_env = recipe.serving.api_key_env
    key = os.environ.get(key_env) or secrets.token_urlsafe(24)
    os.environ[key_env] = key
    results: dict[str, Any] = {"recipe": str(args.recipe), "via": args.via, "overrides": args.set or [],
                               "model": str(args.model), "kt_weights": str(args.kt_weights),
                               "adapter": str(args.adapter), "gpu_used_mib_before": _gpu_used_mib()}

    def log(line: str) -> None:
        print(f"[serve] {line}", flush=True)

    def write() -> None:
        (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")

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
            argv = [str(recipe.toolchains.serve.python.parent / "ktflow"), "serve", str(recipe_path)]
            for s in args.set or []:
                argv += ["--set", s]
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
        results["queries"] = _queries(recipe, endpoint.url, key, Path(args.model).absolute(),
                                      _records(Path(args.records), args.n_records), log,
                                      tokens=Path(args.tokens).absolute() if args.tokens else None)
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
                done = subprocess.run([str(recipe.toolchains.serve.python.parent / "ktflow"), "serve",
                                       str(recipe_path), "--stop", *sum((["--set", s] for s in args.set or []), [])],
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
    m = sub.add_parser("served-model", help="the base with the DeepSeek-V3 config fields sglang-kt needs")
    m.add_argument("base")
    m.add_argument("out")
    k = sub.add_parser("int8-kt-layout", help="quantize-int8's output with kt-kernel's .kt files (AMXINT8 + LoRA)")
    k.add_argument("int8_dir")
    k.add_argument("out")
    args = ap.parse_args()
    return {"env": cmd_env, "run": cmd_run, "served-model": cmd_served_model,
            "int8-kt-layout": cmd_int8_kt_layout}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
