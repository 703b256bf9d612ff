"""The whole pipeline and its planning: ``doctor``, ``plan``, ``run`` and ``demo``."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from ktflow.cli._common import (
    DEMO_RECIPE,
    _Add,
    _add_recipe,
    _add_set,
    _load,
    _print_json,
    _serving_dir,
    err,
    out,
)
from ktflow.recipe import project_dir_of
from ktflow.units import human_bytes


def cmd_doctor(args: argparse.Namespace) -> int:
    from ktflow.host.hardware import probe_host

    recipe = _load(args) if args.recipe else None
    host = probe_host(recipe.store.root if recipe else None)
    checks = []
    probe = None  # kt-kernel's SFT kernels timed here for the recipe (ktflow.planning.host_probe)
    if recipe is not None:
        from ktflow.plan import check_recipe_on_host

        # the probe the store keeps for this machine; `ktflow plan` runs it where none is kept
        checks, probe = _with_plan_problems(check_recipe_on_host(recipe, host), recipe, host)
    if args.json:
        document = host.model_dump(mode="json")
        if recipe is not None:
            document["recipe"] = recipe.name
            document["stages"] = [c.model_dump(mode="json") for c in checks]
            document["kt_probe"] = probe.model_dump(mode="json") if probe is not None else None
        _print_json(document)
    else:
        table = Table(title=f"host {host.hostname}", show_header=False)
        table.add_row("CPU", host.cpu_model)
        variant = host.cpu_variant + (" (KT_KERNEL_CPU_VARIANT override)" if host.cpu_variant_overridden else "")
        table.add_row("kt-kernel variant", variant)
        table.add_row("cores", f"{host.physical_cores} physical, {host.logical_cores} logical")
        numa = ", ".join(f"node{n.id}: {human_bytes(n.mem_total_bytes)}" for n in host.numa)
        table.add_row("NUMA", f"{host.numa_nodes} node(s) ({numa})")
        table.add_row("RAM", f"{human_bytes(host.ram_bytes)} ({human_bytes(host.ram_available_bytes)} available)")
        gpus = ", ".join(f"{g.name} {human_bytes(g.vram_bytes)}" for g in host.gpus) or "none"
        table.add_row("GPUs", gpus)
        table.add_row("disk free", f"{human_bytes(host.disk_free_bytes)} at {host.disk_path}")
        table.add_row("/dev/shm", f"{human_bytes(host.shm_free_bytes)} free of {human_bytes(host.shm_bytes)}")
        if probe is not None:
            table.add_row("KT probe", probe.basis.removeprefix("KT probe: "))
        out.print(table)
        if recipe is not None:
            stages = Table(title=f"recipe {recipe.name} on this host")
            for column in ("stage", "runs", "why", "this host"):
                stages.add_column(column)
            for c in checks:
                verdict = ("[green]ok[/]" if c.runnable else "[red]" + "; ".join(c.missing) + "[/]") if c.needed else "-"
                stages.add_row(c.stage, "yes" if c.needed else "skipped", c.reason, verdict)
            out.print(stages)
            out.print("`ktflow plan` gives each stage's predicted disk, RAM, GPU memory and time.")
    if checks and not all(c.runnable for c in checks):
        return 2
    return 0


def _with_plan_problems(checks: list, recipe, host, probe: bool = False) -> tuple[list, Any]:
    """The doctor's stage checks, with what the plan predicts will not fit (disk, RAM, GPU memory), and the SFT
    line's KT probe (None: the recipe trains without KT, or the host has KT runs); ``probe``: run it if none is kept."""
    from ktflow.plan import plan_recipe

    plan = {s.stage: s for s in plan_recipe(recipe, host, probe=probe).stages}
    merged = []
    for check in checks:
        extra = [p if p.startswith(check.stage) else f"{check.stage} {p}" for p in plan[check.stage].problems
                 if check.needed and not any(p in m for m in check.missing)]
        merged.append(check.model_copy(update={"missing": check.missing + extra,
                                               "runnable": check.runnable and not extra}))
    return merged, plan["sft"].kt_probe if "sft" in plan else None


