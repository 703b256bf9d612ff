"""KT vs plain LoRA SFT at DeepSeek-V2-Lite scale, and ktflow's overhead on the KT path.

The seeds' write-up reports, for LoRA BF16 SFT of DeepSeek-V2-Lite on 4090-class GPUs + an AMX
Xeon: HuggingFace 303.58 tokens/s and 32.12 GB GPU memory, KTransformers 530.38 tokens/s and
6.08 GB. This script measures the same comparison on one host, in one work directory:

    a. ``hf``:     plain LlamaFactory, HuggingFace backend, everything on the GPU
                   (benchmarks/recipes/v2-lite-hf.yaml rendered by ``ktflow sft --dry-run``, run by hand);
    b. ``kt``:     bare LlamaFactory-kt with the KT backend: the command ``ktflow sft`` would run
                   (benchmarks/recipes/v2-lite-kt.yaml rendered by ``ktflow sft --dry-run``), run by hand;
    c. ``ktflow``: ``ktflow sft benchmarks/recipes/v2-lite-kt.yaml`` on a fresh store (the same config);
    ``ktflow-hf``: the same for leg a's recipe (c against a: ktflow's overhead where no KT can run).
    ``kt-profile`` (optional): leg b's config in-process with ``KT_SFT_PROFILE=1`` and KT's own timers,
                   reset after step ``--warmup`` and read after the last: how much of a step the
                   CPU experts take.

Commands, on the GPU host (gpu_host/README: ``bash gpu_host/run.sh setup`` unpacks the toolchain),
from the repository root; each phase fits one device call (10 min), and the work directory
(build/bench-kt-vs-hf/<size>-<arch>, ignored) persists between calls on a warm machine:

    PY=build/gpu-host/bundle/bin/python
    $PY benchmarks/kt_vs_hf.py prepare             # model (31 GB, ~2 min) + data + rendered plans
    $PY benchmarks/kt_vs_hf.py run hf kt ktflow    # the three legs (or one at a time)
    $PY benchmarks/kt_vs_hf.py run kt-profile
    $PY benchmarks/kt_vs_hf.py report              # the table and the ratios; --json PATH as well

``--size tiny`` (a 4-layer model) runs the same code on any box; on a CPU-only box only the
``hf`` leg can run (LlamaFactory trains on the CPU there; set ``--gpus 0``).

What is measured, per leg, from outside the training process (psutil and ``nvidia-smi --loop-ms``):
- wall: the whole command; load (an estimate): start -> the trainer's first logged step, less
  the second step's duration standing in for the first's (imports, model load, KT weight
  packing, data);
- steady step: the median interval between consecutive ``trainer_log.jsonl`` lines (each
  stamped when it appears; logging_steps is 1) for steps ``--warmup + 2`` to the last: step 1's
  duration cannot be told apart from loading, and ``--warmup`` more steps are left out;
- tokens/s: LlamaFactory's own (``throughput`` of its last log line: tokens seen / train time),
  and trained tokens / wall time of the same steady steps (``total_tokens`` deltas over the
  stamped intervals);
- peak GPU: ``memory.used`` of the GPU, sampled every 100 ms, minus its value before the leg
  (CUDA context included);
- peak host RSS: the sum over the leg's process tree, sampled every 250 ms (shared pages of a
  memory-mapped checkpoint count once per process that maps them);
- for ``ktflow``: pre-launch (start -> the launcher child seen) and post (its exit -> exit).
``--steps N`` overrides the recipes' ``max_steps`` (8) in every leg.
The data are synthetic dialogues (``write_dialogues``), a few hundred tokens each; the report
prints their token lengths under the model's tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RECIPES = {"hf": REPO / "benchmarks/recipes/v2-lite-hf.yaml", "kt": REPO / "benchmarks/recipes/v2-lite-kt.yaml"}
LEGS = ("hf", "kt", "ktflow", "ktflow-hf", "kt-profile")
SEEDS = {"hf": {"tokens_per_s": 303.58, "gpu_gb": 32.12}, "kt": {"tokens_per_s": 530.38, "gpu_gb": 6.08}}
RECORDS = 256
ARCHITECTURES = {"v2": "DeepseekV2ForCausalLM", "v3": "DeepseekV3ForCausalLM"}

sys.path.insert(0, str(REPO / "benchmarks"))
from _common import host_info  # noqa: E402


def default_python() -> Path:
    bundle = REPO / "build/gpu-host/bundle/bin/python"
    return bundle if bundle.exists() else REPO / ".venv-train/bin/python"


# --------------------------------------------------------------------------- data


_WORDS = ("the model expert router token layer cache weight adapter gradient memory tensor shard index config "
          "template answer question kitten purr soft warm window sunlight nap tail whisker paw milk fish "
          "garden morning evening quiet happy curious gentle small large bright little very really always "
          "often never maybe today tomorrow because while after before under over with without into from").split()
_OPENERS = ("Could you explain", "Please tell me", "I would like to know", "Describe", "Why does")


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))]
    return words[0].capitalize() + " " + " ".join(words[1:]) + rng.choice((".", ".", "!", "?"))


def write_dialogues(path: Path, n: int, seed: int = 0) -> None:
    """``n`` synthetic chat records (OpenAI messages): a short question, a long stylized answer
    ending in "nya~", as in NekoQA-10K's catgirl dialogues (a few hundred tokens each)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        question = f"{rng.choice(_OPENERS)} " + " ".join(_sentence(rng, 6, 14) for _ in range(rng.randint(1, 3)))
        answer = " ".join(_sentence(rng, 8, 18) for _ in range(rng.randint(4, 8))) + " nya~"
        lines.append(json.dumps({"messages": [{"role": "user", "content": question},
                                              {"role": "assistant", "content": answer}]}))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


