"""Fuzzing the recipe loader: whatever the document, the answer is a Recipe or our RecipeError.

Three sources of input: random YAML text (including aliases, tags and deep nesting), random
mappings dumped to YAML, and random mutations of the shipped recipes (a key deleted, a value
replaced by a random scalar/list/mapping, an unknown key added, a ``--set`` override). Anything
else (a KeyError, a RecursionError, a ValueError out of PyYAML) would reach the user as exit 1,
"internal error".

The safetensors header reader is fuzzed in tests/test_safetensors_io.py.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ktflow.errors import RecipeError
from ktflow.recipe import Recipe, load_recipe, recipe_from_mapping

RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))
SHIPPED = {p.name: yaml.safe_load(p.read_text()) for p in RECIPES}
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.sampled_from(["", "..", "../../etc", "/abs/path", "auto", "AMXINT8", "bf16", "kt", "hf", "sglang", "0.0.0.0",
                     "KTFLOW_API_KEY", "2024-02-30", "1e999", "-1", "null", "~", "yes", "[", "{a: 1}", "\x00"]),
)
keys = st.one_of(st.text(max_size=12), st.sampled_from(
    ["name", "source", "dataset", "sft", "serving", "evaluation", "conversion", "store", "toolchains",
     "kt_config", "backend", "format", "files", "lora_rank", "port", "host", "x[0]", "a.b", ""]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4)), max_leaves=20)


def _accepts(load: Any) -> None:
    try:
        recipe = load()
    except RecipeError as exc:
        assert exc.exit_code == 2 and exc.subject and exc.reason
        return
    assert isinstance(recipe, Recipe)


# --------------------------------------------------------------------------- random documents


@FUZZ
@given(st.text(max_size=300))
def test_random_text_is_a_recipe_or_a_recipe_error(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_bytes(text.encode("utf-8", errors="surrogatepass"))  # a lone surrogate makes invalid UTF-8
    _accepts(lambda: load_recipe(path))


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_are_a_recipe_error(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_bytes(data)
    _accepts(lambda: load_recipe(path))


@FUZZ
@given(values)
def test_random_yaml_documents(tmp_path_factory: pytest.TempPathFactory, document: Any) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_text(yaml.safe_dump(document, allow_unicode=True), encoding="utf-8")
    _accepts(lambda: load_recipe(path))
    _accepts(lambda: recipe_from_mapping(document))  # a flow parameter need not be a mapping either


YAML_TRAPS = [
    "a: &x [*x]\n",  # a recursive alias
    "name: &n tiny\nsource: &s {local_path: /m, format: bf16}\nsft: *s\n",
    "a: &a [1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
    "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n"
    "g: [*f,*f,*f,*f,*f,*f,*f,*f,*f]\n",  # "billion laughs": 9^7 leaves if expanded
    "[" * 3000 + "]" * 3000,
    "{a: " * 500 + "1" + "}" * 500,
    "description: 2024-02-30\n",
    "port: !!float nope\n",
    "data: !!binary '###'\n",
    "? [a, b]\n: c\n",
    "!!python/object:os.system ['true']\n",
    "name: x\n" * 3,
    "--- a\n--- b\n",
    "\ufeffname: x\n",
]


@pytest.mark.parametrize("text", YAML_TRAPS, ids=range(len(YAML_TRAPS)))
def test_yaml_traps_are_recipe_errors(tmp_path: Path, text: str) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(RecipeError):
        load_recipe(path)


# --------------------------------------------------------------------------- mutations of real recipes


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a nested mapping (lists are indexed)."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out.extend(_paths(v, (*prefix, k)))
    return out


@st.composite
def mutated_recipes(draw: st.DrawFn) -> dict:
    name = draw(st.sampled_from(sorted(SHIPPED)))
    doc = copy.deepcopy(SHIPPED[name])
    for _ in range(draw(st.integers(1, 4))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths)) if paths else ()
        *parent_path, last = path or ("name",)
        parent: Any = doc
        for part in parent_path:
            parent = parent[part]
        action = draw(st.sampled_from(["delete", "replace", "add"]))
        if action == "delete" and path:
            del parent[last]
        elif action == "replace":
            parent[last] = draw(values)
        elif isinstance(parent, dict):
            parent[draw(keys)] = draw(values)
    return doc


@FUZZ
@given(mutated_recipes())
def test_mutated_shipped_recipes(document: dict) -> None:
    _accepts(lambda: recipe_from_mapping(document))


@FUZZ
@given(mutated_recipes())
def test_mutated_shipped_recipes_through_a_file(tmp_path_factory: pytest.TempPathFactory, document: dict) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_text(yaml.safe_dump(document, allow_unicode=True), encoding="utf-8")
    _accepts(lambda: load_recipe(path))


override_keys = st.lists(keys, min_size=1, max_size=4).map(".".join)


@FUZZ
@given(st.sampled_from(sorted(SHIPPED)), st.lists(st.one_of(
    st.text(max_size=40),
    st.builds(lambda k, v: f"{k}={v}", override_keys, st.text(max_size=30)),
    st.builds(lambda k, v: f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}", override_keys, values),
), max_size=3))
def test_random_overrides(name: str, overrides: list[str]) -> None:
    _accepts(lambda: recipe_from_mapping(SHIPPED[name], overrides))
    assert SHIPPED[name] == yaml.safe_load((RECIPES[0].parent / name).read_text())  # never mutated


def test_the_fuzzers_reach_valid_recipes() -> None:
    """Not a tautology: unmutated inputs load, so 'succeed' is a real outcome of the properties."""
    for name, doc in SHIPPED.items():
        assert isinstance(recipe_from_mapping(doc), Recipe), name
