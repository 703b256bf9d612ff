#!/usr/bin/env python3
"""Bigger than the GPU: KT LoRA SFT of a MoE that plain LoRA SFT cannot hold, measured on the GPU host.

The model is ``ktflow fixture kimi-k2.5 --size bigger-than-gpu``: Kimi-K2.5's layout and widths with 8
layers of 180 routed experts, 57.1B parameters, 114 GB in BF16 (an H100 80GB reports 85.5 GB), 34.4 GB as
Kimi's INT4 on disk. It is made on the host (nothing that size travels). Each phase fits one 10-minute
device call; run them from the repository root after ``bash gpu_host/run.sh setup`` (run.sh has a step
for each), in this order, on one warm machine (or the fixture again first):

    PY=build/gpu-host/bundle/bin/python
    $PY gpu_host/big.py fixture   # the model and the demo's 48 records (run.sh fixture-big)
    $PY gpu_host/big.py sft       # ktflow sft gpu_host/big-kt-rawint4.yaml, measured from outside (sft-big)
    $PY gpu_host/big.py hf        # ktflow doctor + ktflow sft on gpu_host/big-hf.yaml (refused), then plain
                                  # LlamaFactory on the same INT4 checkpoint by hand: what happens (hf-big)
    $PY gpu_host/big.py convert   # ktflow convert-lora of sft's adapter (convert-big)
    $PY gpu_host/big.py kill      # ktflow sft in a fresh store, kill -9 after its first checkpoint (kill-big)
    $PY gpu_host/big.py resume    # the same command again: resumes from that checkpoint (resume-big)
    $PY gpu_host/big.py report    # the figures of every phase in one table

Several GPUs and thread counts (issue "KT SFT on several GPUs"): ``sft --gpus N`` trains with
``--set sft.gpus=N`` (the recipe's batch kept: each GPU an equal share), ``--threads T`` with
``sft.kt_config.kt_num_threads=T``; each such run has a store and a results name of its own
(``sft-gpus2``, ``sft-t32``, ``sft-gpus4-t64``), and ``ktflow plan``'s prediction for it, made before it
runs, is saved beside what was measured (``predicted``).

Served (issue "Serve for real", item 4), after ``sft``, on the same machine:

    $PY gpu_host/big.py serve-prep   # what `ktflow serve` makes before a start, for RAWINT4 and AMXINT8:
                                     # the converted adapter, quantize-int8 of the INT4 checkpoint itself (no BF16
                                     # copy), kt-kernel's .kt layout of it, the model view sglang-kt loads (timed)
    gpu_host/run.sh serve-big        # per method: `ktflow serve gpu_host/big-sglang-rawint4.yaml` (serve_check.py
                                     # run --via cli --load-json), benchmarks/serve_load.py at concurrency 1, 4, 16
                                     # against it, the host's read bandwidth measured before, `ktflow serve --stop`

``--size reduced`` runs the same code on the same structure at reduced widths (3 layers, 16 experts,
4 steps) in a minute or two (run.sh big-reduced; tests/test_gpu_host.py checks it). Outputs land in
build/gpu-host/big[-reduced]/: model, data, stores, and results/*.json (with every earlier run of a
phase in results/history/) to copy into benchmarks/data/bigger-than-gpu/.

Measured from outside the processes with benchmarks/kt_vs_hf.py's Sampler and measure: wall time;
ktflow's pre-launch (start -> the launcher seen) and publish (launcher exit -> exit) time; load (start
-> first logged step, less the second step's duration); steady step time and tokens/s (logged steps 3..,
also without the steps that save a checkpoint); peak GPU memory over idle (nvidia-smi --loop-ms 100);
peak RSS of the process tree. This process imports neither torch nor transformers (a child's peak RSS
would include them): model facts come from safetensors headers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "build" / "gpu-host"
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from kt_vs_hf import Sampler, _trainer_log_under, measure  # noqa: E402  (psutil only)

RECIPES = {"kt": REPO / "gpu_host" / "big-kt-rawint4.yaml", "hf": REPO / "gpu_host" / "big-hf.yaml"}
SERVE_RECIPE = REPO / "gpu_host" / "big-sglang-rawint4.yaml"  # the KT recipe + a serving section (same run key)
SERVE_METHODS = ("RAWINT4", "AMXINT8")
# --size reduced: the bigger-than-gpu structure (MLA with a q LoRA, top-8, layer 0 dense, one shared
# expert) at widths kt-kernel's RAWINT4 kernels take, made in seconds; 4 steps, a checkpoint after each.
REDUCED_DIMS = {"layers": 3, "experts": 16, "experts_per_tok": 8, "hidden": 1024, "moe_intermediate": 512,
                "intermediate": 2048, "heads": 8, "q_lora_rank": 256, "kv_lora_rank": 128, "qk_nope_head_dim": 64,
                "qk_rope_head_dim": 32, "v_head_dim": 64}
REDUCED_SETS = ["sft.max_steps=4", "sft.save_steps=1"]
PHASE_LIMIT_S = 540  # a device call is 600 s; what a phase may take before its children are killed
HF_ATTEMPT_LIMIT_S = 420  # the plain LlamaFactory attempt, inside the phase's 540 s
def _rss_guard() -> int:
    """Stop an attempt before the kernel's OOM killer picks a victim: 88 % of the host's RAM (110 GiB of the
    one-GPU host's 125 GiB, 440 of the 4-GPU host's 503)."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.88)


