"""Offline generation (LlamaFactory's ChatModel in the training toolchain, no server) answers what
the served endpoint answers.

Real: the tiny bf16 fixture, a LoRA adapter saved by PEFT itself (random non-zero B, so it changes
the answers), ``llamafactory-cli api`` started by :func:`ktflow.stages.serve.serve` on a free port, and
the driver run with the same infer config the server got. At temperature 0 every answer, its
completion token count and finish reason must be identical.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_convert_lora import save_peft_adapter

from ktflow.errors import InvalidInputError, OfflineGenerationError
from ktflow.recipe import load_recipe
from ktflow.stages.offline_generation import LOG_NAME, generate_offline
from ktflow.stages.serve import free_port, render_llamafactory_api, serve, stop

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"
KEY = "offline-test-key-0123456789"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not TRAIN_PYTHON.exists(), reason="training toolchain not installed (make train-env)"),
]

REQUESTS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "What is a shard?"}], "max_tokens": 12, "temperature": 0.0},
    {"messages": [{"role": "system", "content": "You are a terse assistant."},
                  {"role": "user", "content": "Say hello."}], "max_tokens": 12, "temperature": 0.0},
    {"messages": [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
                  {"role": "user", "content": "Another one?"}], "max_tokens": 12, "temperature": 0.0},
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, fixture_dir) -> Iterator[dict[str, Any]]:
    """The tiny base, a PEFT LoRA adapter on it, the recipe, and the infer config the server gets."""
    from ktflow.demo import write_demo_dataset

    root = tmp_path_factory.mktemp("offline")
    model = fixture_dir("bf16", lm_head_std=0.2)
    adapter = save_peft_adapter(model, root / "adapter")
    data = root / "data"
    write_demo_dataset(data)
    recipe = load_recipe(RECIPES / "tiny-demo.yaml", [
        f"source.local_path={model}", "source.format=bf16", f"dataset.files=[{data / 'train.jsonl'}]",
        f"evaluation.files=[{data / 'eval.jsonl'}]", f"store.root={root / 'store'}",
        f"toolchains.train.python={TRAIN_PYTHON}", "serving.ready_timeout_s=240", f"serving.port={free_port()}",
    ])
    _, _, infer = render_llamafactory_api(recipe, model_dir=model, adapter_dir=adapter, train_python=TRAIN_PYTHON,
                                          config_dir=root / "record")
    yield {"root": root, "model": model, "adapter": adapter, "recipe": recipe, "infer": infer}


def test_offline_answers_equal_the_served_endpoints_at_temperature_0(stack: dict[str, Any]) -> None:
    import openai

    record = stack["root"] / "record"
    endpoint = serve(stack["recipe"], model_dir=stack["model"], adapter_dir=stack["adapter"], record_dir=record,
                     api_key=KEY)
    try:
        client = openai.OpenAI(base_url=endpoint.url, api_key=KEY, max_retries=0, timeout=120)
        served = []
        for request in REQUESTS:  # the call ktflow.stages.evaluate makes for each record
            response = client.chat.completions.create(model=endpoint.model, messages=request["messages"],
                                                      temperature=request["temperature"],
                                                      max_tokens=request["max_tokens"])
            served.append({"text": response.choices[0].message.content, "finish_reason": response.choices[0].finish_reason,
                           "completion_tokens": response.usage.completion_tokens})
        client.close()
    finally:
        stop(record)

    lines: list[str] = []
    work = stack["root"] / "offline"
    offline = generate_offline(TRAIN_PYTHON, stack["infer"], REQUESTS, work_dir=work,
                               env=stack["recipe"].toolchains.train.env,
                               log=lines.append, timeout_s=600)
    assert [{k: a[k] for k in ("text", "finish_reason", "completion_tokens")} for a in offline] == served
    assert all(isinstance(a["seconds"], float) and a["seconds"] > 0 for a in offline)
    assert len({a["text"] for a in offline}) > 1, offline  # the prompts reach the model
    assert [line for line in lines if line.startswith("offline generation:")] == [
        f"offline generation: {i}/3 answered" for i in (1, 2, 3)]
    assert f"Loaded adapter(s): {stack['adapter']}" in (work / LOG_NAME).read_text()  # merged at load, as served


def test_a_missing_adapter_fails_naming_it(stack: dict[str, Any], tmp_path: Path) -> None:
    missing = tmp_path / "no-such-adapter"
    with pytest.raises(OfflineGenerationError, match=r"Can't find 'adapter_config.json' at '.*no-such-adapter'") as err:
        generate_offline(TRAIN_PYTHON, {**stack["infer"], "adapter_name_or_path": str(missing)}, REQUESTS[:1],
                         work_dir=tmp_path / "work", timeout_s=300)
    assert err.value.tail and str(tmp_path / "work" / LOG_NAME) in str(err.value)
    assert not (tmp_path / "work" / "offline-answers.json").exists()


def test_a_request_the_api_would_refuse_is_refused_before_starting(stack: dict[str, Any], tmp_path: Path) -> None:
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "late system"},
                        {"role": "user", "content": "b"}], "max_tokens": 4, "temperature": 0}
    with pytest.raises(InvalidInputError, match=r"requests\[0\]: messages\[1\]: role 'system'"):
        generate_offline(TRAIN_PYTHON, stack["infer"], [bad], work_dir=tmp_path / "work")
    assert not (tmp_path / "work").exists()