def cmd_plan(args: argparse.Namespace) -> int:
    from ktflow.host.hardware import probe_host
    from ktflow.plan import load_host, plan_recipe

    recipe = _load(args)
    host = load_host(Path(args.host)) if args.host else probe_host(recipe.store.root)
    # another host's plan uses its probe if the store keeps one; only this machine's can be run here
    plan = plan_recipe(recipe, host, probe=not args.host and not args.no_probe)
    if args.json:
        _print_json({**plan.model_dump(mode="json", exclude={"model": {"linear_shapes"}}), "fits": plan.fits,
                     "seconds": plan.seconds})
        return 0 if plan.fits else 2
    source = plan.model_source
    out.print(f"plan: {recipe.name} on {host.hostname}; model size "
              + (source if source.startswith("unknown") else f"from {source}"))
    table = Table(pad_edge=False)  # 80 columns hold every figure (a merged serve line included)
    for column in ("stage", "runs", "time", "disk", "RAM", "GPU memory", "fits"):
        table.add_column(column, no_wrap=True)
    for s in plan.stages:
        if not s.needed:
            table.add_row(s.stage, "skipped", "", "", "", "", "")
            continue
        gpu = human_bytes(s.gpu_bytes) if s.gpu_bytes else "-"
        table.add_row(s.stage, "yes", _duration(s.seconds) if s.seconds is not None else "?",
                      human_bytes(s.disk_bytes) if s.disk_bytes else "-",
                      human_bytes(s.ram_bytes) if s.ram_bytes else "-",
                      f"{s.gpus} x {gpu}" if s.gpus and s.gpu_bytes else gpu,
                      "[green]yes[/]" if s.fits else "[red]no[/]")
    out.print(table)
    for s in plan.stages:  # one line a stage: the essentials of how it runs here
        out.print(escape(f"{s.stage}: " + (s.summary or s.reason if s.needed else f"skipped: {s.reason}")))
    problems = [p if p.startswith(s.stage) else f"{s.stage}: {p}" for s in plan.stages if s.needed for p in s.problems]
    if problems:
        out.print("[red]what does not fit this host:[/]")
    for problem in problems:  # in full, never shortened
        out.print(f"[red]- {escape(problem)}[/]")
    if problems and not args.host:
        out.print("to plan for the machine that will run it: `ktflow doctor --json > host.json` there, then "
                  "`ktflow plan RECIPE --host host.json`")
    if args.explain:
        out.print("how each figure was derived:")
        for s in plan.stages:
            if not s.needed:
                continue
            if s.time_basis:
                out.print(escape(f"{s.stage} time: {s.time_basis}"))
            if s.candidate:
                out.print(escape(f"{s.stage}: {s.candidate}"))
            if s.candidate_prices:
                out.print(escape(f"{s.stage}: each mode on this host: " + "; ".join(s.candidate_prices)))
            if s.serving_settings_basis:
                out.print(escape(f"{s.stage} settings: {s.serving_settings}: {s.serving_settings_basis}"))
            if s.decode_by_mode:
                out.print(escape(f"{s.stage} decode at concurrency 1 in each mode: " + "; ".join(s.decode_by_mode)))
    if recipe.store.artifacts:
        out.print("each host keeps its own store (store.artifacts: the adapter crosses through "
                  f"{recipe.store.artifacts}); disk by host: " + ", ".join(
                      f"{pool} {human_bytes(disk)}" for pool, disk in plan.disk_by_pool.items()) +
                  " (download and dequantize run on both)")
    total = plan.seconds
    out.print(f"predicted time: {_duration(total) if total is not None else 'unknown (a stage has no prediction)'}; "
              + ("every stage fits" if plan.fits else "does not fit (see above)"))
    if not args.explain:
        out.print("how each figure was derived: ktflow plan --explain")
    return 0 if plan.fits else 2


def _duration(seconds: float) -> str:
    from ktflow.plan import brief_duration

    return brief_duration(seconds)


_API_GUARDIAN: Any = None


