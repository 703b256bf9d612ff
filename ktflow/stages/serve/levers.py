"""The serving engine's settings chosen by measurement, per machine: what each lever buys a served model on a host.

sglang-kt's levers (the CPU expert method, KT threads and NUMA pools, routed experts held on the GPU, expert
deferral, dynamic expert placement, CUDA graphs, the prefill chunk) each change decode speed by an amount no model
predicts well across machines. So ``ktflow tune-serving`` measures them on the host that serves: the recipe's own
serving section (the baseline) and one lever changed at a time (:func:`lever_candidates`), each a short run at
concurrency 1 (decode tokens/s, time to the first token and, where records are given, the served loss of a few
training records). The levers that each beat the baseline by :data:`LEVER_GAIN` or more are then measured
together as one more candidate, and the baseline is started once more, last (:data:`BASELINE_AGAIN`): two starts of
one configuration on one host differ (9 % between two decode-equivalent servers on an H200 host), so a lever wins
only by beating the faster of the baseline's two measurements by :data:`LEVER_GAIN`. The fastest such *correct*
configuration wins (:func:`choose_settings`), else the recipe's own: a candidate that served, and whose served loss
stays within :data:`SAME_WEIGHTS_LOSS_TOLERANCE` of the baseline's (or, for another CPU method, which quantizes the
experts anew, within :data:`REQUANTIZED_LOSS_TOLERANCE` of it).

The result (:class:`ServingLevers`) is kept per machine and served model under the store
(``<store>/serving-levers/<machine>/<model>.json``), and the serve stage applies it
(:func:`apply_measured_levers`) to the serving fields the recipe leaves unset: a recipe's explicit value always
wins. The runner (:func:`measure_levers`) takes the measurement as a callable, so any harness that starts servers
its own way shares these rules; the serve stage's own measurement is :mod:`ktflow.stages.serve.lever_runs`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from ktflow.host.hardware import HostInfo
from ktflow.planning.costs import KT_BYTES_PER_PARAM
from ktflow.recipe import ModelFacts, Recipe, ServingConfig
from ktflow.recipe.serving import MERGED_METHODS, SERVE_RESERVED_CORES, kt_serving_threads
from ktflow.stages.serve.backend import Log, ServeMode
from ktflow.store import atomic_write_json, read_manifest
from ktflow.units import GiB

LEVERS_DIR = "serving-levers"
SAME_WEIGHTS_LOSS_TOLERANCE = 0.002  # |served loss - baseline's| a lever that keeps the weights may move it by
# Another CPU method quantizes the experts anew (AMXINT4 from RAWINT4, say): its served loss may differ by this share
# of the baseline's (or the same-weights tolerance, whichever is larger) and the choice says what it cost.
REQUANTIZED_LOSS_TOLERANCE = 0.01
LEVER_GAIN = 1.03  # a lever counts (joins the combination, may be chosen) when it beats the baseline by 3 % or more
GPU_RESERVE_BYTES = 8 * GiB  # activations, CUDA graphs and workspace beside the weights and the KV pool
DEFAULT_CONTEXT_TOKENS = 16 * 1024  # the KV pool a GPU share keeps room for when the recipe bounds none
AMX_METHODS = ("AMXINT4", "AMXINT8")  # kt-kernel's AMX formats: the merge stage writes them, the GPU holds none
BASELINE = "baseline"
BASELINE_AGAIN = "baseline-again"  # the recipe's own settings started again after the others: the host's spread
OWN_SETTINGS = (BASELINE, BASELINE_AGAIN)  # the runs of the recipe's own settings: references, never levers
COMBINED = "combined"


class ServedModel(BaseModel):
    """What a measurement holds for: the base checkpoint the serve stage starts from, its expert method and mode."""

    path: str  # the serving model directory (before a merge), absolute
    digest: str | None = None  # its manifest's digest where the store published it (None: a plain directory)
    kt_method: str
    mode: ServeMode

    def key(self) -> str:
        """The record's file name: readable, and unique to path, method and mode."""
        name = re.sub(r"[^\w.-]+", "_", Path(self.path).name or "model")[:60]
        digest = hashlib.sha256(f"{self.path}|{self.kt_method}|{self.mode}".encode()).hexdigest()[:12]
        return f"{name}-{self.kt_method.lower()}-{self.mode}-{digest}"


