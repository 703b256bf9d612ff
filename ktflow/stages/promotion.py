"""The promote stage: what serves is a version that passed its gate, moved there health-gated.

Trained -> candidate -> promoted or rejected -> (rollback). The registry
(:mod:`ktflow.registry`) keeps the versions and the production pointer; this module moves what
the recipe's endpoint serves and keeps the pointer in step with it:

- :func:`register_adapter`: the converted adapter becomes version N, with its lineage.
- :func:`judge_candidate`: judge version N as a candidate in the mode
  :func:`ktflow.stages.serve.choose_candidate_mode` picks for this host, and record the verdict.
- :func:`promote_version`: serve version N (a swap health-gated and smoke-tested, the old adapter
  restored if the new one fails to serve), then move the pointer; idempotent; refuses a version
  trained on another base than the one served.
- :func:`rollback`: promote the version production pointed at before its last move.
- :func:`judge_by_swap`: ``swap`` mode: serve the candidate, evaluate it in place, and on a
  failed gate promote the previous version back (the report names the window it served).

Crash safety: a move writes ``pending-move.json`` before it touches the server and clears it
after the pointer moved. A ``kill -9`` in between leaves either adapter serving, or (killed while
the new server started: ktflow's guardian stops a half-started server) none; the next
promote, rollback or pipeline run first calls :func:`recover_interrupted_move`, which finishes
the move when the new adapter serves, or restarts the old one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from ktflow.errors import AdapterError, InvalidInputError
from ktflow.formats.checkpoint import checkpoint_digest, checkpoint_fingerprint, identity_digest
from ktflow.host.hardware import HostInfo, probe_host
from ktflow.recipe import Recipe
from ktflow.registry import (
    JUDGING_MOVE,
    AdapterRegistry,
    AdapterVersion,
    Lineage,
    PendingMove,
    Trigger,
    Verdict,
    utc_now,
)
from ktflow.stages.evaluate import Candidate, EvaluationResult, evaluate_base_vs_tuned, evaluate_candidate
from ktflow.stages.serve import (
    CandidateChoice,
    Endpoint,
    choose_candidate_mode,
    is_alive,
    label_endpoint_version,
    measure_serve,
    port_is_free,
    read_endpoint,
    resolve_api_key,
    serve,
    stop,
    swap_adapter,
)
from ktflow.store import atomic_write_bytes, read_manifest

Log = Callable[[str], None] | None


def serving_dir(recipe: Recipe) -> Path:
    """Where the recipe's production endpoint is recorded (``endpoint.json``, its log and key)."""
    return recipe.store.layout.serving(recipe.name).absolute()


def registry_of(recipe: Recipe) -> AdapterRegistry:
    return AdapterRegistry(recipe.store.root, recipe.name)


# --------------------------------------------------------------------------- versions


def register_adapter(recipe: Recipe, *, adapter_dir: Path, sft_adapter_dir: Path, base_dir: Path,
                     trigger: Trigger | None = None) -> AdapterVersion:
    """The converted adapter ``adapter_dir`` as version N of ``recipe`` (the same adapter: the same
    version), with its lineage: the base it was trained on, the dataset and recipe digests, the
    SFT run, and what started the run.

    Raises:
        InvalidInputError: ``adapter_dir`` or ``sft_adapter_dir`` is not a published artifact.
    """
    sft = read_manifest(sft_adapter_dir)
    if sft is None:
        raise InvalidInputError(str(sft_adapter_dir), "holds no manifest.json: not the SFT stage's output",
                                "pass the SFT stage's adapter directory")
    lineage = Lineage(
        base_digest=sft.inputs.get("base") or checkpoint_digest(base_dir), base_dir=Path(base_dir).absolute(),
        base_fingerprint=sft.inputs.get("base_fingerprint") or checkpoint_fingerprint(base_dir),
        dataset_digest=sft.inputs.get("data", ""),
        recipe_digest=identity_digest(recipe.model_dump(mode="json", exclude={"evaluation", "serving", "store"})),
        sft_run=Path(sft_adapter_dir).absolute(), sft_manifest_digest=sft.digest(), trigger=trigger or Trigger(),
    )
    return registry_of(recipe).register(adapter_dir, lineage)