RSS_GUARD = _rss_guard()
# What the plain attempt's log says about how far it got, in the order it gets there.
HF_MARKERS = (
    ("model load", r"Loading (checkpoint shards|weights)|loading weights file|from_pretrained"),
    ("load report", r"LOAD REPORT"),
    ("weights not loaded", r"\|\s*MISSING\s*\|"),
    ("trainable params", r"trainable params"),
    ("training started", r"\*\*\*\*\* Running training \*\*\*\*\*"),
    ("CUDA out of memory", r"CUDA out of memory|OutOfMemoryError"),
)
_ERROR_LINE = re.compile(r"(Error|Exception|error:|Killed|out of memory)")


class Work:
    """Paths and settings of one size's run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.size: str = args.size
        self.root = BUILD / ("big" if args.size == "full" else "big-reduced")
        self.model, self.data = self.root / "model", self.root / "data" / "train.jsonl"
        self.results = self.root / "results"
        self.python = Path(args.python).absolute()  # the training toolchain the recipes name
        self.ktflow_python = Path(args.ktflow_python or args.python).absolute()
        self.extra_sets: list[str] = list(args.set or ())
        self.gpus: int = args.gpus
        self.threads: int | None = args.threads
        # the batch split as the recipe writes it (sft.kt_shape_batches false): the shaper's predicted gain is the
        # shaped run's tokens/s over this one's
        self.as_written: bool = bool(getattr(args, "as_written", False))
        self.serve_python = Path(args.serve_python).absolute()
        self.methods: list[str] = args.methods.split(",") if args.methods else list(SERVE_METHODS)
        # the sft phase's results name and store: "sft" for the recipe's run, else its GPUs, threads and batch split
        suffix = ((f"-gpus{args.gpus}" if args.gpus != 1 else "") + (f"-t{args.threads}" if args.threads else "")
                  + ("-written" if self.as_written else ""))
        self.sft_name = "sft" + suffix
        self.sft_store = self.root / ("store" + suffix)
        # What the sft, kill and resume phases train: the KT recipe; "hf" rehearses this harness on a CPU box
        # (with --set sft.gpus=0), where KT cannot run.
        self.recipe = RECIPES[args.trainer]
        self.serve_recipe = SERVE_RECIPE  # the KT recipe + a serving section (same run key)
        self.serve_load_args: str | None = None  # more benchmarks/serve_load.py arguments (serve phase)

    def published(self, store: Path) -> Path | None:
        """The newest published adapter in ``store`` (of this work's model, where a store holds several)."""
        return _published(store)

    def sets(self, store: Path) -> list[str]:
        sets = [f"source.local_path={self.model}", f"dataset.files=[{self.data}]", f"store.root={store}",
                f"toolchains.train.python={self.python}", f"toolchains.serve.python={self.python}"]
        run = ([f"sft.gpus={self.gpus}"] if self.gpus != 1 else []) + (
            [f"sft.kt_config.kt_num_threads={self.threads}"] if self.threads else []) + (
            ["sft.kt_shape_batches=false"] if self.as_written else [])
        return sets + (REDUCED_SETS if self.size == "reduced" else []) + run + self.extra_sets

    def ktflow(self, *args: str, store: Path | None = None) -> list[str]:
        """A ``ktflow`` command line; with ``store``, this run's ``--set`` overrides (recipe commands)."""
        argv = [str(self.ktflow_python), "-m", "ktflow.cli", *args]
        for item in self.sets(store) if store is not None else ():
            argv += ["--set", item]
        return argv

    def save_steps(self, store: Path) -> int:
        """The checkpoint interval of the recipe as this run overrides it."""
        from ktflow.recipe import load_recipe

        return load_recipe(self.recipe, self.sets(store)).sft.save_steps

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        return {**os.environ, "KTFLOW_SRC": str(REPO), "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

    def save(self, name: str, doc: dict[str, Any]) -> None:
        """results/NAME.json (the latest) and results/history/NAME-STAMP.json (every run)."""
        doc = {"phase": name, "size": self.size, "stamp": time.strftime("%Y-%m-%dT%H:%M:%S"), **doc}
        (self.results / "history").mkdir(parents=True, exist_ok=True)
        text = json.dumps(doc, indent=2, default=str)
        (self.results / "history" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(text)
        (self.results / f"{name}.json").write_text(text)
        print(f"{name}: {json.dumps({k: v for k, v in doc.items() if not isinstance(v, (list, dict))})}", flush=True)


# --------------------------------------------------------------------------- running and watching children


@contextmanager
def deadline(seconds: float) -> Iterator[dict[str, bool]]:
    """Kill this process's child sessions (each leg runs in its own) if the block runs past ``seconds``,
    so a hung phase still writes its results inside the device call."""
    import psutil

    fired = {"fired": False}

    def expire() -> None:
        fired["fired"] = True
        for child in psutil.Process().children():
            try:
                if os.getpgid(child.pid) == child.pid:
                    os.killpg(child.pid, signal.SIGKILL)
            except (OSError, psutil.Error):
                continue

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield fired
    finally:
        timer.cancel()


def _kill_group(pid: int) -> None:
    """kill -9 the process group a child leads (each leg runs in its own session); gone already is fine."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(path: Path, lines: int = 30) -> list[str]:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in text.splitlines()[-lines:]]


class _Markers:
    """First time each marker appears in a growing log (polled every 0.2 s)."""

    def __init__(self, log: Path, markers: tuple[tuple[str, str], ...], clock: Callable[[], float]) -> None:
        self.log, self.markers, self.clock = log, [(n, re.compile(p)) for n, p in markers], clock
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        offset = 0
        while not self._stop.wait(0.2):
            self.poll_once(offset)
            offset = max(offset, self.log.stat().st_size - 4096) if self.log.is_file() else 0

    def poll_once(self, offset: int = 0) -> None:
        if not self.log.is_file():
            return
        with open(self.log, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
        for name, pattern in self.markers:
            if name not in self.seen and pattern.search(text):
                self.seen[name] = round(self.clock(), 1)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll_once()
        return self.seen


def run_watched(argv: list[str], *, env: dict[str, str], log: Path, limit_s: float,
                trainer_log: Callable[[], Path | None] = lambda: None,
                markers: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    """Run a command that may fail, hang or blow up, and record what happened.

    Its whole process tree is sampled (RSS, GPU memory, trainer log lines); past ``limit_s`` or
    :data:`RSS_GUARD` bytes of RSS the tree is killed (-9) and the outcome says why.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=REPO, start_new_session=True)
        sampler = Sampler(proc.pid, trainer_log, None)
        seen = _Markers(log, markers, sampler.now)
        outcome = None
        while proc.poll() is None:
            if sampler.now() > limit_s:
                outcome = f"killed after {limit_s:.0f} s (the phase's limit)"
            elif sampler.peak_rss > RSS_GUARD:
                outcome = f"killed at {sampler.peak_rss / 2**30:.0f} GiB of host RSS (guard {RSS_GUARD >> 30} GiB)"
            if outcome:
                _kill_group(proc.pid)
                break
            time.sleep(0.2)
        rc = proc.wait()
        wall = sampler.now()
        time.sleep(0.3)
        sampler.stop()
    tail = _tail(log)
    steps = [rec for _, rec in sampler.stamps if rec.get("loss") is not None]
    return {
        "argv": argv, "rc": rc, "outcome": outcome or ("ok" if rc == 0 else f"exit {rc}"), "wall_s": round(wall, 1),
        "markers_s": seen.stop(), "steps_logged": len(steps), "losses": [r["loss"] for r in steps],
        "throughput_llamafactory": steps[-1].get("throughput") if steps else None,
        "error_line": next((line for line in reversed(tail) if _ERROR_LINE.search(line)), None),
        "peak_gpu_mib": None if sampler.gpu_peak is None else sampler.gpu_peak - (sampler.gpu_baseline or 0),
        "peak_host_rss_gib": round(sampler.peak_rss / 2**30, 2), "log": str(log), "log_tail": tail,
    }


# --------------------------------------------------------------------------- facts (headers only)


def gpu_total_mib() -> int | None:
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                          capture_output=True, text=True)
    return int(done.stdout.strip()) if done.returncode == 0 else None


def model_facts(model: Path) -> dict[str, Any]:
    """The checkpoint's size (ktflow's own header arithmetic) beside the GPU's, and the GPU memory
    ktflow estimates plain LoRA SFT of it needs (what ``ktflow sft`` refuses on)."""
    from ktflow.planning.sizing import estimate_hf_sft_gpu_memory, model_size
    from ktflow.recipe import load_recipe

    size = model_size(model)
    config = json.loads((model / "config.json").read_text())["text_config"]
    estimate = estimate_hf_sft_gpu_memory(size, load_recipe(RECIPES["hf"]).sft)
    gpu = gpu_total_mib()
    shards = sorted(model.glob("*.safetensors"))
    return {
        "dims": {k: config[k] for k in ("num_hidden_layers", "n_routed_experts", "num_experts_per_tok", "hidden_size",
                                        "moe_intermediate_size", "intermediate_size", "num_attention_heads",
                                        "vocab_size")},
        "parameters": size.parameters, "bf16_gb": round(2 * size.parameters / 1e9, 1),
        "on_disk_gb": round(sum(p.stat().st_size for p in shards) / 1e9, 2), "shards": len(shards),
        "gpu_total_mib": gpu, "bf16_over_gpu": round(2 * size.parameters / (gpu << 20), 2) if gpu else None,
        "hf_sft_gpu_estimate_gib": round(estimate.total_bytes / 2**30, 1),
    }


def free_disk_gb(path: Path) -> float:
    probe = path
    while not probe.exists():
        probe = probe.parent
    return round(shutil.disk_usage(probe).free / 1e9, 1)


def adapter_facts(adapter: Path) -> dict[str, Any]:
    """Files and sizes of a published adapter and the shapes of KT's fused expert LoRA tensors."""
    from ktflow.formats.safetensors_io import read_header

    if not adapter.is_dir():
        return {"present": False}
    facts: dict[str, Any] = {"files": {p.name: p.stat().st_size for p in sorted(adapter.iterdir()) if p.is_file()}}
    fused = adapter / "fused_expert_lora.safetensors"
    if fused.is_file():
        tensors = read_header(fused).tensors
        facts["fused_expert_lora"] = {"tensors": len(tensors), "shapes": {
            re.sub(r"layers\.\d+\.", "layers.L.", n): [t.dtype, list(t.shape)] for n, t in sorted(tensors.items())}}
    manifest = adapter / "manifest.json"
    if manifest.is_file():
        facts["manifest_extra"] = json.loads(manifest.read_text()).get("extra")
    return facts


# --------------------------------------------------------------------------- phases


def phase_fixture(work: Work) -> int:
    """The model (made here, timed, its RSS sampled: the writer streams one layer at a time) and the data."""
    work.results.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"free_disk_gb_before": free_disk_gb(work.root)}
    if (work.model / "config.json").is_file():
        doc["made"] = "reused (already there)"
    else:
        if work.size == "full":
            argv = work.ktflow("fixture", "kimi-k2.5", str(work.model), "--size", "bigger-than-gpu")
        else:
            argv = [str(work.ktflow_python), __file__, "_reduced_fixture", str(work.model)]
        made = run_watched(argv, env=work.env(), log=work.results / "fixture.log", limit_s=PHASE_LIMIT_S)
        doc["made"] = {k: made[k] for k in ("outcome", "wall_s", "peak_host_rss_gib", "error_line", "log_tail")}
        if made["rc"] != 0:
            work.save("fixture", doc)
            return 1
    data = subprocess.run([str(work.ktflow_python), __file__, "_data", str(work.data.parent)], env=work.env(),
                          cwd=REPO, capture_output=True, text=True)
    if data.returncode != 0:
        print(data.stderr[-3000:])
        return 1
    doc.update(model_facts(work.model), data_records=sum(1 for _ in work.data.open()),
               free_disk_gb_after=free_disk_gb(work.root))
    work.save("fixture", doc)
    return 0


