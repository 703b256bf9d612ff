"""SFT stage overhead: ``ktflow sft`` against bare ``llamafactory-cli train`` on the same config and data.

Command (from the repository root):

    .venv/bin/python benchmarks/sft_overhead.py
    # options: [--steps 20] [--repeat 3] [--workdir DIR] [--keep] [--json PATH]

What it does:
1. Builds, in a fresh directory under ``--workdir`` (default ``.ktflow/bench/``; removed unless
   ``--keep``), the tiny bf16 fixture (``ktflow.fixtures.checkpoints.make_fixture``, default dims: 3 layers,
   8 experts, hidden 256) and the demo dataset (``ktflow.demo.write_demo_dataset``), in a child.
2. Runs ``--repeat`` times (default 3; small boxes are noisy), in this order, each as a subprocess
   whose wall time is taken from outside (the whole command: what a user waits for):
   a. the stage: ``.venv/bin/python -m ktflow.cli sft recipes/tiny-demo.yaml --set ...`` with the
      fixture as ``source.local_path`` (``source.format=bf16``), the work dir's data as dataset and
      evaluation files, a FRESH ``store.root`` per repetition (no cache hit: data preparation and
      training both run), ``sft.max_steps=N``, ``sft.save_steps=N`` (one checkpoint) and
      ``toolchains.train.python=.venv-train/bin/python``;
   b. bare LlamaFactory: ``.venv-train/bin/llamafactory-cli train <run dir>/train.yaml
      output_dir=<fresh dir>``: the YAML that (a) rendered and saved, so the same config and the
      dataset directory that (a) prepared; env HF_HUB_OFFLINE=1 and the training venv's bin/ first
      on PATH, as the stage gives it.
   While each runs, the parent polls the command's direct children every 20 ms (psutil), which
   splits (a) into: pre-launch (start -> the ``llamafactory-cli`` child is first seen), LlamaFactory
   (its lifetime) and post (its exit -> the stage's exit; of which the ``tool_versions`` child).
   CPU time (user + sys of the command and its reaped descendants, from ``os.wait4``) is printed
   beside wall time: on a shared box it moves less with other people's load (not immune: torch threads
   spin while they wait).
   Both runs' ``trainer_log.jsonl`` must show the same number of steps (else exit 1); their final
   losses are printed side by side (same seed: identical or nearly; a relative difference over 1%
   exits 1, it would mean they did not train the same thing).
3. Once, after the repetitions, a child replays the stage's own pre-launch and publish steps
   in-process with a timer per step (imports, recipe, host probe, digests, dataset preparation with
   the model's chat template, rendering; then ``tool_versions`` alone and the SFT ``StageSpec``'s
   post-training steps as ``ktflow.runner.run_stage`` runs them: the adapter's copy into staging,
   ``SFT.verify``, ``SFT.manifest``, ``ktflow.store.publish_dir``, ``SFT.result``, on the last run's
   LlamaFactory output, read only), on another fresh store; its start-up and shutdown
   come from CLOCK_MONOTONIC stamps taken in the child and around it: where pre-launch and post go.
4. Prints host, the table (median wall [min-max]) and the tracked ratio stage/bare with its target
   "<= 1.05 plus a few seconds", read as: met when ratio <= 1.05 OR stage - bare <= 5 s (median
   walls). Both the ratio and the absolute overhead are printed.
"""

from __future__ import annotations

import time

T_ENTRY = time.perf_counter()  # CLOCK_MONOTONIC on Linux: comparable across processes

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import psutil  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import host_info, report, run_child  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ORCH_PYTHON = REPO / ".venv" / "bin" / "python"
TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"
LF_CLI = REPO / ".venv-train" / "bin" / "llamafactory-cli"
RECIPE = "recipes/tiny-demo.yaml"
TARGET_RATIO, TARGET_SECONDS = 1.05, 5.0
POLL_S = 0.02
PUBLISH = "post: publish (copy, verify, manifest + tool_versions, publish_dir)"
SHUTDOWN = "post: python shutdown with torch + transformers loaded (until reaped)"
TRAIN_PACKAGES = ("llamafactory", "torch", "transformers", "peft", "accelerate")


