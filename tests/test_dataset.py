"""Tests of ktflow.formats.dataset: record validation, the prepared copy, its digest, and LlamaFactory's view of it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ktflow.errors import DatasetError
from ktflow.formats.dataset import (
    BadRecord,
    PreparedDataset,
    dataset_digest,
    prepare_dataset,
    validate_dataset,
)
from ktflow.recipe import DatasetConfig

TRAIN_PYTHON = Path(__file__).resolve().parents[1] / ".venv-train" / "bin" / "python"

GOOD_ALPACA = {"instruction": "Say hi", "input": "", "output": "hi"}
GOOD_OPENAI = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
GOOD_SHAREGPT = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
GOOD = {"alpaca": GOOD_ALPACA, "openai": GOOD_OPENAI, "sharegpt": GOOD_SHAREGPT}


def write_lines(path: Path, lines: list[Any]) -> Path:
    """A JSONL file: dicts are dumped, strings written as they are (for malformed lines)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def config(files: list[Path], fmt: str = "alpaca", name: str = "demo", **kwargs: Any) -> DatasetConfig:
    return DatasetConfig(name=name, files=files, format=fmt, **kwargs)


def bad_records(cfg: DatasetConfig) -> tuple[DatasetError, list[BadRecord]]:
    with pytest.raises(DatasetError) as info:
        validate_dataset(cfg)
    return info.value, info.value.bad_records  # type: ignore[attr-defined]


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def assistant(content: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


# --------------------------------------------------------------------------- bad records

# (format, the bad line, the reason it must be reported with)
BAD_CASES: dict[str, tuple[str, Any, str]] = {
    "malformed-json": ("alpaca", '{"instruction": "x", "output": }', "malformed JSON: Expecting value"),
    "not-an-object": ("alpaca", [1, 2], "not a JSON object (got an array)"),
    "empty-conversation": ("openai", {"messages": []}, "empty conversation"),
    "only-system": ("openai", {"messages": [{"role": "system", "content": "s"}]}, "empty conversation"),
    "unknown-role-openai": ("openai", {"messages": [user("hi"), {"role": "bot", "content": "x"}]},
                            'messages[1]: unknown role "bot"'),
    "unknown-role-sharegpt": ("sharegpt", {"conversations": [{"from": "human", "value": "hi"},
                                                             {"from": "robot", "value": "x"}]},
                              'conversations[1]: unknown role "robot"'),
    "not-alternating-openai": ("openai", {"messages": [user("a"), user("b"), assistant("c")]},
                               "roles do not alternate: messages[1] is 'user'"),
    "not-alternating-sharegpt": ("sharegpt", {"conversations": [{"from": "gpt", "value": "a"},
                                                                {"from": "human", "value": "b"}]},
                                 "roles do not alternate: conversations[0] is 'gpt'"),
    "tool-without-call": ("openai", {"messages": [user("a"), {"role": "tool", "content": "r"}, assistant("c")]},
                          "roles do not alternate: messages[1] is 'tool'"),
    "system-not-first": ("openai", {"messages": [user("a"), {"role": "system", "content": "s"}, assistant("c")]},
                         "messages[1]: a system message is only allowed first"),
    "last-not-assistant": ("openai", {"messages": [user("a"), assistant("b"), user("c")]},
                           "the last message must be the assistant's: messages[2] is 'user'"),
    "empty-content": ("openai", {"messages": [user("a"), assistant("  ")]}, "empty content: messages[1]"),
    "empty-output": ("alpaca", {"instruction": "a", "output": ""}, "empty content: 'output' is empty"),
    "missing-output": ("alpaca", {"instruction": "a", "input": "b"}, "missing required key 'output'"),
    "missing-instruction": ("alpaca", {"input": "a", "output": "b"}, "missing required key 'instruction'"),
    "missing-messages": ("openai", {"conversation": []}, "missing required key 'messages'"),
    "output-wrong-type": ("alpaca", {"instruction": "a", "output": 3}, "'output' must be a string (got a number)"),
    "content-wrong-type": ("openai", {"messages": [user({"text": "a"}), assistant("b")]},
                           "messages[0]: 'content' must be a string or a list of parts (got an object)"),
    "sharegpt-value-wrong-type": ("sharegpt", {"conversations": [{"from": "human", "value": ["a"]},
                                                                 {"from": "gpt", "value": "b"}]},
                                  "conversations[0]: 'value' must be a string (got an array)"),
    "missing-image": ("openai", {"messages": [user([{"type": "image_url", "image_url": {"url": "nope.png"}},
                                                   {"type": "text", "text": "what?"}]), assistant("x")]},
                      "messages[0].content[0]: image file not found"),
    "remote-image": ("openai", {"messages": [user([{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]),
                                             assistant("x")]}, "only local image files are supported"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_each_bad_record_kind_is_reported_with_its_line(tmp_path: Path, case: str) -> None:
    fmt, bad_line, reason = BAD_CASES[case]
    # A good record, a blank line (still counted), then the bad one: line 3.
    path = write_lines(tmp_path / "data.jsonl", [GOOD[fmt], "", bad_line])
    error, bad = bad_records(config([path], fmt))
    assert len(bad) == 1
    assert (bad[0].file, bad[0].line) == (str(path), 3)
    assert reason in bad[0].reason
    assert f"{path}:3: " in str(error)
    assert error.exit_code == 2


def test_empty_file_is_reported(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    good = write_lines(tmp_path / "good.jsonl", [GOOD_ALPACA])
    error, bad = bad_records(config([good, empty]))
    assert [(b.file, b.line) for b in bad] == [(str(empty), 0)]
    assert f"{empty}: the file is empty" in str(error)


def test_json_array_records_are_numbered_by_index(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text(json.dumps([GOOD_ALPACA, GOOD_ALPACA, {"instruction": "a"}], indent=2))
    error, bad = bad_records(config([path]))
    assert [(b.line, b.unit) for b in bad] == [(3, "record")]
    assert f"{path}:record 3: missing required key 'output'" in str(error)


def test_malformed_json_array_reports_the_line_of_the_error(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "a" "output": "b"}\n]\n')
    _, bad = bad_records(config([path]))
    assert [(b.line, b.unit) for b in bad] == [(3, "line")]
    assert "malformed JSON" in bad[0].reason


def test_all_bad_records_of_all_files_are_listed(tmp_path: Path) -> None:
    first = write_lines(tmp_path / "a.jsonl", [
        GOOD_OPENAI,
        {"messages": [user("a"), user("b")]},
        "{not json",
        GOOD_OPENAI,
        {"messages": [user("a"), assistant("")]},
    ])
    second = write_lines(tmp_path / "b.jsonl", [{"messages": []}, GOOD_OPENAI])
    error, bad = bad_records(config([first, second], "openai"))
    assert [(Path(b.file).name, b.line) for b in bad] == [("a.jsonl", 2), ("a.jsonl", 3), ("a.jsonl", 5), ("b.jsonl", 1)]
    assert "4 bad records" in str(error)
    for b in bad:
        assert str(b) in str(error)


def test_the_listing_is_capped_at_20(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "a.jsonl", [{"instruction": f"q{i}"} for i in range(25)])
    error, bad = bad_records(config([path]))
    assert len(bad) == 25
    message = str(error)
    assert f"{path}:20: " in message and f"{path}:21: " not in message
    assert "and 5 more" in message


def test_a_bad_dataset_writes_nothing(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "src" / "a.jsonl", [GOOD_ALPACA, {"instruction": "x"}])
    out_root = tmp_path / "out"
    out_root.mkdir()
    with pytest.raises(DatasetError, match="a.jsonl:2: missing required key 'output'"):
        prepare_dataset(config([path]), out_root / "prepared", template="qwen")
    assert list(out_root.iterdir()) == []  # neither the directory nor a staging leftover


def test_unsupported_and_missing_files_are_config_errors(tmp_path: Path) -> None:
    csv = tmp_path / "data.csv"
    csv.write_text("instruction,output\na,b\n")
    with pytest.raises(DatasetError, match=r"unsupported file type \.csv.*use \.jsonl or \.json") as info:
        validate_dataset(config([csv, tmp_path / "missing.jsonl"]))
    assert "missing.jsonl: no such file" in str(info.value)


def test_columns_and_tags_must_fit_the_format(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "a.jsonl", [GOOD_ALPACA])
    with pytest.raises(DatasetError, match="columns.messages: not a column of format alpaca"):
        validate_dataset(config([path], columns={"messages": "m"}))
    with pytest.raises(DatasetError, match="tags: only format sharegpt has tags"):
        validate_dataset(config([path], tags={"role_tag": "role"}))


# --------------------------------------------------------------------------- good data


def test_valid_records_are_counted_across_jsonl_and_json_files(tmp_path: Path) -> None:
    jsonl = write_lines(tmp_path / "a.jsonl", [GOOD_ALPACA, GOOD_ALPACA])
    array = tmp_path / "b.json"
    array.write_text(json.dumps([GOOD_ALPACA] * 3))
    assert validate_dataset(config([jsonl, array])) == 5


def test_tool_turns_are_accepted_where_llamafactory_accepts_them(tmp_path: Path) -> None:
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}},
    ]}
    record = {"messages": [user("weather?"), call, {"role": "tool", "content": "sunny"},
                           {"role": "tool", "content": "rainy"}, assistant("Sunny and rainy.")],
              "tools": [{"type": "function", "function": {"name": "weather", "parameters": {}}}]}
    path = write_lines(tmp_path / "a.jsonl", [record])
    assert validate_dataset(config([path], "openai")) == 1
    prepared = prepare_dataset(config([path], "openai"), tmp_path / "out", template="qwen")
    (written,) = json.loads((prepared.dataset_dir / prepared.entry["file_name"]).read_text())
    roles = [m["role"] for m in written["messages"]]
    assert roles == ["user", "function_call", "tool", "assistant"]
    # Arguments are objects, not OpenAI's JSON strings (LlamaFactory would encode them twice).
    assert json.loads(written["messages"][1]["content"]) == [
        {"name": "weather", "arguments": {"city": "Paris"}}, {"name": "weather", "arguments": {"city": "Rome"}}
    ]
    assert written["messages"][2]["content"] == "sunny\n</tool_response>\n<tool_response>\nrainy"
    assert json.loads(written["tools"])[0]["function"]["name"] == "weather"


def test_alpaca_is_copied_with_canonical_keys(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "a.jsonl", [
        {"question": "Add", "context": "1+1", "answer": "2", "sys": "Be exact."},
        {"question": "Say hi", "answer": "hi"},
    ])
    cfg = config([path], columns={"prompt": "question", "query": "context", "response": "answer", "system": "sys"})
    prepared = prepare_dataset(cfg, tmp_path / "out", template="qwen")
    assert isinstance(prepared, PreparedDataset) and prepared.records == 2
    info = json.loads((prepared.dataset_dir / "dataset_info.json").read_text())
    assert info == {"demo": prepared.entry}
    assert prepared.entry["formatting"] == "alpaca"
    assert prepared.entry["columns"]["prompt"] == "instruction" and prepared.entry["columns"]["response"] == "output"
    records = json.loads((prepared.dataset_dir / prepared.entry["file_name"]).read_text())
    assert records[0] == {"instruction": "Add", "input": "1+1", "output": "2", "system": "Be exact.",
                          "history": [], "tools": "", "images": []}
    assert records[1]["input"] == "" and records[1]["system"] == ""


def test_openai_image_parts_become_placeholders_and_absolute_paths(tmp_path: Path) -> None:
    images = tmp_path / "imgs"
    images.mkdir()
    (images / "cat.png").write_bytes(b"png")
    (tmp_path / "dog.png").write_bytes(b"png")
    record = {"messages": [
        {"role": "system", "content": "Be brief."},
        user([{"type": "image_url", "image_url": {"url": "cat.png"}},
              {"type": "text", "text": "What is this?"}, {"type": "text", "text": "And this?"},
              {"type": "image", "image": f"file://{tmp_path / 'dog.png'}"}]),
        assistant([{"type": "text", "text": "A cat and a dog."}]),
    ]}
    path = write_lines(tmp_path / "data" / "a.jsonl", [record])
    prepared = prepare_dataset(config([path], "openai", images_dir=images), tmp_path / "out", template="qwen")
    (written,) = json.loads((prepared.dataset_dir / prepared.entry["file_name"]).read_text())
    assert written["messages"][1] == {"role": "user", "content": "<image>What is this?\nAnd this?<image>"}
    assert written["messages"][2] == {"role": "assistant", "content": "A cat and a dog."}
    assert written["images"] == [str(images / "cat.png"), str(tmp_path / "dog.png")]
    assert prepared.entry["columns"]["messages"] == "messages" and prepared.entry["columns"]["images"] == "images"
    assert prepared.entry["formatting"] == "sharegpt" and prepared.entry["tags"]["role_tag"] == "role"


def test_relative_images_resolve_against_the_data_file_without_images_dir(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "cat.png").write_bytes(b"png")
    record = {"conversations": [{"from": "human", "value": "<image>What?"}, {"from": "gpt", "value": "A cat."}],
              "images": ["cat.png"]}
    path = write_lines(tmp_path / "data" / "a.jsonl", [record])
    prepared = prepare_dataset(config([path], "sharegpt"), tmp_path / "out", template="qwen")
    (written,) = json.loads((prepared.dataset_dir / prepared.entry["file_name"]).read_text())
    assert written["images"] == [str(tmp_path / "data" / "cat.png")]
    # A placeholder count that does not match the images is caught before LlamaFactory's mm_plugin.
    record["images"] = ["cat.png", "cat.png"]
    write_lines(path, [record])
    _, bad = bad_records(config([path], "sharegpt"))
    assert "2 image(s) but 1 '<image>' placeholder(s)" in bad[0].reason


# --------------------------------------------------------------------------- template empty


@pytest.fixture()
def kimi_dir(fixture_dir: Callable[..., Path]) -> Path:
    return fixture_dir("kimi-k2.5")


def test_template_empty_renders_with_the_models_chat_template(tmp_path: Path, kimi_dir: Path) -> None:
    record = {"messages": [{"role": "system", "content": "Be brief."}, user("hi"), assistant("hello"),
                           user("and again?"), assistant("hello again")]}
    path = write_lines(tmp_path / "a.jsonl", [record])
    prepared = prepare_dataset(config([path], "openai"), tmp_path / "out", template="empty", model_dir=kimi_dir)
    assert prepared.entry["columns"] == {"prompt": "instruction", "response": "output"}
    assert prepared.entry["formatting"] == "alpaca"
    (written,) = json.loads((prepared.dataset_dir / prepared.entry["file_name"]).read_text())
    assert written["instruction"].startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi")
    assert written["instruction"].endswith("<|im_start|>user\nand again?<|im_end|>\n<|im_start|>assistant\n")
    assert written["output"] == "hello again<|im_end|>\n"


def test_template_empty_needs_a_model_and_refuses_images(tmp_path: Path, kimi_dir: Path) -> None:
    (tmp_path / "cat.png").write_bytes(b"png")
    path = write_lines(tmp_path / "a.jsonl", [GOOD_OPENAI, {"messages": [
        user([{"type": "image", "image": "cat.png"}, {"type": "text", "text": "what?"}]), assistant("a cat")]}])
    cfg = config([path], "openai")
    with pytest.raises(DatasetError, match="template 'empty': needs the model directory"):
        prepare_dataset(cfg, tmp_path / "out", template="empty")
    with pytest.raises(DatasetError, match=r"a.jsonl:2: has 1 image\(s\), but template 'empty'"):
        prepare_dataset(cfg, tmp_path / "out", template="empty", model_dir=kimi_dir)
    assert not (tmp_path / "out").exists()


def test_template_empty_rejects_a_template_that_does_not_render_incrementally(
    tmp_path: Path, kimi_dir: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(kimi_dir, model)
    # A generation prompt that the rendering of the answered conversation does not contain.
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(
        template.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
    )
    path = write_lines(tmp_path / "a.jsonl", [GOOD_OPENAI])
    with pytest.raises(DatasetError, match="a.jsonl:1: the model's chat template does not render incrementally"):
        prepare_dataset(config([path], "openai"), tmp_path / "out", template="empty", model_dir=model)


# --------------------------------------------------------------------------- digest and reuse


def test_digest_is_stable_and_follows_every_input(tmp_path: Path, kimi_dir: Path) -> None:
    records = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(5)]
    path = write_lines(tmp_path / "a.jsonl", records)
    cfg = config([path])
    first = dataset_digest(cfg, template="qwen")
    assert dataset_digest(cfg, template="qwen") == first
    assert list(tmp_path.iterdir()) == [path]  # the digest writes nothing
    prepared = prepare_dataset(cfg, tmp_path / "out", template="qwen")
    assert prepared.digest == first

    assert dataset_digest(cfg, template="llama3") != first
    empty = dataset_digest(cfg, template="empty", model_dir=kimi_dir)
    assert empty != first
    # The chat template is part of the digest for template empty.
    model = tmp_path / "model"
    shutil.copytree(kimi_dir, model)
    with open(model / "chat_template.jinja", "a") as f:
        f.write("{# changed #}")
    assert dataset_digest(cfg, template="empty", model_dir=model) != empty

    records[3]["output"] = "a3!"
    write_lines(path, records)
    assert dataset_digest(cfg, template="qwen") != first


def test_a_prepared_dir_is_reused_and_replaced_when_the_data_changes(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "a.jsonl", [GOOD_ALPACA])
    cfg = config([path])
    out = tmp_path / "out"
    first = prepare_dataset(cfg, out, template="qwen")
    assert not first.reused
    data_file = out / first.entry["file_name"]
    stamp = data_file.stat().st_mtime_ns
    again = prepare_dataset(cfg, out, template="qwen")
    assert again.reused and again.digest == first.digest and again.records == 1
    assert data_file.stat().st_mtime_ns == stamp  # not rewritten

    write_lines(path, [GOOD_ALPACA, {"instruction": "new", "output": "record"}])
    changed = prepare_dataset(cfg, out, template="qwen")
    assert not changed.reused and changed.digest != first.digest and changed.records == 2
    assert len(json.loads(data_file.read_text())) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "out"]  # no staging leftovers