# --------------------------------------------------------------------------- moving production


class MoveResult(BaseModel):
    """What a promotion or rollback did."""

    version: int
    replaced: int | None  # the version that served before (None: nothing did)
    moved: bool  # False: it already served (idempotent)
    endpoint: Endpoint | None = None  # what serves now

    def summary(self) -> str:
        if not self.moved:
            return f"v{self.version} already serves"
        return f"promoted v{self.version}" + (f" (replaces v{self.replaced})" if self.replaced is not None else "")


def _move_lock(registry: AdapterRegistry) -> contextlib.AbstractContextManager[None]:
    """One move of a recipe's production at a time."""
    return registry.locked(".move.lock")


def _serving_now(record_dir: Path) -> Endpoint | None:
    """The recorded endpoint if it is ready and alive, else None."""

    endpoint = read_endpoint(record_dir)
    return endpoint if endpoint is not None and endpoint.state == "ready" and is_alive(endpoint) else None


def _serves(endpoint: Endpoint | None, version: AdapterVersion) -> bool:
    return endpoint is not None and endpoint.adapter_dir is not None and \
        Path(endpoint.adapter_dir).absolute() == Path(version.adapter_dir).absolute()


def check_same_base(version: AdapterVersion, served: AdapterVersion | None, base_dir: Path | None) -> None:
    """Refuse ``version`` when it was trained on another base than the model served.

    Raises:
        AdapterError: the bases differ (both digests named).
    """
    mine, expected = version.lineage.base_digest, served.lineage.base_digest if served is not None else None
    # Compared by content fingerprint where both sides have one: a base each host made itself (hosts
    # without a shared store) has another mtime, hence another cache digest, on the serving host.
    theirs = served.lineage.base_fingerprint if served is not None else (
        checkpoint_fingerprint(base_dir) if base_dir is not None else None)
    if version.lineage.base_fingerprint and theirs:
        mine, expected = version.lineage.base_fingerprint, theirs
    elif expected is None and base_dir is not None:
        expected = checkpoint_digest(base_dir)
    if expected is not None and mine != expected:
        what = f"v{served.version}'s base" if served is not None else f"the served model {base_dir}"
        raise AdapterError(f"{version.recipe} v{version.version}",
                           f"was trained on base {mine[:12]} ({version.lineage.base_dir}), "
                           f"not on {what} ({expected[:12]})", "promote a version trained on the served model")


def promote_version(recipe: Recipe, version: int, *, model_dir: Path, kt_weight_dir: Path | None = None,
                    base_dir: Path | None = None, why: str = "ktflow promote", log: Log = None) -> MoveResult:
    """Serve version ``version`` of the recipe's adapter and point production at it.

    A running endpoint swaps adapters health-gated and smoke-tested (:func:`ktflow.stages.serve.swap_adapter`:
    the old adapter is restarted if the new one fails, and :class:`~ktflow.errors.SwapError` is
    raised); with none running, one is started. Idempotent: a version that already serves is left
    as it is. An interrupted earlier move is recovered first.

    ``model_dir``: what the server loads the adapter on; ``base_dir``: the checkpoint adapters are
    trained on (checked against the version's lineage when nothing is in production yet).

    Raises:
        InvalidInputError: no such version.
        AdapterError: the version was trained on another base than the one served.
        SwapError, ServerStartError: the new adapter failed to serve (production is as it was).
    """
    registry = registry_of(recipe)
    record_dir = serving_dir(recipe)
    with _move_lock(registry):
        _recover(recipe, registry, record_dir, log)
        target = registry.get(version)
        current = registry.production_version()
        check_same_base(target, current, base_dir)
        endpoint = _serving_now(record_dir)
        if current is not None and current.version == version and _serves(endpoint, target):
            if log:
                log(f"{recipe.name} v{version} already serves at {endpoint.url}")
            return MoveResult(version=version, replaced=version, moved=False, endpoint=endpoint)
        registry.begin_move(PendingMove(from_version=current.version if current else None, to_version=version, why=why,
                                        model_dir=Path(model_dir).absolute(),
                                        kt_weight_dir=Path(kt_weight_dir).absolute() if kt_weight_dir else None))
        try:
            endpoint = _serve_adapter(recipe, target.adapter_dir, model_dir=model_dir, kt_weight_dir=kt_weight_dir,
                                      running=endpoint, log=log)
        except BaseException:
            if _serves(_serving_now(record_dir), current) or current is None:
                registry.abandon_move()  # the old adapter serves again (or never stopped): nothing moved
            raise
        registry.finish_move(version, why)
        return MoveResult(version=version, replaced=current.version if current else None, moved=True,
                          endpoint=_label_endpoint(record_dir, endpoint, version))


