"""The distributed pipeline's cluster, shared by tests/test_orchestration.py and tests/test_ui.py.

One real Prefect server (on PostgreSQL where its binaries are installed, as on CI) with ktflow's
deployments, and two ``ktflow worker`` "hosts": the training host advertises ``amx`` (the
amx-train pool), the serving host ``avx512_bf16`` (avx512-serve), through KT_KERNEL_CPU_VARIANT,
the override kt-kernel itself obeys. conftest.py makes it once per session (``setup``) and runs
the demo pipeline on it once (``first_run``), with the server restarted while SFT trains: every
test that looks at a finished run reads that one, and a failure of either fixture is reported by
each test that needs it, as the fixture's own error.

Both modules are one unit of pytest-xdist's schedule (``CLUSTER_MODULES``, conftest.py's
scheduler): their tests run in one worker, in file order, against this one cluster.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml
from prefect_cluster import REPO, Cluster, free_port, prefect_cluster

# The test modules that share the cluster: one unit of work for pytest-xdist (see conftest.py).
CLUSTER_MODULES = ("tests/test_orchestration.py", "tests/test_ui.py")
TRAIN, SERVE = "train-host", "serve-host"
# What each fake host advertises; heartbeats every 5 s, so a stopped worker is offline in 15 s.
HOST_ENV = {
    TRAIN: {"KT_KERNEL_CPU_VARIANT": "amx", "PREFECT_WORKER_HEARTBEAT_SECONDS": "5"},
    SERVE: {"KT_KERNEL_CPU_VARIANT": "avx512_bf16", "PREFECT_WORKER_HEARTBEAT_SECONDS": "5"},
}
TRAIN_STAGES = {"download", "dequantize", "sft"}
STAGES = ["download", "dequantize", "sft", "convert-lora", "quantize-int8", "serve", "evaluate"]


class Setup:
    def __init__(self, cluster: Cluster, root: Path, recipe_file: Path) -> None:
        self.cluster, self.root, self.recipe_file = cluster, root, recipe_file

    def recipe(self, dataset: Path | None = None, *overrides: str) -> dict:
        from ktflow.recipe import load_recipe

        data = [f"dataset.files={json.dumps([str(dataset)])}"] if dataset else []
        return load_recipe(self.recipe_file, [*data, *overrides]).model_dump(mode="json")

    def crash_recipe(self, dataset: Path) -> dict:
        """The recipe on ``dataset`` for a test of how the SFT stage survives a crash, a cancel or a
        dead worker: no evaluation (the first run and the regressing-version test judge adapters on
        this cluster; each evaluation starts two servers)."""
        return self.recipe(dataset, "evaluation.enabled=false")

    def dataset_variant(self, name: str, old: str, new: str) -> Path:
        """A copy of the training data with one record changed (a new data hash: SFT reruns)."""
        lines = (self.root / "data/train.jsonl").read_text().splitlines()
        lines[0] = lines[0].replace(old, new)
        assert lines[0] != (self.root / "data/train.jsonl").read_text().splitlines()[0]
        path = self.root / "data" / name
        path.write_text("\n".join(lines) + "\n")
        return path

    def start_pipeline(self, recipe: dict) -> str:
        done = self.cluster.prefect("deployment", "run", "ktflow-dispatch/pipeline", "--params",
                                    json.dumps({"recipe": recipe}))
        return run_id_of(done.stdout)

    def flow_runs(self, flow: str, states: list[str] | None = None) -> list[dict]:
        body: dict = {"flows": {"name": {"any_": [flow]}}, "sort": "EXPECTED_START_TIME_DESC"}
        if states:
            body["flow_runs"] = {"state": {"type": {"any_": states}}}
        return self.cluster.api("POST", "/flow_runs/filter", body)  # type: ignore[return-value]

    def flow_run(self, run_id: str) -> dict:
        return self.cluster.api("GET", f"/flow_runs/{run_id}")  # type: ignore[return-value]

    def children(self, parent: str) -> list[dict]:
        return self.cluster.api("POST", "/flow_runs/filter", {  # type: ignore[return-value]
            "flow_runs": {"parent_flow_run_id": {"any_": [parent]}}, "sort": "EXPECTED_START_TIME_ASC"})

    def wait_state(self, run_id: str, types: set[str], timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = self.flow_run(run_id)
            if run["state_type"] in types:
                return run
            time.sleep(1)
        raise AssertionError(f"flow run {run_id} still {self.flow_run(run_id)['state_type']} after {timeout} s")

    def artifacts(self, flow_run_id: str | list[str] | None = None, key_like: str | None = None) -> list[dict]:
        body: dict = {"artifacts": {}}
        if key_like:
            body["artifacts"]["key"] = {"like_": key_like}
        if flow_run_id:
            ids = [flow_run_id] if isinstance(flow_run_id, str) else flow_run_id
            body["artifacts"]["flow_run_id"] = {"any_": ids}
        return self.cluster.api("POST", "/artifacts/filter", body)  # type: ignore[return-value]

    def stage_hosts(self, parent: str) -> dict[str, dict]:
        """Where each stage of the pipeline run ``parent`` ran: its ``stage-host-*`` artifact row."""
        where = {}
        for artifact in self.artifacts([c["id"] for c in self.children(parent)], key_like="stage-host-"):
            [row] = json.loads(artifact["data"]) if isinstance(artifact["data"], str) else artifact["data"]
            where[row["stage"]] = row
        return where

    def logs(self, flow_run_id: str) -> list[dict]:
        logs: list[dict] = []
        while True:
            page = self.cluster.api("POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}},
                                                            "sort": "TIMESTAMP_ASC", "limit": 200, "offset": len(logs)})
            logs += page  # type: ignore[arg-type]
            if len(page) < 200:  # type: ignore[arg-type]
                return logs

    def summary_rows(self, flow_run_id: str) -> dict[str, dict[str, str]]:
        [artifact] = self.artifacts(flow_run_id, "pipeline-summary")
        rows = json.loads(artifact["data"]) if isinstance(artifact["data"], str) else artifact["data"]
        return {row["stage"]: row for row in rows}

    def summary(self, flow_run_id: str) -> dict[str, str]:
        return {stage: row["result"] for stage, row in self.summary_rows(flow_run_id).items()}

    def endpoint_record(self) -> dict:
        return json.loads((self.root / "store/serving/tiny-demo/endpoint.json").read_text())


def run_id_of(cli_output: str) -> str:
    match = re.search(r"UUID: ([0-9a-f-]{36})", cli_output)
    assert match, cli_output
    return match.group(1)


def processes_of_run(run_id: str, *, tools_only: bool = False) -> list[psutil.Process]:
    """Live processes of a flow run: its flow process and every tool it started (they inherit
    the run's environment, whoever their parent is now)."""
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if env.get("PREFECT__FLOW_RUN_ID") != run_id or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if not tools_only or "KTFLOW_TOOL_RUN" in env:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_for_training(setup: Setup, parent: str, timeout: float, ready=lambda: True) -> dict:
    """The running SFT child run, once its trainer process is up (and ``ready()`` holds)."""
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, "SFT never started"
        assert setup.flow_run(parent)["state_type"] not in ("FAILED", "CRASHED", "COMPLETED", "CANCELLED")
        children = {child["id"] for child in setup.children(parent)}
        running = [run for run in setup.flow_runs("ktflow-sft", ["RUNNING"]) if run["id"] in children]
        if running and processes_of_run(running[0]["id"], tools_only=True) and ready():
            return running[0]
        time.sleep(0.5)


@contextmanager
def distributed_setup(root: Path) -> Iterator[Setup]:
    """The demo's model, data and recipe under ``root``, a cluster with the two hosts' workers;
    whatever serves is stopped on the way out, even when a test failed."""
    from ktflow.demo import DEMO_MODEL, write_demo_dataset
    from ktflow.fixtures.checkpoints import make_fixture

    make_fixture(DEMO_MODEL, root / "model")
    write_demo_dataset(root / "data")
    recipe = yaml.safe_load((REPO / "recipes/tiny-demo.yaml").read_text())
    recipe["source"]["local_path"] = str(root / "model")
    recipe["dataset"]["files"] = [str(root / "data/train.jsonl")]
    recipe["evaluation"]["files"] = [str(root / "data/eval.jsonl")]
    recipe["store"]["root"] = str(root / "store")
    recipe["serving"]["port"] = free_port()
    # The ktflow CLI reads a recipe's relative paths from the recipe's folder (here: root), the
    # workers from the checkout: absolute toolchains mean the same to both.
    recipe["toolchains"] = {role: {"python": str(REPO / f".venv-{role}/bin/python")} for role in ("train", "serve")}
    recipe_file = root / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe))
    with prefect_cluster(root / "prefect") as cluster:
        try:
            # ktflow's block types, and the serving host's own Toolchain block (what a host whose
            # environments live elsewhere does); its worker runs the serving stages with it.
            cluster.prefect("block", "register", "-m", "blocks")
            cluster.prefect("automation", "create", "--from-file", "deployments/automations/zombie-runs.yaml")
            subprocess.run([sys.executable, "-c", "import sys\nfrom blocks import Toolchain\n"
                            "Toolchain(role='serve', python=sys.argv[1]).save('serve-host-serve')",
                            str(REPO / ".venv-serve/bin/python")], cwd=REPO, env=cluster.env, check=True, timeout=120)
            cluster.start_worker(TRAIN, ["ktflow-control", "amx-train"], HOST_ENV[TRAIN])
            cluster.start_worker(SERVE, ["avx512-serve"], HOST_ENV[SERVE], toolchains=["serve=serve-host-serve"])
            yield Setup(cluster, root, recipe_file)
        finally:
            stop_all_servers(root / "store")


