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


# The workshop's words, which a user has no use for: how a result was obtained (sessions, device calls and their
# time, files carried to a machine, machines lent or withheld, budgets, issue items, "the seeds") and results
# named by date. Each pattern is narrow enough to leave ordinary words alone: "a function call", "carry out",
# "the session fixture", "a RAM budget", "random seeds", "the adapter is withheld".
WORKSHOP_WORDS = {
    "a session": re.compile(r"(?<!pytest )\bsessions?\b(?![- ](?:fixtures?|scoped?)\b)", re.I),
    "a device call or device time": re.compile(r"\bdevice[- ](?:calls?|time|tool|machines?|kinds?)\b", re.I),
    "a numbered call": re.compile(r"\bcalls? \d+", re.I),
    "a call as a unit of work": re.compile(
        r"\b(?:this|that|each|every|one|later|next|same|previous|earlier|two|three|four|five|serving|training)"
        r"[- ]calls?\b(?! (?:to|of|for|into)\b)", re.I),
    "files carried to a machine": re.compile(r"\bcarr(?:y|ied)\b\s*(?:`|build/|\||:)|\|\s*carry\s*\|", re.I),
    "a machine lent or withheld": re.compile(
        r"\b(?:hosts?|machines?|kinds?)\b[^.]{0,30}\b(?:lent|withheld)\b|\b(?:lent|withheld)\b[^.]{0,30}"
        r"\b(?:hosts?|machines?|kinds?)\b", re.I),
    "a budget of device time": re.compile(r"\b(?:session's|device[- ]time|call's) budget\b|\bbudget_left", re.I),
    "an issue or its items": re.compile(r"\bissues?\s*#?\d+|\bissue \"|\bitems? \d+\b", re.I),
    "the seeds": re.compile(r"\bseeds'|\bthe seeds\b", re.I),
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
}

_WORKSHOP_CASES = {
    "a session": (["the session's budget", "a later session", "sessions"],
                  ["the session fixture `setup`", "the session-scoped cluster", "a pytest session"]),
    "a device call or device time": (["device time: 1,643 s", "one device call per phase"], ["the device's memory"]),
    "a numbered call": (["calls 8-9", "in call 1"], ["recall 1", "call the API"]),
    "a call as a unit of work": (["one call each", "two calls on one warm machine"],
                                 ["a function call", "each call to the server", "a second call is a cache hit"]),
    "files carried to a machine": (["carry `build/gpu-host/parts`", "| # | command | carry |"],
                                   ["carry out", "configs carry them", "what tuning can carry to unseen prompts"]),
    "a machine lent or withheld": (["the 4-GPU host was withheld", "every GPU host lent so far"],
                                   ["it fails when the adapter is withheld"]),
    "a budget of device time": (["the session's budget went from 1,800 s"], ["within a RAM budget"]),
    "an issue or its items": (['issue "A slice of Kimi-K2.5"', "item 5", "issue 23"], ["an issue with the driver"]),
    "the seeds": (["the seeds' hosts"], ["3 seeds each", "random seeds"]),
    "a date": (["measured on 2026-11-25"], ["kt-20261125-084606-629840.json"]),
}


