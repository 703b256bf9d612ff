"""benchmarks/kt_vs_hf.py: its recipes, its data, and its measuring harness run for real on
the CPU (plain LlamaFactory against ``ktflow sft`` on the same recipe). The KT legs need the GPU
host; what they measured there is in benchmarks/data/kt-vs-hf/ and README."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks" / "kt_vs_hf.py"
TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"
sys.path.insert(0, str(REPO / "benchmarks"))


def test_hf_recipe_is_the_kt_recipe_without_the_kt_fields() -> None:
    """Leg a and legs b/c must train the same thing; only the backend may differ."""
    kt = yaml.safe_load((REPO / "benchmarks/recipes/v2-lite-kt.yaml").read_text())
    hf = yaml.safe_load((REPO / "benchmarks/recipes/v2-lite-hf.yaml").read_text())
    assert kt["sft"].pop("backend") == "kt" and hf["sft"].pop("backend") == "hf"
    kt_only = {k for k in kt["sft"] if k.startswith("kt_")}
    assert kt_only == {"kt_config"}
    for key in kt_only:
        kt["sft"].pop(key)
    kt.pop("description"), hf.pop("description")
    assert kt == hf


def test_dialogues_are_openai_records_a_few_hundred_tokens_long(tmp_path: Path) -> None:
    from kt_vs_hf import write_dialogues

    path = tmp_path / "train.jsonl"
    write_dialogues(path, 64)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 64
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in records)
    assert all(r["messages"][1]["content"].endswith("nya~") for r in records)
    words = [len(r["messages"][0]["content"].split()) + len(r["messages"][1]["content"].split()) for r in records]
    assert 40 <= min(words) and max(words) <= 200  # ~250-670 tokens under the fixture tokenizer
    again = tmp_path / "again.jsonl"
    write_dialogues(again, 64)
    assert again.read_bytes() == path.read_bytes()


@pytest.mark.slow
@pytest.mark.skipif(not TRAIN_PYTHON.exists(), reason="training toolchain not installed (make train-env)")
def test_harness_measures_plain_llamafactory_and_ktflow_sft_on_the_same_recipe(tmp_path: Path) -> None:
    """prepare -> legs hf and ktflow-hf (real LlamaFactory, 4 steps each) -> report, at tiny size."""
    common = ["--size", "tiny", "--workdir", str(tmp_path), "--python", str(TRAIN_PYTHON), "--gpus", "0"]

    def bench(*argv: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, str(BENCH), *argv, *common], capture_output=True, text=True, cwd=REPO)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done

    bench("prepare")
    prep = json.loads((tmp_path / "tiny-v3/results/prepare.json").read_text())
    assert 200 < prep["token_lengths"]["mean"] < 700
    bench("run", "hf", "ktflow-hf", "--steps", "4")
    bench("report", "--json", str(tmp_path / "report.json"))
    report = json.loads((tmp_path / "report.json").read_text())
    hf, kf = report["legs"]["hf"], report["legs"]["ktflow-hf"]
    for leg in (hf, kf):
        assert leg["steps"] == 4 and len(leg["losses"]) == 4
        assert leg["tokens_per_s_llamafactory"] > 0 and leg["tokens_per_s_steady"] > 0
        assert 0 < leg["load_s"] < leg["wall_s"] and leg["steady_step_s"] > 0
        assert leg["peak_host_rss_gib"] > 0.1
    # the same records, in the same order, with the same seed: the same tokens and losses
    assert hf["total_tokens"] == kf["total_tokens"] > 4 * 8 * 200
    assert kf["losses"] == pytest.approx(hf["losses"], rel=1e-3)
    assert 0 < kf["prelaunch_s"] < kf["wall_s"] and kf["post_s"] >= 0
    assert hf["command"][-1].endswith("train.yaml")  # the rendered plan, run by hand
    trained = yaml.safe_load(Path(hf["command"][-1]).read_text())
    assert (trained["lora_rank"], trained["lora_target"]) == (8, "q_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj")


def test_a_leg_follows_its_own_trainer_log_in_a_store_another_run_trained_into(tmp_path: Path) -> None:
    """A store several models train into (the Kimi-K2.5 slice's depths) holds their finished trainer logs; until this
    leg's trainer writes its own, the newest log is another run's. The leg is measured from its own run's lines."""
    from kt_vs_hf import _trainer_log_under, measure

    store = tmp_path / "store"
    finished = store / "runs" / "depth-6" / "output" / "trainer_log.jsonl"
    finished.parent.mkdir(parents=True)
    finished.write_text("".join(json.dumps({"current_steps": s, "loss": 13.0, "total_tokens": 100 * s}) + "\n"
                                for s in range(1, 6)))
    earlier = frozenset(store.glob("runs/*"))
    trainer = tmp_path / "trainer.py"
    trainer.write_text(
        "import json, pathlib, sys, time\n"
        "log = pathlib.Path(sys.argv[1]) / 'runs' / 'depth-12' / 'output' / 'trainer_log.jsonl'\n"
        "time.sleep(0.6)\n"
        "log.parent.mkdir(parents=True)\n"
        "for step in range(1, 5):\n"
        "    with open(log, 'a') as fh:\n"
        "        fh.write(json.dumps({'current_steps': step, 'loss': 12.0 - step, 'total_tokens': 50 * step}) + '\\n')\n"
        "    time.sleep(0.4)\n")
    result = measure([sys.executable, str(trainer), str(store)], env={}, log=tmp_path / "leg.log", warmup=1,
                     trainer_log=lambda: _trainer_log_under(store, earlier))

    assert result["steps_logged"] == [1, 2, 3, 4]
    assert result["losses"] == [11.0, 10.0, 9.0, 8.0]
    assert result["first_step_logged_s"] >= 0.5  # the trainer's first line, not the finished run's
    assert 0.3 <= result["steady_step_s"] <= 1.0
    assert _trainer_log_under(store) == finished.parent.parent.parent / "depth-12" / "output" / "trainer_log.jsonl"
