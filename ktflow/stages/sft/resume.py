"""The SFT run directory: one per base model, data and settings (:func:`run_key`), and resuming in it
from the last complete checkpoint (never from step 0, never from an adapter); the trainer's log
records as they are written."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from ktflow import ENGINE_VERSION
from ktflow.errors import KtflowError
from ktflow.formats.safetensors_io import read_header
from ktflow.recipe import Recipe
from ktflow.stages.sft.render import CHECKPOINT_FILES, KT_OPTIMIZER_INDEX, OPTIMIZER_STATES, TrainerProgress

# --------------------------------------------------------------------------- run directory and resume


def run_key(recipe: Recipe, *, base_digest: str, data_digest: str) -> str:
    """The run's identity: base model, data, every training setting and the engine version.

    The store root and toolchain paths are left out (they move between hosts; the result doesn't).
    Where ktflow shapes KT's micro-batches (``sft.kt_shape_batches``), the split depends on the host
    that trains, so the key holds the effective batch instead: any host finds the run, and a resume
    elsewhere continues it at the same sample (a step holds the same records whatever the split).
    """
    settings = recipe.sft.model_dump(mode="json", exclude={"kt_shape_batches"})
    if recipe.sft.kt_shape_batches:
        settings["effective_batch"] = recipe.sft.per_device_train_batch_size * recipe.sft.gradient_accumulation_steps
        settings["per_device_train_batch_size"] = settings["gradient_accumulation_steps"] = None
    payload = json.dumps(
        {"base": base_digest, "data": data_digest, "sft": settings, "dataset": recipe.dataset.name,
         "engine": ENGINE_VERSION},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def run_dir_for(recipe: Recipe, key: str) -> Path:
    return recipe.store.layout.run(f"{recipe.name}-{key[:12]}")


def _checkpoint_step(path: Path) -> int:
    try:
        return int(path.name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def last_complete_checkpoint(output_dir: Path) -> Path | None:
    """The newest ``checkpoint-N`` that holds everything a resume needs; newer, incomplete ones
    (a kill during a save) are moved aside so LlamaFactory can't pick them up either."""
    candidates = sorted((p for p in output_dir.glob("checkpoint-*") if p.is_dir()), key=_checkpoint_step, reverse=True)
    for ckpt in candidates:
        if checkpoint_is_complete(ckpt):
            return ckpt
        aside = ckpt.with_name(f".incomplete-{ckpt.name}-{int(time.time())}")
        os.replace(ckpt, aside)
    return None


def checkpoint_is_complete(ckpt: Path) -> bool:
    """Whether the trainer finished writing ``ckpt``: what a resume needs is all there and readable (a kill
    during a save leaves the directory without its trainer state, or with a truncated weights file)."""
    if not all((ckpt / name).is_file() for name in CHECKPOINT_FILES):
        return False
    if not (any((ckpt / name).is_file() for name in OPTIMIZER_STATES) or _kt_optimizer_complete(ckpt)):
        return False
    weights = [ckpt / n for n in ("adapter_model.safetensors", "model.safetensors") if (ckpt / n).is_file()]
    weights += sorted(ckpt.glob("model-*.safetensors"))
    if not weights:
        return False
    try:
        json.loads((ckpt / "trainer_state.json").read_text())
        for w in weights:
            read_header(w)
    except (ValueError, OSError, KtflowError):
        return False
    return True


def _kt_optimizer_complete(ckpt: Path) -> bool:
    """KT's per-rank optimizer state: its index (written after every rank's file) names files all present."""
    try:
        index = json.loads((ckpt / KT_OPTIMIZER_INDEX).read_text())
        files = index["rank_files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return bool(files) and all(isinstance(f, str) and (ckpt / f).is_file() for f in files)


def _is_final_checkpoint(ckpt: Path) -> bool:
    """Whether ``ckpt`` was saved at the run's last step (its trainer state says so)."""
    state = json.loads((ckpt / "trainer_state.json").read_text())
    return 0 < int(state.get("max_steps") or 0) <= int(state.get("global_step") or 0)


def _adapter_from_checkpoint(ckpt: Path, output_dir: Path) -> None:
    """Put the final checkpoint's adapter where LlamaFactory's final save would have, unless a
    complete one is there already (the kill came after that save)."""
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        target = output_dir / name
        try:
            if name.endswith(".safetensors"):
                read_header(target)
            else:
                json.loads(target.read_text())
            continue
        except (OSError, ValueError, KtflowError):
            pass
        partial = target.with_name(f".{name}.partial")
        shutil.copyfile(ckpt / name, partial)
        os.replace(partial, target)


def _trainer_records(callback: Callable[[TrainerProgress], None]) -> Callable[[str], None]:
    """A :class:`~ktflow.host.process.LogFollower` callback: each ``trainer_log.jsonl`` record to ``callback``."""

    def on_line(line: str) -> None:
        try:
            record = TrainerProgress.model_validate(json.loads(line))
        except ValueError:
            return
        callback(record)

    return on_line
