"""Tokens a micro-batch carries, and the micro-batch shape KT trains fastest.

KT streams every routed expert through the CPU once per micro-batch pass, so how a recipe splits its
effective batch (``per_device_train_batch_size x gradient_accumulation_steps``) decides its speed: eight
micro-batches of one record cost nearly eight times one micro-batch of eight (benchmarks/data/kt-throughput:
49.2 s against 16.1 s a step). :func:`shape_kt_batches` keeps the effective batch and picks the split the
time model (:func:`~ktflow.planning.costs.kt_step_estimate`) predicts fastest among those whose longest
micro-batch (``cutoff_len`` x records) fits the GPUs and RAM as the SFT preflight checks them.

Tokens come from the dataset where it is readable (:func:`record_lengths`: each record's tokens by the
model's tokenizer when it is on this host, else ~4 UTF-8 bytes a token, cut at ``cutoff_len``); a
micro-batch of ``b`` records is padded to its longest, ``b x`` the expected longest of ``b`` records.
Without the dataset every record counts as ``cutoff_len`` tokens (the bound). Imports: costs, sizing,
recipe, resources, formats.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ktflow.host.hardware import HostInfo
from ktflow.planning.costs import COSTS, CostModel, kt_step_estimate
from ktflow.planning.host_speed import KtStepRecord, calibrated_costs, host_records, kt_threads
from ktflow.planning.sizing import ModelSize, kt_sft_needs
from ktflow.recipe import Recipe, SftConfig
from ktflow.resources import gpu_shortfall, ram_shortfall
from ktflow.units import GiB

# Records read to estimate the lengths (the first ones, in file order): enough for the distribution.
MAX_RECORDS = 4096
# Bytes of UTF-8 per token when the model's tokenizer is not here (English prose; code and CJK differ),
# and the tokens a chat template adds around each message.
BYTES_PER_TOKEN = 4
TEMPLATE_TOKENS_PER_MESSAGE = 4
# A shape other than the one written is chosen only with this share of each GPU to spare (the GPU
# estimate is within ~5 % on the H100 host; an unlucky micro-batch of long records needs room).
GPU_MARGIN = 0.9


class RecordLengths(BaseModel):
    """Tokens per training record, after the template and ``cutoff_len`` (sorted), and where they came from."""

    lengths: list[int]
    basis: str
    records: int  # records in the dataset (``lengths`` may hold the first MAX_RECORDS)

    @property
    def mean(self) -> float:
        return sum(self.lengths) / len(self.lengths)

    def padded_tokens(self, batch: int) -> float:
        """Expected tokens of a micro-batch of ``batch`` records drawn at random, each padded to the
        longest: ``batch x E[max]`` (order statistics of the measured lengths)."""
        n = len(self.lengths)
        expected_max = sum(length * ((i + 1) ** batch - i ** batch) / n ** batch
                           for i, length in enumerate(self.lengths))
        return batch * expected_max


def record_lengths(recipe: Recipe, model_dir: Path | None = None) -> RecordLengths | None:
    """Each record's tokens as training sees them (cut at ``cutoff_len``), from the dataset files when
    they are all here (None otherwise, or when no record is good). Counted with the tokenizer in
    ``model_dir`` (its chat template if it has one) when it loads, else ~4 UTF-8 bytes a token."""
    from ktflow.errors import KtflowError
    from ktflow.formats.dataset import record_messages

    if not all(Path(f).is_file() for f in recipe.dataset.files):
        return None
    tokenizer = load_tokenizer(model_dir)
    counted, total = [], 0
    try:
        for messages in record_messages(recipe.dataset):
            total += 1
            if len(counted) < MAX_RECORDS:
                counted.append(min(_tokens(messages, tokenizer), recipe.sft.cutoff_len))
    except KtflowError:
        return None
    if not counted:
        return None
    how = "the model's tokenizer" if tokenizer is not None else f"~{BYTES_PER_TOKEN} UTF-8 bytes a token (no tokenizer here)"
    sample = f"the first {len(counted)} of {total} records" if len(counted) < total else f"{total} records"
    return RecordLengths(lengths=sorted(counted), records=total,
                         basis=f"{sample}, counted with {how}, cut at cutoff_len {recipe.sft.cutoff_len}")


def load_tokenizer(model_dir: Path | None) -> Any:
    """The model's tokenizer, or None where ``model_dir`` holds no model or its tokenizer does not load."""
    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    except Exception:  # noqa: BLE001 - any loader failure: fall back to the byte estimate
        return None


