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
    env = cli_env(home or cwd)
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
        assert r3["evaluate"].startswith("adapter applied: True, promoted: True, train/eval overlap: 0/8; "
                                         "candidate v2: passed (style "), r3["evaluate"]
        assert third["version"] == 2 and third["promotion"] == "promoted v2 (replaces v1)"
        assert endpoint_pid(tmp_path) != pid  # the new adapter is served
        assert endpoint_record(tmp_path)["adapter_version"] == 2
        report = json.loads((tmp_path / ".ktflow/store/eval/tiny-demo/v2/report.json").read_text())
        assert report["candidate_mode"] == "beside" and report["production_version"] == 1
        assert report["production"]["model"] == "tiny-demo:tuned"  # v1 was asked the same prompts beside it
        assert_no_secret_anywhere(tmp_path)

        # From any working directory: the recipe's project directory is where its paths point.
        elsewhere = tmp_path / "elsewhere" / "deeper"
        elsewhere.mkdir(parents=True)
        away = ktflow_run(elsewhere, tmp_path / "recipes/tiny-demo.yaml", "--json", home=tmp_path)
        assert away.returncode == 0, away.stderr[-3000:]
        assert results(json.loads(away.stdout))["sft"].endswith("(cached)")
        assert not any(elsewhere.iterdir())  # no state of its own where it was started

        assert_rejected_candidates_never_serve(tmp_path)
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


def assert_rejected_candidates_never_serve(tmp_path: Path) -> None:
    """A retrain on a regressing dataset version is judged and rejected in each candidate mode;
    production (v2) keeps answering as it did. Expected errors end in one `error:` line, no traceback."""
    regressing = regressing_dataset(tmp_path)
    # A short tune (40 steps) is enough to make a new version; the three runs below share it (SFT cached).
    retrain = ("--set", f"dataset.files=[{regressing}]", "--set", "sft.max_steps=40")
    before = endpoint_record(tmp_path)
    answers = probe_answers(tmp_path)
    # beside (this box's choice: a second CPU server fits): the same server process keeps serving.
    rejected = ktflow_run(tmp_path, "recipes/tiny-demo.yaml", *retrain)
    assert rejected.returncode == 1, rejected.stderr[-3000:]
    assert "Traceback" not in rejected.stderr + rejected.stdout, rejected.stderr[-3000:]
    [line] = [ln for ln in rejected.stderr.splitlines() if ln.startswith("error:")]
    assert re.search(r"candidate v3: not promoted \(style [+-][\d.]+ < \+50\.00\); production stays v2",
                     rejected.stderr), rejected.stderr[-3000:]
    after = endpoint_record(tmp_path)
    assert (after["pid"], after["adapter_dir"], after["adapter_version"]) == \
        (before["pid"], before["adapter_dir"], 2)
    assert probe_answers(tmp_path) == answers
    assert not candidate_servers(tmp_path), "the candidate's server was left running"
    report = json.loads((tmp_path / ".ktflow/store/eval/tiny-demo/v3/report.json").read_text())
    assert report["promoted"] is False and report["gate_enforced"] is True and report["candidate_mode"] == "beside"

    # swap: the candidate serves in production's place, fails, and v2 is promoted back at once.
    swapped = ktflow_run(tmp_path, "recipes/tiny-demo.yaml", *retrain, "--set", "evaluation.candidate=swap")
    assert swapped.returncode == 1, swapped.stderr[-3000:]
    assert re.search(r"candidate v3: not promoted \(style [+-][\d.]+ < \+50\.00\); production stays v2; it served "
                     r"\S+ - \S+ \(swap mode\)", swapped.stderr), swapped.stderr[-3000:]
    restored = endpoint_record(tmp_path)
    assert restored["adapter_dir"] == before["adapter_dir"] and restored["adapter_version"] == 2
    assert restored["url"] == before["url"] and probe_answers(tmp_path) == answers

    # offline: generation through the training toolchain; nothing that serves is touched. The gate
    # here fails by construction, not by what this CPU's numerics make the random model say: a
    # style every answer matches (/^/) scores 100 % for the base as for the candidate.
    offline = ktflow_run(tmp_path, "recipes/tiny-demo.yaml", *retrain, "--set", "evaluation.candidate=offline",
                         "--set", 'evaluation.style={pattern: "^"}',
                         "--set", "evaluation.gate_min_gain=1")
    assert offline.returncode == 1, offline.stderr[-3000:]
    assert "style is 100.00 against the base's 100.00 (+0.00 points); the promotion gate asks for at least " \
           "+1.00" in offline.stderr, offline.stderr[-3000:]
    assert endpoint_record(tmp_path)["pid"] == restored["pid"]
    report = json.loads((tmp_path / ".ktflow/store/eval/tiny-demo/v3/report.json").read_text())
    assert report["candidate_mode"] == "offline" and report["tuned"]["model"] == "tuned (offline)"
    assert report["production"]["metrics"]["style"] == 100.0

    # The registry: three versions, v2 serving, v3 judged and rejected, with its lineage.
    listed = ktflow_cli(tmp_path, "adapters", "recipes/tiny-demo.yaml", "--json")
    registry = json.loads(listed.stdout)
    assert registry["production"] == 2 and registry["serving"]["version"] == 2
    v3 = registry["versions"][2]
    assert v3["verdict"]["status"] == "failed" and v3["verdict"]["mode"] == "offline"
    assert v3["lineage"]["trigger"]["kind"] == "cli" and v3["lineage"]["dataset_digest"] != \
        registry["versions"][1]["lineage"]["dataset_digest"]
    assert_promote_and_rollback(tmp_path)


