"""The run report's markdown (ktflow.run_report): images a browser can load, the stage table."""

from __future__ import annotations

import base64
import struct
import zlib
from pathlib import Path

from ktflow.run_report import REPORT_COLUMNS, image_markdown, png_data_url, render_run_report, stage_rows


def tiny_png(path: Path) -> bytes:
    """A valid 2x2 grey PNG, written by hand (no imaging library needed)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + b"\x80\x80" for _ in range(2))
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 2, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    path.write_bytes(data)
    return data


def test_a_png_becomes_a_data_url_and_anything_else_does_not(tmp_path: Path) -> None:
    data = tiny_png(tmp_path / "loss.png")
    url = png_data_url(tmp_path / "loss.png")
    assert url is not None and url.startswith("data:image/png;base64,")
    assert base64.b64decode(url.split(",", 1)[1]) == data
    (tmp_path / "fake.png").write_text("not a png")
    assert png_data_url(tmp_path / "fake.png") is None
    assert png_data_url(tmp_path / "missing.png") is None
    assert png_data_url(tmp_path / "loss.png", max_bytes=10) is None


def test_the_image_markdown_embeds_the_png_or_names_the_file_never_a_file_url(tmp_path: Path) -> None:
    tiny_png(tmp_path / "loss.png")
    embedded = image_markdown(tmp_path / "loss.png", "Training loss", "training loss", "6 steps")
    assert "![training loss](data:image/png;base64," in embedded and "6 steps" in embedded
    too_big = image_markdown(tmp_path / "loss.png", "Training loss", "training loss", max_bytes=10)
    assert "not embedded" in too_big and str(tmp_path / "loss.png") in too_big
    assert "file://" not in embedded + too_big and "](" not in too_big
    # The training host's file is not here (two hosts): the curve read there is embedded instead.
    url = png_data_url(tmp_path / "loss.png")
    elsewhere = image_markdown(tmp_path / "gone/loss.png", "Training loss", "training loss", data_url=url)
    assert f"![training loss]({url})" in elsewhere
    for bad in (None, "data:text/html;base64,PHNjcmlwdD4=", "https://example.com/x.png"):
        assert "not embedded" in image_markdown(tmp_path / "gone/loss.png", "T", "t", data_url=bad)


def test_the_stage_table_says_what_ran_what_was_skipped_and_why_what_was_cached_and_where() -> None:
    rows = [{"stage": "download", "runs": "skipped", "why": "local source /m", "result": "/m"},
            {"stage": "dequantize", "runs": "yes", "why": "int4 -> BF16", "result": "/s/bf16 (cached)"},
            {"stage": "sft", "runs": "yes", "why": "LoRA | hf", "result": "/s/runs/a (6 steps)"}]
    where = {"sft": {"host": "gpu1", "pool": "amx-train", "worker": "gpu1-amx-train"}}
    table = stage_rows(rows, where)
    assert [r["outcome"] for r in table] == ["skipped", "cache hit", "ran"]
    assert table[2]["host"] == "gpu1" and table[0]["host"] is None
    md = render_run_report("demo", rows, where,
                           evaluation_table="| metric | base | tuned |\n|---|---|---|\n| bleu-4 | 1.00 | 9.00 |",
                           evaluation_verdict="adapter applied: **True**", endpoint_url="http://h:1/v1",
                           endpoint_models="models: demo")
    lines = md.splitlines()
    header = lines.index("| " + " | ".join(REPORT_COLUMNS) + " |")
    body = lines[header + 2:header + 5]
    assert [line.split(" | ")[0].lstrip("| ") for line in body] == ["download", "dequantize", "sft"]
    assert all(line.count(" | ") == len(REPORT_COLUMNS) - 1 for line in body)  # a '|' in a cell is escaped
    assert "LoRA \\| hf" in md
    for section in ("### Stages", "### Evaluation: base vs tuned", "| bleu-4 | 1.00 | 9.00 |", "### Endpoint",
                    "`http://h:1/v1`"):
        assert section in md
    assert "### Training loss" not in md  # no curve given, no empty section