# --------------------------------------------------------------------------- child jobs (run in .venv)


def job_build(work: Path) -> dict[str, Any]:
    from ktflow.demo import write_demo_dataset
    from ktflow.fixtures.checkpoints import FixtureSpec, make_fixture

    t0 = time.perf_counter()
    spec = FixtureSpec(kind="bf16")
    make_fixture(spec, work / "fixture")
    train, evals = write_demo_dataset(work / "data")
    return {"seconds": time.perf_counter() - t0, "dims": spec.model_dump(), "train": str(train),
            "eval": str(evals), "fixture_bytes": sum(f.stat().st_size for f in (work / "fixture").rglob("*")
                                                     if f.is_file())}


def job_prelaunch(overrides: list[str], trained: Path) -> dict[str, Any]:
    """Replay ``ktflow sft``'s steps before the launch and after training, one timer per step.

    ``trained``: a LlamaFactory output dir of a finished run (read only), for the publish step.
    """
    t0 = time.perf_counter()
    steps: dict[str, float] = {"psutil, argparse (this replay's own imports; ktflow imports psutil too)": t0 - T_ENTRY}

    def lap(name: str, start: float) -> float:
        now = time.perf_counter()
        steps[name] = now - start
        return now

    import ktflow.cli  # noqa: F401  (rich, pydantic, ktflow's own modules: what `python -m ktflow.cli` loads)
    t = lap("import ktflow.cli (rich, pydantic, yaml)", t0)
    from ktflow.recipe import load_recipe

    recipe = load_recipe(REPO / RECIPE, overrides)
    t = lap("load recipe + overrides", t)
    from ktflow.host.hardware import probe_host

    host = probe_host(recipe.store.root)
    t = lap("probe_host", t)
    import rich.progress  # noqa: F401

    from ktflow.formats.adapter import ADAPTER_FILES
    from ktflow.host.process import tool_versions
    from ktflow.stages.sft import dump_yaml, render_sft, run_dir_for, run_key
    from ktflow.stages.sft.render import ADAPTER, LF_OUTPUT
    from ktflow.stages.sft.stage import _TOOL_PACKAGES, SFT, SftRequest, _Job
    from ktflow.stages.weights import ensure_training_weights
    from ktflow.store import atomic_write_bytes, publish_dir, staging_dir_for

    t = lap("import ktflow.stages.sft, ktflow.stages.weights, rich.progress", t)
    model_dir = ensure_training_weights(recipe).absolute()
    t = lap("ensure_training_weights (local bf16 source)", t)
    from ktflow.formats.checkpoint import checkpoint_digest
    from ktflow.formats.dataset import dataset_digest, prepare_dataset
    from ktflow.planning.stage_plan import host_requirements
    from ktflow.resources import check_requirement

    check_requirement(host_requirements(recipe)["sft"], host)
    model_config = json.loads((model_dir / "config.json").read_text())
    data_digest = dataset_digest(recipe.dataset, template=recipe.sft.template, model_dir=model_dir)
    t = lap("dataset_digest", t)
    base_digest = checkpoint_digest(model_dir)
    t = lap("checkpoint_digest", t)
    import transformers  # noqa: F401  (prepare_dataset imports it for template "empty")

    t = lap("import transformers (for the chat template)", t)
    dataset = prepare_dataset(recipe.dataset, recipe.store.layout.dataset(f"x-{data_digest[:12]}").absolute(),
                              template=recipe.sft.template, model_dir=model_dir)
    t = lap("prepare_dataset (tokenizer load, render, fsync, publish)", t)
    key = run_key(recipe, base_digest=base_digest, data_digest=data_digest)
    run_dir = run_dir_for(recipe, key).absolute()
    run_dir.mkdir(parents=True)
    plan = render_sft(recipe, model_dir=model_dir, dataset_dir=dataset.dataset_dir, output_dir=run_dir / "output",
                      config_dir=run_dir, train_python=recipe.toolchains.train.python.absolute(),
                      physical_cores=host.physical_cores, model_config=model_config)
    atomic_write_bytes(run_dir / "train.yaml", dump_yaml(plan.train_config).encode())
    t = lap("run key, render, write train.yaml", t)
    python = recipe.toolchains.train.python.absolute()
    tool_versions(python, _TOOL_PACKAGES)
    t = lap("post: tool_versions alone (a python subprocess)", t)
    # The stage's job as SFT.prepare makes it, its LlamaFactory output the last run's (a link: read only).
    (run_dir / LF_OUTPUT).symlink_to(trained, target_is_directory=True)
    job = _Job(request=SftRequest(recipe=recipe, model_dir=model_dir, host=host), target=run_dir / ADAPTER,
               lock_dir=run_dir, model_dir=model_dir, model_config=model_config, base_digest=base_digest,
               data_digest=data_digest, key=key, run_dir=run_dir, python=python)
    staging = staging_dir_for(job.target)
    staging.mkdir(parents=True)
    for name in ADAPTER_FILES:  # what SFT.work does once training returns
        if (job.output_dir / name).is_file():
            shutil.copy2(job.output_dir / name, staging / name)
    SFT.verify(job, staging)  # then run_stage's steps after the work
    SFT.result(job, publish_dir(staging, job.target, SFT.manifest(job), fsync=job.fsync))
    lap(PUBLISH, t)
    return {"steps": steps, "t_entry": T_ENTRY, "t_report": time.perf_counter()}


