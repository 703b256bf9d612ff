#!/usr/bin/env python3
"""Kimi-K2.5 at its true geometry, a slice of it: planned, trained and served on the GPU host, and the whole model
predicted from it (issue "A slice of Kimi-K2.5 at its true geometry").

The model is ``ktflow fixture kimi-k2.5 MODEL --size slice --layers N+1``: Kimi-K2.5's first N+1 layers as its
config gives them (layer 0 dense, then N MoE layers of 384 routed experts of [2048, 7168], top-8, one shared
expert, MLA, vocabulary 163840), ~9.8 GB a MoE layer on disk, made on the host. Two depths (``--moe-layers``)
measure how KT's step scales with layers; both train into one store, so ``ktflow plan``'s per-host calibration for
the whole 61-layer model (``whole``) comes from them. Each phase fits one 10-minute device call; run them from the
repository root after ``bash gpu_host/run.sh setup`` (run.sh has a ``slice-*`` step for each), on one warm machine:

    PY=build/gpu-host/bundle/bin/python
    $PY gpu_host/kimi_slice.py fixture --moe-layers 3   # the model (+ the 64 multi-turn records, once)
    $PY gpu_host/kimi_slice.py sft --moe-layers 3       # ktflow plan (kept), then ktflow sft, measured from outside
    $PY gpu_host/kimi_slice.py fixture --moe-layers 6
    $PY gpu_host/kimi_slice.py sft --moe-layers 6
    $PY gpu_host/kimi_slice.py whole                    # ktflow plan of recipes/kimi-k2.5-rawint4.yaml on this host
    $PY gpu_host/kimi_slice.py convert --moe-layers 6   # ktflow convert-lora of its adapter
    $PY gpu_host/kimi_slice.py serve-prep --moe-layers 6
    gpu_host/run.sh slice-serve                         # ktflow serve (sglang-kt, RAWINT4) + serve_load at 1 and 8

The records are gpu_host/throughput.py chat-data's (64 multi-turn records of 127-503 tokens under the fixture's
tokenizer), the recipe gpu_host/slice-kt-rawint4.yaml (cutoff 512, 8 records a step shaped by ktflow, 5 steps: the
first holds the load, the second warms up). Measured as gpu_host/big.py measures (kt_vs_hf's Sampler: steady step,
tokens/s, peak GPU memory over idle, peak RSS of the process tree, load time); ``ktflow plan``'s prediction for
each run is made before it and saved beside it (``predicted``). Outputs: build/gpu-host/slice/moeN/results/*.json
and build/gpu-host/slice/whole.json, packed by ``run.sh pack-slice``; copied to benchmarks/data/kimi-slice/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import big  # noqa: E402  (gpu_host/big.py: the harness this one reuses)
from big import BUILD, REPO, Work, free_disk_gb, model_facts, run_watched  # noqa: E402

SLICE = BUILD / "slice"
RECIPE = REPO / "gpu_host" / "slice-kt-rawint4.yaml"
SERVE_RECIPE = REPO / "gpu_host" / "slice-sglang-rawint4.yaml"  # the same recipe + a serving section
WHOLE_RECIPE = REPO / "recipes" / "kimi-k2.5-rawint4.yaml"
DATA = SLICE / "data" / "chat.jsonl"
SERVE_LEVELS = "1,8"
# The whole model's RAM for the "as if it had the RAM" plan: Kimi-K2.5's 571 GB of INT4 experts and more.
AMPLE_RAM = 2 * 2**40


class SliceWork(Work):
    """big.Work for one depth of the slice: its model, results and the shared store."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(argparse.Namespace(
            size="full", python=args.python, ktflow_python=args.ktflow_python, set=args.set, gpus=args.gpus,
            threads=args.threads, as_written=getattr(args, "as_written", False), serve_python=args.serve_python,
            methods="RAWINT4", trainer="kt"))
        self.size = "slice"
        self.moe_layers: int = args.moe_layers
        self.root = SLICE / f"moe{args.moe_layers}"
        self.model, self.data, self.results = self.root / "model", DATA, self.root / "results"
        self.recipe, self.serve_recipe = RECIPE, SERVE_RECIPE
        self.sft_store = SLICE / ("store" + self.sft_name.removeprefix("sft"))  # one store for every depth
        self.serve_load_args = f"--concurrency {SERVE_LEVELS}"

    def published(self, store: Path) -> Path | None:
        """The newest published adapter of this depth's model (the store holds every depth's runs)."""
        mine = [p for p in store.glob("runs/*/adapter") if (p / "manifest.json").is_file()
                and (p.parent / "train.yaml").is_file()
                and str(self.model) in (p.parent / "train.yaml").read_text(errors="replace")]
        return max(mine, key=lambda p: p.stat().st_mtime) if mine else None


