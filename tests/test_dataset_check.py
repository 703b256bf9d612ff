"""`ktflow dataset check RECIPE`: the recipe's training and evaluation records validated as the stages read them,
before anything runs (docs/guides/workstation.md's data step)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

GOOD = {"messages": [{"role": "system", "content": "You answer as our support team."},
                     {"role": "user", "content": "How do I reset my token?"},
                     {"role": "assistant", "content": "Open Settings -> Tokens and choose Reset."}]}


def _project(tmp_path: Path, train: list[dict], evaluation: list[dict]) -> Path:
    """A project folder as a user has it: recipes/ and data/ side by side (relative paths are read from there)."""
    (tmp_path / "recipes").mkdir()
    shutil.copy(REPO / "recipes/kimi-k2.5-rawint4.yaml", tmp_path / "recipes")
    (tmp_path / "data").mkdir()
    for name, records in (("train.jsonl", train), ("eval.jsonl", evaluation)):
        (tmp_path / "data" / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path / "recipes/kimi-k2.5-rawint4.yaml"


def _check(recipe: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ktflow.cli", "dataset", "check", str(recipe), "--json"],
                          capture_output=True, text=True, timeout=120, cwd=recipe.parent.parent)


def test_good_records_are_counted_where_the_recipe_reads_them(tmp_path: Path) -> None:
    done = _check(_project(tmp_path, [GOOD] * 3, [GOOD]))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["train"] == {"files": [str(tmp_path / "data/train.jsonl")], "format": "openai", "records": 3}
    assert report["evaluation"]["records"] == 1


def test_every_bad_record_is_named_by_file_and_line(tmp_path: Path) -> None:
    typo = {"messages": [{"role": "user", "content": "Hi"}, {"role": "asistant", "content": "Hello"}]}
    done = _check(_project(tmp_path, [GOOD, typo, GOOD, typo], [GOOD]))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "train.jsonl:2:" in done.stderr and "train.jsonl:4:" in done.stderr and "asistant" in done.stderr


def test_an_evaluation_record_without_a_reference_is_refused(tmp_path: Path) -> None:
    no_answer = {"messages": [{"role": "user", "content": "Hi"}]}
    done = _check(_project(tmp_path, [GOOD], [no_answer]))
    assert done.returncode == 2 and "eval.jsonl" in done.stderr
