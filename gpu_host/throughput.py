#!/usr/bin/env python3
"""KT training throughput on the GPU host: the host's limits and one-factor-at-a-time KT LoRA SFT runs (issue #28).

Data for a step-time model, gathered on the ``device`` tool's host (H100 + 16-core AMX Xeon), from the
repository root after ``bash gpu_host/run.sh setup fixture-big`` (the bigger-than-GPU Kimi-format model):

    PY=build/gpu-host/bundle/bin/python
    $PY gpu_host/throughput.py host                    # memory read/copy bandwidth, CPU BF16 matmul (AMX) rate
    $PY gpu_host/throughput.py data                    # long synthetic records (cut at cutoff_len: exact lengths)
    $PY gpu_host/throughput.py run NAME:B:G:C:T:S ...  # KT RAWINT4 LoRA SFT runs, measured from outside
    $PY gpu_host/throughput.py fixture2                # a second bigger-than-GPU shape (replaces the first model)
    $PY gpu_host/throughput.py fixture3                # a third shape, a quarter of the expert bytes (beside model 1)
    $PY gpu_host/throughput.py chat-data               # multi-turn records of ~100-500 tokens (issue item 3)
    $PY gpu_host/throughput.py host --quick            # the host's limits at 16 threads only (~15 s)
    $PY gpu_host/throughput.py calibrate A B ...       # runs through ``ktflow sft``: each planned with the earlier

A run ``NAME:B:G:C:T:S`` trains gpu_host/big-kt-rawint4.yaml with per_device_train_batch_size B,
gradient_accumulation_steps G, cutoff_len C (every record is longer than 4,096 tokens, so each sample is
cut to C: a micro-batch holds B x C tokens), kt_num_threads T and S optimizer steps. It is the command
``ktflow sft`` would run (``ktflow sft --dry-run --json``, rendered here), started through
benchmarks/kt_vs_hf.py's ``_profile_train`` (LlamaFactory's ``run_exp`` with KT's own timers, KT_SFT_PROFILE=1),
and measured from outside with kt_vs_hf's ``measure``: steady step time, peak GPU memory over idle
(nvidia-smi every 100 ms), peak RSS of the process tree (every 250 ms). Steady steps: logged steps 3..S
when S >= 4 (step 1 holds the load, step 2 is a warm-up), steps 2..S when S == 3. KT's timers cover
the same steps. No checkpoint is saved during the run (save_strategy no); the adapter is saved at the end,
after the last logged step. ``--model`` points a run at another shape, ``--recipe`` at another recipe (the
BF16 V2-Lite of benchmarks/recipes/v2-lite-kt.yaml), ``--data`` at other records (``chat-data``: records of
realistic lengths, so micro-batches are padded to their longest; ``--set sft.kt_shape_batches=true`` lets
``ktflow sft`` shape the split, recorded as the run's ``batch_shape``).

Each run writes build/gpu-host/tp/results/NAME.json; after each, the results folder is packed into
$OUT/tp-results.tar.gz when OUT is set (what a device call brings back). Copy the JSON files to
benchmarks/data/kt-throughput/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "build" / "gpu-host"
TP = BUILD / "tp"
RESULTS = TP / "results"
DATA = TP / "data" / "long.jsonl"
CHAT_DATA = TP / "data" / "chat.jsonl"
MODEL = BUILD / "big" / "model"
MODEL2 = TP / "model2"
MODEL3 = TP / "model3"
RECIPE = REPO / "gpu_host" / "big-kt-rawint4.yaml"
KT_VS_HF = REPO / "benchmarks" / "kt_vs_hf.py"
sys.path[:0] = [str(REPO), str(REPO / "benchmarks"), str(REPO / "gpu_host")]
from kt_vs_hf import _OPENERS, _sentence, _summarize_profile, measure  # noqa: E402  (psutil only)

# The second shape: Kimi's widths, 6 layers (5 MoE) of 256 routed experts, top-8 (the first: 8 layers of 180).
SHAPE2 = {"layers": 6, "experts": 256, "experts_per_tok": 8, "hidden": 7168, "moe_intermediate": 2048,
          "intermediate": 18432, "heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
          "qk_rope_head_dim": 64, "v_head_dim": 128}
# The third: Kimi's widths, 4 layers (3 MoE) of 96 routed experts: 7.1 GB of packed INT4 experts (model 1: 31.2).
SHAPE3 = {**SHAPE2, "layers": 4, "experts": 96}
RECORDS = 64
# chat-data: record lengths (tokens under the model's chat template) drawn uniformly from this range.
CHAT_TOKENS = (100, 500)
ANSWER_WORDS = 5200  # > 4,096 tokens under the fixture's tokenizer with the question: every sample is cut


def default_python() -> Path:
    return BUILD / "bundle" / "bin" / "python"


def env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "KTFLOW_SRC": str(REPO), "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def pack_results() -> None:
    out = os.environ.get("OUT")
    if not out:
        return
    with tarfile.open(Path(out) / "tp-results.tar.gz", "w:gz") as tar:
        tar.add(RESULTS, arcname="results")


def save(name: str, doc: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"name": name, "stamp": time.strftime("%Y-%m-%dT%H:%M:%S"), **doc}
    (RESULTS / f"{name}.json").write_text(json.dumps(doc, indent=2, default=str))
    pack_results()


# --------------------------------------------------------------------------- host limits


def _best_of(fn: Any, reps: int) -> tuple[float, float]:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times)


def phase_host(args: argparse.Namespace) -> int:
    """Memory read bandwidth (torch sum over 4 GiB), copy bandwidth (read + write counted) and CPU BF16
    matmul throughput (oneDNN: AMX where the CPU has it), at 16 threads and fewer (``--quick``: 16 only,
    the 512-row expert shape only; saved as host-quick)."""
    import torch

    quick = args.quick

    doc: dict[str, Any] = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                           "mkldnn": torch.backends.mkldnn.is_available(), "nproc": os.cpu_count(),
                           "machine": platform.machine()}
    cpuinfo = Path("/proc/cpuinfo").read_text()
    doc["cpu_model"] = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                             if line.startswith("model name")), None)
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    doc["cpu_isa"] = sorted(f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512f", "avx512_vnni")))
    doc["numa_nodes"] = len(list(Path("/sys/devices/system/node").glob("node[0-9]*")))
    mem = {line.split(":")[0]: line.split(":")[1].strip() for line in Path("/proc/meminfo").read_text().splitlines()}
    doc["mem_total"], doc["mem_available_at_start"] = mem.get("MemTotal"), mem.get("MemAvailable")
    if shutil.which("nvidia-smi"):
        doc["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                     "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    doc["free_disk_gb"] = round(shutil.disk_usage(REPO).free / 1e9, 1)

    n = 1 << 30  # 4 GiB of float32
    src = torch.empty(n, dtype=torch.float32).uniform_(-1, 1)
    dst = torch.empty_like(src)
    bandwidth: dict[str, Any] = {}
    for threads in (16,) if quick else (16, 8, 4, 1):
        torch.set_num_threads(threads)
        src.sum()  # warm
        best, med = _best_of(lambda: src.sum(), 5 if threads > 1 else 2)
        cbest, cmed = _best_of(lambda: dst.copy_(src), 5 if threads > 1 else 2)
        bandwidth[str(threads)] = {"read_gb_s_best": round(4 * n / best / 1e9, 1),
                                   "read_gb_s_median": round(4 * n / med / 1e9, 1),
                                   "copy_gb_s_best": round(8 * n / cbest / 1e9, 1),
                                   "copy_gb_s_median": round(8 * n / cmed / 1e9, 1)}
        print(f"bandwidth {threads} threads: {bandwidth[str(threads)]}", flush=True)
    doc["memory_bandwidth"] = {"buffer_bytes": 4 * n, "how": "torch float32 sum (read) and copy_ (read + write "
                               "counted) over a 4 GiB buffer of uniform values; best and median of 5",
                               "by_threads": bandwidth}
    src = dst = torch.empty(0)

    # BF16 matmul: the routed experts' shapes (rows x 7168 @ 7168 x 2048, and back) and a square one.
    shapes = [(32, 7168, 2048), (128, 7168, 2048), (512, 7168, 2048), (2048, 7168, 2048), (512, 2048, 7168),
              (4096, 4096, 4096)]
    matmul: list[dict[str, Any]] = []
    for threads in (16,) if quick else (16, 8, 4):
        torch.set_num_threads(threads)
        few = [(512, 7168, 2048)] if quick else [(512, 7168, 2048), (4096, 4096, 4096)]
        for m, k, nn in shapes if threads == 16 and not quick else few:
            sets = [(torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, nn, dtype=torch.bfloat16)) for _ in range(4)]
            for a, b in sets:
                a @ b  # warm (oneDNN primitive creation)
            reps = max(4, min(64, int(2e11 / (2 * m * k * nn))))
            times = []
            for i in range(reps):
                a, b = sets[i % len(sets)]
                t = time.perf_counter()
                a @ b
                times.append(time.perf_counter() - t)
            flops = 2 * m * k * nn
            row = {"threads": threads, "m": m, "k": k, "n": nn, "reps": reps,
                   "tflops_best": round(flops / min(times) / 1e12, 2),
                   "tflops_median": round(flops / statistics.median(times) / 1e12, 2)}
            matmul.append(row)
            print(f"matmul {row}", flush=True)
    # correctness of one product against float64 (the rate is meaningless if the result is wrong)
    a, b = torch.randn(512, 7168, dtype=torch.bfloat16), torch.randn(7168, 2048, dtype=torch.bfloat16)
    ref = a.double() @ b.double()
    rel = float((a @ b).double().sub(ref).norm() / ref.norm())
    doc["bf16_matmul"] = {"how": "torch bf16 a @ b on the CPU (oneDNN), 4 input sets rotated, best and median",
                          "rel_error_vs_float64": rel, "rows": matmul}
    torch.set_num_threads(16)
    save("host-quick" if quick else "host", doc)
    return 0


# --------------------------------------------------------------------------- data


def phase_data(_: argparse.Namespace) -> int:
    """RECORDS chat records, each longer than 4,096 tokens (a short question, a long answer)."""
    import random

    rng = random.Random(0)
    lines = []
    for _ in range(RECORDS):
        question = f"{rng.choice(_OPENERS)} " + " ".join(_sentence(rng, 6, 14) for _ in range(2))
        words = 0
        answer = []
        while words < ANSWER_WORDS:
            s = _sentence(rng, 8, 18)
            answer.append(s)
            words += len(s.split())
        lines.append(json.dumps({"messages": [{"role": "user", "content": question},
                                              {"role": "assistant", "content": " ".join(answer) + " nya~"}]}))
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text("\n".join(lines) + "\n")
    print(f"data: {RECORDS} records, {DATA.stat().st_size} bytes -> {DATA}")
    return 0


def phase_chat_data(args: argparse.Namespace) -> int:
    """RECORDS multi-turn chat records whose lengths (tokens under ``--model``'s chat template) are drawn
    uniformly from CHAT_TOKENS: 1-3 turns of a question and an answer, the last answer cut to the drawn
    length at a word boundary. Seeded: the same records on every host with the same tokenizer."""
    import random

    from transformers import AutoTokenizer

    from ktflow.planning.batch_shape import _tokens  # a record's tokens as ktflow's planner counts them

    tokenizer = AutoTokenizer.from_pretrained(str(Path(args.model).absolute()), trust_remote_code=True)
    rng = random.Random(1)
    lines, lengths = [], []
    for _ in range(RECORDS):
        target = rng.randint(*CHAT_TOKENS)
        turns = rng.randint(1, 3)
        messages: list[dict[str, str]] = []
        for turn in range(turns):
            question = f"{rng.choice(_OPENERS)} " + " ".join(_sentence(rng, 4, 10) for _ in range(rng.randint(1, 2)))
            messages.append({"role": "user", "content": question})
            words: list[str] = []
            messages.append({"role": "assistant", "content": ""})
            # grow this answer a sentence at a time; the last turn's answer stops at the drawn length
            share = target if turn == turns - 1 else target * (turn + 1) // turns
            while True:
                words.extend(_sentence(rng, 6, 14).split())
                messages[-1]["content"] = " ".join(words)
                if _tokens(messages, tokenizer) >= share:
                    break
        while len(words) > 1 and _tokens(messages, tokenizer) > target:
            words.pop()
            messages[-1]["content"] = " ".join(words)
        messages[-1]["content"] += " nya~"
        lengths.append(_tokens(messages, tokenizer))
        lines.append(json.dumps({"messages": messages}))
    out = Path(args.out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    doc = {"records": RECORDS, "target_tokens": CHAT_TOKENS, "lengths": lengths,
           "mean": round(statistics.mean(lengths), 1), "min": min(lengths), "max": max(lengths),
           "path": str(out.relative_to(REPO) if out.is_relative_to(REPO) else out), "tokenizer": str(args.model)}
    if out == CHAT_DATA.absolute():
        save("chat-data", doc)
    else:  # beside the records (another harness's results)
        out.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    print(f"chat-data: {RECORDS} records, tokens mean {doc['mean']} ({doc['min']}-{doc['max']}) -> {out}")
    return 0


# --------------------------------------------------------------------------- runs


def expert_bytes(model: Path) -> dict[str, Any]:
    """Routed-expert bytes as stored (packed INT4 + scales + shapes), from safetensors headers."""
    from ktflow.formats.safetensors_io import read_header

    routed = other = 0
    layers: set[int] = set()
    for shard in sorted(model.glob("*.safetensors")):
        for name, info in read_header(shard).tensors.items():
            m = re.search(r"layers\.(\d+)\.mlp\.experts\.\d+\.", name)
            if m:
                routed += info.nbytes
                layers.add(int(m.group(1)))
            else:
                other += info.nbytes
    config = json.loads((model / "config.json").read_text())
    text = config.get("text_config", config)
    return {"routed_expert_bytes": routed, "other_bytes": other, "moe_layers": len(layers),
            "dims": {k: text.get(k) for k in ("num_hidden_layers", "n_routed_experts", "num_experts_per_tok",
                                              "hidden_size", "moe_intermediate_size", "vocab_size")}}


def ktflow_json(python: Path, *args: str, timeout: int = 180) -> dict[str, Any]:
    done = subprocess.run([str(python), "-m", "ktflow.cli", *args], env=env(), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    try:  # ``ktflow plan`` exits 2 when a stage does not fit (the local planner's view) and still prints its JSON
        doc = json.loads(done.stdout)
    except ValueError:
        raise SystemExit(f"ktflow {' '.join(args[:2])} failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
                         f"{done.stdout[-1000:]}") from None
    if done.returncode != 0 and args[0] != "plan":
        raise SystemExit(f"ktflow {' '.join(args[:2])} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    notes = [line for line in done.stderr.splitlines() if line.startswith("sft ")]  # e.g. the batch-shape line
    if args[0] == "plan":
        return {**doc, "exit_code": done.returncode}
    return {**doc, "_stderr_notes": notes} if isinstance(doc, dict) else doc


def run_sets(spec: str, args: argparse.Namespace, store: Path) -> list[str]:
    """The recipe overrides of a run ``NAME:B:G:C:T:S`` (see the module's docstring)."""
    _, batch, gas, cutoff, threads, steps = spec.split(":")
    python = Path(args.python).absolute()
    return [f"source.local_path={Path(args.model).absolute()}", f"dataset.files=[{Path(args.data).absolute()}]",
            f"store.root={store}", f"toolchains.train.python={python}", f"toolchains.serve.python={python}",
            f"sft.per_device_train_batch_size={batch}", f"sft.gradient_accumulation_steps={gas}",
            f"sft.cutoff_len={cutoff}", f"sft.kt_config.kt_model_max_length={cutoff}",
            f"sft.kt_config.kt_num_threads={threads}", f"sft.max_steps={steps}", "sft.save_steps=1000",
            *(args.set or ())]


def run_one(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    import yaml

    name, b, g, c, t, s = spec.split(":")
    batch, gas, cutoff, threads, steps = int(b), int(g), int(c), int(t), int(s)
    warmup = 1 if steps >= 4 else 0
    python = Path(args.python).absolute()
    model = Path(args.model).absolute()
    recipe = Path(args.recipe).absolute()
    data = Path(args.data).absolute()
    store = TP / "store"
    sets = run_sets(spec, args, store)
    doc: dict[str, Any] = {"settings": {"per_device_train_batch_size": batch, "gradient_accumulation_steps": gas,
                                        "cutoff_len": cutoff, "kt_num_threads": threads, "max_steps": steps,
                                        "tokens_per_microbatch_nominal": batch * cutoff,
                                        "microbatches_per_step": gas, "extra_sets": list(args.set or ())},
                           "recipe": str(recipe.relative_to(REPO)), "sets": sets, "model": str(model),
                           "data": str(data.relative_to(REPO))}
    doc["model_facts"] = expert_bytes(model)
    t0 = time.perf_counter()
    plan = ktflow_json(python, "sft", str(recipe), "--dry-run", "--json", *[a for x in sets for a in ("--set", x)])
    doc["batch_shape"] = plan.pop("_stderr_notes", [])
    trained = plan["train_config"]
    if (trained["per_device_train_batch_size"], trained["gradient_accumulation_steps"]) != (batch, gas):
        # ktflow sft shaped the split (sft.kt_shape_batches): the run trains what the plan says
        doc["settings"].update(written_split=[batch, gas],
                               per_device_train_batch_size=trained["per_device_train_batch_size"],
                               gradient_accumulation_steps=trained["gradient_accumulation_steps"],
                               microbatches_per_step=trained["gradient_accumulation_steps"],
                               tokens_per_microbatch_nominal=trained["per_device_train_batch_size"] * cutoff)
        batch, gas = trained["per_device_train_batch_size"], trained["gradient_accumulation_steps"]
    dataset_dir = Path(plan["train_config"]["dataset_dir"])
    if not dataset_dir.is_dir():
        done = subprocess.run([str(python), str(KT_VS_HF), "_prepare_data", str(recipe), json.dumps(sets),
                               str(dataset_dir)], env=env(), cwd=REPO, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise SystemExit(f"_prepare_data failed:\n{done.stderr[-3000:]}")
    out = TP / "runs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True)
    cfg = dict(plan["train_config"], output_dir=str(out / "output"), save_strategy="no")
    (out / "train.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    (out / "accelerate.yaml").write_text(yaml.safe_dump(plan["accelerate_config"], sort_keys=False))
    launch = [str(out / Path(a).name) if a.endswith((".yaml", ".yml")) else a for a in plan["launch"]]
    profile = out / "kt_profile.json"
    argv = launch[: launch.index("--no_python")] + [str(KT_VS_HF), "_profile_train", str(out / "train.yaml"),
                                                    str(profile), str(warmup + 1)]
    run_env = {**env(), "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}", **plan["env"],
               "KT_SFT_PROFILE": "1"}
    doc["prepare_s"] = round(time.perf_counter() - t0, 1)
    doc["command"] = argv
    doc["train_config"] = cfg
    from big import deadline

    with deadline(args.limit) as timer:
        try:
            doc.update(measure(argv, env=run_env, log=out / "train.log", trainer_log=out / "output/trainer_log.jsonl",
                               warmup=warmup))
            doc["outcome"] = "trained"
        except SystemExit as exc:
            doc.update(outcome="failed", error=str(exc)[-4000:])
    if timer["fired"]:
        doc["outcome"] += f" (killed at the run's limit, {args.limit} s)"
    times, tokens = doc.get("step_logged_at_s", []), doc.get("tokens_logged", [])
    if len(times) >= 2:
        doc["step_intervals_s"] = [round(y - x, 2) for x, y in zip(times, times[1:])]
        doc["tokens_per_step"] = [y - x for x, y in zip(tokens, tokens[1:]) if x is not None and y is not None]
        if doc["tokens_per_step"]:
            doc["tokens_per_microbatch_measured"] = statistics.median(doc["tokens_per_step"]) / gas
        doc["steady_covers"] = f"logged steps {doc['steady_steps'][0]}..{doc['steady_steps'][1]} (intervals)"
    if profile.is_file():
        raw = json.loads(profile.read_text())
        doc["kt_timers"] = _summarize_profile(raw)
        shutil.copyfile(profile, RESULTS / f"{name}.kt_profile.json")
    for f in ("trainer_log.jsonl",):
        if (out / "output" / f).is_file():
            shutil.copyfile(out / "output" / f, RESULTS / f"{name}.{f}")
    tail = (out / "train.log").read_text(errors="replace").splitlines()[-40:] if (out / "train.log").is_file() else []
    doc["log_tail"] = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in tail]
    shutil.rmtree(out / "output", ignore_errors=True)  # the adapter (fused expert LoRA: GBs with its state)
    try:
        doc["plan"] = ktflow_json(python, "plan", str(recipe), "--json", *[a for x in sets for a in ("--set", x)],
                                  timeout=120)
    except (SystemExit, subprocess.TimeoutExpired, ValueError) as exc:
        doc["plan"] = {"error": str(exc)[-1500:]}
    save(name, doc)
    keys = ("outcome", "steady_step_s", "steady_step_spread_s", "tokens_per_s_steady", "peak_gpu_mib",
            "peak_host_rss_gib", "load_s", "wall_s", "tokens_per_microbatch_measured")
    print(f"{name}: " + json.dumps({k: doc.get(k) for k in keys}), flush=True)
    return doc


def phase_run(args: argparse.Namespace) -> int:
    RESULTS.mkdir(parents=True, exist_ok=True)
    status = 0
    for spec in args.specs:
        doc = run_one(spec, args)
        status |= doc.get("outcome") != "trained"
    return status


def phase_calibrate(args: argparse.Namespace) -> int:
    """The per-host calibration end to end, through ``ktflow sft`` itself (ktflow/planning/host_speed.py):
    each run ``NAME:B:G:C:T:S`` in turn is first planned (``ktflow plan --json``: the step it predicts, and
    on what basis), then trained by the real SFT stage in one store, whose manifest records the steady
    step measured and the shipped model's prediction. The first run is planned uncalibrated; each later
    one is planned with what the earlier runs on this host recorded. Saved as ``calibrate.json``."""
    python = Path(args.python).absolute()
    recipe = str(Path(args.recipe).absolute())
    store = TP / "cal-store"
    shutil.rmtree(store, ignore_errors=True)
    doc: dict[str, Any] = {"recipe": str(Path(recipe).relative_to(REPO)), "runs": []}
    status = 0
    for spec in args.specs:
        sets = [a for x in run_sets(spec, args, store) for a in ("--set", x)]
        plan = ktflow_json(python, "plan", recipe, "--json", *sets, timeout=180)
        line = next(st for st in plan["stages"] if st["stage"] == "sft")
        before = {p.parent for p in store.glob("runs/*/adapter/manifest.json")}
        t0 = time.perf_counter()
        try:
            done = subprocess.run([str(python), "-m", "ktflow.cli", "sft", recipe, *sets], env=env(), cwd=REPO,
                                  capture_output=True, text=True, timeout=args.limit)
            rc, out, err = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out, err = 124, str(exc.stdout or ""), str(exc.stderr or "")
        new = sorted({p.parent for p in store.glob("runs/*/adapter/manifest.json")} - before)
        manifest = json.loads((new[0] / "manifest.json").read_text()) if new else {}
        run = {"name": spec.split(":")[0], "spec": spec, "planned_step_s": line.get("step_seconds"),
               "plan_basis": line.get("time_basis"), "rc": rc, "wall_s": round(time.perf_counter() - t0, 1),
               "kt_step": manifest.get("extra", {}).get("kt_step"), "adapter": str(new[0]) if new else None,
               "stdout_tail": out[-1500:], "stderr_tail": err[-3000:]}
        if run["kt_step"] and run["planned_step_s"]:
            run["planned_residual"] = round(run["planned_step_s"] / run["kt_step"]["measured_step_s"] - 1, 4)
        doc["runs"].append(run)
        save("calibrate", doc)
        print(json.dumps({k: run[k] for k in ("name", "rc", "wall_s", "planned_step_s", "kt_step")}), flush=True)
        status |= rc != 0
    return status


def phase_fixture2(args: argparse.Namespace) -> int:
    """The second shape, made here; the first model is deleted first (a 64 GiB disk holds one)."""
    shutil.rmtree(MODEL, ignore_errors=True)
    return _make_shape("fixture2", MODEL2, SHAPE2, args)


def phase_fixture3(args: argparse.Namespace) -> int:
    """The third shape (7.1 GB of experts), beside model 1 (34.4 GB): both fit the 64 GiB disk."""
    return _make_shape("fixture3", MODEL3, SHAPE3, args)


def _make_shape(name: str, model: Path, shape: dict[str, int], args: argparse.Namespace) -> int:
    shutil.rmtree(model, ignore_errors=True)
    t = time.perf_counter()
    code = ("import sys, json\nfrom ktflow.fixtures.checkpoints import FixtureSpec, make_fixture\n"
            "from ktflow.fixtures.stream import MoeDims\n"
            "make_fixture(FixtureSpec(kind='kimi-k2.5', size='bigger-than-gpu'), sys.argv[1], "
            "dims=MoeDims(**json.loads(sys.argv[2])))\n")
    done = subprocess.run([str(Path(args.python).absolute()), "-c", code, str(model), json.dumps(shape)], env=env(),
                          cwd=REPO, capture_output=True, text=True)
    doc = {"dims": shape, "rc": done.returncode, "wall_s": round(time.perf_counter() - t, 1),
           "stderr_tail": done.stderr[-2000:]}
    if done.returncode == 0:
        doc["model_facts"] = expert_bytes(model)
        doc["on_disk_gb"] = round(sum(p.stat().st_size for p in model.glob("*.safetensors")) / 1e9, 2)
    save(name, doc)
    print(json.dumps({k: v for k, v in doc.items() if k != "stderr_tail"}), flush=True)
    return done.returncode


# --------------------------------------------------------------------------- summary (no torch: runs anywhere)

_RUNTIME = re.compile(r"'loss'.*'train_runtime': '([0-9.]+)'")


def _inside_intervals(doc: dict[str, Any]) -> list[float]:
    """Step intervals from LlamaFactory's own ``train_runtime`` of each logged step (in the log tail): the
    figures of a run whose children were killed after training (the outside stamps are lost then)."""
    seen: list[float] = []
    for line in doc.get("log_tail", []):
        m = _RUNTIME.search(line)
        if m and (not seen or float(m.group(1)) > seen[-1]):
            seen.append(float(m.group(1)))
    return [round(b - a, 2) for a, b in zip(seen, seen[1:])]


def _host_rates(host: dict[str, Any], threads: int) -> tuple[float | None, float | None]:
    """Read bandwidth (GB/s, median) and BF16 matmul rate (TFLOP/s, median, 512 x 7168 @ 7168 x 2048) at
    ``threads`` (measured at 16, 8 and 4)."""
    bw = host.get("memory_bandwidth", {}).get("by_threads", {}).get(str(threads), {}).get("read_gb_s_median")
    rate = next((r["tflops_median"] for r in host.get("bf16_matmul", {}).get("rows", [])
                 if r["threads"] == threads and (r["m"], r["k"], r["n"]) == (512, 7168, 2048)), None)
    return bw, rate


def summarize(results: Path) -> dict[str, Any]:
    """One row per run (the figures a step-time fit needs) and the host's limits, from results/*.json."""
    host = json.loads((results / "host.json").read_text()) if (results / "host.json").is_file() else {}
    rows = []
    for path in sorted(results.glob("*.json")):
        doc = json.loads(path.read_text())
        if "settings" not in doc:
            continue
        st, facts = doc["settings"], doc["model_facts"]
        dims = facts["dims"]
        gas, threads = st["microbatches_per_step"], st["kt_num_threads"]
        step, covers, source = doc.get("steady_step_s"), doc.get("steady_covers"), "outside (trainer_log stamps)"
        if step is None:
            inside = _inside_intervals(doc)
            if len(inside) >= 2:
                step = round(statistics.median(inside[-2:]), 2)
                covers = f"steps {len(inside)}..{len(inside) + 1} (LlamaFactory train_runtime deltas: {inside})"
                source = "inside (LlamaFactory train_runtime; the run was killed at its limit during the final save)"
        tokens_mb = doc.get("tokens_per_microbatch_measured") or st["tokens_per_microbatch_nominal"]
        tokens_step = tokens_mb * gas
        # Floors: the packed experts read once per pass (forward + backward: 2 passes per micro-batch, activations
        # retained, no recompute), and the expert matmuls (gate, up, down: 3 x 2 x hidden x moe_intermediate FLOPs per
        # token and active expert, forward + input gradient = 2x; LoRA and router work left out).
        bw, rate = _host_rates(host, threads)
        expert_bytes = facts["routed_expert_bytes"]
        flops = tokens_step * facts["moe_layers"] * dims["num_experts_per_tok"] * 6 * dims["hidden_size"] * \
            dims["moe_intermediate_size"] * 2
        bytes_floor = 2 * gas * expert_bytes / (bw * 1e9) if bw else None
        flop_floor = flops / (rate * 1e12) if rate else None
        timers = doc.get("kt_timers", {}) if isinstance(doc.get("kt_timers"), dict) else {}
        rows.append({
            "name": doc["name"], "outcome": doc.get("outcome"), "model": doc.get("model"),
            "moe_layers": facts["moe_layers"], "routed_experts": dims["n_routed_experts"],
            "experts_per_token": dims["num_experts_per_tok"], "routed_expert_bytes": expert_bytes,
            "per_device_train_batch_size": st["per_device_train_batch_size"], "cutoff_len": st["cutoff_len"],
            "tokens_per_microbatch": tokens_mb, "microbatches_per_step": gas, "tokens_per_step": tokens_step,
            "rows_per_expert_per_microbatch": round(tokens_mb * dims["num_experts_per_tok"] / dims["n_routed_experts"], 1),
            "kt_num_threads": threads, "max_steps": st["max_steps"], "steady_step_s": step, "steady_covers": covers,
            "step_source": source, "steady_step_spread_s": doc.get("steady_step_spread_s"),
            "step_intervals_s": doc.get("step_intervals_s") or _inside_intervals(doc),
            "tokens_per_s": round(tokens_step / step, 1) if step else None,
            "peak_gpu_mib_over_idle": doc.get("peak_gpu_mib"), "peak_host_rss_gib": doc.get("peak_host_rss_gib"),
            "load_s": doc.get("load_s"),
            "kt_forward_s_per_step": timers.get("kt_moe_s_per_step", {}).get("forward"),
            "kt_backward_s_per_step": timers.get("kt_moe_s_per_step", {}).get("backward"),
            "kt_share_of_step": timers.get("kt_moe_share"), "kt_profiled_step_s": timers.get("step_s"),
            "floor_bytes_s": round(bytes_floor, 2) if bytes_floor else None,
            "floor_flops_s": round(flop_floor, 2) if flop_floor else None, "expert_flops_per_step": flops,
            "step_over_bytes_floor": round(step / bytes_floor, 2) if step and bytes_floor else None,
            "step_over_flops_floor": round(step / flop_floor, 2) if step and flop_floor else None,
            "losses": doc.get("losses"),
        })
    limits = {"read_gb_s_median_by_threads": {t: _host_rates(host, int(t))[0] for t in ("16", "8", "4")},
              "bf16_matmul_tflops_median_512x7168x2048_by_threads": {t: _host_rates(host, int(t))[1]
                                                                     for t in ("16", "8", "4")}}
    return {"host_limits": limits, "floors": "floor_bytes_s = 2 passes x micro-batches x routed_expert_bytes / read "
            "bandwidth at the run's thread count; floor_flops_s = tokens x MoE layers x top-k x 6 x hidden x "
            "moe_intermediate x 2 (forward + input gradient) / BF16 matmul rate at the run's thread count",
            "runs": rows}


def phase_summary(args: argparse.Namespace) -> int:
    results = Path(args.specs[0]) if args.specs else RESULTS
    doc = summarize(results)
    (results / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
    cols = ("name", "tokens_per_microbatch", "microbatches_per_step", "kt_num_threads", "steady_step_s", "tokens_per_s",
            "peak_gpu_mib_over_idle", "peak_host_rss_gib", "step_over_bytes_floor", "step_over_flops_floor")
    print(" | ".join(cols))
    for row in doc["runs"]:
        print(" | ".join(str(row[c]) for c in cols))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=("host", "data", "chat-data", "run", "calibrate", "fixture2", "fixture3",
                                          "summary"))
    parser.add_argument("specs", nargs="*", help="run: NAME:BATCH:GAS:CUTOFF:THREADS:STEPS ...; summary: the results folder")
    parser.add_argument("--python", default=str(default_python()))
    parser.add_argument("--model", default=str(MODEL))
    parser.add_argument("--limit", type=int, default=480, help="a run's time limit (s): its children are killed then")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="a further recipe override")
    parser.add_argument("--recipe", default=str(RECIPE), help="the recipe the runs train (default: big-kt-rawint4)")
    parser.add_argument("--data", default=str(DATA), help="the records (default: the long ones; chat-data's: "
                        f"{CHAT_DATA.relative_to(REPO)})")
    parser.add_argument("--quick", action="store_true", help="host: 16 threads and the expert shape only")
    parser.add_argument("--out", default=str(CHAT_DATA), help="chat-data: where the records go (default: "
                        f"{CHAT_DATA.relative_to(REPO)}; elsewhere, their lengths go beside them as .json)")
    args = parser.parse_args()
    return {"host": phase_host, "data": phase_data, "chat-data": phase_chat_data, "run": phase_run,
            "calibrate": phase_calibrate, "fixture2": phase_fixture2, "fixture3": phase_fixture3,
            "summary": phase_summary}[args.phase](args)


if __name__ == "__main__":
    sys.exit(main())
