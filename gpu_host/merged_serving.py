#!/usr/bin/env python3
"""Merged serving measured on the GPU host: the LoRA path, the merged model and the base model side by side at
Kimi-K2.5's true geometry, the engine's levers one at a time, and served = trained for each merged format.

The model is kimi_slice.py's (``ktflow fixture kimi-k2.5 --size slice``: Kimi-K2.5's first N+1 layers, 384 routed
experts of [2048, 7168], vocabulary 163840), trained here by ``ktflow sft gpu_host/slice-kt-rawint4.yaml`` and
converted by ``ktflow convert-lora`` (or, with ``adapter --random``, a converted adapter of random non-zero LoRA on
the attention and every expert, published as ``converted-random``). Servers go through ktflow's serve stage
(``serving.mode: lora`` for the LoRA path, ``merged`` for the merge stage's output, no adapter for the base) with
gpu_host/slice-sglang-rawint4.yaml's serving section; each server's results come with the host's read bandwidth
measured just before it (the decode floor, benchmarks/serve_load.py). Each phase is a ``gpu_host/run.sh merged-*``
step, stops every server it started (and checks none is left), writes build/gpu-host/merged/results/*.json (every
earlier run in ``history/``) and stays under 540 s: a phase that runs out of time stops, says what it left, and
the same step run again goes on from there.

    PY=build/gpu-host/bundle/bin/python          # after `run.sh setup` (and `serve-setup` for the serving phases)
    $PY gpu_host/merged_serving.py fixture       # the model at the depth the disk allows (depth.json)   ~60-110 s
    $PY gpu_host/merged_serving.py adapter       # ktflow sft (5 steps) + convert-lora + the records' tokens ~200-280 s
    $PY gpu_host/merged_serving.py merge         # ktflow merge RAWINT4 into the store, timed               ~40-120 s
    $PY gpu_host/merged_serving.py levers --group engine|gpu|threads|methods|combo   # item 3, 3-4 servers  ~400-530 s
    $PY gpu_host/merged_serving.py load          # item 5: LoRA path, merged (chosen), base; c = 1, 4, 16  ~450-530 s
    $PY gpu_host/merged_serving.py alternate     # item 5: base and merged (chosen) started in turn, c = 1  ~4 x 100 s
    $PY gpu_host/merged_serving.py check --name bf16|rawint4   # item 4 on the tiny fixtures, 4 servers      ~250-330 s
    $PY gpu_host/merged_serving.py report        # summary.json: the three tables

Wall times (16-core H100 host; from benchmarks/data): the slice fixture wrote 35 GB (depth 3) in 61-79 s; its
5-step SFT took 158-161 s at depth 3 on 16 and 32 threads (a MoE layer ~1/3 of it); sglang-kt at depth 3 with
the KT LoRA was ready in 177 s on a fresh machine, 79 s of it the first request's kernel compilation, 44 s loading
(~7 s a MoE layer of RAWINT4 experts + ~6 s of its expert LoRA), ~50 s imports and tokenizer: a warm start of a
merged or base model is ~80 s at depth 1-2, ~100 s at depth 3, plus CUDA-graph capture (seconds; measured here:
``ready_s``). The load at concurrency 1, 4, 16 with 128 tokens (4, 8 and 32 requests) took 46 s at depth 3 for
concurrency 1 and 8 on the LoRA path (22.9 and 8.3 tokens/s a sequence): ~90 s for the three levels on the LoRA
path, less merged. A lever run (concurrency 1, 3 requests of 256 tokens) is ~25 s. Merges: no merge is timed at
this size yet; ktflow plan's merge_cost prices RAWINT4 at depth 2 at ~40 s on 16 cores and each AMX format at
~45 s; ``merge`` measures it. The tiny servers of ``check`` were ready in 46-63 s warm (docs/results/serving.md).
So: ``load`` = 3 x (~85 s ready + ~10 s served loss + ~60-90 s load + ~7 s stop) + 3 x ~5 s bandwidth;
``levers`` = 3-4 x (~85-100 s + ~25 s); ``check`` = 4 x (~55 s + ~5 s) + merges of a few seconds.

Disk: the fixture's vision part is a stand-in sglang-kt cannot build, so every served checkpoint gets a
language-model view the size of the checkpoint (ktflow/stages/serve/sglang/inputs.py). The base is kept (the LoRA
path, the base server and every merge read it): the merged server's start holds the base, the merge and its view,
~3x the base (depth 1: 15.6 GB a copy, 2: 25.4, 3: 35.2). ``fixture`` picks the deepest of 3, 2, 1 that fits the
free disk (64 GiB host: depth 1; 235 GiB host: depth 3). With ``VIEW_ROOT`` on another filesystem (a tmpfs) the
views go there and the disk holds the base and its merge (64 GiB disk: depth 2); the choice is kept in depth.json
for the later steps. The serving phases remove other models' views and other merges (both made again in seconds
to a minute) where room is short before a start that would not fit, never the base.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import big  # noqa: E402  (gpu_host/big.py: running and watching children, sft, convert)
import kimi_slice  # noqa: E402  (gpu_host/kimi_slice.py: the slice's fixture, records and recipes)
from big import BUILD, REPO, free_disk_gb, run_watched  # noqa: E402

if TYPE_CHECKING:
    from ktflow.host.hardware import HostInfo
    from ktflow.recipe import Recipe
    from ktflow.stages.serve.levers import LeverCandidate, LeverMeasurement, LeverRun, ServedModel, ServingLevers

ROOT = BUILD / "merged"
RESULTS = ROOT / "results"
SERVE_PY = BUILD / "serve" / "bin" / "python"
# The slice's size on disk (benchmarks/data/kimi-slice: depth 3 = 35.22 GB): a fixed part (embeddings, layer 0,
# the vision stand-in) and one MoE layer of 384 INT4 experts.
FIXED_GB, LAYER_GB = 5.82, 9.8
MARGIN_GB = 4.0  # the adapter, its checkpoints' leftovers, sglang-kt's LoRA split in /tmp, logs
DEPTHS = (3, 2, 1)
# Where the served checkpoints' language-model views go (each the size of its checkpoint; see ktflow's
# stages/serve/sglang/inputs.py): beside the slice (default), or under VIEW_ROOT, e.g. a tmpfs such as /dev/shm on a
# host with more RAM than disk, where they cost RAM instead (a 64 GiB disk then holds depth 2: the base and its merge).
VIEW_ROOT_ENV = "VIEW_ROOT"
# What every merged (and base) server of the slice is started with unless a lever says otherwise: the merged mode's
# point (CUDA graphs on), room for concurrency 16, the slice recipe's other settings (graphs off is the LoRA path's).
MERGED_SETS = ["serving.mode=merged", "serving.disable_cuda_graph=false", "serving.max_running_requests=16"]
LORA_SETS = ["serving.mode=lora", "serving.max_running_requests=16"]
LOAD_ARGS = "--concurrency 1,4,16 --max-tokens 128"  # item 5 (4, 8 and 32 requests)
LEVER_ARGS = "--concurrency 1 --max-tokens 256 --requests-per-level 3"
SERVED_LOSS_RECORDS = 16  # the slice's training records whose served loss each load server reports
START_S = {1: 85.0, 2: 90.0, 3: 100.0}  # a warm server start by depth (docstring), for the phases' time budget
LEVER_S, LOAD_S = 40.0, 120.0  # one lever run's load, and item 5's, plus bandwidth and stop
MERGE_S = 90.0  # a merge the phase must make before its server starts, for the phases' time budget
# A tiny fixture's server in the check: ready in 73-158 s on the H200 + 16-core host (the first after serve-setup the
# slowest), then ~5 s to score and its merged weights' float32 score; a server started with less than this left is
# likely killed before it scores (seen with 90 s): the step is run again for it instead.
CHECK_SERVER_S = 150.0
# loss_check.py's reference runs in the host's own python (transformers + PEFT, nothing of the KT stack): run.sh's
# losscheck steps call it as python3 too.
REFERENCE_PYTHON = os.environ.get("KTFLOW_REFERENCE_PYTHON", "python3")
# GPU experts: their INT4 MoE GEMM is sglang's Marlin kernel, compiled by nvcc at its first call (the CUDA-graph
# capture's warm-up): one nvcc process, ~180 template variants, minutes (two starts on an H100 host had not finished
# it ~100 s into the capture). `run.sh serve-jit` builds it once into TVM_FFI_CACHE_DIR; without that build a GPU
# experts lever is not started (GPU_EXPERTS_JIT), with it such a start gets a little more time for the capture.
GPU_EXPERTS_START_EXTRA_S = 60.0
GPU_EXPERTS_JIT = "*moe_wna16_marlin*"  # the built module's folder in TVM_FFI_CACHE_DIR

# Kimi-K2.5 whole (recipes/kimi-k2.5-rawint4.yaml's size block): what a card would give the GPU experts (the
# product's gpu_expert_share, through its lever candidates: ktflow/stages/serve/levers.py).
WHOLE_RECIPE = kimi_slice.WHOLE_RECIPE
# The LoRA path's own figures (tiny fixtures; docs/results/serving.md): served loss and loss_check's reference.
LORA_PATH_PUBLISHED = {"bf16": {"AMXBF16 (LoRA path)": (0.059865, 0.059443), "AMXINT8 (LoRA path)": (0.061720, 0.059443)},
                       "rawint4": {"RAWINT4 (LoRA path)": (0.062874, 0.063235)}}
EXACT_TOLERANCE = 0.0005  # |served - reference| the LoRA path met where the expert weights are exact
# Item 4: the tiny fixtures' merged formats, each beside the LoRA path of the same adapter, on the same machine.
# Each server: (label, the merged format it serves, or None for the LoRA path).
CHECK_VARIANTS = {"bf16": [("lora", None), ("merged-BF16", "BF16"), ("merged-AMXINT8", "AMXINT8"),
                           ("merged-AMXINT4", "AMXINT4"), ("merged-BF16-lora-path", None)],
                  "rawint4": [("lora", None), ("merged-RAWINT4", "RAWINT4"), ("merged-AMXINT4", "AMXINT4"),
                              ("merged-BF16", "BF16")]}
TINY_BASES = {"bf16": BUILD / "inputs" / "dsv3-bf16", "rawint4": BUILD / "inputs" / "kimi-k25-int4"}
# LoRA-path servers of a merged checkpoint instead of the base: label -> the merged server whose merge it serves, with
# the adapter's every B set to zero. kt-kernel's SFT forward runs the same BF16 expert GEMMs and roundings as its
# inference kernel and then adds exactly zero (so does the attention's LoRA on the GPU): the same loss as that
# merged server says the two servers compute alike, so the difference from the LoRA path is the merged weights'
# (the update rounded into BF16 weights, then computed in BF16); another loss points at what else the servers do.
THROUGH_LORA_PATH = {"merged-BF16-lora-path": "merged-BF16"}


class MergedWork(kimi_slice.SliceWork):
    """kimi_slice's work at one depth, with this harness's own folders: build/gpu-host/merged/{moeN,store,results}."""

    def __init__(self, args: argparse.Namespace) -> None:
        depth = args.moe_layers or read_depth()
        super().__init__(argparse.Namespace(moe_layers=depth or 1, python=args.python,
                                            ktflow_python=args.ktflow_python, set=args.set, gpus=1, threads=None,
                                            serve_python=args.serve_python))
        self.depth_known = depth is not None
        self.root = ROOT / f"moe{self.moe_layers}"
        self.model, self.results = self.root / "model", RESULTS
        self.sft_store = ROOT / "store"
        self.converted = self.root / "converted"
        self.tokens = self.root / "tokens.json"
        self.args = args

    def save(self, name: str, doc: dict[str, Any]) -> None:
        super().save(name, {"moe_layers": self.moe_layers, **doc})

    def adapter(self) -> Path:
        """The converted adapter served: convert-lora's of the SFT run, else the random one."""
        if (self.converted / "adapter_model.safetensors").is_file():
            return self.converted
        return self.root / "converted-random"

    @property
    def endpoints(self) -> Path:
        """The served checkpoints' record directories (their model views): VIEW_ROOT's, else beside the slice."""
        where = view_root()
        return where / f"moe{self.moe_layers}" if where else self.root / "endpoints"

    def endpoint(self, key: str) -> Path:
        """One record directory per served checkpoint: its model view is made once and reused by every server."""
        return self.endpoints / key


