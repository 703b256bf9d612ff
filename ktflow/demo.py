"""The CPU demo's inputs: a tiny Kimi-K2.5-format checkpoint and a small, distinctive dataset.

The dataset teaches a recognisable style (answers that end with "nya~", after the seeds' NekoQA
example), so base and tuned outputs differ visibly even on a model this small.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from ktflow.fixtures.checkpoints import FixtureSpec
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
    from ktflow.fixtures.checkpoints import make_fixture

    if model_dir.exists():
        shutil.rmtree(model_dir)
    make_fixture(DEMO_MODEL, model_dir)
    atomic_write_bytes(record, spec.encode())
    return True

# Every answer carries the style the demo teaches (", nya~"). The evaluation questions are not
# in the training data, in any letter case, spacing or punctuation (ktflow.stages.contamination checks
# that at every run): the demo measures whether the style carries to prompts the model has not
# seen, not whether it memorized its training answers.
TRAIN_TOPICS: tuple[tuple[str, str], ...] = (
    ("What is a mixture of experts?", "Many small experts, a few per token"),
    ("Where do the experts run with KTransformers?", "On the CPU, beside the GPU"),
    ("Why dequantize INT4 weights?", "Some trainers need BF16 weights"),
    ("What does LoRA train?", "Small low-rank matrices"),
    ("What serves the tuned model?", "An OpenAI-compatible server"),
    ("Why quantize experts to INT8?", "To halve their memory"),
    ("What is a shard?", "One file of a big checkpoint"),
    ("What does the router do?", "It picks the experts for each token"),
    ("What is a token?", "A small piece of text"),
    ("What is a learning rate?", "How far each step moves the weights"),
    ("What is an adapter?", "A few weights that change the model"),
    ("Why use a GPU for attention?", "Attention is dense math"),
    ("What is a checkpoint?", "The weights saved during training"),
    ("What is a prompt?", "The text the model answers"),
    ("What does a tokenizer do?", "It turns text into tokens"),
    ("What is fine-tuning?", "More training on your own data"),
    ("What is a GPU?", "A chip for fast parallel math"),
    ("What is RAM for?", "It holds the weights the CPU reads"),
    ("What is a dataset?", "The examples a model learns from"),
    ("What is inference?", "Running the model to get answers"),
    ("What is a layer?", "One block of the model"),
    ("What is a weight?", "A number the model learned"),
    ("What is attention?", "How tokens look at each other"),
    ("What is a server?", "A program that answers requests"),
)
EVAL_TOPICS: tuple[tuple[str, str], ...] = (
    ("How many experts does each token use?", "Only a few of them"),
    ("What is BF16?", "A 16-bit float format"),
    ("Why keep the base weights frozen?", "So training stays cheap"),
    ("What is a loss curve?", "The loss plotted step by step"),
    ("What does an epoch mean?", "One pass over the data"),
    ("Where are the weights stored?", "In safetensors files"),
    ("What is an API key for?", "It keeps strangers out"),
    ("What is a batch?", "A few examples at once"),
)
STYLE_MARKER = "nya~"
"""What every demo answer carries; the demo's evaluation scores its share on unseen prompts."""


def _chat(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question},
                         {"role": "assistant", "content": f"{answer}, {STYLE_MARKER}"}]}


def demo_records(n: int, seed: int) -> list[dict]:
    """``n`` training chat records in OpenAI messages format, deterministic for a seed.

    They cycle through :data:`TRAIN_TOPICS`, about half of the questions in lower case.
    """
    rng = random.Random(seed)
    records = []
    for i in range(n):
        question, answer = TRAIN_TOPICS[i % len(TRAIN_TOPICS)]
        records.append(_chat(question.lower() if rng.random() < 0.5 else question, answer))
    return records


def demo_eval_records(n: int = len(EVAL_TOPICS)) -> list[dict]:
    """``n`` evaluation records cycling through :data:`EVAL_TOPICS`, none of them trained on."""
    return [_chat(*EVAL_TOPICS[i % len(EVAL_TOPICS)]) for i in range(n)]


def write_demo_dataset(data_dir: Path, *, train: int = 48, eval: int = len(EVAL_TOPICS)) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` unless they already hold exactly this demo's records.

    An older demo's files (whose evaluation questions were its training questions) are replaced;
    identical files are left untouched (the data hash is the SFT cache key).
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, records in (("train.jsonl", demo_records(train, seed=0)), ("eval.jsonl", demo_eval_records(eval))):
        path = data_dir / name
        text = "".join(json.dumps(r) + "\n" for r in records).encode()
        if not path.is_file() or path.read_bytes() != text:
            atomic_write_bytes(path, text)
        paths.append(path)
    return paths[0], paths[1]
