"""The LoRA merge rule: ``W' = bf16(W + (lora_alpha / r) * B @ A)``, one weight at a time.

PEFT's ``merge_and_unload`` computes the same sum (for a linear layer, ``W += scaling * B @ A``).
Here the product and the sum are taken in float64 and rounded once to float32, then to BF16:
a BF16 or float32 LoRA factor times another is exact in float64, and at ranks LoRA uses the sum
of those products is too, so the result does not depend on how a BLAS orders the sum. That makes
the merge bit-identical whichever process computes it: the orchestrator (BF16 and INT4 outputs)
and kt-kernel's driver in the serving toolchain (AMXINT8/AMXINT4 outputs, another torch build).

Imports torch only: the drivers use it inside the tools' environments.
"""

from __future__ import annotations

import torch

_STEP_ELEMENTS = 1 << 19  # rows merged at once: ~4 MB of float64, so the product stays in the CPU cache


def merge_lora_(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """Merge one LoRA into ``weight`` in place and return it.

    Args:
        weight: the base weight ``[out, in]`` (BF16, or float32/float16), contiguous; overwritten.
        lora_a: ``A`` ``[r, in]``; any float dtype.
        lora_b: ``B`` ``[out, r]``; any float dtype.
        scale: ``lora_alpha / r``.
    """
    rows, cols = weight.shape
    a = lora_a.to(torch.float64)
    b = lora_b.to(torch.float64)
    step = max(1, _STEP_ELEMENTS // max(cols, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        delta = b[r0:r1] @ a
        delta.mul_(scale).add_(weight[r0:r1].to(torch.float64))
        weight[r0:r1] = delta.to(torch.float32).to(weight.dtype)
    return weight