def view_root() -> Path | None:
    """VIEW_ROOT as set, else as the fixture step recorded it in depth.json (every later step keeps its views there)."""
    if os.environ.get(VIEW_ROOT_ENV):
        return Path(os.environ[VIEW_ROOT_ENV])
    path = ROOT / "depth.json"
    recorded = json.loads(path.read_text()).get("view_root") if path.is_file() else None
    return Path(recorded) if recorded else None


def read_depth() -> int | None:
    path = ROOT / "depth.json"
    return json.loads(path.read_text())["moe_layers"] if path.is_file() else None


def slice_gb(depth: int) -> float:
    return FIXED_GB + LAYER_GB * depth


def disk_need_gb(depth: int, views_elsewhere: bool) -> float:
    """What the merged server's start holds on the slice's disk: the base, its RAWINT4 merge and, unless the views
    live elsewhere, that merge's view (with the views elsewhere, their filesystem needs the same for the views of
    the base and the merge)."""
    return (2 if views_elsewhere else 3) * slice_gb(depth) + MARGIN_GB


def choose_depth(free_gb: float, view_free_gb: float | None = None) -> int | None:
    """The deepest slice whose merged server's start fits the disk (``free_gb``) and, with the views elsewhere
    (``view_free_gb`` free there), their filesystem too."""
    elsewhere = view_free_gb is not None
    return next((d for d in DEPTHS if disk_need_gb(d, elsewhere) <= free_gb
                 and (not elsewhere or disk_need_gb(d, elsewhere) <= view_free_gb)), None)


def views_elsewhere() -> bool:
    """Whether the model views live on another filesystem than the slice (VIEW_ROOT on a tmpfs, say)."""
    where = view_root()
    return where is not None and _device(where) != _device(ROOT)


def _device(path: Path) -> int | None:
    """The filesystem holding ``path`` (its nearest existing folder's), or None where none can be read."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return probe.stat().st_dev
    except OSError:
        return None


# --------------------------------------------------------------------------- disk


def make_room(work: MergedWork, need_bytes: int, keep: set[Path], on: Path | None = None) -> dict[str, Any]:
    """Free ``need_bytes`` (plus the margin) on ``on``'s filesystem (default: the slice's) by removing, in this
    order, the model views of other endpoints and the store's other merges (both remade on demand), those of them
    on that filesystem; never the base, the adapter or anything in ``keep``."""
    removed: list[str] = []
    keep = {p.resolve() for p in keep}
    on = on or work.root

    def short() -> float:
        return need_bytes / 1e9 + MARGIN_GB - free_disk_gb(on)

    device = _device(on)
    candidates = [p for p in sorted(work.endpoints.glob("*/model-view-*")) + sorted((work.sft_store / "merged").glob("*"))
                  if _device(p) == device]  # a path gone since the glob reads as another device: skipped
    for path in candidates:
        if short() <= 0:
            break
        if path.resolve() in keep or any(k in path.resolve().parents for k in keep) or not path.is_dir():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return {"need_gb": round(need_bytes / 1e9, 1), "free_gb": free_disk_gb(on), "removed": removed,
            "fits": short() <= 0}


def _view_bytes(model: Path, record_dir: Path) -> int:
    """What starting a server of ``model`` from ``record_dir`` writes: its language-model view, unless made."""
    if any(record_dir.glob("model-view-*")):
        return 0
    from ktflow.stages.serve.sglang.inputs import model_view_plan

    plan = model_view_plan(model) if (model / "config.json").is_file() else None
    return sum(p.stat().st_size for p in model.glob("*.safetensors")) if plan and plan.kind == "language-model" else 0


# --------------------------------------------------------------------------- phases: fixture, adapter, merge


def phase_fixture(work: MergedWork) -> int:
    """The slice at the depth the disk allows (kept in depth.json for the later phases), and the records."""
    if not work.depth_known:
        free = free_disk_gb(ROOT)
        view_free = free_disk_gb(view_root()) if views_elsewhere() else None
        depth = choose_depth(free, view_free)
        if depth is None:
            print(f"fixture: {free} GB free (views: {view_free if view_free is not None else 'on this disk'}); "
                  f"even depth 1 needs {disk_need_gb(1, view_free is not None):.0f} GB")
            return 1
        work = MergedWork(argparse.Namespace(**{**vars(work.args), "moe_layers": depth}))
    ROOT.mkdir(parents=True, exist_ok=True)
    where = view_root()
    (ROOT / "depth.json").write_text(json.dumps({"moe_layers": work.moe_layers, "chosen_with_free_gb":
                                                 free_disk_gb(ROOT), "view_root": str(where) if where else None}))
    return kimi_slice.phase_fixture(work)


def phase_adapter(work: MergedWork) -> int:
    """The converted adapter: ``ktflow sft`` of the slice recipe (big.phase_sft: ktflow plan's prediction, then
    measured) and ``ktflow convert-lora`` (big.phase_convert), then the training records' tokens as training saw
    them (loss_check.py tokens; the first 16 are the served-loss records). ``--random``: a converted adapter of
    random non-zero LoRA instead, named so (no training; the served loss then compares servers, not training)."""
    work.results.mkdir(parents=True, exist_ok=True)
    if work.args.random:
        started = time.perf_counter()
        out = random_converted_adapter(work.model, work.root / "converted-random")
        work.save("adapter", {"adapter": "random", "path": str(out), "seconds": round(time.perf_counter() - started, 1),
                              "converted": big.converted_facts(out)})
        return 0
    if big.phase_sft(work) != 0:
        return 1
    if not (work.converted / "adapter_model.safetensors").is_file() and big.phase_convert(work) != 0:
        return 1
    run = work.published(work.sft_store).parent
    done = subprocess.run([str(work.python), str(REPO / "gpu_host" / "loss_check.py"), "tokens", str(run),
                           str(work.tokens)], env=work.env(), cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-3000:])
        return 1
    rows = json.loads(work.tokens.read_text())
    work.save("adapter", {"adapter": "trained", "path": str(work.converted), "run": str(run),
                          "converted": big.converted_facts(work.converted), "token_records": len(rows)})
    return 0


def random_converted_adapter(model: Path, out: Path, *, seed: int = 0, rank: int = 8, alpha: int = 16,
                             std: float = 0.02) -> Path:
    """A converted (SGLang-format) adapter of ``model`` with random non-zero LoRA, as kt-kernel's converter lays it
    out: the attention projections (PEFT keys, float32, under ``language_model.`` where the base nests its text
    model) and every routed expert of every MoE layer (``model.layers.L.mlp.experts.E.{gate,up,down}_proj``,
    BF16). Made from the headers and config alone."""
    import torch
    from safetensors.torch import save_file

    from ktflow.formats.checkpoint import read_weight_map, text_config
    from ktflow.formats.safetensors_io import read_header

    if (out / "adapter_model.safetensors").is_file():
        return out
    text = text_config(json.loads((model / "config.json").read_text()))
    weight_map, _ = read_weight_map(model)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}

    def pair(module: str, rows: int, cols: int, dtype: torch.dtype) -> None:
        tensors[f"{module}.lora_A.weight"] = (torch.randn(rank, cols, generator=gen) * std).to(dtype)
        tensors[f"{module}.lora_B.weight"] = (torch.randn(rows, rank, generator=gen) * std).to(dtype)

    attention = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    for name in sorted(weight_map):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in attention and ".self_attn." in module:
            rows, cols = read_header(model / weight_map[name]).tensors[name].shape
            pair(module, rows, cols, torch.float32)
    e, h, i = text["n_routed_experts"], text["hidden_size"], text["moe_intermediate_size"]
    for layer in range(text["first_k_dense_replace"], text["num_hidden_layers"]):
        for expert in range(e):
            for proj, (rows, cols) in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
                pair(f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj", rows, cols, torch.bfloat16)
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file(tensors, str(staging / "adapter_model.safetensors"), metadata={"format": "pt"})
    (staging / "adapter_config.json").write_text(json.dumps({
        "base_model_name_or_path": str(model), "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
        "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": [*attention, "gate_proj", "up_proj", "down_proj"], "use_dora": False, "use_rslora": False,
        "rank_pattern": {}, "alpha_pattern": {}, "ktflow_note": f"random LoRA (seed {seed}, std {std}), not trained"},
        indent=2))
    os.rename(staging, out)
    return out


def merge_dir(work: MergedWork, method: str, sets: list[str] | None = None) -> Path:
    """Where the serve stage looks for (and the merge phase writes) the merge of the adapter as ``method``."""
    from ktflow.recipe import load_recipe
    from ktflow.stages.merge import merge_target

    recipe = load_recipe(work.serve_recipe, slice_sets(work, [*MERGED_SETS, f"serving.kt_method={method}", *(sets or [])]))
    return merge_target(recipe.store.layout, work.model, work.adapter(), method,
                        recipe.serving.kt_threadpool_count).absolute()


def timed_merge(work: MergedWork, method: str, sets: list[str] | None = None, limit_s: float = big.PHASE_LIMIT_S,
                ) -> dict[str, Any]:
    """``ktflow merge`` of the adapter as ``method`` into the store (where the serve stage finds it), timed from
    outside (wall, peak RSS), after making room for it; a merge already there is reused."""
    from ktflow.planning.merge_cost import merge_estimate
    from ktflow.planning.sizing import model_size
    from ktflow.store import read_manifest, tree_bytes

    out = merge_dir(work, method, sets)
    t = next((int(s.split("=", 1)[1]) for s in sets or [] if s.startswith("serving.kt_threadpool_count=")), 1)
    cores = os.cpu_count() or 1
    doc: dict[str, Any] = {"method": method, "out": str(out)}
    if read_manifest(out) is not None:
        doc["made"] = "reused (already in the store)"
        return doc
    estimate = merge_estimate(model_size(work.model), method, cores, t)
    doc["estimate"] = {"seconds": round(estimate.seconds, 3), "disk_gb": round(estimate.disk_bytes / 1e9, 3),
                       "basis": estimate.basis}
    doc["room"] = make_room(work, estimate.disk_bytes, keep={work.model, work.adapter()})
    if not doc["room"]["fits"]:
        doc["made"] = "skipped: not enough disk"
        return doc
    argv = work.ktflow("merge", str(work.model), str(work.adapter()), str(out), "--method", method,
                       "--threadpool-count", str(t), "--serve-python", str(work.serve_python))
    if method in ("AMXINT8", "AMXINT4"):
        argv += ["--workers", str(os.cpu_count() or 1)]
    ran = run_watched(argv, env=work.env(), log=work.results / f"merge-{method}.log", limit_s=limit_s)
    doc["made"] = {k: ran[k] for k in ("rc", "outcome", "wall_s", "peak_host_rss_gib", "error_line")}
    doc["bytes_on_disk"] = tree_bytes(out)
    doc["free_disk_gb_after"] = free_disk_gb(work.root)
    if ran["rc"] != 0:
        doc["made"]["log_tail"] = ran["log_tail"]
    return doc


def phase_merge(work: MergedWork) -> int:
    """The merge the merged server reads (RAWINT4, or ``--method``), timed, before any server needs it."""
    doc = timed_merge(work, work.args.method)
    work.save(f"merge-{work.args.method}", doc)
    made = doc["made"]
    return 0 if isinstance(made, str) and made.startswith("reused") or isinstance(made, dict) and made["rc"] == 0 else 1


# --------------------------------------------------------------------------- one server, measured (serving python)


def kt_method_of(sets: list[str], default: str = "RAWINT4") -> str:
    """The last ``serving.kt_method=`` of ``sets``, else the slice recipe's (RAWINT4)."""
    return next((s.split("=", 1)[1] for s in reversed(sets) if s.startswith("serving.kt_method=")), default)


def slice_sets(work: MergedWork, extra: list[str]) -> list[str]:
    """The serving recipe's overrides: the sft run's (same run key), the serving toolchain, then ``extra``."""
    return [*work.sets(work.sft_store), f"toolchains.serve.python={work.serve_python}", *extra]


