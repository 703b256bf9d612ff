"""Routing as data: pools, ``ktflow worker``, and deployments/prefect.yaml agreeing with them."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ktflow.errors import HostRequirementError
from ktflow.host.hardware import HostInfo, NumaNode
from ktflow.host.pools import CONTROL_POOL, WORK_POOLS, pool_for_stage
from ktflow.host.worker import WorkerLaunch, choose_pools, run_workers, worker_launches
from ktflow.planning.stage_plan import STAGE_ORDER

REPO = Path(__file__).resolve().parent.parent
PREFECT_YAML = yaml.safe_load((REPO / "deployments/prefect.yaml").read_text())


def host(variant: str) -> HostInfo:
    return HostInfo(
        hostname="h", cpu_model="x", cpu_flags=[], cpu_variant=variant, cpu_variant_overridden=False,
        physical_cores=16, logical_cores=32, numa_nodes=1,
        numa=[NumaNode(id=0, cpus=list(range(32)), mem_total_bytes=1 << 36, mem_free_bytes=1 << 36)],
        ram_bytes=1 << 36, ram_available_bytes=1 << 36, gpus=[], disk_path="/", disk_free_bytes=1 << 40,
        shm_bytes=1 << 33, shm_free_bytes=1 << 33,
    )


def deployments_by_entrypoint() -> dict[str, dict]:
    """The stage, parent and retrain deployments (the shipped recipes' one-click deployments of the
    parent flow are checked on their own below)."""
    from ktflow.recipe_deployments import recipe_deployment_file

    return {d["entrypoint"]: d for d in PREFECT_YAML["deployments"] if recipe_deployment_file(d) is None}


def test_every_stage_has_one_deployment_on_its_pool_named_after_the_pool() -> None:
    from flows.pipeline import stage_deployment
    from flows.stages import STAGE_FLOWS, stage_flow_entrypoint

    stage_deployments = [d for d in PREFECT_YAML["deployments"] if d["entrypoint"].startswith("flows/stages.py:")]
    pools_of: dict[str, list[str]] = {}
    for deployment in stage_deployments:
        assert deployment["name"] == deployment["work_pool"]["name"]
        pools_of.setdefault(deployment["entrypoint"], []).append(deployment["name"])
    for stage in STAGE_ORDER:
        pool = pool_for_stage(stage).name
        # Its own pool, and the pools that make their own base weights (hosts without a shared store).
        expected = [pool] + [p.name for p in WORK_POOLS if stage in p.prepares]
        assert pools_of[stage_flow_entrypoint(stage)] == expected, stage
        assert stage_deployment(stage) == f"{STAGE_FLOWS[stage].name}/{pool}"
        for other in expected[1:]:
            assert stage_deployment(stage, other) == f"{STAGE_FLOWS[stage].name}/{other}"
    pools_in_yaml = {d["work_pool"]["name"] for d in PREFECT_YAML["deployments"]}
    assert pools_in_yaml == {pool.name for pool in WORK_POOLS}


def test_parent_and_retrain_run_on_the_control_pool_with_an_inactive_schedule_and_the_dataset_trigger() -> None:
    deployments = deployments_by_entrypoint()
    parent = deployments["flows/pipeline.py:pipeline_distributed"]
    retrain = deployments["flows/pipeline.py:retrain"]
    assert parent["work_pool"]["name"] == retrain["work_pool"]["name"] == CONTROL_POOL
    [schedule] = retrain["schedules"]
    assert schedule["active"] is False and len(schedule["cron"].split()) == 5
    [trigger] = retrain["triggers"]
    assert trigger["expect"] == ["dataset.version.published"]
    from flows.events import DATASET_PUBLISHED
    from flows.pipeline import retrain as retrain_flow

    assert trigger["expect"] == [DATASET_PUBLISHED]
    assert set(trigger["parameters"]) <= set(inspect.signature(retrain_flow.fn).parameters)


def test_every_entrypoint_is_a_flow_and_stage_flows_take_their_tasks_parameters() -> None:
    import importlib

    from flows.stages import STAGE_FLOWS, STAGE_TASKS

    for deployment in PREFECT_YAML["deployments"]:
        path, name = deployment["entrypoint"].split(":")
        module = path.removesuffix(".py").replace("/", ".")
        flow = getattr(importlib.import_module(module), name)
        assert hasattr(flow, "fn") and flow.name.startswith("ktflow-")
    for stage in STAGE_ORDER:
        # The parent sends a stage the same keyword arguments whether it runs it here or dispatches it.
        flow_params = inspect.signature(STAGE_FLOWS[stage].fn).parameters
        task_params = inspect.signature(STAGE_TASKS[stage].fn).parameters
        assert list(flow_params)[:len(task_params)] == list(task_params), stage
        # And, dispatched, where its paths are: the recipe's store root, the artifact to fetch first.
        extra = list(flow_params)[len(task_params):]
        assert set(extra) <= {"store_root", "fetch"}, stage
        assert all(flow_params[name].default is None for name in extra), stage


def test_every_shipped_recipe_has_a_one_click_deployment_of_the_parent_named_after_it() -> None:
    from ktflow.recipe import load_recipe
    from ktflow.recipe_deployments import PARENT_ENTRYPOINT, STEP, STEP_ID, recipe_deployment_file, shipped_recipe_files

    by_file = {}
    for deployment in PREFECT_YAML["deployments"]:
        file = recipe_deployment_file(deployment)
        if file is None:
            continue
        assert file not in by_file, f"{file} has two deployments"
        by_file[file] = deployment
    files = shipped_recipe_files(REPO)
    assert len(files) >= 6
    missing = sorted(set(files) - set(by_file))
    assert not missing, f"recipes without a deployment in deployments/prefect.yaml: {missing}"
    stale = sorted(set(by_file) - set(files))
    assert not stale, f"deployments of recipe files that do not exist: {stale}"
    for file, deployment in by_file.items():
        assert deployment["name"] == load_recipe(REPO / file).name, file
        assert deployment["entrypoint"] == PARENT_ENTRYPOINT
        assert deployment["work_pool"]["name"] == CONTROL_POOL
        [step] = deployment["build"]
        assert step[STEP]["id"] == STEP_ID
        # The defaults are the build step's output, never a copy that could drift from the file.
        assert deployment["parameters"] == {"recipe": "{{ %s.recipe }}" % STEP_ID}, file


def test_deploying_a_recipe_deployment_gives_the_recipe_file_as_its_default_parameters() -> None:
    """What ``prefect deploy`` does with an entry: call its build step, template the entry with
    the step's output under its id (Prefect's own templating). The result must be the recipe
    file's JSON, valid as the parent flow's ``recipe`` parameter. (The deploy itself, against a
    real server, is tests/test_ui.py's.)"""
    import importlib

    from prefect.utilities.templating import apply_values

    from flows.pipeline import pipeline_distributed
    from ktflow.recipe import Recipe, load_recipe
    from ktflow.recipe_deployments import recipe_deployment_file

    cwd = os.getcwd()
    os.chdir(REPO)  # as users (and tests/prefect_cluster.py) deploy: from the checkout
    try:
        for deployment in PREFECT_YAML["deployments"]:
            file = recipe_deployment_file(deployment)
            if file is None:
                continue
            [step] = deployment["build"]
            [(fqn, inputs)] = step.items()
            inputs = dict(inputs)
            step_id = inputs.pop("id")
            module, name = fqn.rsplit(".", 1)
            outputs = {step_id: getattr(importlib.import_module(module), name)(**inputs)}
            resolved = apply_values({k: v for k, v in deployment.items() if k != "build"}, outputs)
            expected = load_recipe(REPO / file).model_dump(mode="json")
            assert resolved["parameters"] == {"recipe": expected}, file
            assert Recipe.model_validate(resolved["parameters"]["recipe"]).model_dump(mode="json") == expected
            assert file in resolved["description"]
            assert "recipe" in inspect.signature(pipeline_distributed.fn).parameters
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize(("variant", "joins"), [
    ("amx", ["ktflow-control", "amx-train", "avx512-serve"]),
    ("avx512_bf16", ["ktflow-control", "amx-train", "avx512-serve"]),  # KT 0.7 SFT kernels exist for it
    ("avx512_vbmi", ["ktflow-control", "avx512-serve"]),
    ("avx512_vnni", ["ktflow-control", "avx512-serve"]),
])
def test_a_host_joins_every_pool_it_qualifies_for(variant: str, joins: list[str]) -> None:
    assert [pool.name for pool in choose_pools(host(variant))] == joins


def test_a_pool_the_host_does_not_qualify_for_is_refused_with_the_reason() -> None:
    with pytest.raises(HostRequirementError) as caught:
        choose_pools(host("avx512_vbmi"), ["avx512-serve", "amx-train"])
    message = str(caught.value)
    assert "--pool amx-train" in message and "avx512_bf16" in message and "avx512_vbmi" in message and "Fix:" in message
    with pytest.raises(HostRequirementError, match="is not one of ktflow's pools"):
        choose_pools(host("amx"), ["gpu-serve"])
    with pytest.raises(HostRequirementError, match="qualifies for no stage pool"):
        choose_pools(host("avx2"))


def test_worker_launches_name_host_pool_and_checkout_for_the_flow_runs() -> None:
    launches = worker_launches(choose_pools(host("amx")), host_name="gpu1", checkout=Path("/srv/ktflow"))
    by_pool = {launch.pool: launch for launch in launches}
    train = by_pool["amx-train"]
    assert train.argv[1:] == ["-m", "prefect", "worker", "start", "--pool", "amx-train", "--type", "process",
                              "--name", "gpu1-amx-train", "--limit", "1"]
    assert train.env == {"KTFLOW_HOST_NAME": "gpu1", "KTFLOW_POOL": "amx-train", "KTFLOW_WORKER": "gpu1-amx-train",
                         "KTFLOW_CHECKOUT": "/srv/ktflow"}
    assert "--limit" not in by_pool["avx512-serve"].argv


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ktflow.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_ktflow_worker_cli_refuses_and_lists() -> None:
    refused = cli("worker", "--pool", "amx-train", env={"KT_KERNEL_CPU_VARIANT": "avx2"})
    assert refused.returncode == 2 and "pool amx-train needs" in refused.stderr
    listed = json.loads(cli("worker", "--list", "--json", env={"KT_KERNEL_CPU_VARIANT": "avx512_vnni"}).stdout)
    assert {p["pool"]: p["qualifies"] for p in listed["pools"]} == {
        "ktflow-control": True, "amx-train": False, "avx512-serve": True}
    planned = json.loads(cli("worker", "--dry-run", "--name", "n1", env={"KT_KERNEL_CPU_VARIANT": "amx"}).stdout)
    assert [p["pool"] for p in planned] == ["ktflow-control", "amx-train", "avx512-serve"]


def _sleeper(name: str, exit_after: float | None = None) -> WorkerLaunch:
    code = f"import time,signal,sys; time.sleep({exit_after}); sys.exit(3)" if exit_after else (
        "import signal,sys,time\nsignal.signal(signal.SIGINT, lambda *a: sys.exit(0))\ntime.sleep(120)")
    return WorkerLaunch(pool=name, name=name, argv=[sys.executable, "-c", code], env={})


def test_supervised_workers_stop_together_when_one_exits() -> None:
    started = time.monotonic()
    code = run_workers([_sleeper("a"), _sleeper("b", exit_after=1.0)], log=lambda line: None)
    assert code == 3  # the failed worker's code, so a unit's Restart= restarts the lot
    assert time.monotonic() - started < 30


def test_supervised_workers_stop_on_sigterm() -> None:
    script = (
        "import sys; sys.path.insert(0, %r)\n"
        "from tests.test_deployments import _sleeper\n"
        "from ktflow.host.worker import run_workers\n"
        "print('up', flush=True)\n"
        "sys.exit(run_workers([_sleeper('a'), _sleeper('b')], log=lambda line: None))\n" % str(REPO)
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    time.sleep(1.0)
    import psutil

    children = psutil.Process(proc.pid).children()
    assert len(children) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive
