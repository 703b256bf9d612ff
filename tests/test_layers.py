"""The engine's layers, as README's layout and each package's docstring state them, checked on the
source: what each part of ``ktflow/`` may import from ktflow, that the engine never imports Prefect,
and that its imports form no cycle, those inside functions included."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ENGINE = REPO / "ktflow"
PACKAGES = ("formats", "host", "planning", "stages", "fixtures", "_drivers")
CORE = {"ktflow", "errors", "units", "store", "artifact_store", "recipe", "resources", "runner", "registry"}

# What each part may import from ktflow (its own part is always allowed).
MAY_IMPORT: dict[str, set[str]] = {
    "ktflow": set(),
    "errors": {"ktflow"},
    "units": set(),
    "formats": {"ktflow", "errors", "units", "store", "recipe"},
    "host": {"ktflow", "errors", "units", "resources"},
    "store": {"ktflow", "errors", "units", "formats"},
    "artifact_store": {"ktflow", "errors", "units", "store", "formats"},
    "recipe": {"errors", "units", "store", "artifact_store", "resources"},
    "resources": {"errors", "units", "store", "host"},
    "runner": {"errors", "units", "store", "host", "resources"},
    "registry": {"errors", "units", "store"},
    "fixtures": {"ktflow", "errors", "units", "formats", "store", "host"},
    "_drivers": {"errors", "formats"},  # run inside the toolchains: nothing that needs pydantic
    "planning": CORE | {"formats", "host"},  # the models stages are sized with: never a stage, even lazily
    "stages": CORE | {"formats", "host", "planning", "_drivers"},
    # The plan assembler reads the stages' own declarations of what they need, from above them.
    "plan": CORE | {"formats", "host", "planning", "stages"},
}


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "ktflow"
    return parts[1]


def _imports(path: Path, *, top_level_only: bool = False) -> Iterator[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "ktflow":  # a module of the package, or a name of ktflow/__init__.py
                yield from (f"ktflow.{alias.name}" if _is_module(alias.name) else "ktflow" for alias in node.names)
            else:
                yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def _is_module(name: str) -> bool:
    return (ENGINE / f"{name}.py").is_file() or (ENGINE / name / "__init__.py").is_file()


def _engine_files() -> list[Path]:
    return sorted(p for p in ENGINE.rglob("*.py") if "_fixture_code" not in p.parts)


@pytest.mark.parametrize("path", _engine_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_each_module_imports_only_what_its_layer_may(path: Path) -> None:
    module = _module(path)
    part = _part(module)
    if part in ("cli", "demo", "recipe_deployments", "run_report"):
        allowed = None  # the command line and the demo sit on top of everything
    else:
        allowed = MAY_IMPORT[part] | {part}
    for name in _imports(path):
        top = name.split(".")[0]
        # The command line starts flows (`ktflow run`, `ktflow demo`) and announces moves, lazily.
        if part != "cli":
            assert top not in ("prefect", "tasks", "flows", "blocks"), \
                f"{module} imports {name}: the engine never imports Prefect"
        if top != "ktflow" or allowed is None:
            continue
        target = _part(name)
        assert target in allowed, f"{module} imports {name}: {part} may import {sorted(allowed)}"


def test_planning_never_imports_a_stage_or_the_assembler() -> None:
    """Not even inside a function: the stages import planning's models, so nothing there may reach back up."""
    for path in sorted((ENGINE / "planning").rglob("*.py")):
        upward = [name for name in _imports(path) if _part(name) in ("stages", "plan", "cli")]
        assert not upward, f"{_module(path)} imports {upward}: planning sits below the stages"


@pytest.mark.parametrize("top_level_only", [True, False], ids=["top-level imports", "imports inside functions too"])
def test_imports_form_no_cycle(top_level_only: bool) -> None:
    """A cycle through an import inside a function is one too: it only hides from a reader (and from Python until
    the function runs)."""
    graph = {_module(p): {n for n in _imports(p, top_level_only=top_level_only) if n.startswith("ktflow")}
             for p in _engine_files()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in graph:
                continue
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(target):] + [target]))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_every_package_says_what_its_modules_do() -> None:
    for package in PACKAGES:
        init = ENGINE / package / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        modules = sorted(p.name for p in (ENGINE / package).iterdir()
                         if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and p.name != "__pycache__"))
        missing = [m for m in modules if m.removesuffix(".py") not in doc]
        assert not missing, f"ktflow/{package}/__init__.py does not describe {missing}"
