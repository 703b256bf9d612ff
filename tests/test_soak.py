"""Soak: the real CPU serving backend (LlamaFactory's API, tiny fixture, tiny adapter) under 200
requests, 8 in flight, through the ``openai`` client: no error, bounded server memory, and
nothing left running afterwards, whatever happened. The figures are printed; the benchmark with
the same defaults is ``.venv/bin/python benchmarks/soak.py`` (see its docstring).

200 x 8 takes ~10 s of requests on the 2-core CI box (plus ~30 s to build the fixture and train
a 2-step adapter, ~15 s to start the server), so the CI test runs the full 200.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"
sys.path.insert(0, str(REPO / "benchmarks"))
import soak  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not TRAIN_PYTHON.exists(), reason="training toolchain not installed (make train-env)"),
]
MAX_GROWTH_MB, MAX_GROWTH_PCT = 200.0, 25.0


def test_200_requests_8_in_flight_no_error_bounded_memory_nothing_left(tmp_path: Path, capsys) -> None:
    # What this process ran before the soak (another test's session-scoped servers, in the same
    # pytest-xdist worker) is not the soak's to stop.
    already = {c.pid for c in psutil.Process().children(recursive=True)}
    result = soak.run_soak(tmp_path / "soak", n=200, concurrency=8, max_tokens=8, warmup=16,
                           max_growth_mb=MAX_GROWTH_MB, max_growth_pct=MAX_GROWTH_PCT, log=lambda s: None)
    with capsys.disabled():
        soak.print_report(result)
    (tmp_path / "soak.json").write_text(json.dumps(result, indent=2))

    assert result["errors"] == 0 and result["warmup_errors"] == 0, result["error_samples"]
    assert result["ok"] == 200
    assert result["rss_samples"] >= 5, "the sampler saw too little of the run to judge memory"
    assert result["rss_growth_mb"] <= MAX_GROWTH_MB and result["rss_growth_pct"] <= MAX_GROWTH_PCT, (
        f"server RSS grew {result['rss_growth_mb']:.1f} MB ({result['rss_growth_pct']:.1f}%) after the warm-up")
    assert result["p50_ms"] <= result["p95_ms"] <= result["max_ms"] and result["requests_per_s"] > 0
    # Nothing left: no process carrying the server's run marker, the port closed (the benchmark's
    # check), and no child of this process that was not there before the soak.
    assert result["leftovers"] == {"server_alive": False, "marked": [], "children": [], "port_open": False}
    assert [c for c in psutil.Process().children(recursive=True)
            if c.pid not in already and c.status() != psutil.STATUS_ZOMBIE] == []
    assert result["passed"], result["why"]
