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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT = free_port()


def run(cwd: Path, *extra: str) -> tuple[dict, float]:
    env = {**os.environ, "PREFECT_HOME": str(cwd / ".prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "KTFLOW_API_KEY": API_KEY, "HF_TOKEN": HF_TOKEN}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ktflow.cli", "run", "recipes/tiny-demo.yaml", "--json", *extra],
                          cwd=cwd, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout), time.monotonic() - started


def results(outcome: dict) -> dict[str, str]:
    return {row["stage"]: row["result"] for row in outcome["stages"]}


def test_demo_runs_every_stage_then_caches_then_reruns_only_what_the_data_touches(tmp_path: Path) -> None:
    shutil.copytree(REPO / "recipes", tmp_path / "recipes")
    recipe = tmp_path / "recipes/tiny-demo.yaml"
    recipe.write_text(recipe.read_text().replace("port: 18765", f"port: {PORT}"))
    for env in (".venv-train", ".venv-serve"):
        (tmp_path / env).symlink_to(REPO / env)
    stop = [sys.executable, "-m", "ktflow.cli", "serve", "recipes/tiny-demo.yaml", "--stop"]
    try:
        # `make demo`: makes the fixture and data, runs the pipeline flow on the embedded API.
        demo = demo_run(tmp_path)
        assert re.search(r"demo pipeline \(tiny-demo\): Completed", demo.stdout), demo.stdout
        for stage, ran in (("dequantize", "tensors)"), ("sft", "steps)"), ("quantize-int8", "(T=2)")):
            assert re.search(rf"{stage}\s.*{re.escape(ran)}", demo.stdout), (stage, demo.stdout)
        assert "(cached)" not in demo.stdout
        assert "the answer to" in demo.stdout and "| rouge-l |" in demo.stdout
        assert "adapter applied: **True**" in demo.stdout or "adapter applied" in demo.stdout
        pid = endpoint_pid(tmp_path)
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
        assert r3["evaluate"] == "adapter applied: True, promoted: True"
        assert endpoint_pid(tmp_path) != pid  # the new adapter is served
        assert_no_secret_anywhere(tmp_path)
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


def demo_run(cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PREFECT_HOME": str(cwd / ".prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "COLUMNS": "200", "KTFLOW_API_KEY": API_KEY, "HF_TOKEN": HF_TOKEN}
    done = subprocess.run([sys.executable, "-m", "ktflow.cli", "demo"], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-4000:]
    return done


def endpoint_pid(cwd: Path) -> int:
    return json.loads((cwd / ".ktflow/store/serving/tiny-demo/endpoint.json").read_text())["pid"]
