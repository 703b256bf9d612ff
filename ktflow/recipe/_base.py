"""What every section of the recipe shares: strict, validated-on-every-change models, and the check of fields that
name a directory."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Self

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    """A recipe section: unknown keys refused, defaults validated, and never changed in place.

    A change is a new object built through validation: assignment is refused (``frozen``), and
    ``model_copy(update=...)``, which pydantic would apply unvalidated, rebuilds the model, so every rule (the KT
    LoRA rules, the flags ``extra_args`` may not set, the rules across sections) holds for every recipe that exists.
    """

    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=True)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        if not update:
            return super().model_copy(deep=deep)
        return type(self).model_validate({**dict(self), **update})


# Recipe fields that become one directory name under store.root (store/serving/<name>,
# store/eval/<name>, store/runs/<name>-<key>, store/datasets/<name>-<digest>).
def _path_component(value: str, allowed: str, chars: str) -> str:
    """``value`` if it is a safe single directory name matching ``allowed``, else a ValueError."""
    if not re.fullmatch(allowed, value) or value in (".", ".."):
        raise ValueError(
            f"{value!r:.80} is not a plain name; use {chars}, starting with a letter or digit (it names "
            "directories under store.root, so no '/', '..' or absolute path)"
        )
    return value
