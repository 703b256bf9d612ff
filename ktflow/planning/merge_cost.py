"""What the merge stage costs a host, by output method: time, disk and peak RAM, from a model's size.

Merging the experts' LoRA into a quantized format (RAWINT4, AMXINT8, AMXINT4) runs at one measured per-core rate
(``CostModel.merge_expert_bytes_per_core_s``: fitted on a RAWINT4 merge, the AMX formats' merges timed at the same
pace); BF16 is priced at the dequantize stage's durable write rate (the same streaming writer; the merge's float64
product of a rank-r LoRA is small next to the write), no BF16 merge of a large model having been timed.
"""

from __future__ import annotations

from pydantic import BaseModel

from ktflow.formats.kt_layout import kt_layer_bytes
from ktflow.planning.costs import COSTS, CostModel
from ktflow.planning.sizing import ModelSize
from ktflow.units import GB, GiB

PROCESS_RUNTIME_BYTES = GiB
"""A merge's or quantize-int8's own process beside the data it holds: python and torch, and kt-kernel where imported
(~0.6 GB), with margin. The stages' RAM checks, their processes' layer budget and the plan count it."""
# What the quantized formats' merge rate rests on (CostModel.merge_expert_bytes_per_core_s), as the plan quotes it
_MERGE_RATE_BASIS = ("fitted on one timed RAWINT4 merge of the Kimi-K2.5 slice; seven more took 0.95-1.62x the "
                     "estimate while the merge read the adapter's header once a weight, one since 0.75x; the AMXINT8 "
                     "and AMXINT4 merges 1.10x and 1.00x")
# What a merge worker holds per parameter of the weight it makes: float64 (the merge), BF16 and float32 (the encoder)
MERGE_WORKER_BYTES_PER_PARAM = 8 + 2 + 4


def kt_quantized_layer_bytes(size: ModelSize, method: str, threadpool_count: int = 1) -> tuple[int, int]:
    """``(BF16, quantized)`` bytes of one MoE layer of ``size``'s routed experts, the quantized as kt-kernel's
    ``method`` (AMXINT8 or AMXINT4) lays them out (:func:`~ktflow.formats.kt_layout.kt_layer_bytes`)."""
    return (2 * size.expert_parameters_per_layer,
            kt_layer_bytes(size.routed_experts, size.hidden_size, size.expert_intermediate_size, threadpool_count,
                           method))


def kt_quantizer_layer_ram(layer_bf16: int, layer_quant: int, *, scratch_in_ram: bool) -> int:
    """RAM kt-kernel's quantizer driver (``ktflow/_drivers/kt_int8.py``: quantize-int8, and the merge into AMXINT8
    or AMXINT4) holds for one MoE layer, beside its runtime: the layer's BF16 experts twice (the driver's buffers,
    and a second copy while kt-kernel quantizes them), the quantized layer, and that again where kt-kernel's scratch
    is a tmpfs. Measured on the Kimi-K2.5 slice's AMXINT4 and AMXINT8 merges: 77.7 and 85.9 GB peak RSS, 1.01x and
    1.00x this with the runtime (RSS does not count a tmpfs)."""
    return 2 * layer_bf16 + layer_quant * (2 if scratch_in_ram else 1)


def kt_quantizer_process_ram(layer_bf16: int, layer_quant: int, kept_layers: int = 0, *, scratch_in_ram: bool) -> int:
    """Peak RAM of one driver process: a layer's working set (:func:`kt_quantizer_layer_ram`), the process's
    runtime, and ``kept_layers`` layers' quantized buffers, which kt-kernel 0.7.2 keeps until the process exits (a
    process of N layers is budgeted at N, its current layer's counted twice for margin; 0: the check before any
    work). The BF16 copies it frees layer by layer: on the CPU box the driver's peak grew by the INT8 layer, 1.00x, a
    layer over 1, 4 and 8 layers (``benchmarks/quantize_int8.py``)."""
    return (kt_quantizer_layer_ram(layer_bf16, layer_quant, scratch_in_ram=scratch_in_ram) + PROCESS_RUNTIME_BYTES
            + kept_layers * layer_quant)