def rollback(recipe: Recipe, *, model_dir: Path, kt_weight_dir: Path | None = None, base_dir: Path | None = None,
             log: Log = None) -> MoveResult:
    """Promote the version production pointed at before its last move (``ktflow rollback``).

    Raises:
        InvalidInputError: there is no earlier production version.
        SwapError, ServerStartError: it failed to serve (production is as it was).
    """
    registry = registry_of(recipe)
    with _move_lock(registry):
        _recover(recipe, registry, serving_dir(recipe), log)
    target = registry.rollback_target()
    return promote_version(recipe, target.version, model_dir=model_dir, kt_weight_dir=kt_weight_dir,
                           base_dir=base_dir, why=f"rollback from v{registry.production().version}", log=log)


def recover_interrupted_move(recipe: Recipe, log: Log = None) -> str | None:
    """Finish or undo a promotion whose process died (``pending-move.json`` left behind); what was
    done, in words, or None when nothing was pending."""
    registry = registry_of(recipe)
    with _move_lock(registry):
        return _recover(recipe, registry, serving_dir(recipe), log)


def _recover(recipe: Recipe, registry: AdapterRegistry, record_dir: Path, log: Log) -> str | None:
    pending = registry.pending()
    if pending is None:
        return None
    target = registry.get(pending.to_version)
    endpoint = _serving_now(record_dir)
    if _serves(endpoint, target):
        registry.finish_move(target.version, f"{pending.why} (finished after an interrupted move)")
        _label_endpoint(record_dir, endpoint, target.version)
        said = f"an interrupted move to v{target.version} had finished serving it: production now points at it"
    else:
        back = registry.get(pending.from_version) if pending.from_version is not None else target
        if not _serves(endpoint, back):
            endpoint = _serve_adapter(recipe, back.adapter_dir, model_dir=pending.model_dir,
                                      kt_weight_dir=pending.kt_weight_dir, running=endpoint, log=log)
        if back is target:
            registry.finish_move(target.version, f"{pending.why} (finished after an interrupted move)")
        else:
            registry.abandon_move()
        _label_endpoint(record_dir, endpoint, back.version)
        said = (f"an interrupted move v{pending.from_version} -> v{pending.to_version} was undone: v{back.version} "
                "serves" if back is not target else f"an interrupted first promotion of v{target.version} was finished")
    if log:
        log(said)
    return said


def _serve_adapter(recipe: Recipe, adapter_dir: Path, *, model_dir: Path, kt_weight_dir: Path | None,
                   running: Endpoint | None, log: Log) -> Endpoint:
    """Serve ``adapter_dir`` at the recipe's endpoint: a health-gated swap of a running server, or a
    fresh start (a stale record is cleared first)."""

    record_dir = serving_dir(recipe)
    if running is not None:
        return swap_adapter(recipe, model_dir=Path(model_dir), new_adapter_dir=Path(adapter_dir), record_dir=record_dir,
                            kt_weight_dir=kt_weight_dir, log=log)
    stale = read_endpoint(record_dir)
    stop(record_dir)
    # A server that died (or was stopped mid-swap) comes back on the port clients know.
    port = stale.port if stale is not None and stale.port and port_is_free(recipe.serving.host, stale.port) else None
    return serve(recipe, model_dir=Path(model_dir), adapter_dir=Path(adapter_dir), record_dir=record_dir,
                 kt_weight_dir=kt_weight_dir, port=port, log=log)


