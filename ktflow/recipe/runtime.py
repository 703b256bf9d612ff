"""Where and with what the stages run: the weight conversions (``conversion``), the store (``store``)
and the Python environments of the tools (``toolchains``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from ktflow.recipe._base import _Strict
from ktflow.resources import ToolchainNeed, check_toolchain
from ktflow.store import StoreLayout


class ConversionConfig(_Strict):
    """Settings of the weight conversion stages (dequantize, quantize-int8)."""

    workers: int | None = Field(None, gt=0, description="Parallel workers (default: physical cores)")
    fsync: bool = Field(True, description="fsync each shard before publishing it")
    int8: Literal["auto", "always", "never"] = Field(
        "auto",
        description="CPU INT8 expert weights: auto = when serving.kt_method is AMXINT8; always = "
        "also prepare them for a later SGLang host (e.g. while serving on CPU here)",
    )
    int8_threadpool_count: int | None = Field(
        None, ge=1, description="T to quantize with (default: serving.kt_threadpool_count)"
    )


class StoreConfig(_Strict):
    """Where stage artifacts live (shared storage when stages run on several hosts)."""

    root: Path = Path(".ktflow/store")
    artifacts: str | None = Field(
        None, description="URL of the artifact store for what crosses hosts (sftp://, s3://, gs://, az://, file://): "
                          "each host then keeps its own store root; None: the hosts share the store (one host, or NFS). "
                          "Credentials never go here: the host's environment or an ArtifactStore block holds them")

    @field_validator("artifacts")
    @classmethod
    def _artifact_url(cls, value: str | None) -> str | None:
        from ktflow.artifact_store import check_artifact_url

        return None if value is None else check_artifact_url(value)

    @property
    def layout(self) -> StoreLayout:
        """Where each artifact lives under :attr:`root`."""
        return StoreLayout(self.root)


class Toolchain(_Strict):
    """A Python environment a stage's tools run in."""

    python: Path = Field(description="The environment's python executable")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables")

    def require(self, field: str, holds: str, make_target: str) -> Path:
        """The absolute python path, or a HostRequirementError saying how to install it.

        Args:
            field: the recipe field, e.g. ``toolchains.train.python``.
            holds: what the environment must contain, e.g. ``LlamaFactory``.
            make_target: the Makefile target that builds it here.
        """
        check_toolchain(self.need(field, holds, make_target))
        return self.python.absolute()

    def need(self, field: str, holds: str, make_target: str) -> ToolchainNeed:
        """This environment as a stage's declared need (:class:`~ktflow.resources.Resources`)."""
        return ToolchainNeed(python=self.python.absolute(), field=field, what=holds, make_target=make_target)


class ToolchainsConfig(_Strict):
    train: Toolchain = Toolchain(python=Path(".venv-train/bin/python"))
    serve: Toolchain = Toolchain(python=Path(".venv-serve/bin/python"))