def serve_and_measure(spec: dict[str, Any]) -> dict[str, Any]:
    """In the serving toolchain: the read bandwidth, then one server through ktflow's serve stage (``spec``: recipe,
    sets, model_dir, adapter_dir or None, kt_weight_dir, mode, record_dir), the served loss over ``tokens`` (if
    given), benchmarks/serve_load.py with ``load_args`` (if given, against the floor of that bandwidth), then
    stop it and look for anything left. Returns (and writes to ``out``) what was seen."""
    import serve_check  # gpu_host/serve_check.py: the served loss, the load benchmark, leftovers, GPU memory

    from ktflow.stages.merge import served_paths
    from ktflow.stages.serve import serve, stop
    from ktflow.stages.serve.sglang.inputs import sglang_model_view

    out = Path(spec["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    recipe, key = serve_check._load_recipe_with_key(Path(spec["recipe"]), spec["sets"])
    serving = recipe.serving
    doc: dict[str, Any] = {"label": spec["label"], "sets": spec["sets"], "mode": spec["mode"],
                           "adapter": spec["adapter_dir"], "kt_method": serving.kt_method,
                           "serving": serving.model_dump(mode="json", exclude={"extra_args"}),
                           "gpu_used_mib_before": serve_check._gpu_used_mib()}

    def write() -> None:
        out.write_text(json.dumps(doc, indent=1, default=str) + "\n")

    record_dir = Path(spec["record_dir"])
    if spec.get("load_args"):
        doc["read_bandwidth"] = serve_check._serve_load().bandwidth_record(spec.get("bandwidth_gib", 4.0))
    pids: set[int] = set()
    started = time.perf_counter()
    try:
        adapter = Path(spec["adapter_dir"]) if spec["adapter_dir"] else None
        endpoint = serve(recipe, model_dir=Path(spec["model_dir"]), adapter_dir=adapter, record_dir=record_dir,
                         kt_weight_dir=Path(spec["kt_weight_dir"]), mode=spec["mode"], die_with_parent=True,
                         log=lambda line: print(line, flush=True))
        pids.add(endpoint.pid)
        doc["ready_s"] = round(time.perf_counter() - started, 1)
        doc["gpu_used_mib_ready"] = serve_check._gpu_used_mib()
        doc["endpoint"] = {"url": endpoint.url, "pid": endpoint.pid, "model": endpoint.model,
                           "merged_dir": endpoint.merged_dir}
        try:
            import psutil
            pids |= {c.pid for c in psutil.Process(endpoint.pid).children(recursive=True)}
        except Exception:  # noqa: BLE001
            pass
        served = served_paths(endpoint.merged_dir, serving.kt_method)[0] if endpoint.merged_dir else Path(spec["model_dir"])
        view = sglang_model_view(served, record_dir, create=False)
        doc["served_model_dir"] = str(view)
        doc["argv"] = _server_argv(endpoint.pid)
        write()
        root = endpoint.url.removesuffix("/v1")
        if spec.get("tokens"):
            lora = serving.adapter_name if endpoint.adapter_model_name else None
            doc["served_loss"] = serve_check._served_loss(root, key, lora, Path(spec["tokens"]))
            write()
        if spec.get("load_args"):
            load = SimpleNamespace(load_json=str(out.with_name(out.stem + "-load.json")), load_args=spec["load_args"])
            doc["load"] = serve_check._load_benchmark(load, recipe, endpoint, key, view if view.is_dir() else served,
                                                      doc["read_bandwidth"]["read_gb_s"])
            bench = json.loads(Path(load.load_json).read_text())
            doc["levels"] = [{k: lv.get(k) for k in (
                "concurrency", "requests", "errors", "wall_s", "ttft_s", "prefill_tokens_per_s_median",
                "decode_tokens_per_s_median", "output_tokens_per_s", "peak_gpu_mem_used_mib", "peak_server_rss_bytes",
                "distinct_share_median")}
                for lv in bench.get("levels", [])]
            doc["floor"], doc["decode_vs_floor"] = bench.get("floor"), bench.get("decode_vs_floor")
        doc["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - recorded, then the server is stopped
        doc["ok"] = False
        doc["error"] = f"{type(exc).__name__}: {exc}"[:4000]
    finally:
        t = time.perf_counter()
        doc["stopped"] = stop(record_dir)
        doc["stop_s"] = round(time.perf_counter() - t, 1)
        time.sleep(1)
        # this slice's servers only (every one's --model-path lies under the slice's folder)
        doc["leftover_processes"] = serve_check._leftovers(pids, scope=str(Path(spec["model_dir"]).parent))
        doc["gpu_used_mib_after"] = serve_check._gpu_used_mib()
        doc["server_log_tail"] = serve_check._tail(record_dir / "server.log", 40).splitlines()
        write()
    return doc


def _server_argv(pid: int) -> list[str] | None:
    """The server's launch_server arguments, from its process (the interpreter and the launcher left out)."""
    import psutil

    try:
        cmdline = psutil.Process(pid).cmdline()
    except psutil.Error:
        return None
    return cmdline[cmdline.index("--model-path"):] if "--model-path" in cmdline else cmdline


def machine_boot() -> str:
    """This machine as it runs now (hostname and kernel boot id): two servers with the same one ran on one machine,
    one after the other, so one baseline serves both's comparison."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def marlin_built() -> bool:
    """sglang's Marlin MoE kernel is in the JIT cache the servers use (``run.sh serve-jit`` put it there)."""
    cache = os.environ.get("TVM_FFI_CACHE_DIR")
    return bool(cache) and any(Path(cache).glob(f"**/{GPU_EXPERTS_JIT}"))


def shared_baseline(levers: dict[str, Any], group: str, *, with_loss: bool) -> dict[str, Any] | None:
    """Another step's served baseline measured on this machine since it booted, for ``group`` to compare with
    instead of starting its own (a server start is ~1.5-2.5 min of a step's 9): only where it measured what this
    group compares (the served loss, ``with_loss``)."""
    from ktflow.stages.serve.levers import BASELINE

    here = machine_boot()
    for other in LEVER_GROUPS:
        base = levers.get(other, {}).get(BASELINE)
        if (other != group and base and base.get("boot") == here and _served(lever_measurement(base))
                and (not with_loss or base.get("served_loss"))):
            return {**base, "shared_from": other}
    return None


def run_server(work: MergedWork, spec: dict[str, Any], limit_s: float) -> dict[str, Any]:
    """:func:`serve_and_measure` in the serving toolchain, watched (killed past ``limit_s``; the server dies with it),
    then the endpoint stopped again whatever happened."""
    from ktflow.stages.serve import stop

    argv = [str(work.serve_python), __file__, "_serve", json.dumps(spec)]
    env = {**work.env(), "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "gpu_host"), str(REPO / "benchmarks"),
                                                        os.environ.get("PYTHONPATH", "")])}
    ran = run_watched(argv, env=env, log=Path(spec["out"]).with_suffix(".log"), limit_s=limit_s)
    stop(Path(spec["record_dir"]))
    out = Path(spec["out"])
    doc = json.loads(out.read_text()) if out.is_file() else {"ok": False}
    doc["child"] = {k: ran[k] for k in ("rc", "outcome", "wall_s")}
    doc["boot"] = machine_boot()
    if ran["rc"] != 0 or not doc.get("ok"):
        doc["child"]["log_tail"] = ran["log_tail"]
    return doc


# --------------------------------------------------------------------------- what each server serves


def server_spec(work: MergedWork, what: str, label: str, extra: list[str], *, tokens: Path | None = None,
                load_args: str | None = None) -> dict[str, Any]:
    """``what``: ``lora`` (the LoRA path as the slice's serving recipe has it), ``merged`` (the merge stage's output
    with MERGED_SETS + ``extra``), ``base`` (no adapter, the same settings as merged)."""
    if what == "lora":
        sets, adapter, record = LORA_SETS + extra, work.adapter(), work.endpoint("base")
    elif what == "merged":
        method = kt_method_of(extra)
        sets, adapter, record = MERGED_SETS + extra, work.adapter(), work.endpoint(f"merged-{method}")
    else:
        sets, adapter, record = MERGED_SETS + extra, None, work.endpoint("base")
    return {"label": label, "recipe": str(work.serve_recipe), "sets": slice_sets(work, sets),
            "model_dir": str(work.model), "kt_weight_dir": str(work.model), "adapter_dir": str(adapter) if adapter else None,
            "mode": "merged" if what == "merged" else "lora", "record_dir": str(record),
            "out": str(work.results / "servers" / f"{label}.json"), "tokens": str(tokens) if tokens else None,
            "load_args": load_args, "bandwidth_gib": work.args.bandwidth_gib}


def room_for(work: MergedWork, spec: dict[str, Any]) -> dict[str, Any]:
    """Disk for the view this server's start writes (the merge is made beforehand by timed_merge)."""
    record = Path(spec["record_dir"])
    if spec["mode"] == "merged":
        method = kt_method_of(spec["sets"])
        from ktflow.stages.merge import served_paths

        model = served_paths(merge_dir(work, method, spec["sets"]), method)[0]
    else:
        model = Path(spec["model_dir"])
    keep = {work.model, work.adapter(), record}
    if spec["mode"] == "merged":
        keep.add(model)
    record.mkdir(parents=True, exist_ok=True)
    return make_room(work, _view_bytes(model, record), keep, on=record)


def served_tokens(work: MergedWork) -> Path | None:
    """The first SERVED_LOSS_RECORDS training records' tokens (the adapter phase's), or None (random adapter)."""
    if not work.tokens.is_file():
        return None
    out = work.tokens.with_name(f"tokens-{SERVED_LOSS_RECORDS}.json")
    if not out.is_file():
        out.write_text(json.dumps(json.loads(work.tokens.read_text())[:SERVED_LOSS_RECORDS]))
    return out


# --------------------------------------------------------------------------- item 3: the levers


LEVER_GROUPS = ("engine", "gpu", "threads", "methods", "combo")  # one ``levers --group`` step (device call) each
# The serving fields by which the product's candidates (ktflow/stages/serve/levers.py) fall into the groups, the
# first match winning: another CPU method first (its candidates may also clear the GPU experts).
GROUP_FIELDS = (("methods", ("kt_method",)),
                ("gpu", ("kt_num_gpu_experts", "kt_enable_dynamic_expert_update", "chunked_prefill_size")),
                ("threads", ("kt_cpuinfer", "kt_threadpool_count")),
                ("engine", ("disable_cuda_graph", "kt_max_deferred_experts_per_token")))


def lever_recipe(work: MergedWork) -> Recipe:
    """The recipe the lever candidates are made from and checked against: the slice's serving recipe as every
    merged server of the slice starts (MERGED_SETS), its ``source.size`` the WHOLE Kimi-K2.5's (WHOLE_RECIPE), so
    the product's GPU-expert share is what the whole model would get on this card, not a count that would put the
    whole slice on the GPU."""
    from ktflow.recipe import load_recipe

    recipe = load_recipe(work.serve_recipe, slice_sets(work, MERGED_SETS))
    whole = load_recipe(WHOLE_RECIPE).source.size
    return recipe.model_copy(update={"source": recipe.source.model_copy(update={"size": whole})})


def harness_candidates(recipe: Recipe, host: HostInfo) -> list[LeverCandidate]:
    """The product's candidates for ``host`` in merged mode (``lever_candidates``): the baseline, then each lever
    alone, skipped or refused with the product's reason where it does not apply."""
    from ktflow.stages.serve.levers import lever_candidates

    return lever_candidates(recipe, host, "merged")


def lever_groups(candidates: list[LeverCandidate]) -> dict[str, list[LeverCandidate]]:
    """The candidates in this harness's groups (GROUP_FIELDS), each group its own baseline first (a step may run
    on another machine than the one before, so each has a baseline of its own: measured, or another step's measured on
    this machine since it booted, :func:`shared_baseline`); ``combo`` holds the baseline only (its combination
    is the product's ``combined_candidate`` of what the other groups measured). A lever of fields no group names
    goes to ``engine``."""
    from ktflow.stages.serve.levers import BASELINE

    baseline = next(c for c in candidates if c.name == BASELINE)
    groups: dict[str, list[LeverCandidate]] = {g: [baseline] for g in LEVER_GROUPS}
    for candidate in candidates:
        if candidate.name == BASELINE:
            continue
        fields = set(candidate.updates) - {"mode"}
        group = next((g for g, names in GROUP_FIELDS if fields & set(names)), "engine")
        groups[group].append(candidate)
    return groups


def lever_sets(updates: dict[str, Any]) -> list[str]:
    """A candidate's serving-field updates as this harness's ``serving.X=Y`` overrides (``mode`` is MERGED_SETS's;
    values in YAML, as the recipe loader reads them)."""
    return [f"serving.{field}={value if isinstance(value, str) else json.dumps(value)}"
            for field, value in updates.items() if field != "mode"]


def set_updates(sets: list[str]) -> dict[str, Any]:
    """``serving.X=Y`` overrides back as serving-field updates (a levers.json entry written before its candidate
    was kept with it)."""
    import yaml

    return {"mode": "merged", **{s.split("=", 1)[0].removeprefix("serving."): yaml.safe_load(s.split("=", 1)[1])
                                 for s in sets if s.startswith("serving.")}}


def _decode(doc: dict[str, Any]) -> float | None:
    one = next((lv for lv in doc.get("levels") or [] if lv["concurrency"] == 1), None)
    return one["decode_tokens_per_s_median"] if one and not one["errors"] else None


def lever_measurement(doc: dict[str, Any]) -> LeverMeasurement:
    """One server's record (levers.json) as the product's measurement: decode and TTFT at concurrency 1, the served
    loss where the server measured one."""
    from ktflow.stages.serve.levers import LeverMeasurement

    one = next((lv for lv in doc.get("levels") or [] if lv["concurrency"] == 1), {})
    decode = _decode(doc)
    loss = doc.get("served_loss") or {}
    error = doc.get("error") or (None if decode is not None else
                                 f"no decode at concurrency 1 ({one.get('errors')} errors)" if one else "no load run")
    return LeverMeasurement(ok=bool(doc.get("ok")) and decode is not None, decode_tokens_per_s=decode,
                            ttft_p50_s=(one.get("ttft_s") or {}).get("p50"), served_loss=loss.get("loss"),
                            loss_records=loss.get("records") or 0, requests=one.get("requests") or 0,
                            seconds=(doc.get("child") or {}).get("wall_s") or 0.0, error=error)


def _served(measurement: LeverMeasurement | None) -> bool:
    return measurement is not None and measurement.ok and measurement.decode_tokens_per_s is not None


def measured_runs(levers: dict[str, Any], candidates: list[LeverCandidate],
                  ) -> tuple[list[LeverRun], dict[str, str]]:
    """Everything measured so far (levers.json) as the product's runs, with the group each came from: one baseline
    (the first group's, in LEVER_GROUPS order, that served: the reference) and every candidate of every group, judged
    by the product's ``judge`` against its OWN group's baseline (served loss compared where both measured one). A
    lever's decode is put on the reference baseline's scale (its rate x the reference's / its group's), so the
    product's choice (fastest correct) compares levers measured in different steps as their groups' ratios do; the
    verdict says so. Candidates not measured are recorded as the product records them: skipped, refused, or not
    measured yet."""
    from ktflow.stages.serve.levers import BASELINE, COMBINED, LeverCandidate, LeverRun, judge

    groups = lever_groups(candidates)
    baselines = {g: lever_measurement(levers[g]["baseline"]) for g in LEVER_GROUPS if "baseline" in levers.get(g, {})}
    ref_group = next((g for g in LEVER_GROUPS if _served(baselines.get(g))), None)
    reference = baselines.get(ref_group) if ref_group else None
    base = groups["engine"][0]
    runs = [LeverRun(candidate=base, verdict="not measured yet")]
    where = {BASELINE: "baseline"}
    if reference is not None:
        runs[0] = LeverRun(candidate=base, measurement=reference, correct=True, vs_baseline=1.0,
                           verdict=f"ok: served (the {ref_group} step's baseline; each step has its own)")
    elif baselines:
        first = next(g for g in LEVER_GROUPS if g in baselines)
        runs[0] = LeverRun(candidate=base, measurement=baselines[first], correct=False,
                           verdict=f"did not serve: {baselines[first].error or 'no decode measured'}")
    for group in LEVER_GROUPS:
        measured = {n: d for n, d in levers.get(group, {}).items() if n != BASELINE}
        current = {c.name: c for c in groups[group][1:]}
        for name in dict.fromkeys([*current, *measured]):
            if name in where:
                continue
            where[name] = f"{group}/{name}"
            doc = measured.get(name)
            if doc is None:
                candidate = current[name]
                runs.append(LeverRun(candidate=candidate, verdict=f"{candidate.status}: {candidate.reason}"
                                     if candidate.status != "run" else f"not measured yet (merged-levers-{group})"))
                continue
            if doc.get("candidate"):
                candidate = LeverCandidate.model_validate(doc["candidate"])
            else:  # measured before the harness kept candidates: its overrides, the current words
                why = current[name].why if name in current else "measured by an earlier run of this harness"
                candidate = LeverCandidate(name=name, updates=set_updates(doc.get("lever_sets") or []), why=why)
            run = LeverRun(candidate=candidate, measurement=lever_measurement(doc))
            group_base = baselines.get(group)
            if not _served(group_base) or reference is None:
                run.correct, run.verdict = False, f"not compared: the {group} step's baseline did not serve"
            else:
                run.correct, run.verdict = judge(candidate, run.measurement, group_base)
            rate = run.measurement.decode_tokens_per_s
            if run.correct and rate and group_base is not None and reference is not None:
                base_rate, ref_rate = group_base.decode_tokens_per_s or 0.0, reference.decode_tokens_per_s or 0.0
                run.vs_baseline = round(rate / base_rate, 3)
                if group != ref_group:
                    run.measurement = run.measurement.model_copy(
                        update={"decode_tokens_per_s": round(rate * ref_rate / base_rate, 2)})
                    run.verdict += (f"; measured {rate:.1f} tokens/s against the {group} step's baseline of "
                                    f"{base_rate:.1f}, put on the {ref_group} step's {ref_rate:.1f}")
            runs.append(run)
    if COMBINED not in where:
        where[COMBINED] = f"combo/{COMBINED}"
    return runs, where


def lever_record(levers: dict[str, Any], candidates: list[LeverCandidate], recipe: Recipe, host: HostInfo,
                 model: ServedModel) -> tuple[ServingLevers, dict[str, str]]:
    """The product's record of what the levers phases measured (``ServingLevers``, the document ``ktflow
    tune-serving`` keeps): :func:`measured_runs`, the product's combination (``combined_candidate``: recorded as not
    measured until the combo step measures it) and its choice (``choose_settings``: the fastest correct)."""
    from ktflow.stages.serve.levers import COMBINED, LeverRun, ServingLevers, choose_settings, combined_candidate

    runs, where = measured_runs(levers, candidates)
    if not any(r.candidate.name == COMBINED for r in runs):
        combined = combined_candidate(runs, recipe)
        if combined is not None:
            runs.append(LeverRun(candidate=combined, verdict=f"{combined.status}: {combined.reason}"
                                 if combined.status != "run" else "not measured yet (merged-levers-combo)"))
    return ServingLevers(machine=host.machine, gpu=host.gpus[0].name if host.gpus else None, model=model, runs=runs,
                         choice=choose_settings(runs),
                         measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds")), where


def levers_chosen(record: ServingLevers, where: dict[str, str]) -> dict[str, Any]:
    """levers-chosen.json: the product's choice as this harness's overrides (``name`` GROUP/LEVER, ``sets``,
    ``vs_baseline`` against its own step's baseline, the product's ``reason``); the baseline where nothing
    served."""
    choice = record.choice
    if choice is None:
        return {"name": "baseline", "sets": [], "vs_baseline": 1.0, "reason": "no baseline served: nothing chosen"}
    return {"name": where.get(choice.name, choice.name), "sets": lever_sets(choice.updates),
            "vs_baseline": choice.vs_baseline, "reason": choice.reason}


def phase_levers(work: MergedWork) -> int:
    """Item 3: for the merged model, the product's lever candidates of ``--group`` (ktflow/stages/serve/levers.py
    for this host; combo: the product's combination of what the other groups measured) against that group's own
    baseline (concurrency 1, 3 requests of 256 tokens), into results/levers.json; levers measured before are skipped
    (``--again``: not), so a group cut short by the phase's time goes on when its step runs again, and a group whose
    baseline did not serve runs nothing else. Writes the product's record of everything measured so far
    (serving-levers.json) and its choice as this harness's overrides (levers-chosen.json)."""
    from ktflow.host import hardware
    from ktflow.stages.serve.levers import (
        BASELINE,
        BASELINE_AGAIN,
        COMBINED,
        OWN_SETTINGS,
        baseline_again,
        combined_candidate,
        served_model,
    )
    from ktflow.store import read_manifest

    started = time.perf_counter()
    path = work.results / "levers.json"
    levers: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    recipe = lever_recipe(work)
    host = hardware.probe_host(work.root if work.root.is_dir() else None)
    candidates = harness_candidates(recipe, host)
    group = work.args.group
    runs = lever_groups(candidates)[group]
    gpu = next((c for c in candidates if c.name.startswith("gpu-experts")), None)
    notes: dict[str, Any] = {"gpu_expert_share": gpu and {"lever": gpu.name, "status": gpu.status, "reason": gpu.reason,
                                                          "experts_per_layer": gpu.updates.get("kt_num_gpu_experts"),
                                                          "why": gpu.why},
                             "physical_cores": host.physical_cores, "skipped": []}
    if group == "combo":
        measured = [r for r in measured_runs(levers, candidates)[0] if r.candidate.name != COMBINED]
        combined = combined_candidate(measured, recipe)
        if combined is None:
            notes["skipped"].append({"lever": "combined", "why": "fewer than two levers beat their step's baseline "
                                                                 "by 3 % or more and were correct"})
        else:
            runs = [*runs, combined]
    runs = [*runs, baseline_again(runs[0])]  # as the product: the step's baseline started again, last
    done = levers.setdefault(group, {})
    tokens = served_tokens(work)
    if not (BASELINE in done and done[BASELINE].get("ok")) and not work.args.again:
        shared = shared_baseline(levers, group, with_loss=tokens is not None)
        if shared:
            done[BASELINE] = shared
    budget = START_S.get(work.moe_layers, 100.0) + LEVER_S
    status = 0
    for candidate in runs:
        name, sets = candidate.name, lever_sets(candidate.updates)
        if candidate.status != "run":
            notes["skipped"].append({"lever": name, "why": f"{candidate.status}: {candidate.reason}"})
            continue
        if work.args.levers and name != BASELINE and name not in work.args.levers.split(","):
            notes["skipped"].append({"lever": name, "why": "not asked for this time (--levers)"})
            continue
        if name in done and done[name].get("ok") and not work.args.again:
            continue
        if name == BASELINE_AGAIN and not any(n not in OWN_SETTINGS for n in done):
            notes["skipped"].append({"lever": name, "why": "no other setting of this step was measured"})
            continue
        if name != BASELINE and not _served(lever_measurement(done["baseline"]) if "baseline" in done else None):
            notes["skipped"].append({"lever": name, "why": "this step's baseline was not measured or did not serve: "
                                                          "nothing to compare with"})
            continue
        method = kt_method_of(sets)
        left = big.PHASE_LIMIT_S - (time.perf_counter() - started)
        merged = merge_dir(work, method, sets)
        gpu_experts = bool(candidate.updates.get("kt_num_gpu_experts"))
        if gpu_experts and not marlin_built():
            notes["skipped"].append({"lever": name, "why": "sglang's Marlin MoE kernel is not built on this machine "
                                                          "(minutes of nvcc at the first start): run `run.sh serve-jit` "
                                                          "first"})
            continue
        extra = GPU_EXPERTS_START_EXTRA_S if gpu_experts else 0.0
        need = budget + extra + (0 if read_manifest(merged) else MERGE_S)
        if left < need:
            notes["skipped"].append({"lever": name, "why": f"{left:.0f} s left of the phase, ~{need:.0f} s needed: "
                                                          "run the step again"})
            continue
        merge = timed_merge(work, method, sets, limit_s=left - budget)
        spec = server_spec(work, "merged", f"lever-{group}-{name}", sets, load_args=LEVER_ARGS,
                           tokens=tokens)
        room = room_for(work, spec)
        kept = {"lever_sets": sets, "candidate": candidate.model_dump(mode="json"), "merge": merge, "room": room}
        if not room["fits"]:
            done[name] = {"ok": False, "error": "not enough disk", **kept}
            status = 1
            continue
        doc = run_server(work, spec, limit_s=big.PHASE_LIMIT_S - (time.perf_counter() - started))
        doc.update(kept)
        done[name] = doc
        status |= 0 if doc.get("ok") and not doc.get("leftover_processes") else 1
        path.write_text(json.dumps(levers, indent=1, default=str))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(levers, indent=1, default=str))
    record, where = lever_record(levers, candidates, recipe, host, served_model(recipe, work.model, "merged"))
    (work.results / "serving-levers.json").write_text(json.dumps(record.model_dump(mode="json"), indent=1))
    chosen = levers_chosen(record, where)
    (work.results / "levers-chosen.json").write_text(json.dumps(chosen, indent=1))
    base = _decode(done.get("baseline", {}))
    judged = {r.candidate.name: r for r in record.runs}

    def verdict(name: str, doc: dict[str, Any]) -> dict[str, Any]:
        if name == BASELINE:
            own = lever_measurement(doc)
            return {"correct": _served(own), "verdict": "this step's baseline: " + (
                "served" if _served(own) else f"did not serve: {own.error}")}
        run = judged.get(name) if where.get(name) == f"{group}/{name}" else None
        return {"correct": run.correct, "verdict": run.verdict} if run else {"correct": None, "verdict": None}

    work.save(f"levers-{group}", {**notes, "chosen_so_far": chosen, "runs": {
        n: {"decode_c1": _decode(d), "vs_baseline": round(_decode(d) / base, 3) if base and _decode(d) else None,
            "ttft_p50_s": (next(iter(d.get("levels") or []), {}).get("ttft_s") or {}).get("p50"),
            "ready_s": d.get("ready_s"), "ok": d.get("ok"), "error": d.get("error"), **verdict(n, d)}
        for n, d in done.items()}})
    return status


# --------------------------------------------------------------------------- item 5: side by side


LOAD_SERVERS = ("lora", "merged", "base")


def only_servers(only: str | None, known: list[str], step: str, of: str) -> list[str]:
    """``--only``'s comma-separated server names, in its order (None: ``known``); a name not in ``known`` (the
    servers of ``of``) stops the ``step`` phase before any server starts, naming those it knows."""
    if not only:
        return list(known)
    wanted = only.split(",")
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        raise SystemExit(f"{step} --only: {unknown} are not servers of {of}; use some of {known}")
    return wanted


def load_servers(only: str | None) -> list[str]:
    """The servers a load step runs, in this order: all of LOAD_SERVERS, or those ``only`` names."""
    return only_servers(only, list(LOAD_SERVERS), "load", "the load step")


def chosen_settings(work: MergedWork) -> dict[str, Any]:
    """The levers steps' choice as this harness's overrides (levers-chosen.json), else the slice's defaults."""
    path = work.results / "levers-chosen.json"
    return json.loads(path.read_text()) if path.is_file() else {"name": "default", "sets": []}


def phase_load(work: MergedWork) -> int:
    """Item 5: the LoRA path as today, the merged model with the chosen settings (levers-chosen.json, else
    MERGED_SETS), the base model with the same settings: each served, its served loss over the first training
    records, then serve_load at concurrency 1, 4 and 16 (128 tokens, ignore_eos) against the floor of the bandwidth
    measured just before it. ``--only`` runs one of them (a step cut short goes on with those not measured)."""
    started = time.perf_counter()
    chosen = chosen_settings(work)
    path = work.results / "load.json"
    doc: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    doc["chosen"] = chosen
    tokens = served_tokens(work)
    status = 0
    doc.pop("skipped", None)  # what this run leaves says itself below
    for what in load_servers(work.args.only):
        if doc.get(what, {}).get("ok") and not work.args.again:
            continue
        extra = [] if what == "lora" else list(chosen["sets"])
        method = kt_method_of(extra)
        left = big.PHASE_LIMIT_S - (time.perf_counter() - started)
        need = START_S.get(work.moe_layers, 100.0) + LOAD_S
        if left < need:
            doc.setdefault("skipped", []).append({"what": what, "why": f"{left:.0f} s left, ~{need:.0f} s needed"})
            continue
        merge = timed_merge(work, method, extra, limit_s=left - need) if what == "merged" else None
        spec = server_spec(work, what, f"load-{what}", extra, tokens=tokens, load_args=LOAD_ARGS)
        room = room_for(work, spec)
        if not room["fits"]:
            doc[what] = {"ok": False, "error": "not enough disk", "room": room}
            status = 1
            continue
        got = run_server(work, spec, limit_s=big.PHASE_LIMIT_S - (time.perf_counter() - started))
        got.update(merge=merge, room=room)
        doc[what] = got
        status |= 0 if got.get("ok") and not got.get("leftover_processes") else 1
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, default=str))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str))
    work.save("load-summary", load_table(doc))
    return status


