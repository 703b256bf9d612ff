"""A host's own KT speed: what its finished runs measured against the time model, carried into its next plan.

The step model's constants (:mod:`ktflow.planning.costs`) come from one machine. Machines of one kind
differ: runs the fit never saw, on four other H100/H200 device machines with 16-core AMX Xeons, measured
0.45x to 1.25x the step the model predicts, while on one machine, at one expert format and thread count,
the ratio stayed within about 15 % of its runs' median near the same tokens a micro-batch (README, "KT
step time"; benchmarks/kt_out_of_sample.py). A torch matmul and bandwidth microbenchmark of each machine
did not explain the differences; a KT run on the host does.

So every KT SFT run records its steady step and what the shipped model predicts for it
(:class:`KtStepRecord`, in the SFT manifest's ``extra["kt_step"]``), and :func:`host_records` finds the
runs in the store on the same host with the same expert format, KT threads, NUMA pools and fitted
constants, nearest in tokens a micro-batch and expert bytes. The plan, ``sft.backend: auto`` and
micro-batch shaping (each split at its own tokens) then scale KT's step by the median of their
measured-to-predicted ratios (:func:`calibrated_costs`). A host with no such run is planned with the
model as fitted, its CPU expert passes scaled by what kt-kernel's own SFT kernels measured there
against the machine of the fit (:mod:`ktflow.planning.host_probe`, where that machine's figure is
known), and the plan says so.
"""

from __future__ import annotations

import hashlib
import math
import re
import statistics
from collections.abc import Iterable

from pydantic import BaseModel, Field

from ktflow.planning.costs import COSTS, CostModel, kt_expert_format, kt_pools, kt_step_estimate
from ktflow.planning.sizing import ModelSize
from ktflow.recipe import Recipe, SftConfig
from ktflow.store import MANIFEST_NAME, read_manifest

# The matching runs whose ratios are pooled, nearest first (a median: one odd run does not move it).
NEAREST_RUNS = 3
# A run's steady step spans at least this many optimizer steps after its first logged one (which holds
# the warm-up); LlamaFactory logs whole seconds, so shorter spans are too coarse to trust.
MIN_STEADY_STEPS = 2
MIN_STEADY_SECONDS = 20.0

# The plan's words where a host has no matching run yet.
UNCALIBRATED = ("not yet calibrated on this host: its first KT run with these settings calibrates the next plan; "
                "other machines of this kind measured 0.45-1.25x the model")

_ELAPSED = re.compile(r"^(?:(\d+) days?, )?(\d+):(\d\d):(\d\d)$")


def model_digest(costs: CostModel = COSTS) -> str:
    """The fitted constants' identity: a record predicted by other constants (an older fit) is not evidence
    about these."""
    # the serving constants (serve_*) predict no SFT step: a change there keeps the hosts' SFT calibrations
    serving = {name for name in CostModel.model_fields if name.startswith("serve_")}
    # nor do a host's factors and the probe's reference: they scale a prediction, the records hold it unscaled
    fitted = costs.model_dump_json(exclude={"kt_host_factor", "kt_cpu_factor", "kt_probe_reference", *serving})
    return hashlib.sha256(fitted.encode()).hexdigest()[:16]


def kt_threads(sft: SftConfig, physical_cores: int) -> int:
    """The KT threads a run uses: ``kt_config.kt_num_threads``, else every physical core (as rendered)."""
    return (sft.kt_config.kt_num_threads if sft.kt_config else None) or physical_cores


