"""tasks._common.ProgressReporter: the work never waits on the API, and no update is lost to an outage.

The Prefect calls are replaced here by an API that refuses for a while, as a restarting server
does (the real outage is tests/test_ui.py's restart test: the SFT progress ends at 100 %).
"""

from __future__ import annotations

import threading
import time

import pytest

import tasks._common as common


class FlakyApi:
    """Refuses every update until ``up.set()``; records what it took."""

    def __init__(self) -> None:
        self.up = threading.Event()
        self.taken: list[float] = []
        self.refused = 0

    def update(self, artifact_id: object, progress: float) -> None:
        if not self.up.is_set():
            self.refused += 1
            raise ConnectionRefusedError("server down")
        self.taken.append(progress)


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str, *args: object) -> None:
        self.lines.append(msg % args)

    warning = info


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> tuple[FlakyApi, Log]:
    flaky, log = FlakyApi(), Log()
    monkeypatch.setattr(common, "create_progress_artifact", lambda **kw: "artifact-id")
    monkeypatch.setattr(common, "update_progress_artifact", flaky.update)
    monkeypatch.setattr(common, "get_run_logger", lambda: log)
    return flaky, log


def test_an_update_refused_during_an_outage_is_delivered_once_the_api_is_back(api: tuple[FlakyApi, Log]) -> None:
    flaky, log = api
    with common.ProgressReporter("p", "d", interval=0, unit="steps", retry_s=0.05) as progress:
        started = time.monotonic()
        for step in range(1, 11):
            progress(step, 10)  # every call returns at once, the API down or not
        assert time.monotonic() - started < 0.5
        time.sleep(0.3)
        assert flaky.refused >= 2 and not flaky.taken  # still owed, retried
        flaky.up.set()
    assert flaky.taken[-1] == 100.0  # the newest value, not a stale one, and the last one reported
    assert len(flaky.taken) <= 2
    # Each step's log line was written whatever the API did.
    assert [line for line in log.lines if "of 10 steps" in line] == [f"{10.0 * s:.1f}% ({s} of 10 steps)"
                                                                     for s in range(1, 11)]
    assert sum("progress artifact update failed" in line for line in log.lines) == 1


def test_close_gives_up_after_flush_s_and_says_so(api: tuple[FlakyApi, Log]) -> None:
    flaky, log = api
    progress = common.ProgressReporter("p", "d", interval=0, unit="steps", retry_s=0.05, flush_s=0.3)
    progress(5, 10)
    started = time.monotonic()
    progress.close()
    assert time.monotonic() - started < 2.0
    assert not flaky.taken
    assert any("could not be updated to 50.0%" in line for line in log.lines), log.lines
