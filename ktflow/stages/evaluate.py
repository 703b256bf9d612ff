"""The evaluate stage: base vs tuned through OpenAI-compatible endpoints.

- :func:`load_eval_records` reads held-out records with the dataset stage's own readers and
  validation (every bad record reported as ``file:line``): for each, the chat up to the last
  assistant message is the prompt and that message is the reference (alpaca:
  ``instruction\\ninput`` -> ``output``, with ``system`` and ``history`` kept).
- :func:`evaluate_endpoint` sends every prompt through the ``openai`` client (temperature
  ``cfg.temperature``, 0 = greedy; ``cfg.max_tokens``), ``cfg.concurrency`` requests at a time,
  and scores the answers.
- :func:`adapter_is_applied` proves the served adapter changes the model (LoRA adapters are
  known to be silently dropped by servers): at temperature 0, some answer of the tuned model on
  a fixed prompt set must differ from the base model's.
- :func:`evaluate_base_vs_tuned` is the stage: the tuned endpoint against a base server, the
  markdown table, the adapter check and the promotion gate, written as a report.

Metrics (all on a 0-100 scale, like LlamaFactory's ``predict_results.json``):

- ``bleu-1`` .. ``bleu-4``: sacrebleu corpus BLEU with ``max_ngram_order=n``: the brevity
  penalty times the geometric mean of the modified n-gram precisions of orders 1..n (uniform
  weights), counts summed over the whole corpus, sacrebleu's default ``13a`` tokenizer and
  ``exp`` smoothing. This is cumulative BLEU-n, the usual "BLEU-4" for n=4, and not comparable
  with LlamaFactory's numbers (sentence-level NLTK BLEU on jieba tokens, averaged).
- ``rouge-1``, ``rouge-2``, ``rouge-l``: rouge-score's F1, per example, averaged (its default
  tokenizer: lowercased ASCII letters and digits, no stemming; text in other scripts scores 0).
- ``accuracy`` (``task: multiple_choice``): the share of answers whose first standalone option
  letter A-E equals the reference's (an answer starting with the article "A" counts as A).
- ``style`` (``evaluation.style``): the share of answers that carry the training data's style,
  a marker string they contain or a regular expression they match. Unlike BLEU/ROUGE against
  references, it shows whether tuning carries to prompts the model has not seen.

Before any request, the evaluation prompts are checked against the training data
(:mod:`ktflow.stages.contamination`): the overlap is reported, and a contaminated set is never grounds
for promotion unless ``evaluation.allow_contamination`` says so.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ktflow.errors import DatasetError, EvaluationError, KtflowError
from ktflow.recipe import DatasetConfig, EvaluationConfig, Recipe, StyleMetric
from ktflow.stages.contamination import Contamination, find_overlaps
from ktflow.stages.eval_metrics import GENERATIVE_METRICS as GENERATIVE_METRICS  # still importable from here
from ktflow.stages.eval_metrics import (
    generative_metrics,
    latency_summary,
    multiple_choice_accuracy,
    option_letter,
    style_share,
)
from ktflow.stages.serve import Endpoint, dynamic_adapter, render_llamafactory_api, temporary_server
from ktflow.store import atomic_write_bytes, atomic_write_json

PROBE_PROMPTS = 8  # eval prompts the adapter check uses
PROBE_MAX_TOKENS = 16
REQUEST_TIMEOUT_S = 600.0


class EvalRecord(BaseModel):
    """One held-out example: the chat to send and the answer expected."""

    source: str  # file:line
    messages: list[dict[str, Any]]
    reference: str


class EvalReport(BaseModel):
    """What one model scored on the evaluation set."""

    model: str
    n: int
    metrics: dict[str, float]
    predictions: list[dict]
    latency_s: dict[str, float] = {}
    url: str | None = None


# --------------------------------------------------------------------------- records


def load_eval_records(cfg: EvaluationConfig) -> list[EvalRecord]:
    """The held-out records of ``cfg.files`` as prompt + reference pairs.

    Raises:
        DatasetError: a file is missing or any record is bad (all listed, ``file:line``), a
            record has images or ends with a tool call (text only), or no record is left.
    """
    from ktflow.formats.dataset import BadRecord, _normalized_records, validate_dataset

    dataset = DatasetConfig(name="evaluation", files=list(cfg.files), format=cfg.format)
    validate_dataset(dataset)  # every format error at once, as for training data
    records: list[EvalRecord] = []
    bad: list[str] = []
    for item in _normalized_records(dataset):
        if isinstance(item, BadRecord):  # validate_dataset already raised for these
            bad.append(str(item))
            continue
        where, normalized = item
        at = f"{where.file}:{where.line if where.unit == 'line' else f'record {where.line}'}"
        messages = normalized.messages
        if normalized.images:
            bad.append(f"{at}: has images; evaluation sends text only")
            continue
        last = messages[-1] if messages else {}
        if last.get("role") != "assistant" or last.get("tool_calls") or not str(last.get("content", "")).strip():
            bad.append(f"{at}: the last message must be an assistant answer in text (the reference)")
            continue
        prompt = [{"role": m["role"], "content": m.get("content") or "",
                   **({"tool_calls": m["tool_calls"]} if m.get("tool_calls") else {})} for m in messages[:-1]]
        if not prompt or prompt[-1]["role"] != "user":
            bad.append(f"{at}: the reference must answer a user message")
            continue
        records.append(EvalRecord(source=at, messages=prompt, reference=str(last["content"])))
    if bad:
        shown = "\n  ".join(bad[:20])
        raise DatasetError("evaluation.files", f"{len(bad)} record(s) cannot be evaluated:\n  {shown}",
                           "fix or remove them")
    if not records:
        raise DatasetError("evaluation.files", "hold no records", "add held-out records")
    return records


# --------------------------------------------------------------------------- requests


def _client(url: str, api_key: str, timeout_s: float):
    import openai

    return openai.OpenAI(base_url=url if url.rstrip("/").endswith("/v1") else url.rstrip("/") + "/v1",
                         api_key=api_key, timeout=timeout_s, max_retries=2)


def _chat(client: Any, model: str, messages: list[dict[str, Any]], temperature: float,
          max_tokens: int) -> dict[str, Any]:
    started = time.perf_counter()
    response = client.chat.completions.create(model=model, messages=messages, temperature=temperature,
                                              max_tokens=max_tokens)
    seconds = time.perf_counter() - started
    choice = response.choices[0] if response.choices else None
    content = choice.message.content if choice is not None and choice.message is not None else None
    usage = response.usage
    return {"text": content or "", "finish_reason": choice.finish_reason if choice is not None else None,
            "completion_tokens": usage.completion_tokens if usage is not None else None,
            "latency_s": round(seconds, 4)}


def _run_all(fn: Callable[[int], dict[str, Any]], count: int, concurrency: int) -> list[dict[str, Any]]:
    """``fn(i)`` for every i with bounded concurrency, in order; failures collected, then raised."""
    results: list[dict[str, Any] | None] = [None] * count
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            results[i] = fn(i)
        except Exception as exc:  # noqa: BLE001 - reported below, all together
            errors.append(f"#{i}: {type(exc).__name__}: {str(exc)[:300]}")

    with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="eval") as pool:
        list(pool.map(one, range(count)))
    if errors:
        shown = "\n  ".join(sorted(errors)[:10])
        raise EvaluationError(f"{len(errors)} of {count} requests failed:\n  {shown}")
    return [r for r in results if r is not None]


def evaluate_endpoint(
    url: str, api_key: str, model: str, cfg: EvaluationConfig, *, system: str | None = None,
    records: Sequence[EvalRecord] | None = None, timeout_s: float = REQUEST_TIMEOUT_S,
) -> EvalReport:
    """Score ``model`` at ``url`` (an OpenAI base URL) on the evaluation set.

    Args:
        system: a system message for records that have none.
        records: the records to use (default: :func:`load_eval_records` of ``cfg``).

    Raises:
        DatasetError: bad evaluation records.
        EvaluationError: any request failed (all failures listed; no partial metrics).
    """
    records = list(records) if records is not None else load_eval_records(cfg)
    _check_multiple_choice(records, cfg)
    client = _client(url, api_key, timeout_s)

    def ask(i: int) -> dict[str, Any]:
        messages = list(records[i].messages)
        if system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system}, *messages]
        return _chat(client, model, messages, cfg.temperature, cfg.max_tokens)

    try:
        answers = _run_all(ask, len(records), cfg.concurrency)
    finally:
        client.close()
    return score_answers(model, records, answers, cfg, url=url)


def score_answers(model: str, records: Sequence[EvalRecord], answers: Sequence[dict[str, Any]], cfg: EvaluationConfig,
                  *, url: str | None = None) -> EvalReport:
    """The report of ``model``'s ``answers`` (``{"text", "finish_reason", "completion_tokens",
    "latency_s"}``, one per record, in order), however they were obtained (a server, or offline
    generation)."""
    predictions: list[dict[str, Any]] = []
    for i, (record, answer) in enumerate(zip(records, answers, strict=True)):
        row = {"index": i, "source": record.source, "prompt": record.messages[-1]["content"],
               "reference": record.reference, "prediction": answer["text"], **{k: answer.get(k) for k in (
                   "finish_reason", "completion_tokens", "latency_s")}}
        if cfg.task == "multiple_choice":
            row.update(predicted_option=option_letter(answer["text"]), reference_option=option_letter(record.reference))
            row["correct"] = row["predicted_option"] is not None and row["predicted_option"] == row["reference_option"]
        if cfg.style is not None:
            row["styled"] = cfg.style.matches(answer["text"])
        predictions.append(row)
    texts = [p["prediction"] for p in predictions]
    refs = [r.reference for r in records]
    if cfg.task == "multiple_choice":
        metrics = {"accuracy": multiple_choice_accuracy(texts, refs)}
    else:
        metrics = generative_metrics(texts, refs)
    if cfg.style is not None:
        metrics["style"] = style_share(texts, cfg.style)
    return EvalReport(model=model, n=len(records), metrics=metrics, predictions=predictions,
                      latency_s=latency_summary([p["latency_s"] for p in predictions if p["latency_s"] is not None]),
                      url=url)


def _check_multiple_choice(records: Sequence[EvalRecord], cfg: EvaluationConfig) -> None:
    if cfg.task == "multiple_choice":
        missing = [r.source for r in records if option_letter(r.reference) is None]
        if missing:
            raise DatasetError("evaluation.files", f"multiple-choice references without an option letter A-E: "
                                                   f"{', '.join(missing[:10])}", "write the answer letter first")


# --------------------------------------------------------------------------- comparison


def compare_reports(base: EvalReport, tuned: EvalReport, *, style: StyleMetric | None = None,
                    production: EvalReport | None = None, production_label: str = "production") -> str:
    """A markdown table: ``| metric | base | tuned | delta |``, one row per metric both have, and
    ``production`` (the adapter serving now, when there is one) as a last column.

    ``style``: the recipe's style metric, named in its row (``style ('nya~')``).
    """
    head, rule = "| metric | base | tuned | delta |", "|---|---:|---:|---:|"
    if production is not None:
        head, rule = f"{head} {production_label} |", f"{rule}---:|"
    lines = [head, rule]
    for name in [m for m in base.metrics if m in tuned.metrics]:
        b, t = base.metrics[name], tuned.metrics[name]
        label = (style.label if name == "style" and style is not None else name).replace("|", "\\|")
        row = f"| {label} | {b:.2f} | {t:.2f} | {t - b:+.2f} |"
        if production is not None:
            row += f" {production.metrics[name]:.2f} |" if name in production.metrics else " - |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def promotion_gate(base: EvalReport, tuned: EvalReport, metric: str, *, min_gain: float = 0.0,
                   tolerance: float = 0.0) -> bool:
    """True when ``tuned`` gains at least ``min_gain`` on ``metric`` (tuned >= base + min_gain - tolerance).

    Raises:
        KtflowError: a report lacks the metric.
    """
    for label, report in (("base", base), ("tuned", tuned)):
        if metric not in report.metrics:
            raise KtflowError(f"the {label} report has no metric {metric!r} (it has {', '.join(report.metrics)})")
    return tuned.metrics[metric] >= base.metrics[metric] + min_gain - tolerance


def adapter_is_applied(
    url: str, api_key: str, base_model: str, tuned_model: str, prompts: Sequence[str], *,
    base_url: str | None = None, max_tokens: int = PROBE_MAX_TOKENS, concurrency: int = 2,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> tuple[bool, list[dict[str, Any]]]:
    """Whether the tuned model answers any of ``prompts`` differently from the base, greedily.

    ``tuned_model`` is asked at ``url``, ``base_model`` at ``base_url`` (default ``url``: a server
    that serves both, as SGLang does). Temperature 0: both answers are deterministic, so equal
    answers on every prompt mean the adapter changed nothing (it was not applied).
    """
    if not prompts:
        raise ValueError("adapter_is_applied needs at least one prompt")
    tuned_client = _client(url, api_key, timeout_s)
    base_client = _client(base_url or url, api_key, timeout_s)
    jobs = [(p, which) for p in prompts for which in ("base", "tuned")]

    def ask(i: int) -> dict[str, Any]:
        prompt, which = jobs[i]
        client, model = (base_client, base_model) if which == "base" else (tuned_client, tuned_model)
        return _chat(client, model, [{"role": "user", "content": prompt}], 0.0, max_tokens)

    try:
        answers = _run_all(ask, len(jobs), concurrency)
    finally:
        tuned_client.close()
        base_client.close()
    rows = []
    for k, prompt in enumerate(prompts):
        base_text, tuned_text = answers[2 * k]["text"], answers[2 * k + 1]["text"]
        rows.append({"prompt": prompt, "base": base_text, "tuned": tuned_text, "differs": base_text != tuned_text})
    return any(r["differs"] for r in rows), rows


# --------------------------------------------------------------------------- contamination


def check_contamination(recipe: Recipe, records: Sequence[EvalRecord] | None = None) -> Contamination:
    """Which evaluation prompts (``records``, default the recipe's) also occur in its training data.

    Each record's last user message is compared with every user message of ``recipe.dataset``,
    exactly and normalized (question stems for ``task: multiple_choice``); see
    :mod:`ktflow.stages.contamination`.
    """
    from ktflow.formats.dataset import user_prompts

    records = list(records) if records is not None else load_eval_records(recipe.evaluation)
    return find_overlaps(((r.source, str(r.messages[-1]["content"])) for r in records), user_prompts(recipe.dataset),
                         multiple_choice=recipe.evaluation.task == "multiple_choice")


def contamination_refusal(contamination: Contamination) -> str:
    """Why a contaminated evaluation set cannot promote, naming the records and both fixes."""
    return (f"{contamination.summary()}: {contamination.named()}. A score on prompts the model was trained on "
            "shows memorization, not that tuning carries to unseen prompts; remove them from evaluation.files (or "
            "from the training data), or set evaluation.allow_contamination: true to promote anyway")


def refuse_contaminated_gate(recipe: Recipe) -> Contamination | None:
    """Before any heavy work: an enforced gate on a contaminated evaluation set can never pass.

    Returns the overlap found (None when the recipe does not evaluate).

    Raises:
        DatasetError: the recipe enforces a promotion gate (``gate_metric``), its evaluation set
            overlaps the training data, and ``allow_contamination`` is off.
    """
    cfg = recipe.evaluation
    if not cfg.enabled:
        return None
    contamination = check_contamination(recipe)
    if contamination.count and cfg.gate_metric is not None and not cfg.allow_contamination:
        raise DatasetError("evaluation.files", contamination_refusal(contamination),
                           "hold out prompts the training data does not contain")
    return contamination


# --------------------------------------------------------------------------- the stage


class EvaluationResult(BaseModel):
    base: EvalReport
    tuned: EvalReport  # the candidate
    production: EvalReport | None = None  # the adapter serving now, asked the same prompts (None: nothing serves)
    table: str
    adapter_applied: bool
    probes: list[dict[str, Any]]
    gate_metric: str  # the metric promotion was judged on
    gate_enforced: bool  # the recipe set gate_metric: a tuned model that is not promoted fails the run
    gate_min_gain: float  # the points on gate_metric the tuned model had to gain over the base
    contamination: Contamination  # evaluation prompts that also occur in the training data
    allow_contamination: bool  # the recipe lets a contaminated set promote
    promoted: bool  # adapter applied, a clean (or allowed) eval set, and at least gate_min_gain on gate_metric
    report_json: Path
    report_md: Path
    candidate_mode: str | None = None  # how the candidate was judged: beside, offline or swap
    candidate_version: int | None = None
    production_version: int | None = None

    def gate_failure(self) -> str | None:
        """Why an enforced gate failed (None: it passed or is not enforced)."""
        if not self.gate_enforced or self.promoted:
            return None
        return self.gate_reason()

    def gate_reason(self) -> str:
        """The gate's verdict in words, passed or not: what a rejection says and a promotion records."""
        b, t = self.base.metrics[self.gate_metric], self.tuned.metrics[self.gate_metric]
        if not self.adapter_applied:
            return "the tuned model answers exactly like the base model: the adapter is not applied"
        if self.contamination.count and not self.allow_contamination:
            return contamination_refusal(self.contamination)
        if self.promoted:
            return f"{self.gate_metric} {t - b:+.2f} >= {self.gate_min_gain:+.2f} over the base"
        return (f"the tuned model's {self.gate_metric} is {t:.2f} against the base's {b:.2f} ({t - b:+.2f} points); "
                f"the promotion gate asks for at least {self.gate_min_gain:+.2f}")

    def gate_brief(self) -> str:
        """The gate in a few words for a run report line: ``style +10.00 < +50.00``."""
        if not self.adapter_applied:
            return "adapter not applied"
        if self.contamination.count and not self.allow_contamination:
            return f"evaluation set contaminated ({self.contamination.count} prompts)"
        gain = self.tuned.metrics[self.gate_metric] - self.base.metrics[self.gate_metric]
        return f"{self.gate_metric} {gain:+.2f} {'>=' if self.promoted else '<'} {self.gate_min_gain:+.2f}"


class ServedModel(BaseModel):
    """A model to ask through an OpenAI-compatible server."""

    url: str
    model: str


def evaluate_base_vs_tuned(
    recipe: Recipe, *, model_dir: Path, tuned_url: str, tuned_model: str, api_key: str, out_dir: Path,
    base_url: str | None = None, base_model: str | None = None, production: ServedModel | None = None,
    production_version: int | None = None, candidate_version: int | None = None, candidate_mode: str | None = None,
    log: Callable[[str], None] | None = None, kt_weight_dir: Path | None = None,
) -> EvaluationResult:
    """Evaluate the tuned endpoint against the base model and write the report into ``out_dir``.

    LlamaFactory's api serves one model per server, so unless ``base_url`` names a running base
    server, a temporary one is started for the base model on a free port (same key, bound like
    the recipe's endpoint, started with ``die_with_parent``) and stopped at the end. The two
    servers run side by side: the adapter check compares answers of both to the same prompts,
    and the tuned endpoint keeps serving throughout. (sglang: the base server is sglang-kt without
    an adapter, its CPU experts from ``kt_weight_dir``; sglang-kt refuses base requests on a server
    whose expert LoRA is loaded.) Each model is evaluated in turn, with
    ``evaluation.concurrency`` requests in flight. ``production`` (the adapter serving now, when
    the tuned one is a candidate beside it) is asked the same prompts and reported beside them.

    Writes ``out_dir/report.json`` (both reports with every prediction, the probes) and
    ``out_dir/report.md`` (the table, the adapter check, the gate).

    An adapter that is not applied is reported, not raised: ``adapter_applied`` and ``promoted``
    are then False. So is a contaminated evaluation set (:func:`check_contamination`, counted
    before any request): ``promoted`` is False unless ``evaluation.allow_contamination``.

    Raises:
        DatasetError: bad evaluation records.
        EvaluationError: requests failed.
        ServerStartError: the temporary base server did not start.
    """
    cfg = recipe.evaluation
    records = load_eval_records(cfg)
    contamination = _log_contamination(recipe, records, log)
    with _base_endpoint(recipe, model_dir=model_dir, api_key=api_key, record_dir=Path(out_dir).absolute() / "base-endpoint",
                        base_url=base_url, base_model=base_model, log=log,
                        kt_weight_dir=kt_weight_dir) as (base_url, base_model):
        if log:
            log(f"evaluating {len(records)} records: base {base_model}, tuned {tuned_model}"
                + (f", production {production.model}" if production else ""))
        base = evaluate_endpoint(base_url, api_key, base_model, cfg, records=records)
        tuned = evaluate_endpoint(tuned_url, api_key, tuned_model, cfg, records=records)
        served = evaluate_endpoint(production.url, api_key, production.model, cfg, records=records) if production else None
        prompts = [r.messages[-1]["content"] for r in records[:PROBE_PROMPTS]]
        applied, probes = adapter_is_applied(tuned_url, api_key, base_model, tuned_model, prompts, base_url=base_url)
    return judge(recipe, base=base, tuned=tuned, production=served, applied=applied, probes=probes,
                 contamination=contamination, out_dir=out_dir, candidate_mode=candidate_mode,
                 candidate_version=candidate_version, production_version=production_version)


def _log_contamination(recipe: Recipe, records: Sequence[EvalRecord], log: Callable[[str], None] | None
                       ) -> Contamination:
    contamination = check_contamination(recipe, records)
    if log:
        log(contamination.summary() + (f": {contamination.named()}" if contamination.count else ""))
    return contamination


def judge(recipe: Recipe, *, base: EvalReport, tuned: EvalReport, production: EvalReport | None, applied: bool,
          probes: list[dict[str, Any]], contamination: Contamination, out_dir: Path, candidate_mode: str | None = None,
          candidate_version: int | None = None, production_version: int | None = None) -> EvaluationResult:
    """The promotion gate on the reports, written as ``out_dir/report.json`` and ``report.md``."""
    cfg = recipe.evaluation
    out_dir = Path(out_dir).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    # Promotion is always judged (never "promoted" while worse than the base, nor on prompts the
    # model was trained on); only a recipe that sets gate_metric makes a failed gate fail the run.
    trusted = contamination.clean or cfg.allow_contamination
    promoted = applied and trusted and promotion_gate(base, tuned, cfg.gate, min_gain=cfg.gate_min_gain)
    label = f"production (v{production_version})" if production_version is not None else "production"
    result = EvaluationResult(base=base, tuned=tuned, production=production,
                              table=compare_reports(base, tuned, style=cfg.style, production=production,
                                                    production_label=label),
                              adapter_applied=applied, probes=probes, gate_metric=cfg.gate,
                              gate_enforced=cfg.gate_metric is not None, gate_min_gain=cfg.gate_min_gain,
                              contamination=contamination, allow_contamination=cfg.allow_contamination,
                              promoted=promoted, report_json=out_dir / "report.json", report_md=out_dir / "report.md",
                              candidate_mode=candidate_mode, candidate_version=candidate_version,
                              production_version=production_version)
    atomic_write_json(result.report_json, {
        "base": base.model_dump(mode="json"), "tuned": tuned.model_dump(mode="json"),
        "production": production.model_dump(mode="json") if production else None, "adapter_applied": applied,
        "probes": probes, "gate_metric": result.gate_metric, "gate_enforced": result.gate_enforced,
        "gate_min_gain": cfg.gate_min_gain, "contamination": contamination.model_dump(mode="json"),
        "allow_contamination": cfg.allow_contamination, "promoted": promoted, "candidate_mode": candidate_mode,
        "candidate_version": candidate_version, "production_version": production_version})
    atomic_write_bytes(result.report_md, render_report_md(recipe, result).encode())
    return result


@contextlib.contextmanager
def _base_endpoint(recipe: Recipe, *, model_dir: Path, api_key: str, record_dir: Path, base_url: str | None,
                   base_model: str | None, log: Callable[[str], None] | None,
                   kt_weight_dir: Path | None = None) -> Iterator[tuple[str, str]]:
    """``(url, model)`` of the base model: ``base_url`` when given, else a temporary server on a free
    port (same key, started with ``die_with_parent``), stopped on the way out."""
    if base_url is not None:
        yield base_url, base_model or recipe.serving.served_model_name
        return
    with temporary_server(recipe, model_dir=model_dir, adapter_dir=None, api_key=api_key, record_dir=record_dir,
                          what="base-model", log=log, kt_weight_dir=kt_weight_dir) as served:
        yield served.url, served.model


def render_report_md(recipe: Recipe, result: EvaluationResult) -> str:
    """``report.md``: the table, the train/eval overlap, the adapter check and the gate."""
    cfg = recipe.evaluation
    overlap = result.contamination
    need = f"gain at least {cfg.gate_min_gain:.2f} points" if cfg.gate_min_gain else "not regress"
    held = "held-out records" if overlap.clean else "evaluation records (NOT all held out: see the overlap below)"
    judged = ""
    if result.candidate_version is not None:
        how = {"beside": "beside production, taking no production traffic",
               "offline": "offline, through the training toolchain, before anything was served",
               "swap": "in production's place (swap mode)"}.get(result.candidate_mode or "", "")
        judged = f"Candidate v{result.candidate_version}, judged {how}" + (
            f"; production is v{result.production_version}" if result.production_version is not None else
            "; nothing was in production") + "\n\n"
    md = [f"### Evaluation: {recipe.name}", "", f"{judged}{result.base.n} {held}, temperature {cfg.temperature}, "
          f"max_tokens {cfg.max_tokens}", "", result.table,
          f"Train/eval overlap: {overlap.summary().removeprefix('train/eval overlap: ')}"
          + (f": {overlap.named()}" + ("; allowed by evaluation.allow_contamination" if cfg.allow_contamination
                                        else "; a contaminated set does not promote") if overlap.count else ""), "",
          f"Adapter applied: **{'yes' if result.adapter_applied else 'NO'}** "
          f"({sum(p['differs'] for p in result.probes)} of {len(result.probes)} probe prompts answered differently "
          "from the base at temperature 0)", "",
          f"Promotion gate ({result.gate_metric} must {need}{'' if result.gate_enforced else '; reported only'}): "
          f"**{'pass' if result.promoted else 'fail'}**"]
    return "\n".join(md) + "\n"


# --------------------------------------------------------------------------- candidates


class Candidate(BaseModel):
    """An adapter version to judge before it takes production traffic."""

    version: int
    adapter_dir: Path


def evaluate_candidate(
    recipe: Recipe, *, mode: str, model_dir: Path, serve_model_dir: Path, candidate: Candidate,
    production: Endpoint | None = None, production_version: int | None = None, api_key: str, out_dir: Path,
    log: Callable[[str], None] | None = None, kt_weight_dir: Path | None = None,
) -> EvaluationResult:
    """Judge ``candidate`` without letting it take production traffic: base vs candidate vs production.

    ``mode``: ``beside``: a second adapter name on the production server where the backend loads
    adapters at run time (``serving.dynamic_lora``: SGLang's ``/load_lora_adapter``), else a second
    server process on a free port (LlamaFactory's API and sglang-kt load one adapter per process;
    sglang-kt's CPU experts come from ``kt_weight_dir``, a second copy in RAM), with the base model
    on a third, each stopped (or the adapter unloaded) on the way out, whatever the verdict;
    ``offline``: answers generated through the training toolchain, no server at all.
    ``production``: the recipe's running :class:`~ktflow.stages.serve.Endpoint` (None: nothing serves yet).
    ``model_dir`` is the base the adapter was trained on (the comparison's base model);
    ``serve_model_dir`` what a server loads it on.

    Raises:
        InvalidInputError: the mode cannot judge a candidate with this backend.
        DatasetError, EvaluationError, ServerStartError: as :func:`evaluate_base_vs_tuned`.
    """
    from ktflow.errors import InvalidInputError

    out_dir = Path(out_dir).absolute()
    served = ServedModel(url=production.url, model=production.model) if production is not None else None
    common = dict(production_version=production_version if served else None, candidate_version=candidate.version,
                  candidate_mode=mode, log=log)
    if mode == "offline":
        return evaluate_offline(recipe, model_dir=model_dir, candidate=candidate, production_adapter=(
            production.adapter_dir if production is not None else None), out_dir=out_dir, **common)
    if mode != "beside":
        raise InvalidInputError("evaluation.candidate", f"{mode!r} judges a candidate after it serves, not beside it",
                                "call ktflow.stages.promotion for swap mode")
    serving = recipe.serving
    if serving.backend == "sglang" and serving.dynamic_lora and production is not None:
        name = f"{serving.adapter_name}-candidate-v{candidate.version}"
        with dynamic_adapter(production.root_url, api_key, name, candidate.adapter_dir, log=log):
            return evaluate_base_vs_tuned(
                recipe, model_dir=model_dir, tuned_url=production.url, tuned_model=f"{serving.served_model_name}:{name}",
                api_key=api_key, out_dir=out_dir, base_url=production.url, base_model=serving.served_model_name,
                production=served, **common)
    if serving.backend == "sglang" and kt_weight_dir is None:
        raise InvalidInputError("kt_weight_dir", "'beside' starts a second sglang-kt server for the candidate, "
                                "which needs the CPU expert weights", "pass the weights for serving.kt_method")
    with temporary_server(recipe, model_dir=serve_model_dir, adapter_dir=candidate.adapter_dir, api_key=api_key,
                          record_dir=out_dir / "candidate-endpoint", what=f"candidate v{candidate.version}",
                          log=log, kt_weight_dir=kt_weight_dir) as slot:
        return evaluate_base_vs_tuned(recipe, model_dir=model_dir, tuned_url=slot.url, tuned_model=slot.model,
                                      api_key=api_key, out_dir=out_dir, production=served,
                                      kt_weight_dir=kt_weight_dir, **common)


def evaluate_offline(
    recipe: Recipe, *, model_dir: Path, candidate: Candidate, production_adapter: Path | None, out_dir: Path,
    production_version: int | None = None, candidate_version: int | None = None, candidate_mode: str | None = "offline",
    log: Callable[[str], None] | None = None,
) -> EvaluationResult:
    """Base vs candidate (vs production's adapter) with answers generated through the training
    toolchain (LlamaFactory's own chat engine, as its API server answers): no server is started and
    nothing that serves is touched. Greedy at ``evaluation.temperature`` 0, so the answers are the
    ones the served model would give."""
    from ktflow.stages.offline_generation import generate_offline

    cfg = recipe.evaluation
    records = load_eval_records(cfg)
    _check_multiple_choice(records, cfg)
    contamination = _log_contamination(recipe, records, log)
    out_dir = Path(out_dir).absolute()
    python = recipe.toolchains.train.require("toolchains.train.python", "LlamaFactory", "train-env")
    probe_prompts = [r.messages[-1]["content"] for r in records[:PROBE_PROMPTS]]
    requests = [{"messages": r.messages, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature}
                for r in records] + [{"messages": [{"role": "user", "content": p}], "max_tokens": PROBE_MAX_TOKENS,
                                      "temperature": 0.0} for p in probe_prompts]
    answers: dict[str, list[dict[str, Any]]] = {}
    adapters = {"base": None, "tuned": candidate.adapter_dir, "production": production_adapter}
    for which, adapter in adapters.items():
        if which == "production" and adapter is None:
            continue
        _, env, infer = render_llamafactory_api(recipe, model_dir=model_dir, adapter_dir=adapter, train_python=python,
                                                config_dir=out_dir)
        if log:
            log(f"offline generation: {which} ({len(requests)} requests through the training toolchain)")
        answers[which] = generate_offline(python, infer, requests, work_dir=out_dir / f"offline-{which}",
                                          env={k: v for k, v in env.items() if not k.startswith("API_")}, log=log)
    n = len(records)
    for got in answers.values():
        for answer in got:
            answer.setdefault("latency_s", answer.get("seconds"))
    reports = {which: score_answers(f"{which} (offline)", records, got[:n], cfg) for which, got in answers.items()}
    probes = [{"prompt": p, "base": b["text"], "tuned": t["text"], "differs": b["text"] != t["text"]}
              for p, b, t in zip(probe_prompts, answers["base"][n:], answers["tuned"][n:], strict=True)]
    return judge(recipe, base=reports["base"], tuned=reports["tuned"], production=reports.get("production"),
                 applied=any(p["differs"] for p in probes), probes=probes, contamination=contamination,
                 out_dir=out_dir, candidate_mode=candidate_mode, candidate_version=candidate_version,
                 production_version=production_version)
