"""What serves and how it does: ``serve``, ``eval``, and adapter versions (``adapters``, ``promote``,
``rollback``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from rich.table import Table

from ktflow.cli._common import (
    _Add,
    _add_recipe,
    _load,
    _positive_int,
    _print_json,
    _say,
    _serving_dir,
    err,
    out,
)


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
    """The launch ``ktflow serve`` would start for the trained adapter: the serve stage's own, with nothing made or
    started (the weights as the pipeline will have them, the adapter as a placeholder)."""
    import shlex

    from ktflow.stages.serve import dry_run
    from ktflow.stages.weights import expected_source, expected_training_weights, serving_weights

    trained_on = expected_training_weights(recipe).absolute()
    model_dir, kt_weights = trained_on, None
    if recipe.serving.backend == "sglang":
        source = expected_source(recipe).absolute()
        model_dir, kt_weights = serving_weights(recipe, source_dir=source,
                                                bf16_dir=trained_on if trained_on != source else None)
    launch = dry_run(recipe, model_dir=model_dir, adapter_dir=recipe.store.layout.adapter("<trained adapter>").absolute(),
                     kt_weight_dir=kt_weights, record_dir=record_dir)
    document = {"argv": launch.argv, "env": launch.env, **launch.details}
    if as_json:
        _print_json(document)
    else:
        env_text = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in launch.env.items())
        out.print((env_text + " " if env_text else "") + shlex.join(launch.argv), markup=False, soft_wrap=True)
        for note in launch.details.get("notes", []):
            _say(f"note: {note}")
        if launch.details.get("serving_settings"):
            _say(str(launch.details["serving_settings"]))
    return 0


def cmd_tune_serving(args: argparse.Namespace) -> int:
    """Measure the serving engine's levers on this machine for the recipe's served model, choose the fastest
    correct configuration and keep it in the store, where `ktflow serve` applies it."""
    from ktflow.errors import InvalidInputError
    from ktflow.host.hardware import probe_host
    from ktflow.stages.serve import keep_levers, lever_candidates, measure_levers, resolve_api_key, server_measurement
    from ktflow.stages.serve.lever_runs import loss_records
    from ktflow.stages.serve.levers import served_model
    from ktflow.stages.weights import ensure_serving_weights, ensure_source, ensure_training_weights

    if args.store:
        args.set = [*args.set, f"store.root={Path(args.store).absolute()}"]
    recipe = _load(args)
    serving = recipe.serving
    if serving.backend != "sglang":
        raise InvalidInputError("serving.backend", f"is '{serving.backend}'; the levers measured are sglang-kt's",
                                "set serving.backend: sglang to tune a GPU server")
    mode = serving.resolved_mode
    host = probe_host(recipe.store.root)
    source = ensure_source(recipe)
    trained_on = ensure_training_weights(recipe, source=source)
    model_dir, kt_weights = ensure_serving_weights(recipe, source_dir=source,
                                                   bf16_dir=trained_on if trained_on != source else None, log=_say)
    if args.adapter:
        adapter = Path(args.adapter).absolute()
    else:
        from ktflow.stages.promotion import registry_of

        production = registry_of(recipe).production_version()
        adapter = production.adapter_dir if production is not None else _served_adapter(recipe, trained_on)
    serving_dir = _serving_dir(recipe)
    serving_dir.mkdir(parents=True, exist_ok=True)
    key, _ = resolve_api_key(recipe, serving_dir)
    records = loss_records(recipe, model_dir, args.loss_records)
    if args.loss_records and not records:
        _say("served loss: not measured (the dataset files or the model's tokenizer are not here)")
    measure = server_measurement(recipe, model_dir=model_dir, adapter_dir=adapter, kt_weight_dir=kt_weights,
                                 record_dir=serving_dir / "tune-serving", api_key=key, mode=mode,
                                 requests=args.requests, max_tokens=args.max_tokens, records=records, log=_say)
    record = measure_levers(recipe, lever_candidates(recipe, host, mode), measure, machine=host.machine,
                            model=served_model(recipe, model_dir, mode),
                            gpu=host.gpus[0].name if host.gpus else None, log=_say)
    path = keep_levers(recipe.store.root, record)
    if args.json:
        _print_json({**record.model_dump(mode="json"), "path": str(path)})
        return 0 if record.choice is not None else 1
    _print_levers(record, recipe.name, mode)
    out.print(f"kept in {path}; `ktflow serve` on this machine applies it where the recipe leaves a setting unset",
              markup=False, soft_wrap=True)  # a path is copied from the terminal: never broken into lines
    return 0 if record.choice is not None else 1


def _print_levers(record, name: str, mode: str) -> None:
    """The levers' table and the choice."""
    from rich.markup import escape

    table = Table(title=f"{name}: serving levers on {record.machine} ({mode} mode)", title_justify="left")
    for column in ("lever", "decode tok/s", "vs baseline", "TTFT", "loss", "ok / why"):
        table.add_column(column)
    for run in record.runs:
        m = run.measurement
        decode = f"{m.decode_tokens_per_s:.1f}" if m is not None and m.decode_tokens_per_s else "-"
        ttft = f"{m.ttft_p50_s:.2f} s" if m is not None and m.ttft_p50_s is not None else "-"
        loss = f"{m.served_loss:.4f}" if m is not None and m.served_loss is not None else "-"
        vs = f"{run.vs_baseline:.2f}x" if run.vs_baseline is not None else "-"
        colour = "green" if run.correct else "red" if run.correct is False else "dim"
        verdict = f"[{colour}]{escape(run.verdict)}[/]"
        table.add_row(escape(run.candidate.name), decode, vs, ttft, loss, verdict)
    out.print(table)
    choice = record.choice
    out.print(escape(f"chosen: {choice.reason}") if choice is not None else
              "[red]nothing chosen[/]: the baseline did not serve (see its row)")


