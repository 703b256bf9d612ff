"""The Prefect UI as users see it, on the production database, in a real browser.

One real distributed run (the two ``ktflow worker`` "hosts" of test_orchestration, its setup
reused) on a Prefect server backed by a throwaway PostgreSQL cluster: the shipped recipes are
one-click deployments whose "Custom run" form is pre-filled; the pipeline runs across both
workers while the server is restarted in the middle of SFT; then Debian's Chromium opens the
finished run's page and the assertions are on what it rendered: the stage table, the loss curve
loaded as an image, the evaluation numbers, the endpoint, where each stage ran.

Screenshots go to $KTFLOW_SCREENSHOTS (default: the test's temporary directory), never into
the checkout; the path is printed.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from browser import Browser, browser_skip_reason, chromium
from prefect_cluster import DATABASE_ENV, REPO, postgres_skip_reason
from test_orchestration import (
    SERVE,
    TRAIN,
    TRAIN_STAGES,
    Setup,
    _processes_of_run,
    _wait_for_training,
    setup,  # noqa: F401  (the module's cluster: a fixture reused, not copied)
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (REPO / ".venv-train").exists() or not (REPO / ".venv-serve").exists(),
                       reason="toolchains not installed (make test installs them)"),
    pytest.mark.skipif(postgres_skip_reason() is not None, reason=str(postgres_skip_reason())),
]

STAGES = ["download", "dequantize", "sft", "convert-lora", "quantize-int8", "serve", "evaluate"]


@pytest.fixture(scope="module", autouse=True)
def _on_postgres() -> Iterator[None]:
    """This module's server runs on PostgreSQL whatever KTFLOW_TEST_DATABASE says (autouse: it is
    set up before the cluster)."""
    before = os.environ.get(DATABASE_ENV)
    os.environ[DATABASE_ENV] = "postgres"
    yield
    if before is None:
        os.environ.pop(DATABASE_ENV, None)
    else:
        os.environ[DATABASE_ENV] = before


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(os.environ.get("KTFLOW_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    print(f"\nscreenshots: {path}")
    return path


@pytest.fixture(scope="module")
def browser(shots: Path) -> Iterator[Browser]:
    reason = browser_skip_reason()
    if reason:
        pytest.skip(reason)
    with chromium(shots) as b:
        yield b


@pytest.fixture(scope="module")
def finished(setup: Setup) -> dict:  # noqa: F811
    """Filled by the restart test: the parent run it finished (the page the browser test reads)."""
    return {}


def ui_url(setup: Setup, path: str) -> str:  # noqa: F811
    return setup.cluster.api_url.removesuffix("/api") + path


def short_recipe(setup: Setup) -> dict:  # noqa: F811
    """The module's recipe (the demo's) with a shorter SFT: this test is about the server and the
    page, not about what 400 steps learn, so the demo's promotion gate is reported, not enforced."""
    recipe = setup.recipe()
    recipe["sft"].update(max_steps=60, save_steps=30)
    recipe["evaluation"].update(gate_metric=None, gate_min_gain=0)
    return recipe


def all_logs(setup: Setup, flow_run_id: str) -> list[dict]:  # noqa: F811
    logs: list[dict] = []
    while True:
        page = setup.cluster.api("POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}},
                                                          "sort": "TIMESTAMP_ASC", "limit": 200, "offset": len(logs)})
        logs += page  # type: ignore[arg-type]
        if len(page) < 200:  # type: ignore[arg-type]
            return logs


def children_of(setup: Setup, parent: str) -> list[dict]:  # noqa: F811
    return setup.cluster.api("POST", "/flow_runs/filter", {  # type: ignore[return-value]
        "flow_runs": {"parent_flow_run_id": {"any_": [parent]}}, "sort": "EXPECTED_START_TIME_ASC"})


# --------------------------------------------------------------------------- one click