def stop_all_servers(store: Path) -> None:
    """Stop every endpoint recorded under ``store`` (production, and any candidate or base server
    an evaluation left behind on a failure): each one's whole process tree."""
    from ktflow.stages.serve import stop

    for record in store.glob("**/endpoint.json"):
        stop(record.parent, grace_s=5)


@dataclass(frozen=True)
class FirstRun:
    """The session's first pipeline run (the demo recipe as it ships), with a server outage mid-SFT."""

    parent: str
    sft: str
    down_at: float      # wall-clock time (time.time()) the server was stopped
    up_at: float        # ... and answered again
    training_through: bool  # the trainer was still training when the server came back
    run_s: float
    final: dict         # the parent flow run as the server returned it at the end
    endpoint: dict      # the endpoint record the run left


def first_run(setup: Setup) -> FirstRun:
    """Run the demo pipeline; while its SFT stage trains on the training host's worker, stop the
    server as its service manager does, keep it down 5 s, start it again; wait for the end."""
    started = time.monotonic()
    parent = setup.start_pipeline(setup.recipe())
    sft = wait_for_training(setup, parent, 400)
    trainers = processes_of_run(sft["id"], tools_only=True)
    down_at = time.time()
    setup.cluster.stop_server()
    assert setup.cluster.postgres is None or \
        setup.cluster.postgres.psql(f"SELECT state_type FROM flow_run WHERE id = '{sft['id']}'") == "RUNNING"
    time.sleep(5)
    training_through = any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in trainers)
    setup.cluster.start_server()
    up_at = time.time()
    final = setup.wait_state(parent, {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}, 900)
    endpoint = setup.endpoint_record() if (setup.root / "store/serving/tiny-demo/endpoint.json").is_file() else {}
    return FirstRun(parent=parent, sft=sft["id"], down_at=down_at, up_at=up_at, training_through=training_through,
                    run_s=time.monotonic() - started, final=final, endpoint=endpoint)
