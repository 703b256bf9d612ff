"""The evaluation's metrics, on a 0-100 scale like LlamaFactory's ``predict_results.json``: BLEU and
ROUGE for generative answers, the option letter of a multiple-choice answer, a style's share, and a
latency summary. Pure functions of the answers: no server, no recipe.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence

from ktflow.recipe import StyleMetric

GENERATIVE_METRICS = ("bleu-1", "bleu-2", "bleu-3", "bleu-4", "rouge-1", "rouge-2", "rouge-l")
_LETTER = re.compile(r"\b([A-E])\b")


def option_letter(text: str) -> str | None:
    """The first standalone option letter A-E in ``text`` ("B", "(C)", "Answer: D."), or None."""
    match = _LETTER.search(text or "")
    return match.group(1) if match else None


def generative_metrics(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """BLEU-1..4 (sacrebleu, corpus) and ROUGE-1/2/L F1 (rouge-score, mean), 0-100."""
    from rouge_score import rouge_scorer
    from sacrebleu.metrics import BLEU

    if len(predictions) != len(references) or not references:
        raise ValueError("predictions and references must be non-empty and of equal length")
    hyps = [p.strip() for p in predictions]
    refs = [r.strip() for r in references]
    metrics: dict[str, float] = {}
    for n in range(1, 5):
        metrics[f"bleu-{n}"] = float(BLEU(max_ngram_order=n).corpus_score(hyps, [refs]).score)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=False)
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for hyp, ref in zip(hyps, refs):
        scores = scorer.score(ref, hyp)  # (target, prediction)
        for key in totals:
            totals[key] += scores[key].fmeasure
    for key, name in (("rouge1", "rouge-1"), ("rouge2", "rouge-2"), ("rougeL", "rouge-l")):
        metrics[name] = 100.0 * totals[key] / len(hyps)
    return metrics


def style_share(predictions: Sequence[str], style: StyleMetric) -> float:
    """Percent of predictions that carry ``style`` (contain its marker or match its pattern)."""
    if not predictions:
        raise ValueError("no predictions")
    return 100.0 * sum(1 for p in predictions if style.matches(p)) / len(predictions)


def multiple_choice_accuracy(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Percent of predictions whose option letter equals the reference's."""
    if not references:
        raise ValueError("no references")
    correct = sum(1 for p, r in zip(predictions, references) if option_letter(p) is not None
                  and option_letter(p) == option_letter(r))
    return 100.0 * correct / len(references)


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def latency_summary(latencies: Sequence[float]) -> dict[str, float]:
    return {"p50": _percentile(latencies, 50), "p95": _percentile(latencies, 95),
            "mean": statistics.fmean(latencies) if latencies else math.nan,
            "max": max(latencies) if latencies else math.nan}
