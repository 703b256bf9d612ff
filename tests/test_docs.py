"""The documentation site (mkdocs.yml, docs/): it builds with ``--strict``, so a broken link or anchor, or a
page left out of the navigation, fails the suite; and its generated references (docs/gen_reference.py, run
while the site builds) cover every recipe field and every ``ktflow`` command, walked here independently."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="mkdocs is not installed: the dev extra brings it (make env)")
pytest.importorskip("material", reason="mkdocs-material is not installed: the dev extra brings it (make env)")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as `make docs` builds it, into a temporary directory."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(REPO / "mkdocs.yml"), "--site-dir", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


def _recipe_keys() -> list[str]:
    """Every field of every model a recipe holds, as the dotted key `--set` takes."""
    from pydantic import BaseModel

    from ktflow.recipe import Recipe

    def models(annotation: object) -> list[type]:
        found = [annotation] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []
        return found + [m for arg in typing.get_args(annotation) for m in models(arg)]

    keys: list[str] = []

    def walk(prefix: str, model: type) -> None:
        for name, field in model.model_fields.items():
            keys.append(prefix + name)
            for sub in models(field.annotation):
                walk(f"{prefix}{name}.", sub)

    walk("", Recipe)
    return keys


def _commands() -> list[str]:
    """Every ``ktflow`` command, nested ones included (``dataset publish``)."""
    from ktflow.cli import build_parser

    names: list[str] = []

    def walk(parser: argparse.ArgumentParser, prefix: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    names.append(f"{prefix}{name}")
                    walk(sub, f"{prefix}{name} ")

    walk(build_parser(), "")
    return names


def test_the_site_builds_strict_and_every_page_is_in_it(site: Path) -> None:
    for page in ("index.html", "guides/one-machine/index.html", "reference/recipe/index.html",
                 "reference/cli/index.html", "architecture/index.html", "results/index.html",
                 "development/index.html"):
        assert (site / page).is_file(), page
    assert (site / "figures/plan-vs-measured.svg").read_text().startswith("<svg")
    architecture = (site / "architecture/index.html").read_text()
    assert "checksum_file" in architecture and "ktflow:stage-example" not in architecture


def test_the_recipe_reference_lists_every_field_of_every_recipe_model(site: Path) -> None:
    page = (site / "reference/recipe/index.html").read_text()
    keys = _recipe_keys()
    assert len(keys) > 100 and "sft.kt_config.kt_num_threads" in keys and "source.size.parameters" in keys
    missing = [key for key in keys if f"<code>{key}</code>" not in page]
    assert not missing, f"not in the generated recipe reference: {missing}"


def test_the_cli_reference_lists_every_command(site: Path) -> None:
    page = (site / "reference/cli/index.html").read_text()
    commands = _commands()
    assert {"doctor", "plan", "run", "promote", "rollback", "dataset publish"} <= set(commands)
    missing = [name for name in commands if f"<code>ktflow {name}</code>" not in page]
    assert not missing, f"not in the generated CLI reference: {missing}"


def test_no_internal_issue_numbers_where_users_read() -> None:
    """README and the site speak to users: no "#28" or "issue 23" (a machine called "H100 #2" is a name)."""
    reference = re.compile(r"(?i)\bissues?\s*#?\d+|(?<!H100 )(?<![\w&/])#\d+\b")
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    found = [f"{page.relative_to(REPO)}:{n}: {line.strip()}" for page in pages
             for n, line in enumerate(page.read_text().splitlines(), 1) if reference.search(line)]
    assert not found, "internal issue numbers:\n" + "\n".join(found)
