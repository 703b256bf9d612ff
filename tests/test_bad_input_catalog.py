"""The bad-input catalog: every kind of wrong input a user can hand ktflow, one row each.

Each row of :data:`CATALOG` is a :class:`Case`: an id, the area it belongs to (recipe,
checkpoint, dataset, adapter, environment), a builder that makes the bad input under the test's
own directory and returns the call a user would make (a ``ktflow`` command, run as a
subprocess; or, where the bad fact is about the host and cannot be made real, the engine
function with a constructed :class:`~ktflow.host.hardware.HostInfo`), the substrings that must name
the thing that is wrong (field, file, tensor, record line) and the substrings of the fix.

For every row :func:`test_bad_input_is_refused_cleanly` asserts:

- exit code 2 (an :class:`~ktflow.errors.InvalidInputError` for engine calls), no traceback,
  no "internal error";
- the message names the thing and carries the fix;
- no heavy work started: the training toolchain handed to ``ktflow sft`` is a sentinel whose
  ``llamafactory-cli``/``accelerate`` record that they were launched, and the call is fast;
- nothing published: no new ``manifest.json`` and no ``*.partial`` staging directory holding
  data anywhere under the test's directory (the one exception: ``ktflow sft`` first references
  its *local* source checkpoint, ``store/weights/local-*``, a pointer to the directory the user
  named, not a copy), and no ``out`` directory.

A row with ``xfail`` documents a known gap whose fix lies in a module this suite's author could
not change; it is strict, so fixing the engine turns it into a failure until the mark goes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_convert_lora import make_kt_adapter
from test_dequantize import corrupt_header_offsets, corrupt_missing_companion, corrupt_scale_dtype, corrupt_truncate

from ktflow.errors import HostRequirementError, InvalidInputError
from ktflow.host.hardware import GpuInfo, HostInfo, NumaNode
from ktflow.recipe import load_recipe

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
MAX_SECONDS = 60  # a refusal is a header/config check; anything near this did real work
GOOD_RECORD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


# --------------------------------------------------------------------------- the table's types


@dataclass(frozen=True)
class Cli:
    """``ktflow ARGV...`` in a subprocess (cwd: the test's directory), with extra environment."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Engine:
    """An engine call that must raise ``error`` (for host facts that are constructed, not real)."""

    call: Callable[[], Any]
    error: type[InvalidInputError] = InvalidInputError


@dataclass(frozen=True)
class Case:
    id: str
    area: str  # recipe | checkpoint | dataset | adapter | environment
    build: Callable[[World], Cli | Engine]
    subject: tuple[str, ...]  # substrings naming the field / file / tensor / record line
    fix: tuple[str, ...]  # substrings of the fix
    xfail: str | None = None


@dataclass
class World:
    """The test's directory and the helpers builders make their bad inputs with."""

    tmp: Path
    fixture_dir: Callable[..., Path]

    @property
    def store(self) -> Path:
        return self.tmp / "store"

    @property
    def out(self) -> Path:
        return self.tmp / "out"

    @property
    def launched(self) -> Path:
        return self.tmp / "LAUNCHED"

    def copy_fixture(self, kind: str, name: str = "src", **dims: int) -> Path:
        dst = self.tmp / name
        shutil.copytree(self.fixture_dir(kind, **dims), dst)
        return dst

    def write(self, name: str, text: str) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return path

    def jsonl(self, name: str, lines: list[Any]) -> Path:
        return self.write(name, "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))

    def train_toolchain(self) -> Path:
        """A training toolchain whose launchers only record that they were started."""
        bin_dir = self.tmp / "toolchain" / "bin"
        if not bin_dir.exists():
            bin_dir.mkdir(parents=True)
            (bin_dir / "python").symlink_to(sys.executable)
            for tool in ("llamafactory-cli", "accelerate"):
                script = bin_dir / tool
                script.write_text(f"#!/bin/sh\necho \"$0 $*\" >> '{self.launched}'\nexit 3\n")
                script.chmod(0o755)
        return bin_dir / "python"

    def sft(self, *sets: str, recipe: str = "tiny-demo.yaml", env: Mapping[str, str] | None = None,
            data: Path | None = None) -> Cli:
        """``ktflow sft RECIPE`` for real (not --dry-run) on the tiny BF16 fixture, with the sentinel toolchain."""
        data = data or self.jsonl("data/train.jsonl", [GOOD_RECORD] * 4)
        base = [
            "source.repo_id=null", f"source.local_path={self.fixture_dir('bf16')}", "source.format=bf16",
            f"dataset.files=[{data}]", f"evaluation.files=[{data}]", f"store.root={self.store}",
            f"toolchains.train.python={self.train_toolchain()}",
        ]
        if recipe == "tiny-demo.yaml":
            base.append("sft.template=default")  # no tokenizer load: the data check is what is tested
        argv = ["sft", str(RECIPES / recipe)]
        for item in (*base, *sets):
            argv += ["--set", item]
        return Cli(tuple(argv), env or {})


def recipe_cli(recipe: str, *sets: str) -> Callable[[World], Cli]:
    """``ktflow sft RECIPE --dry-run --set ...``: validation only; a recipe that passed would print and exit 0."""
    def build(w: World) -> Cli:
        argv = ["sft", str(RECIPES / recipe) if "/" not in recipe else recipe, "--dry-run"]
        for item in sets:
            argv += ["--set", item]
        return Cli(tuple(argv))
    return build


def recipe_file(text: str) -> Callable[[World], Cli]:
    def build(w: World) -> Cli:
        return Cli(("sft", str(w.write("bad.yaml", text)), "--dry-run"))
    return build


# --------------------------------------------------------------------------- checkpoint builders


def _qc_weights(src: Path) -> tuple[dict, dict]:
    config = json.loads((src / "config.json").read_text())
    qc = (config.get("text_config") or config)["quantization_config"]
    return config, qc


def edited_config(kind: str, edit: Callable[[dict], None], command: str = "inspect") -> Callable[[World], Cli]:
    """A copy of fixture ``kind`` whose quantization_config ``edit`` changes; then ``ktflow COMMAND``."""
    def build(w: World) -> Cli:
        src = w.copy_fixture(kind)
        config, qc = _qc_weights(src)
        edit(qc)
        (src / "config.json").write_text(json.dumps(config, indent=2))
        return Cli(("inspect", str(src)) if command == "inspect" else ("dequantize", str(src), str(w.out)))
    return build


def _int4_weights(qc: dict) -> dict:
    return qc["config_groups"]["group_0"]["weights"]


def corrupted(kind: str, corrupt: Callable[[Path], str], command: str) -> Callable[[World], Cli]:
    def build(w: World) -> Cli:
        src = w.copy_fixture(kind)
        corrupt(src)
        if command == "inspect":
            return Cli(("inspect", str(src)))
        return Cli(("dequantize", str(src), str(w.out), "--workers", "1"))
    return build


def _missing_shard(src: Path) -> str:
    shard = sorted(src.glob("model-*.safetensors"))[-1]
    shard.unlink()
    return shard.name


def _nan_scale(src: Path) -> str:
    index = json.loads((src / "model.safetensors.index.json").read_text())
    victim = next(k for k in index["weight_map"] if k.endswith(".weight_scale"))
    shard = src / index["weight_map"][victim]
    tensors = load_file(shard)
    tensors[victim] = tensors[victim].clone()
    tensors[victim].view(-1)[0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    return victim


def _index_names_absent_tensor(src: Path) -> str:
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.layers.1.mlp.experts.99.up_proj.weight_packed"] = shard
    index_path.write_text(json.dumps(index))
    return shard


def _header_length_beyond_file(src: Path) -> str:
    shard = sorted(src.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[:8] = (len(data) * 4).to_bytes(8, "little")
    shard.write_bytes(bytes(data))
    return shard.name


# --------------------------------------------------------------------------- dataset builders


def bad_data(*lines: Any, suffix: str = ".jsonl", images: bool = False) -> Callable[[World], Cli]:
    """``ktflow sft`` on the tiny BF16 model with a training file holding a good record, then ``lines``."""
    def build(w: World) -> Cli:
        data = w.jsonl(f"data/train{suffix}", [GOOD_RECORD, *lines])
        return w.sft(data=data)
    return build


def _openai(*messages: tuple[str, Any]) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in messages]}


# --------------------------------------------------------------------------- adapter builders


def _plain_peft(peft: dict, experts: dict, config: dict) -> None:
    """A plain PEFT adapter (no KT wrapper names) on the MLA projections."""
    for key in [k for k in peft if "orig_module" in k]:
        peft.pop(key)


def convert(mutate: Callable[[dict, dict, dict], None] | None = None, *, fused: bool = True, manifest: bool = True,
            edit: Callable[[Path, World], None] | None = None, base_dims: Mapping[str, int] | None = None,
            serve_python: Callable[[World], Path] | None = None) -> Callable[[World], Cli]:
    """``ktflow convert-lora ADAPTER OUT --base BASE`` on a KT-style adapter (test_convert_lora's builder)."""
    def build(w: World) -> Cli:
        base = w.fixture_dir("bf16")
        trained_on = w.fixture_dir("bf16", **base_dims) if base_dims else base
        adapter = make_kt_adapter(trained_on, w.tmp / "adapter", mutate=mutate, fused=fused, manifest=manifest)
        if edit:
            edit(adapter, w)
        python = serve_python(w) if serve_python else REPO / ".venv-serve" / "bin" / "python"
        return Cli(("convert-lora", str(adapter), str(w.out), "--base", str(base), "--serve-python", str(python)))
    return build


def _rank_4(peft: dict, experts: dict, config: dict) -> None:
    key = next(k for k in peft if "layers.1.self_attn.q_a_proj.lora_A" in k)
    peft[key] = torch.zeros(4, peft[key].shape[1])


def _drop_a_lora_b(peft: dict, experts: dict, config: dict) -> None:
    peft.pop(next(k for k in peft if "layers.1.self_attn.kv_b_proj.lora_B" in k))


def _link_out(name: str) -> Callable[[Path, World], None]:
    """Move ``name`` out of the adapter and leave a symlink to it."""
    def edit(adapter: Path, w: World) -> None:
        outside = w.tmp / "elsewhere" / name
        outside.parent.mkdir(exist_ok=True)
        (adapter / name).rename(outside)
        (adapter / name).symlink_to(outside)
    return edit


def _flip_last_byte(adapter: Path, w: World) -> None:
    path = adapter / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------- environment builders


def _host(**update: Any) -> HostInfo:
    """A roomy AMX host with 8 GPUs; cases shrink the one fact they are about."""
    gib = 1 << 30
    host = HostInfo(
        hostname="catalog", cpu_model="test", cpu_flags=[], cpu_variant="amx", cpu_variant_overridden=False,
        logical_cores=64, physical_cores=32, numa_nodes=1,
        numa=[NumaNode(id=0, cpus=list(range(64)), mem_total_bytes=1024 * gib, mem_free_bytes=1000 * gib)],
        ram_bytes=1024 * gib, ram_available_bytes=1000 * gib,
        gpus=[GpuInfo(index=i, name="test GPU", vram_bytes=80 * gib) for i in range(8)],
        disk_path="/store", disk_free_bytes=10_000 * gib, shm_bytes=64 * gib, shm_free_bytes=64 * gib,
    )
    return host.model_copy(update=update)


def run_sft_on(host_update: Mapping[str, Any], recipe: str = "tiny-demo.yaml", *sets: str) -> Callable[[World], Engine]:
    """``run_sft`` (the stage ``ktflow sft`` runs) on a constructed host lacking one resource."""
    def build(w: World) -> Engine:
        from ktflow.stages.sft import run_sft

        cli = w.sft(*sets, recipe=recipe)
        overrides = [a for a in cli.argv[2:] if a != "--set"]
        loaded = load_recipe(RECIPES / recipe, overrides)
        model = w.fixture_dir("bf16")
        return Engine(lambda: run_sft(loaded, model_dir=model, host=_host(**host_update)), HostRequirementError)
    return build


def run_sft_on_a_full_store(w: World) -> Engine:
    """``run_sft`` where the store's filesystem reports no free space (the preflight measures it)."""
    engine = run_sft_on({})(w)

    def run() -> Any:
        with mock.patch("ktflow.store.free_bytes", lambda path: 0):
            return engine.call()

    return Engine(run, engine.error)


def _stub_toolchain(package: str, version: str) -> Callable[[World], Path]:
    """A toolchain python whose installed ``package`` distribution is ``version`` (a dist-info on its path)."""
    def make(w: World) -> Path:
        site = w.tmp / "old-toolchain" / "site"
        dist = site / f"{package.replace('-', '_')}-{version}.dist-info"
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        python = w.tmp / "old-toolchain" / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(f"#!/bin/sh\nPYTHONPATH='{site}' exec '{sys.executable}' \"$@\"\n")
        python.chmod(0o755)
        return python
    return make


def _kt_sft(*sets: str, env: Mapping[str, str] | None = None) -> Callable[[World], Cli]:
    return lambda w: w.sft(*sets, recipe="qwen3-30b-a3b-bf16.yaml", env=env)


# --------------------------------------------------------------------------- the catalog

FIX_RECIPE = "change the field(s) named above"
REFETCH = "re-download"

CATALOG: list[Case] = [
    # ---- recipes: unknown keys, wrong types, impossible combinations (ktflow sft --dry-run)
    Case("recipe-unknown-key-typo", "recipe", recipe_cli("tiny-demo.yaml", "sft.lora_rnk=8"),
         ("sft.lora_rnk: unknown key",), ("did you mean 'sft.lora_rank'",)),
    Case("recipe-unknown-key-from-another-tool", "recipe", recipe_cli("tiny-demo.yaml", "sft.gradient_checkpointing=true"),
         ("sft.gradient_checkpointing: unknown key",), ("disable_gradient_checkpointing",)),
    Case("recipe-secret-in-recipe", "recipe", recipe_cli("tiny-demo.yaml", "serving.api_key=not-a-real-key-0123456789"),
         ("serving.api_key: unknown key",), ("serving.api_key_env",)),
    Case("recipe-wrong-type-int", "recipe", recipe_cli("tiny-demo.yaml", "sft.lora_rank=eight"),
         ("sft.lora_rank", "'eight'"), ("valid integer", FIX_RECIPE)),
    Case("recipe-wrong-type-section", "recipe", recipe_cli("tiny-demo.yaml", "serving=7"),
         ("serving",), ("valid dictionary", FIX_RECIPE)),
    Case("recipe-batch-the-gpus-cannot-share", "recipe", recipe_cli("qwen3-30b-a3b-bf16.yaml", "sft.gpus=3"),
         ("sft.gpus", "3 GPUs cannot share the batch", "8 records a step"),
         ("set gradient_accumulation_steps to 9", FIX_RECIPE)),
    Case("recipe-port-out-of-range", "recipe", recipe_cli("tiny-demo.yaml", "serving.port=70000"),
         ("serving.port", "70000"), ("less than or equal to 65535",)),
    Case("recipe-missing-section", "recipe",
         recipe_file("name: x\nsource: {local_path: /m, format: bf16}\ndataset: {name: d, files: [a.jsonl], "
                     "format: openai}\nsft: {backend: hf, gpus: 0}\n"),
         ("serving: required field is missing",), ("add it",)),
    Case("recipe-not-a-mapping", "recipe", recipe_file("- name: x\n- source: y\n"),
         ("bad.yaml", "top level (got a list)"), ("start the file with 'name: ...'",)),
    Case("recipe-invalid-yaml", "recipe", recipe_file("name: x\nsft: {backend: hf\n"),
         ("bad.yaml", "not valid YAML"), ("fix the YAML syntax",)),
    Case("recipe-impossible-date", "recipe", recipe_file("name: x\ndescription: 2024-02-30\n"),
         ("bad.yaml", "day is out of range"), ("fix the YAML syntax",)),
    Case("recipe-override-syntax", "recipe", recipe_cli("tiny-demo.yaml", "sft.max_steps"),
         ("--set sft.max_steps",), ("e.g. --set sft.max_steps=10",)),
    Case("recipe-kt-rawint4-rank", "recipe", recipe_cli("kimi-k2.5-rawint4.yaml", "sft.lora_rank=16"),
         ("sft.lora_rank", "got 16"), ("set lora_rank: 8",)),
    Case("recipe-kt-backend-vs-weight-format", "recipe",
         recipe_cli("kimi-k2.5-rawint4.yaml", "sft.kt_config.kt_backend=FP8"),
         ("sft.kt_config.kt_backend", "'FP8'"), ("use kt_backend: RAWINT4",)),
    Case("recipe-kt-rawint4-threadpool", "recipe",
         recipe_cli("kimi-k2.5-rawint4.yaml", "sft.kt_config.kt_tp_enabled=true", "sft.kt_config.kt_threadpool_count=4"),
         ("sft.kt_config.kt_threadpool_count", "got 4"), ("set kt_threadpool_count to 1 or 2",)),
    Case("recipe-int8-threadpool-mismatch", "recipe",
         recipe_cli("kimi-k2.5-bf16-int8.yaml", "conversion.int8_threadpool_count=4"),
         ("conversion.int8_threadpool_count", "4 differs from serving.kt_threadpool_count"),
         ("remove conversion.int8_threadpool_count",)),
    Case("recipe-legacy-and-07-mixed", "recipe", recipe_cli("qwen3-30b-a3b-bf16.yaml", "sft.cpu_infer=32"),
         ("sft", "cpu_infer"), ("Remove them, or set backend: kt-legacy",)),
    Case("recipe-rawint4-serving-on-bf16-source", "recipe",
         recipe_cli("qwen3-30b-a3b-bf16.yaml", "serving.kt_method=RAWINT4"),
         ("serving.kt_method", "source.format is 'bf16'"), ("use AMXINT8 or BF16",)),
    Case("recipe-kt-lora-serving-gpu-experts", "recipe",
         recipe_cli("qwen3-30b-a3b-bf16.yaml", "serving.kt_num_gpu_experts=4"),
         ("serving.kt_num_gpu_experts", "got 4"), ("must be 0",)),
    Case("recipe-name-escapes-the-store", "recipe", recipe_cli("tiny-demo.yaml", "name=../../etc"),
         ("name: '../../etc' is not a plain name",), ("lowercase letters",)),
    Case("recipe-revision-escapes-the-store", "recipe",
         recipe_cli("qwen3-30b-a3b-bf16.yaml", "source.revision=../../../tmp"),
         ("source.revision: '../../../tmp'",), ("use e.g. main, v1.0",)),

    # ---- checkpoints (ktflow inspect / ktflow dequantize)
    Case("checkpoint-truncated-shard", "checkpoint", corrupted("deepseek-v3", corrupt_truncate, "dequantize"),
         ("model-00001-of-", "truncated"), (REFETCH,)),
    Case("checkpoint-header-lies-about-offsets", "checkpoint",
         corrupted("kimi-k2.5", corrupt_header_offsets, "dequantize"), ("model-00001-of-",), (REFETCH,)),
    Case("checkpoint-header-length-beyond-file", "checkpoint",
         corrupted("kimi-k2", _header_length_beyond_file, "inspect"), ("model-00001-of-",), (REFETCH,)),
    Case("checkpoint-missing-shard", "checkpoint", corrupted("kimi-k2", _missing_shard, "inspect"),
         ("model-00003-of-00003.safetensors", "missing shard"), (REFETCH,)),
    Case("checkpoint-index-names-absent-tensor", "checkpoint",
         corrupted("kimi-k2", _index_names_absent_tensor, "inspect"),
         ("experts.99.up_proj.weight_packed", "absent from this shard"), (REFETCH,)),
    Case("checkpoint-missing-companion-scale", "checkpoint",
         corrupted("kimi-k2.5", corrupt_missing_companion, "dequantize"), ("weight_packed", "weight_scale"),
         (REFETCH,)),
    Case("checkpoint-scale-wrong-dtype", "checkpoint", corrupted("kimi-k2.5", corrupt_scale_dtype, "dequantize"),
         ("weight_scale", "F16"), ("not a checkpoint in the format its config declares",)),
    Case("checkpoint-int4-asymmetric", "checkpoint",
         edited_config("kimi-k2.5", lambda qc: _int4_weights(qc).update(symmetric=False), "dequantize"),
         ("config.json", "weights.symmetric is false"), ("use a Kimi K2/K2.5 INT4",)),
    Case("checkpoint-int4-other-group-size", "checkpoint",
         edited_config("kimi-k2", lambda qc: _int4_weights(qc).update(group_size=128)),
         ("config.json", "weights.group_size is 128"), ("use a Kimi K2/K2.5 INT4",)),
    Case("checkpoint-int4-other-bits", "checkpoint",
         edited_config("kimi-k2", lambda qc: _int4_weights(qc).update(num_bits=8)),
         ("config.json", "weights.num_bits is 8"), ("use a Kimi K2/K2.5 INT4",)),
    Case("checkpoint-activation-quantization", "checkpoint",
         edited_config("kimi-k2.5", lambda qc: qc["config_groups"]["group_0"].update(
             input_activations={"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True})),
         ("config.json", "input_activations"), ("use a Kimi K2/K2.5 INT4",)),
    Case("checkpoint-fp8-other-block", "checkpoint",
         edited_config("deepseek-v3", lambda qc: qc.update(weight_block_size=[64, 64]), "dequantize"),
         ("config.json", "weight_block_size is [64, 64]"), ("DeepSeek-V3 FP8",)),
    Case("checkpoint-unknown-quant-method", "checkpoint",
         edited_config("deepseek-v3", lambda qc: qc.update(quant_method="gptq")),
         ("config.json", "quant_method is 'gptq'"), ("convert the checkpoint to BF16 first",)),
    Case("checkpoint-nan-in-scales", "checkpoint", corrupted("kimi-k2", _nan_scale, "dequantize"),
         ("weight_scale", "NaN"), (REFETCH,)),

    # ---- datasets (ktflow sft, for real: validation must stop it before the launch)
    Case("dataset-malformed-json-line", "dataset", bad_data('{"messages": [{"role": "user", "content": "x"}'),
         ("train.jsonl:2", "malformed JSON"), ("fix or remove these records",)),
    Case("dataset-empty-conversation", "dataset", bad_data({"messages": []}),
         ("train.jsonl:2", "empty conversation"), ("fix or remove these records",)),
    Case("dataset-wrong-role", "dataset", bad_data(_openai(("user", "hi"), ("bot", "x"))),
         ("train.jsonl:2", 'messages[1]: unknown role "bot"'), ("fix or remove these records",)),
    Case("dataset-last-turn-not-assistant", "dataset", bad_data(_openai(("user", "a"), ("assistant", "b"), ("user", "c"))),
         ("train.jsonl:2", "the last message must be the assistant's"), ("fix or remove these records",)),
    Case("dataset-missing-image-file", "dataset",
         bad_data({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "nope.png"}},
                                                              {"type": "text", "text": "what?"}]},
                                {"role": "assistant", "content": "x"}]}),
         ("train.jsonl:2", "image file not found"), ("fix or remove these records",)),
    Case("dataset-file-missing", "dataset", lambda w: w.sft(data=w.tmp / "data" / "absent.jsonl"),
         ("absent.jsonl: no such file",), ("fix dataset.files",)),
    Case("dataset-unsupported-file-type", "dataset", bad_data(suffix=".csv"),
         ("train.csv", "unsupported file type .csv"), ("use .jsonl or .json",)),

    # ---- adapters (ktflow convert-lora)
    Case("adapter-rank-mismatch", "adapter", convert(_rank_4),
         ("q_a_proj.lora_A.weight", "rank 4, but adapter_config.json says r=8"), ("trained",)),
    Case("adapter-missing-lora-b", "adapter", convert(_drop_a_lora_b),
         ("kv_b_proj.lora_A.weight", "has no matching lora_B"), ("re-save",)),
    Case("adapter-foreign-base-model", "adapter", convert(base_dims={"hidden": 512}),
         ("self_attn", "base weight"), ("trained on this base",)),
    Case("adapter-tampered-file", "adapter", convert(edit=_flip_last_byte),
         ("adapter_model.safetensors", "sha256"), ("copy the file again",)),
    Case("adapter-fused-without-manifest", "adapter", convert(manifest=False),
         ("kt_adapter_manifest.json", "is missing"), ("checkpoint-N whose kt_adapter_manifest.json exists",)),
    Case("adapter-target-modules-disagree", "adapter",
         convert(lambda p, e, c: c["target_modules"].remove("o_proj")),
         ("adapter_config.json: target_modules", "o_proj"), ("target_modules",)),
    Case("adapter-weights-symlinked-outside", "adapter",
         convert(_plain_peft, fused=False, manifest=False, edit=_link_out("adapter_model.safetensors")),
         ("adapter_model.safetensors", "symbolic link", "outside the adapter directory"),
         ("copy the real file into the adapter directory",)),
    Case("adapter-config-symlinked-outside", "adapter",
         convert(_plain_peft, fused=False, manifest=False, edit=_link_out("adapter_config.json")),
         ("adapter_config.json", "symbolic link"), ("copy the real file into the adapter directory",)),

    # ---- environments (toolchains, CPU ISA, GPUs, threads, RAM, disk)
    Case("env-missing-train-toolchain", "environment",
         lambda w: w.sft("toolchains.train.python=/nonexistent/venv/bin/python"),
         ("toolchains.train.python: /nonexistent/venv/bin/python",), ("make train-env",)),
    Case("env-missing-serve-toolchain", "environment",
         convert(serve_python=lambda w: w.tmp / "no-venv" / "bin" / "python"),
         ("serve_python", "no-venv"), ("make serve-env",)),
    Case("env-wrong-kt-kernel-version", "environment",
         convert(serve_python=_stub_toolchain("kt-kernel", "0.6.1")),
         ("serve_python", "kt-kernel 0.6.1"), ("make serve-env", "0.7")),
    Case("env-cpu-lacks-isa", "environment", _kt_sft(env={"KT_KERNEL_CPU_VARIANT": "avx2"}),
         ("sft", "needs a avx512_bf16 CPU or better", "kt-kernel variant avx2"), ("run this stage on a host",)),
    Case("env-not-enough-gpus", "environment", _kt_sft("sft.gpus=64", "sft.gradient_accumulation_steps=64"),
         ("sft", "sft needs 64 GPU(s)"), ("run this stage on a host",)),
    Case("env-threads-beyond-cores", "environment",
         lambda w: Cli(("doctor", "--recipe", str(RECIPES / "qwen3-30b-a3b-bf16.yaml"), "--json",
                        "--set", "sft.kt_config.kt_num_threads=100000", "--set", f"store.root={w.store}")),
         ("sft.kt_config.kt_num_threads is 100000",), ("lower it",)),
    Case("env-not-enough-ram", "environment", run_sft_on({"ram_bytes": 1 << 20}),
         ("sft", "CPU training needs", "GiB of RAM"), ("use a larger host",)),
    Case("env-numa-node-too-small", "environment",
         run_sft_on({"numa_nodes": 2, "numa": [NumaNode(id=0, cpus=[0], mem_total_bytes=1 << 40, mem_free_bytes=0),
                                               NumaNode(id=1, cpus=[1], mem_total_bytes=1 << 10, mem_free_bytes=0)]},
                    "qwen3-30b-a3b-bf16.yaml", "sft.kt_config.kt_tp_enabled=true",
                    "sft.kt_config.kt_threadpool_count=2"),
         ("sft", "per NUMA node", "node 1 has"), ("use a larger host",)),
    Case("env-not-enough-disk", "environment", run_sft_on_a_full_store,
         ("sft's checkpoints needs", "more on this filesystem", "(0 bytes) free"), ("free disk at the store",)),
]


