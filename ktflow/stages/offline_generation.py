"""Chat answers from a base model + LoRA adapter without serving it: LlamaFactory's ``ChatModel``
in the training toolchain, through the driver :mod:`ktflow._drivers.offline_chat`.

The driver gets the same LlamaFactory inference args the CPU endpoint gets
(:func:`ktflow.stages.serve.render_llamafactory_api`'s third element) and turns each OpenAI-style request
into the ``ChatModel.chat`` call that ``llamafactory-cli api`` makes for it, so at temperature 0
an offline answer is the served endpoint's answer. The tool run is a :func:`ktflow.host.process.run_tool`
child: it is stopped with its whole tree if the caller fails, times out, is cancelled or dies.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ktflow._drivers import offline_chat as driver
from ktflow.errors import HostRequirementError, InvalidInputError, KtflowError, OfflineGenerationError, ToolError
from ktflow.host.process import ThrottledLines, ktflow_pythonpath, run_tool
from ktflow.store import atomic_write_json

PLAN_NAME = "offline-plan.json"
OUT_NAME = "offline-answers.json"
LOG_NAME = "offline-chat.log"
TAIL_LINES = 20


def generate_offline(
    train_python: Path,
    infer_config: dict[str, Any],
    requests: list[dict[str, Any]],
    *,
    work_dir: Path,
    env: dict[str, str] | None = None,
    log: Callable[[str], None] | None = None,
    timeout_s: float = 3600,
) -> list[dict[str, Any]]:
    """Answer ``requests`` with the model ``infer_config`` describes, loaded once, in the training toolchain.

    Args:
        train_python: the training toolchain's python (LlamaFactory 0.9.5).
        infer_config: LlamaFactory inference args, as :func:`ktflow.stages.serve.render_llamafactory_api`
            returns them (``model_name_or_path``, ``adapter_name_or_path``, ``template``, ...).
        requests: ``{"messages": [{"role", "content"}, ...], "max_tokens": int, "temperature": float}``
            each, as for an OpenAI chat completion (optional ``top_p``, ``do_sample``,
            ``presence_penalty``, ``stop`` are passed on as LlamaFactory's API passes them).
        work_dir: where the plan, the answers and the driver's log (``offline-chat.log``) go.
        env: variables set on top of the inherited environment (e.g. the recipe's
            ``toolchains.train.env``); ``HF_HUB_OFFLINE=1`` is always set.
        log: receives a line per answered request, and the tool's output (throttled).
        timeout_s: the driver (model load included) is stopped after this many seconds.

    Returns:
        One ``{"text", "seconds", "completion_tokens", "finish_reason"}`` per request, in order;
        ``completion_tokens`` counts what the API's ``usage.completion_tokens`` counts.

    Raises:
        InvalidInputError: a request LlamaFactory's API would refuse (nothing was started).
        HostRequirementError: ``train_python`` does not exist.
        OfflineGenerationError: the driver failed or timed out (its last output lines are in the message).
    """
    train_python = Path(train_python).absolute()  # not resolved: a venv's python is a symlink to the base
    if not train_python.exists():
        raise HostRequirementError("toolchains.train.python", f"{train_python} does not exist",
                                   "install the training toolchain (make train-env)")
    plan = _checked_plan(infer_config, requests)
    work_dir = Path(work_dir).absolute()
    work_dir.mkdir(parents=True, exist_ok=True)
    plan_path, out_path, log_path = work_dir / PLAN_NAME, work_dir / OUT_NAME, work_dir / LOG_NAME
    out_path.unlink(missing_ok=True)  # never return an earlier run's answers
    atomic_write_json(plan_path, plan)

    tail, errors, on_line = _driver_events(log)

    with ktflow_pythonpath() as pkg_dir:
        child_env = {**os.environ, **(env or {}), "PYTHONPATH": pkg_dir, "PYTHONUNBUFFERED": "1",
                     "HF_HUB_OFFLINE": "1"}
        argv = [str(train_python), "-m", "ktflow._drivers.offline_chat", "--plan", str(plan_path),
                "--out", str(out_path)]
        try:
            run_tool(argv, env=child_env, log_path=log_path, on_line=on_line, timeout_s=timeout_s)
        except ToolError as exc:
            what = errors[-1] if errors else f"the driver exited with status {exc.returncode}"
            raise OfflineGenerationError(f"offline generation failed: {what}", list(tail), log_path) from None
        except KtflowError as exc:  # ran past timeout_s, or could not start
            raise OfflineGenerationError(f"offline generation failed: {exc}", list(tail), log_path) from None
    return _read_answers(out_path, len(plan["requests"]), list(tail), log_path)


def _checked_plan(infer_config: dict[str, Any], requests: list[dict[str, Any]]) -> dict[str, Any]:
    """The driver's plan, refused here (nothing started) when LlamaFactory's API would refuse a request."""
    plan = {"infer_config": dict(infer_config), "requests": list(requests)}
    try:
        driver.check_plan(plan)
    except driver.PlanError as exc:
        raise InvalidInputError("offline generation", str(exc),
                                "send what LlamaFactory's API accepts: an optional leading system message, then "
                                "user/assistant turns ending with a user turn") from None
    return plan


def _driver_events(log: Callable[[str], None] | None
                   ) -> tuple[deque[str], list[str], Callable[[str], None]]:
    """The driver's output parser: its last plain lines, the errors it reported, and the callback
    that forwards progress to ``log``."""
    tail: deque[str] = deque(maxlen=50)
    errors: list[str] = []
    raw = ThrottledLines(log) if log is not None else None

    def on_line(line: str) -> None:
        if not line.startswith(driver.EVENT_PREFIX):
            tail.append(line)
            if raw is not None:
                raw(line)
            return
        try:
            event = json.loads(line[len(driver.EVENT_PREFIX):])
        except ValueError:
            tail.append(line)
            return
        if "error" in event:
            errors.append(str(event["error"]))
        elif "done" in event and log is not None:
            log(f"offline generation: {event['done']}/{event['total']} answered")

    return tail, errors, on_line


def _read_answers(out_path: Path, expected: int, tail: list[str], log_path: Path) -> list[dict[str, Any]]:
    try:
        answers = json.loads(out_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OfflineGenerationError(f"offline generation ended without readable answers in {out_path}: {exc}",
                                     tail, log_path) from None
    if (not isinstance(answers, list) or len(answers) != expected
            or not all(isinstance(a, dict) and isinstance(a.get("text"), str) for a in answers)):
        raise OfflineGenerationError(f"offline generation wrote {out_path} without one answer per request "
                                     f"({expected} expected)", tail, log_path)
    return answers

