"""Loading a recipe: YAML, ``--set`` overrides, and validation errors that name the field and the fix."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml
from pydantic import BaseModel, ValidationError

from ktflow.errors import RecipeError
from ktflow.recipe.recipe import Recipe

# Keys people carry over from other tools' docs, with what to write instead.
_KEY_HINTS: dict[str, str] = {
    "gradient_checkpointing": (
        "LlamaFactory spells it 'disable_gradient_checkpointing' (KT rejects "
        "'gradient_checkpointing'); write disable_gradient_checkpointing: false to keep it on"
    ),
    "kt_lora_rank": "LlamaFactory derives it from 'lora_rank'; set sft.lora_rank instead",
    "kt_lora_alpha": "LlamaFactory derives it from 'lora_alpha'; set sft.lora_alpha instead",
    "kt_lora_dropout": "LlamaFactory derives it from 'lora_dropout'; set sft.lora_dropout instead",
    "kt_weight_path": "ktflow sets it from the weights stage's output; remove it",
    "model_name_or_path": "ktflow sets it from the source/dequantize stage; set source.* instead",
    "output_dir": "ktflow picks a deterministic output dir under store.root; remove it",
    "overwrite_output_dir": "ktflow always resumes (overwrite_output_dir: false); remove it",
    "dataset": "set dataset.name / dataset.files instead",
    "dataset_dir": "ktflow writes dataset_info.json itself; set dataset.files instead",
    "tensor_parallel_size": "set serving.gpus (the tensor parallel size) instead",
    "tp_size": "set serving.gpus (the tensor parallel size) instead",
    "lora_paths": "ktflow passes the converted adapter itself; set serving.adapter_name",
    # Secrets never go in a recipe (it is a flow parameter, stored and shown by Prefect).
    "api_key": "a key never goes in a recipe; export it in the variable serving.api_key_env names",
    "token": "a token never goes in a recipe; export HF_TOKEN (or use a Prefect Secret block)",
    "hf_token": "a token never goes in a recipe; export HF_TOKEN (or use a Prefect Secret block)",
}


def project_dir_of(recipe_file: Path) -> Path:
    """Where a recipe file's relative paths point: the folder holding its ``recipes/`` folder (a ktflow
    checkout or a copy of its layout), else the recipe's own folder."""
    folder = Path(recipe_file).absolute().parent
    return folder.parent if folder.name == "recipes" else folder


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Load, override and validate a recipe file.

    Every relative path in it (the store, the toolchains, the data, a local source), written or a default, and
    those given in ``overrides``, is made absolute against the recipe's project folder (:func:`project_dir_of`):
    the recipe means the same from any working directory, from the CLI and from Python alike.

    Args:
        path: a YAML file.
        overrides: ``dotted.key=value`` strings; values are parsed as YAML scalars/lists.

    Raises:
        RecipeError: naming the file, the field and the fix, for every problem found.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(str(path), "no such recipe file", "check the path (see recipes/)") from None
    except UnicodeDecodeError as exc:
        raise RecipeError(str(path), f"is not UTF-8 text (byte {exc.start}): not a YAML recipe",
                          "pass the recipe's .yaml file (see recipes/)") from None
    except OSError as exc:
        raise RecipeError(str(path), f"cannot read the file ({exc.strerror})",
                          "pass a readable recipe file (see recipes/)") from None
    try:
        raw = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as exc:
        # PyYAML raises a bare ValueError for an impossible date (2024-02-30) or a bad !!float.
        raise RecipeError(str(path), f"not valid YAML: {exc}", "fix the YAML syntax") from None
    except RecursionError:
        raise RecipeError(str(path), "the YAML is nested too deeply to be a recipe",
                          "write the recipe as in recipes/ (a few levels of sections)") from None
    if not isinstance(raw, dict):
        raise RecipeError(str(path), f"a recipe must be a YAML mapping at the top level (got {_yaml_type(raw)})",
                          "start the file with 'name: ...', 'source: ...' as in recipes/")
    return recipe_from_mapping(raw, overrides, origin=str(path), base_dir=project_dir_of(path))


def recipe_from_mapping(
    raw: Mapping[str, Any], overrides: Sequence[str] = (), *, origin: str = "recipe", base_dir: Path | None = None,
) -> Recipe:
    """Validate a recipe given as a mapping (a flow parameter, a parsed file).

    ``base_dir``: make every relative path absolute against it (:func:`with_absolute_paths`); None leaves them
    relative to the working directory of the process that uses them (a flow parameter on a worker).

    Raises:
        RecipeError: for anything that is not a valid recipe (never another exception).
    """
    if not isinstance(raw, Mapping):
        raise RecipeError(origin, f"a recipe must be a mapping of sections (got {_yaml_type(raw)})",
                          "pass the parsed recipe YAML (see recipes/)")
    data = _deep_copy(raw, origin=origin)
    for item in overrides:
        apply_override(data, item, origin=origin)
    try:
        recipe = Recipe.model_validate(data)
        return recipe if base_dir is None else with_absolute_paths(recipe, Path(base_dir).absolute())
    except ValidationError as exc:
        raise RecipeError(origin, _format_validation_error(exc), _VALIDATION_FIX) from None
    except RecursionError:
        raise RecipeError(origin, "a value is nested too deeply to be a recipe field",
                          "write the recipe as in recipes/") from None


