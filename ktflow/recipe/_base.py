"""What every section of the recipe shares: strict models, and the check of fields that name a directory."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


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
