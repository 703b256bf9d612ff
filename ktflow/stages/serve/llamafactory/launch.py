"""``llamafactory-cli api``'s command line and inference config for a recipe (what the CPU backend starts, and what
offline generation hands LlamaFactory's chat engine)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ktflow.recipe import Recipe
from ktflow.stages.serve.records import adapter_model_name

INFER_YAML = "infer.yaml"


def render_llamafactory_api(
    recipe: Recipe, *, model_dir: Path, adapter_dir: Path | None, train_python: Path, config_dir: Path,
    port: int | str | None = None,
) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """``llamafactory-cli api`` for the recipe: ``(argv, env, infer_yaml)``.

    ``env`` holds only what ktflow sets on top of the inherited environment; the API key is
    *not* in it (it is added at start, see :func:`start_server`). ``argv`` names
    ``config_dir/infer.yaml``, which the caller writes from ``infer_yaml``.

    The chat template: the recipe's ``sft.template``, except ``empty`` (training data rendered
    with the model's own chat template), for which no template is set so LlamaFactory parses
    the tokenizer's chat template and plain chat requests are formatted as in training.
    """
    serving = recipe.serving
    cfg: dict[str, Any] = {
        "model_name_or_path": str(Path(model_dir).absolute()),
        "trust_remote_code": True,
        "infer_backend": "huggingface",
    }
    if adapter_dir is not None:
        cfg.update(adapter_name_or_path=str(Path(adapter_dir).absolute()), finetuning_type="lora")
    if recipe.sft.template != "empty":
        cfg["template"] = recipe.sft.template
    argv = [str(Path(train_python).parent / "llamafactory-cli"), "api", str(Path(config_dir) / INFER_YAML)]
    env = {
        "API_HOST": serving.host,
        "API_PORT": str(port if port is not None else serving.port),
        "API_MODEL_NAME": adapter_model_name(recipe) if adapter_dir is not None else serving.served_model_name,
        "API_VERBOSE": "0",  # LlamaFactory logs every request body at INFO otherwise
        "HF_HUB_OFFLINE": "1",  # the base and adapter are local: never reach for a hub
        **recipe.toolchains.train.env,
    }
    return argv, env, cfg


def dump_infer_yaml(infer: Mapping[str, Any]) -> str:
    """``infer.yaml``'s text: the config in the order it was built."""
    return yaml.safe_dump(dict(infer), sort_keys=False)
