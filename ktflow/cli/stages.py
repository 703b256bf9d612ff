"""One command per artifact stage (download, dequantize, sft, convert-lora, quantize-int8), and the
checkpoint tools: ``fixture`` and ``inspect``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.table import Table

from ktflow.cli._common import (
    FIXTURE_KINDS,
    _Add,
    _add_recipe,
    _load,
    _positive_int,
    _print_json,
    err,
    out,
)
from ktflow.errors import InvalidInputError
from ktflow.units import human_bytes


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
        if result.batch:
            out.print(f"sft: {result.batch}", markup=False)
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


def cmd_merge(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ktflow.stages.merge import merge_adapter

    columns = (TextColumn(f"merge as {args.method}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("merge", total=None)
        result = merge_adapter(
            Path(args.base_dir), Path(args.adapter_dir), Path(args.out_dir), method=args.method,
            threadpool_count=args.threadpool_count, serve_python=Path(args.serve_python), workers=args.workers,
            fsync=not args.no_fsync, progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    state = ("cache hit" if result.cached else
             f"{result.tensors_merged} weights merged, {result.shards} shards ({result.shards_reused} reused)"
             + (f", {result.kt_layers} kt-kernel layers" if result.kt_layers else "") + f" in {result.seconds:.1f} s")
    out.print(f"merge: {state} -> {result.path}", markup=False, soft_wrap=True)
    out.print("serve it with: " + " ".join(f"{flag} {value}" for flag, value in result.serve_flags.items()),
              markup=False, soft_wrap=True)
    return 0


def _print_int8(result) -> None:
    errors = ", ".join(f"layer {k}: {v.get('mean_rel_err', float('nan')):.4f}" for k, v in result.verification.items()
                       if isinstance(v, dict))
    state = ("cache hit" if result.cached
             else f"{result.layers} layers ({result.layers_reused} reused) in {result.seconds:.1f} s")
    out.print(f"quantize-int8: {state}, T={result.threadpool_count}, AMXINT8 check {errors or '-'} -> {result.path}")


def add_checkpoint_commands(add: _Add) -> None:
    """Checkpoint tools: fixture, inspect."""
    p = add("fixture", cmd_fixture, "write a random MoE checkpoint in a real model's format: tiny by default, "
            "or at full width (--full-size, --size) up to a 57B model or a slice of Kimi-K2.5")
    p.add_argument("kind", choices=FIXTURE_KINDS, metavar="KIND",
                   help=f"the model whose checkpoint format it imitates: {', '.join(FIXTURE_KINDS)}")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the folder to write the checkpoint into")
    p.add_argument("--layers", type=_positive_int, default=3,
                   help="decoder layers, the first one dense (default 3); with --size slice, Kimi-K2.5's first N")
    p.add_argument("--experts", type=_positive_int, default=8, help="routed experts in each MoE layer (default 8)")
    p.add_argument("--hidden", type=_positive_int, default=256, help="hidden size (default 256)")
    p.add_argument("--moe-intermediate", type=_positive_int, default=128,
                   help="each expert's intermediate size (default 128)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights: one seed, one checkpoint (default 0)")
    p.add_argument("--full-size", action="store_true",
                   help="deepseek-v2-lite only: the real model's dimensions (15.7B parameters, 31 GB on disk)")
    p.add_argument("--architecture", choices=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
                   default="DeepseekV2ForCausalLM",
                   help="deepseek-v2-lite only: the model class (V3: DeepSeek-V3 routing, which kt-kernel 0.7.2 trains)")
    # choices: ktflow.fixtures.checkpoints.FIXTURE_SIZES
    p.add_argument("--size", choices=("tiny", "bigger-than-gpu", "slice"), default="tiny",
                   help="kimi-k2.5 only: bigger-than-gpu = Kimi's widths, 8 layers of 180 experts (57.1B parameters, "
                        "114 GB in BF16, 34.4 GB on disk); slice = Kimi-K2.5's first --layers layers at its true "
                        "geometry (384 experts, vocabulary 163840; ~9.5 GB of INT4 experts a MoE layer); both "
                        "streamed one layer per shard")

    p = add("inspect", cmd_inspect, "detect a checkpoint's format and validate its files")
    p.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="the checkpoint folder")
    p.add_argument("--json", action="store_true", help="print one JSON document")


def add_stage_commands(add: _Add) -> None:
    """One command per artifact stage: download, dequantize, sft, convert-lora, quantize-int8."""
    p = add("download", cmd_download, "fetch the recipe's source checkpoint (pinned, verified)")
    _add_recipe(p)

    p = add("dequantize", cmd_dequantize, "INT4/FP8 -> BF16, streaming and bit-exact")
    p.add_argument("src", metavar="SRC", help="the INT4 (compressed-tensors) or FP8 checkpoint folder")
    p.add_argument("dst", metavar="DST", help="the folder to write the BF16 checkpoint into")
    p.add_argument("--workers", type=_positive_int, help="tensors decoded in parallel (default: physical cores)")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync before publishing each shard")

    p = add("sft", cmd_sft, "LoRA SFT through LlamaFactory")
    _add_recipe(p)
    p.add_argument("--dry-run", action="store_true", help="print the rendered config and launch command")
    p.add_argument("--json", action="store_true", help="with --dry-run: one JSON object")

    p = add("convert-lora", cmd_convert_lora, "convert/validate an adapter for SGLang")
    p.add_argument("adapter_dir", metavar="ADAPTER_DIR", help="the adapter the sft stage published")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the folder to write the converted adapter into")
    p.add_argument("--base", required=True, metavar="MODEL_DIR",
                   help="the base checkpoint the adapter was trained on: every tensor is checked against it")
    p.add_argument("--serve-python", default=".venv-serve/bin/python", metavar="PYTHON",
                   help="python of the serving toolchain (kt-kernel), for KT fused adapters")
    p.add_argument("--lora-alpha", type=float, help="only for adapters whose config lacks lora_alpha")

    p = add("quantize-int8", cmd_quantize_int8, "BF16 or Kimi INT4 experts -> kt-kernel AMXINT8 CPU weights")
    p.add_argument("bf16_dir", metavar="SOURCE_DIR",
                   help="a BF16 checkpoint, or a Kimi-K2/K2.5 INT4 checkpoint as released (its experts decoded in "
                        "memory: no BF16 copy on disk); FP8 goes through dequantize first")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the folder to write the AMXINT8 weights into")
    p.add_argument("--threadpool-count", type=_positive_int, required=True, metavar="T",
                   help="NUMA thread pools; serve with the same --kt-threadpool-count")
    p.add_argument("--workers", type=_positive_int, help="CPU threads for kt-kernel (default: physical cores)")
    p.add_argument("--serve-python", default=".venv-serve/bin/python", metavar="PYTHON",
                   help="python of the serving toolchain (kt-kernel)")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync before publishing each layer")

    p = add("merge", cmd_merge, "fold a converted adapter into its base's weights, written as the server reads them")
    p.add_argument("base_dir", metavar="BASE_DIR",
                   help="the checkpoint the adapter was trained on: BF16, or a Kimi-K2/K2.5 INT4 checkpoint as released")
    p.add_argument("adapter_dir", metavar="ADAPTER_DIR", help="the converted adapter (`ktflow convert-lora`'s output)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the folder to write the merged weights into")
    p.add_argument("--method", required=True, choices=("BF16", "RAWINT4", "AMXINT8", "AMXINT4"),
                   help="the expert format, as sglang-kt's --kt-method names it: BF16, RAWINT4 (Kimi INT4 bases: "
                        "the source's scheme), or kt-kernel's AMXINT8 / AMXINT4")
    p.add_argument("--threadpool-count", type=_positive_int, default=1, metavar="T",
                   help="AMXINT8/AMXINT4: NUMA thread pools; serve with the same --kt-threadpool-count (default 1)")
    p.add_argument("--workers", type=_positive_int,
                   help="tensors merged at once (default 2); AMXINT8/AMXINT4: kt-kernel's CPU threads")
    p.add_argument("--serve-python", default=".venv-serve/bin/python", metavar="PYTHON",
                   help="AMXINT8/AMXINT4: python of the serving toolchain (kt-kernel)")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync before publishing each shard")
