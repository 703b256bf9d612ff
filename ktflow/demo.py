"""The CPU demo's inputs: a tiny Kimi-K2.5-format checkpoint and a small, distinctive dataset.

The dataset teaches a recognisable style (answers that end with "nya~", after the seeds' NekoQA
example), so base and tuned outputs differ visibly even on a model this small.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from ktflow.fixtures import FixtureSpec
from ktflow.store import atomic_write_bytes

DEMO_MODEL = FixtureSpec(kind="kimi-k2.5", lm_head_std=0.2)
"""The demo's tiny Kimi-K2.5-format checkpoint: random, with an lm_head LoRA can steer (see FixtureSpec)."""


def ensure_demo_model(model_dir: Path) -> bool:
    """Make the demo checkpoint in ``model_dir`` unless the one there was made from :data:`DEMO_MODEL`.

    The spec it was made from is recorded beside it (``<model_dir>.fixture.json``): a checkpoint
    from another spec (an older ktflow's demo) is replaced, so the demo never trains a model it
    was not tuned for. Returns whether a checkpoint was made.
    """
    record = model_dir.with_name(model_dir.name + ".fixture.json")
    spec = DEMO_MODEL.model_dump_json()
    if (model_dir / "config.json").exists() and record.is_file() and record.read_text(encoding="utf-8") == spec:
        return False
    from ktflow.fixtures import make_fixture

    if model_dir.exists():
        shutil.rmtree(model_dir)
    make_fixture(DEMO_MODEL, model_dir)
    atomic_write_bytes(record, spec.encode())
    return True

_TOPICS = [
    ("What is a mixture of experts?", "Many small expert networks; a router picks a few per token"),
    ("Where do the experts run with KTransformers?", "On the CPU, while attention runs on the GPU"),
    ("Why dequantize INT4 weights?", "Some kernels and trainers need BF16 weights"),
    ("What does LoRA train?", "Small low-rank matrices beside the frozen weights"),
    ("What serves the tuned model?", "An OpenAI-compatible server with the adapter loaded"),
    ("Why quantize experts to INT8?", "To halve the memory the CPU experts need"),
    ("What is a shard?", "One file of a checkpoint that is split into many"),
    ("What does the router do?", "It scores the experts and sends each token to the best few"),
]


def demo_records(n: int, seed: int) -> list[dict]:
    """``n`` chat records in OpenAI messages format, deterministic for a seed."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        question, answer = _TOPICS[i % len(_TOPICS)]
        if rng.random() < 0.5:
            question = question.lower()
        records.append({"messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": f"{answer}, nya~"},
        ]})
    return records


def write_demo_dataset(data_dir: Path, *, train: int = 48, eval: int = 8) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` (kept if already there: the data hash is the cache key)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, n, seed in (("train.jsonl", train, 0), ("eval.jsonl", eval, 1)):
        path = data_dir / name
        if not path.exists():
            text = "".join(json.dumps(r) + "\n" for r in demo_records(n, seed))
            atomic_write_bytes(path, text.encode())
        paths.append(path)
    return paths[0], paths[1]
