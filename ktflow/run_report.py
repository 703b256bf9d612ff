"""What the Prefect UI shows of a run, rendered without Prefect: images a browser can load.

The UI is a web page served over HTTP: an image given by a ``file://`` path (where the store
happens to be) never loads in a user's browser. A small PNG (LlamaFactory's loss curve is ~20 KB)
is therefore embedded in the artifact itself, as a ``data:`` URL in markdown, which the UI's
markdown renderer shows as an image wherever the server is reached from. Engine side: no
Prefect import (tasks/sft.py publishes the markdown).
"""

from __future__ import annotations

import base64
from pathlib import Path

# Above this the image is not embedded (artifacts live in the server's database): the markdown
# names the file instead. A matplotlib loss curve is two orders of magnitude smaller.
MAX_INLINE_IMAGE_BYTES = 1 << 20

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_data_url(path: Path, max_bytes: int = MAX_INLINE_IMAGE_BYTES) -> str | None:
    """``data:image/png;base64,...`` of the PNG at ``path``; None if it is missing, not a PNG
    or larger than ``max_bytes``."""
    try:
        if Path(path).stat().st_size > max_bytes:
            return None
        data = Path(path).read_bytes()
    except OSError:
        return None
    if not data.startswith(_PNG_SIGNATURE) or len(data) > max_bytes:
        return None
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def image_markdown(path: Path, title: str, alt: str, caption: str = "",
                   max_bytes: int = MAX_INLINE_IMAGE_BYTES, data_url: str | None = None) -> str:
    """A markdown block showing the PNG at ``path`` inline (a data URL), with a title and caption.

    ``data_url``: the same image as it was read where ``path`` exists (another host), used when the
    file is not here. When the image cannot be embedded (missing, not a PNG, too large), the block says
    so and names the file, instead of a link the browser cannot open.
    """
    url = png_data_url(path, max_bytes) or (data_url if data_url and data_url.startswith("data:image/png;") else None)
    lines = [f"### {title}", ""]
    if url is None:
        lines.append(f"_{alt}: not embedded (missing, not a PNG, or over {max_bytes} bytes); file: `{path}`_")
    else:
        lines.append(f"![{alt}]({url})")
    if caption:
        lines += ["", caption]
    return "\n".join(lines) + "\n"


# The stage table's columns, the short ones first (the result, a path, is the widest).
REPORT_COLUMNS = ("stage", "outcome", "host", "pool", "worker", "why", "result")


def _cell(value: object) -> str:
    """A markdown table cell: no pipes or newlines to break the row."""
    text = "-" if value is None or value == "" else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def stage_rows(rows: list[dict], where: dict[str, dict]) -> list[dict[str, str]]:
    """The pipeline's stage rows (stage, runs, why, result) with how each ended and where it ran.

    ``where`` maps a stage to its ``stage-host-<stage>`` record (host, pool, worker); a stage
    that did not run has none. "outcome" is what a user scans for: ran, cache hit or skipped.
    """
    out = []
    for row in rows:
        result = str(row.get("result", ""))
        if row.get("runs") == "skipped":
            outcome = "skipped"
        elif result.endswith("(cached)"):
            outcome = "cache hit"
        else:
            outcome = "ran"
        place = where.get(row["stage"]) or {}
        out.append({"stage": row["stage"], "outcome": outcome, "why": row.get("why", ""), "result": result,
                    "host": place.get("host"), "pool": place.get("pool"), "worker": place.get("worker")})
    return out


def render_run_report(
    name: str,
    rows: list[dict],
    where: dict[str, dict],
    *,
    loss_curve: Path | None = None,
    loss_curve_png: str | None = None,
    loss_caption: str = "",
    evaluation_table: str | None = None,
    evaluation_verdict: str = "",
    endpoint_url: str | None = None,
    endpoint_models: str = "",
    promotion: str = "",
    max_image_bytes: int = MAX_INLINE_IMAGE_BYTES,
) -> str:
    """The whole story of one pipeline run as one markdown document (the run's report artifact).

    Sections: the stage table (what ran, what was skipped and why, what was a cache hit, where
    each stage ran), the training loss curve (embedded), the evaluation table base vs tuned, and
    the endpoint. ``loss_curve_png``: the curve as read on the training host (embedded where
    ``loss_curve`` is not on this host). ``promotion``: the candidate's fate in one line ("promoted v2 (replaces v1)",
    "candidate v2: not promoted (...); production stays v1"), shown first.
    """
    lines = [f"## ktflow pipeline: {name}", ""]
    if promotion:
        lines += [f"**{promotion}**", ""]
    lines += ["### Stages", "",
             "| " + " | ".join(REPORT_COLUMNS) + " |", "|" + "---|" * len(REPORT_COLUMNS)]
    for row in stage_rows(rows, where):
        lines.append("| " + " | ".join(_cell(row[k]) for k in REPORT_COLUMNS) + " |")
    lines.append("")
    if loss_curve is not None:
        lines.append(image_markdown(loss_curve, "Training loss", "training loss", loss_caption, max_image_bytes,
                                    data_url=loss_curve_png))
    if evaluation_table:
        lines += ["### Evaluation: base vs tuned" + (" vs production" if "production" in evaluation_table.split("\n", 1)[0]
                                                    else ""), "", evaluation_table.strip(), ""]
        if evaluation_verdict:
            lines += [evaluation_verdict, ""]
    if endpoint_url:
        lines += ["### Endpoint", "", f"`{endpoint_url}`" + (f" ({endpoint_models})" if endpoint_models else ""),
                  "", "The API key is not shown: it is in the server host's environment or key file.", ""]
    return "\n".join(lines).rstrip() + "\n"