ALTERNATE_MODELS = ("merged", "base")
MERGED_OVER_BASE_TARGET = 0.9  # item 5: merged within 10 % of the base model's decode at concurrency 1


def alternate_order(first: str, starts: int) -> list[str]:
    """The models an ``alternate`` step starts, in turn from ``first``: base, merged, base, merged for 4 from base."""
    if first not in ALTERNATE_MODELS:
        raise SystemExit(f"alternate --first: {first!r} is not one of {list(ALTERNATE_MODELS)}")
    if starts < 2 or starts % 2:
        raise SystemExit(f"alternate --starts: {starts} is not an even number of 2 or more (each model as often)")
    other = next(m for m in ALTERNATE_MODELS if m != first)
    return [first if i % 2 == 0 else other for i in range(starts)]


def alternate_summary(starts: list[dict[str, Any]]) -> dict[str, Any]:
    """The merged-vs-base gap against the spread between starts of one model: each model's decode at concurrency 1
    over its starts (median and range), merged / base of the medians, and each model's own spread (its fastest start
    over its slowest). A gap no wider than the models' own spread is the machine's, not merging's."""
    rates: dict[str, list[float]] = {m: [] for m in ALTERNATE_MODELS}
    for start in starts:
        if start and start.get("ok") and start.get("decode_tokens_per_s"):  # a start not measured (None) or failed
            rates[start["what"]].append(start["decode_tokens_per_s"])
    models = {m: {"starts": len(r), "median": statistics.median(r) if r else None,
                  "range": [min(r), max(r)] if r else None,
                  "own_spread": max(r) / min(r) if len(r) > 1 else None} for m, r in rates.items()}
    merged, base = models["merged"]["median"], models["base"]["median"]
    ratio = merged / base if merged and base else None
    spreads = [m["own_spread"] for m in models.values() if m["own_spread"]]
    return {"models": models, "merged_over_base": ratio,
            "within_10_percent": None if ratio is None else ratio >= MERGED_OVER_BASE_TARGET,
            "gap_wider_than_own_spread": None if ratio is None or len(spreads) < 2
            else max(ratio, 1 / ratio) > max(spreads)}