def test_a_foreign_out_dir_is_never_replaced(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "a.jsonl", [GOOD_ALPACA])
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(DatasetError, match="not a dataset prepared by ktflow"):
        prepare_dataset(config([path]), out, template="qwen")
    assert (out / "notes.txt").read_text() == "mine"


# --------------------------------------------------------------------------- LlamaFactory accepts it

# Runs in the training venv: loads each prepared dataset with LlamaFactory 0.9.5's own code.
# "tokenize": get_dataset() with the template and the fixture's tokenizer (what training runs);
# "align": get_dataset_list() + _load_single_dataset() (file loading, column/tag mapping and
# media path handling, but no tokenization: a text-only tokenizer cannot take images).
LLAMAFACTORY_CHECK = textwrap.dedent("""
    import json, sys, tempfile
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer
    from llamafactory.data import get_template_and_fix_tokenizer, get_dataset
    from llamafactory.data.loader import _load_single_dataset
    from llamafactory.data.parser import get_dataset_list
    results = []
    for spec in json.loads(sys.argv[1]):
        args = dict(model_name_or_path=spec["model"], stage="sft", do_train=True, finetuning_type="lora",
                    dataset=spec["name"], dataset_dir=spec["dir"], template=spec["template"], cutoff_len=4096,
                    output_dir=tempfile.mkdtemp(), overwrite_cache=True, report_to="none", trust_remote_code=True)
        model_args, data_args, training_args, _, _ = get_train_args(args)
        if spec["mode"] == "align":
            (attr,) = get_dataset_list([spec["name"]], spec["dir"])
            ds = _load_single_dataset(attr, model_args, data_args, training_args)
            results.append({"n": len(ds), "first": dict(ds[0]), "last": dict(ds[len(ds) - 1])})
            continue
        tokenizer_module = load_tokenizer(model_args)
        tokenizer = tokenizer_module["tokenizer"]
        template = get_template_and_fix_tokenizer(tokenizer, data_args)
        ds = get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)
        ds = ds["train_dataset"]
        first = ds[0]
        prompt = [t for t, label in zip(first["input_ids"], first["labels"]) if label == -100]
        response = [label for label in first["labels"] if label != -100]
        results.append({"n": len(ds), "prompt": tokenizer.decode(prompt), "response": tokenizer.decode(response)})
    print("RESULT " + json.dumps(results))
""")