def with_absolute_paths(recipe: Recipe, base_dir: Path) -> Recipe:
    """``recipe`` with every relative path it holds joined onto ``base_dir`` (not resolved: a venv's python is a
    link that must keep its name), rebuilt through validation."""
    return _absolute(recipe, base_dir)


def _absolute(value: Any, base_dir: Path) -> Any:
    if isinstance(value, Path):
        return value if value.is_absolute() else base_dir / value
    if isinstance(value, list):
        items = [_absolute(v, base_dir) for v in value]
        return items if any(a is not b for a, b in zip(items, value)) else value
    if isinstance(value, BaseModel):
        changed = {name: new for name in type(value).model_fields
                   if (new := _absolute(getattr(value, name), base_dir)) is not getattr(value, name)}
        return value.model_copy(update=changed) if changed else value
    return value


_VALIDATION_FIX = "change the field(s) named above in the recipe (or with --set); recipes/ has complete examples"


def _yaml_type(value: Any) -> str:
    if value is None:
        return "an empty document"
    return {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def apply_override(data: dict[str, Any], item: str, *, origin: str = "recipe") -> None:
    """Apply one ``dotted.key=value`` override to a raw recipe mapping, in place."""
    key, sep, value_text = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise RecipeError(
            f"--set {item}", "expected dotted.key=value", "e.g. --set sft.max_steps=10"
        )
    try:
        value = yaml.safe_load(value_text) if value_text != "" else ""
    except (yaml.YAMLError, ValueError):
        value = value_text  # not YAML: the text itself (validated like any string)
    except RecursionError:
        raise RecipeError(f"--set {key}", "the value is nested too deeply", "pass a scalar or a short list") from None
    parts = key.split(".")
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise RecipeError(
                f"--set {item}", f"'{where}' is a value in {origin}, not a section", "check the key"
            )
        node = child
    node[parts[-1]] = value


def _deep_copy(value: Any, *, origin: str = "recipe") -> Any:
    """A copy of a parsed recipe's containers (the input is never mutated).

    YAML aliases make shared and even recursive structures: a shared one is copied once (so a
    "billion laughs" document stays small), a recursive one is refused.
    """
    memo: dict[int, Any] = {}
    active: set[int] = set()

    def copy(node: Any, depth: int) -> Any:
        if not isinstance(node, (Mapping, list)):
            return node
        if id(node) in active or depth > 100:
            raise RecipeError(origin, "a value refers to itself (a recursive YAML alias) or is nested too deeply",
                              "write the value out instead of through an alias")
        if id(node) in memo:
            return memo[id(node)]
        active.add(id(node))
        try:
            result: Any = (
                {k: copy(v, depth + 1) for k, v in node.items()} if isinstance(node, Mapping)
                else [copy(v, depth + 1) for v in node]
            )
        finally:
            active.discard(id(node))
        memo[id(node)] = result
        return result

    return copy(value, 0)


def _model_at(loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The pydantic model class at a validation-error location (for key suggestions)."""
    model: Any = Recipe
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        annotation = field.annotation
        candidates = getattr(annotation, "__args__", (annotation,))
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


def _format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        raw_loc = err["loc"]
        if err["type"] == "extra_forbidden" and raw_loc:
            # The last element is the user's own key (which may hold any character).
            loc = [*(p for p in raw_loc[:-1] if not (isinstance(p, str) and "[" in p)), raw_loc[-1]]
        else:
            loc = [p for p in raw_loc if not (isinstance(p, str) and "[" in p)]
        where = ".".join(str(p) for p in loc)
        if err["type"] == "extra_forbidden" and loc:
            key = str(loc[-1])
            parent = _model_at(loc[:-1])
            message = f"{where}: unknown key"
            if key in _KEY_HINTS:
                message += f"; {_KEY_HINTS[key]}"
            elif parent is not None:
                close = difflib.get_close_matches(key, list(parent.model_fields), n=1, cutoff=0.6)
                if close:
                    message += f"; did you mean '{'.'.join(map(str, loc[:-1] + [close[0]]))}'?"
                else:
                    message += f"; allowed keys: {', '.join(parent.model_fields)}"
        elif err["type"] == "missing":
            message = f"{where}: required field is missing; add it (recipes/ has an example of every section)"
        else:
            text = err["msg"].removeprefix("Value error, ")
            # Cross-field rules name their field as "@field: ..." (a model validator's error
            # is located at the model; this points it at the field the user must change).
            if text.startswith("@") and ": " in text:
                field, text = text[1:].split(": ", 1)
                loc = [*loc, *field.split(".")]
                where = ".".join(str(p) for p in loc)
            given = err.get("input")
            shown = "" if isinstance(given, (dict, list)) or err["type"].startswith("value_error") else (
                f" (got {given!r:.200})"
            )
            message = f"{where}: {text}{shown}" if where else f"{text}{shown}"
        lines.append(message)
    return "; ".join(lines) if len(lines) == 1 else "\n  " + "\n  ".join(lines)