def phase_alternate(work: MergedWork) -> int:
    """Item 5's merged-vs-base gap against the spread between two starts of one server: the merged model and the
    base model, both with the chosen settings (levers-chosen.json), started in turn (``--starts``, ``--first``) and
    each measured as a lever is (concurrency 1, 3 requests of 256 tokens) into results/alternate.json, with
    :func:`alternate_summary`. ``starts`` holds a slot a start, in order (null: not measured yet); a run of the step
    measures, in order, the slots not measured or failed and keeps the others (a step cut short goes on; each start
    records when it began); ``--again``: all of them."""
    from ktflow.store import read_manifest

    started = time.perf_counter()
    chosen = chosen_settings(work)
    path = work.results / "alternate.json"
    doc: dict[str, Any] = json.loads(path.read_text()) if path.is_file() and not work.args.again else {}
    order = alternate_order(work.args.first, work.args.starts)
    if doc.get("order") != order or doc.get("chosen") != chosen:
        doc = {"order": order, "chosen": chosen, "starts": [None] * len(order)}
    doc.pop("skipped", None)  # what this run leaves says itself below
    tokens = served_tokens(work)
    extra = list(chosen["sets"])
    method = kt_method_of(extra)
    status = 0
    for index, what in enumerate(order):
        if (doc["starts"][index] or {}).get("ok"):
            continue
        left = big.PHASE_LIMIT_S - (time.perf_counter() - started)
        need = (START_S.get(work.moe_layers, 100.0) + LEVER_S
                + (MERGE_S if what == "merged" and not read_manifest(merge_dir(work, method, extra)) else 0.0))
        if left < need:  # the rest waits for the next run, so the starts keep their turns
            doc["skipped"] = (f"starts {index + 1}-{len(order)}: {left:.0f} s left, ~{need:.0f} s needed: run the "
                              "step again")
            break
        stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
        merge = timed_merge(work, method, extra, limit_s=left - need) if what == "merged" else None
        spec = server_spec(work, what, f"alternate-{index + 1}-{what}", extra, tokens=tokens, load_args=LEVER_ARGS)
        room = room_for(work, spec)
        if not room["fits"]:
            doc["starts"][index] = {"what": what, "ok": False, "error": "not enough disk", "room": room}
            status = 1
            break
        got = run_server(work, spec, limit_s=big.PHASE_LIMIT_S - (time.perf_counter() - started))
        one = next((lv for lv in got.get("levels") or [] if lv["concurrency"] == 1), {})
        doc["starts"][index] = {"what": what, "started": stamp, "ok": bool(got.get("ok")),
                                "decode_tokens_per_s": _decode(got),
                                "ttft_p50_s": (one.get("ttft_s") or {}).get("p50"),
                                "distinct_share": one.get("distinct_share_median"), "ready_s": got.get("ready_s"),
                                "server": spec["out"], "merge": merge, "error": got.get("error")}
        status |= 0 if got.get("ok") and not got.get("leftover_processes") else 1
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, default=str))
    doc["summary"] = alternate_summary(doc["starts"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str))
    print(f"alternate: {json.dumps(doc['summary'])}")
    return status