def phase_fixture(work: SliceWork) -> int:
    """The model (``ktflow fixture ... --size slice``, timed, RSS sampled) and, once, the records."""
    work.results.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"moe_layers": work.moe_layers, "free_disk_gb_before": free_disk_gb(work.root)}
    for partial in work.root.glob(f".{work.model.name}.partial-*"):  # what a call's time limit cut short
        shutil.rmtree(partial, ignore_errors=True)
    if (work.model / "config.json").is_file():
        doc["made"] = "reused (already there)"
    else:
        argv = work.ktflow("fixture", "kimi-k2.5", str(work.model), "--size", "slice",
                           "--layers", str(work.moe_layers + 1))
        made = run_watched(argv, env=work.env(), log=work.results / "fixture.log", limit_s=big.PHASE_LIMIT_S)
        doc["made"] = {k: made[k] for k in ("outcome", "wall_s", "peak_host_rss_gib", "error_line", "log_tail")}
        if made["rc"] != 0:
            work.save("fixture", doc)
            return 1
    if not DATA.is_file():
        done = subprocess.run([str(work.ktflow_python), str(REPO / "gpu_host" / "throughput.py"), "chat-data",
                               "--model", str(work.model), "--out", str(DATA)], env=work.env(), cwd=REPO,
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-2000:], done.stderr[-3000:])
            return 1
    doc.update(model_facts(work.model), data=json.loads(DATA.with_suffix(".json").read_text()),
               free_disk_gb_after=free_disk_gb(work.root))
    work.save("fixture", doc)
    return 0


