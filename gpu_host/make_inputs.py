#!/usr/bin/env python3
"""Make the GPU-host run's inputs: two tiny checkpoints and the training records.

- ``dsv3-bf16``: a BF16 DeepSeek-V3-architecture MoE (``ktflow fixture bf16``'s model);
- ``kimi-k25-int4``: the same weights in Kimi-K2.5's native INT4 layout (packed by
  compressed-tensors, as ``ktflow fixture kimi-k2.5``);
- ``data/train.jsonl``: the demo's 48 chat records (answers end in "nya~").

Both models use ``lm_head_std=0.2`` (as the demo model does): at the default 0.02 a random
model's lm_head gives no token a clear margin and a LoRA without lm_head cannot lower the loss
much. Sizes: hidden 256, MoE intermediate 128, 8 experts, 3 layers (layer 0 dense): aligned
for kt-kernel's AMX kernels. Runs here (it needs compressed-tensors); the outputs are small
(~10 MB) and travel to the host with the call.

    .venv/bin/python gpu_host/make_inputs.py [OUT_DIR]   # default build/gpu-host/inputs
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ktflow.demo import write_demo_dataset  # noqa: E402
from ktflow.fixtures import FixtureSpec, make_fixture  # noqa: E402

MODELS = {"dsv3-bf16": FixtureSpec(kind="bf16", lm_head_std=0.2),
          "kimi-k25-int4": FixtureSpec(kind="kimi-k2.5", lm_head_std=0.2)}


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "build" / "gpu-host" / "inputs"
    for name, spec in MODELS.items():
        if not (out / name / "config.json").exists():
            make_fixture(spec, out / name)
            print(f"made {out / name}")
    write_demo_dataset(out / "data", train=48, eval=8)
    print(f"inputs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