def run_llamafactory(specs: list[dict[str, Any]], cache: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [str(TRAIN_PYTHON), "-c", LLAMAFACTORY_CHECK, json.dumps(specs)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.slow
def test_llamafactory_loads_every_prepared_form(tmp_path: Path, kimi_dir: Path) -> None:
    if not TRAIN_PYTHON.exists():
        pytest.skip(f"the training venv ({TRAIN_PYTHON.parent.parent}) is not installed")
    (tmp_path / "cat.png").write_bytes(b"png")
    alpaca = write_lines(tmp_path / "alpaca.jsonl", [
        {"question": "Say hi", "answer": "hi"}, {"question": "Add", "ctx": "1+1", "answer": "2"}])
    sharegpt = write_lines(tmp_path / "sharegpt.jsonl", [
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "hi"},
                           {"from": "gpt", "value": "hello"}]},
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
                           {"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}]}])
    openai_text = write_lines(tmp_path / "openai.jsonl", [
        {"messages": [user("weather?"), {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "content": "sunny"}, assistant("Sunny.")]},
        GOOD_OPENAI])
    openai_image = write_lines(tmp_path / "openai-image.jsonl", [
        {"messages": [{"role": "system", "content": "Be brief."},
                      user([{"type": "text", "text": "What is this?"},
                            {"type": "image_url", "image_url": {"url": "cat.png"}}]), assistant("A cat.")]},
        GOOD_OPENAI])
    # The first 10 MB of records have no history, a later one has: JSON Lines would make the
    # `datasets` loader type the column list<null> from the first block and fail on that record.
    padding = [{"instruction": "x" * 500, "output": "y"}] * 21000
    late_list = write_lines(tmp_path / "late.jsonl", [*padding, {"instruction": "q", "output": "a",
                                                                "history": [["h1", "h2"]]}])

    def prep(name: str, path: Path, fmt: str, template: str, **kwargs: Any) -> PreparedDataset:
        model_dir = kimi_dir if template == "empty" else None
        cfg = config([path], fmt, name=name, **kwargs)
        return prepare_dataset(cfg, tmp_path / "prepared" / name, template=template, model_dir=model_dir)

    prepared = [
        prep("alpaca", alpaca, "alpaca", "qwen", columns={"prompt": "question", "query": "ctx", "response": "answer"}),
        prep("sharegpt", sharegpt, "sharegpt", "qwen"),
        prep("openai", openai_text, "openai", "qwen"),
        prep("empty", openai_text, "openai", "empty"),
        prep("image", openai_image, "openai", "qwen"),
        prep("late", late_list, "alpaca", "qwen"),
    ]
    modes = ["tokenize"] * 4 + ["align"] * 2
    specs = [{"model": str(kimi_dir), "name": p.name, "dir": str(p.dataset_dir), "template": t, "mode": m}
             for p, t, m in zip(prepared, ["qwen", "qwen", "qwen", "empty", "qwen", "qwen"], modes)]
    alpaca_r, sharegpt_r, openai_r, empty_r, image_r, late_r = run_llamafactory(specs, tmp_path / "hf-datasets")

    assert alpaca_r["n"] == 2
    assert alpaca_r["prompt"].endswith("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n")
    assert alpaca_r["response"] == "hi<|im_end|>\n"
    assert sharegpt_r["n"] == 2
    assert sharegpt_r["prompt"] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert sharegpt_r["response"] == "hello<|im_end|>\n"
    assert openai_r["n"] == 2
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>' in openai_r["response"]
    assert "<tool_response>\nsunny\n</tool_response>" in openai_r["prompt"]
    # Template empty: LlamaFactory adds nothing to what the model's template rendered.
    empty_records = json.loads((prepared[3].dataset_dir / "empty.json").read_text())
    assert empty_r["n"] == 2
    assert empty_r["prompt"] == empty_records[0]["instruction"]
    assert empty_r["response"] == empty_records[0]["output"] == "Sunny.<|im_end|>\n"
    assert image_r["n"] == 2
    assert image_r["first"]["_prompt"] == [{"role": "user", "content": "What is this?<image>"}]
    assert image_r["first"]["_response"] == [{"role": "assistant", "content": "A cat."}]
    assert image_r["first"]["_system"] == "Be brief."
    assert image_r["first"]["_images"] == [str(tmp_path / "cat.png")]
    assert image_r["last"]["_images"] is None
    assert late_r["n"] == len(padding) + 1
    assert late_r["last"]["_prompt"][:2] == [{"role": "user", "content": "h1"}, {"role": "assistant", "content": "h2"}]