def child_main(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.child == "build":
        report(job_build(Path(args.workdir)))
    elif args.child == "prelaunch":
        report(job_prelaunch(json.loads(args.overrides), Path(args.workdir)))


# --------------------------------------------------------------------------- orchestration (no torch here)


class Watch:
    """Poll a process's direct children: when each (by a cmdline marker) was first and last seen."""

    def __init__(self, pid: int, t0: float, markers: dict[str, str]) -> None:
        self.pid, self.t0, self.markers = pid, t0, markers
        self.seen: dict[str, list[float]] = {}  # marker name -> [first seen, last seen] (s from t0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            parent = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop.is_set():
            now = time.perf_counter() - self.t0
            try:
                children = parent.children()
            except psutil.Error:
                break
            for child in children:
                try:
                    cmd = " ".join(child.cmdline())
                except psutil.Error:
                    continue
                for name, marker in self.markers.items():
                    if marker in cmd:  # first seen <= one poll after its exec (create_time is too coarse)
                        self.seen.setdefault(name, [now, now])[1] = now
            self._stop.wait(POLL_S)

    def stop(self) -> dict[str, list[float]]:
        self._stop.set()
        self._thread.join()
        return self.seen


def timed(argv: list[str], log: Path, env: dict[str, str], markers: dict[str, str]) -> dict[str, Any]:
    """Run ``argv`` (cwd = repo root) with output to ``log``; wall time from outside, children watched."""
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=REPO)
        watch = Watch(proc.pid, t0, markers)
        _, status, usage = os.wait4(proc.pid, 0)  # usage covers the command and its reaped descendants
        wall = time.perf_counter() - t0
    proc.returncode = rc = os.waitstatus_to_exitcode(status)  # reaped here; keep Popen consistent
    spans = watch.stop()
    if rc != 0:
        print(f"{' '.join(argv[:4])} ... failed (exit {rc}); last output:\n" + log.read_text(errors="replace")[-3000:],
              file=sys.stderr)
        raise SystemExit(1)
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "spans": spans}


def trainer_log(path: Path) -> dict[str, Any]:
    steps, losses = 0, []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        steps = max(steps, int(rec.get("current_steps", 0)))
        if rec.get("loss") is not None:
            losses.append(float(rec["loss"]))
    return {"steps": steps, "losses": losses, "final_loss": losses[-1] if losses else None}


def toolchain_versions(python: Path, packages: tuple[str, ...]) -> dict[str, str | None]:
    code = ("import json, sys, importlib.metadata as m\nout = {}\nfor p in sys.argv[1:]:\n"
            "    try: out[p] = m.version(p)\n    except m.PackageNotFoundError: out[p] = None\nprint(json.dumps(out))")
    done = subprocess.run([str(python), "-c", code, *packages], capture_output=True, text=True, timeout=120)
    return json.loads(done.stdout) if done.returncode == 0 else {}