def test_each_shipped_recipe_is_a_one_click_deployment_with_the_recipe_as_its_form_defaults(
        setup: Setup, browser: Browser) -> None:  # noqa: F811
    from ktflow.recipe import load_recipe
    from ktflow.recipe_deployments import recipe_parameters, shipped_recipe_files

    pg = setup.cluster.postgres
    assert pg is not None, "the server of this module runs on PostgreSQL"
    files = shipped_recipe_files(REPO)
    assert len(files) >= 6
    for file in files:
        name = recipe_parameters(file)["name"]
        deployment = setup.cluster.api("GET", f"/deployments/name/ktflow-dispatch/{name}")
        assert deployment["parameters"] == {"recipe": load_recipe(REPO / file).model_dump(mode="json")}, file  # type: ignore[index]
        assert deployment["work_pool_name"] == "ktflow-control"  # type: ignore[index]
    # What the server keeps is in PostgreSQL, under the non-superuser role that owns it.
    assert int(pg.psql("SELECT count(*) FROM deployment WHERE name = 'tiny-demo'")) == 1
    assert pg.psql("SELECT rolsuper FROM pg_roles WHERE rolname = 'prefect'") == "f"
    assert pg.psql("SELECT pg_catalog.pg_get_userbyid(datdba) FROM pg_database WHERE datname = 'prefect'") == "prefect"

    tiny = setup.cluster.api("GET", "/deployments/name/ktflow-dispatch/tiny-demo")
    recipe = load_recipe(REPO / "recipes/tiny-demo.yaml")
    # "Custom run": the typed form, every field's help text, the recipe's values filled in.
    browser.get(ui_url(setup, f"/deployments/deployment/{tiny['id']}/run"))  # type: ignore[index]
    browser.wait("the recipe form", lambda: "Lora Rank" in browser.text())
    values = browser.wait("the recipe's values in the form",
                          lambda: (v := browser.input_values()) and recipe.sft.lora_target in v and v)
    for expected in (recipe.name, str(recipe.store.root), str(recipe.source.local_path), recipe.sft.lora_target,
                     str(recipe.serving.port), recipe.serving.served_model_name):
        assert expected in values, (expected, values)
    text = browser.text()
    for help_text in ("GPUs for training (accelerate num_processes); 0 = CPU", "A local or NFS checkpoint directory",
                      "Checkpoint interval: what a crash can cost"):
        assert help_text in text
    browser.screenshot("01-custom-run-form-prefilled")

    # "Quick run": one click makes a run with the recipe as it ships. The control pool is paused
    # so that no worker takes it (it would run the demo in the checkout); it is deleted after.
    setup.cluster.prefect("work-pool", "pause", "ktflow-control")
    try:
        before = {run["id"] for run in setup.flow_runs("ktflow-dispatch")}
        browser.get(ui_url(setup, f"/deployments/deployment/{tiny['id']}"))  # type: ignore[index]
        browser.click_text("button", "Run")
        browser.screenshot("02-deployment-run-menu")
        browser.click_text("button", "Quick run")
        # The flow's recipe parameter is required, so Prefect's Quick run shows its parameters
        # (the recipe, pre-filled) for a last look: one more click on Run.
        browser.wait("the quick run's parameters", lambda: "Run Deployment" in browser.text() and
                     "Lora Rank" in browser.text())
        browser.screenshot("03-quick-run-confirm")
        browser.click_text(".p-modal__footer button", "Run")
        created = browser.wait("the quick run's flow run",
                               lambda: [r for r in setup.flow_runs("ktflow-dispatch") if r["id"] not in before])
        [run] = created
        assert run["deployment_id"] == tiny["id"]  # type: ignore[index]
        assert run["parameters"]["recipe"] == recipe.model_dump(mode="json")  # the other parameters: their defaults
        setup.cluster.api("DELETE", f"/flow_runs/{run['id']}")
    finally:
        setup.cluster.prefect("work-pool", "resume", "ktflow-control")


# --------------------------------------------------------------------------- PostgreSQL, restart