# --------------------------------------------------------------------------- children (run with the training python)


def child_token_lengths(model: Path, data: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    texts = [tok.apply_chat_template(json.loads(line)["messages"], tokenize=False) for line in data.read_text().splitlines()]
    lengths = sorted(len(ids) for ids in tok(texts, add_special_tokens=False).input_ids)
    return {"records": len(lengths), "mean": round(statistics.mean(lengths), 1), "min": lengths[0],
            "median": lengths[len(lengths) // 2], "max": lengths[-1]}


def child_toolchain() -> dict[str, Any]:
    """Versions as the training toolchain sees them (the -kt forks or upstream, whichever is there)."""
    from importlib import metadata

    versions: dict[str, Any] = {}
    for names in (("torch",), ("transformers-kt", "transformers"), ("llamafactory-kt", "llamafactory"),
                  ("peft-kt", "peft"), ("accelerate-kt", "accelerate"), ("kt-kernel",)):
        for name in names:
            try:
                versions[name] = metadata.version(name)
                break
            except metadata.PackageNotFoundError:
                continue
    try:
        import torch

        versions["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return versions


def child_prepare_data(recipe_file: Path, overrides: list[str], dataset_dir: Path) -> None:
    """Publish the recipe's dataset where its rendered plan reads it, as ``ktflow sft`` would."""
    from ktflow.formats.dataset import prepare_dataset
    from ktflow.recipe import load_recipe

    recipe = load_recipe(recipe_file, overrides)
    model_dir = recipe.source.local_path.absolute() if recipe.source.local_path else None
    prepare_dataset(recipe.dataset, dataset_dir, template=recipe.sft.template, model_dir=model_dir)


def child_profile_train(train_yaml: Path, out: Path, warmup: int) -> None:
    """LlamaFactory's own entry (``run_exp``) with one callback that reads KT's per-layer timers
    after ``warmup`` steps and at the end; ``KT_SFT_PROFILE=1`` is set before the model exists."""
    import yaml
    from kt_kernel.sft import collect_kt_sft_profile, format_kt_sft_profile, reset_kt_sft_profile
    from llamafactory.train.tuner import run_exp
    from transformers import TrainerCallback

    class KtTimers(TrainerCallback):
        t0 = 0.0

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == warmup:
                reset_kt_sft_profile(model)
                self.t0 = time.perf_counter()
            elif state.global_step == state.max_steps:
                wall = time.perf_counter() - self.t0
                profile = collect_kt_sft_profile(model)
                out.write_text(json.dumps({"steps": state.global_step - warmup, "wall_s": wall, "profile": profile,
                                           "table": format_kt_sft_profile(profile)}))

    run_exp(yaml.safe_load(train_yaml.read_text()), callbacks=[KtTimers()])


# --------------------------------------------------------------------------- measuring a leg (no torch here)


class Sampler:
    """Peak RSS of a process tree, peak GPU memory, when marked children run, and when each
    ``trainer_log.jsonl`` line appears, all from outside the leg."""

    def __init__(self, pid: int, trainer_log: Callable[[], Path | None], child_marker: str | None,
                 skip_existing: bool = False) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.t0 = time.perf_counter()
        self.trainer_log, self.child_marker = trainer_log, child_marker
        # A resumed run appends to the trainer log of the run it resumes: stamp only the lines it adds.
        existing = trainer_log() if skip_existing else None
        self.log_start = existing.stat().st_size if existing is not None and existing.is_file() else 0
        self.peak_rss = 0
        # every GPU's memory.used, before and at its peak (a run on several GPUs uses several; [] without nvidia-smi)
        self.gpu_baselines = _gpus_used_mib()
        self.gpu_peaks = list(self.gpu_baselines)
        self.child_span: list[float] = []
        self.stamps: list[tuple[float, dict[str, Any]]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._tree, daemon=True),
                         threading.Thread(target=self._log, daemon=True)]
        self._smi = None
        if self.gpu_baselines:
            self._smi = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                          "--loop-ms=100"], stdout=subprocess.PIPE, text=True)
            self._threads.append(threading.Thread(target=self._gpu, daemon=True))
        for t in self._threads:
            t.start()

    @property
    def gpu_baseline(self) -> int | None:
        """GPU 0's memory.used before the leg (None without nvidia-smi)."""
        return self.gpu_baselines[0] if self.gpu_baselines else None

    @property
    def gpu_peak(self) -> int | None:
        """GPU 0's peak memory.used during the leg."""
        return self.gpu_peaks[0] if self.gpu_peaks else None

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _tree(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self.proc, *self.proc.children(recursive=True)]
            except psutil.Error:
                break
            rss = 0
            for p in procs:
                try:
                    rss += p.memory_info().rss
                    if self.child_marker and p.pid != self.proc.pid and self.child_marker in " ".join(p.cmdline()):
                        self.child_span = [self.child_span[0] if self.child_span else self.now(), self.now()]
                except psutil.Error:
                    continue
            self.peak_rss = max(self.peak_rss, rss)
            self._stop.wait(0.25)

    def _gpu(self) -> None:
        assert self._smi is not None and self._smi.stdout is not None
        n = len(self.gpu_peaks)
        i = 0  # each tick prints one line per GPU, in index order
        for line in self._smi.stdout:
            try:
                used = int(line.strip())
            except ValueError:
                continue
            self.gpu_peaks[i % n] = max(self.gpu_peaks[i % n], used)
            i += 1

    def _log(self) -> None:
        offset = self.log_start
        while not self._stop.is_set():
            path = self.trainer_log()
            if path is not None and path.is_file():
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    chunk = fh.read()
                complete = chunk[: chunk.rfind(b"\n") + 1]
                offset += len(complete)
                for line in complete.decode().splitlines():
                    try:
                        self.stamps.append((self.now(), json.loads(line)))
                    except ValueError:
                        continue
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        if self._smi is not None:
            self._smi.terminate()
            self._smi.wait()
        for t in self._threads:
            t.join(timeout=5)


def _gpus_used_mib() -> list[int]:
    """memory.used (MiB) of every GPU, in index order; [] without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True)
    return [int(v) for v in out.stdout.split()] if out.returncode == 0 else []


def measure(argv: list[str], *, env: dict[str, str], log: Path, trainer_log: Path | Callable[[], Path | None],
            warmup: int, child_marker: str | None = None, skip_existing: bool = False) -> dict[str, Any]:
    """Run one leg and derive its figures (see the module docstring).

    Steady figures cover logged steps ``warmup + 2`` to the last: a line is stamped when it
    appears, so a step's duration is the gap to the line before it, and step 1 has none that
    can be told apart from loading. With ``skip_existing`` (a resumed run) the lines the trainer
    log already held at the start are not this leg's: only lines added later are stamped.
    """
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=REPO, start_new_session=True)
        try:
            find_log = trainer_log if callable(trainer_log) else (lambda: trainer_log)
            sampler = Sampler(proc.pid, find_log, child_marker, skip_existing=skip_existing)
            rc = proc.wait()
            wall = sampler.now()
            time.sleep(0.3)  # the log follower's last poll
            sampler.stop()
        finally:
            # An interrupted harness must not leave a trainer holding the GPU and 37 GiB for the next leg.
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if rc != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise SystemExit(f"{' '.join(argv[:3])} ... failed (exit {rc}); last output of {log}:\n{tail}")
    steps = [(t, rec) for t, rec in sampler.stamps if "current_steps" in rec and rec.get("loss") is not None]
    if len(steps) <= warmup + 1:
        raise SystemExit(f"{log}: {len(steps)} logged steps; --warmup {warmup} needs at least {warmup + 2}")
    times = [t for t, _ in steps]
    intervals = [b - a for a, b in zip(times[warmup:], times[warmup + 1:])]
    second_step = times[1] - times[0]
    last = steps[-1][1]
    tokens = [rec.get("total_tokens") for _, rec in steps]
    steady_tokens_per_s = None
    if all(isinstance(x, int) for x in tokens):
        steady_tokens_per_s = (tokens[-1] - tokens[warmup]) / (times[-1] - times[warmup])
    result = {
        "wall_s": round(wall, 1),
        # an estimate: start -> first logged step, less the second step's duration standing in for the first's
        "load_s": round(times[0] - second_step, 1),
        "first_step_logged_s": round(times[0], 1),
        "steps": last["current_steps"],
        "steady_steps": [steps[warmup + 1][1]["current_steps"], last["current_steps"]],
        "steady_step_s": round(statistics.median(intervals), 2),
        "steady_step_spread_s": [round(min(intervals), 2), round(max(intervals), 2)],
        "tokens_per_s_llamafactory": last.get("throughput"),
        "tokens_per_s_steady": None if steady_tokens_per_s is None else round(steady_tokens_per_s, 1),
        "total_tokens": last.get("total_tokens"),
        "losses": [rec["loss"] for _, rec in steps],
        "step_logged_at_s": [round(t, 2) for t in times],
        "steps_logged": [rec["current_steps"] for _, rec in steps],
        "tokens_logged": [rec.get("total_tokens") for _, rec in steps],
        "peak_gpu_mib": None if sampler.gpu_peak is None else sampler.gpu_peak - (sampler.gpu_baseline or 0),
        "peak_gpu_mib_per_gpu": [peak - base for peak, base in zip(sampler.gpu_peaks, sampler.gpu_baselines)] or None,
        "peak_host_rss_gib": round(sampler.peak_rss / 2**30, 2),
        "log": str(log.relative_to(REPO)) if log.is_relative_to(REPO) else str(log),
    }
    if child_marker and sampler.child_span:
        result["prelaunch_s"] = round(sampler.child_span[0], 2)
        result["post_s"] = round(wall - sampler.child_span[1], 2)
    return result


# --------------------------------------------------------------------------- phases


class Work:
    def __init__(self, args: argparse.Namespace) -> None:
        self.root = (Path(args.workdir) / f"{args.size}-{args.arch}").absolute()
        self.architecture = ARCHITECTURES[args.arch]
        self.python = Path(args.python).absolute()
        self.size, self.steps, self.warmup, self.gpus = args.size, args.steps, args.warmup, args.gpus
        self.extra_sets, self.tag = list(args.set or ()), args.tag
        self.model, self.data = self.root / "model", self.root / "data/train.jsonl"
        self.results = self.root / "results"

    def overrides(self, store: Path, leg: str) -> list[str]:
        sets = [f"source.local_path={self.model}", f"dataset.files=[{self.data}]", f"store.root={store}",
                f"toolchains.train.python={self.python}", f"toolchains.serve.python={self.python}"]
        if self.steps is not None:
            sets.append(f"sft.max_steps={self.steps}")
        if self.gpus is not None and leg == "hf":
            sets.append(f"sft.gpus={self.gpus}")
        return sets + self.extra_sets

    def env(self) -> dict[str, str]:
        return {**os.environ, "KTFLOW_SRC": str(REPO), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1"}

    def child(self, *argv: str) -> str:
        env = {**self.env(), "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([str(self.python), __file__, *argv], env=env, cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv[:2])} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
        return done.stdout

    def ktflow(self, *argv: str) -> str:
        done = subprocess.run([str(self.python), "-m", "ktflow.cli", *argv], env=self.env(), cwd=REPO,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"ktflow {' '.join(argv[:2])} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
        return done.stdout


def phase_prepare(work: Work) -> None:
    work.results.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    if not (work.model / "config.json").is_file():
        size = ["--full-size"] if work.size == "full" else ["--layers", "4", "--experts", "8"]
        work.ktflow("fixture", "deepseek-v2-lite", str(work.model), *size, "--architecture", work.architecture)
    model_s = time.perf_counter() - t
    if not work.data.is_file():
        write_dialogues(work.data, RECORDS)
    lengths = json.loads(work.child("_token_lengths", str(work.model), str(work.data)).strip().splitlines()[-1])
    for leg in ("hf", "kt"):
        render_plan(work, leg)
    total = sum(f.stat().st_size for f in work.model.glob("*.safetensors"))
    (work.results / "prepare.json").write_text(json.dumps(
        {"model_bytes": total, "model_s": round(model_s, 1), "token_lengths": lengths}, indent=2))
    print(f"model {total / 1e9:.1f} GB ({model_s:.0f} s), data {lengths}", flush=True)


def render_plan(work: Work, leg: str) -> dict[str, Any]:
    """``ktflow sft --dry-run --json`` of ``leg``'s recipe (with ``--set``), and its dataset
    published where the plan reads it, as ``ktflow sft`` would publish it."""
    store = work.root / "store-bare"
    plan = json.loads(work.ktflow("sft", str(RECIPES[leg]), "--dry-run", "--json",
                                  *[a for s in work.overrides(store, leg) for a in ("--set", s)]))
    dataset_dir = Path(plan["train_config"]["dataset_dir"])
    if not dataset_dir.is_dir():
        work.child("_prepare_data", str(RECIPES[leg]), json.dumps(work.overrides(store, leg)), str(dataset_dir))
    return plan


def _bare_argv(work: Work, leg: str, out_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The rendered plan of ``leg``, with its YAML files written in ``out_dir``: what ktflow would run."""
    import yaml

    plan = render_plan(work, leg)
    out_dir.mkdir(parents=True)
    (out_dir / "plan.json").write_text(json.dumps(plan, indent=2))
    cfg = dict(plan["train_config"], output_dir=str(out_dir / "output"))
    (out_dir / "train.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    if plan["accelerate_config"] is not None:
        (out_dir / "accelerate.yaml").write_text(yaml.safe_dump(plan["accelerate_config"], sort_keys=False))
    argv = [str(out_dir / Path(a).name) if a.endswith((".yaml", ".yml")) else a for a in plan["launch"]]
    env = {**work.env(), "PATH": f"{work.python.parent}{os.pathsep}{os.environ.get('PATH', '')}", **plan["env"]}
    return argv, env


def phase_run(work: Work, leg: str) -> None:
    stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{time.time_ns() // 1000 % 1000000:06d}"
    name = f"{leg}-{work.tag}" if work.tag else leg
    if leg in ("hf", "kt"):
        out_dir = work.root / "legs" / f"{name}-{stamp}"
        argv, env = _bare_argv(work, leg, out_dir)
        result = measure(argv, env=env, log=out_dir / "train.log", trainer_log=out_dir / "output/trainer_log.jsonl",
                         warmup=work.warmup)
        result["command"] = argv
    elif leg in ("ktflow", "ktflow-hf"):
        backend = "hf" if leg == "ktflow-hf" else "kt"
        store = work.root / f"store-{name}-{stamp}"  # fresh: no cache hit, data prepared again
        argv = [str(work.python), "-m", "ktflow.cli", "sft", str(RECIPES[backend]),
                *[a for s in work.overrides(store, backend) for a in ("--set", s)]]
        log = work.root / "legs" / f"{name}-{stamp}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        result = measure(argv, env=work.env(), log=log, trainer_log=lambda: _trainer_log_under(store),
                         warmup=work.warmup, child_marker="llamafactory-cli")
        result["command"] = argv
        result["run_dir"] = str(_trainer_log_under(store).parent.parent)
    else:  # kt-profile
        if work.warmup < 1:
            raise SystemExit("kt-profile needs --warmup 1 or more (KT's timers are reset after that step)")
        out_dir = work.root / "legs" / f"{name}-{stamp}"
        argv, env = _bare_argv(work, "kt", out_dir)
        profile_json = out_dir / "kt_profile.json"
        argv = argv[: argv.index("--no_python")] + [__file__, "_profile_train", str(out_dir / "train.yaml"),
                                                   str(profile_json), str(work.warmup)]
        env["KT_SFT_PROFILE"] = "1"
        result = measure(argv, env=env, log=out_dir / "train.log", trainer_log=out_dir / "output/trainer_log.jsonl",
                         warmup=work.warmup)
        if profile_json.is_file():
            shutil.copyfile(profile_json, work.results / f"{name}.raw.json")
            result["kt_profile_raw"] = f"{name}.raw.json"
            result["kt_timers"] = _summarize_profile(json.loads(profile_json.read_text()))
        else:
            result["kt_timers"] = "no profile written (see the log)"
    result["sets"] = work.extra_sets
    result["stamp"] = stamp
    # <leg>.json is the latest run of a leg (what report reads); every run is also kept in history/
    (work.results / "history").mkdir(parents=True, exist_ok=True)
    (work.results / "history" / f"{name}-{stamp}.json").write_text(json.dumps(result, indent=2))
    (work.results / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(f"{name}: {json.dumps({k: v for k, v in result.items() if k not in ('losses', 'command')})}", flush=True)


def _trainer_log_under(store: Path, earlier: Collection[Path] = ()) -> Path | None:
    """``ktflow sft`` names its run directory (a content key) itself: the newest one's log, leaving out the run
    directories in ``earlier`` (those the store held before this leg: a store that several models train into holds
    their finished logs, and until this leg's trainer writes its own the newest would be one of theirs)."""
    runs = sorted((p for p in store.glob("runs/*/output") if p.parent not in earlier), key=lambda p: p.stat().st_mtime)
    return runs[-1] / "trainer_log.jsonl" if runs else None


def _summarize_profile(doc: dict[str, Any]) -> dict[str, Any]:
    """Seconds per step that KT's MoE layers hold the step up, summed over layers (KT's wrapper
    timers), against the step's wall time: the rest is GPU work and the framework.

    Forward and backward block the step. The backward weight repack runs in the background
    (submitted ahead for the next layer); only its ``backward_repack_wait`` blocks, so the repack's
    total work is reported beside, not added in.
    """
    blocking = {"forward": "wrapper.tp.forward.total.total_ns", "backward": "wrapper.tp.backward.total.total_ns",
                "backward_repack_wait": "wrapper.weights.backward_repack_wait.total_ns"}
    background = {"backward_repack": "wrapper.weights.backward_repack.total_ns"}
    totals = dict.fromkeys([*blocking, *background], 0.0)
    calls = 0.0
    for raw in doc["profile"].get("layers", {}).values():
        for stage, key in (blocking | background).items():
            totals[stage] += raw.get(key, 0.0) / 1e9
        calls += raw.get("wrapper.weights.backward_repack.calls", 0.0)
    steps = max(1, doc["steps"])
    step_s = doc["wall_s"] / steps
    per_step = {k: round(v / steps, 2) for k, v in totals.items()}
    held = sum(per_step[k] for k in blocking)
    return {"profiled_steps": doc["steps"], "step_s": round(step_s, 2), "kt_moe_s_per_step": per_step,
            "kt_moe_blocking_s_per_step": round(held, 2), "kt_moe_share": round(held / step_s, 3) if step_s else None,
            "backward_repack_calls_per_step": calls / steps,
            "enabled": doc["profile"].get("enabled"), "table": doc["table"]}


def _cell(value: float | int | None) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) or abs(value) >= 1000 and value == int(value) else f"{value:.4g}"


def phase_report(work: Work, json_out: Path | None) -> int:
    results = {f.stem: json.loads(f.read_text()) for f in sorted(work.results.glob("*.json"))
               if f.stem not in ("prepare", "host") and not f.name.endswith(".raw.json")}
    for r in results.values():  # KT's timers are summarized again from the raw profile, if it was kept
        raw = work.results / r.get("kt_profile_raw", "-")
        if raw.is_file():
            r["kt_timers"] = _summarize_profile(json.loads(raw.read_text()))
    prep = json.loads((work.results / "prepare.json").read_text()) if (work.results / "prepare.json").is_file() else {}
    host = json.loads((work.results / "host.json").read_text()) if (work.results / "host.json").is_file() else {}
    hf, kt, kf = results.get("hf"), results.get("kt"), results.get("ktflow")

    def ratio(x: dict | None, y: dict | None, key: str) -> str:
        if not x or not y or not x.get(key) or not y.get(key):
            return "-"
        return f"{x[key] / y[key]:.2f}x"

    rows = [("LlamaFactory tokens/s", "tokens_per_s_llamafactory"), ("steady tokens/s", "tokens_per_s_steady"),
            ("steady step s", "steady_step_s"), ("load s (estimate)", "load_s"), ("wall s", "wall_s"),
            ("peak GPU MiB over idle", "peak_gpu_mib"), ("peak host RSS GiB", "peak_host_rss_gib"),
            ("steps run", "steps"), ("final loss", "final_loss")]
    for r in results.values():
        r["final_loss"] = r["losses"][-1] if r.get("losses") else None
    named = {"hf": "a HF", "kt": "b bare KT", "ktflow": "c ktflow", "ktflow-hf": "ktflow HF"}
    columns = [(named[leg], leg) for leg in named if leg in results] + \
        [(leg, leg) for leg in results if leg not in named and not leg.startswith("kt-profile")]
    pairs = [(label, x, y) for label, x, y in (("KT/HF", "kt", "hf"), ("c/b", "ktflow", "kt"),
                                               ("ktflow-hf/a", "ktflow-hf", "hf")) if x in results and y in results]
    pairs += [(f"{leg}/HF", leg, "hf") for _, leg in columns if leg not in named and "hf" in results]
    print(f"host: {host.get('gpu', '?')}; {host.get('cpu', '?')}, {host.get('physical_cores', '?')} cores")
    print(f"model: {prep.get('model_bytes', 0) / 1e9:.1f} GB; data (tokens per record): {prep.get('token_lengths')}")
    print(f"toolchain: {host.get('toolchain', '?')}")
    print("ratios are first/second of the pair named: for tokens/s above 1 favours the first, for times and memory "
          "below 1 does")
    print(f"{'':22}" + "".join(f"{name:>12}" for name, _ in columns) + "".join(f"{label:>13}" for label, *_ in pairs))
    for label, key in rows:
        cells = [_cell(results[leg].get(key)) for _, leg in columns]
        ratios = ["" if key in ("final_loss", "steps") else ratio(results[x], results[y], key) for _, x, y in pairs]
        print(f"{label:22}" + "".join(f"{c:>12}" for c in cells) + "".join(f"{r:>13}" for r in ratios))
    summary: dict[str, Any] = {"host": host, "prepare": prep, "legs": results}
    if kt and kf:
        diffs = [abs(a - b) for a, b in zip(kt["losses"], kf["losses"])]
        summary["c_vs_b"] = {"max_loss_diff": max(diffs) if diffs else None, "steps_compared": len(diffs),
                             "wall_ratio": round(kf["wall_s"] / kt["wall_s"], 4),
                             "wall_minus_prelaunch_ratio": round((kf["wall_s"] - kf.get("prelaunch_s", 0.0))
                                                                 / kt["wall_s"], 4),
                             "prelaunch_s": kf.get("prelaunch_s"), "post_s": kf.get("post_s")}
        print(f"c vs b: losses over {len(diffs)} steps differ by at most {summary['c_vs_b']['max_loss_diff']}; "
              f"wall c/b {summary['c_vs_b']['wall_ratio']}, pre-launch {kf.get('prelaunch_s')} s, "
              f"post {kf.get('post_s')} s; (c - pre-launch)/b {summary['c_vs_b']['wall_minus_prelaunch_ratio']}")
    if hf and kt:
        summary["kt_vs_hf"] = {
            "throughput_ratio": ratio(kt, hf, "tokens_per_s_llamafactory"),
            "gpu_ratio": ratio(kt, hf, "peak_gpu_mib"),
            "seeds_throughput_ratio": f"{SEEDS['kt']['tokens_per_s'] / SEEDS['hf']['tokens_per_s']:.2f}x",
            "seeds_gpu_ratio": f"{SEEDS['kt']['gpu_gb'] / SEEDS['hf']['gpu_gb']:.2f}x",
        }
        print(f"KT/HF: throughput {summary['kt_vs_hf']['throughput_ratio']} (seeds "
              f"{summary['kt_vs_hf']['seeds_throughput_ratio']}), GPU memory {summary['kt_vs_hf']['gpu_ratio']} "
              f"(seeds {summary['kt_vs_hf']['seeds_gpu_ratio']})")
    for leg in [leg for leg in results if leg.startswith("kt-profile")]:
        prof = results[leg].get("kt_timers")
        if not isinstance(prof, dict):
            continue
        print(f"{leg} {results[leg].get('sets') or ''}")
        print(f"KT timers over {prof['profiled_steps']} steps: step {prof['step_s']} s; KT's MoE layers hold it "
              f"{prof.get('kt_moe_blocking_s_per_step')} s ({prof['kt_moe_share']} of the step); per stage and step: "
              f"{prof['kt_moe_s_per_step']} (backward_repack runs in the background: only its wait blocks)")
        print(prof["table"])
    for leg, r in results.items():
        if r.get("sets"):
            print(f"{leg}: --set {' --set '.join(r['sets'])}")
    if json_out:
        json_out.write_text(json.dumps(summary, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=("prepare", "run", "report", "all", "_token_lengths", "_prepare_data",
                                          "_profile_train", "_toolchain"))
    parser.add_argument("legs", nargs="*")
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--workdir", default=str(REPO / "build/bench-kt-vs-hf"),
                        help="holds <size>-<arch>/ (model, data, legs, results)")
    parser.add_argument("--arch", choices=tuple(ARCHITECTURES), default="v3",
                        help="the model class: v3 (V2-Lite's dimensions, DeepSeek-V3 routing: what kt-kernel 0.7.2 "
                             "trains) or v2 (DeepseekV2ForCausalLM: the HF leg runs, the KT legs stop at KT's gate check)")
    parser.add_argument("--python", default=str(default_python()), help="the training toolchain's python")
    parser.add_argument("--steps", type=int, default=None, help="sft.max_steps (the recipe's: 8)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the steady-state figures")
    parser.add_argument("--gpus", type=int, default=None, help="sft.gpus (0: the hf leg on the CPU)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="a recipe override for the legs run (ktflow's --set), e.g. sft.kt_cpu_activation=retain")
    parser.add_argument("--tag", default=None, help="results of this run go to <leg>-<tag>.json (e.g. a --set variant)")
    args = parser.parse_args()
    if args.phase == "_token_lengths":
        print(json.dumps(child_token_lengths(Path(args.legs[0]), Path(args.legs[1]))))
        return 0
    if args.phase == "_toolchain":
        print(json.dumps(child_toolchain()))
        return 0
    if args.phase == "_prepare_data":
        child_prepare_data(Path(args.legs[0]), json.loads(args.legs[1]), Path(args.legs[2]))
        return 0
    if args.phase == "_profile_train":
        child_profile_train(Path(args.legs[0]), Path(args.legs[1]), int(args.legs[2]))
        return 0
    work = Work(args)
    if args.phase in ("prepare", "all"):
        phase_prepare(work)
        host = host_info(())
        host["toolchain"] = json.loads(work.child("_toolchain").strip().splitlines()[-1])
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
        host["cpu_isa"] = sorted(f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512f")))
        host["numa_nodes"] = len(list(Path("/sys/devices/system/node").glob("node[0-9]*")))
        host["gpu"] = (subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                      capture_output=True, text=True).stdout.strip()
                       if shutil.which("nvidia-smi") else "none")
        (work.results / "host.json").write_text(json.dumps(host, indent=2))
    if args.phase in ("run", "all"):
        legs = args.legs or ["hf", "kt", "ktflow"]
        unknown = [leg for leg in legs if leg not in LEGS]
        if unknown:
            parser.error(f"unknown leg(s) {', '.join(unknown)}; choose from {', '.join(LEGS)}")
        for leg in legs:
            phase_run(work, leg)
    if args.phase in ("report", "all"):
        return phase_report(work, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
