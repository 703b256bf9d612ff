"""The CPU backend: LlamaFactory's OpenAI-compatible API (``llamafactory-cli api``) from the training toolchain,
with the adapter merged at load; one model per server.

- ``launch.py``: the command line and the inference config (``infer.yaml``) for a recipe.
- here: the backend the lifecycle starts (:data:`BACKEND`): the toolchain, the adapter check (against the base,
  headers only), readiness on ``/v1/models`` listing the model, with the key checked.
"""

from __future__ import annotations

from pathlib import Path

from ktflow.formats.adapter import check_servable_adapter
from ktflow.host.hardware import HostInfo
from ktflow.recipe import Recipe
from ktflow.stages.serve.backend import Launch, Log, ServeMode
from ktflow.stages.serve.llamafactory.launch import INFER_YAML, dump_infer_yaml, render_llamafactory_api
from ktflow.stages.serve.records import LLAMAFACTORY_KEY_ENV, base_url
from ktflow.store import atomic_write_bytes

__all__ = ["BACKEND", "INFER_YAML", "LlamafactoryBackend", "dump_infer_yaml", "render_llamafactory_api"]


class LlamafactoryBackend:
    """``llamafactory-cli api`` in the training toolchain."""

    name = "llamafactory"

    def python(self, recipe: Recipe) -> Path:
        # LlamaFactory's API comes with the training toolchain.
        return recipe.toolchains.train.require("toolchains.train.python", "LlamaFactory", "train-env")

    def check_adapter(self, adapter_dir: Path, *, model_dir: Path, validate: bool) -> Path:
        return check_servable_adapter(adapter_dir, model_dir if validate else None)

    def prepare(self, recipe: Recipe, *, model_dir: Path, adapter_dir: Path | None, kt_weight_dir: Path | None,
                record_dir: Path, log: Log, mode: ServeMode = "lora") -> None:
        return None  # LlamaFactory reads the checkpoint and the adapter as they are

    def launch(self, recipe: Recipe, *, model_dir: Path, adapter_dir: Path | None, kt_weight_dir: Path | None,
               record_dir: Path, port: int | str, host: HostInfo | None, log: Log = None, dry_run: bool = False,
               mode: ServeMode = "lora") -> Launch:
        """Readiness is ``/v1/models`` listing the model; ``infer.yaml`` is written beside the record (not in a
        dry run). LlamaFactory merges the adapter at load whatever ``mode`` says."""
        python = recipe.toolchains.train.python.absolute() if dry_run else self.python(recipe)
        argv, env, infer = render_llamafactory_api(recipe, model_dir=model_dir, adapter_dir=adapter_dir,
                                                   train_python=python, config_dir=record_dir, port=port)
        if not dry_run:
            atomic_write_bytes(record_dir / INFER_YAML, dump_infer_yaml(infer).encode())
        model_name = env["API_MODEL_NAME"]
        return Launch(what="llamafactory-cli api", python=python, argv=argv, env=env, key_env=LLAMAFACTORY_KEY_ENV,
                      model_name=model_name, ready_url=f"{base_url(recipe.serving.host, port)}/models",
                      expect_model=model_name, check_auth=True, infer_path=record_dir / INFER_YAML,
                      details={"infer_config": infer})


BACKEND = LlamafactoryBackend()