def _text(content: Any) -> str:
    return content if isinstance(content, str) else str(content or "")


def chat_token_ids(messages: list[dict[str, Any]], tokenizer: Any) -> tuple[list[int], bool]:
    """A record's token ids as training renders it, and whether the model's chat template made them: with its
    template where it has one that renders, else the turns' text joined (the template's own tokens missing)."""
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]], True
        except Exception:  # noqa: BLE001 - a template that cannot render these turns: their text
            pass
    text = "\n".join(_text(m.get("content")) for m in messages)
    return [int(i) for i in tokenizer(text)["input_ids"]], False


def _tokens(messages: list[dict[str, Any]], tokenizer: Any) -> int:
    if tokenizer is not None:
        try:
            ids, templated = chat_token_ids(messages, tokenizer)
            return len(ids) + (0 if templated else TEMPLATE_TOKENS_PER_MESSAGE * len(messages))
        except Exception:  # noqa: BLE001 - a tokenizer that fails on the text: count the bytes instead
            pass
    size = sum(len(_text(m.get("content")).encode()) for m in messages)
    return math.ceil(size / BYTES_PER_TOKEN) + TEMPLATE_TOKENS_PER_MESSAGE * len(messages)


def tokens_per_micro_batch(sft: SftConfig, lengths: RecordLengths | None) -> float:
    """Tokens a micro-batch of ``sft`` carries through the model, padding included."""
    if lengths is None:
        return float(sft.per_device_train_batch_size * sft.cutoff_len)
    return lengths.padded_tokens(sft.per_device_train_batch_size)


def tokens_basis(sft: SftConfig, lengths: RecordLengths | None) -> str:
    """How :func:`tokens_per_micro_batch` was found, for a plan line."""
    tokens = tokens_per_micro_batch(sft, lengths)
    if lengths is None:
        return (f"{tokens:,.0f} tokens a micro-batch: every record counted as cutoff_len {sft.cutoff_len} "
                "(the bound; the dataset is not here)")
    return (f"{tokens:,.0f} tokens a micro-batch: {sft.per_device_train_batch_size} record(s) of "
            f"~{lengths.mean:,.0f} tokens padded to the longest ({lengths.basis})")


# --------------------------------------------------------------------------- shaping


class BatchShape(BaseModel):
    """One split of the effective batch and what the models predict for it."""

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    tokens_per_micro_batch: float
    step_s: float
    tokens_per_s: float  # the records' own tokens (no padding) per second
    gpu_bytes: int  # each GPU, at the longest micro-batch cutoff_len allows
    rss_bytes: int
    fits: bool
    problem: str = ""

    @property
    def label(self) -> str:
        return f"{self.per_device_train_batch_size} x {self.gradient_accumulation_steps}"


class ShapeChoice(BaseModel):
    """The split :func:`shape_kt_batches` chose (or would choose), and why."""

    recipe: Recipe  # with the chosen split when applied, else as written
    applied: bool  # whether the split was changed
    enabled: bool  # whether the recipe lets ktflow shape its batches (sft.kt_shape_batches)
    written: BatchShape
    best: BatchShape  # the fastest split that fits (the written one when none does)
    candidates: list[BatchShape]
    reason: str


def _with_split(recipe: Recipe, batch: int, accumulation: int) -> Recipe:
    sft = recipe.sft.model_copy(update={"per_device_train_batch_size": batch, "gradient_accumulation_steps": accumulation})
    return recipe.model_copy(update={"sft": sft})


def _shape(recipe: Recipe, size: ModelSize, host: HostInfo, threads: int, lengths: RecordLengths | None,
           costs: CostModel, records: list[tuple[str, str, KtStepRecord]]) -> BatchShape:
    sft = recipe.sft
    tokens = tokens_per_micro_batch(sft, lengths)
    # each split at this host's own speed near its tokens, where the host has KT runs (host_speed)
    host_costs, _ = calibrated_costs(recipe, host.hostname, threads, tokens, size.expert_stored_bytes, costs, records,
                                    machine=host.machine)
    estimate = kt_step_estimate(size, sft, threads, host_costs, tokens)
    records = sft.per_device_train_batch_size * sft.gradient_accumulation_steps
    real = (lengths.mean if lengths is not None else sft.cutoff_len) * records
    gpu, ram = kt_sft_needs(size, sft)
    problems = [p for p in (gpu_shortfall("sft", gpu, host), ram_shortfall("sft", ram, host)) if p]
    return BatchShape(per_device_train_batch_size=sft.per_device_train_batch_size,
                      gradient_accumulation_steps=sft.gradient_accumulation_steps, tokens_per_micro_batch=tokens,
                      step_s=estimate.step_s, tokens_per_s=real / estimate.step_s, gpu_bytes=gpu.bytes,
                      rss_bytes=ram.bytes, fits=not problems, problem="; ".join(problems))