def stats(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {"median": statistics.median(v), "min": v[0], "max": v[-1]}


def fmt(s: dict[str, float]) -> str:
    return f"{s['median']:7.2f} [{s['min']:6.2f} -{s['max']:6.2f}]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions of a-b; wall = median (default 3)")
    p.add_argument("--workdir", type=Path, default=REPO / ".ktflow" / "bench", help="a fresh run dir is made in it")
    p.add_argument("--keep", action="store_true", help="keep the run dir (fixture, stores, outputs, logs)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--overrides", default="[]", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child_main(args)
        return 0
    for path in (ORCH_PYTHON, TRAIN_PYTHON, LF_CLI):
        if not path.exists():
            print(f"{path} is missing (make dev / make train-env)", file=sys.stderr)
            return 1

    args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="sft-overhead-", dir=args.workdir)).absolute()
    me = str(Path(__file__).resolve())
    n = args.steps
    try:
        host = host_info(["ktflow", "pydantic", "rich"])
        train_versions = toolchain_versions(TRAIN_PYTHON, TRAIN_PACKAGES)
        print(f"host: {host['cpu']}, {host['physical_cores']} physical / {host['logical_cores']} logical cores, "
              f"{host['memory_gb']} GB RAM, Linux {host['kernel']}, Python {host['python']}, "
              + ", ".join(f"{k} {v}" for k, v in host["packages"].items())
              + "; .venv-train: " + ", ".join(f"{k} {v}" for k, v in train_versions.items()))
        built = run_child([me, "--child", "build", "--workdir", str(work)], work / "build.log")
        if built.returncode != 0:
            print("build failed; last output:\n" + built.log.read_text()[-3000:], file=sys.stderr)
            return 1
        b = built.result
        dims = ", ".join(f"{k} {v}" for k, v in b["dims"].items() if k != "kind")
        print(f"input: bf16 fixture ({dims}; {b['fixture_bytes'] / 1e6:.1f} MB) + demo dataset in {work}, "
              f"built in {b['seconds']:.1f} s")

        def overrides(store: Path) -> list[str]:
            return [f"source.local_path={work / 'fixture'}", "source.format=bf16",
                    f"dataset.files=[{work / 'data' / 'train.jsonl'}]",
                    f"evaluation.files=[{work / 'data' / 'eval.jsonl'}]", f"store.root={store}",
                    f"sft.max_steps={n}", f"sft.save_steps={n}", f"toolchains.train.python={TRAIN_PYTHON}"]

        env = {**os.environ, "HF_HUB_OFFLINE": "1",
               "PATH": f"{TRAIN_PYTHON.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        markers = {"lf": "llamafactory-cli", "tool_versions": "importlib.metadata"}
        samples: dict[str, list[dict[str, Any]]] = {"stage": [], "bare": []}
        checks: list[dict[str, Any]] = []
        for rep in range(args.repeat):
            store = work / f"store-{rep}"
            argv = [str(ORCH_PYTHON), "-m", "ktflow.cli", "sft", RECIPE]
            for o in overrides(store):
                argv += ["--set", o]
            stage = timed(argv, work / f"stage-{rep}.log", env, markers)
            runs = sorted((store / "runs").iterdir())
            if len(runs) != 1:
                print(f"expected one run dir under {store / 'runs'}, found {len(runs)}", file=sys.stderr)
                return 1
            run_dir = runs[0]
            lf = stage["spans"].get("lf")
            if lf is None:
                print("never saw the stage's llamafactory-cli child (ran too briefly?)", file=sys.stderr)
                return 1
            tv = stage["spans"].get("tool_versions")
            stage.update(pre=lf[0], lf=lf[1] - lf[0], post=stage["wall"] - lf[1],
                         tool_versions=(tv[1] - tv[0]) if tv else 0.0)
            samples["stage"].append(stage)

            out_dir = work / f"bare-{rep}"
            bare = timed([str(LF_CLI), "train", str(run_dir / "train.yaml"), f"output_dir={out_dir}"],
                         work / f"bare-{rep}.log", env, markers)
            samples["bare"].append(bare)

            a, c = trainer_log(run_dir / "output" / "trainer_log.jsonl"), trainer_log(out_dir / "trainer_log.jsonl")
            diffs = [abs(x - y) for x, y in zip(a["losses"], c["losses"])]
            checks.append({"stage_steps": a["steps"], "bare_steps": c["steps"], "stage_final_loss": a["final_loss"],
                           "bare_final_loss": c["final_loss"], "max_loss_diff": max(diffs) if diffs else None})
            print(f"rep {rep + 1}/{args.repeat}: stage {stage['wall']:.2f} s, bare {bare['wall']:.2f} s; steps "
                  f"{a['steps']} vs {c['steps']}; final loss {a['final_loss']:.6f} vs {c['final_loss']:.6f}"
                  f" (largest per-step loss difference {checks[-1]['max_loss_diff']:.2e})", flush=True)

        overrides_diag = overrides(work / "store-diag")
        t_spawn = time.perf_counter()
        diag = run_child([me, "--child", "prelaunch", "--workdir", str(run_dir / "output"),
                          "--overrides", json.dumps(overrides_diag)], work / "diag.log")
        t_done = time.perf_counter()
        if diag.returncode != 0:
            print("pre-launch replay failed; last output:\n" + diag.log.read_text()[-3000:], file=sys.stderr)
            return 1

        # ------------------------------------------------------------------ figures
        fig = {
            "stage": stats([s["wall"] for s in samples["stage"]]),
            "bare": stats([s["wall"] for s in samples["bare"]]),
            "stage_cpu": stats([s["cpu"] for s in samples["stage"]]),
            "bare_cpu": stats([s["cpu"] for s in samples["bare"]]),
            "stage_pre": stats([s["pre"] for s in samples["stage"]]),
            "stage_lf": stats([s["lf"] for s in samples["stage"]]),
            "stage_post": stats([s["post"] for s in samples["stage"]]),
            "stage_tool_versions": stats([s["tool_versions"] for s in samples["stage"]]),
        }
        ratio = fig["stage"]["median"] / fig["bare"]["median"]
        overhead = fig["stage"]["median"] - fig["bare"]["median"]
        paired = [s["wall"] - b["wall"] for s, b in zip(samples["stage"], samples["bare"])]
        direct = stats([s["pre"] + s["post"] for s in samples["stage"]])
        lf_vs_bare = [s["lf"] - b["wall"] for s, b in zip(samples["stage"], samples["bare"])]
        met = ratio <= TARGET_RATIO or overhead <= TARGET_SECONDS

        print(f"\n{n} LoRA steps on CPU per run (batch 2, cutoff 256, logging every step, one checkpoint at "
              f"step {n}); {args.repeat} repetition(s), stage then bare each time; wall = median [min - max], s, "
              "taken from outside (whole command)")
        print(f"{'run':62} {'wall s':>7} {'[min  -   max]':>16}   {'CPU s (user+sys)':>28}")
        rows = [
            ("a. ktflow sft (whole command)", fig["stage"], fig["stage_cpu"]),
            ("     pre-launch: start -> llamafactory-cli started", fig["stage_pre"], None),
            ("     llamafactory-cli child, start -> exit", fig["stage_lf"], None),
            ("     post: llamafactory-cli exit -> stage exit", fig["stage_post"], None),
            ("       of which tool_versions subprocess", fig["stage_tool_versions"], None),
            ("b. bare llamafactory-cli train (same train.yaml, same data)", fig["bare"], fig["bare_cpu"]),
        ]
        for label, s, cpu in rows:
            print(f"{label:62} {fmt(s)}" + (f"   {fmt(cpu):>28}" if cpu else ""))
        print("(the split of a. comes from polling the stage's children every 20 ms: +-0.02 s each)")

        steps_ok = all(c["stage_steps"] == c["bare_steps"] == n for c in checks)
        loss_ok = all(c["stage_final_loss"] is not None and c["bare_final_loss"] is not None
                      and abs(c["stage_final_loss"] - c["bare_final_loss"])
                      <= 0.01 * max(abs(c["bare_final_loss"]), 1e-12) for c in checks)
        print("\nsame training: steps stage/bare = "
              + ", ".join(f"{c['stage_steps']}/{c['bare_steps']}" for c in checks)
              + f" (expected {n}) {'ok' if steps_ok else 'MISMATCH'}; final loss stage/bare = "
              + ", ".join(f"{c['stage_final_loss']:.6f}/{c['bare_final_loss']:.6f}" for c in checks)
              + f" {'ok' if loss_ok else 'MISMATCH'}")

        d = diag.result
        d["startup_s"], d["shutdown_s"] = d["t_entry"] - t_spawn, t_done - d["t_report"]
        print("\nwhere the pre-launch and post time goes: one in-process replay of the stage's steps (fresh store; "
              "publish on the last run's output), one timer per step:")
        print(f"  {'pre: python start-up (fork, exec, site; before any import)':72} {d['startup_s']:6.2f} s")
        for name, secs in d["steps"].items():
            label = name if name.startswith("post") else f"pre: {name}"
            print(f"  {label:72} {secs:6.2f} s")
        print(f"  {SHUTDOWN:72} {d['shutdown_s']:6.2f} s")
        pre_sum = d["startup_s"] + sum(v for k, v in d["steps"].items() if not k.startswith("post"))
        post_sum = d["shutdown_s"] + d["steps"][PUBLISH]
        d["pre_sum_s"], d["post_sum_s"] = pre_sum, post_sum
        print(f"  replay: pre {pre_sum:.2f} s, post {post_sum:.2f} s; measured in a. (medians): pre-launch "
              f"{fig['stage_pre']['median']:.2f} s, post {fig['stage_post']['median']:.2f} s (the rest: run-to-run "
              "noise, rich, fork+exec from a process holding torch, the 20 ms poll)")

        mark = "ok" if met else "MISSED"
        print(f"\nstage / bare wall (medians):  {ratio:6.3f}   overhead stage - bare: {overhead:+6.2f} s "
              f"(per repetition: {', '.join(f'{x:+.2f}' for x in paired)} s)")
        cpu_overhead = fig["stage_cpu"]["median"] - fig["bare_cpu"]["median"]
        print(f"CPU time stage / bare (medians): {fig['stage_cpu']['median'] / fig['bare_cpu']['median']:.3f}, "
              f"stage - bare {cpu_overhead:+.2f} CPU s (less sensitive to other people's load than wall time)")
        print(f"overhead measured directly (pre-launch + post of a., no bare run involved): {direct['median']:.2f} s "
              f"[{direct['min']:.2f} - {direct['max']:.2f}]; the stage's llamafactory-cli child - bare wall, per "
              f"repetition: {', '.join(f'{x:+.2f}' for x in lf_vs_bare)} s (the same work: this box's noise)")
        print(f"target \"<= {TARGET_RATIO} plus a few seconds\", read as ratio <= {TARGET_RATIO} OR overhead <= "
              f"{TARGET_SECONDS:.0f} s: {mark} (ratio {'<=' if ratio <= TARGET_RATIO else '>'} {TARGET_RATIO}, "
              f"overhead {'<=' if overhead <= TARGET_SECONDS else '>'} {TARGET_SECONDS:.0f} s)")
        if args.json:
            args.json.write_text(json.dumps({
                "host": host, "train_toolchain": train_versions, "steps": n, "repeat": args.repeat,
                "runs": {k: [{kk: vv for kk, vv in s.items() if kk != "spans"} for s in v] for k, v in samples.items()},
                "figures": fig, "ratio": ratio, "overhead_s": overhead, "paired_overhead_s": paired,
                "target": {"ratio": TARGET_RATIO, "seconds": TARGET_SECONDS,
                           "rule": "ratio <= 1.05 or overhead <= 5 s"},
                "met": met, "cpu_overhead_s": cpu_overhead, "direct_overhead_s": direct,
                "lf_child_minus_bare_s": lf_vs_bare, "checks": checks,
                "same_steps": steps_ok, "same_loss": loss_ok,
                "prelaunch_replay": d,
            }, indent=2) + "\n")
        return 0 if steps_ok and loss_ok else 1
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
