"""Events ktflow emits: a published dataset version, which the retrain deployment listens for."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ktflow.errors import KtflowError
from ktflow.formats.dataset import validate_dataset
from ktflow.recipe import load_recipe

DATASET_PUBLISHED = "dataset.version.published"


def publish_dataset(recipe_file: Path, path: Path) -> dict[str, Any]:
    """Validate ``path`` as ``recipe_file``'s dataset, then emit ``dataset.version.published``.

    Nothing is emitted for a dataset that would fail training: the same validation as the SFT
    stage runs first (bad records are named by file and line). The event carries absolute
    paths (the retrain runs on another host, against the shared checkout and store) and the
    file's sha256, so a re-published unchanged file is recognisably the same version.

    Returns:
        The event as emitted (``event``, ``resource``, ``payload``).
    """
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker

    recipe_file, path = recipe_file.absolute(), path.absolute()
    recipe = load_recipe(recipe_file, [f"dataset.files={json.dumps([str(path)])}"])
    records = validate_dataset(recipe.dataset)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    resource = {"prefect.resource.id": f"ktflow.formats.dataset.{recipe.dataset.name}",
                "prefect.resource.name": recipe.dataset.name}
    payload = {"recipe_file": str(recipe_file), "recipe": recipe.name, "path": str(path), "sha256": digest,
               "records": records}
    event = emit_event(DATASET_PUBLISHED, resource=resource, payload=payload)
    if event is None:
        raise KtflowError("the event was not emitted: point PREFECT_API_URL at the Prefect server the "
                          "retrain deployment lives on")
    EventsWorker.drain_all()  # delivered before this process exits
    return {"event": DATASET_PUBLISHED, "resource": resource["prefect.resource.id"], "payload": payload}