def load_table(doc: dict[str, Any]) -> dict[str, Any]:
    """The side by side's figures: per server and level, decode tokens/s and TTFT, the floor, and the targets' ratios."""
    rows: dict[str, Any] = {}
    for what in ("lora", "merged", "base"):
        got = doc.get(what) or {}
        rows[what] = {"ok": got.get("ok"), "ready_s": got.get("ready_s"),
                      "served_loss": (got.get("served_loss") or {}).get("loss"),
                      "floor_tokens_per_s": (got.get("floor") or {}).get("floor_tokens_per_s"),
                      "read_gb_s": (got.get("read_bandwidth") or {}).get("read_gb_s"),
                      "levels": {lv["concurrency"]: {"decode_tokens_per_s": lv["decode_tokens_per_s_median"],
                                                     "ttft_p50_s": lv["ttft_s"]["p50"],
                                                     "output_tokens_per_s": lv["output_tokens_per_s"],
                                                     # repetition in what it generated (serve_load's rows)
                                                     "distinct_share": lv.get("distinct_share_median"),
                                                     "errors": lv["errors"]} for lv in got.get("levels") or []},
                      "error": got.get("error")}
    ratio: dict[str, Any] = {}
    for c in (1, 4, 16):
        rate = {w: (rows[w]["levels"].get(c) or {}).get("decode_tokens_per_s") for w in rows}
        ratio[c] = {"merged_over_base": rate["merged"] / rate["base"] if rate["merged"] and rate["base"] else None,
                    "merged_over_lora": rate["merged"] / rate["lora"] if rate["merged"] and rate["lora"] else None}
    targets = {"merged within 10 % of base (c=1)": None if ratio[1]["merged_over_base"] is None
               else ratio[1]["merged_over_base"] >= MERGED_OVER_BASE_TARGET,
               "merged at least 2x the LoRA path (c=1)": None if ratio[1]["merged_over_lora"] is None
               else ratio[1]["merged_over_lora"] >= 2.0}
    return {"chosen": doc.get("chosen"), "servers": rows, "ratios": ratio, "targets": targets,
            "skipped": doc.get("skipped")}


# --------------------------------------------------------------------------- item 4: served = trained, merged


def check_sets(name: str, method: str | None, store: Path, serve_python: Path, extra: list[str]) -> list[str]:
    sets = [f"store.root={store}", f"toolchains.serve.python={serve_python}", *extra]
    if method is None:
        return sets + ["serving.mode=lora"]
    return sets + ["serving.mode=merged", f"serving.kt_method={method}", "serving.disable_cuda_graph=false"]


def check_variants(name: str, only: str | None) -> list[tuple[str, str | None]]:
    """The fixture's servers a check step runs: all of CHECK_VARIANTS[name], or those ``only`` names (comma-separated
    labels, e.g. ``merged-BF16,merged-AMXINT8`` to skip a LoRA path measured before)."""
    variants = CHECK_VARIANTS[name]
    wanted = only_servers(only, [label for label, _ in variants], "check", f"the {name} check")
    return [(label, method) for label, method in variants if label in wanted]


def phase_check(work: MergedWork) -> int:
    """Item 4 on the tiny fixtures the LoRA path's served = trained was measured on (run.sh NAME convert-NAME
    losscheck-NAME before, on this machine): the LoRA path and each merged format of the same converted adapter,
    each on a server of its own, the served loss over every training record through /generate's prompt logprobs
    against loss_check.py's reference (transformers + PEFT, fp32). BF16 must be within the LoRA path's 0.0005;
    the quantized formats are measured. (At the slice's geometry the fp32 reference does not fit: 2 MoE layers are
    135 GB in fp32.)"""
    started = time.perf_counter()
    name = work.args.name
    results = BUILD / "results"
    tokens, reference = results / f"tokens-{name}.json", results / f"loss-{name}-full.json"
    adapter = BUILD / "store" / "converted" / name
    missing = [str(p) for p in (tokens, reference, adapter, TINY_BASES[name]) if not p.exists()]
    if missing:
        print(f"check: missing {missing}: run `run.sh {name} convert-{name} losscheck-{name}` first")
        return 1
    ref = json.loads(reference.read_text())["loss"]
    recipe = REPO / "gpu_host" / f"tiny-sglang-{name}.yaml"
    store = ROOT / "tiny-store"
    path = work.results / f"check-{name}.json"
    doc: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    doc.update(reference=ref, reference_file=str(reference), published_lora_path=LORA_PATH_PUBLISHED[name])
    doc.pop("skipped", None)  # what this run leaves says itself below
    status = 0
    variants = check_variants(name, work.args.only)
    for label, method in variants:
        through = THROUGH_LORA_PATH.get(label)  # the merged server whose checkpoint this one serves, if any
        source = _merged_source(doc, through) if through else None
        if (doc.get(label, {}).get("ok") and not work.args.again
                and (not through or doc[label].get("merged_dir") == source)):
            continue
        left = big.PHASE_LIMIT_S - (time.perf_counter() - started)
        if left < CHECK_SERVER_S:
            doc.setdefault("skipped", []).append(label)
            continue
        spec = {"label": f"check-{name}-{label}", "recipe": str(recipe),
                "sets": check_sets(name, method, store, work.serve_python, work.extra_sets),
                "model_dir": str(TINY_BASES[name]), "kt_weight_dir": str(TINY_BASES[name]), "adapter_dir": str(adapter),
                "mode": "lora" if method is None else "merged", "record_dir": str(ROOT / "tiny-endpoint" / name),
                "out": str(work.results / "servers" / f"check-{name}-{label}.json"), "tokens": str(tokens),
                "load_args": None}
        if through:
            if source is None:
                doc[label] = {"ok": False, "error": f"{through}'s merged checkpoint is not on this machine: "
                                                    f"run ONLY={through},{label} first"}
                status = 1
                continue
            spec.update(model_dir=source, kt_weight_dir=source,
                        adapter_dir=str(zero_b_adapter(adapter, ROOT / "tiny-zero-b" / name)),
                        record_dir=str(ROOT / "tiny-endpoint" / f"{name}-{label}"))
        got = run_server(work, spec, limit_s=left)
        if through:
            got["merged_dir"] = source
        served = (got.get("served_loss") or {}).get("loss")
        got["difference"] = served - ref if served is not None else None
        got["within_exact_tolerance"] = abs(served - ref) <= EXACT_TOLERANCE if served is not None else None
        doc[label] = got
        status |= 0 if got.get("ok") and not got.get("leftover_processes") else 1
        path.write_text(json.dumps(doc, indent=1, default=str))  # the server's measurement kept before the score
        if method in ("BF16", "RAWINT4") and served is not None:  # formats loss_check.py reads (kt-kernel's: no)
            left = big.PHASE_LIMIT_S - (time.perf_counter() - started)
            got["merged_weights_fp32"] = merged_weights_loss(work, got, method, adapter, tokens, ref,
                                                             timeout_s=max(left, 10.0))
            path.write_text(json.dumps(doc, indent=1, default=str))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str))
    table = check_table(name, doc)
    work.save(f"check-{name}-summary", table)
    return status | (0 if table["bf16_within_tolerance"] is not False else 1)


