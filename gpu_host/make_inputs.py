#!/usr/bin/env python3
"""Make the GPU-host run's inputs: two tiny checkpoints and the training records.

- ``dsv3-bf16``: a BF16 DeepSeek-V3-architecture MoE (``ktflow fixture bf16``'s model);
- ``kimi-k25-int4``: the same weights in Kimi-K2.5's native INT4 layout (packed by
  compressed-tensors, as ``ktflow fixture kimi-k2.5``);
- ``data/train.jsonl``: 48 chat records over the demo's first 8 questions (answers end in "nya~"), to memorize.

Both models use ``lm_head_std=0.2`` (as the demo model does): at the default 0.02 a random
model's lm_head gives no token a clear margin and a LoRA without lm_head cannot lower the loss
much. Sizes: hidden 256, MoE intermediate 128, 8 experts, 3 layers (layer 0 dense): aligned
for kt-kernel's AMX kernels. Runs here (it needs compressed-tensors); the outputs are small
(~10 MB) and travel to the host with the call.

    .venv/bin/python gpu_host/make_inputs.py [OUT_DIR]   # default build/gpu-host/inputs
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ktflow.demo import STYLE_MARKER, TRAIN_TOPICS  # noqa: E402
from ktflow.fixtures.checkpoints import FixtureSpec, make_fixture  # noqa: E402

MODELS = {"dsv3-bf16": FixtureSpec(kind="bf16", lm_head_std=0.2),
          "kimi-k25-int4": FixtureSpec(kind="kimi-k2.5", lm_head_std=0.2)}


MEMORIZED_TOPICS = 8


def memorized_records(n: int) -> list[dict]:
    """``n`` chat records cycling through the demo's first 8 questions (half in lower case).

    The GPU-host checks train to memorize a small set: in 72 steps the loss falls from ~10 to
    well under 0.5, so "the loss falls" and "the served loss is the trained loss" compare clear
    figures. (The demo's full 24-question set, which its held-out evaluation needs, is not
    memorized in 72 steps: its loss plateaus near 1.4 there, where batch noise exceeds the
    served-loss tolerance.)
    """
    records = []
    for i in range(n):
        question, answer = TRAIN_TOPICS[i % MEMORIZED_TOPICS]
        records.append({"messages": [{"role": "user",
                                      "content": question.lower() if (i // MEMORIZED_TOPICS) % 2 else question},
                                     {"role": "assistant", "content": f"{answer}, {STYLE_MARKER}"}]})
    return records


def write_records(path: Path, records: list[dict]) -> None:
    """Write ``records`` as JSON lines unless ``path`` already holds exactly them (the data hash is SFT's cache key)."""
    text = "".join(json.dumps(r) + "\n" for r in records)
    if path.is_file() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "build" / "gpu-host" / "inputs"
    for name, spec in MODELS.items():
        if not (out / name / "config.json").exists():
            make_fixture(spec, out / name)
            print(f"made {out / name}")
    write_records(out / "data" / "train.jsonl", memorized_records(48))
    print(f"inputs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
