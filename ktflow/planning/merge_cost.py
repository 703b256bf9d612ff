"""What the merge stage costs a host, by output method: time, disk and peak RAM, from a model's size.

The INT4 re-encode (RAWINT4) runs at its own measured per-core rate (``CostModel.merge_int4_bytes_per_core_s``,
one timed merge); the other rates are the closest stages' measured ones (:class:`~ktflow.planning.costs.CostModel`):
writing a BF16 or INT4 checkpoint at the dequantize stage's durable write rate (the same streaming writer; the
merge's float64 product of a rank-r LoRA is small next to the write), and handing experts to kt-kernel's quantizer
at quantize-int8's per-core rate (the same driver, which also merges each expert before quantizing).
"""

from __future__ import annotations

from pydantic import BaseModel

from ktflow.planning.costs import COSTS, CostModel
from ktflow.planning.sizing import ModelSize
from ktflow.units import GB, GiB

_RUNTIME_BYTES = GiB  # python + torch (+ kt-kernel): the merge's own footprint
# What a merge worker holds per parameter of the weight it makes: float64 (the merge), BF16 and float32 (the encoder)
MERGE_WORKER_BYTES_PER_PARAM = 8 + 2 + 4


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
    quant_rate = costs.quantize_bytes_per_core_s * cores
    if method == "BF16":
        disk = expert_bf16 + non_expert_bf16
        seconds = disk / write_rate
        ram = in_flight + _RUNTIME_BYTES
        basis = f"{disk / GB:.0f} GB of BF16 written at {write_rate / GB:.1f} GB/s (dequantize's rate)"
    elif method == "RAWINT4":
        disk = size.stored_bytes
        encode_rate = costs.merge_int4_bytes_per_core_s
        seconds = disk / write_rate + expert_bf16 / (encode_rate * cores)
        ram = in_flight + _RUNTIME_BYTES
        basis = (f"{disk / GB:.0f} GB written at {write_rate / GB:.1f} GB/s (dequantize's rate) + the experts' "
                 f"{expert_bf16 / GB:.0f} GB of BF16 merged and re-encoded as INT4 at {encode_rate / 1e6:.1f} MB/s a "
                 f"core x {cores} (one timed merge: the Kimi-K2.5 slice on a 16-core host)")
    elif method in ("AMXINT8", "AMXINT4"):
        bits = 8 if method == "AMXINT8" else 4
        # per output row one fp32 scale: ~4 bytes per moe_intermediate (or hidden) weights, under 1 %
        experts = size.expert_parameters * bits // 8 + size.expert_parameters // 256
        disk = experts + 2 * non_expert_bf16  # the non-expert checkpoint, and its copy in kt/ as quantize-int8 has it
        seconds = expert_bf16 / quant_rate + 2 * non_expert_bf16 / write_rate
        layer_bf16, layer_quant = expert_bf16 // layers, experts // layers
        ram = layer_bf16 + 2 * layer_quant + _RUNTIME_BYTES
        basis = (f"the experts' {expert_bf16 / GB:.0f} GB of BF16 through kt-kernel's {method} quantizer at "
                 f"{costs.quantize_bytes_per_core_s / GB:.2f} GB/s a core x {cores} (quantize-int8's rate, T="
                 f"{threadpool_count}) + {2 * non_expert_bf16 / GB:.0f} GB of non-expert BF16 written; one MoE layer "
                 "in RAM")
    else:
        raise ValueError(f"unknown merge method {method!r}")
    return MergeEstimate(method=method, seconds=seconds, disk_bytes=int(disk), ram_bytes=int(ram),
                         basis=basis + ("" if method == "RAWINT4" else
                                        "; derived from other stages' measured rates, no merge of this method timed"))