def _published(store: Path) -> Path | None:
    adapters = [p for p in store.glob("runs/*/adapter") if (p / "manifest.json").is_file()]
    return max(adapters, key=lambda p: p.stat().st_mtime) if adapters else None


def _step_figures(result: dict[str, Any], save_steps: int) -> dict[str, Any]:
    """Step intervals split into those that include a checkpoint save and those that do not (logged
    steps 3.. only: the first logged step holds the load, the second is the warm-up)."""
    steps, times = result.get("steps_logged", []), result.get("step_logged_at_s", [])
    tokens = result.get("tokens_logged", [])
    plain, saving, plain_tokens = [], [], []
    for i in range(2, len(steps)):
        interval = times[i] - times[i - 1]
        if interval <= 0:  # two log lines seen in one poll: no interval to measure between them
            continue
        # the trainer saves after logging step k (k % save_steps == 0): that save sits in the next interval
        (saving if steps[i - 1] % save_steps == 0 else plain).append(interval)
        if steps[i - 1] % save_steps and tokens[i] is not None and tokens[i - 1] is not None:
            plain_tokens.append((tokens[i] - tokens[i - 1]) / interval)
    return {"step_intervals_s": [round(b - a, 2) for a, b in zip(times, times[1:])],
            "steady_step_no_save_s": round(statistics.median(plain), 2) if plain else None,
            "steady_step_with_save_s": round(statistics.median(saving), 2) if saving else None,
            "tokens_per_s_no_save": round(statistics.median(plain_tokens), 1) if plain_tokens else None}