def test_the_pipeline_on_postgresql_completes_across_a_server_restart_in_the_middle_of_sft(
        setup: Setup, finished: dict, request: pytest.FixtureRequest) -> None:  # noqa: F811
    from ktflow.host.pools import pool_for_stage

    started = time.monotonic()
    parent = setup.start_pipeline(short_recipe(setup))
    sft = _wait_for_training(setup, parent, 400)
    # The server goes down while the SFT stage trains on the training host's worker.
    trainers = _processes_of_run(sft["id"], tools_only=True)
    setup.cluster.stop_server()
    down = time.monotonic()
    assert setup.cluster.postgres is not None
    assert setup.cluster.postgres.psql(f"SELECT state_type FROM flow_run WHERE id = '{sft['id']}'") == "RUNNING"
    time.sleep(5)
    training_through = any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in trainers)
    setup.cluster.start_server()
    restarted_after = time.monotonic() - down
    # The stage's page shows its progress (live while it runs; 100% once done). Without a
    # browser this test still checks the server and the run; the page tests below then skip.
    if browser_skip_reason() is None:
        browser: Browser = request.getfixturevalue("browser")
        browser.get(ui_url(setup, f"/runs/flow-run/{sft['id']}"))
        browser.click_text("li.p-tab", "Artifacts")
        browser.wait("the sft-progress artifact", lambda: "sft-progress" in browser.text())
        browser.screenshot("04-sft-progress")

    final = setup.wait_state(parent, {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}, 600)
    assert final["state_type"] == "COMPLETED", final["state"]
    # Nothing was done twice: one child run per stage, each completed; SFT was not resumed or redone.
    children = children_of(setup, parent)
    flows = [setup.cluster.api("GET", f"/flows/{child['flow_id']}")["name"] for child in children]  # type: ignore[index]
    assert sorted(flows) == sorted(f"ktflow-{stage}" for stage in STAGES), flows
    assert all(child["state_type"] == "COMPLETED" for child in children), [c["state_type"] for c in children]
    assert [c["id"] for c, f in zip(children, flows) if f == "ktflow-sft"] == [sft["id"]]
    recipe = short_recipe(setup)
    summary = setup.summary(parent)
    assert "resumed from" not in summary["sft"] and f"({recipe['sft']['max_steps']} steps)" in summary["sft"], summary
    assert summary["evaluate"].startswith("adapter applied: True"), summary["evaluate"]
    # Nothing of the run is lost: the stage's result, artifacts and state are the server's, its
    # progress ended at 100%, and its log reached the server from before the outage and on after
    # it. A log line emitted while the server was down can be dropped by Prefect's log worker (it
    # sends a batch and does not keep one it could not send; seen for steps 5 and 15 with 10
    # delivered between them by a retry), so lines missing from one short window of the run are
    # tolerated, and reported; a log that stopped reaching the server would miss far more.
    every = recipe["sft"]["logging_steps"]
    expected = sorted(range(every, recipe["sft"]["max_steps"] + 1, every))
    logged = {int(m.group(1)) for log in all_logs(setup, sft["id"])
              if (m := re.search(r"step (\d+)/\d+ loss", log["message"]))}
    missing = [step for step in expected if step not in logged]
    if missing:
        window = expected.index(missing[-1]) - expected.index(missing[0]) + 1
        assert window <= 4 and expected[-1] in logged and len(logged) >= len(expected) - 4, (missing, sorted(logged))
        print(f"\nlog lines of steps {missing} (emitted while the server was down) did not reach it")
    [progress] = setup.artifacts(sft["id"], "sft-progress")
    assert float(progress["data"]) == 100.0
    # Each stage ran on the worker of its pool.
    where = {}
    for artifact in setup.artifacts(key_like="stage-host-"):
        if artifact["flow_run_id"] in {c["id"] for c in children}:
            [row] = json.loads(artifact["data"]) if isinstance(artifact["data"], str) else artifact["data"]
            where[row["stage"]] = row
    assert set(where) == set(STAGES)
    for stage, row in where.items():
        host = TRAIN if stage in TRAIN_STAGES else SERVE
        assert (row["host"], row["pool"]) == (host, pool_for_stage(stage).name), row  # type: ignore[arg-type]
    # The rows are PostgreSQL's.
    assert setup.cluster.postgres is not None
    assert setup.cluster.postgres.psql(f"SELECT state_type FROM flow_run WHERE id = '{parent}'") == "COMPLETED"
    finished.update(parent=parent, sft=sft["id"], where=where, restart_s=restarted_after,
                    run_s=time.monotonic() - started)
    print(f"\ndistributed run on PostgreSQL with a server restart: {finished['run_s']:.0f} s "
          f"(server down {restarted_after:.1f} s, trainer still training when it came back: {training_through})")


# --------------------------------------------------------------------------- the run page


