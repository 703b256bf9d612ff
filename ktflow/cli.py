"""The ``ktflow`` command line.

Exit codes: 0 success; 2 invalid input (bad arguments, recipe, checkpoint, dataset, host),
with the reason on stderr naming the file or field and the fix; 1 anything else.
``--json`` prints exactly one JSON document on stdout. Heavy modules (torch, transformers)
are imported only by the commands that need them, so ``doctor`` and ``--help`` are fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from rich.console import Console
from rich.table import Table

from ktflow import __version__
from ktflow.errors import InvalidInputError, KtflowError
from ktflow.units import human_bytes

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

# ktflow.fixtures.checkpoints.FIXTURE_KINDS, spelled out so that `ktflow --help` does not import torch
# (a test keeps them equal)
FIXTURE_KINDS = ("kimi-k2.5", "kimi-k2", "deepseek-v3", "bf16", "deepseek-v2-lite")
DEMO_RECIPE = Path("recipes/tiny-demo.yaml")


def _print_json(document: Any) -> None:
    sys.stdout.write(json.dumps(document, indent=2, sort_keys=False, default=str) + "\n")




def project_dir_of(recipe_file: Path) -> Path:
    """Where a recipe's relative paths point: the folder holding its ``recipes/`` folder (a ktflow
    checkout or a copy of its layout), else the recipe's own folder."""
    folder = recipe_file.absolute().parent
    return folder.parent if folder.name == "recipes" else folder


def _load(args: argparse.Namespace):
    """Load the command's recipe and work in its project directory from here on, so that its
    relative paths (store, toolchains, data) mean the same from any working directory."""
    from ktflow.recipe import load_recipe

    recipe_file = Path(args.recipe).absolute()
    if recipe_file.is_file():
        os.chdir(project_dir_of(recipe_file))
    return load_recipe(recipe_file, args.set or ())


# --------------------------------------------------------------------------- commands


def cmd_doctor(args: argparse.Namespace) -> int:
    from ktflow.host.hardware import probe_host

    recipe = _load(args) if args.recipe else None
    host = probe_host(recipe.store.root if recipe else None)
    checks = []
    if recipe is not None:
        from ktflow.planning.stage_plan import check_recipe_on_host

        checks = _with_plan_problems(check_recipe_on_host(recipe, host), recipe, host)
    if args.json:
        document = host.model_dump(mode="json")
        if recipe is not None:
            document["recipe"] = recipe.name
            document["stages"] = [c.model_dump(mode="json") for c in checks]
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


def _with_plan_problems(checks: list, recipe, host) -> list:
    """The doctor's stage checks, with what the plan predicts will not fit (disk, RAM, GPU memory)."""
    from ktflow.planning.plan import plan_recipe

    plan = {s.stage: s for s in plan_recipe(recipe, host).stages}
    merged = []
    for check in checks:
        extra = [p if p.startswith(check.stage) else f"{check.stage} {p}" for p in plan[check.stage].problems
                 if check.needed and not any(p in m for m in check.missing)]
        merged.append(check.model_copy(update={"missing": check.missing + extra,
                                               "runnable": check.runnable and not extra}))
    return merged