def _label_endpoint(record_dir: Path, endpoint: Endpoint, version: int) -> Endpoint:
    """``endpoint.json`` names the version it serves."""

    return label_endpoint_version(record_dir, endpoint, version)


def stop_serving(recipe: Recipe, log: Log = None) -> None:
    """Stop the recipe's endpoint (swap mode: a rejected first candidate, with nothing to go back to)."""

    registry = registry_of(recipe)
    with _move_lock(registry):
        stop(serving_dir(recipe))
    if log:
        log(f"stopped the endpoint of {recipe.name}: nothing passed its gate yet")


# --------------------------------------------------------------------------- swap mode


class SwapJudgement(BaseModel):
    """What :func:`judge_by_swap` did: the evaluation, and the window the candidate served in."""

    evaluation: EvaluationResult
    window: tuple[str, str] | None
    restored: int | None  # the version promoted back after a failed gate (None: none, or it passed)


def judge_by_swap(recipe: Recipe, version: int, *, model_dir: Path, serve_model_dir: Path,
                  kt_weight_dir: Path | None, api_key: str, out_dir: Path, log: Log = None) -> SwapJudgement:
    """``swap`` mode: the candidate takes production's place (health-gated), is evaluated there, and
    a failed gate promotes the previous version back at once (or, with none, stops the endpoint).

    Raises:
        SwapError, ServerStartError: the candidate failed to serve (production is as it was).
    """

    registry = registry_of(recipe)
    before = registry.production().version
    moved = promote_version(recipe, version, model_dir=serve_model_dir, kt_weight_dir=kt_weight_dir,
                            base_dir=model_dir, why=JUDGING_MOVE, log=log)
    started = utc_now()
    endpoint = moved.endpoint
    result = evaluate_base_vs_tuned(recipe, model_dir=model_dir, tuned_url=endpoint.url,
                                    tuned_model=endpoint.model, api_key=api_key, out_dir=out_dir,
                                    candidate_version=version, candidate_mode="swap",
                                    production_version=before if before != version else None, log=log,
                                    kt_weight_dir=kt_weight_dir)
    if result.gate_failure() is None:
        return SwapJudgement(evaluation=result, window=None, restored=None)
    if before is not None and before != version:
        promote_version(recipe, before, model_dir=serve_model_dir, kt_weight_dir=kt_weight_dir, base_dir=model_dir,
                        why=f"swap mode: v{version} failed its gate", log=log)
    elif before is None:
        stop_serving(recipe, log)
        registry.clear_production(f"swap mode: v{version} failed its gate and nothing served before it")
    return SwapJudgement(evaluation=result, window=(started, utc_now()), restored=before)


# --------------------------------------------------------------------------- judging a candidate


class Judgement(BaseModel):
    """A candidate's verdict: its evaluation, how it was judged, what serves."""

    version: int
    evaluation: EvaluationResult
    choice: CandidateChoice
    production_version: int | None  # what served while it was judged (and still does if it was rejected)
    window: tuple[str, str] | None = None  # swap mode, rejected: when the candidate served
    reused: bool = False  # it already serves and was judged before: not evaluated again

    @property
    def accepted(self) -> bool:
        """Whether it may replace production: the adapter is applied and no enforced gate failed."""
        return self.evaluation.adapter_applied and self.evaluation.gate_failure() is None

    def summary(self) -> str:
        """``candidate v2: not promoted (style +10.00 < +50.00); production stays v1``."""
        gate = self.evaluation.gate_brief()
        if self.accepted:
            return f"candidate v{self.version}: passed ({gate})" if self.evaluation.gate_enforced else \
                f"candidate v{self.version}: gate reported only ({gate})"
        stays = f"production stays v{self.production_version}" if self.production_version is not None else \
            "nothing is in production"
        served = f"; it served {self.window[0]} - {self.window[1]} (swap mode)" if self.window else ""
        return f"candidate v{self.version}: not promoted ({gate}); {stays}{served}"

    def rejection(self) -> str:
        """The run's failure message: the gate's reason and what stays in production."""
        reason = self.evaluation.gate_failure() or self.evaluation.gate_reason()
        return f"{self.summary()}. {reason}; report: {self.evaluation.report_md}"


