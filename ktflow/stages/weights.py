"""Which weights each stage reads, and where they live in the store.

The pipeline's weight stages are download (or a reference to a local copy) and, where some
stage reads BF16 and the source is INT4/FP8, dequantize. These functions run them (both are
cache hits when already done) or, for ``--dry-run``, only say where their outputs will be.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ktflow.formats.checkpoint import checkpoint_digest
from ktflow.recipe import Recipe, as_weights_reader, needs_bf16_weights, needs_int8_weights


def bf16_dir_for(recipe: Recipe, source_dir: Path, digest: str | None = None) -> Path:
    """Where the dequantize stage publishes the BF16 copy of ``source_dir``. ``digest``: its
    checkpoint digest when the host that holds it computed it (the caller's host may not)."""
    return recipe.store.layout.bf16((digest or checkpoint_digest(source_dir))[:16])


def ensure_source(recipe: Recipe, *, token: str | None = None) -> Path:
    """The source checkpoint directory (downloaded and verified, or the local copy)."""
    from ktflow.stages.download import download_checkpoint

    return download_checkpoint(recipe.source, recipe.store.root, token=token).path


def trains_on_source(recipe: Recipe) -> bool:
    """Whether SFT reads the source checkpoint as it is (KT RAWINT4 / FP8 experts, or a BF16 source)."""
    recipe = as_weights_reader(recipe)
    kt = recipe.sft.kt_config
    native = recipe.sft.backend == "kt" and kt is not None and kt.effective_weight_format != "bf16"
    return native or recipe.source.format == "bf16" or not needs_bf16_weights(recipe)


def ensure_training_weights(
    recipe: Recipe, *, source: Path | None = None, token: str | None = None, workers: int | None = None
) -> Path:
    """The weights LlamaFactory trains on: BF16 when a stage needs it, else the source as is.

    ``source`` is the source checkpoint when the caller already has it (else it is ensured here).
    """
    source = source or ensure_source(recipe, token=token)
    if trains_on_source(recipe):
        return source
    from ktflow.stages.dequantize import dequantize_checkpoint

    result = dequantize_checkpoint(source, bf16_dir_for(recipe, source), workers=workers or recipe.conversion.workers,
                                   fsync=recipe.conversion.fsync)
    return result.path


def expected_training_weights(recipe: Recipe) -> Path:
    """Where the training weights are or will be, without fetching or converting anything."""
    base = expected_source(recipe)
    if trains_on_source(recipe):
        return base
    if (base / "config.json").exists():
        return bf16_dir_for(recipe, base)
    return recipe.store.layout.bf16("pending")


def expected_source(recipe: Recipe) -> Path:
    """Where the source checkpoint is or will be, without fetching anything."""
    source = recipe.source
    if source.local_path is not None:
        return source.local_path
    if source.repo_id is not None:
        return recipe.store.layout.weights(f"{source.repo_id.replace('/', '--')}@{source.revision}")
    return recipe.store.layout.weights("uri-pending")


def int8_dir_for(recipe: Recipe, bf16_dir: Path) -> Path:
    """Where the quantize-int8 stage publishes the AMXINT8 weights of ``bf16_dir``."""
    from ktflow.recipe import int8_threadpool_count

    return recipe.store.layout.int8(f"{Path(bf16_dir).name}-tp{int8_threadpool_count(recipe)}")


def serving_weights(recipe: Recipe, *, source_dir: Path, bf16_dir: Path | None) -> tuple[Path, Path | None]:
    """``(model_dir, kt_weight_dir)`` the serve stage starts with.

    sglang-kt loads the non-expert weights from the model dir and the CPU experts from
    ``--kt-weight-path``: the original checkpoint for RAWINT4/FP8, the BF16 copy for BF16/AMXBF16,
    the quantize-int8 output for AMXINT8. The CPU backend needs only a BF16 model (no kt weights).
    """
    method = recipe.serving.kt_method
    bf16 = bf16_dir or source_dir
    if recipe.serving.backend == "llamafactory":
        return bf16, None
    if method in ("RAWINT4", "FP8"):
        return source_dir, source_dir
    if method == "AMXINT8":
        return bf16, int8_dir_for(recipe, bf16)
    return bf16, bf16


def ensure_serving_weights(recipe: Recipe, *, source_dir: Path, bf16_dir: Path | None,
                           log: Callable[[str], None] | None = None) -> tuple[Path, Path | None]:
    """:func:`serving_weights`, with the AMXINT8 experts made when missing: the quantize-int8 stage
    of the BF16 weights for the recipe's T (a cache hit once published), as the pipeline runs it.

    Raises:
        as :func:`ktflow.stages.quantize_int8.quantize_int8` (a host without kt-kernel's INT8 kernels,
        no serving toolchain, too little RAM or disk).
    """
    model_dir, kt_weights = serving_weights(recipe, source_dir=source_dir, bf16_dir=bf16_dir)
    if recipe.serving.backend == "sglang" and recipe.serving.kt_method == "AMXINT8" and needs_int8_weights(recipe):
        assert kt_weights is not None
        from ktflow.recipe import int8_threadpool_count
        from ktflow.stages.quantize_int8 import quantize_int8

        result = quantize_int8(model_dir, kt_weights, threadpool_count=int8_threadpool_count(recipe),
                               serve_python=recipe.toolchains.serve.python, workers=recipe.conversion.workers,
                               fsync=recipe.conversion.fsync)
        if log:
            log(f"quantize-int8: {'cache hit' if result.cached else f'{result.layers} layers'}, "
                f"T={result.threadpool_count} -> {result.path}")
    return model_dir, kt_weights