def cmd_plan(args: argparse.Namespace) -> int:
    from ktflow.host.hardware import probe_host
    from ktflow.planning.plan import load_host, plan_recipe

    recipe = _load(args)
    host = load_host(Path(args.host)) if args.host else probe_host(recipe.store.root)
    plan = plan_recipe(recipe, host)
    if args.json:
        _print_json({**plan.model_dump(mode="json", exclude={"model": {"linear_shapes"}}), "fits": plan.fits,
                     "seconds": plan.seconds})
        return 0 if plan.fits else 2
    out.print(f"plan: {recipe.name} on {host.hostname}; model size from {plan.model_source}")
    table = Table()
    for column in ("stage", "disk", "RAM", "GPU memory", "GPUs", "time", "fits"):
        table.add_column(column)
    notes = []
    for s in plan.stages:
        if not s.needed:
            table.add_row(s.stage, "", "", "", "", "", "skipped")
            continue
        table.add_row(s.stage, human_bytes(s.disk_bytes) if s.disk_bytes else "-",
                      human_bytes(s.ram_bytes) if s.ram_bytes else "-",
                      human_bytes(s.gpu_bytes) if s.gpu_bytes else "-", str(s.gpus or "-"),
                      _duration(s.seconds) if s.seconds is not None else "?",
                      "[green]yes[/]" if s.fits else "[red]no[/]")
        notes += [f"[red]{s.stage}: {p}[/]" for p in s.problems]
        if s.time_basis:
            notes.append(f"{s.stage} time: {s.time_basis}")
        if s.candidate:
            notes.append(f"{s.stage}: {s.candidate}")
        if s.candidate_prices:
            notes.append(f"{s.stage}: each mode on this host: " + "; ".join(s.candidate_prices))
    out.print(table)
    for note in notes:
        out.print(note)
    if recipe.store.artifacts:
        out.print("each host keeps its own store (store.artifacts: the adapter crosses through "
                  f"{recipe.store.artifacts}); disk by host: " + ", ".join(
                      f"{pool} {human_bytes(disk)}" for pool, disk in plan.disk_by_pool.items()) +
                  " (download and dequantize run on both)")
    total = plan.seconds
    out.print(f"predicted time: {_duration(total) if total is not None else 'unknown (a stage has no prediction)'}; "
              f"{'every stage fits' if plan.fits else 'does not fit this host (see why)'}")
    return 0 if plan.fits else 2


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def cmd_fixture(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ktflow.fixtures.checkpoints import FixtureSpec, make_fixture

    spec = FixtureSpec(
        kind=args.kind, layers=args.layers, experts=args.experts, hidden=args.hidden,
        moe_intermediate=args.moe_intermediate, seed=args.seed, full_size=args.full_size,
        architecture=args.architecture, size=args.size,
    )
    columns = (TextColumn("shards"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("shards", total=None)
        path = make_fixture(spec, Path(args.out_dir),
                            progress=lambda done, total: bar.update(task, completed=done, total=total))
    form = " (full size)" if spec.full_size else ""
    if spec.streamed:
        from ktflow.fixtures.checkpoints import fixture_dims, streamed_parameters

        vocab = json.loads((path / "config.json").read_text())["text_config"]["vocab_size"]
        params = streamed_parameters(fixture_dims(spec), vocab_size=vocab)
        on_disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        form = (f" ({spec.size}: {params / 1e9:.2f}B parameters, {2 * params / 1e9:.1f} GB in BF16, "
                f"{on_disk / 1e9:.1f} GB on disk)")
    err.print(f"wrote {spec.kind}{form} fixture to {path}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from ktflow.formats.checkpoint import inspect_checkpoint

    info = inspect_checkpoint(Path(args.checkpoint_dir))
    if args.json:
        _print_json(info.model_dump(mode="json"))
        return 0
    table = Table(title=f"checkpoint {info.path}", show_header=False)
    table.add_row("format", f"{info.format} ({info.layout} layout, prefix '{info.tensor_prefix}')")
    table.add_row("architecture", f"{', '.join(info.architectures)} (model_type {info.model_type})")
    table.add_row("layers", f"{info.num_layers} ({info.first_k_dense} dense)")
    table.add_row("experts", f"{info.num_routed_experts} routed + {info.num_shared_experts} shared")
    table.add_row("dims", f"hidden {info.hidden_size}, moe_intermediate {info.moe_intermediate_size}, "
                          f"intermediate {info.intermediate_size}")
    table.add_row("tensors", f"{info.num_tensors} in {info.num_shards} shard(s), {human_bytes(info.tensor_bytes)}")
    table.add_row("quantized", str(info.quantized_tensors))
    table.add_row("dtypes", ", ".join(f"{k}: {v}" for k, v in sorted(info.dtypes.items())))
    out.print(table)
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from ktflow.stages.download import download_checkpoint

    recipe = _load(args)
    columns = (BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("download", total=None)
        # The token comes from HF_TOKEN (or huggingface_hub's saved login): never from argv,
        # where any user could read it in the process list.
        result = download_checkpoint(
            recipe.source, recipe.store.root,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    state = "cache hit" if result.cached else f"{result.files} files, {human_bytes(result.bytes)} verified"
    out.print(f"{state}: {result.path} (revision {result.revision})")
    return 0


def cmd_dequantize(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from ktflow.stages.dequantize import dequantize_checkpoint

    columns = (*Progress.get_default_columns()[:1], BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("dequantize", total=None)
        result = dequantize_checkpoint(
            Path(args.src), Path(args.dst), workers=args.workers, fsync=not args.no_fsync,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    if result.reused_source:
        out.print(f"{result.path} is already BF16: nothing to do, use it as it is")
    elif result.cached:
        out.print(f"{result.path}: already converted from this source ({result.source_format}); cache hit")
    else:
        rate = result.bytes_written / max(result.seconds, 1e-9) / 1e9
        out.print(
            f"{result.source_format} -> BF16: {result.tensors_decoded} tensors decoded, "
            f"{human_bytes(result.bytes_written)} in {result.shards} shards, {result.seconds:.1f} s "
            f"({rate:.2f} GB/s) -> {result.path}"
        )
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from ktflow.host.hardware import probe_host

    recipe = _load(args)
    host = probe_host(recipe.store.root)
    if args.dry_run:
        return _sft_dry_run(recipe, host, as_json=args.json)

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ktflow.formats.dataset import validate_dataset
    from ktflow.planning.host_speed import KtStepRecord
    from ktflow.stages.sft import check_hf_fits_gpus, run_sft
    from ktflow.stages.weights import ensure_source, ensure_training_weights

    # Bad records and a model the GPUs cannot hold are refused in seconds, before an hours-long dequantize.
    validate_dataset(recipe.dataset)
    source = ensure_source(recipe)
    check_hf_fits_gpus(recipe, host, source)
    model_dir = ensure_training_weights(recipe, source=source)
    columns = (TextColumn("sft"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[loss]}"),
               TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("sft", total=None, loss="")

        def on_progress(record) -> None:
            loss = f"loss {record.loss:.4f}" if record.loss is not None else ""
            bar.update(task, completed=record.current_steps, total=record.total_steps, loss=loss)

        result = run_sft(recipe, model_dir=model_dir, host=host, progress=on_progress,
                         log=lambda line: err.print(line, markup=False, highlight=False))
    if result.cached:
        out.print(f"sft: cache hit, adapter {result.adapter_dir}")
    else:
        resumed = f", resumed from {result.resumed_from}" if result.resumed_from else ""
        loss = f", final loss {result.final_loss:.4f}" if result.final_loss is not None else ""
        out.print(f"sft: {result.steps} steps{loss} in {result.seconds:.1f} s{resumed} -> {result.adapter_dir}")
        if result.backend_reason:
            out.print(f"sft.backend auto chose {result.backend_reason}", markup=False)
        if result.batch_shape:
            out.print(f"sft {result.batch_shape}", markup=False)
        if result.kt_step:
            step = KtStepRecord.model_validate(result.kt_step)
            out.print(f"sft: KT step {step.measured_step_s:.1f} s measured, {step.predicted_step_s:.1f} s predicted "
                      f"by the model as fitted (x{step.ratio:.2f}: the next plan on this host is calibrated by it)",
                      markup=False)
        if result.loss_curve:
            out.print(f"loss curve: {result.loss_curve}")
    return 0


def _sft_dry_run(recipe, host, *, as_json: bool) -> int:
    """Render without fetching, converting, validating data or launching anything."""
    import shlex

    from ktflow.formats.dataset import dataset_digest
    from ktflow.stages.sft import check_kt_model, dump_yaml, render_sft, run_dir_for, run_key
    from ktflow.stages.weights import expected_training_weights

    model_dir = expected_training_weights(recipe).absolute()
    config_path = model_dir / "config.json"
    model_config = json.loads(config_path.read_text()) if config_path.is_file() else None
    try:  # a dry run shows the plan anyway; the real run refuses it
        check_kt_model(recipe, model_config, config_path)
    except InvalidInputError as exc:
        err.print(f"[yellow]warning[/]: ktflow sft would refuse this: {exc}", markup=True)
    if model_config is not None:  # KT's micro-batch split, as the real run shapes it on this host
        from ktflow.stages.sft import dataset_lengths, resolve_batch_shape

        shape = resolve_batch_shape(recipe, model_dir, host, dataset_lengths(recipe, model_dir))
        if shape is not None:
            recipe = shape.recipe
            err.print(f"sft {shape.reason}", markup=False, highlight=False)
    if all(Path(f).is_file() for f in recipe.dataset.files) and (recipe.sft.template != "empty" or model_config):
        data = dataset_digest(recipe.dataset, template=recipe.sft.template,
                              model_dir=model_dir if recipe.sft.template == "empty" else None)
    else:
        data = "pending"  # the data files are not here yet: paths below are placeholders
    key = run_key(recipe, base_digest="pending" if model_config is None else model_dir.name, data_digest=data)
    run_dir = run_dir_for(recipe, key).absolute()
    plan = render_sft(
        recipe, model_dir=model_dir,
        dataset_dir=recipe.store.layout.dataset(f"{recipe.dataset.name}-{data[:12]}").absolute(),
        output_dir=run_dir / "output", config_dir=run_dir, train_python=recipe.toolchains.train.python.absolute(),
        physical_cores=host.physical_cores, model_config=model_config,
    )
    if as_json:
        _print_json(plan.model_dump(mode="json"))
        return 0
    out.print("[bold]# train.yaml[/]")
    out.print(dump_yaml(plan.train_config), markup=False)
    if plan.accelerate_config is not None:
        out.print("[bold]# accelerate.yaml[/]")
        out.print(dump_yaml(plan.accelerate_config), markup=False)
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env.items())
    out.print("[bold]# launch[/]")
    out.print((env + " " if env else "") + shlex.join(plan.launch), markup=False, soft_wrap=True)
    return 0


def cmd_convert_lora(args: argparse.Namespace) -> int:
    from ktflow.stages.convert_lora import convert_lora

    result = convert_lora(Path(args.adapter_dir), Path(args.out_dir), base_dir=Path(args.base),
                          serve_python=Path(args.serve_python), lora_alpha=args.lora_alpha,
                          on_line=lambda line: err.print(line, markup=False, highlight=False))
    state = "cache hit" if result.cached else ("converted by kt-kernel" if result.kind == "kt-fused" else "validated")
    out.print(
        f"{state}: {result.kind} adapter, rank {result.rank}, {result.tensors} tensors, targets "
        f"{', '.join(result.target_modules)} -> {result.path}"
    )
    return 0


def cmd_quantize_int8(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ktflow.stages.quantize_int8 import quantize_int8

    columns = (TextColumn("quantize-int8 layers"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("int8", total=None)
        result = quantize_int8(
            Path(args.bf16_dir), Path(args.out_dir), threadpool_count=args.threadpool_count,
            serve_python=Path(args.serve_python), workers=args.workers, fsync=not args.no_fsync,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    _print_int8(result)
    return 0


def _print_int8(result) -> None:
    errors = ", ".join(f"layer {k}: {v.get('mean_rel_err', float('nan')):.4f}" for k, v in result.verification.items()
                       if isinstance(v, dict))
    state = ("cache hit" if result.cached
             else f"{result.layers} layers ({result.layers_reused} reused) in {result.seconds:.1f} s")
    out.print(f"quantize-int8: {state}, T={result.threadpool_count}, AMXINT8 check {errors or '-'} -> {result.path}")


def _serving_dir(recipe) -> Path:
    from ktflow.stages.promotion import serving_dir

    return serving_dir(recipe)


def _served_adapter(recipe, model_dir: Path) -> Path:
    """The converted adapter to serve: the SFT run's adapter, through convert-lora (cached)."""
    from ktflow.stages.convert_lora import convert_lora
    from ktflow.stages.sft import locate_adapter
    from ktflow.store import read_manifest

    trained = locate_adapter(recipe, model_dir)
    digest = read_manifest(trained).digest()  # type: ignore[union-attr]
    return convert_lora(trained, recipe.store.layout.adapter(digest[:16]), base_dir=model_dir,
                        serve_python=recipe.toolchains.serve.python).path


def cmd_serve(args: argparse.Namespace) -> int:
    from ktflow.stages.serve import serve, stop

    recipe = _load(args)
    record_dir = _serving_dir(recipe)
    if args.stop:
        stopped = stop(record_dir)
        out.print(f"stopped the endpoint of {recipe.name}" if stopped else f"no endpoint of {recipe.name} is running")
        return 0
    if args.dry_run:
        return _serve_dry_run(recipe, record_dir, as_json=args.json)
    from ktflow.stages.weights import ensure_serving_weights, ensure_source, ensure_training_weights

    source = ensure_source(recipe)
    trained_on = ensure_training_weights(recipe, source=source)
    bf16 = trained_on if trained_on != source else None
    model_dir, kt_weights = ensure_serving_weights(recipe, source_dir=source, bf16_dir=bf16, log=_say)
    from ktflow.stages.promotion import registry_of

    production = registry_of(recipe).production_version()
    adapter = production.adapter_dir if production is not None else _served_adapter(recipe, trained_on)
    endpoint = serve(recipe, model_dir=model_dir, adapter_dir=adapter,
                     record_dir=record_dir, kt_weight_dir=kt_weights,
                     log=lambda line: err.print(line, markup=False, highlight=False))
    out.print(f"serving {endpoint.adapter_model_name or endpoint.served_model_name} at {endpoint.url} "
              f"(pid {endpoint.pid}, log {endpoint.log_path}); key: ${recipe.serving.api_key_env} or "
              f"{record_dir / 'api_key'}; stop: ktflow serve {args.recipe} --stop")
    return 0


def _serve_dry_run(recipe, record_dir: Path, *, as_json: bool) -> int:
    import shlex

    from ktflow.stages.weights import expected_training_weights

    model_dir = expected_training_weights(recipe).absolute()
    adapter = recipe.store.layout.adapter("<trained adapter>").absolute()
    if recipe.serving.backend == "llamafactory":
        from ktflow.stages.serve import render_llamafactory_api

        argv, env, infer = render_llamafactory_api(recipe, model_dir=model_dir, adapter_dir=adapter,
                                                   train_python=recipe.toolchains.train.python.absolute(),
                                                   config_dir=record_dir)
        document = {"argv": argv, "env": env, "infer_config": infer}
    else:
        from ktflow.host.hardware import probe_host
        from ktflow.stages.sglang_launch import render_sglang_launch
        from ktflow.stages.weights import expected_source, serving_weights

        source = expected_source(recipe).absolute()
        model_dir, weights = serving_weights(recipe, source_dir=source, bf16_dir=model_dir if model_dir != source else None)
        assert weights is not None
        # The command is for the GPU serving host, not necessarily this one: render it for a host
        # with the GPUs and cores the recipe asks for (the real host is checked at launch).
        from ktflow.host.hardware import GpuInfo

        here = probe_host(recipe.store.root)
        serving_host = here.model_copy(update={
            "gpus": here.gpus or [GpuInfo(index=i, name="serving-host GPU", vram_bytes=0)
                                  for i in range(recipe.serving.gpus)],
            "physical_cores": max(here.physical_cores, recipe.serving.kt_cpuinfer or 0),
        })
        notes = []
        if (Path(model_dir) / "config.json").is_file():  # the view the serve stage gives sglang-kt, if any
            from ktflow.stages.serve.sglang_inputs import model_view_plan, sglang_model_view

            view = sglang_model_view(model_dir, record_dir, create=False)
            if view != Path(model_dir).absolute():
                notes.append(f"--model-path: a view of {model_dir} the serve stage makes at start "
                             f"({model_view_plan(model_dir).reason})")  # type: ignore[union-attr]
            model_dir = view
        if recipe.serving.kt_method == "AMXINT8":
            notes.append("--kt-weight-path: with an adapter that carries an expert LoRA (a KT SFT adapter), the "
                         "serve stage serves kt-kernel's .kt layout of these INT8 weights, written once into the "
                         "store at start")
        launch = render_sglang_launch(recipe, model_dir=model_dir, kt_weight_dir=weights.absolute(), adapter_dir=adapter,
                                      serve_python=recipe.toolchains.serve.python.absolute(),
                                      host=serving_host, check_files=False)
        document = {"argv": launch.argv, "env": launch.env}
        if launch.int8_threadpool_count is not None:
            document["int8_threadpool_count"] = launch.int8_threadpool_count
        if notes:
            document["notes"] = notes
    if as_json:
        _print_json(document)
    else:
        env_text = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in document["env"].items())
        out.print((env_text + " " if env_text else "") + shlex.join(document["argv"]), markup=False, soft_wrap=True)
        for note in document.get("notes", []):
            _say(f"note: {note}")
    return 0


def _version_number(text: str) -> int:
    from ktflow.errors import InvalidInputError

    digits = text.lower().removeprefix("v")
    if not digits.isdigit() or int(digits) < 1:
        raise InvalidInputError(f"VERSION {text!r}", "is not a version number", "give one as `ktflow adapters` lists "
                                "them: 3 or v3")
    return int(digits)


def _production_weights(recipe) -> dict[str, Any]:
    """What a promotion serves an adapter on: the serving weights, and the base adapters train on."""
    from ktflow.stages.weights import ensure_serving_weights, ensure_source, ensure_training_weights

    source = ensure_source(recipe)
    trained_on = ensure_training_weights(recipe, source=source)
    model_dir, kt_weights = ensure_serving_weights(recipe, source_dir=source, bf16_dir=trained_on
                                                   if trained_on != source else None, log=_say)
    return {"model_dir": model_dir, "kt_weight_dir": kt_weights, "base_dir": trained_on}


def _say(line: str) -> None:
    err.print(line, markup=False, highlight=False)


def cmd_adapters(args: argparse.Namespace) -> int:
    """The versions of the recipe's adapter, which one serves, and a move a crash interrupted."""
    from ktflow.registry import summarize
    from ktflow.stages.promotion import registry_of
    from ktflow.stages.serve import is_alive, read_endpoint

    recipe = _load(args)
    registry = registry_of(recipe)
    document = summarize(registry)
    endpoint = read_endpoint(_serving_dir(recipe))
    alive = endpoint is not None and is_alive(endpoint)
    document["serving"] = ({"url": endpoint.url, "version": endpoint.adapter_version,
                            "adapter_dir": str(endpoint.adapter_dir), "state": endpoint.state} if alive else None)
    if args.json:
        _print_json(document)
        return 0
    table = Table(title=f"{recipe.name}: adapter versions", title_justify="left")
    for column in ("version", "created", "trigger", "dataset", "verdict", "status"):
        table.add_column(column)
    production = document["production"]
    for v in registry.versions():
        status = "production" if v.version == production else ("previous" if v.version == document["previous"] else "")
        if status == "production" and not alive:
            status = "production (endpoint not running)"
        verdict = f"{v.verdict.status}: {v.verdict.summary}" if v.verdict else "not judged"
        table.add_row(v.label, v.created_at.replace("T", " ")[:19], str(v.lineage.trigger),
                      v.lineage.dataset_digest[:12], verdict, status)
    out.print(table)
    if document["pending_move"]:
        move = document["pending_move"]
        out.print(f"[yellow]a move v{move['from_version']} -> v{move['to_version']} was interrupted[/]; the next "
                  f"`ktflow promote`, `ktflow rollback` or run finishes or undoes it")
    if alive:
        out.print(f"serving: {endpoint.url}" + (f" (v{endpoint.adapter_version})" if endpoint.adapter_version else ""))
    else:
        out.print("serving: nothing is running")
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    """Serve a version as production: health-gated and smoke-tested; idempotent."""
    from ktflow.stages.promotion import promote_version

    recipe = _load(args)
    moved = promote_version(recipe, _version_number(args.version), why="ktflow promote", log=_say,
                            **_production_weights(recipe))
    _announce(recipe, moved, "ktflow promote")
    out.print(f"{recipe.name}: {moved.summary()} at {moved.endpoint.url}")
    return 0


def _announce(recipe, moved, why: str) -> None:
    """``ktflow.adapter.promoted`` on the Prefect server this shell points at (PREFECT_API_URL), so a
    hand-made move reaches the same notifications as the pipeline's; nothing without a server."""
    from prefect.settings import PREFECT_API_URL

    if not moved.moved or not PREFECT_API_URL.value():
        return
    from prefect.events.worker import EventsWorker

    from tasks.promote import emit_moved

    emit_moved(recipe, moved, why)
    EventsWorker.drain_all()  # delivered before this process exits


def cmd_rollback(args: argparse.Namespace) -> int:
    """Serve the version production pointed at before its last move."""
    from ktflow.stages.promotion import rollback

    recipe = _load(args)
    moved = rollback(recipe, log=_say, **_production_weights(recipe))
    _announce(recipe, moved, "ktflow rollback")
    out.print(f"{recipe.name}: rolled back: {moved.summary()} at {moved.endpoint.url}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from ktflow.stages.evaluate import evaluate_base_vs_tuned
    from ktflow.stages.serve import adapter_model_name, api_key_for, read_endpoint
    from ktflow.stages.weights import ensure_training_weights

    recipe = _load(args)
    endpoint = read_endpoint(_serving_dir(recipe))
    key = api_key_for(endpoint) if endpoint is not None and endpoint.url.rstrip("/") == args.endpoint.rstrip("/") else None
    key = key or os.environ.get(recipe.serving.api_key_env)
    if not key:
        from ktflow.errors import InvalidInputError

        raise InvalidInputError(recipe.serving.api_key_env, "no API key for the endpoint",
                                f"export {recipe.serving.api_key_env}=<the server's key>")
    # sglang: the base model is a server of its own (sglang-kt without an adapter), its experts the serving ones
    weights = _production_weights(recipe) if recipe.serving.backend == "sglang" else None
    result = evaluate_base_vs_tuned(recipe, model_dir=weights["base_dir"] if weights else ensure_training_weights(recipe),
                                    tuned_url=args.endpoint, tuned_model=adapter_model_name(recipe), api_key=key,
                                    out_dir=recipe.store.layout.evaluation(recipe.name).absolute(),
                                    log=lambda line: err.print(line, markup=False, highlight=False),
                                    kt_weight_dir=weights["kt_weight_dir"] if weights else None)
    out.print(result.table, markup=False)
    overlap = result.contamination
    out.print(overlap.summary() + (f": {overlap.named()}" if overlap.count else ""), markup=False)
    out.print(f"adapter applied: {'yes' if result.adapter_applied else 'NO'}; promoted: "
              f"{'yes' if result.promoted else 'no'} (on {result.gate_metric}); report: {result.report_md}")
    failure = result.gate_failure()
    if failure:
        from ktflow.errors import PromotionGateError

        raise PromotionGateError(failure)
    return 0 if result.adapter_applied else 1


_API_GUARDIAN: Any = None


def _embedded_prefect(verbose: bool) -> None:
    """Prefect's ephemeral API with state under the project: no server to start. A
    PREFECT_API_URL set by the user (a real server) wins; ktflow never overrides the environment.

    Prefect's own console lines (state changes, and a traceback for every failed task and flow)
    are shown with ``--verbose`` only: without it a failed run ends in one ``error:`` line. Its
    logs still reach the API at INFO, so the UI shows every task's log.
    """
    global _API_GUARDIAN
    home = Path(os.environ.setdefault("PREFECT_HOME", str(Path(".ktflow/prefect").absolute())))
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


def _print_stages(title: str, outcome: dict) -> None:
    table = Table(title=title)
    for column in ("stage", "runs", "why", "result"):
        table.add_column(column)
    here = f"{Path.cwd()}{os.sep}"
    for row in outcome["stages"]:
        table.add_row(row["stage"], row["runs"], row["why"], row["result"].replace(here, ""))
    out.print(table)


def cmd_run(args: argparse.Namespace) -> int:
    """The whole pipeline as one Prefect flow, in-process on Prefect's ephemeral API."""
    recipe = _load(args)
    _embedded_prefect(args.verbose)
    from flows.pipeline import pipeline

    outcome = pipeline(recipe)
    if args.json:
        _print_json(outcome)
        return 0
    _print_stages(f"ktflow run {recipe.name}", outcome)
    if "endpoint" in outcome:
        out.print(f"endpoint: {outcome['endpoint']} (stop it with: ktflow serve {args.recipe} --stop)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The pipeline flow on the CPU demo: a tiny model and dataset made locally, every stage for real."""
    import time

    from ktflow.demo import ensure_demo_model, write_demo_dataset
    from ktflow.recipe import load_recipe
    from ktflow.stages.serve import SMOKE_PROMPT, adapter_model_name, api_key_for, read_endpoint, smoke_test

    os.chdir(_demo_checkout())
    recipe = load_recipe(DEMO_RECIPE)
    source = recipe.source.local_path
    assert source is not None, "the demo recipe uses a local source"
    if ensure_demo_model(source):
        err.print(f"[bold]fixture[/]: made the tiny Kimi-K2.5-format checkpoint in {source}")
    write_demo_dataset(Path(recipe.dataset.files[0]).parent)
    _embedded_prefect(args.verbose)
    from flows.pipeline import pipeline

    err.print("[bold]ktflow-pipeline[/]: download -> dequantize -> sft -> convert-lora -> quantize-int8 -> evaluate "
              "the candidate -> serve it if it passed, on Prefect's embedded API (state in .ktflow/prefect)")
    started = time.monotonic()
    state = pipeline(recipe, return_state=True)
    outcome = state.result()  # raises the failed stage's error
    _print_stages(f"demo pipeline ({recipe.name}): {state.name} in {time.monotonic() - started:.1f} s", outcome)

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
    candidates.append(Path(__file__).resolve().parent.parent)
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


# --------------------------------------------------------------------------- parser


def cmd_worker(args: argparse.Namespace) -> int:
    """Start a Prefect worker on every pool this host qualifies for (or the ones asked for)."""
    from ktflow.host.hardware import probe_host
    from ktflow.host.worker import choose_pools, pool_verdicts, run_workers, worker_launches

    if args.create_pools:
        from ktflow.host.worker import create_pools

        create_pools(log=lambda line: err.print(line))
        return 0
    host = probe_host()
    if args.list:
        verdicts = pool_verdicts(host)
        if args.json:
            _print_json({"host": host.hostname, "cpu_variant": host.cpu_variant,
                         "pools": [v.model_dump(mode="json") for v in verdicts]})
            return 0
        table = Table(title=f"work pools for host {host.hostname} ({host.cpu_variant})")
        for column in ("pool", "runs", "this host"):
            table.add_column(column)
        for v in verdicts:
            stages = ", ".join(v.stages) or v.role
            table.add_row(v.pool, stages, "[green]qualifies[/]" if v.qualifies else "[red]" + "; ".join(v.missing) + "[/]")
        out.print(table)
        return 0
    pools = choose_pools(host, args.pool or ())
    toolchains = {}
    for item in args.toolchain or ():
        role, sep, block = item.partition("=")
        if not sep or role not in ("train", "serve") or not block:
            raise InvalidInputError(f"--toolchain {item}", "expected ROLE=BLOCK with ROLE train or serve",
                                    "e.g. --toolchain train=gpu1-train (a ktflow Toolchain block)")
        toolchains[role] = block
    launches = worker_launches(pools, host_name=args.name or host.hostname, checkout=Path(args.checkout).absolute(),
                               toolchain_blocks=toolchains, store_root=Path(args.store_root) if args.store_root else None,
                               artifacts_block=args.artifacts)
    if args.dry_run:
        _print_json([launch.model_dump(mode="json") for launch in launches])
        return 0
    if not os.environ.get("PREFECT_API_URL"):
        err.print("[yellow]PREFECT_API_URL is not set: the workers will talk to the profile's API "
                  "(`prefect config view`)[/]")
    return run_workers(launches, log=lambda line: err.print(line))


def cmd_dataset_publish(args: argparse.Namespace) -> int:
    """Validate a dataset for a recipe and announce it: the retrain deployment's trigger starts a run."""
    from flows.events import publish_dataset

    event = publish_dataset(Path(args.recipe), Path(args.path))
    if args.json:
        _print_json(event)
    else:
        out.print(f"published {event['payload']['path']} ({event['payload']['records']} records, "
                  f"sha256 {event['payload']['sha256'][:12]}) as {event['event']} for {event['resource']}")
    return 0


def _add_recipe(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", metavar="RECIPE", help="recipe YAML file (see recipes/)")
    _add_set(parser)


def _add_set(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set", action="append", metavar="KEY=VALUE", default=[],
        help="override a recipe field, e.g. --set sft.max_steps=10 (repeatable)",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive (got {value})")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ktflow",
        description="Fine-tune and serve giant MoE models with KTransformers, LlamaFactory and SGLang.",
    )
    parser.add_argument("--version", action="version", version=f"ktflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=func)
        return p

    p = add("doctor", cmd_doctor, "probe this host; with --recipe, say which stages it can run")
    p.add_argument("--recipe", metavar="FILE")
    _add_set(p)
    p.add_argument("--json", action="store_true", help="print one JSON document")

    p = add("plan", cmd_plan, "predict each stage's disk, RAM, GPU memory, GPUs and time on a host, and what fits")
    p.add_argument("recipe", metavar="RECIPE")
    _add_set(p)
    p.add_argument("--host", metavar="FILE", help="plan for the host `ktflow doctor --json` described in FILE")
    p.add_argument("--json", action="store_true", help="print one JSON document")

    p = add("fixture", cmd_fixture, "write a tiny random MoE checkpoint in a real model's format")
    p.add_argument("kind", choices=FIXTURE_KINDS)
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--layers", type=_positive_int, default=3)
    p.add_argument("--experts", type=_positive_int, default=8)
    p.add_argument("--hidden", type=_positive_int, default=256)
    p.add_argument("--moe-intermediate", type=_positive_int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--full-size", action="store_true",
                   help="deepseek-v2-lite only: the real model's dimensions (15.7B parameters, 31 GB on disk)")
    p.add_argument("--architecture", choices=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
                   default="DeepseekV2ForCausalLM",
                   help="deepseek-v2-lite only: the model class (V3: DeepSeek-V3 routing, which kt-kernel 0.7.2 trains)")
    # choices: ktflow.fixtures.checkpoints.FIXTURE_SIZES
    p.add_argument("--size", choices=("tiny", "bigger-than-gpu"), default="tiny",
                   help="kimi-k2.5 only: bigger-than-gpu = Kimi's widths, 8 layers of 180 experts (57.1B parameters, "
                        "114 GB in BF16, 34.4 GB on disk), streamed one layer per shard")

    p = add("inspect", cmd_inspect, "detect a checkpoint's format and validate its files")
    p.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR")
    p.add_argument("--json", action="store_true")

    _add_stage_commands(add)
    _add_run_commands(add)
    _add_promotion_commands(add)
    _add_host_commands(add)
    return parser


_Add = Callable[[str, Callable[[argparse.Namespace], int], str], argparse.ArgumentParser]


def _add_stage_commands(add: _Add) -> None:
    """One command per artifact stage: download, dequantize, sft, convert-lora, quantize-int8."""
    p = add("download", cmd_download, "fetch the recipe's source checkpoint (pinned, verified)")
    _add_recipe(p)

    p = add("dequantize", cmd_dequantize, "INT4/FP8 -> BF16, streaming and bit-exact")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--workers", type=_positive_int, help="tensors decoded in parallel (default: physical cores)")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync before publishing each shard")

    p = add("sft", cmd_sft, "LoRA SFT through LlamaFactory")
    _add_recipe(p)
    p.add_argument("--dry-run", action="store_true", help="print the rendered config and launch command")
    p.add_argument("--json", action="store_true", help="with --dry-run: one JSON object")

    p = add("convert-lora", cmd_convert_lora, "convert/validate an adapter for SGLang")
    p.add_argument("adapter_dir", metavar="ADAPTER_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--base", required=True, metavar="MODEL_DIR")
    p.add_argument("--serve-python", default=".venv-serve/bin/python", metavar="PYTHON",
                   help="python of the serving toolchain (kt-kernel), for KT fused adapters")
    p.add_argument("--lora-alpha", type=float, help="only for adapters whose config lacks lora_alpha")

    p = add("quantize-int8", cmd_quantize_int8, "BF16 experts -> kt-kernel AMXINT8 CPU weights")
    p.add_argument("bf16_dir", metavar="BF16_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--threadpool-count", type=_positive_int, required=True, metavar="T",
                   help="NUMA thread pools; serve with the same --kt-threadpool-count")
    p.add_argument("--workers", type=_positive_int, help="CPU threads for kt-kernel (default: physical cores)")
    p.add_argument("--serve-python", default=".venv-serve/bin/python", metavar="PYTHON",
                   help="python of the serving toolchain (kt-kernel)")
    p.add_argument("--no-fsync", action="store_true")


def _add_run_commands(add: _Add) -> None:
    """Serving, evaluation and whole-pipeline runs."""
    p = add("serve", cmd_serve, "serve the tuned model behind an OpenAI-compatible API")
    _add_recipe(p)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--stop", action="store_true", help="stop the recipe's running server")

    p = add("eval", cmd_eval, "evaluate base vs tuned through an endpoint")
    _add_recipe(p)
    p.add_argument("--endpoint", required=True, metavar="URL")

    p = add("run", cmd_run, "run the whole pipeline (embedded Prefect)")
    _add_recipe(p)
    p.add_argument("--verbose", action="store_true", help="show Prefect's task logs")
    p.add_argument("--json", action="store_true", help="print the stage summary as one JSON document")

    p = add("demo", cmd_demo, "the pipeline flow on a tiny model and dataset made locally (CPU)")
    p.add_argument("--verbose", action="store_true", help="show Prefect's task logs")


def _add_promotion_commands(add: _Add) -> None:
    """Adapter versions and what serves: list, promote, roll back."""
    p = add("adapters", cmd_adapters, "list the recipe's adapter versions, their lineage and verdicts, and which serves")
    _add_recipe(p)
    p.add_argument("--json", action="store_true", help="print one JSON document")

    p = add("promote", cmd_promote, "serve an adapter version as production (health-gated, smoke-tested)")
    _add_recipe(p)
    p.add_argument("version", metavar="VERSION", help="the version: 3 or v3 (see `ktflow adapters`)")

    p = add("rollback", cmd_rollback, "serve the version production pointed at before its last move")
    _add_recipe(p)


def _add_host_commands(add: _Add) -> None:
    """Workers and dataset versions: the distributed side."""
    p = add("worker", cmd_worker, "join the Prefect work pools this host qualifies for")
    p.add_argument("--pool", action="append", metavar="POOL", help="a pool to join (repeatable; default: all that qualify)")
    p.add_argument("--name", metavar="HOST", help="the host name the worker advertises (default: hostname)")
    p.add_argument("--checkout", default=".", metavar="DIR", help="this host's ktflow checkout (default: .)")
    p.add_argument("--toolchain", action="append", metavar="ROLE=BLOCK",
                   help="this host's Toolchain block for train or serve (repeatable)")
    p.add_argument("--store-root", metavar="DIR",
                   help="this host's own store (hosts without a shared one: the recipe sets store.artifacts)")
    p.add_argument("--artifacts", metavar="BLOCK",
                   help="this host's ktflow ArtifactStore block: the artifact store's URL and credentials")
    p.add_argument("--list", action="store_true", help="list the pools and whether this host qualifies")
    p.add_argument("--create-pools", action="store_true",
                   help="create ktflow's work pools on the server (before `prefect deploy`), then exit")
    p.add_argument("--dry-run", action="store_true", help="print the worker commands instead of starting them")
    p.add_argument("--json", action="store_true", help="with --list: one JSON document")

    p = add("dataset", lambda a: a.dataset_parser.error("say what to do: publish"), "dataset versions")
    p.set_defaults(dataset_parser=p)
    dsub = p.add_subparsers(dest="dataset_command", metavar="ACTION")
    q = dsub.add_parser("publish", help="validate a dataset and emit dataset.version.published (starts a retrain)",
                        description="validate a dataset and emit dataset.version.published (starts a retrain)")
    q.set_defaults(func=cmd_dataset_publish)
    q.add_argument("path", metavar="PATH", help="the new dataset file")
    q.add_argument("--recipe", required=True, metavar="FILE", help="the recipe to retrain with it")
    q.add_argument("--json", action="store_true")


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so every cleanup path (tool trees, staging dirs) runs."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    import signal

    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _raise_terminated)
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "json", False) and getattr(args, "dry_run", None) is False and args.command in ("sft", "serve"):
        parser.error("--json goes with --dry-run")
    try:
        return args.func(args)
    except KtflowError as exc:
        err.print(f"[red]error:[/] {exc}", soft_wrap=True)
        return exc.exit_code
    except _Terminated:
        err.print("[red]terminated[/]")
        return 143
    except KeyboardInterrupt:
        err.print("[red]interrupted[/]")
        return 130
    except Exception as exc:  # unexpected: say so plainly, with the traceback on request
        if os.environ.get("KTFLOW_DEBUG"):
            raise
        err.print(f"[red]internal error:[/] {type(exc).__name__}: {exc} (set KTFLOW_DEBUG=1 for the traceback)",
                  soft_wrap=True)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
