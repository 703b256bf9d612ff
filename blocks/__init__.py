"""Prefect Block types of ktflow: where the store is, the artifact store what crosses hosts goes
through, which Python runs a stage's tools, the HF credentials, and a served endpoint.

Register them once per server with ``prefect block register -m blocks`` (from the checkout),
then create documents in the UI or in Python (``ModelStore(root="/mnt/store").save("shared")``).
Hosts differ in where their environments live, so a worker is pointed at its own documents:
``ktflow worker --toolchain train=gpu1-train --toolchain serve=gpu1-serve`` puts the names in
the worker's environment and every stage flow it runs applies them (flows/stages.py).
"""

from __future__ import annotations

from pathlib import Path

from prefect.blocks.core import Block
from prefect.types import SecretDict
from pydantic import Field, SecretStr

from ktflow.artifact_store import ArtifactStore as ArtifactStoreClient
from ktflow.artifact_store import check_artifact_url
from ktflow.recipe import Recipe
from ktflow.recipe import Toolchain as RecipeToolchain


class ModelStore(Block):
    """The store: one root for every stage's artifacts, on one host or mounted at the same path on
    every host (NFS). Hosts without a shared filesystem keep their own (``ktflow worker --store-root``)
    and hand each other what crosses through an :class:`ArtifactStore`."""

    _block_type_name = "ktflow Model Store"
    _block_type_slug = "ktflow-model-store"
    _description = "Where ktflow's stage artifacts live: weights, BF16/INT8 copies, runs, adapters."

    root: str = Field(description="absolute path of the store, the same on every host")

    def apply(self, recipe: Recipe) -> Recipe:
        """``recipe`` with its store root replaced by this store's."""
        return recipe.model_copy(update={"store": recipe.store.model_copy(update={"root": Path(self.root)})})


class ArtifactStore(Block):
    """Where what crosses hosts travels (the SFT adapter), with this host's credentials for it.

    Hosts without a shared filesystem each keep their own store; a worker started with
    ``ktflow worker --artifacts BLOCK`` reaches the artifact store through this block. The
    credentials stay in the block (secret) and never enter a recipe, argv or log.
    """

    _block_type_name = "ktflow Artifact Store"
    _block_type_slug = "ktflow-artifact-store"
    _description = "An fsspec URL (sftp://, s3://, gs://, az://, file://) and the credentials to reach it."

    url: str = Field(description="e.g. sftp://ktflow@srv1/srv/ktflow-artifacts or s3://bucket/ktflow; no password")
    storage_options: SecretDict = Field(
        default_factory=lambda: SecretDict({}),
        description="fsspec options with the credentials, e.g. {\"key_filename\": \"/etc/ktflow/id_ed25519\"} "
                    "(sftp) or {\"key\": ..., \"secret\": ..., \"client_kwargs\": {\"endpoint_url\": ...}} (s3)")

    def store(self) -> ArtifactStoreClient:
        """The artifact store client at this block's URL (a host may reach the recipe's store by
        another address), with the block's credentials."""
        check_artifact_url(self.url, "ArtifactStore.url")
        return ArtifactStoreClient(self.url, self.storage_options.get_secret_value())


class Toolchain(Block):
    """A Python environment on one host that runs a stage's tools (LlamaFactory, kt-kernel, SGLang)."""

    _block_type_name = "ktflow Toolchain"
    _block_type_slug = "ktflow-toolchain"
    _description = "The python executable (and extra environment) of a training or serving toolchain on a host."

    role: str = Field(pattern="^(train|serve)$", description="train or serve")
    python: str = Field(description="absolute path of the environment's python")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables for its tools")

    def apply(self, recipe: Recipe) -> Recipe:
        """``recipe`` with the toolchain of this block's role replaced."""
        toolchains = recipe.toolchains.model_copy(
            update={self.role: RecipeToolchain(python=Path(self.python), env=dict(self.env))})
        return recipe.model_copy(update={"toolchains": toolchains})


class HuggingFaceCredentials(Block):
    """The Hugging Face token the download stage uses (kept as a secret; never logged or written)."""

    _block_type_name = "ktflow Hugging Face Credentials"
    _block_type_slug = "ktflow-huggingface-credentials"
    _description = "A Hugging Face access token for gated or private checkpoints."

    token: SecretStr = Field(description="hf_... access token")


class ServingEndpoint(Block):
    """An endpoint a serve stage started: where it answers and which model names it serves."""

    _block_type_name = "ktflow Serving Endpoint"
    _block_type_slug = "ktflow-serving-endpoint"
    _description = "An OpenAI-compatible endpoint started by ktflow (the key stays in the named env var)."

    url: str = Field(description="base URL, e.g. http://10.0.0.5:30000/v1")
    base_model: str = Field(description="model name that answers without the adapter")
    tuned_model: str = Field(description="model name that answers with the adapter")
    api_key_env: str = Field(description="the environment variable holding the key on the serving host")
    adapter_dir: str = Field(description="the adapter being served")
