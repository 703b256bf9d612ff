"""The ``ktflow`` command line.

Exit codes: 0 success; 2 invalid input (bad arguments, recipe, checkpoint, dataset, host),
with the reason on stderr naming the file or field and the fix; 1 anything else.
``--json`` prints exactly one JSON document on stdout. Heavy modules (torch, transformers)
are imported only by the commands that need them, so ``doctor`` and ``--help`` are fast.

The commands live in one module per group: ``pipeline`` (doctor, plan, run, demo), ``stages`` (fixture,
inspect, download, dequantize, sft, convert-lora, quantize-int8), ``serving`` (serve, tune-serving, eval, adapters,
promote, rollback) and ``orchestration`` (worker, dataset); ``_common`` holds what they share.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable, Sequence

from ktflow import __version__
from ktflow.cli._common import (
    DEMO_RECIPE,
    FIXTURE_KINDS,
    _Add,
    _add_recipe,
    _add_set,
    _load,
    _positive_int,
    _print_json,
    _say,
    _serving_dir,
    err,
    out,
)
from ktflow.cli.orchestration import add_host_commands, cmd_dataset_publish, cmd_worker
from ktflow.cli.pipeline import (
    _demo_checkout,
    _duration,
    _embedded_prefect,
    _print_side_by_side,
    _print_stages,
    _with_plan_problems,
    add_planning_commands,
    add_run_commands,
    cmd_demo,
    cmd_doctor,
    cmd_plan,
    cmd_run,
)
from ktflow.cli.serving import (
    _announce,
    _production_weights,
    _serve_dry_run,
    _served_adapter,
    _version_number,
    add_promotion_commands,
    add_serve_commands,
    cmd_adapters,
    cmd_eval,
    cmd_promote,
    cmd_rollback,
    cmd_serve,
    cmd_tune_serving,
)
from ktflow.cli.stages import (
    _print_int8,
    _sft_dry_run,
    add_checkpoint_commands,
    add_stage_commands,
    cmd_convert_lora,
    cmd_dequantize,
    cmd_download,
    cmd_fixture,
    cmd_inspect,
    cmd_quantize_int8,
    cmd_sft,
)
from ktflow.errors import InvalidInputError, KtflowError
from ktflow.units import human_bytes

# What `from ktflow.cli import ...` gave when the command line was one module: every command and helper.
__all__ = [
    "DEMO_RECIPE", "FIXTURE_KINDS", "InvalidInputError", "KtflowError", "_Add", "_add_recipe", "_add_set", "_announce",
    "_demo_checkout", "_duration", "_embedded_prefect", "_load", "_positive_int", "_print_int8", "_print_json",
    "_print_side_by_side", "_print_stages", "_production_weights", "_say", "_serve_dry_run", "_served_adapter",
    "_serving_dir", "_sft_dry_run", "_version_number", "_with_plan_problems", "add_checkpoint_commands",
    "add_host_commands", "add_planning_commands", "add_promotion_commands", "add_run_commands", "add_serve_commands",
    "add_stage_commands", "build_parser", "cmd_adapters", "cmd_convert_lora", "cmd_dataset_publish", "cmd_demo",
    "cmd_dequantize", "cmd_doctor", "cmd_download", "cmd_eval", "cmd_fixture", "cmd_inspect", "cmd_plan",
    "cmd_promote", "cmd_quantize_int8", "cmd_rollback", "cmd_run", "cmd_serve", "cmd_sft", "cmd_tune_serving",
    "cmd_worker", "err",
    "human_bytes", "main", "out",
]


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

    add_planning_commands(add)
    add_checkpoint_commands(add)
    add_stage_commands(add)
    add_serve_commands(add)
    add_run_commands(add)
    add_promotion_commands(add)
    add_host_commands(add)
    return parser


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