EVALUATION_JSON = "evaluation.json"


def judge_candidate(recipe: Recipe, version: int, *, model_dir: Path, serve_model_dir: Path,
                    kt_weight_dir: Path | None = None, host: HostInfo | None = None, log: Log = None) -> Judgement:
    """Judge version ``version`` as a candidate (the evaluate stage) and record the verdict.

    The mode is :func:`choose_candidate_mode`'s for this host; ``beside`` and ``offline`` leave
    production untouched whatever the verdict (the candidate's server is stopped, its adapter
    unloaded); ``swap`` serves it and promotes the previous version back on a failed gate. A
    version that already serves in production and passed before is not judged again.
    The report goes to ``<store>/eval/<recipe>/v<N>/``.
    """

    registry = registry_of(recipe)
    record_dir = serving_dir(recipe)
    with _move_lock(registry):
        _recover(recipe, registry, record_dir, log)
    candidate = registry.get(version)
    production = _serving_now(record_dir)
    production_version = registry.production().version if production is not None else None
    out_dir = recipe.store.layout.evaluation(recipe.name, version).absolute()
    sizes = measure_serve(serve_model_dir, kt_weight_dir)
    choice = choose_candidate_mode(recipe, sizes, host or probe_host(recipe.store.root),
                                   production_running=production is not None)
    before = candidate.verdict
    judged_with = evaluation_digest(recipe, model_dir)
    if production_version == version and before is not None and before.status == "passed" and \
            before.evaluation_digest == judged_with and (out_dir / EVALUATION_JSON).is_file():
        evaluation = EvaluationResult.model_validate_json((out_dir / EVALUATION_JSON).read_text(encoding="utf-8"))
        return Judgement(version=version, evaluation=evaluation, choice=choice, production_version=version, reused=True)
    if log:
        log(f"judging candidate v{version} {choice.mode}: {choice.reason}")
    key, _ = resolve_api_key(recipe, record_dir)
    window = None
    if choice.mode == "swap":
        swapped = judge_by_swap(recipe, version, model_dir=model_dir, serve_model_dir=serve_model_dir,
                                kt_weight_dir=kt_weight_dir, api_key=key, out_dir=out_dir, log=log)
        evaluation, window = swapped.evaluation, swapped.window
    else:
        evaluation = evaluate_candidate(recipe, mode=choice.mode, model_dir=model_dir, serve_model_dir=serve_model_dir,
                                        candidate=Candidate(version=version, adapter_dir=candidate.adapter_dir),
                                        production=production, production_version=production_version, api_key=key,
                                        out_dir=out_dir, log=log, kt_weight_dir=kt_weight_dir)
    judgement = Judgement(version=version, evaluation=evaluation, choice=choice,
                          production_version=production_version, window=window)
    atomic_write_bytes(out_dir / EVALUATION_JSON, evaluation.model_dump_json(indent=2).encode())
    registry.record_verdict(version, Verdict(
        status="passed" if judgement.accepted else "failed",
        enforced=evaluation.gate_enforced, summary=judgement.summary(), mode=choice.mode,
        report=evaluation.report_md, served_window=window, evaluation_digest=judged_with))
    return judgement


def evaluation_digest(recipe: Recipe, model_dir: Path) -> str:
    """What a verdict depends on besides the adapter and production: the evaluation settings, the
    held-out files' bytes and the base compared against."""
    import hashlib

    files = [hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in recipe.evaluation.files]
    return identity_digest({"evaluation": recipe.evaluation.model_dump(mode="json"), "files": files,
                            "base": str(Path(model_dir).absolute())})
