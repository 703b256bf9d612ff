"""Adapter versions of a recipe and the pointer to the one in production (a model registry).

Trained is not in production. Every adapter the pipeline publishes for a recipe becomes
**version N** of it, with its lineage (the base checkpoint, dataset and recipe digests, the SFT
run, what started the run); the evaluation's verdict is added once the candidate is judged.
**Production** is a pointer to one version, moved by a promotion and moved back by a rollback,
like an MLflow alias (``champion``) or a ZenML stage; every move is kept in its history.

Layout, one directory per recipe (``<store>/registry/<recipe>/``)::

    v0001.json ...        one AdapterVersion each (written once, the verdict added later)
    production.json       the pointer: the version serving, the one before, every move
    pending-move.json     a promotion in flight (written before the server is touched,
                          removed after the pointer moved): what a crash leaves behind
    .lock                 flock: one writer of these records at a time (version numbers, the pointer)
    .move.lock            flock: one move of production at a time (ktflow.stages.promotion)

Every file is written atomically; a reader sees the old document or the new, never half of one.
This module only keeps records; moving what a server serves is :mod:`ktflow.stages.promotion`'s job.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from ktflow.errors import InvalidInputError
from ktflow.store import StoreLayout, atomic_write_json, read_manifest

PRODUCTION_FILE = "production.json"
PENDING_FILE = "pending-move.json"
JUDGING_MOVE = "swap mode: serving the candidate to judge it"  # a move that does not make a version production

# "deployment": a run of a deployment started from the Prefect UI or `prefect deployment run` (the OSS
# server records no difference between the two).
TriggerKind = Literal["cli", "schedule", "dataset-event", "deployment", "unknown"]
CandidateMode = Literal["beside", "offline", "swap"]
VerdictStatus = Literal["passed", "failed", "not-evaluated"]


def utc_now() -> str:
    """Now, as every record here writes a time (UTC, to the second)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Trigger(BaseModel):
    """What started the run that trained a version."""

    kind: TriggerKind = "unknown"
    detail: str = ""  # the flow run, deployment or command

    def __str__(self) -> str:
        return f"{self.kind} ({self.detail})" if self.detail else self.kind


class Lineage(BaseModel):
    """Where a version came from: enough to tell two versions apart and to retrace either."""

    base_digest: str = Field(description="The base checkpoint the adapter was trained on (manifest digest)")
    base_dir: Path = Field(description="That checkpoint on the host that trained it")
    base_fingerprint: str | None = Field(
        None, description="The base's content fingerprint (formats.checkpoint.checkpoint_fingerprint): equal on "
                          "every host that holds the same base, where base_digest is one host's cache key")
    dataset_digest: str
    recipe_digest: str
    sft_run: Path = Field(description="The SFT stage's adapter directory")
    sft_manifest_digest: str
    trigger: Trigger = Field(default_factory=Trigger)


class Verdict(BaseModel):
    """How a version was judged as a candidate."""

    status: VerdictStatus  # the gate's verdict (whether it serves is production's pointer)
    enforced: bool = True  # False: the recipe sets no gate_metric; the gate was only reported
    summary: str  # "style +100.00 >= +50.00" / why it failed
    mode: CandidateMode | None = None  # how the candidate was judged (None: not evaluated)
    report: Path | None = None  # the evaluation report (report.md)
    served_window: tuple[str, str] | None = None  # swap mode: when the candidate took production traffic
    evaluation_digest: str = ""  # the evaluation settings and held-out files it was judged with
    at: str = Field(default_factory=utc_now)


class AdapterVersion(BaseModel):
    """Version N of a recipe's adapter."""

    recipe: str
    version: int
    adapter_dir: Path  # the converted adapter a server loads
    adapter_digest: str  # its manifest digest: the same adapter is the same version
    created_at: str = Field(default_factory=utc_now)
    lineage: Lineage
    verdict: Verdict | None = None

    @property
    def label(self) -> str:
        return f"v{self.version}"


class Move(BaseModel):
    """One move of the production pointer."""

    at: str = Field(default_factory=utc_now)
    from_version: int | None
    to_version: int | None  # None: production was cleared (a rejected first candidate in swap mode)
    why: str  # "promoted (gate passed)", "ktflow promote", "ktflow rollback", "recovered after a crash"


class Production(BaseModel):
    """The production pointer of a recipe."""

    version: int | None = None
    previous: int | None = None  # the version production was before the last move (rollback's target)
    history: list[Move] = Field(default_factory=list)


class PendingMove(BaseModel):
    """A promotion in flight: written before the server is touched, removed once the pointer moved."""

    from_version: int | None
    to_version: int
    why: str
    model_dir: Path  # what the server serves the adapter on, to restart either side after a crash
    kt_weight_dir: Path | None = None
    pid: int = Field(default_factory=os.getpid)
    started_at: str = Field(default_factory=utc_now)


