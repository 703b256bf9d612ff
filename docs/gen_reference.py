"""The documentation site's generated parts, made at build time (mkdocs.yml: ``hooks``); nothing here is committed.

A committed page holds a marker where generated content goes, so it reads on GitHub too:

- ``<!-- ktflow:recipe-reference -->``: every recipe section's fields, types, defaults and descriptions, walked
  from the pydantic model ``ktflow.recipe.Recipe`` (so the reference cannot drift from the code);
- ``<!-- ktflow:cli-reference -->``: every ``ktflow`` command with its usage and arguments, from the argparse
  parser ``ktflow.cli.build_parser``;
- ``<!-- ktflow:stage-example -->``: the stage a contributor copies, taken from docs/contributing.md,
  where tests/test_runner.py runs it as written;
- ``<!-- ktflow:figure NAME -->``: a chart drawn (SVG) from the data under benchmarks/data.

A marker the hook does not know, or a page that names a figure with no data, fails the build.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BENCH = ROOT / "benchmarks" / "data"
FIGURES = "figures"  # where the generated SVGs live in the built site

_MARKER = re.compile(r"<!-- ktflow:([a-z-]+)(?: ([a-z0-9-]+))? -->")


# --------------------------------------------------------------------------------------------------
# The recipe reference
# --------------------------------------------------------------------------------------------------

def recipe_sections() -> list[tuple[str, type]]:
    """Every (dotted path, model) a recipe holds, depth first from ``Recipe`` itself ("" is the top level)."""
    from pydantic import BaseModel

    from ktflow.recipe import Recipe

    found: list[tuple[str, type]] = []

    def models_in(annotation: Any) -> Iterator[type]:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield annotation
        for arg in typing.get_args(annotation):
            yield from models_in(arg)

    def walk(path: str, model: type) -> None:
        found.append((path, model))
        for name, field in model.model_fields.items():
            for sub in models_in(field.annotation):
                walk(f"{path}.{name}" if path else name, sub)

    walk("", Recipe)
    return found


def _type_name(annotation: Any) -> str:
    """A field's type as a reader writes it in YAML: ``int``, ``"lora" or "full"``, ``list of path``."""
    from pydantic import BaseModel

    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Literal:
        return " or ".join(json.dumps(a) if isinstance(a, str) else str(a).lower() for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin in (list, tuple, set):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping of {_type_name(args[0])} to {_type_name(args[1])}" if args else "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping (section below)"
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return "path"
    return getattr(annotation, "__name__", str(annotation)).replace("NoneType", "null")


def _constraints(field: Any) -> str:
    """A field's bounds and patterns, as pydantic declares them (``> 0``, ``1 to 256``, ``matches ^[A-Z_]...``)."""
    parts: list[str] = []
    for item in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{sign} {value}")
        if getattr(item, "min_length", None):
            parts.append(f"at least {item.min_length} item(s)" if "list" in str(field.annotation)
                         else f"at least {item.min_length} character(s)")
        pattern = getattr(item, "pattern", None)
        if pattern:
            parts.append(f"matches `{pattern}`")
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if extra.get("pattern"):
        parts.append(f"matches `{extra['pattern']}`")
    return ", ".join(parts)


def _default(field: Any) -> str:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "the section's defaults"
    if value is None:
        return "unset"
    if isinstance(value, Path):
        return f"`{value}`"
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return " ".join(text.split()).replace("|", "&#124;")


def recipe_reference() -> str:
    from pydantic import BaseModel

    out: list[str] = []
    for path, model in recipe_sections():
        title = f"`{path}`" if path else "The top level"
        out += [f"## {title}", ""]
        doc = " ".join((model.__doc__ or "").split())
        if doc:
            out += [doc, ""]
        out += ["| field | type | default | description |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            key = f"{path}.{name}" if path else name
            kind = _type_name(field.annotation)
            if any(isinstance(a, type) and issubclass(a, BaseModel)
                   for a in (field.annotation, *typing.get_args(field.annotation))):
                kind = kind.replace("mapping (section below)", f"mapping: [`{key}`](#{_slug(key)})")
            bounds = _constraints(field)
            if bounds:
                kind += f"; {bounds}"
            out.append(f"| `{key}` | {_cell(kind)} | {_cell(_default(field))} | {_cell(field.description or '')} |")
        out.append("")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------
# The CLI reference
# --------------------------------------------------------------------------------------------------

def cli_commands() -> list[tuple[str, argparse.ArgumentParser, str]]:
    """Every command as (``ktflow sft``, its parser, its help), nested ones (``ktflow dataset publish``) included."""
    from ktflow.cli import build_parser

    found: list[tuple[str, argparse.ArgumentParser, str]] = []

    def walk(parser: argparse.ArgumentParser, prefix: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
                for name, sub in action.choices.items():
                    found.append((f"{prefix} {name}", sub, helps.get(name, sub.description or "")))
                    walk(sub, f"{prefix} {name}")

    walk(build_parser(), "ktflow")
    return found


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=100)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip()


def cli_reference() -> str:
    out: list[str] = []
    for command, parser, help_text in cli_commands():
        out += [f"## `{command}`", ""]
        if help_text:
            out += [help_text[0].upper() + help_text[1:] + ".", ""]
        out += ["```", _usage(parser), "```", ""]
        rows: list[str] = []
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if action.option_strings:
                shown = ", ".join(action.option_strings)
                if action.nargs != 0:
                    shown += f" {action.metavar or action.dest.upper()}"
            else:
                shown = action.metavar or action.dest
            notes: list[str] = []
            if action.required and action.option_strings:
                notes.append("required")
            if isinstance(action, argparse._AppendAction):
                notes.append("repeatable")
            if action.choices:
                notes.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
            if action.default is not None and action.default is not False and action.default != [] \
                    and action.default != argparse.SUPPRESS and action.nargs != 0:
                notes.append(f"default `{action.default}`")
            rows.append(f"| `{shown}` | {_cell(action.help or '')} | {_cell('; '.join(notes))} |")
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                rows.append(f"| `{action.metavar or 'ACTION'}` | one of: "
                            + ", ".join(f"[`{name}`](#{_slug(f'{command} {name}')})" for name in action.choices) + " | |")
        if rows:
            out += ["| argument | what | notes |", "|---|---|---|", *rows, ""]
    return "\n".join(out)


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc gives a heading (its default slugify)."""
    text = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


# --------------------------------------------------------------------------------------------------
# The stage a contributor copies (README.md is its one copy: tests/test_runner.py runs it there)
# --------------------------------------------------------------------------------------------------

def stage_example() -> str:
    page = (DOCS / "contributing.md").read_text(encoding="utf-8")
    heading = "## A stage to copy"
    if heading not in page or "```python\n" not in page.split(heading, 1)[1]:
        raise ValueError(f"docs/contributing.md has no python block under {heading!r} (tests/test_runner.py runs it)")
    code = page.split(heading, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    return f"```python\n{code}```"


# --------------------------------------------------------------------------------------------------
# Figures: small SVG charts from benchmarks/data
# --------------------------------------------------------------------------------------------------

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


class Axis:
    def __init__(self, lo: float, hi: float, log: bool, start: float, end: float) -> None:
        self.log, self.start, self.end = log, start, end
        self.lo, self.hi = (math.log10(lo), math.log10(hi)) if log else (lo, hi)

    def __call__(self, value: float) -> float:
        v = math.log10(value) if self.log else value
        return self.start + (v - self.lo) / (self.hi - self.lo) * (self.end - self.start)

    def ticks(self) -> list[float]:
        if self.log:
            out = []
            for exp in range(math.floor(self.lo), math.ceil(self.hi) + 1):
                for m in (1, 2, 5):
                    v = m * 10 ** exp
                    if 10 ** self.lo <= v * 1.0001 and v <= 10 ** self.hi * 1.0001:
                        out.append(v)
            return out
        span = self.hi - self.lo
        step = 10 ** math.floor(math.log10(span / 4))
        for m in (1, 2, 5, 10):
            if span / (m * step) <= 6:
                step *= m
                break
        first = math.ceil(self.lo / step) * step
        return [first + i * step for i in range(int((self.hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:g}" if abs(v) >= 0.01 or v == 0 else f"{v:.0e}"


def chart(title: str, xlabel: str, ylabel: str, series: list[dict], *, xlog: bool = False, ylog: bool = False,
          diagonal: bool = False, band: float = 0.0) -> str:
    """An SVG chart. Each series: ``label``, ``points`` [(x, y)], ``style`` "line" or "dot", optional ``color``."""
    width, height, left, right, top, bottom = 720, 420, 70, 190, 40, 55
    xs = [x for s in series for x, _ in s["points"]]
    ys = [y for s in series for _, y in s["points"]]
    lo, hi = min(xs + (ys if diagonal else [])), max(xs + (ys if diagonal else []))
    if diagonal:
        xlo, xhi, ylo, yhi = lo / 1.15, hi * 1.15, lo / 1.15, hi * 1.15
    else:
        pad_x = 0 if xlog else (max(xs) - min(xs)) * 0.03
        xlo, xhi = (min(xs) / 1.1, max(xs) * 1.1) if xlog else (min(xs) - pad_x, max(xs) + pad_x)
        ylo, yhi = (min(ys) / 1.2, max(ys) * 1.2) if ylog else (min(0.0, min(ys)), max(ys) * 1.08)
    X = Axis(xlo, xhi, xlog, left, width - right)
    Y = Axis(ylo, yhi, ylog, height - bottom, top)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" font-family="sans-serif" '
           f'font-size="12" role="img" aria-label="{html.escape(title)}">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="14" font-weight="bold">{html.escape(title)}</text>']
    for t in X.ticks():
        svg.append(f'<line x1="{X(t):.1f}" y1="{top}" x2="{X(t):.1f}" y2="{height - bottom}" stroke="#e5e5e5"/>')
        svg.append(f'<text x="{X(t):.1f}" y="{height - bottom + 16}" text-anchor="middle">{_fmt(t)}</text>')
    for t in Y.ticks():
        svg.append(f'<line x1="{left}" y1="{Y(t):.1f}" x2="{width - right}" y2="{Y(t):.1f}" stroke="#e5e5e5"/>')
        svg.append(f'<text x="{left - 6}" y="{Y(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    svg.append(f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" '
               'fill="none" stroke="#888"/>')
    svg.append(f'<text x="{(left + width - right) / 2}" y="{height - 14}" text-anchor="middle">{html.escape(xlabel)}</text>')
    svg.append(f'<text transform="translate(16 {(top + height - bottom) / 2}) rotate(-90)" '
               f'text-anchor="middle">{html.escape(ylabel)}</text>')
    if diagonal:
        a, b = max(xlo, ylo), min(xhi, yhi)
        if band:
            poly = [(a, a * (1 + band)), (b, b * (1 + band)), (b, b / (1 + band)), (a, a / (1 + band))]
            pts = " ".join(f"{X(px):.1f},{Y(min(max(py, ylo), yhi)):.1f}" for px, py in poly)
            svg.append(f'<polygon points="{pts}" fill="#f2f2f2" stroke="none"/>')
        svg.append(f'<line x1="{X(a):.1f}" y1="{Y(a):.1f}" x2="{X(b):.1f}" y2="{Y(b):.1f}" stroke="#444" '
                   'stroke-dasharray="4 3"/>')
    for i, s in enumerate(series):
        color = s.get("color", COLORS[i % len(COLORS)])
        pts = [(X(x), Y(y)) for x, y in s["points"]]
        if s.get("style", "line") == "line":
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py in pts)
            dash = ' stroke-dasharray="6 4"' if s.get("dashed") else ""
            svg.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        else:
            for px, py in pts:
                svg.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="{s.get("size", 4)}" fill="{color}" '
                           'fill-opacity="0.8"/>')
        ly = top + 8 + 20 * i
        lx = width - right + 12
        if s.get("style", "line") == "line":
            dash = ' stroke-dasharray="6 4"' if s.get("dashed") else ""
            svg.append(f'<line x1="{lx}" y1="{ly}" x2="{lx + 18}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>')
        else:
            svg.append(f'<circle cx="{lx + 9}" cy="{ly}" r="4" fill="{color}"/>')
        svg.append(f'<text x="{lx + 24}" y="{ly + 4}">{html.escape(s["label"])}</text>')
    if diagonal:
        ly = top + 8 + 20 * len(series)
        lx = width - right + 12
        svg.append(f'<line x1="{lx}" y1="{ly}" x2="{lx + 18}" y2="{ly}" stroke="#444" stroke-dasharray="4 3"/>')
        svg.append(f'<text x="{lx + 24}" y="{ly + 4}">predicted = measured</text>')
        if band:
            svg.append(f'<rect x="{lx}" y="{ly + 12}" width="18" height="10" fill="#f2f2f2" stroke="#ccc"/>')
            svg.append(f'<text x="{lx + 24}" y="{ly + 21}">within {band:.0%}</text>')
    svg.append("</svg>")
    return "\n".join(svg) + "\n"


def _losses(path: Path) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    seen: dict[int, float] = {}
    for row in rows:
        if "loss" in row:
            seen[row["current_steps"]] = row["loss"]
    return sorted(seen.items())


def figure_loss_gpu_host() -> str:
    base = BENCH / "gpu-host-checks"
    return chart("KT 0.7 LoRA SFT on the GPU host, tiny models (2026-11-25)", "optimizer step", "training loss (log)",
                 [{"label": "BF16 (AMXBF16)", "points": _losses(base / "run-bf16/trainer_log.jsonl")},
                  {"label": "Kimi INT4 (RAWINT4)", "points": _losses(base / "run-rawint4/trainer_log.jsonl"),
                   "dashed": True}], ylog=True)


def figure_loss_bigger_than_gpu() -> str:
    base = BENCH / "bigger-than-gpu"
    return chart("57B Kimi-format MoE on one H100: killed and resumed", "optimizer step", "training loss",
                 [{"label": "uninterrupted", "points": _losses(base / "run-sft/trainer_log.jsonl")},
                  {"label": "killed (kill -9)", "points": _losses(base / "kill-trainer_log.jsonl"), "style": "dot",
                   "size": 7},
                  {"label": "resumed", "points": _losses(base / "run-resume/trainer_log.jsonl"), "style": "dot"}])


def figure_kt_step_vs_tokens() -> str:
    fit = json.loads((BENCH / "kt-throughput/fit.json").read_text())
    runs = [r for r in fit["runs"] if r["model"] == 1 and r["threads"] == 16 and r["micro_batches"] == 1]
    runs.sort(key=lambda r: r["tokens_per_micro_batch"])
    measured = [(r["tokens_per_micro_batch"], r["step_s"][1]) for r in runs]
    predicted = [(r["tokens_per_micro_batch"], r["step_s"][0]) for r in runs]
    return chart("KT step time against tokens per micro-batch (57B fixture, 16 threads)",
                 "tokens per micro-batch (log)", "steady step, s",
                 [{"label": "measured", "points": measured, "style": "dot", "size": 5},
                  {"label": "the fitted model", "points": predicted, "dashed": True}], xlog=True)


def figure_plan_vs_measured() -> str:
    fit = json.loads((BENCH / "kt-throughput/fit.json").read_text())
    oos = json.loads((BENCH / "kt-throughput/out-of-sample-check.json").read_text())
    fitted = [(r["step_s"][1], r["step_s"][0]) for r in fit["runs"] if r["set"] == "fit" and r["step_s"][1]]
    held = [(r["step_s"][1], r["step_s"][0]) for r in fit["runs"] if r["set"] != "fit" and r["step_s"][1]]
    planner, calibrated = [], []
    for machine in oos["machines"]:
        for r in machine["runs"]:
            planner.append((r["step_s"], r["planner_step_s"]))
            if r.get("calibrated_step_s"):
                calibrated.append((r["step_s"], r["calibrated_step_s"]))
    return chart("KT step time: predicted against measured", "measured step, s (log)", "predicted step, s (log)",
                 [{"label": "fit's runs", "points": fitted, "style": "dot"},
                  {"label": "held out", "points": held, "style": "dot"},
                  {"label": "other machines", "points": planner, "style": "dot"},
                  {"label": "same, calibrated", "points": calibrated, "style": "dot"}],
                 xlog=True, ylog=True, diagonal=True, band=0.2)


FIGURE_MAKERS: dict[str, tuple[Callable[[], str], str]] = {
    "loss-gpu-host": (figure_loss_gpu_host, "Training loss per step of the BF16 and RAWINT4 checks"),
    "loss-bigger-than-gpu": (figure_loss_bigger_than_gpu,
                             "Loss per step of the 57B run, uninterrupted and killed then resumed"),
    "kt-step-vs-tokens": (figure_kt_step_vs_tokens, "KT step time against tokens per micro-batch, measured and fitted"),
    "plan-vs-measured": (figure_plan_vs_measured, "Predicted against measured KT step time on five machines"),
}


# --------------------------------------------------------------------------------------------------
# The MkDocs hooks
# --------------------------------------------------------------------------------------------------

GENERATORS: dict[str, Callable[[], str]] = {
    "recipe-reference": recipe_reference,
    "cli-reference": cli_reference,
    "stage-example": stage_example,
}


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for name, (make, _alt) in FIGURE_MAKERS.items():
        files.append(File.generated(config, f"{FIGURES}/{name}.svg", content=make()))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    depth = page.file.src_uri.count("/")

    def replace(match: re.Match[str]) -> str:
        kind, arg = match.group(1), match.group(2)
        if kind == "figure":
            if arg not in FIGURE_MAKERS:
                raise ValueError(f"{page.file.src_uri}: no figure named {arg!r} (docs/gen_reference.py)")
            return f"![{FIGURE_MAKERS[arg][1]}]({'../' * depth}{FIGURES}/{arg}.svg)"
        if kind not in GENERATORS:
            raise ValueError(f"{page.file.src_uri}: unknown marker ktflow:{kind} (docs/gen_reference.py)")
        return GENERATORS[kind]()

    return _repository_links(_MARKER.sub(replace, markdown), page.file.src_uri, config)


# A link that leaves docs/ for a file of the repository (``[data](../../benchmarks/data/x/README.md)``) works on
# GitHub but not in the built site, which holds no raw data: it becomes a link to the repository's copy where
# mkdocs.yml names a ``repo_url``, else the repository path in code. A path that does not exist fails the build.
_LINK = re.compile(r"\[([^\]]+)\]\(((?:\.\./)+[^)#\s]+)(#[^)\s]*)?\)")


def _repository_links(markdown: str, src_uri: str, config: Any) -> str:
    def replace(match: re.Match[str]) -> str:
        text, target, anchor = match.group(1), match.group(2), match.group(3) or ""
        resolved = (DOCS / src_uri).parent.joinpath(target).resolve()
        if resolved.is_relative_to(DOCS.resolve()):
            return match.group(0)  # a page of the site: mkdocs checks it
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            raise ValueError(f"{src_uri}: link to {target!r}, which is not a file of the repository")
        path = resolved.relative_to(ROOT).as_posix()
        repo_url = (config.get("repo_url") or "").rstrip("/")
        if repo_url:
            kind = "tree" if resolved.is_dir() else "blob"
            return f"[{text}]({repo_url}/{kind}/HEAD/{path}{anchor})"
        return f"{text} (`{path}` in the repository)"

    return _LINK.sub(replace, markdown)