def _collect_run(store: Path, into: Path, earlier: Collection[Path] = ()) -> None:
    """The run's logs and manifests into results (the newest run not in ``earlier``); then its checkpoints go (GBs
    each; the adapter stays)."""
    runs = [p for p in store.glob("runs/*") if p.is_dir() and not p.name.endswith(".lock") and p not in earlier]
    if not runs:
        return
    run = max(runs, key=lambda p: p.stat().st_mtime)
    into.mkdir(parents=True, exist_ok=True)
    for f in (run / "output/trainer_log.jsonl", run / "output/training_loss.png", run / "train.yaml",
              run / "accelerate.yaml", run / "adapter/manifest.json", run / "adapter/kt_adapter_manifest.json",
              run / "adapter/adapter_config.json"):
        if f.is_file():
            shutil.copy2(f, into / f.name)
    (into / "train.log.tail").write_text("\n".join(_tail(run / "train.log", 200)) + "\n")
    for ckpt in run.glob("output/checkpoint-*"):
        shutil.rmtree(ckpt, ignore_errors=True)


def measured_sft(work: Work, name: str, store: Path, *, resumed: bool = False) -> dict[str, Any]:
    """``ktflow sft`` of the KT recipe in ``store``, measured (kt_vs_hf.measure), within the phase limit."""
    argv = work.ktflow("sft", str(work.recipe), store=store)
    # The slice trains every depth into one store: this run is the one the store did not hold before (a resumed run
    # goes on in its own directory, so it keeps it).
    earlier = frozenset() if resumed else frozenset(store.glob("runs/*"))
    with deadline(PHASE_LIMIT_S) as timer:
        try:
            # A resumed run logs only the steps after its checkpoint: its first one holds the load.
            result = measure(argv, env=work.env(), log=work.results / f"{name}.log", warmup=0 if resumed else 1,
                             trainer_log=lambda: _trainer_log_under(store, earlier),
                             child_marker="llamafactory-cli", skip_existing=resumed)
            result["outcome"] = "trained"
        except SystemExit as exc:
            result = {"outcome": "failed", "error": str(exc)[-4000:], "command": argv}
    if timer["fired"]:
        result["outcome"] += f" (killed at the phase limit, {PHASE_LIMIT_S} s)"
    if result.get("step_logged_at_s"):
        result.update(_step_figures(result, work.save_steps(store)))
    adapter = work.published(store)
    result["adapter"] = adapter_facts(adapter) if adapter else {"present": False}
    _collect_run(store, work.results / f"run-{name}", earlier)
    result["free_disk_gb_after"] = free_disk_gb(work.root)
    return result


