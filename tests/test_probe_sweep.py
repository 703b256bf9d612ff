"""gpu_host/probe_sweep.py: the KT probe's settings swept on a host. Its points are the product's probe with one
setting changed, and a cut sweep goes on where it stopped. The probe itself runs for real in test_host_probe.py;
here run_probe is replaced by a recorder, since what is checked is the sweep's own bookkeeping."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "gpu_host"))

import probe_sweep  # noqa: E402

from ktflow.planning.host_probe import KtProbe, KtProbeSettings, probe_settings  # noqa: E402
from ktflow.recipe import load_recipe  # noqa: E402


def test_the_as_shipped_point_is_the_probe_ktflow_plan_runs_for_the_slice() -> None:
    sft = load_recipe(probe_sweep.RECIPE).sft
    shipped = probe_settings(sft, probe_sweep.kimi_slice_size(6), 64)
    point = probe_sweep.point_settings(sft, 64, None, None)
    assert point == shipped
    assert (point.experts, point.tokens, point.top_k) == (22, 29, 8)  # Kimi-K2.5's 384 experts, cutoff 512


def test_each_point_changes_only_the_experts_and_the_tokens_keeping_the_tokens_an_expert() -> None:
    sft = load_recipe(probe_sweep.RECIPE).sft
    shipped = probe_sweep.point_settings(sft, 16, None, None)
    every = probe_sweep.point_settings(sft, 16, 384, probe_sweep.SHAPED_TOKENS)
    assert (every.experts, every.tokens) == (384, 3623)  # the whole layer, the shaper's micro-batch
    bound = probe_sweep.point_settings(sft, 16, 128, None)
    assert (bound.experts, bound.tokens) == (128, round(512 * 128 / 384))
    for point in (every, bound):
        assert point.model_dump(exclude={"experts", "tokens"}) == shipped.model_dump(exclude={"experts", "tokens"})


def test_a_cut_sweep_goes_on_where_it_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[KtProbeSettings] = []

    def fake_probe(settings: KtProbeSettings, machine: str, python: Path, **_: object) -> KtProbe:
        ran.append(settings)
        return KtProbe(machine=machine, settings=settings, status="measured", forward_s=0.01 * settings.experts,
                       backward_s=0.02 * settings.experts, pairs=3, weight_bytes=1)

    monkeypatch.setattr(probe_sweep, "run_probe", fake_probe)
    out = tmp_path / "sweep.json"
    probe_sweep.sweep(["as-shipped"], 4, out, Path(sys.executable), "test machine")
    assert len(ran) == 3  # its repeats
    records = probe_sweep.sweep(["as-shipped", "128-experts-bound"], 4, out, Path(sys.executable),
                              "test machine")
    assert len(ran) == 5  # only the new point's two
    assert [r["point"] for r in records] == ["as-shipped"] * 3 + ["128-experts-bound"] * 2
    assert json.loads(out.read_text()) == records
    for record in records:
        assert record["machine"] == "test machine"
        settings = KtProbeSettings.model_validate(record["settings"])
        assert record["ratio"] == pytest.approx(0.03 * settings.experts / record["model_s"])
        assert record["model_s"] > 0


def test_a_probe_that_cannot_run_stops_the_sweep_and_records_nothing(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    with pytest.raises(SystemExit, match="could not run in /nonexistent/python"):
        probe_sweep.sweep(["as-shipped"], 2, out, Path("/nonexistent/python"), "test machine")
    assert not out.exists()
