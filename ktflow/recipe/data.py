"""The training data (``dataset``), as LlamaFactory's dataset_info.json will describe it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from ktflow.recipe._base import _path_component, _Strict


class DatasetConfig(_Strict):
    """The training data, as LlamaFactory's dataset_info.json will describe it."""

    name: str = Field(
        description="dataset_info.json entry name (lowercase letters, digits, '_', '-')",
        json_schema_extra={"pattern": "^[a-z0-9][a-z0-9_-]*$"},
    )
    files: list[Path] = Field(min_length=1, description="JSON/JSONL/CSV/Parquet files")
    format: Literal["alpaca", "sharegpt", "openai"] = Field(
        description="alpaca; sharegpt (from/value); openai (messages with role/content)"
    )
    columns: dict[str, str] | None = Field(None, description="LlamaFactory 'columns' overrides")
    tags: dict[str, str] | None = Field(None, description="LlamaFactory sharegpt 'tags' overrides")
    images_dir: Path | None = Field(None, description="Where relative image paths in records point")

    @field_validator("name")
    @classmethod
    def _name_is_a_plain_name(cls, value: str) -> str:
        return _path_component(value, r"[a-z0-9][a-z0-9_-]*", "lowercase letters, digits, '_' and '-'")
