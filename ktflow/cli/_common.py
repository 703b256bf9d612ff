"""What every command group shares: the consoles, recipe loading, and the parser's argument helpers."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

# ktflow.fixtures.checkpoints.FIXTURE_KINDS, spelled out so that `ktflow --help` does not import torch
# (a test keeps them equal)
FIXTURE_KINDS = ("kimi-k2.5", "kimi-k2", "deepseek-v3", "bf16", "deepseek-v2-lite")
DEMO_RECIPE = Path("recipes/tiny-demo.yaml")


def _print_json(document: Any) -> None:
    sys.stdout.write(json.dumps(document, indent=2, sort_keys=False, default=str) + "\n")


def _load(args: argparse.Namespace):
    """Load the command's recipe; its relative paths (store, toolchains, data) are read against its project folder
    (:func:`ktflow.recipe.project_dir_of`), so they mean the same from any working directory."""
    from ktflow.recipe import load_recipe

    return load_recipe(Path(args.recipe).absolute(), args.set or ())


def _say(line: str) -> None:
    err.print(line, markup=False, highlight=False)


def _serving_dir(recipe) -> Path:
    from ktflow.stages.promotion import serving_dir

    return serving_dir(recipe)


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


_Add = Callable[[str, Callable[[argparse.Namespace], int], str], argparse.ArgumentParser]
