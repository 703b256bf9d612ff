"""What a serving backend gives the lifecycle: a :class:`Launch` (how its server starts and how to tell that it is
ready), made by the backend's :class:`Backend` methods. The lifecycle (:mod:`ktflow.stages.serve.lifecycle`) picks
the backend once, from ``serving.backend``, and starts, gates and records whatever it launches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from ktflow.host.hardware import HostInfo
from ktflow.recipe import Recipe

Log = Callable[[str], None] | None
ServeMode = Literal["merged", "lora"]


@dataclass(frozen=True)
class Launch:
    """One server as its backend starts it: the command and what tells that it is ready.

    A dry run (``ktflow serve --dry-run``) prints ``argv``, ``env`` and ``details``: the same object the serve
    stage starts, made with nothing written or started.
    """

    what: str  # for the log
    python: Path  # the toolchain's python: its bin/ goes first on PATH
    argv: list[str]
    env: dict[str, str]  # on top of the caller's environment; never a secret
    key_env: str  # the variable the server reads its API key from
    model_name: str  # the model a client asks for (the adapter's, when one is served)
    ready_url: str
    expect_model: str | None  # a model /v1/models must list before the server counts as ready
    check_auth: bool  # whether the readiness gate also checks that a request without the key is refused
    infer_path: Path | None = None  # LlamaFactory's inference config, written beside the record
    merged_dir: Path | None = None  # the merge of the adapter it serves (serving.mode merged)
    details: dict[str, Any] = field(default_factory=dict)  # what else a dry run shows (the backend's own)


class Backend(Protocol):
    """A serving backend: its toolchain, its adapter check and its launch."""

    name: str

    def python(self, recipe: Recipe) -> Path:
        """The toolchain python the server runs in (HostRequirementError when it is missing)."""
        ...

    def check_adapter(self, adapter_dir: Path, *, model_dir: Path, validate: bool) -> Path:
        """The absolute adapter directory, after the checks this backend makes before anything starts."""
        ...

    def prepare(self, recipe: Recipe, *, model_dir: Path, adapter_dir: Path | None, kt_weight_dir: Path | None,
                record_dir: Path, log: Log, mode: ServeMode = "lora") -> None:
        """Make what the server will read (a swap does it while the old server still serves)."""
        ...

    def launch(self, recipe: Recipe, *, model_dir: Path, adapter_dir: Path | None, kt_weight_dir: Path | None,
               record_dir: Path, port: int | str, host: HostInfo | None, log: Log = None, dry_run: bool = False,
               mode: ServeMode = "lora") -> Launch:
        """The server's :class:`Launch`; ``dry_run``: check and make nothing that needs the files, write nothing;
        ``mode``: ``merged`` serves the adapter folded into the weights (made here when first needed)."""
        ...