def cmd_eval(args: argparse.Namespace) -> int:
    from ktflow.stages.evaluate import evaluate_base_vs_tuned
    from ktflow.stages.serve import api_key_for, read_endpoint, tuned_model_name
    from ktflow.stages.weights import ensure_training_weights

    recipe = _load(args)
    endpoint = read_endpoint(_serving_dir(recipe))
    ours = endpoint is not None and endpoint.url.rstrip("/") == args.endpoint.rstrip("/")
    key = api_key_for(endpoint) if ours else None
    key = key or os.environ.get(recipe.serving.api_key_env)
    if not key:
        from ktflow.errors import InvalidInputError

        raise InvalidInputError(recipe.serving.api_key_env, "no API key for the endpoint",
                                f"export {recipe.serving.api_key_env}=<the server's key>")
    # sglang: the base model is a server of its own (sglang-kt without an adapter), its experts the serving ones
    weights = _production_weights(recipe) if recipe.serving.backend == "sglang" else None
    tuned = endpoint.model if ours and endpoint is not None else tuned_model_name(recipe)
    result = evaluate_base_vs_tuned(recipe, model_dir=weights["base_dir"] if weights else ensure_training_weights(recipe),
                                    tuned_url=args.endpoint, tuned_model=tuned, api_key=key,
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
    if not moved.moved:
        return
    try:
        from prefect.settings import PREFECT_API_URL
    except ImportError:  # a toolchain without Prefect (the GPU host's serving bundle): the move stands
        if os.environ.get("PREFECT_API_URL"):
            _say(f"PREFECT_API_URL is set but Prefect is not installed in {sys.executable}: "
                 "ktflow.adapter.promoted was not emitted")
        return
    if not PREFECT_API_URL.value():
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


def add_serve_commands(add: _Add) -> None:
    """Serving and evaluation: serve, tune-serving, eval."""
    p = add("serve", cmd_serve, "serve the tuned model behind an OpenAI-compatible API")
    _add_recipe(p)
    p.add_argument("--dry-run", action="store_true",
                   help="print the server's command line and environment the serve stage would start; start nothing")
    p.add_argument("--json", action="store_true", help="with --dry-run: print it as one JSON document")
    p.add_argument("--stop", action="store_true", help="stop the recipe's running server")

    p = add("tune-serving", cmd_tune_serving,
            "measure what each serving setting buys on this machine and keep the fastest correct one for `ktflow serve`")
    _add_recipe(p)
    p.add_argument("--store", metavar="DIR", help="the store to keep the measurement in (default: the recipe's "
                   "store.root, where `ktflow serve` and `ktflow plan` look for it)")
    p.add_argument("--adapter", metavar="DIR", help="serve this converted adapter while measuring (default: the "
                   "production version, else the trained adapter)")
    p.add_argument("--requests", type=_positive_int, default=3, metavar="N",
                   help="timed chat requests a configuration, one at a time (default 3)")
    p.add_argument("--max-tokens", type=_positive_int, default=256, metavar="N",
                   help="tokens each timed request generates (default 256)")
    p.add_argument("--loss-records", type=int, default=4, metavar="N",
                   help="training records whose served loss each configuration reports, to catch a fast but wrong "
                        "one (default 4; 0: none)")
    p.add_argument("--json", action="store_true", help="print the measurement as one JSON document")

    p = add("eval", cmd_eval, "evaluate base vs tuned through an endpoint")
    _add_recipe(p)
    p.add_argument("--endpoint", required=True, metavar="URL",
                   help="the OpenAI-compatible base URL to evaluate, e.g. http://127.0.0.1:30000/v1")


def add_promotion_commands(add: _Add) -> None:
    """Adapter versions and what serves: list, promote, roll back."""
    p = add("adapters", cmd_adapters, "list the recipe's adapter versions, their lineage and verdicts, and which serves")
    _add_recipe(p)
    p.add_argument("--json", action="store_true", help="print one JSON document")

    p = add("promote", cmd_promote, "serve an adapter version as production (health-gated, smoke-tested)")
    _add_recipe(p)
    p.add_argument("version", metavar="VERSION", help="the version: 3 or v3 (see `ktflow adapters`)")

    p = add("rollback", cmd_rollback, "serve the version production pointed at before its last move")
    _add_recipe(p)
