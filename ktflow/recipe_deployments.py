"""The shipped recipes as one-click runs: a ``ktflow-dispatch`` deployment per recipe file.

``deployments/prefect.yaml`` has, for every file in ``recipes/``, a deployment of the parent
flow named after the recipe (``ktflow-dispatch/tiny-demo``, ...) whose build step is
:func:`recipe_parameters`: at ``prefect deploy`` time the file is loaded and validated like
any recipe, and the Recipe model's JSON becomes the deployment's default parameters. So the
Prefect UI's "Quick run" runs the recipe as shipped, "Custom run" shows it pre-filled for
editing, and the file stays the single source: editing a recipe and redeploying updates its
deployment; nothing is copied into prefect.yaml by hand (tests/test_deployments.py checks the
two agree).

Paths in a recipe stay as written (relative to the checkout): the deployments' pull step makes
the checkout the flow run's working directory on every host.

Engine side: no Prefect import (Prefect calls :func:`recipe_parameters` as a deployment step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ktflow.recipe import load_recipe

RECIPES_DIR = "recipes"
PARENT_ENTRYPOINT = "flows/pipeline.py:pipeline_distributed"
# The id the build step has in prefect.yaml; the deployment templates "{{ shipped.recipe }}".
STEP_ID = "shipped"
STEP = "ktflow.recipe_deployments.recipe_parameters"


def recipe_parameters(recipe_file: str) -> dict[str, Any]:
    """A deployment step: the recipe file as the parent flow's default parameters.

    Returns ``recipe`` (the Recipe model's JSON: the value of the flow's ``recipe`` parameter),
    ``name`` (the recipe's name, which the deployment is called) and ``description`` (the
    recipe's, with the file it came from).

    Raises:
        RecipeError: the file is not a valid recipe (the deploy stops, naming the field).
    """
    recipe = load_recipe(recipe_file)
    about = recipe.description or f"the {recipe.name} recipe"
    return {
        "recipe": recipe.model_dump(mode="json"),
        "name": recipe.name,
        "description": f"{about} (defaults: {recipe_file}; Custom run to change any field)",
    }


def shipped_recipe_files(checkout: Path) -> list[str]:
    """The recipe files a checkout ships, as paths relative to it (``recipes/x.yaml``)."""
    return sorted(f"{RECIPES_DIR}/{path.name}" for path in (checkout / RECIPES_DIR).glob("*.yaml"))


def recipe_deployment_file(deployment: dict[str, Any]) -> str | None:
    """The recipe file a prefect.yaml deployment entry takes its defaults from, if any."""
    for step in deployment.get("build") or []:
        if isinstance(step, dict) and STEP in step:
            return step[STEP].get("recipe_file")
    return None