def served_model(recipe: Recipe, model_dir: Path, mode: ServeMode) -> ServedModel:
    """The identity of ``model_dir`` served by ``recipe`` in ``mode``."""
    path = Path(model_dir).absolute()
    manifest = read_manifest(path) if path.is_dir() else None
    return ServedModel(path=str(path), digest=manifest.digest() if manifest is not None else None,
                       kt_method=str(recipe.serving.kt_method), mode=mode)


def expected_served_model(recipe: Recipe, mode: ServeMode | None = None) -> ServedModel | None:
    """The served model as the serve stage will know it, without fetching or making anything (the plan, the dry
    run); None for a backend without levers (llamafactory)."""
    from ktflow.stages.weights import expected_source, expected_training_weights, serving_weights

    if recipe.serving.backend != "sglang":
        return None
    trained_on = expected_training_weights(recipe).absolute()
    source = expected_source(recipe).absolute()
    model_dir, _ = serving_weights(recipe, source_dir=source, bf16_dir=trained_on if trained_on != source else None)
    return served_model(recipe, model_dir, mode or recipe.serving.resolved_mode)


# --------------------------------------------------------------------------- the candidates


class LeverCandidate(BaseModel):
    """One configuration to measure: the baseline's serving section with ``updates``."""

    name: str
    updates: dict[str, Any] = {}
    why: str  # what the lever tries
    status: Literal["run", "refused", "skipped"] = "run"
    reason: str = ""  # refused: the recipe's message; skipped: why it does not apply on this host


class GpuExpertShare(BaseModel):
    """The routed experts a MoE layer of the whole model gets on one card, and the arithmetic."""

    experts_per_layer: int
    routed_experts: int
    card_bytes: int
    non_expert_bytes: int  # on this card (split over the tensor-parallel ranks)
    kv_bytes: int
    reserve_bytes: int
    expert_bytes: int  # one expert on this card
    moe_layers: int

    def describe(self) -> str:
        return (f"{self.experts_per_layer} of {self.routed_experts} experts a layer: a {self.card_bytes / GiB:.1f} GiB "
                f"card less {self.non_expert_bytes / GiB:.1f} GiB of non-expert weights, a {self.kv_bytes / GiB:.2f} "
                f"GiB KV pool and {self.reserve_bytes / GiB:.0f} GiB of working room, over {self.moe_layers} MoE "
                f"layers of {self.expert_bytes / 2**20:.1f} MiB experts")


def gpu_expert_share(size: ModelFacts, card_bytes: int, *, method: str, gpus: int = 1,
                     context_tokens: int = DEFAULT_CONTEXT_TOKENS,
                     reserve_bytes: int = GPU_RESERVE_BYTES) -> GpuExpertShare:
    """The routed experts per MoE layer the WHOLE model (``size``: the recipe's ``source.size``) would get on a card
    of ``card_bytes``: what is left after its non-expert weights as stored, a KV pool of ``context_tokens`` and
    ``reserve_bytes``, over its MoE layers of one expert's bytes (as the source stores it for RAWINT4, BF16 for
    BF16). With ``gpus`` tensor-parallel ranks each card holds its share of both."""
    ranks = max(gpus, 1)
    experts = max(size.moe_layers * size.routed_experts, 1)
    if method == "RAWINT4" and size.expert_stored_bytes:
        per_expert = size.expert_stored_bytes / experts
    else:
        # where the source's stored size does not say: Kimi's packed INT4 for RAWINT4, else BF16
        per_expert = size.expert_parameters / experts * KT_BYTES_PER_PARAM["rawint4" if method == "RAWINT4" else "bf16"]
    expert_bytes = int(per_expert / ranks)
    non_expert = (size.stored_bytes - size.expert_stored_bytes) // ranks
    kv = size.kv_bytes_per_token * context_tokens // (1 if size.kv_latent else ranks)
    left = card_bytes - non_expert - kv - reserve_bytes
    per_layer = max(0, min(size.routed_experts, int(left // max(size.moe_layers * expert_bytes, 1))))
    return GpuExpertShare(experts_per_layer=per_layer, routed_experts=size.routed_experts, card_bytes=card_bytes,
                          non_expert_bytes=non_expert, kv_bytes=kv, reserve_bytes=reserve_bytes,
                          expert_bytes=expert_bytes, moe_layers=size.moe_layers)


def candidate_recipe(recipe: Recipe, updates: dict[str, Any]) -> Recipe:
    """``recipe`` with its serving section updated, validated as a whole (the serving rules and the rules across
    sections).

    Raises:
        ValidationError: the recipe refuses the change.
    """
    return recipe.model_copy(update={"serving": recipe.serving.model_copy(update=updates)})


def refusal(exc: ValidationError) -> str:
    """The recipe's own words for a refused change (its first error)."""
    first = exc.errors()[0]
    return str(first.get("msg", exc)).removeprefix("Value error, ")


def lever_candidates(recipe: Recipe, host: HostInfo, mode: ServeMode | None = None) -> list[LeverCandidate]:
    """The baseline (the recipe's serving section in ``mode``, default the recipe's) and each lever alone, for this
    host: CUDA graphs toggled; deferral 1 and 2; the whole model's share of the card in GPU experts, alone and with
    dynamic expert update; chunked prefill 4096; KT threads at every physical core, cores - 2 and cores / 2 (the
    count the recipe already serves with skipped); two thread pools (more than one NUMA node only); the AMX methods
    (an AMX CPU, merged mode). A lever the host cannot use is ``skipped`` with why, one the recipe refuses
    ``refused`` with its message."""
    serving = recipe.serving
    mode = mode or serving.resolved_mode
    method = str(serving.kt_method)
    cores = host.physical_cores
    threads = kt_serving_threads(serving, cores)
    out = [LeverCandidate(name=BASELINE, updates={"mode": mode}, why=f"the recipe's serving section, {mode} mode")]

    def lever(name: str, why: str, updates: dict[str, Any] | None = None, skipped: str = "") -> None:
        out.append(LeverCandidate(name=name, updates={"mode": mode, **(updates or {})}, why=why,
                                  status="skipped" if skipped else "run", reason=skipped))

    graphs = "off" if not serving.disable_cuda_graph else "on"
    lever(f"cuda-graphs-{graphs}", f"CUDA graphs {graphs} (the recipe has them {'on' if graphs == 'off' else 'off'})",
          {"disable_cuda_graph": graphs == "off"})
    for deferred in (1, 2):
        same = serving.kt_max_deferred_experts_per_token == deferred
        lever(f"deferral-{deferred}", f"a token leaves up to {deferred} expert(s) to the CPU while the next layer runs",
              {"kt_max_deferred_experts_per_token": deferred}, "the recipe's own value" if same else "")
    share_skip, share = _gpu_share_skip(recipe, host, mode, method)
    n = share.experts_per_layer if share is not None else 0
    own = "the recipe's own value" if share is not None and n == serving.kt_num_gpu_experts else ""
    name = f"gpu-experts-{n}" if share is not None else "gpu-experts"
    why = f"the whole model's share of the card: {share.describe()}" if share is not None else "experts on the GPU"
    lever(name, why, {"kt_num_gpu_experts": n}, share_skip or own)
    lever(f"{name}-dynamic", f"{why}; the most used experts moved there as the server runs",
          {"kt_num_gpu_experts": n, "kt_enable_dynamic_expert_update": True}, share_skip)
    lever("chunked-prefill-4096", "prefill in chunks of 4096 tokens", {"chunked_prefill_size": 4096},
          "the recipe's own value" if serving.chunked_prefill_size == 4096 else "")
    for count in dict.fromkeys((cores, max(cores - SERVE_RESERVED_CORES, 1), max(cores // 2, 1))):
        lever(f"cpuinfer-{count}", f"{count} KT threads of {cores} physical cores", {"kt_cpuinfer": count},
              f"the recipe's own thread count ({threads})" if count == threads else "")
    numa = ("the recipe's own value" if serving.kt_threadpool_count == 2 else "" if host.numa_nodes > 1 else
            f"this host has {host.numa_nodes} NUMA node: a second pool would split one node's memory bandwidth")
    lever("threadpools-2", "two NUMA thread pools, one a node", {"kt_threadpool_count": 2}, numa)
    for amx in AMX_METHODS:
        lever(amx, f"the experts as kt-kernel's {amx} (quantized anew by the merge stage)",
              {"kt_method": amx, **({"kt_num_gpu_experts": 0} if serving.kt_num_gpu_experts else {})},
              _method_skip(amx, method, mode, host))
    for candidate in out:
        if candidate.status == "run":
            try:
                candidate_recipe(recipe, candidate.updates)
            except ValidationError as exc:
                candidate.status, candidate.reason = "refused", refusal(exc)
    return out


def _gpu_share_skip(recipe: Recipe, host: HostInfo, mode: ServeMode,
                    method: str) -> tuple[str, GpuExpertShare | None]:
    if method in AMX_METHODS:
        return f"{method} experts are held in kt-kernel's CPU layout only: no GPU experts", None
    if mode != "merged":
        return "KT's LoRA path holds no expert on the GPU", None
    if not host.gpus:
        return "this host has no GPU", None
    size = recipe.source.size
    if size is None or not size.moe_layers or not size.routed_experts:
        return "the recipe has no source.size, so the whole model's share of the card is not known", None
    context = recipe.serving.max_total_tokens or recipe.serving.context_length or DEFAULT_CONTEXT_TOKENS
    share = gpu_expert_share(size, host.gpus[0].vram_bytes, method=method, gpus=recipe.serving.gpus,
                             context_tokens=context)
    if share.experts_per_layer == 0:
        return f"the card has no room for experts beside the rest: {share.describe()}", share
    return "", share


def _method_skip(amx: str, method: str, mode: ServeMode, host: HostInfo) -> str:
    if amx == method:
        return "the recipe's own method"
    if host.runnable_variant != "amx":
        return f"this CPU has no AMX (kt-kernel variant {host.runnable_variant})"
    if mode != "merged":
        return "another method needs other expert weights: the merge stage writes them in merged mode only"
    if method not in MERGED_METHODS:
        return f"the merge stage does not merge {method} sources into {amx}"
    return ""


# --------------------------------------------------------------------------- measurements and the choice


class LeverMeasurement(BaseModel):
    """One configuration served and timed: concurrency 1, a few short requests."""

    ok: bool
    decode_tokens_per_s: float | None = None  # median over the requests
    ttft_p50_s: float | None = None
    served_loss: float | None = None  # mean loss of the training records' tokens from the prompt logprobs
    loss_records: int = 0
    requests: int = 0
    seconds: float = 0.0  # start, requests and stop
    error: str | None = None


class LeverRun(BaseModel):
    """A candidate and what it measured, against the baseline."""

    candidate: LeverCandidate
    measurement: LeverMeasurement | None = None
    vs_baseline: float | None = None  # decode / the baseline's
    correct: bool | None = None
    verdict: str = ""  # why it is (not) correct, or why it did not run


class LeverChoice(BaseModel):
    """The configuration chosen, and why."""

    name: str
    updates: dict[str, Any]
    decode_tokens_per_s: float
    vs_baseline: float
    reason: str


class ServingLevers(BaseModel):
    """A served model's levers measured on one machine, as kept in the store."""

    machine: str  # HostInfo.machine
    gpu: str | None = None
    model: ServedModel
    measured_at: str
    runs: list[LeverRun]
    choice: LeverChoice | None = None

    def run(self, name: str) -> LeverRun | None:
        return next((r for r in self.runs if r.candidate.name == name), None)


def judge(candidate: LeverCandidate, measurement: LeverMeasurement,
          baseline: LeverMeasurement | None) -> tuple[bool, str]:
    """Whether a measured candidate is correct, and why: it served, and its served loss (where both were measured)
    is within the tolerance of the baseline's: the same weights :data:`SAME_WEIGHTS_LOSS_TOLERANCE`, another CPU
    method :data:`REQUANTIZED_LOSS_TOLERANCE` of it."""
    if not measurement.ok or measurement.decode_tokens_per_s is None:
        return False, f"did not serve: {measurement.error or 'no decode measured'}"
    if baseline is None or measurement.served_loss is None or baseline.served_loss is None:
        return True, "ok: served (no served loss compared)"
    requantized = "kt_method" in candidate.updates
    tolerance = (max(SAME_WEIGHTS_LOSS_TOLERANCE, REQUANTIZED_LOSS_TOLERANCE * baseline.served_loss) if requantized
                 else SAME_WEIGHTS_LOSS_TOLERANCE)
    moved = measurement.served_loss - baseline.served_loss
    what = f"served loss {moved:+.4f}" + (f" ({moved / baseline.served_loss:+.1%})" if baseline.served_loss else "")
    limit = f"{'re-quantized experts' if requantized else 'the same weights'} allow {tolerance:.4f}"
    if abs(moved) > tolerance:
        return False, f"wrong: {what}; {limit}"
    return True, f"ok: {what}; {limit}"


def combined_candidate(runs: list[LeverRun], recipe: Recipe) -> LeverCandidate | None:
    """The levers that each beat the baseline by :data:`LEVER_GAIN` or more and were correct, together (where
    two set one field, the faster one's value); None when fewer than two qualify. Refused if the recipe refuses."""
    winners = sorted((r for r in runs if r.correct and r.candidate.name not in OWN_SETTINGS
                      and r.vs_baseline is not None and r.vs_baseline >= LEVER_GAIN), key=lambda r: -(r.vs_baseline or 0))
    if len(winners) < 2:
        return None
    updates: dict[str, Any] = {}
    for run in winners:
        for field, value in run.candidate.updates.items():
            updates.setdefault(field, value)
    names = [r.candidate.name for r in winners]
    candidate = LeverCandidate(name=COMBINED, updates=updates,
                               why=f"the levers that each beat the baseline by {LEVER_GAIN - 1:.0%} or more: "
                                   + ", ".join(names))
    try:
        candidate_recipe(recipe, updates)
    except ValidationError as exc:
        candidate.status, candidate.reason = "refused", refusal(exc)
    return candidate


def baseline_again(baseline: LeverCandidate) -> LeverCandidate:
    """The baseline's configuration as the last candidate (:data:`BASELINE_AGAIN`): its second start."""
    return LeverCandidate(name=BASELINE_AGAIN, updates=baseline.updates,
                          why="the recipe's own settings started again after the others: how far two starts of one "
                              "configuration differ on this host")


def choose_settings(runs: list[LeverRun]) -> LeverChoice | None:
    """The fastest correct configuration measured that beats the recipe's own settings by :data:`LEVER_GAIN`
    (against the faster of the baseline's measurements: the first, and :data:`BASELINE_AGAIN` where it ran), else
    the recipe's own; None when the baseline did not serve."""
    baseline = next((r for r in runs if r.candidate.name == BASELINE), None)
    if baseline is None or not baseline.correct or baseline.measurement is None:
        return None
    base_rate = baseline.measurement.decode_tokens_per_s or 0.0
    again = next((r for r in runs if r.candidate.name == BASELINE_AGAIN and r.correct and r.measurement is not None
                  and r.measurement.decode_tokens_per_s), None)
    again_rate = again.measurement.decode_tokens_per_s if again is not None else None  # type: ignore[union-attr]
    reference = max(base_rate, again_rate or 0.0)
    starts = (f"its two starts measured {base_rate:.1f} and {again_rate:.1f} tokens/s"
              if again_rate is not None else f"{base_rate:.1f} tokens/s")
    better = [r for r in runs if r.correct and r.measurement is not None and r.measurement.decode_tokens_per_s
              and r.candidate.name not in OWN_SETTINGS
              and r.measurement.decode_tokens_per_s >= LEVER_GAIN * reference]
    if not better:
        return LeverChoice(name=BASELINE, updates={k: v for k, v in baseline.candidate.updates.items() if k != "mode"},
                           decode_tokens_per_s=base_rate, vs_baseline=1.0,
                           reason=f"the recipe's own settings: no setting beat them by {LEVER_GAIN - 1:.0%} or more "
                                  f"at concurrency 1 ({starts})")
    best = max(better, key=lambda r: r.measurement.decode_tokens_per_s or 0.0)  # type: ignore[union-attr]
    rate = best.measurement.decode_tokens_per_s or 0.0  # type: ignore[union-attr]
    reason = (f"{best.candidate.name}: {rate:.1f} tokens/s decode at concurrency 1, {rate / base_rate:.2f}x the "
              f"baseline's {base_rate:.1f}" + (f" and {rate / again_rate:.2f}x its second start's {again_rate:.1f}"
                                              if again_rate is not None else "")
              + f" ({best.candidate.why}); {best.verdict}")
    return LeverChoice(name=best.candidate.name, updates={k: v for k, v in best.candidate.updates.items()
                                                          if k != "mode"},
                       decode_tokens_per_s=rate, vs_baseline=round(rate / base_rate, 3) if base_rate else 1.0,
                       reason=reason)


def measure_levers(recipe: Recipe, candidates: list[LeverCandidate],
                   measure: Callable[[ServingConfig], LeverMeasurement], *, machine: str, model: ServedModel,
                   gpu: str | None = None, log: Log = None) -> ServingLevers:
    """Measure ``candidates`` (the baseline first) with ``measure``, then the combination of the levers that beat
    the baseline, then the baseline again (the host's spread between two starts), and choose. Skipped and refused
    candidates are recorded, not run."""
    runs: list[LeverRun] = []
    baseline: LeverMeasurement | None = None

    def run_one(candidate: LeverCandidate) -> None:
        nonlocal baseline
        run = LeverRun(candidate=candidate)
        runs.append(run)
        if candidate.status != "run":
            run.verdict = f"{candidate.status}: {candidate.reason}"
            return
        if log:
            log(f"measuring {candidate.name}: {candidate.why}")
        measurement = measure(candidate_recipe(recipe, candidate.updates).serving)
        run.measurement = measurement
        if candidate.name == BASELINE:
            baseline = measurement
        run.correct, run.verdict = judge(candidate, measurement, baseline)
        base_rate = baseline.decode_tokens_per_s if baseline is not None and baseline.ok else None
        if run.correct and base_rate and measurement.decode_tokens_per_s:
            run.vs_baseline = round(measurement.decode_tokens_per_s / base_rate, 3)
        if log:
            log(f"{candidate.name}: " + (f"{measurement.decode_tokens_per_s:.1f} tokens/s; {run.verdict}"
                                         if measurement.decode_tokens_per_s else run.verdict))

    ordered = sorted(candidates, key=lambda c: c.name != BASELINE)
    for candidate in ordered:
        run_one(candidate)
        if candidate.name == BASELINE and not runs[-1].correct:
            for rest in ordered[1:]:  # nothing to compare with: the others are not started
                runs.append(LeverRun(candidate=rest, verdict=f"{rest.status}: {rest.reason}" if rest.status != "run"
                                     else "not run: the baseline did not serve"))
            break
    combined = combined_candidate(runs, recipe)
    if combined is not None:
        run_one(combined)
    first = runs[0] if runs and runs[0].candidate.name == BASELINE else None
    if first is not None and first.correct:
        run_one(baseline_again(first.candidate))
    return ServingLevers(machine=machine, gpu=gpu, model=model, runs=runs, choice=choose_settings(runs),
                         measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))


# --------------------------------------------------------------------------- kept per machine


def levers_path(store_root: str | os.PathLike[str], machine: str, model: ServedModel) -> Path:
    """``<store>/serving-levers/<digest of the machine>/<model key>.json``."""
    return (Path(store_root) / LEVERS_DIR / hashlib.sha256(machine.encode()).hexdigest()[:16]
            / f"{model.key()}.json")


def keep_levers(store_root: str | os.PathLike[str], record: ServingLevers) -> Path:
    """Write ``record`` for its machine and model (whole, renamed into place); the path."""
    path = levers_path(store_root, record.machine, record.model)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record.model_dump(mode="json"))
    return path


def kept_levers(store_root: str | os.PathLike[str], machine: str, model: ServedModel) -> ServingLevers | None:
    """The record kept for ``machine`` and ``model``, if any (an unreadable one, or one measured on weights since
    replaced, counts as none)."""
    try:
        record = ServingLevers.model_validate(json.loads(levers_path(store_root, machine, model).read_text("utf-8")))
    except (OSError, ValueError):
        return None
    if record.machine != machine or record.model.path != model.path or record.model.mode != model.mode:
        return None
    if record.model.digest is not None and model.digest is not None and record.model.digest != model.digest:
        return None
    return record


# --------------------------------------------------------------------------- applied


def describe_updates(updates: dict[str, Any]) -> str:
    """``kt_cpuinfer 14, kt_max_deferred_experts_per_token 1``."""
    return ", ".join(f"{field} {value}" for field, value in updates.items()) or "none"


def split_choice(serving: ServingConfig, record: ServingLevers) -> tuple[dict[str, Any], dict[str, Any]]:
    """The measured choice's settings as ``(applied, kept)``: those the recipe leaves unset (they apply) and those it
    sets to another value itself (its own win); settings equal to the recipe's are neither."""
    if record.choice is None:
        return {}, {}
    explicit = serving.model_fields_set
    changed = {k: v for k, v in record.choice.updates.items() if getattr(serving, k) != v}
    return ({k: v for k, v in changed.items() if k not in explicit},
            {k: v for k, v in changed.items() if k in explicit})


def measured_decode(record: ServingLevers, applied: dict[str, Any]) -> float | None:
    """The decode measured with exactly ``applied`` on top of the recipe's settings (the baseline's with none);
    None where no run measured that configuration."""
    for run in record.runs:
        updates = {k: v for k, v in run.candidate.updates.items() if k != "mode"}
        if updates == applied and run.correct and run.measurement is not None:
            return run.measurement.decode_tokens_per_s
    return None


def apply_measured_levers(serving: ServingConfig, record: ServingLevers) -> tuple[ServingConfig, str]:
    """``serving`` with the measured choice applied to the fields the recipe does not set itself (explicit recipe
    values win), and one line that says what was measured, what applies and what the recipe kept.

    Raises:
        ValidationError: the serving section refuses the chosen settings (the caller keeps its own).
    """
    head = f"serving settings measured on this machine on {record.measured_at[:10]}"
    choice = record.choice
    if choice is None:
        return serving, f"{head}: no configuration served correctly; the recipe's settings are used"
    rate = f"{choice.decode_tokens_per_s:.1f} tokens/s decode at concurrency 1"
    if not choice.updates:
        return serving, (f"{head}: the recipe's own settings kept, no setting beat them by {LEVER_GAIN - 1:.0%} or "
                         f"more ({rate})")
    applied, kept = split_choice(serving, record)
    line = f"{head}: {choice.name} fastest ({rate}, {choice.vs_baseline:.2f}x the recipe's own)"
    line += f"; applied: {describe_updates(applied)}" if applied else "; nothing applied"
    if kept:
        line += ("; recipe sets " + ", ".join(f"{k} {getattr(serving, k)}" for k in kept)
                 + f" (measured best: {describe_updates(kept)}), kept")
    return (serving.model_copy(update=applied) if applied else serving), line


def recipe_with_measured_levers(recipe: Recipe, machine: str, model: ServedModel) -> tuple[Recipe, str | None]:
    """``recipe`` with this machine's kept measurement for ``model`` applied (:func:`apply_measured_levers`), and
    the line that says so; ``(recipe, None)`` where none is kept."""
    if recipe.serving.backend != "sglang":
        return recipe, None
    record = kept_levers(recipe.store.root, machine, model)
    return (recipe, None) if record is None else recipe_with_levers(recipe, record)


def recipe_with_levers(recipe: Recipe, record: ServingLevers) -> tuple[Recipe, str]:
    """``recipe`` with ``record``'s choice applied (:func:`apply_measured_levers`), and the line that says so; the
    recipe as it is where it refuses the choice, said in the line."""
    try:
        serving, line = apply_measured_levers(recipe.serving, record)
        return recipe.model_copy(update={"serving": serving}), line
    except ValidationError as exc:
        return recipe, (f"serving settings measured on this machine on {record.measured_at[:10]} not applied: the "
                        f"recipe refuses them ({refusal(exc)}); run `ktflow tune-serving` again")


def lever_settings(serving: ServingConfig, physical_cores: int) -> str:
    """A serving section's levers in a few words: ``RAWINT4, 16 threads x 1 pool, 0 GPU experts, graphs off``."""
    pools = serving.kt_threadpool_count
    parts = [f"{serving.kt_method}", f"{kt_serving_threads(serving, physical_cores)} threads x {pools} "
             f"pool{'s' if pools != 1 else ''}", f"{serving.kt_num_gpu_experts} GPU experts"]
    if serving.kt_enable_dynamic_expert_update:
        parts.append("dynamic experts")
    if serving.kt_max_deferred_experts_per_token:
        parts.append(f"deferral {serving.kt_max_deferred_experts_per_token}")
    if serving.chunked_prefill_size:
        parts.append(f"chunks {serving.chunked_prefill_size}")
    parts.append("graphs off" if serving.disable_cuda_graph or serving.resolved_mode == "lora" else "graphs on")
    return ", ".join(parts)