class KtStepRecord(BaseModel):
    """One finished KT SFT run's steady step, measured and as the shipped model predicts it."""

    host: str  # the hostname the run trained on
    machine: str = ""  # HostInfo.machine of that host ("": recorded before ktflow kept it; matched on hostname alone)
    expert_format: str
    threads: int
    pools: int
    measured_step_s: float = Field(gt=0)
    predicted_step_s: float = Field(gt=0)  # the constants of ``model``, at the tokens the trainer counted
    steps: int  # optimizer steps the measurement spans
    tokens_per_micro_batch: float = Field(gt=0)  # as the trainer counted them, padding included
    expert_bytes: int = Field(0, ge=0)  # the routed experts as stored (0: not recorded)
    model: str = ""  # model_digest() of the constants that predicted it

    @property
    def ratio(self) -> float:
        return self.measured_step_s / self.predicted_step_s

    def matches(self, host: str, sft: SftConfig, threads: int, machine: str = "") -> bool:
        same_machine = not self.machine or not machine or self.machine == machine
        return same_machine and (self.host, self.expert_format, self.threads, self.pools, self.model) == (
            host, kt_expert_format(sft), threads, kt_pools(sft), model_digest())


class HostSpeed(BaseModel):
    """The factor KT's predicted step is scaled by on one host, and the runs it comes from."""

    factor: float
    runs: list[str]  # the run directories' names, nearest first
    ratios: list[float]

    @property
    def basis(self) -> str:
        pairs = ", ".join(f"{name} {ratio:.2f}" for name, ratio in zip(self.runs, self.ratios))
        return (f"x{self.factor:.2f} for this host: the median measured/predicted step of its {len(self.runs)} KT "
                f"run(s) with these settings nearest in tokens and expert bytes ({pairs})")


def elapsed_seconds(text: str | None) -> float | None:
    """LlamaFactory's ``elapsed_time`` (``str(timedelta)`` of whole seconds) in seconds."""
    match = _ELAPSED.match((text or "").strip())
    if match is None:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def steady_step(records: Iterable[dict]) -> tuple[float, int, float | None] | None:
    """Seconds an optimizer step took once training ran, from ``trainer_log.jsonl`` records: ``(seconds a
    step, steps spanned, tokens a step or None)`` between the last attempt's first logged step and its
    last, or None when they span too little (:data:`MIN_STEADY_STEPS`, :data:`MIN_STEADY_SECONDS`). A
    resumed or restarted run appends to the log: its elapsed time restarts, or its steps go back, and
    only the last attempt counts."""
    points: list[tuple[int, float, int | None]] = []
    for record in records:
        elapsed = elapsed_seconds(record.get("elapsed_time"))
        step = record.get("current_steps")
        if elapsed is None or not isinstance(step, int):
            continue
        if points and (elapsed < points[-1][1] or step < points[-1][0]):
            points = []  # a new attempt
        elif points and step == points[-1][0]:
            continue  # the trainer's closing line repeats the last step
        points.append((step, elapsed, record.get("total_tokens")))
    if len(points) < 2:
        return None
    (s0, t0, k0), (s1, t1, k1) = points[0], points[-1]
    if s1 - s0 < MIN_STEADY_STEPS or t1 - t0 < MIN_STEADY_SECONDS:
        return None
    tokens = (k1 - k0) / (s1 - s0) if isinstance(k0, int) and isinstance(k1, int) and k1 > k0 else None
    return (t1 - t0) / (s1 - s0), s1 - s0, tokens


def kt_step_record(sft: SftConfig, host: str, threads: int, size: ModelSize,
                   records: Iterable[dict], machine: str = "") -> KtStepRecord | None:
    """A finished KT run's record: its steady step (:func:`steady_step` over its trainer log ``records``)
    and the shipped model's prediction for it at the tokens the trainer counted. None when the log spans
    too little to measure, or counts no tokens (a prediction at the ``cutoff_len`` bound would make the
    ratio too low)."""
    measured = steady_step(records)
    if measured is None or not measured[2]:
        return None
    step_s, steps, tokens_per_step = measured
    tokens = tokens_per_step / sft.gradient_accumulation_steps
    predicted = kt_step_estimate(size, sft, threads, COSTS, tokens).step_s
    if predicted <= 0:
        return None
    return KtStepRecord(host=host, machine=machine, expert_format=kt_expert_format(sft), threads=threads,
                        pools=kt_pools(sft),
                        measured_step_s=round(step_s, 3), predicted_step_s=round(predicted, 3), steps=steps,
                        tokens_per_micro_batch=tokens, expert_bytes=size.expert_stored_bytes, model=model_digest())