def kt_layers_per_process(ram_available: int, layer_bf16: int, layer_quant: int, *, scratch_in_ram: bool) -> int:
    """How many MoE layers one driver process may quantize before it is restarted: the most whose
    :func:`kt_quantizer_process_ram` fits 80 % of ``ram_available`` (at least one)."""
    room = ram_available * 0.8 - kt_quantizer_process_ram(layer_bf16, layer_quant, scratch_in_ram=scratch_in_ram)
    return max(1, int(room // max(layer_quant, 1)))


class MergeEstimate(BaseModel):
    """One merge of an adapter into ``size``'s model, as ``method`` serves it."""

    method: str
    seconds: float
    disk_bytes: int  # the published output
    ram_bytes: int  # peak
    basis: str


def merge_estimate(size: ModelSize, method: str, cores: int, threadpool_count: int = 1,
                   costs: CostModel = COSTS) -> MergeEstimate:
    """Time, disk and peak RAM of merging into ``size``'s model with output ``method`` on ``cores`` cores.

    Raises:
        ValueError: an unknown method (the merge stage's are BF16, RAWINT4, AMXINT8, AMXINT4).
    """
    cores = max(int(cores), 1)
    layers = max(size.moe_layers, 1)
    expert_bf16 = 2 * size.expert_parameters
    non_expert_bf16 = 2 * size.non_expert_parameters
    embedding = 2 * size.vocab_size * size.hidden_size  # the largest single tensor a worker holds (copied)
    matrix = size.expert_parameters // max(layers * size.routed_experts * 3, 1)  # one expert projection
    # the stage runs a worker a core: the embedding copied (read and written) beside one expert weight a core
    in_flight = 2 * embedding + cores * matrix * MERGE_WORKER_BYTES_PER_PARAM
    write_rate = costs.dequantize_bytes_per_s
    merge_per_core = costs.merge_expert_bytes_per_core_s
    merge_rate = merge_per_core * cores
    if method == "BF16":
        disk = expert_bf16 + non_expert_bf16
        seconds = disk / write_rate
        ram = in_flight + PROCESS_RUNTIME_BYTES
        basis = f"{disk / GB:.0f} GB of BF16 written at {write_rate / GB:.1f} GB/s (dequantize's rate)"
    elif method == "RAWINT4":
        disk = size.stored_bytes
        seconds = disk / write_rate + expert_bf16 / merge_rate
        ram = in_flight + PROCESS_RUNTIME_BYTES
        basis = (f"{disk / GB:.0f} GB written at {write_rate / GB:.1f} GB/s (dequantize's rate) + the experts' "
                 f"{expert_bf16 / GB:.0f} GB of BF16 merged and re-encoded as INT4 at {merge_per_core / 1e6:.1f} MB/s "
                 f"a core x {cores} ({_MERGE_RATE_BASIS})")
    elif method in ("AMXINT8", "AMXINT4"):
        layer_bf16, layer_quant = kt_quantized_layer_bytes(size, method, threadpool_count)
        disk = layers * layer_quant + 2 * non_expert_bf16  # the non-expert checkpoint, and its copy in kt/
        seconds = expert_bf16 / merge_rate + 2 * non_expert_bf16 / write_rate
        # kt-kernel's scratch in /dev/shm, the stage's default where it fits
        ram = kt_quantizer_process_ram(layer_bf16, layer_quant, scratch_in_ram=True)
        basis = (f"the experts' {expert_bf16 / GB:.0f} GB of BF16 merged and quantized by kt-kernel's {method} "
                 f"quantizer (T={threadpool_count}) at {merge_per_core / 1e6:.1f} MB/s a core x {cores} "
                 f"({_MERGE_RATE_BASIS}) + {2 * non_expert_bf16 / GB:.0f} GB of non-expert BF16 written; a MoE "
                 f"layer's BF16 twice in RAM ({layer_bf16 / GB:.0f} GB each) beside its quantized form and "
                 "kt-kernel's scratch of it in /dev/shm")
    else:
        raise ValueError(f"unknown merge method {method!r}")
    return MergeEstimate(method=method, seconds=seconds, disk_bytes=int(disk), ram_bytes=int(ram),
                         basis=basis + ("; derived from another stage's measured rate, no merge of this method timed"
                                        if method == "BF16" else ""))