def _host_file(work: SliceWork, ram_bytes: int) -> Path:
    """``ktflow doctor --json`` of this host (what ``ktflow plan --host`` reads) as host.json, and beside it the
    same host with ``ram_bytes`` of RAM (host-ample-ram.json, returned)."""
    done = subprocess.run(work.ktflow("doctor", "--json"), env=work.env(), cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    host = json.loads(done.stdout)
    SLICE.mkdir(parents=True, exist_ok=True)
    (SLICE / "host.json").write_text(json.dumps(host, indent=2))
    path = SLICE / "host-ample-ram.json"
    path.write_text(json.dumps({**host, "ram_bytes": ram_bytes, "ram_available_bytes": ram_bytes}, indent=2))
    return path


# The whole model's plans: the slice's own settings (its records counted with the slice's tokenizer, cutoff 512, a
# shaped batch of 8: only the depth differs), the shipped recipe's (cutoff 4096, 64 records a step, every micro-batch
# at the cutoff: no dataset here), and the seeds' guide's (cutoff 2048, 1 record x 8 micro-batches; ktransformers'
# SFT_Installation_Guide_KimiK2.md), each on this host's GPUs as they are and its RAM as if enough.
WHOLE_VARIANTS: dict[str, list[str]] = {
    "as-the-slice-trains": ["sft.cutoff_len=512", "sft.per_device_train_batch_size=1",
                            "sft.gradient_accumulation_steps=8", "sft.kt_shape_batches=true",
                            "sft.kt_config.kt_model_max_length=512", "sft.max_steps=5"],
    "as-the-recipe-ships": [],
    "as-the-seeds-guide": ["sft.cutoff_len=2048", "sft.per_device_train_batch_size=1",
                           "sft.gradient_accumulation_steps=8", "sft.kt_shape_batches=false",
                           "sft.kt_config.kt_model_max_length=2048"],
}


def whole_sets(variant: str, store: Path, gpus: int, data: Path = DATA) -> list[str]:
    """Overrides of recipes/kimi-k2.5-rawint4.yaml for a plan beside the slice's runs: the slice's store (its runs
    calibrate the plan), the KT settings the calibration matches on (one NUMA pool, the host's cores, RAWINT4 with
    retained activations as the slice trains), ``gpus`` GPUs, and the variant's batch (and, as the slice trains,
    its records ``data``)."""
    records = [f"dataset.files=[{data}]"] if variant == "as-the-slice-trains" else []
    return [f"store.root={store}", "evaluation.enabled=false", f"sft.gpus={gpus}",
            "sft.kt_config.kt_tp_enabled=false", "sft.kt_config.kt_threadpool_count=1",
            "sft.disable_gradient_checkpointing=true", "sft.kt_cpu_activation=retain", *records,
            *WHOLE_VARIANTS[variant]]


def plan_whole(host_file: Path, store: Path, tokenizer_dir: Path | None, data: Path = DATA) -> list[dict[str, Any]]:
    """``ktflow plan`` (its ``plan_recipe``) of the whole Kimi-K2.5 for every variant, on 1 GPU and on every GPU
    of ``host_file``; the slice variant's records counted with ``tokenizer_dir``'s tokenizer (the slice's: the
    whole model's own is not here), as ``ktflow plan`` counts them with a downloaded model's."""
    from ktflow.plan import load_host, plan_recipe
    from ktflow.planning.batch_shape import record_lengths
    from ktflow.recipe import load_recipe

    host = load_host(host_file)
    rows: list[dict[str, Any]] = []
    for variant in WHOLE_VARIANTS:
        for gpus in sorted({1, len(host.gpus) or 1}):
            sets = whole_sets(variant, store, gpus, data)
            recipe = load_recipe(WHOLE_RECIPE, sets)
            lengths = record_lengths(recipe, tokenizer_dir) if variant == "as-the-slice-trains" else None
            sft, serve = _sft_and_serve(plan_recipe(recipe, host, lengths=lengths))
            rows.append({"variant": variant, "gpus": gpus, "sets": sets, "step_s": sft.step_seconds,
                         "seconds": sft.seconds, **_sft_figures(sft), "serve": _serve_figures(serve)})
    return rows


def _sft_and_serve(plan: Any) -> tuple[Any, Any]:
    """A plan's sft line and its serve line (None: the recipe serves nothing)."""
    stages = {st.stage: st for st in plan.stages}
    return stages["sft"], stages.get("serve")


def _sft_figures(sft: Any) -> dict[str, Any]:
    """What whole.json and seeds.json keep of a plan's sft line (besides its step)."""
    return {"gpu_gib_per_gpu": round(sft.gpu_bytes / 2**30, 2), "ram_gib": round(sft.ram_bytes / 2**30, 1),
            "time_basis": sft.time_basis, "fits": sft.fits, "problems": sft.problems}


def _serve_figures(serve: Any) -> dict[str, Any] | None:
    """What whole.json and seeds.json keep of a plan's serve line."""
    if serve is None:
        return None
    return {"decode_tokens_per_s": serve.decode_tokens_per_s, "gpu_gib": round(serve.gpu_bytes / 2**30, 2),
            "ram_gib": round(serve.ram_bytes / 2**30, 1), "time_basis": serve.time_basis}


def slice_tokenizer(preferred: Path, slices: Path = SLICE) -> Path | None:
    """A slice model's folder with its tokenizer: ``preferred``, else any depth's still on disk (every depth's
    tokenizer is the same one), else None (records are then counted at ~4 bytes a token)."""
    for model in (preferred, *sorted(slices.glob("moe*/model"))):
        if (model / "tokenizer.json").is_file():
            return model
    return None


def phase_whole(work: SliceWork) -> int:
    """``ktflow plan`` for the whole Kimi-K2.5 on this host (its RAM as if enough), calibrated from the slice
    runs in the store (:func:`plan_whole`)."""
    ample = _host_file(work, AMPLE_RAM)
    rows = plan_whole(ample, work.sft_store, slice_tokenizer(work.model))
    doc = {"recipe": str(WHOLE_RECIPE.relative_to(REPO)), "host": json.loads(ample.read_text()), "plans": rows}
    (SLICE / "whole.json").write_text(json.dumps(doc, indent=2))
    for row in rows:
        print("whole: " + json.dumps({k: row.get(k) for k in ("variant", "gpus", "step_s", "gpu_gib_per_gpu",
                                                                "ram_gib", "fits")}), flush=True)
    return 0


# The seeds' hosts (issue "A slice of Kimi-K2.5", item 4; benchmarks/data/kimi-slice/README.md says where each figure
# comes from): a dual-socket Xeon Platinum 8488C (48 cores a socket, as the KT docs' --kt-cpuinfer 96 and
# --kt-threadpool-count 2 on that machine imply; one NUMA node a socket) with RTX 4090 24 GB cards.
SEED_GPU = {"name": "NVIDIA GeForce RTX 4090", "vram_bytes": 24564 * 2**20}
SEED_HOSTS: dict[str, tuple[int, int]] = {  # name: (GPUs, RAM bytes)
    "seed-train-2x4090": (2, int(1.97 * 2**40)),  # Moonshot's 44.55 tokens/s: "2x 4090 + 8488C with 1.97T RAM"
    "seed-train-4x4090": (4, 2 * 2**40),  # KT's Kimi-K2.5 SFT tutorial: 4 x RTX 4090 24GB, >= 2 TB
    "seed-serve-2x4090": (2, 600 * 2**30),  # KT's Kimi-K2.5 serving doc: 2 x 4090, at least 600 GB
}
# What each seed figure trained (KT's DeepSeek-V3 user guide: qlen 512, GAS 16, LoRA r 8, BF16 experts on AMX; KT's
# Kimi-K2 SFT guide's YAML: cutoff 2048, 1 record x 8 micro-batches, LoRA r 8), planned with ktflow's recipes' other
# KT settings as shipped.
DEEPSEEK_V3_RECIPE = REPO / "recipes" / "deepseek-v3-fp8.yaml"
DEEPSEEK_USER_GUIDE = ["sft.cutoff_len=512", "sft.per_device_train_batch_size=1", "sft.gradient_accumulation_steps=16",
                       "sft.kt_shape_batches=false",
                       "sft.lora_rank=8", "sft.kt_config.kt_model_max_length=512", "sft.kt_config.kt_backend=AMXBF16",
                       "sft.kt_config.kt_expert_weight_format=bf16"]
SEED_PLANS: list[tuple[str, Path, str, list[str]]] = [
    ("kimi-k2.5 as the seeds' guide", WHOLE_RECIPE, "seed-train-2x4090", WHOLE_VARIANTS["as-the-seeds-guide"]),
    ("kimi-k2.5 as the seeds' guide", WHOLE_RECIPE, "seed-train-4x4090", WHOLE_VARIANTS["as-the-seeds-guide"]),
    ("deepseek-v3 as KT's user guide", DEEPSEEK_V3_RECIPE, "seed-train-2x4090", DEEPSEEK_USER_GUIDE),
    ("deepseek-v3 as KT's user guide", DEEPSEEK_V3_RECIPE, "seed-train-4x4090", DEEPSEEK_USER_GUIDE),
    ("kimi-k2.5 served", WHOLE_RECIPE, "seed-serve-2x4090", ["serving.gpus=2"]),
]


def seed_host(name: str, template: dict[str, Any]) -> dict[str, Any]:
    """A seed host as ``ktflow doctor --json`` would describe it, on ``template`` (an AMX host's doctor JSON)."""
    gpus, ram = SEED_HOSTS[name]
    numa = [{"id": i, "cpus": list(range(48 * i, 48 * (i + 1))), "mem_total_bytes": ram // 2,
             "mem_free_bytes": ram // 2} for i in range(2)]
    return {**template, "hostname": name, "cpu_model": "Intel(R) Xeon(R) Platinum 8488C (2 sockets x 48 cores)",
            "logical_cores": 192, "physical_cores": 96, "numa_nodes": 2, "numa": numa, "ram_bytes": ram,
            "ram_available_bytes": ram, "gpus": [{"index": i, **SEED_GPU} for i in range(gpus)],
            "disk_free_bytes": 8 * 10**12}


def plan_seeds(template: Path, out: Path) -> list[dict[str, Any]]:
    """ktflow's plan for each of SEED_PLANS on its seed host (no run of ours on those hosts: the shipped
    constants, uncalibrated); the host files are written into ``out``."""
    from ktflow.plan import load_host, plan_recipe
    from ktflow.recipe import load_recipe

    out.mkdir(parents=True, exist_ok=True)
    base = json.loads(template.read_text())
    rows: list[dict[str, Any]] = []
    for what, recipe_path, host_name, sets in SEED_PLANS:
        host_file = out / f"{host_name}.json"
        host_file.write_text(json.dumps(seed_host(host_name, base), indent=2))
        gpus = SEED_HOSTS[host_name][0]
        recipe = load_recipe(recipe_path, [f"sft.gpus={gpus}", "evaluation.enabled=false", *sets])
        sft, serve = _sft_and_serve(plan_recipe(recipe, load_host(host_file)))
        tokens_per_step = recipe.sft.cutoff_len * recipe.sft.per_device_train_batch_size * \
            recipe.sft.gradient_accumulation_steps
        served = _serve_figures(serve)
        if served is not None:
            served.update(fits=serve.fits, problems=serve.problems)
        rows.append({"what": what, "recipe": str(recipe_path.relative_to(REPO)), "host": host_name, "sets": sets,
                     "gpus": gpus, "step_s": sft.step_seconds, "tokens_per_step": tokens_per_step,
                     "tokens_per_s": round(tokens_per_step / sft.step_seconds, 2) if sft.step_seconds else None,
                     **_sft_figures(sft), "serve": served})
    return rows


def phase_seeds(work: SliceWork) -> int:
    """The seeds' hosts planned (:func:`plan_seeds`; no GPU needed): benchmarks/data/kimi-slice/seeds.json."""
    docs = REPO / "benchmarks" / "data" / "kimi-slice"
    rows = plan_seeds(docs / "host.json", docs / "hosts")
    (docs / "seeds.json").write_text(json.dumps({"plans": rows}, indent=2))
    for row in rows:
        print("seeds: " + json.dumps({k: row[k] for k in ("what", "host", "step_s", "tokens_per_s", "gpu_gib_per_gpu",
                                                            "ram_gib", "fits")}), flush=True)
    return 0


def phase_clean(work: SliceWork) -> int:
    """Remove this depth's model (the disk holds two depths but not a third beside the serving bundle)."""
    shutil.rmtree(work.model, ignore_errors=True)
    print(f"removed {work.model}; {free_disk_gb(SLICE)} GB free")
    return 0


PHASES = {"fixture": phase_fixture, "sft": big.phase_sft, "convert": big.phase_convert, "whole": phase_whole,
          "serve-prep": big.phase_serve_prep, "serve": big.phase_serve, "clean": phase_clean, "seeds": phase_seeds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=PHASES)
    parser.add_argument("--moe-layers", type=int, default=6, help="the depth: MoE layers after the dense one")
    parser.add_argument("--python", default=str(big.default_python()), help="the training toolchain's python")
    parser.add_argument("--ktflow-python", default=None, help="the python that runs ktflow (default: --python)")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="a further recipe override")
    parser.add_argument("--gpus", type=int, default=1, help="sft: train on N GPUs (sft.gpus=N, the batch kept)")
    parser.add_argument("--threads", type=int, default=None, help="sft: KT CPU threads (kt_config.kt_num_threads)")
    parser.add_argument("--as-written", action="store_true",
                        help="sft: the recipe's batch split (1 x 8), not the shaper's, in a store of its own")
    parser.add_argument("--serve-python", default=str(BUILD / "serve" / "bin" / "python"),
                        help="the serving toolchain's python (serve phases)")
    args = parser.parse_args(argv)
    return PHASES[args.phase](SliceWork(args))


if __name__ == "__main__":
    sys.exit(main())