def shape_kt_batches(recipe: Recipe, size: ModelSize, host: HostInfo, lengths: RecordLengths | None = None,
                     costs: CostModel = COSTS) -> ShapeChoice:
    """The split of ``recipe``'s effective batch KT is predicted to train fastest on ``host``.

    Every ``b x g`` with ``b x g = per_device_train_batch_size x gradient_accumulation_steps`` (and, on
    several GPUs, ``b`` dividing each GPU's share, :meth:`~ktflow.recipe.SftConfig.gpu_split`) is
    predicted (:func:`~ktflow.planning.costs.kt_step_estimate`, tokens from ``lengths``) and checked as
    the SFT preflight checks it (:func:`~ktflow.planning.sizing.kt_sft_needs`, at ``b x cutoff_len``
    tokens), with a 10 % GPU margin for a split other than the written one. Applied only when
    ``sft.kt_shape_batches`` is true (the recipe's resolved setting; see :class:`~ktflow.recipe.SftConfig`);
    otherwise the reason says what it would choose. ``recipe`` must have ``sft.backend: kt``.
    """
    sft = recipe.sft
    threads = kt_threads(sft, host.physical_cores)
    effective = sft.per_device_train_batch_size * sft.gradient_accumulation_steps
    share = sft.gpu_split().share  # each GPU's records a step: every candidate micro-batch divides it
    records = host_records(recipe, host.hostname, threads, host.machine)  # the splits share the host, format and threads
    written = _shape(recipe, size, host, threads, lengths, costs, records)
    candidates = []
    for batch in range(1, share + 1):
        if share % batch:  # a micro-batch every GPU trains as it is (gpu_split keeps it)
            continue
        shape = written if batch == sft.per_device_train_batch_size else _shape(
            _with_split(recipe, batch, effective // batch), size, host, threads, lengths, costs, records)
        if shape is not written and shape.fits and host.gpus:
            spare = min(g.vram_bytes for g in host.gpus[: max(sft.gpus, 1)])
            if shape.gpu_bytes > GPU_MARGIN * spare:
                shape = shape.model_copy(update={"fits": False, "problem": (
                    f"{shape.gpu_bytes / GiB:.1f} GiB of GPU memory leaves less than {1 - GPU_MARGIN:.0%} of "
                    f"{spare / GiB:.1f} GiB spare")})
        candidates.append(shape)
    if written not in candidates:  # on several GPUs the written micro-batch may not divide a GPU's share: still
        candidates.insert(0, written)  # the recipe as written, and what any other split must beat
    fitting = [c for c in candidates if c.fits]
    best = min(fitting, key=lambda c: (c.step_s, c is not written)) if fitting else written
    enabled = bool(sft.kt_shape_batches)
    gain = written.step_s / best.step_s
    if best is written:
        reason = (f"batch shape {written.label} (per_device_train_batch_size x gradient_accumulation_steps) is "
                  "the fastest that fits" + ("" if fitting else f" (none fits: {written.problem})"))
        return ShapeChoice(recipe=recipe, applied=False, enabled=enabled, written=written, best=best,
                           candidates=candidates, reason=reason)
    split = "per_device_train_batch_size x gradient_accumulation_steps"
    predicted = (f"a step predicted at {best.step_s:.1f} s against {written.step_s:.1f} s ({gain:.2f}x the "
                 f"tokens/s), {best.gpu_bytes / GiB:.1f} GiB of GPU memory a GPU at the longest micro-batch; "
                 f"effective batch {effective} kept")
    if not enabled:
        return ShapeChoice(recipe=recipe, applied=False, enabled=False, written=written, best=best,
                           candidates=candidates,
                           reason=f"batch shape {written.label} ({split}) as written; {best.label} would train "
                                  f"faster ({predicted}): set sft.kt_shape_batches: true to use it")
    shaped = _with_split(recipe, best.per_device_train_batch_size, best.gradient_accumulation_steps)
    return ShapeChoice(recipe=Recipe.model_validate(shaped.model_dump()), applied=True, enabled=True,
                       written=written, best=best, candidates=candidates,
                       reason=f"batch shape {best.label} ({split}) instead of {written.label}: {predicted}")
