"""Evaluation (``evaluation``): base vs tuned through the endpoint, and the promotion gate."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from ktflow.recipe._base import _Strict


class StyleMetric(_Strict):
    """The ``style`` metric: the share of answers (0-100) that carry the training data's style.

    Give a ``marker`` (a string the answer contains, e.g. ``nya~``) or a ``pattern`` (a Python
    regular expression searched in the answer, e.g. ``nya~\\s*$``), not both.
    """

    marker: str | None = Field(None, min_length=1, description="A string a styled answer contains")
    pattern: str | None = Field(None, min_length=1, description="A regular expression (re.search) a styled answer matches")

    @model_validator(mode="after")
    def _one_of(self) -> StyleMetric:
        if (self.marker is None) == (self.pattern is None):
            raise ValueError("give exactly one of marker (a string) or pattern (a regular expression)")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise ValueError(f"@pattern: {self.pattern!r} is not a regular expression ({exc})") from None
        return self

    @property
    def label(self) -> str:
        """How the eval table names the metric."""
        return f"style ({self.marker!r})" if self.marker is not None else f"style (/{self.pattern}/)"

    def matches(self, answer: str) -> bool:
        """Whether ``answer`` carries the style."""
        if self.marker is not None:
            return self.marker in answer
        assert self.pattern is not None
        return re.search(self.pattern, answer) is not None


class EvaluationConfig(_Strict):
    """Base-vs-tuned evaluation through the OpenAI-compatible endpoint."""

    enabled: bool = True
    files: list[Path] = Field(default_factory=list, description="Held-out records")
    format: Literal["alpaca", "sharegpt", "openai"] = "openai"
    task: Literal["generative", "multiple_choice"] = "generative"
    temperature: float = Field(0.0, ge=0.0)
    max_tokens: int = Field(256, gt=0)
    concurrency: int = Field(4, ge=1, le=256)
    style: StyleMetric | None = Field(
        None, description="Also score the share of answers in the training data's style (a marker or a regex)"
    )
    gate_metric: Literal["bleu-4", "rouge-l", "accuracy", "style"] | None = Field(
        None, description="The promotion gate: a tuned model that does not gain gate_min_gain points on this "
        "metric over the base fails the run. Unset: the gate is only reported, on rouge-l (accuracy for "
        "multiple_choice), and never fails the run"
    )
    gate_min_gain: float = Field(
        0.0, ge=0.0, le=100.0, description="Points (0-100 scale) the tuned model must gain over the base on the "
        "gate metric to be promoted (0: it must not regress)"
    )
    allow_contamination: bool = Field(
        False, description="Promote even when evaluation prompts also occur in the training data (they are still "
        "counted, named and reported). Off: a contaminated evaluation set is never grounds for promotion"
    )
    candidate: Literal["beside", "offline", "swap"] | None = Field(
        None, description="How a retrained adapter is judged before it replaces production. beside: a second "
        "adapter name on the server (serving.dynamic_lora) or a second server on a free port; offline: answers "
        "generated through the training toolchain, no server; swap: it serves first and a failed gate rolls "
        "production back. Unset: the plan picks from the host's memory and says why"
    )

    @model_validator(mode="after")
    def _files_when_enabled(self) -> EvaluationConfig:
        if self.enabled and not self.files:
            raise ValueError("@files: evaluation is enabled but lists no files; add files or set enabled: false")
        if self.gate_metric == "accuracy" and self.task != "multiple_choice":
            raise ValueError("@gate_metric: 'accuracy' needs task: multiple_choice")
        if self.gate_metric == "style" and self.style is None:
            raise ValueError("@gate_metric: 'style' needs evaluation.style (a marker or a pattern)")
        return self

    @property
    def gate(self) -> str:
        """The metric promotion is judged on: ``gate_metric``, else the task's main metric."""
        return self.gate_metric or ("accuracy" if self.task == "multiple_choice" else "rouge-l")