def _served_merge(got: dict[str, Any]) -> str | None:
    """The merged checkpoint a server's record says it served (None: the base, or no record)."""
    return (got.get("endpoint") or {}).get("merged_dir")


def _merged_source(doc: dict[str, Any], server: str) -> str | None:
    """The merged checkpoint ``server`` served in this check, if it served and the folder is still here."""
    got = doc.get(server) or {}
    merged = _served_merge(got)
    return merged if got.get("ok") and merged and Path(merged).is_dir() else None


def zero_b_adapter(adapter: Path, out: Path) -> Path:
    """``adapter`` (a converted adapter) with every LoRA B set to zero, remade at ``out`` from it every time (a few MB
    here): served on any base of its geometry, the LoRA path then adds exactly nothing. The adapter's manifest is
    left out, since it describes the adapter as trained."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ktflow.store import MANIFEST_NAME

    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(adapter, staging, ignore=shutil.ignore_patterns(MANIFEST_NAME))
    for path in staging.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:  # one read: the tensors and the file's metadata
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        save_file({k: torch.zeros_like(v) if k.endswith(".lora_B.weight") else v for k, v in tensors.items()},
                  str(path), metadata=metadata)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(staging, out)
    return out


def merged_weights_loss(work: MergedWork, got: dict[str, Any], method: str, adapter: Path, tokens: Path,
                        reference: float, *, timeout_s: float = 300.0) -> dict[str, Any]:
    """A merged checkpoint scored by loss_check.py in float32 (as the reference, with no adapter on top), so a merged
    server's difference from the reference splits in two: the merge's rounding to its format (this score less the
    reference) and the server's computation (the served loss less this score). BF16 is scored as written; RAWINT4
    as the BF16 its INT4 decodes to exactly (ktflow dequantize, the reference's own decoding of the base). Within
    ``timeout_s`` (the step's time left), else an error entry."""
    merged = _served_merge(got)
    if not merged:
        return {"error": "the server's record names no merged folder"}
    deadline = time.monotonic() + timeout_s

    def run(argv: list[str], what: str) -> str | None:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, env=work.env(), cwd=REPO,
                                  timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            return f"{what} did not finish in the step's time left ({timeout_s:.0f} s)"
        return None if done.returncode == 0 else f"{what} exited {done.returncode}: {done.stderr.strip()[-300:]}"

    with tempfile.TemporaryDirectory() as tmp:
        scored = merged
        if method == "RAWINT4":
            scored = str(Path(tmp) / "bf16")
            error = run(work.ktflow("dequantize", merged, scored, "--no-fsync"), "ktflow dequantize")
            if error:
                return {"error": error}
        out = Path(tmp) / "loss.json"
        error = run([REFERENCE_PYTHON, str(REPO / "gpu_host" / "loss_check.py"), "loss", scored, str(adapter),
                     str(tokens), "--variant", "base", "--json", str(out)], "loss_check.py")
        if error or not out.is_file():
            return {"error": error or "loss_check.py wrote no result"}
        loss = json.loads(out.read_text())["loss"]
    served = got["served_loss"]["loss"]
    return {"loss": loss, "rounding": loss - reference, "server": served - loss}


def check_table(name: str, doc: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for label, method in CHECK_VARIANTS[name]:
        got = doc.get(label) or {}
        loss = (got.get("served_loss") or {}).get("loss")
        rows.append({"server": label, "kt_method": got.get("kt_method"), "served_loss": loss,
                     "reference": doc.get("reference"), "difference": got.get("difference"),
                     "relative": got["difference"] / doc["reference"] if got.get("difference") is not None else None,
                     "within_0.0005": got.get("within_exact_tolerance"), "ready_s": got.get("ready_s"),
                     "merged_weights_fp32": got.get("merged_weights_fp32"), "error": got.get("error")})
    bf16 = next((r for r in rows if r["server"] == "merged-BF16"), {})
    return {"name": name, "rows": rows, "published_lora_path": doc.get("published_lora_path"),
            "bf16_within_tolerance": bf16.get("within_0.0005")}


# --------------------------------------------------------------------------- report


def phase_report(work: MergedWork) -> int:
    """The three tables in results/summary.json (and printed)."""
    def read(name: str) -> Any:
        path = work.results / name
        return json.loads(path.read_text()) if path.is_file() else None

    load = read("load.json")
    levers = read("levers.json") or {}
    summary = {
        "moe_layers": work.moe_layers,
        "item5_side_by_side": load_table(load) if load else None,
        "item5_alternate_starts": (read("alternate.json") or {}).get("summary"),
        "item3_levers": {g: {n: {"decode_c1": _decode(d), "ready_s": d.get("ready_s"), "ok": d.get("ok"),
                                 "served_loss": (d.get("served_loss") or {}).get("loss"),
                                 "merge_s": ((d.get("merge") or {}).get("made") or {}).get("wall_s")
                                 if isinstance((d.get("merge") or {}).get("made"), dict) else None}
                             for n, d in runs.items()} for g, runs in levers.items()},
        "item3_chosen": read("levers-chosen.json"),
        "item4_served_equals_trained": {n: check_table(n, read(f"check-{n}.json"))
                                        for n in ("bf16", "rawint4") if read(f"check-{n}.json")},
        "merges": {p.stem: json.loads(p.read_text()) for p in sorted(work.results.glob("merge-*.json"))},
    }
    work.results.mkdir(parents=True, exist_ok=True)
    (work.results / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps(summary, indent=1, default=str)[:6000])
    return 0


def phase_clean(work: MergedWork) -> int:
    """Remove this depth's model, views, merges and store (the results stay)."""
    for path in (work.root, work.endpoints, work.sft_store, ROOT / "tiny-store", ROOT / "tiny-endpoint"):
        shutil.rmtree(path, ignore_errors=True)
    (ROOT / "depth.json").unlink(missing_ok=True)
    print(f"removed; {free_disk_gb(ROOT)} GB free")
    return 0


REHEARSAL_GPU_ENV = "KTFLOW_MERGED_SERVING_REHEARSAL_GPU"


def _rehearsal_gpu() -> None:
    """Only for tests/test_merged_serving_harness.py on a box without GPUs: the serve stage's host probe reports one
    (the stand-in server needs none; the launch's checks want serving.gpus of them)."""
    import ktflow.resources
    from ktflow.host.hardware import GpuInfo, probe_host

    host = probe_host().model_copy(update={"gpus": [GpuInfo(index=0, name="rehearsal", vram_bytes=80 << 30)]})
    ktflow.resources.hardware.probe_host = lambda *a, **k: host


PHASES = {"fixture": phase_fixture, "adapter": phase_adapter, "merge": phase_merge, "levers": phase_levers,
          "load": phase_load, "alternate": phase_alternate, "check": phase_check, "report": phase_report,
          "clean": phase_clean}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_serve"]:
        if os.environ.get(REHEARSAL_GPU_ENV):  # the CPU rehearsal (stand-in server): the host gets a GPU to check
            _rehearsal_gpu()
        doc = serve_and_measure(json.loads(argv[1]))
        return 0 if doc.get("ok") and not doc.get("leftover_processes") else 1
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=PHASES)
    parser.add_argument("--moe-layers", type=int, default=None,
                        help="the depth (default: depth.json, written by fixture from the free disk)")
    parser.add_argument("--python", default=str(big.default_python()), help="the training toolchain's python")
    parser.add_argument("--ktflow-python", default=None, help="the python that runs ktflow (default: --python)")
    parser.add_argument("--serve-python", default=str(SERVE_PY), help="the serving toolchain's python")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="a further recipe override (training)")
    parser.add_argument("--random", action="store_true", help="adapter: random non-zero LoRA instead of training")
    parser.add_argument("--method", default="RAWINT4", help="merge: the expert format")
    parser.add_argument("--group", default="engine", choices=("engine", "gpu", "threads", "methods", "combo"),
                        help="levers: which levers")
    parser.add_argument("--levers", default="", help="levers: only these of the group (comma-separated names)")
    parser.add_argument("--only", default=None,
                        help="load: which servers, in this order (default lora,merged,base); check: which of the "
                             "fixture's servers (default all: lora and each merged format)")
    parser.add_argument("--name", default="bf16", choices=tuple(TINY_BASES), help="check: which tiny fixture")
    parser.add_argument("--starts", type=int, default=4, help="alternate: how many starts in all (even)")
    parser.add_argument("--first", default="base", choices=ALTERNATE_MODELS, help="alternate: which model starts first")
    parser.add_argument("--again", action="store_true", help="measure again what was measured before")
    parser.add_argument("--bandwidth-gib", type=float, default=4.0, help="the read-bandwidth buffer (GiB)")
    args = parser.parse_args(argv)
    return PHASES[args.phase](MergedWork(args))


if __name__ == "__main__":
    sys.exit(main())