def _embedded_prefect(verbose: bool, project_dir: Path) -> None:
    """Prefect's ephemeral API with state under ``project_dir/.ktflow/prefect``: no server to start. A
    PREFECT_API_URL set by the user (a real server) wins; ktflow never overrides the environment.

    Prefect's own console lines (state changes, and a traceback for every failed task and flow)
    are shown with ``--verbose`` only: without it a failed run ends in one ``error:`` line. Its
    logs still reach the API at INFO, so the UI shows every task's log.
    """
    global _API_GUARDIAN
    home = Path(os.environ.setdefault("PREFECT_HOME", str(Path(project_dir).absolute() / ".ktflow" / "prefect")))
    try:
        home.mkdir(parents=True, exist_ok=True)  # Prefect creates only the last level itself
    except OSError as exc:
        from ktflow.errors import HostRequirementError

        raise HostRequirementError(f"PREFECT_HOME {home}", f"cannot be created ({exc.strerror}).",
                                   "run from a writable checkout, or set PREFECT_HOME to a writable directory") from None
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
    if not os.environ.get("PREFECT_API_URL") and _API_GUARDIAN is None:
        # Prefect stops its ephemeral API server (a uvicorn subprocess) only at a clean exit: after
        # a SIGKILL of ktflow it would live on. The server inherits this marker; the guardian stops it.
        from ktflow.host.process import EMBEDDED_API_MARKER, guard_descendants

        _API_GUARDIAN = guard_descendants(EMBEDDED_API_MARKER)


def _print_stages(title: str, outcome: dict, project_dir: Path) -> None:
    """The flow's stages as a table, their results' paths relative to the recipe's project folder."""
    table = Table(title=title)
    for column in ("stage", "runs", "why", "result"):
        table.add_column(column)
    here = f"{Path(project_dir).absolute()}{os.sep}"
    for row in outcome["stages"]:
        table.add_row(row["stage"], row["runs"], row["why"], row["result"].replace(here, ""))
    out.print(table)


