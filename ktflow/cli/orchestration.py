"""The distributed side: Prefect workers (``worker``) and dataset versions (``dataset publish``); and the host's
install: ``preflight`` before the GPU toolchains are installed, ``smoke-check`` after."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.table import Table

from ktflow.cli._common import (
    _Add,
    _add_recipe,
    _load,
    _print_json,
    err,
    out,
)
from ktflow.errors import InvalidInputError

_VERDICT_COLOR = {"ok": "green", "missing": "red", "warn": "yellow", "skipped": "dim"}


def _verdict(verdict: str) -> str:
    """``ok``/``missing``/``warn``/``skipped``, colored and padded to one width."""
    return f"[{_VERDICT_COLOR[verdict]}]{verdict:<7}[/]"


def cmd_preflight(args: argparse.Namespace) -> int:
    """What this host lacks for the KT training and serving toolchains, and how to get it (exit 2 if anything)."""
    from ktflow.host.preflight import INSTALL_DISK_BYTES, preflight, probe_facts

    facts = probe_facts(python=args.python, disk_path=args.disk_path)
    report = preflight(facts, gpu=not args.no_gpu, disk_needed=INSTALL_DISK_BYTES)
    if args.json:
        _print_json({"facts": facts.model_dump(mode="json"), "ok": report.ok,
                     "findings": [f.model_dump(mode="json") for f in report.findings]})
        return 0 if report.ok else 2
    out.print(f"preflight for the KT training and serving toolchains on {facts.cpu_model or 'this host'}:")
    for f in report.findings:
        out.print(f"  {_verdict(f.verdict)} {f.item}: {f.have} (needs {f.need})", soft_wrap=True)
        if f.fix:
            out.print(f"          -> {f.fix}", soft_wrap=True)
    if report.ok:
        out.print("[green]preflight: nothing missing[/]" + (" (GPU side not checked)" if args.no_gpu else ""))
        return 0
    missing = ", ".join(f.item for f in report.missing)
    err.print(f"[red]preflight: missing {missing}[/]: the lines marked -> say how to get each")
    return 2


def cmd_smoke_check(args: argparse.Namespace) -> int:
    """Import what each installed toolchain must run; exit 2 naming what failed."""
    from ktflow.host.preflight import run_smoke

    results = run_smoke({"serve": args.serve_python, "train": args.train_python}, gpu=not args.no_gpu)
    failed = [r for r in results if r.verdict == "missing"]
    if args.json:
        _print_json({"ok": not failed, "results": [r.model_dump(mode="json") for r in results]})
        return 2 if failed else 0
    table = Table(title="smoke check of the installed toolchains")
    for column in ("toolchain", "check", "result"):
        table.add_column(column)
    for r in results:
        table.add_row(r.toolchain, f"{_verdict(r.verdict)} {r.name}", r.detail)
    out.print(table)
    if failed:
        err.print(f"[red]smoke check failed: {', '.join(f'{r.toolchain}: {r.name}' for r in failed)}[/]")
        return 2
    return 0


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


def cmd_dataset_check(args: argparse.Namespace) -> int:
    """Validate a recipe's training records (and its held-out evaluation records) as the stages will read them."""
    from ktflow.formats.dataset import validate_dataset

    recipe = _load(args)
    result: dict[str, object] = {"train": {"files": [str(f) for f in recipe.dataset.files],
                                           "format": recipe.dataset.format,
                                           "records": validate_dataset(recipe.dataset)}}
    if recipe.evaluation.enabled and recipe.evaluation.files:
        from ktflow.stages.evaluate import load_eval_records

        result["evaluation"] = {"files": [str(f) for f in recipe.evaluation.files],
                                "format": recipe.evaluation.format,
                                "records": len(load_eval_records(recipe.evaluation))}
    if args.json:
        _print_json(result)
        return 0
    for role, found in result.items():
        assert isinstance(found, dict)
        out.print(f"{role}: {found['records']} good record(s) in {', '.join(found['files'])} ({found['format']})",
                  soft_wrap=True, highlight=False)
    return 0


def add_host_commands(add: _Add) -> None:
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

    p = add("preflight", cmd_preflight,
            "say what this host lacks for the KT training and serving toolchains, and how to get it")
    p.add_argument("--python", default="python3", metavar="PYTHON",
                   help="the Python the toolchains' venvs will be made with (default: python3)")
    p.add_argument("--disk-path", default=".", metavar="DIR",
                   help="where the venvs and uv's cache go: the checkout (default: .)")
    p.add_argument("--no-gpu", action="store_true",
                   help="skip the GPU side (driver, GPUs, nvcc, g++): a machine that only installs")
    p.add_argument("--json", action="store_true", help="print one JSON document")

    p = add("smoke-check", cmd_smoke_check,
            "import what the installed KT toolchains must run: sglang's server, kt-kernel, LlamaFactory-kt, the GPU")
    p.add_argument("--serve-python", default=".venv-serve/bin/python", metavar="PYTHON",
                   help="the serving toolchain's python (default: .venv-serve/bin/python)")
    p.add_argument("--train-python", default=".venv-kt-train/bin/python", metavar="PYTHON",
                   help="the KT training toolchain's python (default: .venv-kt-train/bin/python)")
    p.add_argument("--no-gpu", action="store_true", help="run only the CPU checks (a machine without a GPU)")
    p.add_argument("--json", action="store_true", help="print one JSON document")

    p = add("dataset", lambda a: a.dataset_parser.error("say what to do: check or publish"), "dataset versions")
    p.set_defaults(dataset_parser=p)
    dsub = p.add_subparsers(dest="dataset_command", metavar="ACTION")
    q = dsub.add_parser("publish", help="validate a dataset and emit dataset.version.published (starts a retrain)",
                        description="validate a dataset and emit dataset.version.published (starts a retrain)")
    q.set_defaults(func=cmd_dataset_publish)
    q.add_argument("path", metavar="PATH", help="the new dataset file")
    q.add_argument("--recipe", required=True, metavar="FILE", help="the recipe to retrain with it")
    q.add_argument("--json", action="store_true", help="print one JSON document")
    q = dsub.add_parser("check", help="validate a recipe's training and evaluation records, every bad one by file:line",
                        description="validate a recipe's training and evaluation records, every bad one by file:line")
    q.set_defaults(func=cmd_dataset_check)
    _add_recipe(q)
    q.add_argument("--json", action="store_true", help="print one JSON document")