def predicted(work: Work, store: Path) -> dict[str, Any]:
    """``ktflow plan``'s SFT line for this run (its GPUs, threads, records), made before it runs."""
    done = subprocess.run(work.ktflow("plan", str(work.recipe), "--json", store=store), env=work.env(), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    try:
        plan = json.loads(done.stdout)
    except ValueError:
        return {"error": f"ktflow plan exited {done.returncode}: {done.stderr[-1500:]}"}
    sft = next((s for s in plan.get("stages", []) if s["stage"] == "sft"), {})
    return {"step_s": sft.get("step_seconds"), "seconds": sft.get("seconds"), "gpus": sft.get("gpus"),
            "gpu_gib_per_gpu": round(sft.get("gpu_bytes", 0) / 2**30, 2),
            "ram_gib": round(sft.get("ram_bytes", 0) / 2**30, 2), "time_basis": sft.get("time_basis"),
            "reason": sft.get("reason"), "fits": sft.get("fits"), "problems": sft.get("problems")}


def phase_sft(work: Work) -> int:
    store, name = work.sft_store, work.sft_name
    if work.published(store) is not None and (work.results / f"{name}.json").is_file():
        print(f"{name}: already trained and measured ({work.results / f'{name}.json'}); delete {store} to measure again")
        return 0
    work.results.mkdir(parents=True, exist_ok=True)
    forecast = predicted(work, store)
    print(f"{name}: predicted {json.dumps(forecast)}", flush=True)
    result = measured_sft(work, name, store)
    result.update(model=model_facts(work.model), predicted=forecast, gpus=work.gpus, threads=work.threads)
    work.save(name, result)
    return 0 if result["outcome"] == "trained" else 1


def plain_llamafactory(work: Work, store: Path) -> dict[str, Any]:
    """Plain LlamaFactory (HuggingFace backend) on the INT4 checkpoint itself, by hand: the train.yaml
    ``ktflow sft --dry-run`` renders for gpu_host/big-hf.yaml with the model pointed at the INT4 source
    (ktflow itself would train a BF16 copy, which a 64 GiB disk cannot hold), run with a time limit and
    a host-RSS guard. Nothing about the outcome is assumed: how far it got is read from its log."""
    import yaml

    out = work.root / "hf-attempt"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    dry = subprocess.run(work.ktflow("sft", str(RECIPES["hf"]), "--dry-run", "--json", store=store),
                         env=work.env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    if dry.returncode != 0:
        return {"outcome": "not started: ktflow sft --dry-run failed", "stderr": dry.stderr[-3000:]}
    plan = json.loads(dry.stdout)
    cfg = dict(plan["train_config"], model_name_or_path=str(work.model), output_dir=str(out / "output"),
               dataset_dir=str(out / "dataset"))
    data = subprocess.run([str(work.ktflow_python), str(REPO / "benchmarks/kt_vs_hf.py"), "_prepare_data",
                           str(RECIPES["hf"]), json.dumps(work.sets(store)), cfg["dataset_dir"]],
                          env=work.env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    if data.returncode != 0:
        return {"outcome": "not started: preparing the data failed", "stderr": data.stderr[-3000:]}
    (out / "train.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    argv = [str(out / "train.yaml") if a.endswith(".yaml") else a for a in plan["launch"]]
    result = run_watched(argv, env={**work.env(), **plan["env"]}, log=work.results / "hf-plain.log",
                         limit_s=HF_ATTEMPT_LIMIT_S, trainer_log=lambda: out / "output" / "trainer_log.jsonl",
                         markers=HF_MARKERS)
    result["train_yaml"] = cfg
    shutil.rmtree(out / "output", ignore_errors=True)  # checkpoints, if it ever trained
    return result


def toolchain_versions(python: Path) -> dict[str, str | None]:
    """What the plain attempt loads with (compressed-tensors decides whether transformers can decode INT4)."""
    code = ("import json, importlib.metadata as m\nout = {}\n"
            "for p in ('torch', 'transformers-kt', 'transformers', 'llamafactory-kt', 'compressed-tensors'):\n"
            "    try: out[p] = m.version(p)\n    except m.PackageNotFoundError: out[p] = None\nprint(json.dumps(out))")
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-500:]}


def phase_hf(work: Work) -> int:
    """What plain LoRA SFT does with the same model: ktflow's preflight (doctor, sft), then the real thing."""
    store = work.root / "store"
    work.results.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"model": model_facts(work.model), "toolchain": toolchain_versions(work.python)}
    doctor = subprocess.run(work.ktflow("doctor", "--recipe", str(RECIPES["hf"]), "--json", store=store),
                            env=work.env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    stages = json.loads(doctor.stdout).get("stages", []) if doctor.stdout.strip().startswith("{") else []
    doc["doctor"] = {"rc": doctor.returncode, "sft": next((s for s in stages if s["stage"] == "sft"), None),
                     "stderr": doctor.stderr[-2000:]}
    refused = run_watched(work.ktflow("sft", str(RECIPES["hf"]), store=store), env=work.env(),
                          log=work.results / "hf-ktflow-sft.log", limit_s=240)
    doc["ktflow_sft"] = {k: refused[k] for k in ("rc", "outcome", "wall_s", "error_line", "peak_gpu_mib",
                                                  "peak_host_rss_gib")}
    doc["ktflow_sft"]["log_tail"] = refused["log_tail"][-12:]
    shutil.rmtree(store / "bf16", ignore_errors=True)  # what a refused (or killed) dequantize left
    doc["plain_llamafactory"] = plain_llamafactory(work, store)
    work.save("hf", doc)
    return 0  # whatever happened is the result


def phase_convert(work: Work) -> int:
    adapter = work.published(work.sft_store)
    if adapter is None:
        print(f"convert: no published adapter under {work.sft_store}: run the sft phase first")
        return 1
    out = work.root / "converted"
    shutil.rmtree(out, ignore_errors=True)
    argv = work.ktflow("convert-lora", str(adapter), str(out), "--base", str(work.model), "--serve-python",
                       str(work.python))
    result = run_watched(argv, env=work.env(), log=work.results / "convert.log", limit_s=PHASE_LIMIT_S)
    result["converted"] = converted_facts(out)
    work.save("convert", result)
    return 0 if result["rc"] == 0 else 1


def converted_facts(out: Path) -> dict[str, Any]:
    from ktflow.formats.safetensors_io import read_header

    weights = out / "adapter_model.safetensors"
    if not weights.is_file():
        return {"present": False}
    names = list(read_header(weights).tensors)
    config = json.loads((out / "adapter_config.json").read_text())
    return {"tensors": len(names), "expert_tensors": sum(".experts." in n for n in names), "bytes": weights.stat().st_size,
            "target_modules": config.get("target_modules"), "r": config.get("r"), "lora_alpha": config.get("lora_alpha")}


def _last_step(trainer_log: Path | None) -> int:
    if trainer_log is None or not trainer_log.is_file():
        return 0
    steps = [json.loads(line).get("current_steps", 0) for line in trainer_log.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def phase_kill(work: Work) -> int:
    """ktflow sft in a fresh store, killed (-9, the whole process group) once its first checkpoint is
    complete (trainer_state.json is the last file a checkpoint gets) and a later step is logged: what a
    crash mid-run leaves for the rerun (resume phase). At reduced size a step takes a fraction of a
    second, so the kill comes as soon as the checkpoint is complete, before a second one is written."""
    store = work.root / "store-kill"
    shutil.rmtree(store, ignore_errors=True)
    first = work.save_steps(store)
    log = work.results / "kill.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(work.ktflow("sft", str(work.recipe), store=store), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=work.env(), cwd=REPO,
                                start_new_session=True)
        sampler = Sampler(proc.pid, lambda: _trainer_log_under(store), "llamafactory-cli")
        outcome = "kill point not reached"
        while sampler.now() < PHASE_LIMIT_S - 30:
            trainer_log = _trainer_log_under(store)
            checkpoint = trainer_log.parent / f"checkpoint-{first}" if trainer_log else None
            complete = checkpoint is not None and (checkpoint / "trainer_state.json").is_file()
            if complete and (work.size == "reduced" or _last_step(trainer_log) > first):
                outcome = f"killed after checkpoint-{first}"
                break
            if proc.poll() is not None:
                outcome = f"training ended (exit {proc.returncode}) before the kill point"
                break
            time.sleep(0.05)
        killed_at = sampler.now()
        _kill_group(proc.pid)
        proc.wait()
        sampler.stop()
    trainer_log = _trainer_log_under(store)
    doc = {"outcome": outcome, "killed_at_s": round(killed_at, 1), "last_step_logged": _last_step(trainer_log),
           "output_listing": sorted(p.name for p in trainer_log.parent.iterdir()) if trainer_log else [],
           "peak_gpu_mib": None if sampler.gpu_peak is None else sampler.gpu_peak - (sampler.gpu_baseline or 0),
           "peak_host_rss_gib": round(sampler.peak_rss / 2**30, 2), "log_tail": _tail(log, 15)}
    if trainer_log and trainer_log.is_file():
        shutil.copy2(trainer_log, work.results / "kill-trainer_log.jsonl")
    work.save("kill", doc)
    return 0 if outcome.startswith("killed after") else 1


def _losses_by_step(trainer_log: Path) -> dict[int, float]:
    """Loss per step; a resumed run logs the steps after its checkpoint again: the later line wins."""
    rows = [json.loads(line) for line in trainer_log.read_text().splitlines() if '"loss"' in line]
    return {row["current_steps"]: row["loss"] for row in rows if row.get("loss") is not None}


def phase_resume(work: Work) -> int:
    """The same ``ktflow sft`` command again, on the killed run's store: it must resume, not restart."""
    store = work.root / "store-kill"
    if not (work.results / "kill.json").is_file() or _trainer_log_under(store) is None:
        print("resume: no killed run to resume: run the kill phase first (on the same machine)")
        return 1
    result = measured_sft(work, "resume", store, resumed=True)
    flat = "".join((work.results / "resume.log").read_text(errors="replace").split())  # rich wraps long paths
    match = re.search(r"resumedfrom(\S*?checkpoint-\d+)", flat)
    result["resumed_from"] = match.group(1) if match else None
    resumed_log, clean_log = work.results / "run-resume/trainer_log.jsonl", work.results / "run-sft/trainer_log.jsonl"
    if resumed_log.is_file() and clean_log.is_file():
        resumed, clean = _losses_by_step(resumed_log), _losses_by_step(clean_log)
        shared = sorted(set(resumed) & set(clean))
        result["vs_uninterrupted"] = {
            "steps": shared, "resumed_losses": [resumed[s] for s in shared],
            "uninterrupted_losses": [clean[s] for s in shared],
            "equal_steps": sum(resumed[s] == clean[s] for s in shared),
            "max_abs_diff": max((abs(resumed[s] - clean[s]) for s in shared), default=None)}
    work.save("resume", result)
    return 0 if result["outcome"] == "trained" and result["resumed_from"] else 1


def serve_sets(work: Work, method: str, serve_python: Path | None = None) -> list[str]:
    """The serving recipe's overrides: the sft phase's (same run key), the serving toolchain (default: the
    serving bundle's), the method."""
    return [*work.sets(work.sft_store), f"toolchains.serve.python={serve_python or work.serve_python}",
            f"serving.kt_method={method}"]


def phase_serve_prep(work: Work) -> int:
    """What ``ktflow serve`` makes before starting sglang-kt, made here (timed, RSS sampled) so the serve calls
    start the server at once: the converted adapter; for AMXINT8, quantize-int8 of the INT4 checkpoint itself
    and kt-kernel's ``.kt`` layout of it (the adapter carries an expert LoRA); the model view sglang-kt loads.
    Runs in the training toolchain (kt-kernel 0.7.2 there quantizes as the serving one does)."""
    doc: dict[str, Any] = {"free_disk_gb_before": free_disk_gb(work.root)}
    for method in work.methods:
        argv = [str(work.ktflow_python), __file__, "_serve_prep", json.dumps(serve_sets(work, method, work.python)),
                str(work.serve_recipe)]
        made = run_watched(argv, env=work.env(), log=work.results / f"serve-prep-{method}.log", limit_s=PHASE_LIMIT_S)
        doc[method] = {k: made[k] for k in ("rc", "outcome", "wall_s", "peak_host_rss_gib", "error_line")}
        doc[method]["made"] = next((json.loads(line[len("PREPARED "):]) for line in reversed(made["log_tail"])
                                    if line.startswith("PREPARED ")), None)
        doc[method]["free_disk_gb_after"] = free_disk_gb(work.root)
        if made["rc"] != 0:
            doc[method]["log_tail"] = made["log_tail"]
            work.save("serve-prep", doc)
            return 1
    work.save("serve-prep", doc)
    return 0


def child_serve_prep(sets_json: str, serve_recipe: str) -> int:
    """In the toolchain: ``ktflow serve``'s own preparation (ktflow.cli.serving.cmd_serve up to the launch)."""
    from ktflow.cli.serving import _served_adapter
    from ktflow.recipe import load_recipe
    from ktflow.stages.promotion import serving_dir
    from ktflow.stages.serve.sglang.inputs import sglang_inputs
    from ktflow.stages.weights import ensure_serving_weights, ensure_source, ensure_training_weights
    from ktflow.store import tree_bytes

    recipe = load_recipe(Path(serve_recipe), json.loads(sets_json))
    timings: dict[str, float] = {}
    started = time.perf_counter()
    source = ensure_source(recipe)
    trained_on = ensure_training_weights(recipe, source=source)
    model_dir, kt_weights = ensure_serving_weights(recipe, source_dir=source,
                                                   bf16_dir=trained_on if trained_on != source else None, log=print)
    timings["weights_s"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    adapter = _served_adapter(recipe, trained_on)  # the SFT run's adapter through convert-lora, as `ktflow serve`
    timings["convert_s"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    view, kt_dir = sglang_inputs(recipe, model_dir=model_dir, kt_weight_dir=kt_weights, adapter_dir=adapter,
                                 record_dir=serving_dir(recipe), log=print)
    timings["sglang_inputs_s"] = round(time.perf_counter() - started, 1)
    sizes = {str(p): round(tree_bytes(p) / 1e9, 2) for p in {kt_weights, kt_dir, view}}
    print("PREPARED " + json.dumps({"method": recipe.serving.kt_method, "model_dir": str(model_dir),
                                    "kt_weights": str(kt_weights), "kt_weight_path": str(kt_dir), "model_view": str(view),
                                    "adapter": str(adapter), "gb_on_disk": sizes, **timings}), flush=True)
    return 0


def phase_serve(work: Work) -> int:
    """Per method: ``ktflow serve`` of the serving recipe as a user starts it (gpu_host/serve_check.py run --via
    cli: ready, health gate, smoke test, chat and completions through the openai client), then
    benchmarks/serve_load.py against it (TTFT, prefill and decode tokens/s at concurrency 1, 4 and 16, GPU memory,
    the server's RSS, decode against its bandwidth floor), then ``ktflow serve --stop``. Run in the serving
    toolchain with run.sh's serving environment (run.sh serve-big)."""
    status = 0
    for method in work.methods:
        out = work.results / f"serve-{method}"
        shutil.rmtree(out, ignore_errors=True)
        argv = [str(work.serve_python), str(REPO / "gpu_host" / "serve_check.py"), "run", "--via", "cli",
                "--recipe", str(work.serve_recipe), "--model", str(work.model), "--kt-weights", str(work.model),
                "--adapter", str(work.root / "converted"), "--records", str(work.data), "--out", str(out),
                "--n-records", "2", "--load-json", str(work.results / f"serve-load-{method}.json")]
        if work.serve_load_args:
            argv += ["--load-args", work.serve_load_args]
        for item in serve_sets(work, method):
            argv += ["--set", item]
        ran = run_watched(argv, env=work.env(), log=work.results / f"serve-{method}.log", limit_s=PHASE_LIMIT_S)
        checked = out / "results.json"
        doc = {k: ran[k] for k in ("rc", "outcome", "wall_s", "error_line")}
        if checked.is_file():
            got = json.loads(checked.read_text())
            doc.update({k: got.get(k) for k in ("ready_s", "gpu_used_mib_before", "gpu_used_mib_ready",
                                                 "gpu_used_mib_after", "stop_s", "leftover_processes", "error",
                                                 "read_bandwidth", "load", "served_model_dir")})
        load = work.results / f"serve-load-{method}.json"
        if load.is_file():
            bench = json.loads(load.read_text())
            doc["levels"] = [{k: lv.get(k) for k in (
                "concurrency", "requests", "errors", "wall_s", "ttft_s", "prefill_tokens_per_s_median",
                "decode_tokens_per_s_median", "output_tokens_per_s", "peak_gpu_mem_used_mib", "peak_server_rss_bytes")}
                for lv in bench.get("levels", [])]
            doc["floor"], doc["decode_vs_floor"] = bench.get("floor"), bench.get("decode_vs_floor")
        if ran["rc"] != 0:
            doc["log_tail"] = ran["log_tail"]
            status = 1
        work.save(f"serve-{method}", doc)
    return status


REPORT_KEYS = {
    "fixture": ("parameters", "bf16_gb", "on_disk_gb", "gpu_total_mib", "bf16_over_gpu", "hf_sft_gpu_estimate_gib"),
    "sft": ("outcome", "wall_s", "prelaunch_s", "load_s", "steady_step_s", "steady_step_no_save_s",
            "steady_step_with_save_s", "tokens_per_s_steady", "tokens_per_s_no_save", "tokens_per_s_llamafactory",
            "peak_gpu_mib", "peak_host_rss_gib", "post_s", "steps", "losses"),
    "convert": ("outcome", "wall_s", "peak_host_rss_gib", "converted"),
    "kill": ("outcome", "killed_at_s", "last_step_logged"),
    "resume": ("outcome", "resumed_from", "wall_s", "load_s", "steps", "vs_uninterrupted"),
}


def phase_report(work: Work) -> int:
    for name, keys in REPORT_KEYS.items():
        path = work.results / f"{name}.json"
        if path.is_file():
            doc = json.loads(path.read_text())
            print(f"{name}: " + json.dumps({k: doc.get(k) for k in keys}))
    hf = work.results / "hf.json"
    if hf.is_file():
        doc = json.loads(hf.read_text())
        plain = doc.get("plain_llamafactory", {})
        print("hf: " + json.dumps({"doctor_rc": doc["doctor"]["rc"], "ktflow_sft": doc["ktflow_sft"]["error_line"],
                                   "plain": {k: plain.get(k) for k in ("outcome", "wall_s", "markers_s", "error_line",
                                                                      "peak_gpu_mib", "peak_host_rss_gib",
                                                                      "steps_logged")}}))
    return 0


# --------------------------------------------------------------------------- children (run with the toolchain python)


def child_reduced_fixture(out: str) -> int:
    from ktflow.fixtures.checkpoints import FixtureSpec, make_fixture
    from ktflow.fixtures.stream import MoeDims

    make_fixture(FixtureSpec(kind="kimi-k2.5", size="bigger-than-gpu"), out, dims=MoeDims(**REDUCED_DIMS))
    return 0


def child_data(folder: str) -> int:
    from ktflow.demo import write_demo_dataset

    write_demo_dataset(Path(folder), train=48, eval=8)
    return 0


PHASES: dict[str, Callable[[Work], int]] = {
    "fixture": phase_fixture, "sft": phase_sft, "hf": phase_hf, "convert": phase_convert, "kill": phase_kill,
    "resume": phase_resume, "report": phase_report, "serve-prep": phase_serve_prep, "serve": phase_serve,
}


def default_python() -> Path:
    bundle = BUILD / "bundle" / "bin" / "python"
    return bundle if bundle.exists() else REPO / ".venv-kt-train" / "bin" / "python"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=(*PHASES, "_reduced_fixture", "_data", "_serve_prep"))
    parser.add_argument("args", nargs="*")
    parser.add_argument("--size", choices=("full", "reduced"), default="full")
    parser.add_argument("--python", default=str(default_python()), help="the training toolchain's python (recipes)")
    parser.add_argument("--ktflow-python", default=None, help="the python that runs ktflow (default: --python)")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="a further recipe override")
    parser.add_argument("--trainer", choices=("kt", "hf"), default="kt",
                        help="the recipe of the sft, kill and resume phases (hf: a CPU rehearsal of this harness)")
    parser.add_argument("--gpus", type=int, default=1, help="sft: train on N GPUs (sft.gpus=N, the batch kept)")
    parser.add_argument("--threads", type=int, default=None, help="sft: KT CPU threads (kt_config.kt_num_threads)")
    parser.add_argument("--as-written", action="store_true",
                        help="sft: the batch split as the recipe writes it, not the shaper's (its own store)")
    parser.add_argument("--serve-python", default=str(BUILD / "serve" / "bin" / "python"),
                        help="the serving toolchain's python (serve phases)")
    parser.add_argument("--methods", default=None, help=f"serve phases: comma-separated (default {','.join(SERVE_METHODS)})")
    args = parser.parse_args()
    if args.phase == "_reduced_fixture":
        return child_reduced_fixture(args.args[0])
    if args.phase == "_data":
        return child_data(args.args[0])
    if args.phase == "_serve_prep":
        return child_serve_prep(args.args[0], args.args[1])
    return PHASES[args.phase](Work(args))


if __name__ == "__main__":
    sys.exit(main())