def cmd_run(args: argparse.Namespace) -> int:
    """The whole pipeline as one Prefect flow, in-process on Prefect's ephemeral API."""
    recipe = _load(args)
    project_dir = project_dir_of(Path(args.recipe))
    _embedded_prefect(args.verbose, project_dir)
    from flows.pipeline import pipeline

    outcome = pipeline(recipe)
    if args.json:
        _print_json(outcome)
        return 0
    _print_stages(f"ktflow run {recipe.name}", outcome, project_dir)
    if "endpoint" in outcome:
        out.print(f"endpoint: {outcome['endpoint']} (stop it with: ktflow serve {args.recipe} --stop)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The pipeline flow on the CPU demo: a tiny model and dataset made locally, every stage for real."""
    import time

    from ktflow.demo import ensure_demo_model, write_demo_dataset
    from ktflow.recipe import load_recipe
    from ktflow.stages.serve import SMOKE_PROMPT, adapter_model_name, api_key_for, read_endpoint, smoke_test

    checkout = _demo_checkout()
    recipe = load_recipe(checkout / DEMO_RECIPE)
    source = recipe.source.local_path
    assert source is not None, "the demo recipe uses a local source"
    if ensure_demo_model(source):
        err.print(f"[bold]fixture[/]: made the tiny Kimi-K2.5-format checkpoint in {source}")
    write_demo_dataset(Path(recipe.dataset.files[0]).parent)
    _embedded_prefect(args.verbose, checkout)
    from flows.pipeline import pipeline

    err.print("[bold]ktflow-pipeline[/]: download -> dequantize -> sft -> convert-lora -> quantize-int8 -> evaluate "
              "the candidate -> serve it if it passed, on Prefect's embedded API (state in .ktflow/prefect)")
    started = time.monotonic()
    state = pipeline(recipe, return_state=True)
    outcome = state.result()  # raises the failed stage's error
    _print_stages(f"demo pipeline ({recipe.name}): {state.name} in {time.monotonic() - started:.1f} s", outcome,
                  checkout)

    endpoint = read_endpoint(_serving_dir(recipe))
    assert endpoint is not None, "the serve stage records its endpoint"
    key = api_key_for(endpoint)
    assert key is not None
    answer = smoke_test(endpoint.url, key, adapter_model_name(recipe))
    out.print(f"endpoint {endpoint.url}, model {adapter_model_name(recipe)}: asked {SMOKE_PROMPT!r}, it answers "
              f"{answer['content']!r}")
    report = Path(outcome["evaluation"]) if "evaluation" in outcome else None
    if report is not None and report.is_file():
        _print_side_by_side(report.with_name("report.json"))
        out.print(report.read_text(encoding="utf-8"), markup=False)
    out.print(f"The endpoint keeps running (a rerun is all cache hits); stop it with: ktflow serve {DEMO_RECIPE} --stop")
    return 0


def _demo_checkout() -> Path:
    """The checkout the demo runs in: this directory if it has the demo recipe, else
    ``$KTFLOW_CHECKOUT``, else the checkout this ktflow is installed from (``pip install -e``)."""
    candidates = [Path.cwd()]
    if os.environ.get("KTFLOW_CHECKOUT"):
        candidates.append(Path(os.environ["KTFLOW_CHECKOUT"]))
    candidates.append(Path(__file__).resolve().parent.parent.parent)
    for candidate in candidates:
        if (candidate / DEMO_RECIPE).is_file():
            return candidate
    from ktflow.errors import InvalidInputError

    raise InvalidInputError(str(DEMO_RECIPE), "was found neither here nor in $KTFLOW_CHECKOUT nor beside ktflow.",
                            "run `make demo` (or `ktflow demo`) in a ktflow checkout, or set KTFLOW_CHECKOUT to one")


def _print_side_by_side(report_json: Path) -> None:
    """One evaluation prompt: the reference answer, the base model's and the tuned model's.

    The demo's evaluation prompts are not in its training data; the title says "unseen" only
    when the report's overlap check found none.
    """
    report = json.loads(report_json.read_text(encoding="utf-8"))
    base, tuned = report["base"]["predictions"][0], report["tuned"]["predictions"][0]
    unseen = not report.get("contamination", {}).get("overlaps", [None])
    what = "one unseen prompt (not in the training data)" if unseen else "one evaluation prompt"
    table = Table(title=f"{what}: {base['prompt']!r}", show_lines=True)
    for column in ("expected (training data's style)", "base model", "tuned model"):
        table.add_column(column, overflow="fold")
    table.add_row(base["reference"], base["prediction"], tuned["prediction"])
    out.print(table)


def add_planning_commands(add: _Add) -> None:
    """Probe the host and plan a recipe on it: doctor, plan."""
    p = add("doctor", cmd_doctor, "probe this host; with --recipe, say which stages it can run")
    p.add_argument("--recipe", metavar="FILE", help="a recipe YAML file: also say which of its stages this host can run")
    _add_set(p)
    p.add_argument("--json", action="store_true", help="print one JSON document")

    p = add("plan", cmd_plan, "predict each stage's disk, RAM, GPU memory, GPUs and time on a host, and what fits")
    p.add_argument("recipe", metavar="RECIPE", help="recipe YAML file (see recipes/)")
    _add_set(p)
    p.add_argument("--host", metavar="FILE", help="plan for the host `ktflow doctor --json` described in FILE")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--no-probe", action="store_true",
                   help="do not time kt-kernel's SFT kernels on this host before predicting KT (up to ~30 s, "
                        "kept per machine in the store)")
    p.add_argument("--explain", action="store_true",
                   help="also print how each figure was derived: the step and decode models and what they were "
                        "fitted on, the batch shapes weighed, the KT probe, and every candidate mode priced")


def add_run_commands(add: _Add) -> None:
    """Whole-pipeline runs: run, demo."""
    p = add("run", cmd_run, "run the whole pipeline (embedded Prefect)")
    _add_recipe(p)
    p.add_argument("--verbose", action="store_true", help="show Prefect's task logs")
    p.add_argument("--json", action="store_true", help="print the stage summary as one JSON document")

    p = add("demo", cmd_demo, "the pipeline flow on a tiny model and dataset made locally (CPU)")
    p.add_argument("--verbose", action="store_true", help="show Prefect's task logs")
