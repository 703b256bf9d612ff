"""Train/eval overlap: which evaluation prompts the model already saw in training.

A score on a prompt the model was trained on measures memorization, not whether tuning carries
to prompts it has not seen. :func:`find_overlaps` compares each evaluation prompt with every
user message of the training data, twice:

- **exact**: the same text after stripping leading and trailing whitespace;
- **normalized**: the same after Unicode NFKC, case folding, removing punctuation (Unicode
  category P*) and collapsing runs of whitespace, so "What is a shard?" and
  "what is a  SHARD" are one prompt.

For multiple choice both sides are reduced to the question **stem** first (the text before the
first option line such as ``A. ...``, ``(B) ...`` or ``C) ...``): the same question with its
options reworded or reordered is still the same question.

The evaluate stage reports the count and share, and a contaminated set is never grounds for
promotion unless the recipe says so (``evaluation.allow_contamination``).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel

_OPTION_LINE = re.compile(r"^\s*(?:\(\s*[A-Ea-e]\s*\)|[A-Ea-e]\s*[.):：])\s*\S")
_WHITESPACE = re.compile(r"\s+")
SHOWN_PROMPT_CHARS = 80


def normalize_prompt(text: str) -> str:
    """``text`` for the normalized comparison: NFKC, casefolded, no punctuation, single spaces."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    kept = "".join(ch for ch in folded if not unicodedata.category(ch).startswith("P"))
    return _WHITESPACE.sub(" ", kept).strip()


def question_stem(text: str) -> str:
    """A multiple-choice prompt without its options: the lines before the first option line.

    A prompt with no option line is its own stem.
    """
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if _OPTION_LINE.match(line) and i > 0:
            return "\n".join(lines[:i]).strip()
    return text.strip()


class Overlap(BaseModel):
    """One evaluation prompt that also occurs in the training data."""

    eval_source: str  # file:line of the evaluation record
    train_source: str  # file:line of the first training record with the same prompt
    match: Literal["exact", "normalized"]
    prompt: str  # the evaluation prompt, shortened for reports

    def __str__(self) -> str:
        return f"{self.eval_source} = {self.train_source} ({self.match}): {self.prompt!r}"


class Contamination(BaseModel):
    """How many evaluation prompts the training data holds, and which."""

    eval_prompts: int
    compared: Literal["prompt", "question stem"]
    overlaps: list[Overlap] = []

    @property
    def count(self) -> int:
        """Evaluation prompts found in the training data (exact or normalized)."""
        return len(self.overlaps)

    @property
    def exact(self) -> int:
        return sum(1 for o in self.overlaps if o.match == "exact")

    @property
    def share(self) -> float:
        """Percent of the evaluation prompts found in the training data."""
        return 100.0 * self.count / self.eval_prompts if self.eval_prompts else 0.0

    @property
    def clean(self) -> bool:
        return not self.overlaps

    def summary(self) -> str:
        """One line: ``train/eval overlap: 0 of 8 eval prompts (0.0 %)`` and how it was compared."""
        unit = "question stems" if self.compared == "question stem" else "prompts"
        return (f"train/eval overlap: {self.count} of {self.eval_prompts} eval {unit} ({self.share:.1f} %) occur in "
                f"the training data ({self.exact} exact, {self.count - self.exact} more after normalizing case, "
                "whitespace and punctuation)")

    def named(self, limit: int = 10) -> str:
        """The overlapping records, ``eval = train (match): prompt``, at most ``limit`` of them."""
        shown = [str(o) for o in self.overlaps[:limit]]
        more = len(self.overlaps) - len(shown)
        return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


def find_overlaps(
    eval_prompts: Iterable[tuple[str, str]], train_prompts: Iterable[tuple[str, str]], *,
    multiple_choice: bool = False,
) -> Contamination:
    """The evaluation prompts that also occur among the training prompts.

    Args:
        eval_prompts: ``(source, prompt)`` for each evaluation record (its last user message).
        train_prompts: ``(source, text)`` for each user message of the training data
            (:func:`ktflow.formats.dataset.user_prompts`).
        multiple_choice: compare question stems (:func:`question_stem`) instead of whole prompts.
    """
    reduce = question_stem if multiple_choice else str.strip
    exact: dict[str, str] = {}
    normalized: dict[str, str] = {}
    for source, text in train_prompts:
        key = reduce(text)
        exact.setdefault(key, source)
        normalized.setdefault(normalize_prompt(key), source)
    overlaps: list[Overlap] = []
    count = 0
    for source, prompt in eval_prompts:
        count += 1
        key = reduce(prompt)
        shown = prompt if len(prompt) <= SHOWN_PROMPT_CHARS else prompt[: SHOWN_PROMPT_CHARS - 3] + "..."
        if key in exact:
            overlaps.append(Overlap(eval_source=source, train_source=exact[key], match="exact", prompt=shown))
        elif (norm := normalize_prompt(key)) and norm in normalized:
            overlaps.append(Overlap(eval_source=source, train_source=normalized[norm], match="normalized", prompt=shown))
    return Contamination(eval_prompts=count, compared="question stem" if multiple_choice else "prompt",
                         overlaps=overlaps)