def test_the_finished_run_page_shows_stages_loss_curve_evaluation_endpoint_and_hosts(
        setup: Setup, finished: dict, browser: Browser) -> None:  # noqa: F811
    if not finished:
        pytest.fail("the run of the restart test did not finish; nothing to look at")
    parent = finished["parent"]
    browser.get(ui_url(setup, f"/runs/flow-run/{parent}"))
    browser.wait("the run's page", lambda: "Completed" in (text := browser.text()) and "ktflow-control" in text
                 and "Finished in state" in text)
    time.sleep(3)  # the run graph (a canvas) draws after the data arrives
    browser.screenshot("05-run-page")
    browser.click_text("li.p-tab", "Artifacts")
    browser.wait("the run's report card", lambda: "pipeline-report" in browser.text())
    browser.screenshot("06-run-artifacts")
    browser.click_text(".artifact-card, .p-card, a, div", "pipeline-report")
    browser.wait("the report's stage table", lambda: any(t and t[0][:2] == ["stage", "outcome"] for t in browser.tables()))
    browser.wait("the loss curve to load", lambda: any(i["complete"] and i["width"] > 0 for i in browser.images()))
    shot = browser.screenshot("07-run-report")
    browser.dump("07-run-report", {"tables": browser.tables(), "images": browser.images()})

    tables = browser.tables()
    [stages] = [t for t in tables if t and t[0][:2] == ["stage", "outcome"]]
    header, rows = stages[0], stages[1:]
    assert [row[0] for row in rows] == STAGES, rows
    cell = {row[0]: dict(zip(header, row)) for row in rows}
    for stage in STAGES:
        assert cell[stage]["outcome"] in ("ran", "skipped", "cache hit"), cell[stage]
        assert cell[stage]["why"] not in ("", "-"), cell[stage]
        if stage in finished["where"]:
            assert cell[stage]["host"] == finished["where"][stage]["host"], cell[stage]
            assert cell[stage]["pool"] == finished["where"][stage]["pool"], cell[stage]
    assert cell["sft"]["outcome"] == "ran" and cell["serve"]["outcome"] == "ran"
    # The loss curve is an image in the page (not a link the browser cannot open), loaded.
    loaded = [i for i in browser.images() if i["alt"] == "training loss"]
    assert loaded and loaded[0]["complete"] and loaded[0]["width"] > 100 and loaded[0]["height"] > 100, browser.images()
    assert loaded[0]["src"].startswith("data:image/png;base64,")
    # The evaluation numbers are the report's.
    # The version this run judged: the newest report (each version's lives in eval/<recipe>/v<N>/).
    newest = max((setup.root / "store/eval/tiny-demo").glob("v*/report.json"), key=lambda p: p.stat().st_mtime)
    report = json.loads(newest.read_text())
    [evaluation] = [t for t in tables if t and t[0][:3] == ["metric", "base", "tuned"]]
    # The style row is named after the recipe's marker (``style ('nya~')``); the report keys it ``style``.
    from ktflow.recipe import load_recipe
    style = load_recipe(REPO / "recipes/tiny-demo.yaml").evaluation.style
    metric_of = {style.label: "style"} if style is not None else {}
    shown = {metric_of.get(row[0], row[0]): (row[1], row[2]) for row in evaluation[1:]}
    assert shown, evaluation
    assert set(shown) == set(report["base"]["metrics"]), (shown, report["base"]["metrics"])
    for metric, (base, tuned) in shown.items():
        assert float(base) == pytest.approx(report["base"]["metrics"][metric], abs=0.006), (metric, base)
        assert float(tuned) == pytest.approx(report["tuned"]["metrics"][metric], abs=0.006), (metric, tuned)
    endpoint = setup.endpoint_record()
    assert endpoint["url"] in browser.text()

    # The SFT stage's own loss-curve artifact is an image in the page too (it was a file:// link).
    [curve] = setup.artifacts(finished["sft"], "sft-loss-curve")
    browser.get(ui_url(setup, f"/artifacts/artifact/{curve['id']}"))
    image = browser.wait("the stage's loss curve", lambda: [i for i in browser.images()
                                                             if i["alt"] == "training loss" and i["complete"]])
    assert image[0]["width"] > 100 and image[0]["height"] > 100, image
    browser.screenshot("08-sft-loss-curve")
    print(f"\nrun report screenshot: {shot}")