def pick_calibration(records: list[tuple[str, str, KtStepRecord]], tokens: float, expert_bytes: int = 0,
                     nearest: int = NEAREST_RUNS) -> HostSpeed | None:
    """The factor from matching ``(created_at, run name, record)`` entries: the median ratio of the
    ``nearest`` runs to ``tokens`` a micro-batch and ``expert_bytes`` (by ratio; ties: the newest). Near
    in tokens because how much of a step is per-token work differs between machines (the out-of-sample
    check: within 15 % calibrated this way, 30 % from any one run)."""
    if not records:
        return None

    def distance(record: KtStepRecord) -> float:
        d = abs(math.log(record.tokens_per_micro_batch / tokens))
        if expert_bytes and record.expert_bytes:
            d += abs(math.log(record.expert_bytes / expert_bytes))
        return d

    newest_first = sorted(records, key=lambda item: item[0], reverse=True)  # the sort below is stable
    chosen = sorted(newest_first, key=lambda item: distance(item[2]))[:nearest]
    ratios = [round(r.ratio, 4) for _, _, r in chosen]
    return HostSpeed(factor=statistics.median(ratios), runs=[name for _, name, _ in chosen], ratios=ratios)


def host_records(recipe: Recipe, host: str, threads: int, machine: str = "") -> list[tuple[str, str, KtStepRecord]]:
    """Every ``(created_at, run name, record)`` in ``recipe``'s store (``<store>/runs/*/adapter``) of a KT run
    on ``host`` (the hostname, and ``machine`` where both it and the record say one) with ``recipe``'s expert
    format and pools, ``threads`` and these fitted constants: what :func:`pick_calibration` chooses from. Empty
    unless the recipe trains with KT."""
    if recipe.sft.backend != "kt":
        return []
    found: list[tuple[str, str, KtStepRecord]] = []
    for manifest_path in recipe.store.layout.run(recipe.name).parent.glob(f"*/adapter/{MANIFEST_NAME}"):
        try:
            manifest = read_manifest(manifest_path.parent)
            raw = manifest.extra.get("kt_step") if manifest is not None else None
            record = KtStepRecord.model_validate(raw) if raw else None
        except (OSError, ValueError):
            continue  # a manifest of another engine version, or being replaced: not evidence
        if manifest.stage == "sft" and record is not None and record.matches(host, recipe.sft, threads, machine):
            found.append((manifest.created_at, manifest_path.parent.parent.name, record))
    return found


def calibrated_costs(recipe: Recipe, host: str, threads: int, tokens: float, expert_bytes: int = 0,
                     costs: CostModel = COSTS, records: list[tuple[str, str, KtStepRecord]] | None = None,
                     machine: str = "") -> tuple[CostModel, HostSpeed | None]:
    """``costs`` with KT's step scaled to what this host measured for ``recipe``'s KT settings near
    ``tokens`` a micro-batch and ``expert_bytes``, and the evidence; ``costs`` with no host factor without
    any. ``records``: :func:`host_records` already read (one read for many predictions of one recipe).
    Where the host has runs, they replace a probe's ``kt_cpu_factor`` in ``costs``: their ratios are of the
    whole step, against the model as fitted."""
    speed = pick_calibration(host_records(recipe, host, threads, machine) if records is None else records, tokens,
                             expert_bytes)
    if speed is None:
        return costs.model_copy(update={"kt_host_factor": 1.0}), None
    return costs.model_copy(update={"kt_host_factor": speed.factor, "kt_cpu_factor": 1.0}), speed
