"""A host's own KT speed (ktflow.planning.host_speed): what a finished KT run records, and how the next plan
on the same host is scaled by it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ktflow.planning.costs import kt_step_estimate
from ktflow.planning.host_speed import (
    UNCALIBRATED,
    KtStepRecord,
    calibrated_costs,
    elapsed_seconds,
    host_records,
    kt_step_record,
    model_digest,
    pick_calibration,
    steady_step,
)
from ktflow.recipe import Recipe, load_recipe
from ktflow.store import MANIFEST_NAME, StageManifest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kt_step_model  # noqa: E402
from test_costs import _h100, _plan_sft  # noqa: E402

BIG = REPO / "gpu_host/big-kt-rawint4.yaml"


def _big(store: Path, *sets: str) -> Recipe:
    return load_recipe(BIG, [f"store.root={store}", "sft.kt_config.kt_model_max_length=4096", *sets])


def _log(steps: int, *, seconds_a_step: int, load_s: int = 90, tokens_a_step: int | None = 4096) -> list[dict]:
    """trainer_log.jsonl records as LlamaFactory writes them: elapsed time in whole seconds."""
    records = []
    for step in range(1, steps + 1):
        elapsed = load_s + step * seconds_a_step
        record = {"current_steps": step, "total_steps": steps, "loss": 1.0,
                  "elapsed_time": f"{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}"}
        if tokens_a_step is not None:
            record["total_tokens"] = step * tokens_a_step
        records.append(record)
    return records


def test_llamafactorys_elapsed_time_is_read() -> None:
    assert elapsed_seconds("0:01:23") == 83.0
    assert elapsed_seconds("2 days, 1:00:00") == 2 * 86400 + 3600.0
    assert elapsed_seconds(None) is None and elapsed_seconds("soon") is None


def test_the_steady_step_leaves_out_the_load_and_only_counts_the_last_attempt() -> None:
    log = _log(10, seconds_a_step=12)
    step_s, steps, tokens = steady_step(log)
    assert (step_s, steps, tokens) == (12.0, 9, 4096.0)  # the load (90 s) is in the first record only
    # LlamaFactory closes the log with the last step repeated (no loss): it changes nothing
    closing = {k: v for k, v in log[-1].items() if k != "loss"}
    assert steady_step([*log, closing]) == (12.0, 9, 4096.0)
    # resumed at step 6: elapsed restarts, the steps go on; the first attempt (another speed) is not counted
    resumed = _log(5, seconds_a_step=30) + [dict(r, current_steps=r["current_steps"] + 5)
                                            for r in _log(5, seconds_a_step=12, load_s=40)]
    assert steady_step(resumed)[:2] == (12.0, 4)
    # restarted from scratch into the same log (no checkpoint): the steps go back, elapsed need not
    restarted = _log(3, seconds_a_step=10, load_s=0) + _log(8, seconds_a_step=60, load_s=-20)
    assert steady_step(restarted)[:2] == (60.0, 7)
    # too short to trust (whole seconds): no measurement, so no record
    assert steady_step(_log(2, seconds_a_step=12)) is None
    assert steady_step(_log(3, seconds_a_step=5)) is None
    assert steady_step(_log(10, seconds_a_step=12, tokens_a_step=None))[2] is None


def test_a_kt_run_records_its_step_against_the_shipped_prediction(tmp_path: Path) -> None:
    size = kt_step_model.model_sizes()[1]
    sft = _big(tmp_path, "sft.per_device_train_batch_size=4", "sft.gradient_accumulation_steps=2").sft
    record = kt_step_record(sft, "node-a", 16, size, _log(10, seconds_a_step=30, tokens_a_step=2 * 4 * 256))
    assert record is not None
    assert (record.host, record.expert_format, record.threads, record.pools) == ("node-a", "rawint4", 16, 1)
    assert record.tokens_per_micro_batch == 1024  # the trainer's tokens a step / micro-batches
    assert record.predicted_step_s == pytest.approx(kt_step_estimate(size, sft, 16, tokens_per_micro_batch=1024).step_s,
                                                    abs=1e-3)
    assert record.ratio == pytest.approx(30.0 / record.predicted_step_s)
    assert record.expert_bytes == size.expert_stored_bytes and record.model == model_digest()
    # without the trainer's token count the prediction would be at the cutoff_len bound: no record
    assert kt_step_record(sft, "node-a", 16, size, _log(10, seconds_a_step=30, tokens_a_step=None)) is None


def _record(ratio: float, tokens: float, **kw) -> KtStepRecord:
    return KtStepRecord(**{"host": "node-a", "expert_format": "rawint4", "threads": 16, "pools": 1,
                           "measured_step_s": 10 * ratio, "predicted_step_s": 10.0, "steps": 9,
                           "tokens_per_micro_batch": tokens, "model": model_digest(), **kw})


def test_the_calibration_is_the_median_of_the_runs_nearest_in_tokens() -> None:
    runs = [("2026-01-01", "old-near", _record(0.70, 3000)), ("2026-01-02", "far", _record(1.00, 300)),
            ("2026-01-03", "near", _record(0.74, 3500)), ("2026-01-04", "mid", _record(0.80, 1500)),
            ("2026-01-05", "newest-far", _record(1.10, 250))]
    speed = pick_calibration(runs, 3072)
    assert speed.runs == ["old-near", "near", "mid"] and speed.factor == 0.74
    assert "old-near 0.70" in speed.basis
    assert pick_calibration(runs, 300).runs == ["far", "newest-far", "mid"]
    # equally near: the newest first
    assert pick_calibration([("2026-01-01", "older", _record(0.5, 1000)), ("2026-01-02", "newer", _record(0.9, 1000))],
                            1000, nearest=1).runs == ["newer"]
    # nearer in expert bytes as well as tokens: a small model's runs do not speak for a large one first
    sized = [("2026-01-01", "small-model", _record(0.5, 1000, expert_bytes=7 << 30)),
             ("2026-01-02", "this-model", _record(0.9, 1200, expert_bytes=500 << 30))]
    assert pick_calibration(sized, 1000, 500 << 30, nearest=1).runs == ["this-model"]
    assert pick_calibration([], 1000) is None


def _publish(store: Path, name: str, record: KtStepRecord | None, stage: str = "sft", created: str = "2026-01-01") -> None:
    adapter = store / "runs" / name / "adapter"
    adapter.mkdir(parents=True)
    manifest = StageManifest(stage=stage, created_at=created,
                             extra={"kt_step": record.model_dump(mode="json") if record else None})
    (adapter / MANIFEST_NAME).write_text(manifest.model_dump_json())


def test_only_runs_of_this_host_and_these_kt_settings_count(tmp_path: Path) -> None:
    recipe = _big(tmp_path)
    _publish(tmp_path, "a", _record(0.75, 1024))
    _publish(tmp_path, "other-host", _record(2.0, 1024, host="node-b"))
    _publish(tmp_path, "eight-threads", _record(2.0, 1024, threads=8))
    _publish(tmp_path, "bf16", _record(2.0, 1024, expert_format="bf16"))
    _publish(tmp_path, "two-pools", _record(2.0, 1024, pools=2))
    _publish(tmp_path, "plain-sft", None)
    _publish(tmp_path, "not-sft", _record(2.0, 1024), stage="convert-lora")
    _publish(tmp_path, "older-fit", _record(2.0, 1024, model="0123456789abcdef"))  # constants since refitted
    (tmp_path / "runs/half-written/adapter").mkdir(parents=True)
    (tmp_path / "runs/half-written/adapter" / MANIFEST_NAME).write_text("{not json")
    speed = pick_calibration(host_records(recipe, "node-a", 16), 1024)
    assert speed is not None and speed.runs == ["a"] and speed.factor == 0.75
    assert host_records(recipe, "node-c", 16) == []


def test_two_machines_sharing_a_hostname_do_not_calibrate_each_other(tmp_path: Path) -> None:
    """Every GPU host lent so far, and the CI box, are named "vm": the hostname alone would pool a 16-core
    H100 host's runs with a 32-core H200 host's at the same thread count."""
    recipe = _big(tmp_path)
    h100 = _h100().model_copy(update={"hostname": "vm"})
    h200 = h100.model_copy(update={"physical_cores": 32, "logical_cores": 64})
    assert h100.machine != h200.machine and "16 cores" in h100.machine
    # the same machine planned as if it had more RAM (kimi_slice.py whole) is still calibrated by its runs
    assert h100.model_copy(update={"ram_bytes": 2 << 40}).machine == h100.machine
    _publish(tmp_path, "on-h100", _record(0.60, 1024, host="vm", machine=h100.machine))
    _publish(tmp_path, "on-h200", _record(1.20, 1024, host="vm", machine=h200.machine), created="2026-01-02")
    _publish(tmp_path, "before-machines", _record(0.90, 1024, host="vm"), created="2026-01-03")  # no machine: kept
    assert {name for _, name, _ in host_records(recipe, "vm", 16, h100.machine)} == {"on-h100", "before-machines"}
    assert sorted(pick_calibration(host_records(recipe, "vm", 16, h200.machine), 1024).ratios) == [0.9, 1.2]
    # the record a run writes carries its machine
    size = kt_step_model.model_sizes()[1]
    record = kt_step_record(_big(tmp_path).sft, "vm", 16, size, _log(10, seconds_a_step=30, tokens_a_step=4096),
                            h200.machine)
    assert record is not None and record.machine == h200.machine


def test_the_plan_on_a_host_that_ran_kt_is_scaled_by_what_it_measured(tmp_path: Path) -> None:
    host = _h100().model_copy(update={"hostname": "node-a"})
    recipe = _big(tmp_path, "sft.per_device_train_batch_size=4", "sft.gradient_accumulation_steps=1",
                  "sft.cutoff_len=256", "sft.kt_config.kt_num_threads=16")
    size = kt_step_model.model_sizes()[1]
    before = _plan_sft(recipe, host, size=size)
    assert UNCALIBRATED in before.time_basis
    _publish(tmp_path, "big-kt-rawint4-earlier", _record(0.74, 1024))
    after = _plan_sft(recipe, host, size=size)
    assert after.step_seconds == pytest.approx(0.74 * before.step_seconds, rel=1e-6)
    assert "x0.74 for this host" in after.time_basis and UNCALIBRATED not in after.time_basis
    # another host's plan of the same recipe and store is not scaled by node-a's runs
    assert _plan_sft(recipe, _h100(), size=size).step_seconds == pytest.approx(before.step_seconds)
    costs, speed = calibrated_costs(recipe, "node-a", 16, 1024)
    assert speed is not None and costs.kt_host_factor == 0.74
    # set, not compounded: calibrating calibrated costs again changes nothing
    assert calibrated_costs(recipe, "node-a", 16, 1024, costs=costs)[0].kt_host_factor == 0.74
    assert json.loads(speed.model_dump_json())["runs"] == ["big-kt-rawint4-earlier"]


def test_the_device_runs_were_planned_by_this_rule_from_the_runs_before_them() -> None:
    """benchmarks/data/kt-throughput/calibration-h200c: three ``ktflow sft`` runs in one store on the H200
    host; each later plan is the shipped prediction scaled by what the earlier runs recorded."""
    runs = json.loads((REPO / "benchmarks/data/kt-throughput/calibration-h200c/calibrate.json").read_text())["runs"]
    assert [r["rc"] for r in runs] == [0, 0, 0] and all(r["kt_step"] for r in runs)
    assert UNCALIBRATED in runs[0]["plan_basis"]
    for i, run in enumerate(runs):
        record = KtStepRecord.model_validate(run["kt_step"])
        earlier = [(str(j), r["name"], KtStepRecord.model_validate(r["kt_step"])) for j, r in enumerate(runs[:i])]
        speed = pick_calibration(earlier, record.tokens_per_micro_batch)  # one model: expert bytes equal
        expected = record.predicted_step_s * (speed.factor if speed else 1.0)
        assert run["planned_step_s"] == pytest.approx(expected, rel=2e-3)
        if speed:
            assert f"x{speed.factor:.2f} for this host" in run["plan_basis"]
            # calibrated, the plan is within 10 % of the step the run then measured (uncalibrated: +46 %)
            assert abs(run["planned_step_s"] / record.measured_step_s - 1) < 0.10
