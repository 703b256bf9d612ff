"""`ktflow run`: the whole pipeline as one Prefect flow on the embedded (ephemeral) API."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (REPO / ".venv-train").exists() or not (REPO / ".venv-serve").exists(),
                       reason="toolchains not installed (make test installs them)"),
]


def ktflow_run(cwd: Path, recipe: str | Path, *extra: str, home: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PREFECT_HOME": str((home or cwd) / ".prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "KTFLOW_API_KEY": API_KEY, "HF_TOKEN": HF_TOKEN, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "ktflow.cli", "run", str(recipe), *extra],
                          cwd=cwd, capture_output=True, text=True, env=env, timeout=900)


def run(cwd: Path, *extra: str) -> tuple[dict, float]:
    started = time.monotonic()
    done = ktflow_run(cwd, "recipes/tiny-demo.yaml", "--json", *extra)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout), time.monotonic() - started


def results(outcome: dict) -> dict[str, str]:
    return {row["stage"]: row["result"] for row in outcome["stages"]}


def test_demo_runs_every_stage_then_caches_then_reruns_only_what_the_data_touches(tmp_path: Path,
                                                                                  int8_kernels: bool) -> None:
    shutil.copytree(REPO / "recipes", tmp_path / "recipes")
    assert "port: auto" in (tmp_path / "recipes/tiny-demo.yaml").read_text()  # the demo takes a free port
    for env in (".venv-train", ".venv-serve"):
        (tmp_path / env).symlink_to(REPO / env)
    stop = [sys.executable, "-m", "ktflow.cli", "serve", "recipes/tiny-demo.yaml", "--stop"]
    try:
        # `make demo`: makes the fixture and data, runs the pipeline flow on the embedded API.
        started = time.monotonic()
        demo = demo_run(tmp_path)
        print(f"first demo run: {time.monotonic() - started:.1f} s")
        assert re.search(r"demo pipeline \(tiny-demo\): Completed", demo.stdout), demo.stdout
        for stage, ran in (("dequantize", "tensors)"), ("sft", "steps)")):
            assert re.search(rf"{stage}\s.*{re.escape(ran)}", demo.stdout), (stage, demo.stdout)
        if int8_kernels:
            assert re.search(r"quantize-int8\s+│ yes .*\(T=2\)", demo.stdout), demo.stdout
        else:  # skipped with what it needs, what this CPU has, and where it runs instead
            assert re.search(r"quantize-int8\s+│ skipped .*skipped on this host: quantize-int8 needs a avx512_base",
                             demo.stdout), demo.stdout
        assert "(cached)" not in demo.stdout
        assert "Traceback" not in demo.stderr, demo.stderr[-3000:]
        assert_honest_evaluation(tmp_path, demo.stdout)
        pid = endpoint_pid(tmp_path)
        port = json.loads((tmp_path / ".ktflow/store/serving/tiny-demo/endpoint.json").read_text())["port"]
        assert f"endpoint http://127.0.0.1:{port}/v1" in demo.stdout  # it says which port it took
        assert_no_secret_anywhere(tmp_path)

        started = time.monotonic()
        again = demo_run(tmp_path)  # everything is a cache hit; the server is not restarted
        print(f"cached demo rerun: {time.monotonic() - started:.1f} s")
        assert again.stdout.count("(cached)") >= 3, again.stdout  # dequantize, sft, and the summary says so
        assert endpoint_pid(tmp_path) == pid

        data = tmp_path / ".ktflow/demo/data/train.jsonl"
        lines = data.read_text().splitlines()
        lines[0] = lines[0].replace("nya~", "nya nya~")  # one record changes
        data.write_text("\n".join(lines) + "\n")
        third, _ = run(tmp_path)
        r3 = results(third)
        assert r3["dequantize"].endswith("(cached)")  # the data is downstream of the weights
        assert "steps" in r3["sft"] and not r3["sft"].endswith("(cached)")  # trained again
        [int8] = [row for row in third["stages"] if row["stage"] == "quantize-int8"]
        if int8_kernels:
            assert int8["runs"] == "yes" and int8["result"].endswith("(T=2) (cached)"), int8
        else:
            assert int8["runs"] == "skipped" and int8["result"] == "-", int8
            for says in ("needs a avx512_base CPU or better", "AVX512F + AVX512BW", "kt-kernel variant avx2",
                         "`ktflow worker --pool avx512-serve`"):
                assert says in int8["why"], (says, int8["why"])
        assert r3["evaluate"] == "adapter applied: True, promoted: True, train/eval overlap: 0/8"
        assert endpoint_pid(tmp_path) != pid  # the new adapter is served
        assert_no_secret_anywhere(tmp_path)

        # From any working directory: the recipe's project directory is where its paths point.
        elsewhere = tmp_path / "elsewhere" / "deeper"
        elsewhere.mkdir(parents=True)
        away = ktflow_run(elsewhere, tmp_path / "recipes/tiny-demo.yaml", "--json", home=tmp_path)
        assert away.returncode == 0, away.stderr[-3000:]
        assert results(json.loads(away.stdout))["sft"].endswith("(cached)")
        assert not any(elsewhere.iterdir())  # no state of its own where it was started

        # Expected errors end in one `error:` line, no traceback. A gate no model can meet fails
        # the run (exit 1) and does not promote it: by construction, not by what this CPU's
        # numerics make the random model say. A style every answer matches (/^/) scores 100 % for
        # the base as for the tuned model, so no gain is possible ...
        gated = ktflow_run(tmp_path, "recipes/tiny-demo.yaml", "--set", 'evaluation.style={pattern: "^"}',
                           "--set", "evaluation.gate_min_gain=1")
        assert gated.returncode == 1, gated.stderr[-3000:]
        assert "Traceback" not in gated.stderr + gated.stdout, gated.stderr[-3000:]
        [line] = [ln for ln in gated.stderr.splitlines() if ln.startswith("error:")]
        assert "style is 100.00 against the base's 100.00 (+0.00 points); the promotion gate asks for at least " \
               "+1.00" in gated.stderr, gated.stderr[-3000:]
        report = json.loads((tmp_path / ".ktflow/store/eval/tiny-demo/report.json").read_text())
        assert report["promoted"] is False and report["gate_enforced"] is True
        # ... and so does an evaluation set the model was trained on, before anything runs.
        contaminated = ktflow_run(tmp_path, "recipes/tiny-demo.yaml", "--set",
                                  f"evaluation.files=[{tmp_path / '.ktflow/demo/data/train.jsonl'}]")
        assert contaminated.returncode == 2, contaminated.stderr[-3000:]
        assert re.search(r"^error: evaluation.files: train/eval overlap: 48 of 48 eval prompts \(100.0 %\)",
                         contaminated.stderr, re.M), contaminated.stderr[-3000:]
        # ... and a host that lacks what a stage needs is bad input (exit 2), found before the stage runs.
        missing = ktflow_run(tmp_path, "recipes/tiny-demo.yaml", "--set", "toolchains.train.python=/nonexistent/python",
                             "--set", "sft.max_steps=401")
        assert missing.returncode == 2, missing.stderr[-3000:]
        assert "Traceback" not in missing.stderr + missing.stdout, missing.stderr[-3000:]
        assert re.search(r"^error: .*/nonexistent/python", missing.stderr, re.M), missing.stderr[-3000:]
    finally:
        subprocess.run(stop, cwd=tmp_path, capture_output=True)


# Secrets the demo runs with: the serving key (the recipe's serving.api_key_env) and an HF token.
API_KEY = "ktflow-test-key-" + os.urandom(12).hex()
HF_TOKEN = "hf_" + os.urandom(16).hex()


def assert_no_secret_anywhere(root: Path) -> None:
    """Neither secret in any file a run wrote (store, manifests, rendered configs, logs, eval
    reports, Prefect's database with its logs and artifacts) nor in any process's command line."""
    for path in root.rglob("*"):
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        for secret in (API_KEY, HF_TOKEN):
            assert secret.encode() not in data, f"{secret[:8]}... found in {path}"
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        assert API_KEY not in cmdline and HF_TOKEN not in cmdline, f"secret in the argv of pid {proc.pid}"


def assert_honest_evaluation(checkout: Path, stdout: str) -> None:
    """The demo's evaluation is held out, and what it prints is what its report holds.

    Nothing here rests on what the random model says: the overlap is a property of the data,
    the figures are recomputed from the report's own predictions, the gate line must agree
    with them. (The run completing means the enforced gate passed: the demo's own claim.)
    """
    from ktflow.contamination import find_overlaps
    from ktflow.demo import STYLE_MARKER

    data = checkout / ".ktflow/demo/data"
    train = [(f"train:{i}", json.loads(line)["messages"][0]["content"])
             for i, line in enumerate((data / "train.jsonl").read_text().splitlines())]
    evals = [(f"eval:{i}", json.loads(line)["messages"][0]["content"])
             for i, line in enumerate((data / "eval.jsonl").read_text().splitlines())]
    assert find_overlaps(evals, train).clean and len(evals) == 8
    report = json.loads((checkout / ".ktflow/store/eval/tiny-demo/report.json").read_text())
    assert report["contamination"]["overlaps"] == [] and report["contamination"]["eval_prompts"] == 8
    assert re.search(r"evaluate\s.*adapter applied: True, promoted: True, train/eval overlap: 0/8", stdout), stdout
    assert "Train/eval overlap: 0 of 8 eval prompts (0.0 %)" in stdout
    # The side-by-side prompt is an unseen one.
    side = stdout[stdout.index("one unseen prompt (not in the training data): "):]
    assert side.split("'")[1] in {q for _, q in evals} - {q for _, q in train}
    # The style row is the share of answers carrying the marker, as the predictions show.
    shares = {}
    for model in ("base", "tuned"):
        predictions = [p["prediction"] for p in report[model]["predictions"]]
        shares[model] = 100 * sum(STYLE_MARKER in p for p in predictions) / len(predictions)
        assert report[model]["metrics"]["style"] == pytest.approx(shares[model])
    gain = shares["tuned"] - shares["base"]
    assert f"| style ('nya~') | {shares['base']:.2f} | {shares['tuned']:.2f} | {gain:+.2f} |" in stdout
    for metric in ("bleu-4", "rouge-l"):  # reported as they are, whatever they are
        assert re.search(rf"\| {metric} \| [\d.]+ \| [\d.]+ \| [+-][\d.]+ \|", stdout), metric
    passed = "Promotion gate (style must gain at least 50.00 points): **pass**" in stdout
    assert passed is (gain >= 50) is report["promoted"], (gain, stdout)


def demo_run(cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PREFECT_HOME": str(cwd / ".prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "COLUMNS": "200", "KTFLOW_API_KEY": API_KEY, "HF_TOKEN": HF_TOKEN}
    done = subprocess.run([sys.executable, "-m", "ktflow.cli", "demo"], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-4000:]
    return done


def endpoint_pid(cwd: Path) -> int:
    return json.loads((cwd / ".ktflow/store/serving/tiny-demo/endpoint.json").read_text())["pid"]