# --------------------------------------------------------------------------- the test


def _published(root: Path) -> set[str]:
    """What a refusal must not leave under ``root``: manifests (published artifacts) and staging
    directories holding data (a ``.X.partial`` with only ktflow's hidden bookkeeping, e.g. the
    dequantizer's source journal, is tolerated). Local-source references are left out (see above)."""
    found = set()
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("store/weights/local-"):
            continue
        if path.name == "manifest.json":
            found.add(rel)
        elif path.name.endswith(".partial") and path.is_dir():
            data = [p.name for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
            if data:
                found.add(f"{rel} ({', '.join(sorted(data)[:3])})")
    return found


def _params() -> list[Any]:
    return [pytest.param(c, id=c.id, marks=[pytest.mark.xfail(reason=c.xfail, strict=True)] if c.xfail else [])
            for c in CATALOG]


@pytest.mark.parametrize("case", _params())
def test_bad_input_is_refused_cleanly(case: Case, tmp_path: Path, fixture_dir) -> None:
    world = World(tmp_path, fixture_dir)
    call = case.build(world)
    before = _published(tmp_path)
    started = time.monotonic()
    if isinstance(call, Cli):
        done = subprocess.run(
            [sys.executable, "-m", "ktflow.cli", *call.argv], cwd=tmp_path, capture_output=True, text=True,
            timeout=MAX_SECONDS * 2, env={**os.environ, "COLUMNS": "250", "KTFLOW_DEBUG": "", **call.env},
        )
        message = done.stderr + done.stdout
        assert done.returncode == 2, f"exit {done.returncode}, expected 2:\n{message[-3000:]}"
        assert "Traceback" not in message and "internal error" not in message, message[-3000:]
    else:
        with pytest.raises(call.error) as info:
            call.call()
        message = str(info.value)
        assert info.value.exit_code == 2 and info.value.fix, message
    elapsed = time.monotonic() - started

    for text in case.subject:
        assert text in message, f"the message does not name {text!r}:\n{message[-3000:]}"
    for text in case.fix:
        assert text in message, f"the message lacks the fix {text!r}:\n{message[-3000:]}"
    assert not world.launched.exists(), f"a training tool was started: {world.launched.read_text()}"
    assert elapsed < MAX_SECONDS, f"took {elapsed:.0f} s: heavy work was started"
    assert _published(tmp_path) - before == set(), "something was published or left staged"
    assert not world.out.exists(), "an output directory was created"


def test_catalog_covers_every_area_with_unique_ids() -> None:
    ids = [c.id for c in CATALOG]
    assert len(ids) == len(set(ids))
    areas = {c.area for c in CATALOG}
    assert areas == {"recipe", "checkpoint", "dataset", "adapter", "environment"}
    assert len(CATALOG) >= 30
    assert all(c.subject and c.fix for c in CATALOG)