def assert_promote_and_rollback(tmp_path: Path) -> None:
    """`ktflow promote` is idempotent, `ktflow rollback` returns to v1 (not to v3, which never
    passed), and a promotion killed with SIGKILL mid-swap is finished by the next command."""
    pid = endpoint_record(tmp_path)["pid"]
    again = ktflow_cli(tmp_path, "promote", "recipes/tiny-demo.yaml", "2")
    assert "v2 already serves" in again.stdout and endpoint_record(tmp_path)["pid"] == pid
    back = ktflow_cli(tmp_path, "rollback", "recipes/tiny-demo.yaml")
    assert "rolled back: promoted v1 (replaces v2)" in back.stdout, back.stdout
    assert endpoint_record(tmp_path)["adapter_version"] == 1
    bad = ktflow_cli(tmp_path, "promote", "recipes/tiny-demo.yaml", "9", check=False)
    assert bad.returncode == 2 and "no such adapter version (the recipe has: v1, v2, v3)" in bad.stderr
    # A server toolchain that is gone is refused before production is stopped: v1 keeps serving.
    serving = endpoint_record(tmp_path)
    gone = ktflow_cli(tmp_path, "promote", "recipes/tiny-demo.yaml", "2", "--set",
                      "toolchains.train.python=/nonexistent/python", check=False)
    assert gone.returncode == 2 and "/nonexistent/python" in gone.stderr, gone.stderr[-2000:]
    assert endpoint_record(tmp_path)["pid"] == serving["pid"] and psutil.pid_exists(serving["pid"])
    assert not (tmp_path / ".ktflow/store/registry/tiny-demo/pending-move.json").exists()

    registry = tmp_path / ".ktflow/store/registry/tiny-demo"
    proc = subprocess.Popen([sys.executable, "-m", "ktflow.cli", "promote", "recipes/tiny-demo.yaml", "2"],
                            cwd=tmp_path, env=cli_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not ((registry / "pending-move.json").exists() and endpoint_state(tmp_path) == "starting"):
        assert proc.poll() is None and time.monotonic() < deadline, "the promotion never reached the swap"
        time.sleep(0.05)
    proc.kill()  # SIGKILL while the v2 server starts: the old server is already stopped
    proc.wait()
    listed = json.loads(ktflow_cli(tmp_path, "adapters", "recipes/tiny-demo.yaml", "--json").stdout)
    assert listed["pending_move"]["to_version"] == 2 and listed["production"] == 1
    finished = ktflow_cli(tmp_path, "promote", "recipes/tiny-demo.yaml", "2")
    assert "interrupted move v1 -> v2 was undone: v1 serves" in finished.stderr, finished.stderr[-2000:]
    assert "promoted v2 (replaces v1)" in finished.stdout
    record = endpoint_record(tmp_path)
    assert record["adapter_version"] == 2 and record["state"] == "ready"
    assert not (registry / "pending-move.json").exists()


def regressing_dataset(tmp_path: Path) -> Path:
    """The demo's training records with the style marker removed and the answers shuffled between
    records: a dataset version a scheduled retrain could pick up, on which tuning carries no style."""
    records = [json.loads(line) for line in (tmp_path / ".ktflow/demo/data/train.jsonl").read_text().splitlines()]
    answers = [r["messages"][-1]["content"].replace(", nya~", "").replace("nya~", "") for r in records]
    answers = answers[1:] + answers[:1]
    path = tmp_path / "regressing.jsonl"
    with path.open("w") as f:
        for record, answer in zip(records, answers):
            record["messages"][-1]["content"] = answer
            assert "nya~" not in answer
            f.write(json.dumps(record) + "\n")
    return path


def endpoint_record(cwd: Path) -> dict:
    return json.loads((cwd / ".ktflow/store/serving/tiny-demo/endpoint.json").read_text())


def endpoint_state(cwd: Path) -> str | None:
    try:
        return endpoint_record(cwd)["state"]
    except (OSError, ValueError, KeyError):
        return None


def probe_answers(cwd: Path) -> list[str]:
    """Production's answers at temperature 0 to the adapter-probe prompts (the first eval prompts)."""
    import openai

    record = endpoint_record(cwd)
    prompts = [json.loads(line)["messages"][0]["content"]
               for line in (cwd / ".ktflow/demo/data/eval.jsonl").read_text().splitlines()[:4]]
    client = openai.OpenAI(base_url=record["url"], api_key=API_KEY, timeout=120)
    return [client.chat.completions.create(model=record["adapter_model_name"], temperature=0, max_tokens=16,
                                           messages=[{"role": "user", "content": p}]).choices[0].message.content
            for p in prompts]


def candidate_servers(cwd: Path) -> list[int]:
    """Live processes of a candidate's server (their working directory is its record directory)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if "candidate-endpoint" in proc.cwd() and str(cwd) in proc.cwd():
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def cli_env(cwd: Path) -> dict[str, str]:
    return {**os.environ, "PREFECT_HOME": str(cwd / ".prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "KTFLOW_API_KEY": API_KEY, "HF_TOKEN": HF_TOKEN, "COLUMNS": "200"}


def ktflow_cli(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "ktflow.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env=cli_env(cwd), timeout=600)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


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
    from ktflow.demo import STYLE_MARKER
    from ktflow.stages.contamination import find_overlaps

    data = checkout / ".ktflow/demo/data"
    train = [(f"train:{i}", json.loads(line)["messages"][0]["content"])
             for i, line in enumerate((data / "train.jsonl").read_text().splitlines())]
    evals = [(f"eval:{i}", json.loads(line)["messages"][0]["content"])
             for i, line in enumerate((data / "eval.jsonl").read_text().splitlines())]
    assert find_overlaps(evals, train).clean and len(evals) == 8
    report = json.loads((checkout / ".ktflow/store/eval/tiny-demo/v1/report.json").read_text())
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
