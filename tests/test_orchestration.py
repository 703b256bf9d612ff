"""The distributed pipeline on a real Prefect server with two ``ktflow worker`` "hosts".

Each worker advertises its host's capabilities with KT_KERNEL_CPU_VARIANT (the override
kt-kernel itself obeys): the training host as ``amx`` (the amx-train pool), the serving host as
``avx512_bf16`` (avx512-serve), so the pools are joined the same way on every CPU. What runs
is what this CPU can run: on a CPU without AVX512 the serving host skips the quantize-int8
stage (its weights are for a later SGLang host), with the reason, as the embedded run does.
Deployments come from deployments/prefect.yaml; runs are started with the ``prefect`` CLI, as
users do. Every stage is real (tiny Kimi-K2.5 fixture, LlamaFactory SFT on CPU, kt-kernel INT8
where the CPU has it, LlamaFactory's OpenAI server).

The cluster and its first pipeline run are the session's (tests/distributed.py, made by
conftest.py's ``setup`` and ``first_run``), shared with tests/test_ui.py.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from distributed import (
    HOST_ENV,
    SERVE,
    STAGES,
    TRAIN,
    TRAIN_STAGES,
    FirstRun,
    Setup,
    run_id_of,
)
from distributed import processes_of_run as _processes_of_run
from distributed import wait_for_training as _wait_for_training
from prefect_cluster import REPO

from ktflow.stages.sft.resume import checkpoint_is_complete

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (REPO / ".venv-train").exists() or not (REPO / ".venv-serve").exists(),
                       reason="toolchains not installed (make test installs them)"),
]


def test_each_stage_runs_on_the_worker_of_its_pool(setup: Setup, first_run: FirstRun, int8_kernels: bool) -> None:
    """The session's first pipeline run (conftest's ``first_run``: the demo recipe, started with
    `prefect deployment run`; its server restart is tests/test_ui.py's subject)."""
    from ktflow.host.pools import pool_for_stage

    parent = first_run.parent
    assert setup.flow_run(parent)["state_type"] == "COMPLETED"

    where = setup.stage_hosts(parent)
    assert set(where) == set(STAGES)
    for stage, row in where.items():
        host = TRAIN if stage in TRAIN_STAGES else SERVE
        pool = pool_for_stage(stage).name  # type: ignore[arg-type]
        assert (row["host"], row["pool"], row["worker_pool"], row["worker"]) == (host, pool, pool, f"{host}-{pool}"), row
    # The child runs hang under the parent (as_subflow): the UI shows one tree.
    children = [setup.flow_run(row["flow_run"]) for row in where.values()]
    assert all(child["state_type"] == "COMPLETED" for child in children)
    assert {child["parent_task_run_id"] is not None for child in children} == {True}
    summary = setup.summary(parent)
    assert "steps" in summary["sft"], summary
    # The candidate (v1, nothing in production yet) is judged before it serves; the row ends with its verdict.
    prefix = "adapter applied: True, promoted: True, train/eval overlap: 0/8; "
    assert summary["evaluate"].startswith(prefix), summary["evaluate"]
    assert re.fullmatch(r"candidate v1: passed \(style \+\d+\.\d\d >= \+50\.00\)",
                        summary["evaluate"].removeprefix(prefix)), summary["evaluate"]
    int8 = setup.summary_rows(parent)["quantize-int8"]
    if int8_kernels:
        assert int8["runs"] == "yes" and int8["result"].endswith("(T=2)"), int8
    else:  # the serving host's CPU lacks the kernels: it says so, and the run goes on
        assert int8["runs"] == "skipped" and "skipped on this host" in int8["why"], int8
        assert "ktflow worker --pool avx512-serve" in int8["why"], int8
    # The serve stage left a ServingEndpoint block for clients (the key stays in its env var).
    loaded = subprocess.run([sys.executable, "-c", "from blocks import ServingEndpoint\n"
                             "print(ServingEndpoint.load('tiny-demo-endpoint').model_dump_json())"],
                            cwd=REPO, env=setup.cluster.env, capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    block = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert block["url"] == first_run.endpoint["url"] and block["api_key_env"] == "KTFLOW_API_KEY"
    assert "ktflow-crash-zombie-flow-runs" in setup.cluster.prefect("automation", "ls").stdout
    types = setup.cluster.prefect("block", "type", "ls").stdout
    for block_type in ("ktflow-model-store", "ktflow-toolchain", "ktflow-huggingface-credentials", "ktflow-artifact-store"):
        assert block_type in types, types


def test_publishing_an_unchanged_dataset_retrains_as_a_cache_hit_without_restarting_the_server(
        setup: Setup, first_run: FirstRun) -> None:
    before = setup.endpoint_record()
    published = setup.cluster.ktflow("dataset", "publish", str(setup.root / "data/train.jsonl"),
                                     "--recipe", str(setup.recipe_file), "--json")
    event = json.loads(published.stdout)
    assert event["event"] == "dataset.version.published" and event["payload"]["records"] == 48

    deadline = time.monotonic() + 300
    runs: list[dict] = []
    while time.monotonic() < deadline:
        runs = setup.flow_runs("ktflow-retrain")
        if runs and runs[0]["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            break
        time.sleep(2)
    assert runs, "the event started no retrain"
    [run] = runs
    assert run["state_type"] == "COMPLETED", run["state"]
    assert run["parameters"]["dataset_file"] == str(setup.root / "data/train.jsonl")
    summary = setup.summary(run["id"])
    assert summary["dequantize"].endswith("(cached)") and summary["sft"].endswith("(cached)")
    after = setup.endpoint_record()
    assert (after["pid"], after["url"]) == (before["pid"], before["url"])  # not restarted


def _regressing_dataset(setup: Setup) -> Path:
    """The demo's training records with the style marker removed from every answer and the answers
    shuffled between records: a dataset version whose adapter cannot pass the style gate."""
    records = [json.loads(line) for line in (setup.root / "data/train.jsonl").read_text().splitlines()]
    answers = [r["messages"][-1]["content"].replace(", nya~", "").replace("nya~", "") for r in records]
    random.Random(27).shuffle(answers)
    for record, answer in zip(records, answers, strict=True):
        record["messages"][-1]["content"] = answer
    text = "".join(json.dumps(r) + "\n" for r in records)
    assert "nya~" not in text
    path = setup.root / "data/regressing.jsonl"
    path.write_text(text)
    return path


def _probe_answers(setup: Setup, n: int = 3) -> list[str]:
    """What the recipe's endpoint answers to the first ``n`` evaluation prompts, greedily."""
    from openai import OpenAI

    from ktflow.stages.serve import api_key_for, read_endpoint

    endpoint = read_endpoint(setup.root / "store/serving/tiny-demo")
    assert endpoint is not None
    prompts = [json.loads(line)["messages"][0]["content"]
               for line in (setup.root / "data/eval.jsonl").read_text().splitlines()[:n]]
    client = OpenAI(base_url=endpoint.url, api_key=api_key_for(endpoint), timeout=120, max_retries=0)
    try:
        return [client.chat.completions.create(model=endpoint.model, messages=[{"role": "user", "content": p}],
                                               temperature=0, max_tokens=48).choices[0].message.content or ""
                for p in prompts]
    finally:
        client.close()


def _adapter_events(setup: Setup, names: set[str], timeout: float = 60) -> list[dict]:
    """The server's ``ktflow.adapter.*`` events, once one of each of ``names`` arrived (oldest first)."""
    deadline = time.monotonic() + timeout
    while True:
        found = setup.cluster.api("POST", "/events/filter", {"filter": {"event": {"prefix": ["ktflow.adapter."]},
                                                                        "order": "ASC"}, "limit": 50})
        events = found["events"]  # type: ignore[index]
        if names <= {e["event"] for e in events} or time.monotonic() > deadline:
            return events
        time.sleep(1)


def test_a_regressing_dataset_version_is_rejected_production_stays_and_promote_rollback_swap(
        setup: Setup, first_run: FirstRun) -> None:
    """Issue #27: a published dataset version whose adapter fails the gate is judged beside
    production and rejected; production keeps serving v1, untouched; promote and rollback move it."""
    from ktflow.registry import AdapterRegistry

    before = setup.endpoint_record()
    assert before["adapter_version"] == 1, before
    answers = _probe_answers(setup)
    data = _regressing_dataset(setup)
    setup.cluster.ktflow("dataset", "publish", str(data), "--recipe", str(setup.recipe_file), "--json")

    deadline = time.monotonic() + 900
    while True:
        runs = [r for r in setup.flow_runs("ktflow-retrain") if r["parameters"].get("dataset_file") == str(data)]
        if runs and runs[0]["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            break
        assert time.monotonic() < deadline, f"the retrain on {data} did not end: {runs and runs[0]['state']}"
        time.sleep(2)
    [run] = runs
    # It failed on the gate, saying what stays in production, in its state and its report.
    message = run["state"]["message"]
    assert run["state_type"] == "FAILED", run["state"]
    assert "PromotionGateError" in message and "candidate v2: not promoted (" in message, message
    assert "production stays v1" in message, message
    [report] = setup.artifacts(run["id"], "pipeline-report")
    lines = [line for line in report["data"].splitlines() if line.strip()]
    assert lines[1].startswith("**candidate v2: not promoted (") and lines[1].endswith("; production stays v1**"), lines
    assert "| production (v1) |" in report["data"], report["data"]  # the report compares with what serves
    summary = setup.summary(run["id"])
    assert "not promoted (" in summary["serve"] and "production stays v1" in summary["serve"], summary
    assert "candidate v2: not promoted (" in summary["evaluate"], summary

    # Production is untouched: the same process serves v1 and answers as it did.
    after = setup.endpoint_record()
    assert {k: after[k] for k in ("pid", "adapter_dir", "adapter_version")} == \
        {k: before[k] for k in ("pid", "adapter_dir", "adapter_version")}
    assert _probe_answers(setup) == answers
    # Nothing of the candidate's (or the evaluation's base) server is left.
    judged = setup.root / "store/eval/tiny-demo/v2"
    for record_dir in (judged / "candidate-endpoint", judged / "base-endpoint"):
        assert not (record_dir / "endpoint.json").exists(), record_dir
    left = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if str(judged) in proc.cwd() or any(str(judged) in arg for arg in proc.cmdline()):
                left.append(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    assert not left, left

    # The registry: v2 is kept with its failed verdict and what started it; production stays v1.
    listed = json.loads(setup.cluster.ktflow("adapters", str(setup.recipe_file), "--json").stdout)
    assert listed["production"] == 1 and listed["serving"]["version"] == 1, listed
    versions = {v["version"]: v for v in listed["versions"]}
    assert set(versions) == {1, 2}, versions
    assert versions[2]["verdict"]["status"] == "failed" and versions[2]["verdict"]["mode"] == "beside", versions[2]
    assert versions[2]["lineage"]["trigger"]["kind"] == "dataset-event", versions[2]["lineage"]
    assert versions[1]["verdict"]["status"] == "passed", versions[1]
    # What users hang notifications on: v1's promotion (the first run) and v2's rejection.
    events = _adapter_events(setup, {"ktflow.adapter.promoted", "ktflow.adapter.rejected"})
    seen = [(e["event"], e["payload"].get("version")) for e in events]
    assert ("ktflow.adapter.promoted", 1) in seen and ("ktflow.adapter.rejected", 2) in seen, seen
    [rejected] = [e for e in events if e["event"] == "ktflow.adapter.rejected"]
    assert rejected["resource"]["prefect.resource.id"] == "ktflow.adapter.tiny-demo", rejected
    assert rejected["payload"]["production"] == 1 and rejected["payload"]["mode"] == "beside", rejected

    # A person overrides the gate: v2 serves (a real swap: a new, health-gated server) ...
    promoted = setup.cluster.ktflow("promote", str(setup.recipe_file), "2", timeout=600)
    assert "promoted v2 (replaces v1)" in promoted.stdout, promoted.stdout + promoted.stderr
    now = setup.endpoint_record()
    registry = AdapterRegistry(setup.root / "store", "tiny-demo")
    assert now["adapter_version"] == 2 and now["pid"] != before["pid"], now
    assert now["adapter_dir"] == str(registry.get(2).adapter_dir) and now["state"] == "ready", now
    # ... and a rollback brings v1 back, answering as before.
    rolled = setup.cluster.ktflow("rollback", str(setup.recipe_file), timeout=600)
    assert "promoted v1 (replaces v2)" in rolled.stdout, rolled.stdout + rolled.stderr
    back = setup.endpoint_record()
    assert back["adapter_version"] == 1 and back["adapter_dir"] == before["adapter_dir"], back
    assert back["pid"] not in (before["pid"], now["pid"]) and back["state"] == "ready", back
    assert registry.production().version == 1 and registry.pending() is None
    assert _probe_answers(setup) == answers


def test_a_bad_dataset_is_not_published(setup: Setup) -> None:
    bad = setup.root / "data/bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{not json\n')
    done = setup.cluster.ktflow("dataset", "publish", str(bad), "--recipe", str(setup.recipe_file), check=False)
    assert done.returncode == 2
    assert "bad.jsonl:2" in done.stderr or "bad.jsonl:2" in done.stdout, done.stderr


def test_cancelling_the_parent_cancels_the_running_stage_and_leaves_no_process(setup: Setup) -> None:
    data = setup.dataset_variant("cancel.jsonl", "nya~", "nya nya nya~")
    parent = setup.start_pipeline(setup.crash_recipe(data))
    sft = _wait_for_training(setup, parent, 300)
    setup.cluster.prefect("flow-run", "cancel", parent)
    setup.wait_state(parent, {"CANCELLED"}, 120)
    setup.wait_state(sft["id"], {"CANCELLED", "CRASHED"}, 120)
    deadline = time.monotonic() + 60
    while (left := _processes_of_run(sft["id"])) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, [p.cmdline() for p in left]


def test_a_killed_stage_is_retried_and_resumes_from_its_checkpoint(setup: Setup) -> None:
    data = setup.dataset_variant("kill.jsonl", "nya~", "nya, nya~")
    earlier = set((setup.root / "store").glob("runs/*/output/checkpoint-*"))
    parent = setup.start_pipeline(setup.crash_recipe(data))

    def checkpointed() -> bool:  # a complete one: a kill during the save leaves nothing to resume from
        return any(checkpoint_is_complete(c) for c in set((setup.root / "store").glob("runs/*/output/checkpoint-*"))
                   - earlier)

    sft = _wait_for_training(setup, parent, 400, checkpointed)
    victims = _processes_of_run(sft["id"])
    assert victims
    for proc in victims:  # the stage's flow process and its trainer die at once, as on a crash
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    setup.wait_state(sft["id"], {"CRASHED", "FAILED"}, 120)
    final = setup.wait_state(parent, {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}, 600)
    assert final["state_type"] == "COMPLETED", final["state"]
    sft_runs = setup.flow_runs("ktflow-sft")
    retried = [run for run in sft_runs if run["id"] != sft["id"] and run["created"] > sft["created"]]
    assert retried and retried[0]["state_type"] == "COMPLETED"
    assert "resumed from" in setup.summary(parent)["sft"] and "checkpoint-" in setup.summary(parent)["sft"]


def test_a_restarted_worker_does_not_run_a_stage_twice(setup: Setup) -> None:
    data = setup.dataset_variant("restart.jsonl", "nya~", "nya... nya~")
    before = {run["id"] for run in setup.flow_runs("ktflow-sft")}
    parent = setup.start_pipeline(setup.crash_recipe(data))
    sft = _wait_for_training(setup, parent, 300)
    # The training host's worker dies (kill -9 of ktflow worker and Prefect's workers); the
    # stage's own process lives on, as it does when a worker unit is restarted.
    supervisor = psutil.Process(setup.cluster.workers[TRAIN].pid)
    workers = supervisor.children()
    for proc in [supervisor, *workers]:
        proc.kill()
    psutil.wait_procs([supervisor, *workers], timeout=30)
    setup.cluster.workers.pop(TRAIN).wait()
    assert _processes_of_run(sft["id"]), "the stage's process outlives its worker"
    setup.cluster.start_worker(TRAIN, ["ktflow-control", "amx-train"], HOST_ENV[TRAIN])

    final = setup.wait_state(parent, {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}, 600)
    assert final["state_type"] == "COMPLETED", final["state"]
    new_sft_runs = [run for run in setup.flow_runs("ktflow-sft") if run["id"] not in before]
    assert [run["id"] for run in new_sft_runs] == [sft["id"]]  # one SFT run, not two
    assert "resumed from" not in setup.summary(parent)["sft"]


def test_the_server_rejects_an_invalid_recipe_before_creating_a_run(setup: Setup) -> None:
    recipe = setup.recipe()
    recipe["sft"]["lora_rank"] = "eight"
    before = len(setup.flow_runs("ktflow-dispatch"))
    done = setup.cluster.prefect("deployment", "run", "ktflow-dispatch/pipeline", "--params",
                                 json.dumps({"recipe": recipe}), check=False)
    assert done.returncode != 0
    assert "lora_rank" in done.stdout + done.stderr
    assert len(setup.flow_runs("ktflow-dispatch")) == before


def test_a_stage_whose_pool_no_live_worker_serves_fails_in_bounded_time(
        setup: Setup, first_run: FirstRun) -> None:
    setup.cluster.stop_worker(SERVE)
    try:
        deadline = time.monotonic() + 60
        while any(w["status"] == "ONLINE" for w in setup.cluster.api("POST", "/work_pools/avx512-serve/workers/filter", {})):
            assert time.monotonic() < deadline, "the stopped worker still counts as online"
            time.sleep(1)
        # Download, dequantize and SFT are cache hits on the training host; convert-lora has no worker.
        started = time.monotonic()
        done = setup.cluster.prefect("deployment", "run", "ktflow-dispatch/pipeline", "--params",
                                     json.dumps({"recipe": setup.recipe(), "pickup_timeout_s": 5}))
        parent = run_id_of(done.stdout)
        final = setup.wait_state(parent, {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}, 300)
        print(f"failed after {time.monotonic() - started:.1f} s")
        assert final["state_type"] == "FAILED", final["state"]
        message = final["state"]["message"]
        for says in ("stage convert-lora", "work pool avx512-serve", "no live worker served the pool for 5 s",
                     "`ktflow worker --pool avx512-serve`", "avx512_base or better"):
            assert says in message, (says, message)
        [child] = setup.flow_runs("ktflow-convert-lora", ["SCHEDULED", "PENDING", "CANCELLING", "CANCELLED"])[:1]
        setup.wait_state(child["id"], {"CANCELLED"}, 60)  # never left Scheduled for a worker to find later
    finally:
        setup.cluster.start_worker(SERVE, ["avx512-serve"], HOST_ENV[SERVE], toolchains=["serve=serve-host-serve"])
