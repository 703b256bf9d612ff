"""The Prefect UI as users see it, on the production database, in a real browser.

The session's distributed cluster (tests/distributed.py: the two ``ktflow worker`` "hosts" on a
Prefect server backed by a throwaway PostgreSQL cluster) and its first pipeline run, during
whose SFT stage the server was stopped and started again (conftest.py's ``first_run``): the
shipped recipes are one-click deployments whose "Custom run" form is pre-filled; the run
completed across the restart with nothing lost or done twice; then Debian's Chromium opens the
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
from datetime import datetime
from pathlib import Path

import pytest
from browser import Browser, browser_skip_reason, chromium
from distributed import SERVE, STAGES, TRAIN, TRAIN_STAGES, FirstRun, Setup
from prefect_cluster import REPO, postgres_skip_reason

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (REPO / ".venv-train").exists() or not (REPO / ".venv-serve").exists(),
                       reason="toolchains not installed (make test installs them)"),
    pytest.mark.skipif(postgres_skip_reason() is not None, reason=str(postgres_skip_reason())),
]

# Prefect's log worker sends what it has queued every PREFECT_LOGGING_TO_API_BATCH_INTERVAL (2 s by
# default) and drops a batch it could not send. A line can be lost if it was queued by then: emitted
# at most one interval before the server went down, with a second of room for a loaded box.
LOG_BATCH_S = 2.0 + 1.0


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


@pytest.fixture(autouse=True)
def _on_postgresql(setup: Setup) -> None:
    if setup.cluster.postgres is None:
        pytest.skip("the session's Prefect server runs on SQLite (KTFLOW_TEST_DATABASE=sqlite): these tests "
                    "are about PostgreSQL, the production database")


def ui_url(setup: Setup, path: str) -> str:
    return setup.cluster.api_url.removesuffix("/api") + path


# --------------------------------------------------------------------------- one click


def test_each_shipped_recipe_is_a_one_click_deployment_with_the_recipe_as_its_form_defaults(
        setup: Setup, browser: Browser) -> None:
    from ktflow.recipe import load_recipe
    from ktflow.recipe_deployments import recipe_parameters, shipped_recipe_files

    pg = setup.cluster.postgres
    assert pg is not None
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


def _timestamp(log: dict) -> float:
    return datetime.fromisoformat(log["timestamp"].replace("Z", "+00:00")).timestamp()


def test_the_pipeline_on_postgresql_completes_across_a_server_restart_in_the_middle_of_sft(
        setup: Setup, first_run: FirstRun) -> None:
    """What a user relies on after a server restart mid-SFT: the run completes (``first_run``
    fails with its own error otherwise), nothing runs twice, the stage's progress and summary
    reach the server, and every log line emitted while the server was up is delivered."""
    from ktflow.host.pools import pool_for_stage

    assert setup.cluster.postgres is not None
    parent, sft = first_run.parent, first_run.sft
    # Nothing was done twice: one child run per stage, each completed; SFT was not resumed or redone.
    children = setup.children(parent)
    flows = [setup.cluster.api("GET", f"/flows/{child['flow_id']}")["name"] for child in children]  # type: ignore[index]
    assert sorted(flows) == sorted(f"ktflow-{stage}" for stage in STAGES), flows
    assert all(child["state_type"] == "COMPLETED" for child in children), [c["state_type"] for c in children]
    assert [c["id"] for c, f in zip(children, flows) if f == "ktflow-sft"] == [sft]
    recipe = setup.recipe()
    summary = setup.summary(parent)
    assert "resumed from" not in summary["sft"] and f"({recipe['sft']['max_steps']} steps)" in summary["sft"], summary
    assert summary["evaluate"].startswith("adapter applied: True"), summary["evaluate"]
    # The stage's progress and summary went through Prefect's retried client calls: they are the server's.
    [progress] = setup.artifacts(sft, "sft-progress")
    assert float(progress["data"]) == 100.0
    [sft_summary] = setup.artifacts(sft, "sft-summary")
    assert f"| {recipe['sft']['max_steps']} |" in sft_summary["data"], sft_summary["data"]

    # The log: every "step N/M loss" line (one each logging_steps) emitted while the server was up
    # reached it. A missing line must have been emitted inside the outage (or queued just before
    # it): between the delivered lines around it, a span that meets [down - one batch, up].
    every = recipe["sft"]["logging_steps"]
    expected = list(range(every, recipe["sft"]["max_steps"] + 1, every))
    delivered: dict[int, float] = {}
    for log in setup.logs(sft):
        if m := re.search(r"step (\d+)/\d+ loss", log["message"]):
            delivered.setdefault(int(m.group(1)), _timestamp(log))
    assert set(delivered) <= set(expected), sorted(delivered)
    missing = [step for step in expected if step not in delivered]
    lost_from, lost_to = first_run.down_at - LOG_BATCH_S, first_run.up_at
    for step in missing:
        before = [delivered[s] for s in expected if s < step and s in delivered]
        after = [delivered[s] for s in expected if s > step and s in delivered]
        emitted_from, emitted_to = max(before, default=float("-inf")), min(after, default=float("inf"))
        assert emitted_from <= lost_to and emitted_to >= lost_from, (
            f"the log line of step {step} never reached the server, though it was emitted between "
            f"{emitted_from:.1f} and {emitted_to:.1f}, outside the outage [{lost_from:.1f}, {lost_to:.1f}]; "
            f"delivered: {sorted(delivered)}")
    if missing:
        print(f"\nlog lines of steps {missing} (emitted while the server was down) did not reach it")
    # Each stage ran on the worker of its pool.
    where = setup.stage_hosts(parent)
    assert set(where) == set(STAGES)
    for stage, row in where.items():
        host = TRAIN if stage in TRAIN_STAGES else SERVE
        assert (row["host"], row["pool"]) == (host, pool_for_stage(stage).name), row  # type: ignore[arg-type]
    # The rows are PostgreSQL's.
    assert setup.cluster.postgres.psql(f"SELECT state_type FROM flow_run WHERE id = '{parent}'") == "COMPLETED"
    print(f"\ndistributed run on PostgreSQL with a server restart: {first_run.run_s:.0f} s "
          f"(server down {first_run.up_at - first_run.down_at:.1f} s, trainer still training when it came back: "
          f"{first_run.training_through})")


# --------------------------------------------------------------------------- the run page


def test_the_finished_run_page_shows_stages_loss_curve_evaluation_endpoint_and_hosts(
        setup: Setup, first_run: FirstRun, browser: Browser) -> None:
    # The SFT stage's page shows its progress artifact (live while it runs; 100 % once done).
    browser.get(ui_url(setup, f"/runs/flow-run/{first_run.sft}"))
    browser.open_tab("Artifacts", "the sft-progress artifact", lambda: "sft-progress" in browser.text())
    browser.screenshot("04-sft-progress")

    parent = first_run.parent
    where = setup.stage_hosts(parent)
    browser.get(ui_url(setup, f"/runs/flow-run/{parent}"))
    browser.wait("the run's page", lambda: "Completed" in (text := browser.text()) and "ktflow-control" in text
                 and "Finished in state" in text)
    time.sleep(3)  # the run graph (a canvas) draws after the data arrives
    browser.screenshot("05-run-page")
    browser.open_tab("Artifacts", "the run's report card", lambda: "pipeline-report" in browser.text())
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
        if stage in where:
            assert cell[stage]["host"] == where[stage]["host"], cell[stage]
            assert cell[stage]["pool"] == where[stage]["pool"], cell[stage]
    assert cell["sft"]["outcome"] == "ran" and cell["serve"]["outcome"] == "ran"
    # The loss curve is an image in the page (not a link the browser cannot open), loaded.
    loaded = [i for i in browser.images() if i["alt"] == "training loss"]
    assert loaded and loaded[0]["complete"] and loaded[0]["width"] > 100 and loaded[0]["height"] > 100, browser.images()
    assert loaded[0]["src"].startswith("data:image/png;base64,")
    # The evaluation numbers are the report's.
    # The version this run judged (later tests of the session judge others: each has its own report).
    version = re.search(r"candidate v(\d+):", setup.summary(parent)["evaluate"])
    assert version, setup.summary(parent)["evaluate"]
    report = json.loads((setup.root / f"store/eval/tiny-demo/v{version.group(1)}/report.json").read_text())
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
    assert first_run.endpoint["url"] in browser.text()

    # The SFT stage's own loss-curve artifact is an image in the page too (it was a file:// link).
    [curve] = setup.artifacts(first_run.sft, "sft-loss-curve")
    browser.get(ui_url(setup, f"/artifacts/artifact/{curve['id']}"))
    image = browser.wait("the stage's loss curve", lambda: [i for i in browser.images()
                                                             if i["alt"] == "training loss" and i["complete"]])
    assert image[0]["width"] > 100 and image[0]["height"] > 100, image
    browser.screenshot("08-sft-loss-curve")
    print(f"\nrun report screenshot: {shot}")
