"""``ktflow serve --dry-run --json`` for every shipped recipe: the launch the serve stage would start, unchanged.

The expected documents in tests/data/serve-dry-run/ were rendered from the shipped recipes for a fixed serving host
(:func:`test_sglang_launch.fake_host`, so the host running the suite does not enter them), with the checkout's path
written as ``<repo>``. A change to what a recipe's server is started with shows here as a diff of its document;
regenerate them on purpose with ``KTFLOW_REGENERATE_DRY_RUN=1``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXPECTED = REPO / "tests" / "data" / "serve-dry-run"
RECIPES = sorted([*REPO.glob("recipes/*.yaml"), *REPO.glob("gpu_host/*.yaml"), *REPO.glob("benchmarks/recipes/*.yaml")])

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_sglang_launch import fake_host  # noqa: E402


def _expected_name(recipe_file: Path) -> str:
    return str(recipe_file.relative_to(REPO).with_suffix(".json")).replace("/", "--")


@pytest.mark.parametrize("recipe_file", RECIPES, ids=lambda p: str(p.relative_to(REPO)))
def test_dry_run_is_the_launch_of_the_shipped_recipe(recipe_file: Path, monkeypatch, capsys) -> None:
    import ktflow.host.hardware
    from ktflow.cli import main

    monkeypatch.setattr(ktflow.host.hardware, "probe_host", lambda *a, **k: fake_host(cores=64, gpus=8, numa=1))
    if main(["serve", str(recipe_file), "--dry-run", "--json"]) != 0:
        pytest.fail(f"ktflow serve {recipe_file} --dry-run --json failed")
    document = json.loads(capsys.readouterr().out.replace(str(REPO), "<repo>"))
    expected = EXPECTED / _expected_name(recipe_file)
    if os.environ.get("KTFLOW_REGENERATE_DRY_RUN"):
        expected.parent.mkdir(parents=True, exist_ok=True)
        expected.write_text(json.dumps(document, indent=2) + "\n")
    assert document == json.loads(expected.read_text()), f"the launch of {recipe_file.name} changed"


def test_every_shipped_recipe_has_its_expected_launch() -> None:
    assert sorted(p.name for p in EXPECTED.glob("*.json")) == sorted(_expected_name(p) for p in RECIPES)
