"""kt-kernel's CPU expert layouts: the two forms AMXINT8 experts take on disk.

- **The shard layout** (what quantize-int8 publishes and kt-kernel's ``SafeTensorLoader`` reads for inference):
  one safetensors shard per MoE layer holding ``blk.{L}.ffn_{gate,up,down}_exps.{E}.numa.{N}.{weight,scale}``
  (the packed INT8 slice and its fp32 row scales), as kt-kernel's ``convert_cpu_weights.py`` writes them.
- **The ``.kt`` layout** (what kt-kernel's ``cpu_save`` writes, and the only form its SFT wrapper, used to serve
  an expert LoRA, reads): ``_layer_L/_numa_N/INT8_{proj}_{E}_{bytes}Byte_{quant|scale}_.kt``, one file a slice.

The intermediate dimension of each expert is split over the ``threadpool_count`` T NUMA slices, so both layouts
depend on T. Imports the standard library only: the drivers (``ktflow/_drivers``) use it inside the tools' own
environments.
"""

from __future__ import annotations

import re
from pathlib import Path

PROJS = ("gate", "up", "down")
MERGED_KT_DIR = "kt"
"""Where a merge to a kt-kernel format keeps its experts (the shard layout), beside its non-expert checkpoint."""
KT_FILE_TAG = "INT8"  # the method tag in kt-kernel's .kt file names
KT_WEIGHT_BITS = {"AMXINT8": 8, "AMXINT4": 4}
"""Bits a weight in each kt-kernel CPU format of the shard layout (AMXINT4: two codes a byte, laid out as AMXINT8)."""
_SHARD_PROJ = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}
SHARD_KEY = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(\d+)\.numa\.(\d+)\.(weight|scale)$")
"""A shard tensor's name: groups layer, projection, expert, NUMA slice, weight|scale."""


def expert_key(layer: int, proj: str, expert: int, numa: int, kind: str) -> str:
    """``blk.{L}.ffn_{proj}_exps.{E}.numa.{N}.{weight|scale}``: one slice's tensor in the shard layout."""
    return f"blk.{layer}.{_SHARD_PROJ[proj]}.{expert}.numa.{numa}.{kind}"


def slice_sizes(proj: str, hidden: int, moe_intermediate: int, threadpool_count: int) -> tuple[int, int]:
    """``(weight bytes, scale count)`` of one expert's projection on one NUMA slice.

    The intermediate dim is split into ``threadpool_count`` slices: gate/up keep ``I/T`` of their
    rows (one fp32 scale per row), down keeps ``I/T`` of its columns (all ``H`` rows, so ``H`` scales).
    """
    n = moe_intermediate // threadpool_count
    if proj == "down":
        return hidden * n, hidden
    return n * hidden, n


def kt_layer_bytes(experts: int, hidden: int, moe_intermediate: int, threadpool_count: int, method: str) -> int:
    """One MoE layer's routed experts in the shard layout as ``method`` stores them: every NUMA slice's codes and
    its fp32 row scales (:func:`slice_sizes`). The one count of a quantized layer's bytes: quantize-int8, the merge
    and the plan all size their disk and RAM with it."""
    total = 0
    for proj in PROJS:
        nbytes, scales = slice_sizes(proj, hidden, moe_intermediate, threadpool_count)
        total += experts * threadpool_count * (nbytes * KT_WEIGHT_BITS[method] // 8 + 4 * scales)
    return total


def kt_layer_sizes(experts: int, hidden: int, moe_intermediate: int, threadpool_count: int,
                   method: str) -> tuple[int, int]:
    """``(BF16, quantized)`` bytes of one MoE layer's routed experts: what a kt-kernel quantizing process reads and
    what it writes (:func:`kt_layer_bytes`)."""
    return experts * 3 * moe_intermediate * hidden * 2, kt_layer_bytes(experts, hidden, moe_intermediate,
                                                                       threadpool_count, method)


def kt_file_name(layer: int, numa: int, proj: str, expert: int, nbytes: int, kind: str) -> str:
    """One slice's file in the ``.kt`` layout, relative to the weight directory:
    ``_layer_L/_numa_N/INT8_{proj}_{E}_{bytes}Byte_{quant|scale}_.kt``."""
    return f"_layer_{layer}/_numa_{numa}/{KT_FILE_TAG}_{proj}_{expert}_{nbytes}Byte_{kind}_.kt"


def has_kt_layout(weight_dir: Path) -> bool:
    """Whether ``weight_dir`` holds ``.kt`` files (what kt-kernel's AMXINT8_SFT reads)."""
    return any(True for layer in Path(weight_dir).glob("_layer_*") for _ in (layer / "_numa_0").glob("*.kt"))


def kt_files_of_layer(layer: int, threadpool_count: int, experts: int, hidden: int,
                      moe_intermediate: int) -> set[str]:
    """Every ``.kt`` file one MoE layer has: each (NUMA slice, expert, projection), quant and scale."""
    files = set()
    for numa in range(threadpool_count):
        for expert in range(experts):
            for proj in PROJS:
                nbytes, scales = slice_sizes(proj, hidden, moe_intermediate, threadpool_count)
                files.add(kt_file_name(layer, numa, proj, expert, nbytes, "quant"))
                files.add(kt_file_name(layer, numa, proj, expert, 4 * scales, "scale"))
    return files