def _user_texts() -> list[tuple[str, str]]:
    """(where, text) of everything a user reads: README, the site's pages, the GPU-host and benchmark READMEs
    (raw data's file lists included), the comments of the shipped recipes, and what the CLI prints (every
    command's help, and the texts the plan is made of)."""
    import ast

    from ktflow.cli import build_parser

    texts: list[tuple[str, str]] = []
    pages = [REPO / "README.md", REPO / "gpu_host/README.md", *sorted((REPO / "docs").rglob("*.md")),
             *sorted((REPO / "benchmarks").rglob("README.md"))]
    for page in pages:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            texts.append((f"{page.relative_to(REPO)}:{n}", line))
    for recipe in sorted([*(REPO / "recipes").glob("*.yaml"), *(REPO / "gpu_host").glob("*.yaml")]):
        for n, line in enumerate(recipe.read_text().splitlines(), 1):
            if "#" in line:
                texts.append((f"{recipe.relative_to(REPO)}:{n}", line[line.index("#"):]))

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        texts.append((f"ktflow {name} --help".replace("  ", " "), parser.format_help()))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(sub, f"{name} {sub_name}".strip())

    walk(build_parser(), "")
    for module in [REPO / "ktflow/plan.py", *sorted((REPO / "ktflow/planning").glob("*.py"))]:
        tree = ast.parse(module.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                texts.append((f"{module.relative_to(REPO)}:{node.lineno} (printed by ktflow plan)", node.value))
    return texts


def test_the_workshop_word_patterns_catch_what_they_mean_and_nothing_else() -> None:
    assert set(_WORKSHOP_CASES) == set(WORKSHOP_WORDS)
    for name, (caught, left_alone) in _WORKSHOP_CASES.items():
        for text in caught:
            assert WORKSHOP_WORDS[name].search(text), (name, text)
        for text in left_alone:
            assert not WORKSHOP_WORDS[name].search(text), (name, text)


def test_what_users_read_speaks_of_the_product_not_of_how_it_was_built() -> None:
    """README, the site, the GPU-host and benchmark READMEs, recipe comments and the CLI's output name hardware,
    commands and results, never the sessions, device calls, carried files, lent machines, budgets or issue items
    of the work that produced them; results are named by what they measure, not by date."""
    found = [f"{where}: [{name}] {text.strip()[:160]}" for where, text in _user_texts()
             for name, pattern in WORKSHOP_WORDS.items() if pattern.search(text)]
    assert not found, "workshop words where users read:\n" + "\n".join(found)


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every ``ktflow`` parser with its command's name ("" for ktflow itself, "dataset publish" nested)."""
    from ktflow.cli import build_parser

    found: list[tuple[str, argparse.ArgumentParser]] = []

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        found.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(sub, f"{name} {sub_name}".strip())

    walk(build_parser(), "")
    return found


# Arguments of ktflow/cli/serving.py still without a help text; proposed: serve --dry-run "print the server's
# launch command and what it would serve; start nothing", serve --json "with --dry-run: one JSON object",
# eval --endpoint "the tuned model's OpenAI-compatible endpoint (http://HOST:PORT/v1)". Remove each entry with its
# help text: the test fails on an entry that has one.
_HELP_PENDING: set[tuple[str, str]] = set()


def test_every_cli_argument_and_command_has_a_help_text() -> None:
    """`ktflow CMD --help` and the generated CLI reference explain every argument and every command."""
    missing: set[tuple[str, str]] = set()
    for name, parser in _parsers():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                missing |= {(f"{name} {sub.dest}".strip(), "(the command)") for sub in action._choices_actions
                            if not (sub.help or "").strip()}
                continue
            if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
                missing.add((name, "/".join(action.option_strings) or action.dest))
    assert not missing - _HELP_PENDING, f"arguments without a help text: {sorted(missing - _HELP_PENDING)}"
    assert not _HELP_PENDING - missing, f"have a help text now, drop from _HELP_PENDING: {_HELP_PENDING - missing}"


def test_the_stages_reference_says_what_the_cli_says() -> None:
    """docs/reference/stages.md has a section per stage command, opened by the command's own one-line help, and
    every usage it gives (`ktflow CMD POSITIONAL ...`) names the command's positional arguments in order."""
    commands = {name: parser for name, parser in _parsers() if name}
    helps = {}
    for _name, parser in _parsers():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps.update({sub.dest: sub.help for sub in action._choices_actions})
    page = (REPO / "docs/reference/stages.md").read_text()
    sections = dict(re.findall(r"^## (\S+)\n(.*?)(?=^## |\Z)", page, re.S | re.M))
    command_of = {"evaluate": "eval"}
    stage_commands = {"download", "dequantize", "sft", "convert-lora", "quantize-int8", "serve", "eval", "fixture"}
    assert stage_commands <= {command_of.get(h, h) for h in sections} <= set(commands), sorted(sections)
    for heading, text in sections.items():
        command = command_of.get(heading, heading)
        assert f"`ktflow {command}`: {helps[command]}." in text, (heading, helps[command])
        positionals = [a.metavar or a.dest for a in commands[command]._actions
                       if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]
        for usage in re.findall(rf"`ktflow {re.escape(command)} ([^`]*)`", text):
            words = []  # the positional arguments the usage gives: a NAME, or a value in its place
            for word in usage.split():
                if word.startswith(("-", "[")):
                    break
                words.append(word)
            if any(re.fullmatch(r"[A-Z][A-Z0-9_]+", word) for word in words):
                assert len(words) == len(positionals), (command, usage, positionals)
                for word, positional in zip(words, positionals):
                    assert not re.fullmatch(r"[A-Z][A-Z0-9_]+", word) or word == positional, (command, usage)


# Claims a page once made that the status page (docs/status.md) and the measured results contradict: each was
# run for real since. A page that makes one of them again fails here.
_CONTRADICTED = {
    r"sglang-kt[^\n]*(?:checked by its (?:argument )?parser|on paper)": "sglang-kt served on the GPU host",
    r"[Oo]n paper only: sglang-kt": "sglang-kt ran as production and candidate",
    r"no 2-GPU host": "KT SFT ran on 2 and 4 GPUs",
    r"(?:more than|over) 16 cores[^.]*(?:never|not yet) measured|[Hh]osts with more\s+than 16 cores or": (
        "32- and 64-core hosts were measured"),
    r"quantize-int8[^.]*(?:BF16 only|from BF16 only)|BF16_DIR": "quantize-int8 takes Kimi INT4 as released",
    r"46 min(?:utes)? in all": "the suite takes about 22 minutes",
}


def test_no_page_contradicts_what_ran_for_real() -> None:
    status = (REPO / "docs/status.md").read_text()
    for needed in ("results/serving.md", "results/multi-gpu.md", "results/kimi-slice.md", "quantize-int8"):
        assert needed in status, f"docs/status.md no longer says {needed!r}: update _CONTRADICTED with it"
    pages = [REPO / "README.md", REPO / "gpu_host/README.md", *sorted((REPO / "docs").rglob("*.md"))]
    found = [f"{page.relative_to(REPO)}: {why} ({match.group(0)!r})" for page in pages
             for pattern, why in _CONTRADICTED.items() for match in re.finditer(pattern, page.read_text())]
    assert not found, "pages that contradict docs/status.md:\n" + "\n".join(found)
