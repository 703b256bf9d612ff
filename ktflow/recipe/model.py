"""The base model: where it comes from (``source``), its format, and its size before a download."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ktflow.recipe._base import _Strict

SourceFormat = Literal["kimi-k2.5-int4", "kimi-k2-int4", "deepseek-v3-fp8", "bf16"]
INT4_FORMATS: frozenset[str] = frozenset({"kimi-k2.5-int4", "kimi-k2-int4"})


class ModelFacts(_Strict):
    """What a model card or config.json says of a model's size: lets ``ktflow plan`` size a
    checkpoint before it is downloaded (once it is here, its headers are used instead)."""

    parameters: int = Field(gt=0, description="Every weight, quantized ones counted as the values they decode to")
    expert_parameters: int = Field(ge=0, description="The routed experts' share of parameters")
    stored_bytes: int = Field(gt=0, description="The checkpoint's size on disk")
    expert_stored_bytes: int = Field(ge=0, description="The routed experts' share of stored_bytes")
    num_layers: int = Field(gt=0, description="config.json: num_hidden_layers")
    moe_layers: int = Field(ge=0, description="Layers with routed experts (num_hidden_layers - first_k_dense_replace)")
    hidden_size: int = Field(gt=0, description="config.json: hidden_size")
    vocab_size: int = Field(gt=0, description="config.json: vocab_size")
    routed_experts: int = Field(ge=0, description="config.json: n_routed_experts (num_experts)")
    experts_per_token: int = Field(ge=0, description="config.json: num_experts_per_tok")
    kv_bytes_per_token: int = Field(
        0, ge=0, description="One token's KV cache in BF16 over every layer: MLA (kv_lora_rank + qk_rope_head_dim) "
        "x 2 B x layers; else 2 x num_key_value_heads x head_dim x 2 B x layers. 0: unknown (the serving plan then "
        "leaves the KV pool out)",
    )
    kv_latent: bool = Field(False, description="MLA (config.json has kv_lora_rank): every tensor-parallel rank keeps "
                            "the whole cache, where per-head keys and values split over the ranks")


class SourceConfig(_Strict):
    """Where the base model comes from, and the format it is in."""

    repo_id: str | None = Field(None, description="Hugging Face repo, e.g. moonshotai/Kimi-K2.5")
    revision: str = Field(
        "main", description="Branch, tag or commit; a branch is resolved to its sha and recorded"
    )
    local_path: Path | None = Field(None, description="A local or NFS checkpoint directory")
    uri: str | None = Field(None, description="An fsspec URL (s3://, gs://, ...) of a checkpoint dir")
    allow_patterns: list[str] | None = Field(None, description="Only fetch files matching these globs")
    format: SourceFormat = Field(description="The checkpoint's format; checked against the files")
    size: ModelFacts | None = Field(None, description="The model's size before it is downloaded (ktflow plan)")

    @field_validator("repo_id")
    @classmethod
    def _repo_id_shape(cls, value: str | None) -> str | None:
        if value is not None and (
            not re.fullmatch(r"[\w.-]+/[\w.-]+", value) or any(p in (".", "..") for p in value.split("/"))
        ):
            raise ValueError(f"'{value}' is not a hub repo id; write it as owner/name")
        return value

    @field_validator("revision")
    @classmethod
    def _revision_shape(cls, value: str) -> str:
        # A git ref never has a '..' component, a leading '/' or a backslash (git check-ref-format);
        # the revision is part of a directory name under store.root/weights.
        parts = value.split("/")
        if not value or value.startswith("/") or "\\" in value or any(p in ("", ".", "..") for p in parts) \
                or any(ord(c) < 32 for c in value):
            raise ValueError(
                f"{value!r} is not a branch, tag or commit sha; use e.g. main, v1.0 or a 40-hex commit"
            )
        return value

    @model_validator(mode="after")
    def _exactly_one_location(self) -> SourceConfig:
        given = [k for k in ("repo_id", "local_path", "uri") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "@repo_id: set exactly one of repo_id, local_path, uri "
                f"(got {', '.join(given) if given else 'none'})"
            )
        return self