class AdapterRegistry:
    """The versions of one recipe's adapter in ``store_root/registry/<recipe>``."""

    def __init__(self, store_root: Path, recipe_name: str) -> None:
        self.recipe = recipe_name
        self.root = StoreLayout(store_root).registry(recipe_name).absolute()

    # ------------------------------------------------------------------ reading

    def versions(self) -> list[AdapterVersion]:
        """Every version, oldest first."""
        if not self.root.is_dir():
            return []
        return [AdapterVersion.model_validate_json(p.read_text(encoding="utf-8"))
                for p in sorted(self.root.glob("v[0-9]*.json"))]

    def get(self, version: int) -> AdapterVersion:
        """Version ``version``.

        Raises:
            InvalidInputError: the recipe has no such version (the message lists those it has).
        """
        path = self._version_path(version)
        if not path.is_file():
            have = ", ".join(v.label for v in self.versions()) or "none yet"
            raise InvalidInputError(f"{self.recipe} v{version}", f"no such adapter version (the recipe has: {have})",
                                    "`ktflow adapters RECIPE` lists the versions")
        return AdapterVersion.model_validate_json(path.read_text(encoding="utf-8"))

    def find(self, adapter_digest: str) -> AdapterVersion | None:
        """The version of the adapter whose manifest digest is ``adapter_digest``, if registered."""
        return next((v for v in self.versions() if v.adapter_digest == adapter_digest), None)

    def production(self) -> Production:
        path = self.root / PRODUCTION_FILE
        if not path.is_file():
            return Production()
        return Production.model_validate_json(path.read_text(encoding="utf-8"))

    def production_version(self) -> AdapterVersion | None:
        """The version production points at (None: nothing was promoted yet)."""
        current = self.production().version
        return self.get(current) if current is not None else None

    def pending(self) -> PendingMove | None:
        """A promotion that started and did not finish (its process crashed), if any."""
        path = self.root / PENDING_FILE
        if not path.is_file():
            return None
        return PendingMove.model_validate_json(path.read_text(encoding="utf-8"))

    # ------------------------------------------------------------------ writing

    @contextlib.contextmanager
    def locked(self, name: str = ".lock") -> Iterator[None]:
        """Hold one of the registry's locks (flock: released by the kernel if the holder dies):
        ``.lock`` for its records (held for milliseconds), ``.move.lock`` for a move of production
        (held while a server swaps; :mod:`ktflow.stages.promotion`). Not reentrant."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def register(self, adapter_dir: Path, lineage: Lineage) -> AdapterVersion:
        """The version of the adapter in ``adapter_dir``: the existing one if it was registered
        before (a rerun of an unchanged recipe makes no new version), else the next number.

        Raises:
            InvalidInputError: ``adapter_dir`` is not a published artifact (no manifest).
        """
        manifest = read_manifest(adapter_dir)
        if manifest is None:
            raise InvalidInputError(str(adapter_dir), "holds no manifest.json: not a published adapter",
                                    "register the convert-lora stage's output")
        digest = manifest.digest()
        with self.locked():
            found = self.find(digest)
            if found is not None:
                return found
            numbers = [v.version for v in self.versions()]
            version = AdapterVersion(recipe=self.recipe, version=max(numbers, default=0) + 1,
                                     adapter_dir=Path(adapter_dir).absolute(), adapter_digest=digest, lineage=lineage)
            atomic_write_json(self._version_path(version.version), version.model_dump(mode="json"))
            return version

    def record_verdict(self, version: int, verdict: Verdict) -> AdapterVersion:
        """Attach (or replace) the verdict of ``version``'s latest judgement."""
        with self.locked():
            updated = self.get(version).model_copy(update={"verdict": verdict})
            atomic_write_json(self._version_path(version), updated.model_dump(mode="json"))
            return updated

    def begin_move(self, move: PendingMove) -> None:
        """Record a promotion about to touch the server (before anything is stopped)."""
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.root / PENDING_FILE, move.model_dump(mode="json"))

    def finish_move(self, to_version: int, why: str) -> Production:
        """Point production at ``to_version`` (the server serves it now) and clear the pending move."""
        with self.locked():
            current = self.production()
            if current.version != to_version:
                current = Production(version=to_version, previous=current.version, history=[
                    *current.history, Move(from_version=current.version, to_version=to_version, why=why)])
                atomic_write_json(self.root / PRODUCTION_FILE, current.model_dump(mode="json"))
            (self.root / PENDING_FILE).unlink(missing_ok=True)
            return current

    def clear_production(self, why: str) -> Production:
        """Point production at nothing (its endpoint was stopped)."""
        with self.locked():
            current = self.production()
            # The rejected version never counted as production: a rollback goes where it would have before.
            current = Production(version=None, previous=current.previous, history=[
                *current.history, Move(from_version=current.version, to_version=None, why=why)])
            atomic_write_json(self.root / PRODUCTION_FILE, current.model_dump(mode="json"))
            (self.root / PENDING_FILE).unlink(missing_ok=True)
            return current

    def abandon_move(self) -> None:
        """Clear the pending move: the server serves what production points at."""
        (self.root / PENDING_FILE).unlink(missing_ok=True)

    def rollback_target(self) -> AdapterVersion:
        """The version a rollback returns to: the latest one production pointed at before the current
        one, skipping a candidate that served only to be judged (swap mode; a version promoted by
        hand counts, whatever its verdict).

        Raises:
            InvalidInputError: nothing else was ever promoted, so there is nothing to go back to.
        """
        current = self.production()
        for move in reversed(current.history):
            if move.to_version is None or move.to_version == current.version or move.why == JUDGING_MOVE:
                continue
            return self.get(move.to_version)
        what = f"only v{current.version} was ever promoted" if current.version else "nothing was promoted yet"
        raise InvalidInputError(f"{self.recipe}", f"has no earlier production version to roll back to ({what})",
                                "promote a version by number: `ktflow promote RECIPE VERSION`")

    def _version_path(self, version: int) -> Path:
        return self.root / f"v{version:04d}.json"


def summarize(registry: AdapterRegistry) -> dict:
    """The registry as one JSON-able document: versions, which one serves, a pending move."""
    production = registry.production()
    return {
        "recipe": registry.recipe,
        "production": production.version,
        "previous": production.previous,
        "pending_move": (p.model_dump(mode="json") if (p := registry.pending()) else None),
        "versions": [v.model_dump(mode="json") for v in registry.versions()],
        "history": [m.model_dump(mode="json") for m in production.history],
    }
